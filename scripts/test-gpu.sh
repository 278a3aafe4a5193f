#!/usr/bin/env bash
# test-gpu.sh: the GPU suite (issue 14): the CUDA backend built for this machine's GPU and
# the ctest label "gpu" run (tests/gpu.cmake: CUDA against CPU logits and greedy output on
# the synthetic, default and Qwen2.5 0.5B models), then the first parity test again under
# compute-sanitizer when the toolkit has it.
#
# Without a usable GPU it prints one line saying so and exits 0 (the CPU suite,
# scripts/test.sh, registers the same tests and reports them as skipped).
#
# Environment: TANDEM_JOBS (all cores); TANDEM_GPU_OFFLINE=1 on a machine without network
# (no setup.sh: give TANDEM_PYTHON, the venv's python, and TANDEM_MODEL / TANDEM_MODEL_QWEN05,
# the model files; a missing one drops its tests); TANDEM_CUDA_ARCH (default "native").
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test-gpu.sh: no NVIDIA GPU on this machine (nvidia-smi -L lists none): skipped"
  exit 0
fi
nvidia-smi -L

JOBS=${TANDEM_JOBS:-$(nproc)}
if [ "${TANDEM_GPU_OFFLINE:-0}" = 1 ]; then
  PY=${TANDEM_PYTHON:-}
  MODEL=${TANDEM_MODEL:-}
  QWEN05=${TANDEM_MODEL_QWEN05:-}
else
  MODEL=$(bash scripts/setup.sh)
  PY=${TANDEM_VENV:-$HOME/.cache/tandem/venv}/bin/python
  QWEN05=$("$PY" scripts/fetch_model.py --dir "${TANDEM_MODELS:-$HOME/.cache/tandem/models}" \
             qwen0.5b) || QWEN05=""
fi

cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${TANDEM_CUDA_ARCH:-native}" \
  -DTANDEM_PYTHON="$PY" -DTANDEM_MODEL="$MODEL" -DTANDEM_MODEL_QWEN05="$QWEN05"
cmake --build build-gpu -j "$JOBS"

status=0
# the synthetic models the gpu tests use come from the synth_models fixture
ctest --test-dir build-gpu -L gpu --output-on-failure -j 1 || status=1
ctest --test-dir build-gpu -R "engine_device|model_split_qwen2" --output-on-failure || status=1

CS=$(command -v compute-sanitizer || true)
[ -n "$CS" ] || CS=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$CS" ] && [ -f build-gpu/test-data/synth/qwen2.gguf ]; then
  if "$CS" --error-exitcode 9 build-gpu/bin/tandem generate --backend cuda \
       --model build-gpu/test-data/synth/qwen2.gguf --prompt-ids 1,2,3,4,5,6,7,8 \
       --max-tokens 8 --temperature 0 --ids; then
    echo "test-gpu.sh: compute-sanitizer: clean"
  else
    echo "test-gpu.sh: compute-sanitizer reported errors" >&2
    status=1
  fi
else
  echo "test-gpu.sh: compute-sanitizer not found: memcheck not run"
fi
[ $status -eq 0 ] && echo "test-gpu.sh: passed" || echo "test-gpu.sh: FAILED" >&2
exit $status
