#!/usr/bin/env bash
# gpu-bundle.sh: builds the CUDA backend on this machine and packs what a GPU machine needs
# to run the GPU checks without this project's build dependencies: a machine with the
# NVIDIA driver, the CUDA 13 runtime and cuBLAS, and python3 with numpy (e.g. a CUDA
# container image). scripts/test-gpu.sh is the path on a GPU machine that can build.
#
# DIR (default .gpu, git-ignored through .git/info/exclude) gets: bin/ (tandem, the node
# binaries, test_cuda, test_engine_device, test_elem), libs.tar.xz (their shared libraries
# other than glibc's and CUDA's), m/ (the synthetic test models, and --model FILE as
# m/model.gguf) and run.sh (scripts/gpu-bundle-run.sh). Copy DIR into a checkout of the
# same commit on the GPU machine (the python tests come from tests/gpu/) and run
#   bash DIR/run.sh [unit] [parity] [serve] [bench] [sanitize]
# Environment: TANDEM_CUDA_ARCH (default 90: Hopper), TANDEM_PYTHON (default the venv of
# scripts/setup.sh, for the synthetic models).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=""
if [ "${1:-}" = --model ]; then
  MODEL=$2
  shift 2
fi
DIR=${1:-.gpu}
case $DIR in
*/* | "") echo "gpu-bundle.sh: DIR must be a folder name in the repository root" >&2; exit 2 ;;
esac
PY=${TANDEM_PYTHON:-${TANDEM_VENV:-$HOME/.cache/tandem/venv}/bin/python}
[ -x "$PY" ] || { bash scripts/setup.sh >/dev/null; }
if [ "$DIR" = .gpu ] && [ -d .git ]; then
  mkdir -p .git/info
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
fi
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${TANDEM_CUDA_ARCH:-90}" -DTANDEM_PYTHON="$PY" >/dev/null
BINS="tandem tandem-decode tandem-router tandem-prefill test_cuda test_engine_device test_elem"
# shellcheck disable=SC2086
cmake --build build-gpu -j "${TANDEM_JOBS:-$(nproc)}" --target $BINS
rm -rf "$DIR/bin" "$DIR/m" "$DIR/lib" "$DIR/libs.tar.xz"
mkdir -p "$DIR/bin" "$DIR/m"
for b in $BINS; do cp build-gpu/bin/$b "$DIR/bin/"; done
# shared libraries: everything ldd finds except glibc's, the compiler runtime's and CUDA's
# (those come with the GPU machine's driver and toolkit)
stage=$(mktemp -d)
mkdir -p "$stage/lib/ucx"
for b in $BINS; do ldd build-gpu/bin/$b; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so|ld-linux|cuda|cublas|nccl' |
  xargs -r -I{} cp -L {} "$stage/lib/"
# UCX loads its transports from <libdir>/ucx: shared memory (cma) is the one a test uses
cp -P /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so* "$stage/lib/ucx/" 2>/dev/null || true
tar cJf "$DIR/libs.tar.xz" -C "$stage" lib
rm -rf "$stage"
PYTHONDONTWRITEBYTECODE=1 "$PY" tests/ref/make_synth.py --suite "$DIR/m" >/dev/null
# the shapes tests/model.cmake gives them
PYTHONDONTWRITEBYTECODE=1 "$PY" tests/ref/make_synth.py --out "$DIR/m/split-kquant.gguf" \
  --arch qwen2 --types kquant --n-ff 768 --seed 13 >/dev/null
PYTHONDONTWRITEBYTECODE=1 "$PY" tests/ref/make_synth.py --out "$DIR/m/split-qwen2.gguf" \
  --arch qwen2 --types mixed --seed 11 >/dev/null
rm -f "$DIR/m/llama-f32.gguf" "$DIR/m/llama.expect"
[ -z "$MODEL" ] || cp "$MODEL" "$DIR/m/model.gguf"
cp scripts/gpu-bundle-run.sh "$DIR/run.sh"
echo "gpu-bundle.sh: $DIR: $(du -sh "$DIR" | cut -f1)"
