#!/bin/bash
# tools/bench_q8act.sh: bench-engine at 1 thread, act f32 then q8, on the two Qwen2.5-Coder files (BENCHMARKS.md)
cd "$(dirname "$0")/.."
for M in Qwen2.5-Coder-1.5B-Instruct.Q4_K_M Qwen2.5-Coder-0.5B-Instruct.Q4_K_M; do
  for a in f32 q8; do
    echo "== $M act $a load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    ./build/bin/tandem bench-engine --model ~/.cache/tandem/models/$M.gguf --threads 1 --reps 3 --act $a --json 2>&1 | tail -1
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
