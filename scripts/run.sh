#!/usr/bin/env bash
# run.sh: setup, a Release build into build/ of every binary `tandem up` runs (tandem,
# tandem-decode, tandem-prefill, tandem-router), then the local cluster of deploy/local.yaml
# (the router, a prefill instance of two stages and a decode instance on the default model)
# in the foreground, serving the OpenAI API at http://127.0.0.1:8000 until Ctrl-C
# (docs/deploy.md). `tandem up` prints an example request once the cluster answers.
#
#   scripts/run.sh                    Ctrl-C stops every process
#   scripts/run.sh --port 8100        the router on 8100, the control ports on 8101, 8102
#   scripts/run.sh --timeout 600      any argument goes to `tandem up` as it is
#
# Ports of the default cluster: 8000 (router, HTTP), 9000 (decode d0), 9100 (prefill p0
# stage 0); `tandem up` says so and stops before anything starts if one is taken.
# The CUDA backend is built only where it can run: with an NVIDIA GPU that nvidia-smi lists,
# for that GPU's architecture alone (CMake's "native"); without one it is left out, which
# saves the minutes nvcc spends on six GPU targets (`backend: cuda` then says that this
# build has none). TANDEM_CUDA=ON or OFF decides instead; scripts/test.sh and
# scripts/test-gpu.sh build it whatever this finds.
#
# Environment: TANDEM_JOBS (2), TANDEM_BUILD_DIR (build), TANDEM_CUDA (auto), plus setup.sh's
# TANDEM_VENV / TANDEM_MODELS (when the model lands elsewhere than local.yaml says, a copy of
# the YAML naming it is written to the build directory and used instead).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${TANDEM_BUILD_DIR:-build}
MODEL=$(bash scripts/setup.sh)
CUDA=${TANDEM_CUDA:-auto}
if [ "$CUDA" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    CUDA=native
  else
    CUDA=OFF
    echo "run: no NVIDIA GPU here (nvidia-smi lists none): building without the CUDA backend" >&2
  fi
fi
case "$CUDA" in
  native) CUDA_ARGS=(-DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native) ;;
  ON | OFF) CUDA_ARGS=(-DTANDEM_CUDA="$CUDA") ;;
  *) echo "run: TANDEM_CUDA must be ON, OFF or auto, not '$CUDA'" >&2; exit 2 ;;
esac
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${CUDA_ARGS[@]}" >&2
cmake --build "$BUILD" -j "${TANDEM_JOBS:-2}" \
  --target tandem tandem-decode tandem-prefill tandem-router >&2

CONFIG=deploy/local.yaml
if [ "$MODEL" != "$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  CONFIG=$BUILD/local.yaml
  sed "s|^model: .*|model: $MODEL|" deploy/local.yaml > "$CONFIG"
fi
# exec: Ctrl-C and SIGTERM reach `tandem up` itself, which stops every process it started
exec "$BUILD/bin/tandem" up "$CONFIG" "$@"
