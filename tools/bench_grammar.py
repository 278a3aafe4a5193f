#!/usr/bin/env python3
"""bench_grammar.py: the cost of structured output and of logprobs, on one colocated cluster
(tandem-router + one tp1 decode instance, threads 1, max_batch 16; tests/router/rtlib.py).

Modes (--mode):
  grammar:  chat requests at temperature 1.0 with no response_format, json_object and a strict
            json_schema;
  logprobs: chat requests at temperature 0 with logprobs off, logprobs on (top_logprobs 0) and
            top_logprobs 20; min_tokens = max_tokens, so every variant generates exactly the
            same tokens and the same number of them.
Requests go over http.client with the json module, not the openai client, to keep the
client's CPU (it shares the 2 cores) small next to the server's: the openai client builds
objects for every chunk, 20 alternatives a token with top_logprobs 20.
Method (BENCHMARKING.md): one warm-up round of every variant, then --rounds rounds; in each
round, for concurrency 1 then 16, every variant runs once (--requests requests at concurrency
16, a quarter of them at 1), the variants' order rotated from round to round so drift hits
all of them; medians over rounds and min..max. Each request streams; per variant:
  tok/s   generated tokens (usage) / wall time of the variant's batch of requests
  step ms median over requests of (last token time - first token time) / (tokens - 1): the
          decode step time as a request sees it (inter-token latency), length-independent
  tok/req mean generated tokens per request (grammar: a finished document ends the request)
--record FILE writes the generated documents of the grammar variants (JSON lines) for
tests/grammar/bench_mask.c (build/bin/bench_grammar_mask), which times the mask itself.

usage: bench_grammar.py --build build --model GGUF [--mode grammar|logprobs] [--rounds 5]
"""
import argparse
import concurrent.futures as cf
import http.client
import json
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "router"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from rtlib import Cluster  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
GRAMMAR = {"none": {},
           "json_object": {"response_format": {"type": "json_object"}},
           "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
               "name": "p", "schema": SCHEMA, "strict": True}}}}
LOGPROBS = {"off": {},
            "logprobs": {"logprobs": True, "top_logprobs": 0},
            "top20": {"logprobs": True, "top_logprobs": 20}}


def one(url, mid, kw, i, a):
    """One streamed chat request over plain http.client: (tokens, step s, text)."""
    body = dict(model=mid, messages=[{"role": "user", "content": f"Describe person {i} as JSON."}],
                max_tokens=a.max_tokens, temperature=1.0 if a.mode == "grammar" else 0.0, seed=i,
                stream=True, stream_options={"include_usage": True}, **kw)
    if a.mode == "logprobs":
        body["min_tokens"] = a.max_tokens
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read()[:300]!r}")
    t_first = t_last = None
    text, toks = [], 0
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            toks = ev["usage"]["completion_tokens"]
        ch = ev.get("choices") or [{}]
        delta = ch[0].get("delta") or {}
        if delta.get("content") or ch[0].get("logprobs"):
            t_last = time.perf_counter()
            t_first = t_first or t_last
            text.append(delta.get("content") or "")
    c.close()
    step = (t_last - t_first) / (toks - 1) if toks > 1 and t_first else None
    return toks, step, "".join(text)


def run(url, mid, kw, conc, n, a):
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(lambda i: one(url, mid, kw, i, a), range(n)))
    dt = time.perf_counter() - t0
    toks = sum(r[0] for r in res)
    steps = [r[1] for r in res if r[1] is not None]
    return {"tps": toks / dt, "step": statistics.median(steps) * 1e3 if steps else float("nan"),
            "tpr": toks / n, "texts": [r[2] for r in res]}


def complete(text):
    """A whole document (not cut by max_tokens): bench_mask replays it up to its EOG."""
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def spread(v):
    return f"{statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("grammar", "logprobs"), default="grammar")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--record", help="write the grammar variants' documents here (JSON lines)")
    a = ap.parse_args()
    b = os.path.join(a.build, "bin")
    args = argparse.Namespace(router=os.path.join(b, "tandem-router"),
                              decode=os.path.join(b, "tandem-decode"),
                              tandem=os.path.join(b, "tandem"), synth="", model=a.model)
    variants = list((GRAMMAR if a.mode == "grammar" else LOGPROBS).items())
    res = {(c, name): [] for c in (1, 16) for name, _ in variants}
    docs = []
    with Cluster(args, a.model, max_batch=16) as cl:
        url = urllib.parse.urlparse(cl.url)
        mid = json.loads(urllib.request.urlopen(cl.url + "/v1/models").read())["data"][0]["id"]
        for name, kw in variants:  # warm-up: threads, grammar compile, mask cache
            run(url, mid, kw, 4, 4, a)
        for rnd in range(a.rounds):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for conc in (1, 16):
                n = a.requests if conc > 1 else max(4, a.requests // 4)
                for name, kw in order:
                    r = run(url, mid, kw, conc, n, a)
                    res[(conc, name)].append(r)
                    if name != "none" and a.mode == "grammar":
                        docs += [{"kind": name, "schema": SCHEMA if name == "json_schema"
                                  else None, "text": t} for t in r["texts"] if complete(t)]
                    print(f"round {rnd} conc {conc} {name}: {r['tps']:.1f} tok/s, step "
                          f"{r['step']:.1f} ms, {r['tpr']:.1f} tok/req", file=sys.stderr,
                          flush=True)
    base = variants[0][0]
    print(f"| concurrency | variant | tok/s | vs {base} | step ms | vs {base} | tok/req |")
    print("|---|---|---|---|---|---|---|")
    for conc in (1, 16):
        b0 = res[(conc, base)]
        for name, _ in variants:
            rs = res[(conc, name)]
            tps = [r["tps"] for r in rs]
            step = [r["step"] for r in rs]
            # ratios per round (same round, adjacent in time), then their median
            rt = statistics.median(r["tps"] / q["tps"] for r, q in zip(rs, b0))
            rs_ = statistics.median(r["step"] / q["step"] for r, q in zip(rs, b0))
            print(f"| {conc} | {name} | {spread(tps)} | {rt:.2f} | {spread(step)} | {rs_:.2f} | "
                  f"{statistics.mean(r['tpr'] for r in rs):.1f} |")
    if a.record:
        with open(a.record, "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    main()
