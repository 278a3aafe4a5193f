#!/usr/bin/env bash
# test_tokenize.sh: `tandem tokenize` on llama.cpp's vocabulary-only test files (no tensors):
# ids as the .out files have them, BOS added as the vocabulary says, pieces printed escaped,
# --decode back to text, the t5 (Unigram) vocabulary, and an unsupported tokenizer model
# refused with its reason (exit 1).
# usage: test_tokenize.sh TANDEM_BIN VOCAB_DIR
set -uo pipefail
BIN=$1 DIR=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
check() { # check DESCRIPTION GOT WANT
  if [ "$2" == "$3" ]; then echo "ok   $1"; else fail "$1: got '$2', want '$3'"; fi
}
tok() { "$BIN" tokenize "$@" 2>"$TMP/err"; }

BPE=$DIR/ggml-vocab-llama-bpe.gguf
check "llama-bpe adds BOS" "$(tok --model "$BPE" --text 'Hello world' --ids)" "128000 9906 1917"
check "--no-bos" "$(tok --model "$BPE" --text 'Hello world' --ids --no-bos)" "9906 1917"
check "special text parsed" "$(tok --model "$BPE" --text '<|eot_id|>' --ids --no-bos)" "128009"
check "--no-parse-special" \
  "$(tok --model "$BPE" --text '<|eot_id|>' --ids --no-bos --no-parse-special)" "27 91 68 354 851 91 29"
check "pieces, escaped" "$(tok --model "$BPE" --text $'Hello\n' --no-bos | tr '\t' '|')" \
  "$(printf '9906|Hello\n198|\\n')"
check "--decode" "$(tok --model "$BPE" --decode '128000,9906,1917')" "<|begin_of_text|>Hello world"
check "stdin, bytes as given" "$(printf ' Hello' | tok --model "$DIR/ggml-vocab-llama-spm.gguf" --ids)" \
  "1 29871 15043"
check "WordPiece adds [CLS] and [SEP]" \
  "$(tok --model "$DIR/ggml-vocab-bert-bge.gguf" --text 'Hello, World!' --ids)" "101 7592 1010 2088 999 102"

# two cases of every vocabulary's .inp, through --file, against its .out (the library runs
# them all in tok_corpus_*; each run here loads the vocabulary again)
for inp in "$DIR"/*.gguf.inp; do
  vocab=${inp%.inp} name=$(basename "${inp%.gguf.inp}")
  python3 - "$inp" "$TMP/case" <<'PY'
import sys
raw = open(sys.argv[1], "rb").read().split(b"\n__ggml_vocab_test__\n")
for i in (0, 20):
    open("%s%d" % (sys.argv[2], i), "wb").write(raw[i])
PY
  for i in 0 20; do
    want=$(sed -n "$((i + 1))p" "${vocab}.out" | sed 's/^ *//; s/ *$//')
    got=$(tok --model "$vocab" --file "$TMP/case$i" --ids --no-bos --no-parse-special)
    [ "$got" == "$want" ] || fail "$name case $i: got '$got', want '$want'"
  done
  echo "ok   $name: 2 cases"
done

# t5 (Unigram): the charsmap normalizes (full-width letters, the ligature), <s> and </s>
# added, <mask> parsed (it takes the spaces before it); ids as llama-tokenize gives them
UGM=$DIR/ggml-vocab-nomic-bert-moe.gguf
check "t5 adds <s> and </s>" "$(tok --model "$UGM" --text 'Hello  world' --ids)" "0 35378 8999 2"
check "t5 normalizes, parses <mask>" \
  "$(tok --model "$UGM" --text $'\xef\xbc\xa1\xef\xbc\xa2\xef\xbc\xa3 \xef\xac\x81ne <mask> x' --ids)" "0 47457 5885 250001 1022 2"
check "t5 --decode" "$(tok --model "$UGM" --decode '0,47457,5885,250001,1022,2')" "<s> ABC fine<mask> x</s>"

# a tokenizer model that is not implemented is refused, never tokenized by a near match
python3 - "$TMP/rwkv.gguf" <<'PY'
import struct, sys
def s(x): return struct.pack("<Q", len(x)) + x
kv = s(b"tokenizer.ggml.model") + struct.pack("<I", 8) + s(b"rwkv")
kv += s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1) + s(b"a")
open(sys.argv[1], "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv + b"\0" * 32)
PY
"$BIN" tokenize --model "$TMP/rwkv.gguf" --text hi >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ $rc -eq 1 ] && grep -q "unsupported tokenizer model 'rwkv'" "$TMP/err" && [ ! -s "$TMP/out" ]; then
  echo "ok   rwkv vocabulary refused: $(grep -m1 unsupported "$TMP/err" | sed 's/.*error: //')"
else
  fail "rwkv vocabulary: exit $rc, stderr: $(cat "$TMP/err")"
fi
"$BIN" tokenize --text hi >/dev/null 2>"$TMP/err"
[ $? -eq 1 ] && grep -q -- "--model is required" "$TMP/err" && echo "ok   no --model" || fail "no --model"
"$BIN" tokenize --model "$BPE" --decode '1 99999999' >/dev/null 2>"$TMP/err"
[ $? -eq 1 ] && grep -q "not in \[0, 128256)" "$TMP/err" && echo "ok   bad id" || fail "bad id: $(cat "$TMP/err")"

[ $fails -eq 0 ] && echo "all ok" || echo "$fails failed"
[ $fails -eq 0 ]
