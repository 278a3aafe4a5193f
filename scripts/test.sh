#!/usr/bin/env bash
# test.sh: everything CI runs: setup, the sanitizer build and its ctest suite, the GGUF fuzzer.
#
#   build-asan/   -DTANDEM_SANITIZE=ON RelWithDebInfo build; ctest with a per-test timeout
#   build-fuzz/   clang libFuzzer build of tests/fuzz/fuzz_gguf.c, seeded with the malformed
#                 corpus (tests/ref/make_malformed.py), run for TANDEM_FUZZ_SECONDS
#
# Environment: TANDEM_JOBS (2), TANDEM_TEST_TIMEOUT (seconds per test, 1800),
# TANDEM_FUZZ_SECONDS (60; 0 skips the fuzzer), plus setup.sh's TANDEM_VENV / TANDEM_MODELS.
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

# --- sanitizer build and ctest -------------------------------------------------------------
if cmake -S . -B build-asan -DTANDEM_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DTANDEM_PYTHON="$PY" -DTANDEM_MODEL="$MODEL"; then
  # -k: build every target that can be built, so one broken target does not hide the rest
  if ! cmake --build build-asan -j "$JOBS" -- -k; then
    step_failed "build-asan: build errors (tests of the broken targets fail below)"
  fi
  set +e
  ctest --test-dir build-asan --output-on-failure --timeout "$TEST_TIMEOUT" -j "$JOBS" \
    2>&1 | tee build-asan/ctest.log
  set -e
  # "NN% tests passed, F tests failed out of T"
  line=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" build-asan/ctest.log | tail -n1 || true)
  if [ -n "$line" ]; then
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/')
    t=$(echo "$line" | sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\2/')
    passed=$((passed + t - f))
    failed=$((failed + f))
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
       tests/fuzz/fuzz_gguf.c common/gguf.c common/td_dtype.c common/td_err.c \
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
       common/td_err.c -lprotobuf-c -lpthread -lm -o build-fuzz/fuzz_ctrl &&
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
fi

for n in "${notes[@]+"${notes[@]}"}"; do echo "test.sh: $n"; done
echo "tandem: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
