#!/usr/bin/env bash
# start-prefill.sh: start pipeline stages of a prefill instance of a cluster YAML on this host.
#
#   deploy/start-prefill.sh FILE INSTANCE STAGE [extra tandem-prefill options]
#   deploy/start-prefill.sh FILE INSTANCE all   [extra tandem-prefill options]
#
# STAGE: run that one stage in the foreground (exec), on the host hosts[STAGE] of the
# instance. Stage 0 serves the instance's control socket (tcp://hosts[0]:port) and says
# "ready" once every stage joined it; the other stages join stage 0 by themselves and retry
# until it is there, so the stages (and the decode instances and the router) start in any
# order. SIGTERM stops a stage cleanly.
#
# all: run every stage of the instance here (all of its hosts are this machine), as
# children of this script: SIGTERM/SIGINT/SIGHUP to the script is passed to every stage; if
# one stage exits by itself the others are stopped too and the script exits non-zero, so a
# supervisor (systemd, a shell loop) restarts the instance as a whole. Exit status 0 when
# every stage stopped cleanly after a signal.
#
# Binary: $TANDEM_BIN/tandem-prefill if TANDEM_BIN is set, else build/bin/ of this repository
# (`all` also needs the `tandem` tool there, to read the stage count from the YAML).
# Docs: docs/deploy.md.
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 FILE INSTANCE STAGE|all [tandem-prefill options]" >&2
  exit 2
fi
file=$1 instance=$2 stage=$3
shift 3
bin_dir=${TANDEM_BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin}
if [ ! -x "$bin_dir/tandem-prefill" ]; then
  echo "$0: $bin_dir/tandem-prefill not found (build it, or set TANDEM_BIN)" >&2
  exit 1
fi
if [ "$stage" != all ]; then
  exec "$bin_dir/tandem-prefill" --config "$file" --instance "$instance" --stage "$stage" "$@"
fi

# --- every stage of the instance, supervised by this script ---------------------------------
if [ ! -x "$bin_dir/tandem" ]; then
  echo "$0: $bin_dir/tandem not found (needed to read the YAML; build it, or set TANDEM_BIN)" >&2
  exit 1
fi
# `tandem status` lists every process of the YAML: "prefill INSTANCE STAGE PID STATE"
if ! listing=$("$bin_dir/tandem" status "$file"); then
  exit 1 # tandem printed why (FILE:LINE:COLUMN: ...)
fi
stages=$(awk -v i="$instance" '$1 == "prefill" && $2 == i { printf "%s ", $3 }' <<<"$listing")
if [ -z "$stages" ]; then
  echo "$0: $file has no prefill instance '$instance'" >&2
  exit 2
fi
pids=()
stopping=0
stop_all() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
# shellcheck disable=SC2317 # called by the trap
on_signal() {
  stopping=1
  stop_all
}
trap on_signal TERM INT HUP
for s in $stages; do # word splitting wanted: one stage number each
  "$bin_dir/tandem-prefill" --config "$file" --instance "$instance" --stage "$s" "$@" &
  pids+=($!)
done
[ $stopping = 0 ] || stop_all # a signal came while the stages were being started
echo "$0: prefill $instance: stages ${stages% } running (pids ${pids[*]})" >&2
first=0
wait -n || first=$? # the first stage to exit, or a signal interrupting the wait
if [ $stopping = 0 ]; then
  echo "$0: prefill $instance: a stage exited (status $first); stopping the others" >&2
  stop_all
fi
status=0
for p in "${pids[@]}"; do
  while :; do
    wait "$p"
    r=$?
    kill -0 "$p" 2>/dev/null || break # reaped (else a signal interrupted the wait)
  done
  [ "$r" -eq 0 ] || status=$r
done
if [ $stopping = 0 ]; then
  exit $((first ? first : 1))
fi
exit "$status"
