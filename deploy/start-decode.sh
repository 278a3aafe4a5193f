#!/usr/bin/env bash
# start-decode.sh: start one rank of a decode instance of a cluster YAML on this host.
#
#   deploy/start-decode.sh FILE INSTANCE RANK [extra tandem-decode options]
#
# Run it once per rank (0 .. tp-1) on the instance's `host`, in any order; rank 0 serves
# the instance's control socket (tcp://host:port). The process runs in the foreground
# (exec): wrap it in systemd, tmux or `nohup ... &` as you like; SIGTERM stops it.
# Binary: $TANDEM_BIN/tandem-decode if TANDEM_BIN is set, else build/bin/ of this
# repository. Docs: docs/deploy.md.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 FILE INSTANCE RANK [tandem-decode options]" >&2
  exit 2
fi
file=$1 instance=$2 rank=$3
shift 3
bin_dir=${TANDEM_BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin}
if [ ! -x "$bin_dir/tandem-decode" ]; then
  echo "$0: $bin_dir/tandem-decode not found (build it, or set TANDEM_BIN)" >&2
  exit 1
fi
exec "$bin_dir/tandem-decode" --config "$file" --instance "$instance" --rank "$rank" "$@"
