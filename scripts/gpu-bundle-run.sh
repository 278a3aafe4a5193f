#!/bin/bash
# The device side of scripts/gpu-bundle.sh (copied there as run.sh): runs the GPU checks
# from a bundle, in the repository checkout that holds it.
#   unit      test_elem, test_cuda (TANDEM_CUDA_SYNC=1: every op checked as it runs),
#             test_engine_device
#   parity    tests/gpu/test_gpu_parity.py on every model of m/ (MODELS: names without .gguf)
#   serve     tests/gpu/test_gpu_serve.py (SERVE_MODELS, default model or qwen2;
#             SERVE_ARGS=--bench adds the load runs)
#   bench     tandem bench-engine --backend cuda (BENCH_MODELS, BATCHES), then one run with
#             TANDEM_CUDA_PROFILE=1 (per-op times)
#   sanitize  compute-sanitizer memcheck on a short generate (SAN_MODELS)
# Every step prints "=== rc=N" lines; the exit status is 1 if any failed.
set +e
G=$(cd "$(dirname "$0")" && pwd)
cd "$G/.."
[ -d "$G/lib" ] || tar xJf "$G/libs.tar.xz" -C "$G"
nvidia-smi -L
dirs=""
for n in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
  p=$(ldconfig -p | awk -v n="$n" '$1==n {print $NF; exit}')
  [ -n "$p" ] || p=$(find /usr/local /opt /usr/lib -name "$n" 2>/dev/null | head -1)
  echo "lib $n: ${p:-MISSING}"
  [ -n "$p" ] && dirs="$dirs:$(dirname "$p")"
done
LIBS="$G/lib$dirs"
# wrappers: the binaries with their libraries (children, e.g. the nodes of `tandem up`,
# inherit LD_LIBRARY_PATH; the python tests do not need it)
mkdir -p "$G/w"
for b in "$G"/bin/*; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$LIBS" "$b" > "$G/w/$(basename "$b")"
  chmod +x "$G/w/$(basename "$b")"
done
W=$G/w
M=$G/m
all=$(cd "$M" && ls *.gguf | sed 's/\.gguf$//' | grep -v '^split-qwen2$' | tr '\n' ' ')
default=qwen2
[ -f "$M/model.gguf" ] && default=model
status=0
run() {
  echo "=== $*"
  timeout 600 "$@"
  local rc=$?
  echo "=== rc=$rc: $1 $2"
  [ $rc -eq 0 ] || [ $rc -eq 77 ] || status=1  # 77: skipped (no usable GPU)
}
for s in ${*:-unit parity serve sanitize}; do
  case $s in
  unit)
    run "$W/test_elem"
    TANDEM_CUDA_SYNC=1 run "$W/test_cuda"
    run "$W/test_engine_device" "$M/split-qwen2.gguf"
    ;;
  parity)
    for m in ${MODELS:-$all}; do
      run python3 tests/gpu/test_gpu_parity.py --tandem "$W/tandem" --model "$M/$m.gguf"
    done
    ;;
  serve)
    for m in ${SERVE_MODELS:-$default}; do
      # shellcheck disable=SC2086
      run python3 tests/gpu/test_gpu_serve.py --tandem "$W/tandem" --model "$M/$m.gguf" $SERVE_ARGS
    done
    ;;
  bench)
    for m in ${BENCH_MODELS:-$default}; do
      for b in ${BATCHES:-16 64}; do
        run "$W/tandem" bench-engine --backend cuda --model "$M/$m.gguf" --batch "$b" --reps 2
      done
      TANDEM_CUDA_PROFILE=1 run "$W/tandem" bench-engine --backend cuda --model "$M/$m.gguf" \
        --batch "${PROFILE_BATCH:-64}" --reps 1 --gen 64
    done
    ;;
  sanitize)
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for m in ${SAN_MODELS:-$default gemma3}; do
      run env LD_LIBRARY_PATH="$LIBS" "$CS" --error-exitcode 9 "$G/bin/tandem" generate \
        --backend cuda --model "$M/$m.gguf" --max-tokens 8 --temperature 0 --ids \
        --prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
    done
    ;;
  *) echo "gpu-bundle run.sh: unknown step '$s'" >&2; status=1 ;;
  esac
done
[ $status -eq 0 ] && echo "=== all steps passed" || echo "=== some steps FAILED"
exit $status
