#!/usr/bin/env bash
# run.sh: setup, a Release build into build/, then one chat turn with the default model.
#
#   scripts/run.sh                      answers a fixed question (128 tokens at most)
#   scripts/run.sh --temperature 0.7    extra arguments go to `tandem generate` as they are
#
# Environment: TANDEM_JOBS (2), plus setup.sh's TANDEM_VENV / TANDEM_MODELS.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=$(bash scripts/setup.sh)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >&2
cmake --build build -j "${TANDEM_JOBS:-2}" --target tandem >&2
exec build/bin/tandem generate --model "$MODEL" --chat "What is the capital of France?" \
  --max-tokens 128 "$@"
