#!/usr/bin/env bash
# start-router.sh: start the router of a cluster YAML on this host.
#
#   deploy/start-router.sh FILE [extra tandem-router options]
#
# The router serves the OpenAI HTTP API on router.listen and reaches every instance at the
# host/port the YAML gives it; start it on the host whose address router.listen names.
# The process runs in the foreground (exec); SIGTERM stops it.
# Binary: $TANDEM_BIN/tandem-router if TANDEM_BIN is set, else build/bin/ of this
# repository. Docs: docs/deploy.md.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 FILE [tandem-router options]" >&2
  exit 2
fi
file=$1
shift
bin_dir=${TANDEM_BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin}
if [ ! -x "$bin_dir/tandem-router" ]; then
  echo "$0: $bin_dir/tandem-router not found (build it, or set TANDEM_BIN)" >&2
  exit 1
fi
exec "$bin_dir/tandem-router" --config "$file" "$@"
