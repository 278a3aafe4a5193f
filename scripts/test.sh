#!/usr/bin/env bash
# test.sh: everything CI runs: setup, two builds and their ctest suites, the fuzzers, the
# time budget.
#
#   setup         scripts/setup.sh, then the qwen0.5b and gemma3 models (scripts/fetch_model.py;
#                 kept and only re-verified once in the cache) for the models_* and
#                 model_split_* real-file tests, and the chat-template corpus
#                 (scripts/fetch_corpus.py: llama.cpp's templates from the llama-cpp-python
#                 sdist, likewise kept) for template_corpus (tests/templates.cmake)
#   build-asan/   -DTANDEM_SANITIZE=ON RelWithDebInfo build (with the CUDA backend where nvcc
#                 is found, compiled for one GPU target, TANDEM_CI_CUDA_ARCHS: 80-real, the
#                 oldest the release build targets; device code that compiles for it compiles
#                 for the newer ones, and the six targets of a release build took nvcc 163 s of
#                 cuda_matmul.cu alone against 34); ctest runs every test but those labelled
#                 ci_release
#   build-rel/    Release build, CUDA off; ctest runs the ci_release tests: those whose time
#                 goes to real models' forward passes (tests/CMakeLists.txt says which and
#                 why; what they run besides the forward pass runs under ASan in smaller tests)
#   build-fuzz/   clang libFuzzer builds of tests/fuzz/fuzz_gguf.c (seeded with the malformed
#                 corpus, tests/ref/make_malformed.py; TANDEM_FUZZ_SECONDS) and the
#                 control-message, YAML config, kvxfer, router-request, grammar and
#                 stage-chain fuzzers, two at a time; the regression inputs in
#                 tests/fuzz/regress/
#   budget        the whole run must end within TANDEM_TEST_BUDGET_S (2400 s: 40 minutes on
#                 the 2-core machine CI runs on; about 23 are used): past it, the run fails and
#                 prints its phases and its 20 slowest tests (docs/contributing.md)
#
# Environment: TANDEM_JOBS (2), TANDEM_TEST_TIMEOUT (seconds per test, 1800),
# TANDEM_FUZZ_SECONDS (60; 0 skips the fuzzers), TANDEM_FUZZ_SECONDS_EACH (20: the other
# fuzzers), TANDEM_TEST_BUDGET_S (2400; 0: no budget), TANDEM_CI_CUDA_ARCHS (80-real; any
# CMAKE_CUDA_ARCHITECTURES value), TANDEM_CORPUS_DIR (the template
# corpus cache, ~/.cache/tandem/corpus), plus setup.sh's TANDEM_VENV / TANDEM_MODELS.
# Ends with "tandem: N passed, M failed" (ctest's tests, each fuzzer and any failed build
# step each count as one) and exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."

JOBS=${TANDEM_JOBS:-2}
TEST_TIMEOUT=${TANDEM_TEST_TIMEOUT:-1800}
FUZZ_SECONDS=${TANDEM_FUZZ_SECONDS:-60}
VENV=${TANDEM_VENV:-$HOME/.cache/tandem/venv}
PY=$VENV/bin/python
export PYTHONDONTWRITEBYTECODE=1
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
# the suite-wide LeakSanitizer suppressions (each entry explained in the file)
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}

passed=0
failed=0
notes=()
phases=() # "name N s" per phase, printed at the end
phase_start=0
phase() { phases+=("$1 $((SECONDS - phase_start)) s"); phase_start=$SECONDS; }
step_failed() { failed=$((failed + 1)); notes+=("$1"); echo "test.sh: FAILED: $1" >&2; }

MODEL=$(bash scripts/setup.sh)
# the Qwen2.5-Coder 0.5B Q4_K_M file for tests/models.cmake: fetched once (PyPI part wheels,
# sha256-pinned), then only verified; without it the models_* tests are not defined, and
# that is counted as a failure here
QWEN05=""
if ! QWEN05=$("$PY" scripts/fetch_model.py --dir "${TANDEM_MODELS:-$HOME/.cache/tandem/models}" \
               qwen0.5b); then
  QWEN05=""
  step_failed "fetch of the qwen0.5b model failed (scripts/fetch_model.py): models_* tests not run"
fi
# Gemma 3 270M Q4_K_M (253 MB): its one KV head replicated across TP ranks (model_split_gemma3_270m)
GEMMA3=""
if ! GEMMA3=$("$PY" scripts/fetch_model.py --dir "${TANDEM_MODELS:-$HOME/.cache/tandem/models}" \
               gemma3); then
  GEMMA3=""
  step_failed "fetch of the gemma3 model failed (scripts/fetch_model.py): model_split_gemma3_270m not run"
fi
# the chat-template corpus for template_corpus (tests/templates.cmake): fetched once (the
# llama-cpp-python sdist, sha256-pinned), then only verified; without it the test is not
# defined, and that is counted as a failure here
CORPUS=""
if ! CORPUS=$("$PY" scripts/fetch_corpus.py --dir "${TANDEM_CORPUS_DIR:-$HOME/.cache/tandem/corpus}"); then
  CORPUS=""
  step_failed "fetch of the template corpus failed (scripts/fetch_corpus.py): template_corpus not run"
fi

# --- the two builds and their ctest suites ------------------------------------------------
# run_ctest DIR LABEL-ARGS...: one ctest run, counted into passed/failed.
# --repeat until-pass:2: a test that fails is run once more, and a test that passes only on
# its second run is listed as flaky (so a flake is seen, never hidden). Known: decode_pd_faults
# over TCP, rarely on a loaded machine: UCX 1.13 aborts the decode leader
# ("ucp_request.inl:346 Fatal: unexpected error: Endpoint timeout" under ucp_put_handler)
# when a killed writer's emulated puts are read after its endpoint failed (kvxfer/README.md).
run_ctest() {
  local dir=$1
  shift
  set +e
  ctest --test-dir "$dir" --output-on-failure --timeout "$TEST_TIMEOUT" -j "$JOBS" \
    --repeat until-pass:2 "$@" 2>&1 | tee "$dir/ctest.log"
  # failed at least once (any run) minus failed in the end = flaky
  grep -oE "Test +#[0-9]+: [A-Za-z0-9_.]+ [.]*\*\*\*(Failed|Timeout|Exception)" "$dir/ctest.log" |
    awk '{print $3}' | sort -u >"$dir/failed-once.txt" || true
  sed -n '/The following tests FAILED/,$p' "$dir/ctest.log" |
    grep -oE "^[[:space:]]+[0-9]+ - [A-Za-z0-9_.]+" | awk '{print $3}' | sort -u \
    >"$dir/failed-final.txt" || true
  local flaky
  flaky=$(comm -23 "$dir/failed-once.txt" "$dir/failed-final.txt" | tr '\n' ' ')
  [ -z "$flaky" ] || notes+=("$dir: flaky (failed once, passed on the retry): $flaky")
  set -e
  # "NN% tests passed, F tests failed out of T"
  local line f t skipped ns
  line=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" "$dir/ctest.log" | tail -n1 || true)
  if [ -z "$line" ]; then
    step_failed "$dir: ctest: no test summary (no tests found?)"
    return
  fi
  f=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/')
  t=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\2/')
  # skipped (ctest SKIP_RETURN_CODE: the gpu label's tests without a GPU) are not passes
  skipped=$(sed -n '/The following tests did not run/,/^$/p' "$dir/ctest.log" |
    grep -oE "[0-9]+ - [A-Za-z0-9_.]+ \(Skipped\)" | awk '{print $3}' | tr '\n' ' ' || true)
  ns=$(echo "$skipped" | wc -w)
  passed=$((passed + t - f - ns))
  failed=$((failed + f))
  [ "$ns" -eq 0 ] || notes+=("$dir: skipped ($ns, each printed its reason): $skipped")
  [ "$f" -eq 0 ] || notes+=("$dir: ctest: $f of $t tests failed")
}

# configure_build DIR CMAKE-ARGS...: 0 when the build tree is usable (configured; build
# errors are counted here and the broken targets' tests fail in ctest)
configure_build() {
  local dir=$1
  shift
  if ! cmake -S . -B "$dir" -DTANDEM_PYTHON="$PY" -DTANDEM_MODEL="$MODEL" \
       -DTANDEM_MODEL_QWEN05="$QWEN05" -DTANDEM_MODEL_GEMMA3="$GEMMA3" \
       -DTANDEM_CORPUS="$CORPUS" "$@"; then
    step_failed "$dir: cmake configure failed"
    return 1
  fi
  # -k: build every target that can be built, so one broken target does not hide the rest
  if ! cmake --build "$dir" -j "$JOBS" -- -k; then
    step_failed "$dir: build errors (tests of the broken targets fail below)"
  fi
  return 0
}

phase "setup"
asan_ok=0
rel_ok=0
configure_build build-asan -DTANDEM_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CUDA_ARCHITECTURES="${TANDEM_CI_CUDA_ARCHS:-80-real}" && asan_ok=1
phase "build-asan"
configure_build build-rel -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=OFF && rel_ok=1
phase "build-rel"
[ "$asan_ok" -eq 0 ] || run_ctest build-asan -LE ci_release
phase "ctest build-asan"
[ "$rel_ok" -eq 0 ] || run_ctest build-rel -L ci_release
phase "ctest build-rel"

# --- fuzzers ----------------------------------------------------------------------------------------
# Each is built with clang's libFuzzer, ASan and UBSan, then run for its seconds with its
# seeds; two run at a time (one per core). Then every crasher kept in tests/fuzz/regress/
# (named gguf-*, ctrl-*, config-*, kvx-*, openai-*, grammar-*, jinja-* or pfwire-*) must run clean
# through its target.
if [ "$FUZZ_SECONDS" -gt 0 ]; then
  EACH=${TANDEM_FUZZ_SECONDS_EACH:-20}
  CTRL_SECONDS=${TANDEM_FUZZ_CTRL_SECONDS:-30}
  FZ_CC=(clang -g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined
         -fno-sanitize-recover=undefined -Wall -Wextra -Werror -Wno-unused-parameter)
  KVX_SRC=(kvxfer/kvx_conn.c kvxfer/kvx_conn_pf.c kvxfer/kvx_conn_put.c kvxfer/kvx_conn_dec.c
           kvxfer/kvx_lookup.c kvxfer/kvx_pipe.c kvxfer/kvx_pipe_fake.c)
  TOK_SRC=(common/tokenizer.c common/tok_pretok.c common/tok_decode.c common/tok_vocab.c
           common/tok_special.c common/tok_unicode.c common/tok_wpm.c common/tok_ugm.c common/gguf.c
           common/td_dtype.c)
  GR_SRC=(grammar/gr_schema.c grammar/gr_match.c grammar/gr_vocab.c grammar/gr_tok.c)
  JN_SRC=(jinja/jn_value.c jinja/jn_lex.c jinja/jn_parse.c jinja/jn_parse_stmt.c jinja/jn_eval.c
          jinja/jn_filters.c jinja/jn_methods.c jinja/jn_chat.c)
  BASE_SRC=(common/td_err.c common/td_clock.c common/td_grow.c)
  mkdir -p build-fuzz/artifacts build-fuzz/ctrl-gen build-fuzz/ctrl-seeds build-fuzz/config-seeds
  for t in gguf ctrl config kvx openai grammar jinja pfwire; do mkdir -p build-fuzz/$t-corpus; done

  # build: two compilers at a time (fuzz_kvx and fuzz_gguf in the background)
  built=()
  "${FZ_CC[@]}" -Icommon -Ikvxfer -Ikvxfer/include tests/fuzz/fuzz_kvx.c "${KVX_SRC[@]}" "${BASE_SRC[@]}" \
    -lpthread -lm -o build-fuzz/fuzz_kvx &
  kvx_build=$!
  "${FZ_CC[@]}" -Icommon tests/fuzz/fuzz_gguf.c common/gguf.c common/td_dtype.c "${BASE_SRC[@]}" \
    -lpthread -lm -o build-fuzz/fuzz_gguf &
  gguf_build=$!
  if wait "$gguf_build" && "$PY" tests/ref/make_malformed.py --out build-fuzz/seeds >&2; then
    built+=(gguf)
  else
    step_failed "fuzz_gguf: build or seed generation failed"
  fi
  # the control-plane envelope decoder; seeds come from the sanitizer build's test_ctrl
  if protoc-c --c_out=build-fuzz/ctrl-gen -Iproto proto/tandem_ctrl.proto &&
     "${FZ_CC[@]}" -Icommon -Ibuild-fuzz/ctrl-gen tests/ctrl/fuzz_ctrl.c common/ctrl_codec.c \
       build-fuzz/ctrl-gen/tandem_ctrl.pb-c.c "${BASE_SRC[@]}" -lprotobuf-c -lpthread -lm \
       -o build-fuzz/fuzz_ctrl &&
     build-asan/bin/test_ctrl --seeds build-fuzz/ctrl-seeds >&2; then
    built+=(ctrl)
  else
    step_failed "fuzz_ctrl: build or seed generation failed"
  fi
  if "${FZ_CC[@]}" -Icommon tests/fuzz/fuzz_config.c common/config.c common/config_util.c common/config_yaml.c \
       "${BASE_SRC[@]}" -lyaml -lpthread -lm -o build-fuzz/fuzz_config; then
    built+=(config)
  else
    step_failed "fuzz_config: build failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Irouter -Igrammar/include -Ijinja/include -Ibuild-fuzz/ctrl-gen tests/fuzz/fuzz_openai.c \
       router/rt_openai.c router/rt_format.c router/rt_chat.c router/rt_reason.c router/rt_toolfmt.c \
       router/rt_buf.c "${GR_SRC[@]}" "${JN_SRC[@]}" "${TOK_SRC[@]}" "${BASE_SRC[@]}" -ljansson \
       -lpthread -lm -o build-fuzz/fuzz_openai &&
     "$PY" tests/ref/make_synth.py --out build-fuzz/tiny.gguf --arch llama --tiny >/dev/null; then
    built+=(openai)
    export TD_FUZZ_MODEL=$PWD/build-fuzz/tiny.gguf # the tokenizer and chat template
  else
    step_failed "fuzz_openai: build or model generation failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Igrammar/include tests/fuzz/fuzz_grammar.c "${GR_SRC[@]}" "${TOK_SRC[@]}" \
       "${BASE_SRC[@]}" -ljansson -lpthread -lm -o build-fuzz/fuzz_grammar; then
    built+=(grammar)
  else
    step_failed "fuzz_grammar: build failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Ijinja/include tests/fuzz/fuzz_jinja.c "${JN_SRC[@]}" "${TOK_SRC[@]}" \
       "${BASE_SRC[@]}" -ljansson -lpthread -lm -o build-fuzz/fuzz_jinja; then
    built+=(jinja)
  else
    step_failed "fuzz_jinja: build failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Iprefill-node tests/fuzz/fuzz_pfwire.c prefill-node/pf_wire.c \
       "${BASE_SRC[@]}" -lpthread -lm -o build-fuzz/fuzz_pfwire; then
    built+=(pfwire)
  else
    step_failed "fuzz_pfwire: build failed"
  fi
  if wait "$kvx_build"; then
    built+=(kvx)
  else
    step_failed "fuzz_kvx: build failed"
  fi
  cp deploy/*.yaml tests/fuzz/seeds-config/* build-fuzz/config-seeds/
  phase "fuzz builds"

  # fuzz_one T: runs fuzz_T for its seconds; its exit status goes to build-fuzz/fuzz_T.rc
  fuzz_one() {
    local t=$1 secs=$EACH seeds=tests/fuzz/seeds-$1 extra=()
    case "$t" in
      gguf) secs=$FUZZ_SECONDS seeds=build-fuzz/seeds extra=(-dict=tests/fuzz/gguf.dict) ;;
      ctrl) secs=$CTRL_SECONDS seeds=build-fuzz/ctrl-seeds ;;
      config) seeds=build-fuzz/config-seeds ;;
    esac
    echo "test.sh: fuzzing fuzz_$t for ${secs}s" >&2
    local rc=0
    build-fuzz/fuzz_$t -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 "${extra[@]}" \
      -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 \
      build-fuzz/$t-corpus "$seeds" >build-fuzz/fuzz_$t.log 2>&1 || rc=$?
    echo "$rc" >build-fuzz/fuzz_$t.rc
  }
  # the longest first, then at most JOBS at once
  for t in "${built[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    rm -f build-fuzz/fuzz_$t.rc
    fuzz_one "$t" &
  done
  wait || true
  for t in "${built[@]}"; do
    if [ "$(cat build-fuzz/fuzz_$t.rc 2>/dev/null)" = 0 ]; then
      grep -E "stat::number_of_executed_units|Done [0-9]+ runs" build-fuzz/fuzz_$t.log >&2 || true
      echo "fuzz_$t: passed" >&2
      passed=$((passed + 1))
    else
      tail -n 60 build-fuzz/fuzz_$t.log >&2
      step_failed "fuzz_$t: crash or error (see build-fuzz/fuzz_$t.log and build-fuzz/artifacts/)"
    fi
  done
  # regression inputs: each must run clean through the (fixed) code it once crashed
  reg_bad=()
  for f in tests/fuzz/regress/*; do
    [ -f "$f" ] || continue
    t=$(basename "$f" | cut -d- -f1)
    if [ ! -x "build-fuzz/fuzz_$t" ] ||
       ! "build-fuzz/fuzz_$t" "$f" >build-fuzz/regress.log 2>&1; then
      tail -n 30 build-fuzz/regress.log >&2
      reg_bad+=("$(basename "$f")")
    fi
  done
  if [ "${#reg_bad[@]}" -eq 0 ]; then
    echo "fuzz_regress: passed" >&2
    passed=$((passed + 1))
  else
    step_failed "fuzz_regress: ${reg_bad[*]} (tests/fuzz/regress/)"
  fi
  phase "fuzzing"
fi

# --- the time budget -----------------------------------------------------------------------
# slowest_tests N: the N slowest tests of both ctest runs, "seconds name (build)"
slowest_tests() {
  for d in build-asan build-rel; do
    [ -f "$d/ctest.log" ] || continue
    grep -oE "Test +#[0-9]+: [A-Za-z0-9_.]+ [.]* *[A-Za-z*]+[A-Za-z ]* +[0-9.]+ sec" "$d/ctest.log" |
      awk -v d="$d" '{print $(NF-1), $3, "(" d ")"}'
  done | sort -rn | head -n "$1"
}
BUDGET=${TANDEM_TEST_BUDGET_S:-2400}
echo "test.sh: phases: $(IFS=,; echo "${phases[*]}" | sed 's/,/, /g'); total ${SECONDS} s" >&2
if [ "$BUDGET" -gt 0 ] && [ "$SECONDS" -gt "$BUDGET" ]; then
  echo "test.sh: the 20 slowest tests:" >&2
  slowest_tests 20 | sed 's/^/test.sh:   /' >&2
  step_failed "the suite took ${SECONDS} s, over its budget of ${BUDGET} s (TANDEM_TEST_BUDGET_S; docs/contributing.md, \"The test budget\")"
fi

for n in "${notes[@]+"${notes[@]}"}"; do echo "test.sh: $n"; done
echo "tandem: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
