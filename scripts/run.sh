#!/usr/bin/env bash
# run.sh: setup, a Release build into build/, then the local cluster of deploy/local.yaml
# (the router and one decode instance on the default model) in the foreground, serving the
# OpenAI API at http://127.0.0.1:8000 until Ctrl-C (docs/deploy.md).
#
#   scripts/run.sh                    Ctrl-C stops every process
#   scripts/run.sh --timeout 600      extra arguments go to `tandem up` as they are
#
# Environment: TANDEM_JOBS (2), TANDEM_BUILD_DIR (build), plus setup.sh's TANDEM_VENV /
# TANDEM_MODELS (when the model lands elsewhere than local.yaml says, a copy of the YAML
# naming it is written to the build directory and used instead).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${TANDEM_BUILD_DIR:-build}
MODEL=$(bash scripts/setup.sh)
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
cmake --build "$BUILD" -j "${TANDEM_JOBS:-2}" --target tandem tandem-decode tandem-router >&2

CONFIG=deploy/local.yaml
if [ "$MODEL" != "$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  CONFIG=$BUILD/local.yaml
  sed "s|^model: .*|model: $MODEL|" deploy/local.yaml > "$CONFIG"
fi
echo "run.sh: try: curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'" >&2
exec "$BUILD/bin/tandem" up "$CONFIG" "$@"
