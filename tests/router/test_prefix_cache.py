"""test_prefix_cache.py: the decode node's prefix cache through the router, with the official
`openai` client, colocated, at tp 1 and tp 2 on the synthetic model, tp 1 on (with --model) the
default model and tp 2 on (with --model-tp2) Qwen2.5-Coder 0.5B (SmolLM2's 9 heads do not split
in 2):
  - the 2nd turn of a conversation (turn 1 + its answer + a new message) right after turn 1
    gives the greedy text a cold cluster (decode[].prefix_cache: false) gives, with
    usage.prompt_tokens_details.cached_tokens > 0 (0 cold); streamed usage carries it too;
  - n=4 greedy choices of a new prompt are identical, equal the cold text, and cached_tokens
    shows that the choices shared the prompt;
  - (tp 1) a small pool: many distinct prompts evict cached blocks, then the first prompt
    again gives its first answer; /metrics counts queries, hits and evictions.
Both clusters run with decode[].deterministic: true (every row computed as if alone), the
setting under which a cache hit is bit-identical to computing the prefix (docs/prefix-cache.md).

usage: test_prefix_cache.py --router BIN --decode BIN --tandem BIN --synth GGUF [--model GGUF]
       [--model-tp2 GGUF] [--tp 1,2]
"""
import argparse
import http.client
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import openai  # noqa: E402
from rtlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import parse_metrics  # noqa: E402

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, in plain words, and say "
          "so when you do not know. Keep every answer under three sentences.")
TURN1 = "Name three colours of the rainbow."
TURN2 = "Now name two more."
N_TOK = 12


def client_of(cl):
    return openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def cached(usage):
    d = usage.prompt_tokens_details
    return d.cached_tokens if d is not None else None


def chat(client, mid, msgs, **kw):
    return client.chat.completions.create(model=mid, messages=msgs, max_tokens=N_TOK,
                                          temperature=0, **kw)


def conversation(client, mid):
    """Turn 1, then turn 2 on the same cluster: (turn-1 response, turn-2 response)."""
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN1}]
    r1 = chat(client, mid, m1)
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": TURN2}]
    return r1, chat(client, mid, m2), m2


def long_prompt(i):
    return (f"Story {i}: once upon a time there was a small village by a river, where the "
            f"people kept bees and grew apples, and every autumn number {i} they held a fair.")


def metric(cl, name):
    """The sum of a family's samples on the router's /metrics."""
    c = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return sum(v for (n, _), v in parse_metrics(text).items() if n == name)


def run_shape(args, model, name, tp):
    extra = {"deterministic": True}
    with Cluster(args, model, tp=tp, decode_extra=dict(extra, prefix_cache=False)) as cold:
        client = client_of(cold)
        mid = client.models.list().data[0].id
        c1, c2, m2 = conversation(client, mid)
        check(cached(c1.usage) == 0 and cached(c2.usage) == 0,
              f"{name}: cold cluster: cached_tokens 0 ({cached(c1.usage)}, {cached(c2.usage)})")
        cold2 = c2.choices[0].message.content
        cold_story = client.completions.create(model=mid, prompt=long_prompt(0),
                                               max_tokens=N_TOK, temperature=0).choices[0].text
    with Cluster(args, model, tp=tp, decode_extra=dict(extra, prefix_cache=True)) as warm:
        client = client_of(warm)
        w1, w2, _ = conversation(client, mid)
        check(w1.choices[0].message.content == c1.choices[0].message.content,
              f"{name}: turn 1 warm == cold")
        got = w2.choices[0].message.content
        check(got == cold2, f"{name}: turn 2 with a cache hit == cold"
              + ("" if got == cold2 else f": {got!r} != {cold2!r}"))
        k = cached(w2.usage)
        check(k is not None and 0 < k < w2.usage.prompt_tokens,
              f"{name}: turn 2 cached_tokens {k} of {w2.usage.prompt_tokens} prompt tokens")
        # streamed: the usage chunk carries it too (the same prompt again: all but its last
        # partial block or token is cached now)
        text, usage = "", None
        for ch in client.chat.completions.create(model=mid, messages=m2, max_tokens=N_TOK,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
            if ch.usage:
                usage = ch.usage
        check(text == cold2, f"{name}: streamed turn 2 == cold")
        check(usage is not None and cached(usage) is not None and cached(usage) >= k,
              f"{name}: streamed usage has cached_tokens ({usage and cached(usage)} >= {k})")
        # n = 4 greedy choices of a new prompt: identical, == cold, the prompt shared
        r = client.completions.create(model=mid, prompt=long_prompt(0), max_tokens=N_TOK,
                                      temperature=0, n=4)
        texts = [c.text for c in r.choices]
        check(len(texts) == 4 and all(t == cold_story for t in texts),
              f"{name}: n=4 greedy choices identical and == cold")
        check(cached(r.usage) > 0, f"{name}: n=4 cached_tokens {cached(r.usage)} > 0 (shared)")
        hits = metric(warm, "vllm:prefix_cache_hits_total")
        queries = metric(warm, "vllm:prefix_cache_queries_total")
        check(0 < hits <= queries, f"{name}: /metrics prefix cache hits {hits} of {queries}")


def run_eviction(args, model, name, kv_blocks):
    """A small pool: distinct prompts evict, then the first again answers as at first."""
    with Cluster(args, model, kv_blocks=kv_blocks,
                 decode_extra={"deterministic": True, "prefix_cache": True}) as cl:
        client = client_of(cl)
        mid = client.models.list().data[0].id
        first = None
        for i in range(12):
            t = client.completions.create(model=mid, prompt=long_prompt(i), max_tokens=N_TOK,
                                          temperature=0).choices[0].text
            first = t if first is None else first
        again = client.completions.create(model=mid, prompt=long_prompt(0), max_tokens=N_TOK,
                                          temperature=0)
        check(again.choices[0].text == first, f"{name}: the first prompt after evictions == "
              "its first answer")
        time.sleep(0.6)  # a heartbeat brings the counters
        ev = metric(cl, "tandem_prefix_cache_evictions_total")
        check(ev > 0, f"{name}: evictions counted ({ev})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--model-tp2", default="",
                    help="a real model whose heads tp 2 divides (the default model's 9 do not)")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--model-only", action="store_true",
                    help="only the real models' runs (tests/router.cmake: the synthetic "
                         "model's run under ASan, the real models' in Release)")
    args = ap.parse_args()
    if args.model_only and not (args.model or args.model_tp2):
        ap.error("--model-only needs --model or --model-tp2")
    t0 = time.time()
    tps = [int(x) for x in args.tp.split(",")]
    shapes = [] if args.model_only else [("synth", args.synth, tps, True)]
    if args.model:
        shapes.append(("default", args.model, [t for t in tps if t == 1], True))
    if args.model_tp2:
        shapes.append(("qwen2.5-0.5b", args.model_tp2, [t for t in tps if t == 2], False))
    for mname, model, shape_tps, evict in shapes:
        for tp in shape_tps:
            run_shape(args, model, f"{mname} tp {tp}", tp)
        if evict:
            run_eviction(args, model, f"{mname} small pool", 24)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
