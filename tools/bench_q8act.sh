#!/bin/bash
# tools/bench_q8act.sh: bench-engine, act f32 then q8 back to back, on the default model (Q4_1)
# and the 0.5B Qwen (Q4_K_M); each run gives pp512, tg128 and batched decode (--batch B).
# Usage: tools/bench_q8act.sh [reps] [configs]   configs: "threads:batch ..." (BENCHMARKS.md
# "8-bit activations"); default 1:8 1:16 1:32 2:8 2:16 2:32.
cd "$(dirname "$0")/.."
REPS=${1:-2}
CONFIGS=${2:-"1:8 1:16 1:32 2:8 2:16 2:32"}
for M in SmolLM2-135M-Instruct.Q4_1 Qwen2.5-Coder-0.5B-Instruct.Q4_K_M; do
  for c in $CONFIGS; do
    th=${c%:*} b=${c#*:}
    for a in f32 q8; do
      echo "== $M threads $th batch $b act $a load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
      ./build/bin/tandem bench-engine --model ~/.cache/tandem/models/$M.gguf --threads "$th" \
        --reps "$REPS" --batch "$b" --act $a --json 2>&1 | tail -1
    done
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
