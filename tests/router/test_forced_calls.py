#!/usr/bin/env python3
"""test_forced_calls.py: tool_choice "required" gives a parsed call back with every template
of llama.cpp's corpus that reads tools (issue 41's goal), through tandem-router and a decode
instance, on a synthetic model (random weights, 8192-token context, written here by
tests/ref/make_synth.py): the router renders the conversation with the corpus template
(router.chat_template), the grammar engine constrains the output to one call of the declared
tool, and the answer must be finish_reason "tool_calls" with that call parsed (its arguments
valid under the tool's schema). The model is random, so only the constraint can make the call:
this checks the whole forced path per template, not a model's skill.

A template that does not read tools answers 400 `unsupported_parameter` (counted apart); one
that refuses the conversation itself (its raise_exception, or an error Python's jinja2 raises
as well: an undefined operand, a generator given to tojson) is counted apart too, and its
message must not be the engine's "not implemented". Every other template must give the call.

usage: test_forced_calls.py --router BIN --decode BIN --corpus DIR
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # tdtest
import rtlib  # noqa: E402
from tdtest.checks import check, summary  # noqa: E402
from tdtest.cluster import write_yaml  # noqa: E402
from tdtest.ports import free_port  # noqa: E402
from tdtest.procs import spawn, stop  # noqa: E402
from tdtest.waits import wait_http  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in Paris", "strict": True,
    "parameters": {"type": "object",
                   "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}
BODY = {"messages": [{"role": "system", "content": "You are a weather assistant."},
                     {"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [TOOL], "tool_choice": "required", "max_tokens": 200, "temperature": 0}


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "decode", "corpus"):
        ap.add_argument("--" + k, required=True)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="tandem-forced-")
    model = os.path.join(d, "llama-8k.gguf")
    make = os.path.join(HERE, "..", "ref", "make_synth.py")
    r = subprocess.run([sys.executable, make, "--out", model, "--arch", "llama", "--n-ctx", "8192"],
                       capture_output=True, text=True)
    if not check(r.returncode == 0,
                 f"a synthetic model with an 8192-token context ({r.stderr[-300:]})"):
        return summary()
    tdir = os.path.join(a.corpus, "templates")
    templates = sorted(f for f in os.listdir(tdir) if f.endswith(".jinja"))
    http_port, dport = free_port(), free_port()

    def cfg_for(tmpl):
        return write_yaml(os.path.join(d, "cluster.yaml"), {
            "model": model,
            "router": {"listen": f"127.0.0.1:{http_port}", "heartbeat_ms": 100,
                       "max_prompt_tokens": 8192, "chat_template": os.path.join(tdir, tmpl)},
            "decode": [{"name": "d0", "threads": 1, "kv_blocks": 1024, "max_batch": 4,
                        "step_tokens": 512, "port": dport}]})

    cfg = cfg_for(templates[0])
    dec = spawn([a.decode, "--config", cfg, "--instance", "d0", "--rank", "0"],
                os.path.join(d, "d0.log"))
    called, no_tools, refused, bad = [], [], [], []
    try:
        for tmpl in templates:
            cfg = cfg_for(tmpl)
            log = os.path.join(d, "router.log")
            router = spawn([a.router, "--config", cfg], log)
            try:
                up = wait_http(http_port, 200, 120, proc=router)
                if not up:
                    with open(log, errors="replace") as f:
                        bad.append(f"{tmpl}: the router did not serve ({f.read()[-300:]})")
                    continue
                st, _, out = rtlib.post(http_port, "/v1/chat/completions", BODY)
                js = json.loads(out) if out.startswith(b"{") else {}
                err = js.get("error") or {}
                if st == 400 and err.get("code") == "unsupported_parameter" and \
                        err.get("param") == "tools":
                    no_tools.append(tmpl)
                    continue
                if st == 400 and "template" in err.get("message", ""):
                    refused.append(f"{tmpl}: {err.get('message', '')[:160]}")
                    continue
                ch = (js.get("choices") or [{}])[0]
                calls = (ch.get("message") or {}).get("tool_calls") or []
                ok = st == 200 and ch.get("finish_reason") == "tool_calls" and len(calls) == 1 \
                    and calls[0]["function"]["name"] == "get_weather"
                args = {}
                if ok:
                    try:
                        args = json.loads(calls[0]["function"]["arguments"])
                    except ValueError:
                        ok = False
                ok = ok and isinstance(args, dict) and list(args) == ["unit"] and \
                    args["unit"] in ("celsius", "fahrenheit")
                (called if ok else bad).append(tmpl if ok else f"{tmpl}: {st} {out[:300]!r}")
            finally:
                stop([router], timeout=30)
    finally:
        stop([dec], timeout=30)
    print(f"{len(templates)} templates: {len(called)} gave the call, {len(no_tools)} do not read "
          f"tools, {len(refused)} refuse the conversation themselves", flush=True)
    for x in refused:
        print(f"  refused by its template: {x}")
    check(not [x for x in refused if "not implemented" in x],
          "no template is refused for a construct the engine lacks")
    check(not bad, f"every template that reads tools gives a parsed call ({len(bad)} did not: "
                   f"{bad[:3]})")
    check(len(called) >= 30, f"most of the corpus' templates read tools ({len(called)})")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
