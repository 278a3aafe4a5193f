#!/usr/bin/env python3
"""test_chat_tools.py: the router renders tools, assistant tool_calls and tool messages
byte-exact as Qwen2.5's Jinja template does under transformers / vLLM (jinja2 with
trim_blocks, lstrip_blocks and transformers' `tojson` = json.dumps(ensure_ascii=False); each
call's arguments string parsed first, as vLLM hands it to the template), for several
conversations; and refuses tools with a 400 on a template that does not read them (while a
history of calls and results renders there as the template writes any message).

The template is tests/router/data/qwen2.5-chat-template.jinja, the tokenizer.chat_template
of Qwen2.5-Coder-0.5B-Instruct; with --gguf (that model file) the fixture is checked to be
exactly the GGUF's template.

usage: test_chat_tools.py --bin test_rt_chat --template FILE [--gguf QWEN_GGUF] [--smollm GGUF]
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
# key order not sorted, non-ASCII, escapes, floats of every repr shape, ints, bools, null
ODD = {"type": "function", "function": {
    "name": "m\u00e9t\u00e9o_\u4e2d", "parameters": {
        "type": "object", "properties": {"z": {"type": "number", "minimum": 0.5,
                                               "maximum": 1e20, "multipleOf": 1e-07,
                                               "default": 2.0, "x": -0.0, "y": 123.456e3},
                                         "a": {"type": "integer", "default": 10,
                                               "nullable": True, "d": None, "f": False},
                                         "q": {"description": "tab\there \"quoted\" \\ /\n\u0001"}}}}}
NOPARAMS = {"type": "function", "function": {"name": "now"}}

CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'}}]
ODD_CALL = [{"id": "call_3", "type": "function", "function": {
    "name": "m\u00e9t\u00e9o_\u4e2d",
    "arguments": '{"z": 1.5, "w": [1, 2.25e-5, true, null, "\u00e9\\n\\"x\\""], "a": {}}'}}]

CASES = [
    ("user_one_tool", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                       "tools": [WEATHER]}),
    ("system_three_tools", {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi \u4e2d\u6587 \U0001F600"}],
                            "tools": [WEATHER, ODD, NOPARAMS]}),
    ("history_two_calls", {"messages": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]}],
        "tools": [WEATHER]}),
    ("history_content_and_call", {"messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": ODD_CALL},
        {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        {"role": "system", "content": "Later system."},
        {"role": "user", "content": "B"}],
        "tools": [ODD, WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}),
    ("history_without_tools", {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "thanks"}]}),
    ("tool_choice_none", {"messages": [{"role": "developer", "content": "D"},
                                       {"role": "user", "content": "Weather in Paris?"}],
                          "tools": [WEATHER], "tool_choice": "none"}),
    ("plain_no_tools", {"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": None},
                                     {"role": "user", "content": "again"}]}),
]


def jinja_render(tmpl, body):
    """What transformers' apply_chat_template (as vLLM calls it) renders for this body."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    msgs = copy.deepcopy(body["messages"])
    for m in msgs:
        if m["role"] == "developer":
            m["role"] = "system"
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        if m["role"] == "assistant" and m.get("content") is None:  # vLLM: "" (calls or not)
            m["content"] = ""
        for c in m.get("tool_calls") or []:  # vLLM: arguments parsed for the template
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return env.from_string(tmpl).render(messages=msgs, tools=body.get("tools"),
                                        add_generation_prompt=True, bos_token="", eos_token="")


def ours(binary, tmpl_path, body, d):
    p = os.path.join(d, "body.json")
    with open(p, "w") as f:
        json.dump(body, f)
    r = subprocess.run([binary, tmpl_path, p], capture_output=True, timeout=30)
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8", "replace")


def gguf_template(path):
    from gguf import GGUFReader
    f = GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--template", required=True)
    ap.add_argument("--gguf", default="")
    ap.add_argument("--smollm", default="")
    a = ap.parse_args()
    with open(a.template, encoding="utf-8") as f:
        tmpl = f.read()
    if a.gguf and os.path.exists(a.gguf):
        check(gguf_template(a.gguf) == tmpl, "the fixture is the Qwen2.5-Coder GGUF's template")
    else:
        print("SKIP fixture == GGUF template: no Qwen2.5 model file (TANDEM_MODEL_QWEN05)")
    d = tempfile.mkdtemp(prefix="tandem-chat-tools-")
    for name, body in CASES:
        want = jinja_render(tmpl, body)
        rc, got, err = ours(a.bin, a.template, body, d)
        ok = rc == 0 and got == want
        check(ok, f"{name}: rendered byte-exact as jinja2 ({len(want)} bytes)")
        if not ok:
            print(f"--- ours (rc {rc}, {err.strip()})\n{got}\n--- jinja2\n{want}\n---")
        if name == "history_content_and_call":
            check("tool_parse 1 parallel 0" in err, f"{name}: auto parses, parallel off")
        if name == "tool_choice_none":
            check("tool_parse 0" in err, f"{name}: none does not parse tool calls")

    # refusals: a template without tools, strict with auto, forced calls without a tool or with
    # a schema the grammar engine does not take, bad args
    plain = os.path.join(d, "plain.jinja")
    with open(plain, "w") as f:
        f.write(gguf_template(a.smollm) if a.smollm and os.path.exists(a.smollm) else
                "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
    user = [{"role": "user", "content": "hi"}]
    # a template that does not read `tools` still renders a history of calls and results as
    # it renders any message (as vLLM does); only `tools` themselves are refused
    with open(plain, encoding="utf-8") as f:
        plain_text = f.read()
    for k, body in enumerate([
            {k: v for k, v in CASES[4][1].items() if k != "tools"},
            {"messages": user + [{"role": "tool", "tool_call_id": "x", "content": "r"}]}]):
        rc, got, err = ours(a.bin, plain, body, d)
        want = jinja_render(plain_text, body)
        check(rc == 0 and got == want, f"plain template {k}: a call history renders as jinja2's"
              + ("" if got == want else f" (rc {rc} {err.strip()[:200]} {got[:200]!r})"))
    bad = [
        (plain, {"messages": user, "tools": [WEATHER]}, "needs a chat template that renders tools"),
        (a.template, {"messages": user, "tool_choice": "required"}, "needs 'tools'"),
        (a.template, {"messages": user, "tools": [WEATHER], "tool_choice":
                      {"type": "function", "function": {"name": "get_time"}}},
         "function 'get_time', which 'tools' does not declare"),
        (a.template, {"messages": user, "tools": [dict(WEATHER, function=dict(
            WEATHER["function"], parameters={"type": "object", "properties": {
                "city": {"type": "string", "pattern": "^P"}}}))], "tool_choice": "required"},
         "unsupported JSON schema keyword 'pattern'"),
        (a.template, {"messages": user, "tools": [dict(WEATHER, function=dict(
            WEATHER["function"], strict=True))]}, "strict"),
        (a.template, {"messages": user, "tools": [{"type": "retrieval"}]}, "tools[0] must be"),
        (a.template, {"messages": user, "tools": [WEATHER], "tool_choice": "sometimes"},
         "'tool_choice' must be"),
        (a.template, {"messages": user, "tools": [WEATHER], "parallel_tool_calls": 1},
         "must be a boolean"),
        (a.template, {"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}]}, "is not valid JSON"),
        (a.template, {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
         "tool_call_id is not supported"),
        (a.template, {"messages": [{"role": "robot", "content": "x"}]}, "role must be"),
    ]
    # forced calls: the call's schema, one tool or anyOf over them; strict from the function
    time_tool = {"type": "function", "function": {"name": "get_time", "strict": True,
                 "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
    for choice, want, strict in [
            ("required", {"anyOf": [
                {"type": "object", "properties": {"name": {"const": "get_weather"},
                 "arguments": WEATHER["function"]["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False},
                {"type": "object", "properties": {"name": {"const": "get_time"},
                 "arguments": time_tool["function"]["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False}]}, 1),
            ({"type": "function", "function": {"name": "get_weather"}},
             {"type": "object", "properties": {"name": {"const": "get_weather"},
              "arguments": WEATHER["function"]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}, 0)]:
        rc, _, err = ours(a.bin, a.template, {"messages": user, "tools": [WEATHER, time_tool],
                                              "tool_choice": choice}, d)
        line = [x for x in err.splitlines() if x.startswith("forced ")]
        got = json.loads(line[0].split(" grammar ", 1)[1]) if line else None
        check(rc == 0 and "tool_parse 1" in err and got == want and
              line[0].startswith(f"forced strict {strict} "),
              f"tool_choice {json.dumps(choice)}: the call's schema, strict {strict}"
              + ("" if got == want else f" ({err.strip()[:300]})"))

    for k, (t, body, want) in enumerate(bad):
        rc, got, _ = ours(a.bin, t, body, d)
        ok = rc == 3 and '"status": 400' in got and want in got
        check(ok, f"refusal {k}: 400 '{want}'")
        if not ok:
            print("   got:", rc, got[:300])
    print(f"{len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
