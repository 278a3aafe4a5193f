#!/usr/bin/env bash
# test_template_cli.sh: `tandem template`'s own paths: a built-in family template by name, the
# engine's errors as a user sees them (a template that does not parse names its line, one
# that raises gives its message, a construct not implemented is named), bad inputs refused,
# and --kwargs reaching the template. The renderings themselves are checked against
# transformers by template_corpus / template_models.
# usage: test_template_cli.sh TANDEM_BIN
set -uo pipefail
BIN=$1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
check() { # check DESCRIPTION GOT WANT
  if [ "$2" == "$3" ]; then echo "ok   $1"; else fail "$1: got '$2', want '$3'"; fi
}
refused() { # refused DESCRIPTION STDERR-SUBSTRING ARGS...: exit 1 and the message
  local what=$1 want=$2
  shift 2
  if "$BIN" template "$@" >"$TMP/out" 2>"$TMP/err"; then
    fail "$what: exit 0"
  elif ! grep -qF -- "$want" "$TMP/err"; then
    fail "$what: stderr lacks '$want': $(cat "$TMP/err")"
  else
    echo "ok   $what"
  fi
}
echo '[{"role": "user", "content": "hi"}]' >"$TMP/m.json"
t() { printf '%s' "$1" >"$TMP/t.jinja"; }

check "chatml by name" "$("$BIN" template --template chatml --messages "$TMP/m.json" --add-generation-prompt)" \
  "$(printf '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n')"
t '{{ "on" if enable_thinking else "off" }}|{{ bos_token }}'
check "--kwargs and --bos reach the template" \
  "$("$BIN" template --template "$TMP/t.jinja" --kwargs '{"enable_thinking": true}' --bos B)" "on|B"
t $'line one\n{% if x %}\n{{ x + }}\n{% endif %}'
refused "a syntax error names its line" "line 3" --template "$TMP/t.jinja"
t "{{ raise_exception('Conversation roles must alternate') }}"
refused "raise_exception's message" "Conversation roles must alternate" --template "$TMP/t.jinja"
t "{% include 'other.jinja' %}"
refused "a statement not implemented is named" "'include' statement is not supported" --template "$TMP/t.jinja"
t "{{ x|wordwrap }}"
refused "a filter not implemented is named" "the filter 'wordwrap' is not implemented" --template "$TMP/t.jinja"
t "{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}"
refused "a runaway loop stops" "loop iterations" --template "$TMP/t.jinja"
refused "a missing file" "cannot open" --template "$TMP/none.jinja"
echo '{"not": "a list"' >"$TMP/bad.json"
refused "bad JSON messages" "messages" --template chatml --messages "$TMP/bad.json"
echo '{"role": "user"}' >"$TMP/obj.json"
refused "messages not a list" "must be a JSON array" --template chatml --messages "$TMP/obj.json"
refused "bad --kwargs" "--kwargs" --template chatml --kwargs '[1'
refused "--now not a number" "--now" --template chatml --now soon
refused "both --model and --template" "one of --model and --template" --template chatml --model x.gguf
refused "an unknown option" "unknown option" --template chatml --frobnicate
[ "$fails" -eq 0 ] && echo "test_template_cli: all passed" || echo "test_template_cli: $fails failed"
exit $((fails > 0))
