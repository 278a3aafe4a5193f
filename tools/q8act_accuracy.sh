#!/bin/bash
# tools/q8act_accuracy.sh: greedy agreement over 32 tokens and last-position logits, act f32 against q8,
# on the default model (SmolLM2 Q4_1) and the 0.5B Qwen (Q4_K_M); extra gguf names as arguments
cd "$(dirname "$0")/.."
PY=$HOME/.cache/tandem/venv/bin/python
T=./build/bin/tandem
mkdir -p /tmp/q8acc
for M in SmolLM2-135M-Instruct.Q4_1 Qwen2.5-Coder-0.5B-Instruct.Q4_K_M "$@"; do
  MP=~/.cache/tandem/models/$M.gguf
  i=0
  for P in "def fibonacci(n):" "The capital of France is" "import numpy as np
# compute the mean of a list" "Write a haiku about the sea."; do
    i=$((i+1))
    for a in f32 q8; do
      TANDEM_CPU_ACT=$a $T generate --model $MP --prompt "$P" --max-tokens 32 --temperature 0 --ids --ignore-eos --threads 2 2>/dev/null | tail -1 > /tmp/q8acc/$M.$i.$a
    done
    ids=$(tr ' ' ',' < /tmp/q8acc/$M.$i.f32)
    for a in f32 q8; do
      TANDEM_CPU_ACT=$a $T logits --model $MP --prompt-ids "$ids" --out /tmp/q8acc/$M.$i.$a.logits --threads 2 2>/dev/null
    done
    $PY - "$M" "$i" <<'PY'
import sys, numpy as np
m, i = sys.argv[1], sys.argv[2]
b = f"/tmp/q8acc/{m}.{i}"
f = open(b + ".f32").read().split(); q = open(b + ".q8").read().split()
n = min(len(f), len(q)); pre = next((k for k in range(n) if f[k] != q[k]), n)
lf = np.fromfile(b + ".f32.logits", np.float32); lq = np.fromfile(b + ".q8.logits", np.float32)
rel = np.linalg.norm(lq.astype(np.float64) - lf) / np.linalg.norm(lf.astype(np.float64))
print(f"{m} prompt {i}: tokens {len(f)}/{len(q)}, common prefix {pre}, equal positions {sum(f[k]==q[k] for k in range(n))}/{n}, logits rel L2 {rel:.4f}, argmax {'same' if lf.argmax()==lq.argmax() else 'differs'}")
PY
  done
done
