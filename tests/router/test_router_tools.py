#!/usr/bin/env python3
"""test_router_tools.py: tool calling through the official `openai` client on the real
Qwen2.5-Coder-0.5B-Instruct model, colocated (one decode instance) and disaggregated
(prefill pp 1 -> decode tp 1), greedy:
  - a weather question with a get_weather tool gets a parsed tool call (finish_reason
    "tool_calls", content null, arguments a JSON text naming Paris);
  - the same streamed assembles to the same call, with index and id/name in the first
    tool_calls delta, the arguments in pieces, and no call text in the content deltas;
  - tool_choice "none" gives text and no tool_calls;
  - a history with the call and its result gets a text answer that uses the result;
  - a greeting (text with "auto") gets one call with tool_choice "required", and the named
    function with a named tool_choice, the arguments valid under its schema (constrained by
    the grammar engine), streamed == non-streamed; strict makes every property present;
    strict with "auto", an undeclared name and response_format with a forced call are 400s.
  - /metrics counts the tool-call answers as vllm:request_success_total{finished_reason=
    "tool_calls"} and the text answers as "stop" (or "length").
This model writes its calls as bare JSON (no <tool_call> tags), which the parser accepts for
declared tools (router/rt_tools.h).

usage: test_router_tools.py --router BIN --decode BIN --prefill BIN --tandem BIN --model GGUF
"""
import argparse
import json
import os
import re
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tdtest
sys.path.insert(0, os.path.join(HERE, "..", "disagg"))  # pdlib
import jsonschema  # noqa: E402
import openai  # noqa: E402
import pdlib  # noqa: E402
import rtlib  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object",
                   "properties": {"timezone": {"type": "string", "maxLength": 40},
                                  "format": {"enum": ["12h", "24h"]}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
HELLO = [{"role": "user", "content": "Hello! How are you?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 18 degrees Celsius"},
    {"role": "user", "content": "Thanks. Describe the weather in Paris in one sentence."}]
MAX_TOKENS = 40


def check_call(name, msg, finish):
    calls = msg.tool_calls or []
    check(finish == "tool_calls", f"{name}: finish_reason tool_calls (got {finish})")
    check(msg.content is None, f"{name}: content null (got {msg.content!r})")
    check(len(calls) == 1, f"{name}: one tool call (got {len(calls)})")
    if not calls:
        return None
    c = calls[0]
    try:
        args = json.loads(c.function.arguments)
    except ValueError:
        args = None
    check(c.type == "function" and c.function.name == "get_weather" and
          c.id.startswith("call_"), f"{name}: get_weather, id {c.id}")
    check(isinstance(args, dict) and "paris" in str(args.get("city", "")).lower(),
          f"{name}: arguments {c.function.arguments!r} name Paris")
    return c


def streamed(client, mid, **kw):
    """(content, calls {index: [id, name, args, n_arg_pieces]}, finish, first_deltas)."""
    content, calls, finish, first = "", {}, None, {}
    for ch in client.chat.completions.create(model=mid, stream=True, **kw):
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    calls[t.index] = [t.id, t.function.name if t.function else None, "", 0]
                    first[t.index] = t
                if t.function and t.function.arguments:
                    calls[t.index][2] += t.function.arguments
                    calls[t.index][3] += 1
            finish = c.finish_reason or finish
    return content, calls, finish, first


def success_counts(url):
    """vllm:request_success_total by finished_reason, from the router's /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^vllm:request_success_total\{[^}]*finished_reason="([a-z_]+)"\} (\S+)$', text, re.M)}


def run_shape(name, client, url):
    mid = client.models.list().data[0].id
    kw = dict(model=mid, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=MAX_TOKENS)
    t0 = time.time()
    r = client.chat.completions.create(**kw)
    call = check_call(f"{name} call", r.choices[0].message, r.choices[0].finish_reason)

    content, calls, finish, first = streamed(client, mid, messages=ASK, tools=[WEATHER],
                                             temperature=0, max_tokens=MAX_TOKENS)
    check(finish == "tool_calls", f"{name} stream: finish_reason tool_calls (got {finish})")
    check(content == "", f"{name} stream: no content text (got {content!r})")
    check(list(calls) == [0], f"{name} stream: one call at index 0 (got {list(calls)})")
    if call and 0 in calls:
        cid, cname, cargs, pieces = calls[0]
        check(cid and cid.startswith("call_") and cname == "get_weather" and
              first[0].type == "function", f"{name} stream: id and name in the first delta")
        check(cargs == call.function.arguments,
              f"{name} stream: arguments assemble to the non-streamed ones ({cargs!r})")
        check(pieces > 1, f"{name} stream: arguments arrive in pieces ({pieces})")

    r = client.chat.completions.create(**dict(kw, tool_choice="none"))
    m = r.choices[0].message
    check(not m.tool_calls and r.choices[0].finish_reason in ("stop", "length") and m.content,
          f"{name} tool_choice none: text, no tool_calls ({r.choices[0].finish_reason})")

    r = client.chat.completions.create(**dict(kw, messages=HISTORY))
    m = r.choices[0].message
    check(not m.tool_calls and r.choices[0].finish_reason == "stop" and m.content and
          "18" in m.content, f"{name} history with the tool result: text answer {m.content!r}")

    forced_calls(name, client, mid)
    try:  # logprobs of an answer parsed into calls: not defined, refused (docs/api.md)
        client.chat.completions.create(**dict(kw, logprobs=True))
        check(False, f"{name} logprobs with tools: refused")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(body.get("param") == "logprobs", f"{name} logprobs with tools: 400 naming it ({e})")
    fr = success_counts(url)
    check(fr.get("tool_calls", 0) >= 2 and fr.get("stop", 0) + fr.get("length", 0) >= 2,
          f"{name} metrics: the tool_calls and stop/length answers counted (got {fr})")
    print(f"{name}: {time.time() - t0:.1f} s", flush=True)


def forced_calls(name, client, mid):
    """tool_choice required and a named function: the output is constrained to one call."""
    # a greeting: with "auto" the model answers in text; "required" makes it call a tool
    kw = dict(model=mid, messages=HELLO, tools=[WEATHER, TIME], temperature=0,
              max_tokens=MAX_TOKENS)
    r = client.chat.completions.create(**kw)
    check(not r.choices[0].message.tool_calls and r.choices[0].message.content,
          f"{name} greeting, auto: a text answer ({r.choices[0].message.content!r})")
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        label = f"{name} greeting, tool_choice {json.dumps(choice)}"
        r = client.chat.completions.create(**dict(kw, tool_choice=choice))
        m, fin = r.choices[0].message, r.choices[0].finish_reason
        calls = m.tool_calls or []
        check(fin == "tool_calls" and m.content is None and len(calls) == 1,
              f"{label}: one tool call ({fin}, {m.content!r}, {len(calls)})")
        if not calls:
            continue
        fn = calls[0].function
        want = {"get_weather": WEATHER, "get_time": TIME}.get(fn.name)
        if choice != "required":
            check(fn.name == "get_time", f"{label}: the named function ({fn.name})")
        try:
            jsonschema.validate(json.loads(fn.arguments), want["function"]["parameters"])
            check(True, f"{label}: arguments {fn.arguments} validate against {fn.name}'s schema")
        except (TypeError, ValueError, jsonschema.ValidationError) as e:
            check(False, f"{label}: arguments validate ({fn.name}, {fn.arguments!r}: {e})")
        skw = {k: v for k, v in kw.items() if k != "model"}
        content, scalls, sfin, _ = streamed(client, mid, **dict(skw, tool_choice=choice))
        check(sfin == fin and content == "" and list(scalls) == [0] and
              scalls[0][1] == fn.name and scalls[0][2] == fn.arguments,
              f"{label}: streamed == non-streamed ({sfin}, {content!r}, {scalls})")
    # strict: every property of the arguments required (OpenAI's strict mode)
    strict = {"type": "function", "function": dict(TIME["function"], strict=True)}
    r = client.chat.completions.create(**dict(kw, tools=[WEATHER, strict], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    calls = r.choices[0].message.tool_calls or []
    args = json.loads(calls[0].function.arguments) if calls else {}
    check(calls and set(args) == {"timezone", "format"},
          f"{name} strict: every property present ({args})")
    for bad, word in [(dict(kw, tools=[strict]), "strict"),
                      (dict(kw, tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "nope"),
                      (dict(kw, tool_choice="required", response_format={"type": "json_object"}),
                       "response_format")]:
        try:
            client.chat.completions.create(**bad)
            check(False, f"{name}: 400 naming {word}")
        except openai.BadRequestError as e:
            check(word in str(e), f"{name}: 400 naming {word} ({e})")


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "decode", "prefill", "tandem"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    if not (args.model and os.path.exists(args.model)):
        print("SKIP: no Qwen2.5-Coder-0.5B-Instruct model file (set TANDEM_MODEL_QWEN05; "
              "scripts/setup.sh --models qwen0.5b)")
        print("0 passed, 0 failed, 1 skipped")
        return 0
    for name in ("colocated", "disaggregated"):
        try:
            if name == "colocated":
                with rtlib.Cluster(args, args.model) as c:
                    run_shape(name, openai.OpenAI(base_url=c.url + "/v1", api_key="x"), c.url)
            else:
                with pdlib.Cluster(args, args.model, [{"pp": 1}], [{"tp": 1}]) as c:
                    run_shape(name, openai.OpenAI(base_url=c.url + "/v1", api_key="x"), c.url)
        except Exception as e:  # a crashed shape is a failure; the other still runs
            check(False, f"{name}: {type(e).__name__}: {e}")
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
