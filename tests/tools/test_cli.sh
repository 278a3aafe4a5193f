#!/usr/bin/env bash
# test_cli.sh: the `tandem` CLI as a user runs it: errors are one clear line on stderr with
# exit status 1 (never a crash), the same seed gives the same output, --ids and text agree,
# and (with the default model) a greedy chat answer is the known one.
# usage: test_cli.sh TANDEM_BIN SYNTH_MODEL.gguf [DEFAULT_MODEL.gguf]
set -uo pipefail
BIN=$1 SYNTH=$2 MODEL=${3:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# expect_error DESCRIPTION REGEX -- ARGS...: exit status 1 and stderr matching REGEX
expect_error() {
  local what=$1 re=$2
  shift 3
  "$BIN" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ $rc -ne 1 ]; then fail "$what: exit status $rc, expected 1"; cat "$TMP/err" >&2; return; fi
  if ! grep -Eq "$re" "$TMP/err"; then fail "$what: stderr does not match '$re':"; cat "$TMP/err" >&2; return; fi
  echo "ok   $what: $(head -n1 "$TMP/err")"
}

printf 'this is not a model\n' >"$TMP/bad.gguf"
head -c 1000 "$SYNTH" >"$TMP/truncated.gguf"

expect_error "missing model file" "cannot open" -- generate --model "$TMP/nope.gguf" --prompt hi --max-tokens 4
expect_error "not a GGUF file" "not a GGUF file" -- generate --model "$TMP/bad.gguf" --prompt hi --max-tokens 4
expect_error "truncated GGUF" "truncated|past end|impossible" -- generate --model "$TMP/truncated.gguf" --prompt hi --max-tokens 4
expect_error "prompt longer than the context" "context" -- generate --model "$SYNTH" --prompt-ids 1,2,3,4,5,6,7,8,9 --ctx 8 --max-tokens 4
expect_error "token id outside the vocabulary" "vocabulary" -- generate --model "$SYNTH" --prompt-ids 1,99999999 --max-tokens 4
expect_error "bad number" "needs an integer" -- generate --model "$SYNTH" --prompt hi --max-tokens lots
expect_error "two prompt sources" "exactly one" -- generate --model "$SYNTH" --prompt hi --chat hi --max-tokens 4
expect_error "unknown option" "unknown option" -- generate --model "$SYNTH" --prompt hi --max-tokens 4 --frobnicate
expect_error "unknown command" "unknown command" -- frobnicate
expect_error "bad kv type" "kv-type" -- generate --model "$SYNTH" --prompt hi --max-tokens 4 --kv-type f8
expect_error "unknown backend" "unknown backend 'tpu'" -- generate --model "$SYNTH" --prompt hi --max-tokens 4 --backend tpu
# backend cuda where no GPU is usable: refused with the reason, never run on the CPU instead
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect_error "cuda without a GPU" "backend 'cuda': (no usable GPU|this build has no CUDA)" -- \
    generate --model "$SYNTH" --prompt hi --max-tokens 4 --backend cuda
fi

# same seed, same output; the text and the ids agree in length of work done
run() { "$BIN" generate --model "$SYNTH" --prompt "hello world" --max-tokens 12 --ignore-eos "$@" 2>"$TMP/err"; }
a=$(run --seed 42 --temperature 0.9 --ids) b=$(run --seed 42 --temperature 0.9 --ids)
c=$(run --seed 43 --temperature 0.9 --ids)
[ -n "$a" ] && [ "$a" = "$b" ] && echo "ok   same seed, same ids: $a" || fail "same seed gave '$a' and '$b'"
[ "$(echo "$a" | wc -w)" -eq 12 ] || fail "expected 12 ids, got '$a'"
[ "$a" != "$c" ] && echo "ok   another seed, other ids" || fail "seeds 42 and 43 gave the same 12 ids"
g1=$(run --temperature 0 --ids) g2=$(run --temperature 0 --ids --threads 1 --chunk 3)
[ "$g1" = "$g2" ] && echo "ok   greedy ids independent of threads and chunking" || fail "greedy '$g1' vs '$g2'"

# --timing: the two wall times on stderr, the output unchanged
t=$(run --temperature 0 --ids --timing)
[ "$t" = "$g1" ] && grep -Eq "^timing: prefill [0-9]+ tokens .*; decode 11 steps" "$TMP/err" &&
  echo "ok   --timing: $(cat "$TMP/err")" || fail "--timing: '$t' / $(cat "$TMP/err")"
# bench-engine: the batch and generation length it was given, in its JSON
j=$("$BIN" bench-engine --model "$SYNTH" --reps 1 --batch 4 --gen 8 --json 2>"$TMP/err")
echo "$j" | grep -q '"decode_batch": 4' && echo "ok   bench-engine --batch 4 --gen 8" ||
  fail "bench-engine: '$j' $(cat "$TMP/err")"
expect_error "bench-engine --act on cuda" "cuda|--act" -- bench-engine --model "$SYNTH" --backend cuda --act q8

if [ -n "$MODEL" ]; then
  out=$("$BIN" generate --model "$MODEL" --chat "What is the capital of France?" --max-tokens 16 --temperature 0 2>"$TMP/err")
  if echo "$out" | grep -q "Paris"; then echo "ok   chat answer: $out"; else fail "chat answer '$out'"; cat "$TMP/err" >&2; fi
fi

echo "$fails failed"
[ $fails -eq 0 ]
