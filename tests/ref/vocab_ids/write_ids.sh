#!/usr/bin/env bash
# write_ids.sh: the ids llama.cpp's llama-tokenize gives each text of an .inp file (texts
# separated by "\n__ggml_vocab_test__\n", as test-tokenizer-0 splits them), one line of
# space-separated ids per text, add_special and parse_special off (--no-bos,
# --no-parse-special; each text from its own file, bytes as given: --no-escape).
# usage: write_ids.sh LLAMA_TOKENIZE VOCAB.gguf TEXTS.inp > NAME.out
set -euo pipefail
BIN=$1 VOCAB=$2 INP=$3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
n=$(python3 - "$INP" "$TMP/case" <<'PY'
import sys
raw = open(sys.argv[1], "rb").read()
sep = b"\n__ggml_vocab_test__\n"
parts = raw.split(sep)
if parts and parts[-1] == b"":
    parts.pop()
for i, p in enumerate(parts):
    open("%s%d" % (sys.argv[2], i), "wb").write(p)
print(len(parts))
PY
)
for ((i = 0; i < n; i++)); do
  if [ -s "$TMP/case$i" ]; then
    "$BIN" -m "$VOCAB" -f "$TMP/case$i" --ids --no-bos --no-parse-special --no-escape \
      --log-disable 2>/dev/null | tail -n 1 | tr -d '[],'
  else
    echo # an empty text has no ids (llama-tokenize refuses an empty prompt)
  fi
done
