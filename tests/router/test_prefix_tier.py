"""test_prefix_tier.py: the decode prefix cache's second tier (decode[].prefix_cache_tier,
docs/prefix-cache.md "Second tier") end to end, colocated, real processes, the official
`openai` client, on the synthetic model (and the default model with --model):
  - a small pool (24 blocks) plus a file tier: conversation A's turn 1, then enough other
    prompts to evict A's blocks from the pool into the tier, then A's turn 2: its prefix is
    found in the tier (usage cached_tokens > 0, tandem_prefix_cache_tier_hits_total > 0,
    tier writes and reads counted) and its greedy text equals a cold cluster's
    (prefix_cache: false), with decode[].deterministic: true on both;
  - the same run without the tier shows the prefix was really gone from the pool (A's turn 2
    hits at most the shared head of the prompt there);
  - the same scenario at tp 2 on the synthetic model (two ranks, each with its own tier file PATH.r0 / PATH.r1, the
    leader's copies repeated by rank 1 from the step plan): turn 2 hits in the tier with the
    same cached_tokens as at tp 1, both ranks' tiers are written, and its greedy text equals
    a cold tp 2 cluster's;
  - the tp 1 and tp 2 scenarios with `backend: cpu-dev` (pools in device memory, copied to
    the tiers through the backend's download/upload): the same text and cached_tokens as on
    cpu; tp 2 with decode[].overlap too;

usage: test_prefix_tier.py --router BIN --decode BIN --tandem BIN --synth GGUF [--model GGUF]
"""
import argparse
import http.client
import os
import shutil
import sys
import tempfile
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
KV_BLOCKS = 24


def client_of(cl):
    return openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def cached(usage):
    d = usage.prompt_tokens_details
    return d.cached_tokens if d is not None else None


def chat(client, mid, msgs):
    return client.chat.completions.create(model=mid, messages=msgs, max_tokens=N_TOK,
                                          temperature=0)


def other_prompt(i):
    return (f"Story {i}: once upon a time there was a small village by a river, where the "
            f"people kept bees and grew apples, and every autumn number {i} they held a fair.")


def metrics(cl):
    c = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=30)
    c.request("GET", "/metrics")
    m = parse_metrics(c.getresponse().read().decode())
    c.close()
    return lambda name: sum(v for (n, _), v in m.items() if n == name)


def run(client, mid, n_other):
    """A's turn 1, n_other other prompts, A's turn 2: (turn 1, turn 2) responses."""
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN1}]
    r1 = chat(client, mid, m1)
    for i in range(n_other):
        client.completions.create(model=mid, prompt=other_prompt(i), max_tokens=N_TOK,
                                  temperature=0)
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": TURN2}]
    return r1, chat(client, mid, m2)


def cluster(args, model, tp, decode_extra, backend):
    cl = Cluster(args, model, kv_blocks=KV_BLOCKS, tp=tp, decode_extra=decode_extra)
    if backend:
        with open(cl.cfg, "a") as f:
            f.write(f"backend: {backend}\n")
    return cl


def run_model(args, model, name, tp=1, want_cached=None, backend=None, cold_text=None,
              overlap=False):
    """The scenario at tp ranks on backend (None: the default, cpu); want_cached: turn 2's
    cached_tokens must equal it (tp 1's); cold_text: (turn 1, turn 2) of a cold cluster run
    before (else one runs here); overlap: decode[].overlap on the tier's cluster. Returns
    (turn 2's cached_tokens with the tier, cold_text)."""
    base = {"deterministic": True}
    name = f"{name} tp {tp}" + (f" {backend}" if backend else "") + (" overlap" if overlap else "")
    if cold_text is None:
        with cluster(args, model, tp, dict(base, prefix_cache=False), None) as cold:
            client = client_of(cold)
            mid = client.models.list().data[0].id
            c1, c2 = run(client, mid, 0)
        cold_text = (c1.choices[0].message.content, c2.choices[0].message.content)
    want = cold_text[1]
    base_hit = 0
    if tp == 1 and not backend:  # without a tier: the other prompts push A out of the pool
        with cluster(args, model, 1, dict(base), None) as pool_only:
            _, p2 = run(client_of(pool_only), mid, 12)
            base_hit = cached(p2.usage)
            check(p2.choices[0].message.content == want, f"{name}: pool only: turn 2 == cold")
    tdir = tempfile.mkdtemp(prefix="tandem-tier-")
    tier = f"{{path: {tdir}/tier, size: 64MiB}}"
    with cluster(args, model, tp, dict(base, prefix_cache_tier=tier, overlap=overlap),
                 backend) as cl:
        client = client_of(cl)
        mid = client.models.list().data[0].id
        w1, w2 = run(client, mid, 12)
        check(w1.choices[0].message.content == cold_text[0], f"{name}: turn 1 with a tier == cold")
        if backend:
            with open(os.path.join(cl.dir, "d0.log"), errors="replace") as f:
                check(backend in f.read(), f"{name}: the decode node runs on {backend}")
        got = w2.choices[0].message.content
        check(got == want, f"{name}: turn 2 from the tier == cold"
              + ("" if got == want else f": {got!r} != {want!r}"))
        k = cached(w2.usage)
        check(k is not None and k > (base_hit or 0) and k < w2.usage.prompt_tokens,
              f"{name}: turn 2 cached_tokens {k} > {base_hit} (pool only) of "
              f"{w2.usage.prompt_tokens}")
        if want_cached is not None:
            check(k == want_cached, f"{name}: turn 2 cached_tokens {k} == {want_cached} (tp 1)")
        time.sleep(0.6)  # a heartbeat brings the counters
        m = metrics(cl)
        writes = m("tandem_prefix_cache_tier_writes_total")
        reads = m("tandem_prefix_cache_tier_reads_total")
        hits = m("tandem_prefix_cache_tier_hits_total")
        check(writes > 0 and reads > 0 and hits > 0 and hits <= k,
              f"{name}: tier writes {writes}, reads {reads}, hit tokens {hits} (<= {k})")
        for r in range(tp):
            f = f"{tdir}/tier.r{r}"
            size = os.path.getsize(f) if os.path.exists(f) else 0
            check(0 < size <= 64 << 20, f"{name}: the tier file {f} ({size} bytes)")
            # rank r's tier was written: some slot past the 4 KiB header is not all zeros
            with open(f, "rb") as fh:
                fh.seek(4096)
                data = fh.read(4 << 20)
            check(data.count(0) < len(data), f"{name}: rank {r}'s tier holds KV")
    shutil.rmtree(tdir, ignore_errors=True)
    return k, cold_text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--model-only", action="store_true",
                    help="only the real models' runs (tests/router.cmake: the synthetic "
                         "model's run under ASan, the real models' in Release)")
    args = ap.parse_args()
    if args.model_only and not args.model:
        ap.error("--model-only needs --model")
    t0 = time.time()
    if not args.model_only:
        k1, cold = run_model(args, args.synth, "synth")
        # a pool in device memory (cpu-dev: the cpu kernels behind a device backend's
        # contract, bit-identical to cpu): the same answers and hits as on cpu
        run_model(args, args.synth, "synth", want_cached=k1, backend="cpu-dev", cold_text=cold)
        _, cold2 = run_model(args, args.synth, "synth", tp=2, want_cached=k1)
        run_model(args, args.synth, "synth", tp=2, want_cached=k1, backend="cpu-dev",
                  cold_text=cold2)
        # overlap: the next step is planned (and its copies made) while no pass is in flight
        run_model(args, args.synth, "synth", tp=2, want_cached=k1, cold_text=cold2, overlap=True)
    if args.model:  # tp 1 only: the default model's 9 heads do not split over 2 ranks
        run_model(args, args.model, "default")
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
