#!/usr/bin/env python3
"""bench_grammar.py: the cost of structured output. One colocated cluster (tandem-router + one
tp1 decode instance, tests/router/rtlib.py), the default model; at concurrency 1 and 16, the
same chat requests with no response_format, json_object and a json_schema (strict), in the
same run; prints generated tokens/s of each (usage.completion_tokens / wall time).

usage: bench_grammar.py --build build --model GGUF [--requests 32] [--max-tokens 64] [--threads 2]
"""
import argparse
import concurrent.futures as cf
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "router"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import openai  # noqa: E402
from rtlib import Cluster  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
FORMATS = {"none": None, "json_object": {"type": "json_object"},
           "json_schema": {"type": "json_schema",
                           "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}


def one(client, mid, rf, i, max_tokens):
    kw = {"response_format": rf} if rf else {}
    r = client.chat.completions.create(
        model=mid, messages=[{"role": "user", "content": f"Describe person {i} as JSON."}],
        max_tokens=max_tokens, temperature=1.0, seed=i, **kw)
    return r.usage.completion_tokens


def run(client, mid, rf, conc, n, max_tokens):
    t0 = time.time()
    with cf.ThreadPoolExecutor(conc) as ex:
        toks = sum(ex.map(lambda i: one(client, mid, rf, i, max_tokens), range(n)))
    return toks, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reverse", action="store_true", help="run the formats in reverse order")
    a = ap.parse_args()
    b = os.path.join(a.build, "bin")
    args = argparse.Namespace(router=os.path.join(b, "tandem-router"),
                              decode=os.path.join(b, "tandem-decode"),
                              tandem=os.path.join(b, "tandem"), synth="", model=a.model)
    with Cluster(args, a.model, max_batch=16) as cl:
        client = openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        mid = client.models.list().data[0].id
        run(client, mid, FORMATS["json_schema"], 2, 4, 16)  # warm-up: compile, mask cache
        print("| concurrency | response_format | requests | tokens | s | tokens/s | vs none |")
        print("|---|---|---|---|---|---|---|")
        for conc in (1, 16):
            n = a.requests if conc > 1 else max(4, a.requests // 4)
            base = None
            for name, rf in (FORMATS.items() if not a.reverse else reversed(FORMATS.items())):
                toks, dt = run(client, mid, rf, conc, n, a.max_tokens)
                tps = toks / dt
                base = base or tps  # the first format run (none, or json_schema reversed)
                print(f"| {conc} | {name} | {n} | {toks} | {dt:.1f} | {tps:.1f} | "
                      f"{tps / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
