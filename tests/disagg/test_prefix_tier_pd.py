#!/usr/bin/env python3
"""test_prefix_tier_pd.py: the decode prefix cache's second tier searched at Alloc in
disaggregated mode (docs/prefix-cache.md "Disaggregated mode", "The second tier"): router,
a prefill stage and a decode rank as real processes on loopback, synthetic llama.

A 24-block decode pool with a file tier: turn 1 of a conversation, then other prompts that
evict its blocks from the pool (into the tier), then turn 2: its Alloc finds turn 1's blocks
in the tier, copies them back and holds them (the decode log's "N held here" > 0: the
stages push only the rest), the tier's reads and hits are counted, and the output equals
`tandem generate` (a cold run). The same run without the tier holds nothing for turn 2 (the
prefix really left the pool). The tier run again at decode tp 2: each rank has its own tier
file, the leader holds an Alloc's KV targets until every rank copied out the blocks that
allocation evicted (a copy plan and a barrier, decode-node/dc_tier.c), and the output is
still the cold one; and at tp 2 with decode[].overlap. After each run every instance is idle.

usage: test_prefix_tier_pd.py --router BIN --prefill BIN --decode BIN --tandem BIN
                              --synth-dir DIR
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pdlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
import test_prefix_cache as pc  # noqa: E402  (its helpers: text, exact, arrivals, idle)

KV_BLOCKS = 24


def with_tier(c, path):
    """Add decode[0].prefix_cache_tier to the cluster's YAML (before it starts)."""
    with open(c.cfg) as f:
        y = f.read()
    y2 = re.sub(r"(\n  - name: d0\n)", rf"\1    prefix_cache_tier: {{path: {path}, size: 64MiB}}\n",
                y, count=1)
    check(y2 != y, "the decode instance's YAML takes the tier")
    with open(c.cfg, "w") as f:
        f.write(y2)


def tier_counters(c):
    m = c.metrics()
    get = (lambda name: float(re.search(rf'^{name}\{{.*instance="d0"\}} (\S+)$', m, re.M).group(1))
           if re.search(rf'^{name}\{{.*instance="d0"\}}', m, re.M) else -1.0)
    return (get("tandem_prefix_cache_tier_reads_total"),
            get("tandem_prefix_cache_tier_hits_total"))


def run(args, tier, tp=1, overlap=False):
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = (("tier" if tier else "no tier") + (f" tp {tp}" if tp > 1 else "") +
             (" overlap" if overlap else ""))
    t1, t2 = pc.conversation(90, 30)
    # distinct from their first token on: together they need the whole pool
    others = [f"story {i}: " + pc.text(90, pc.OTHER[i:] + pc.OTHER[:i]) for i in range(4)]
    c = Cluster(args, model, [{"pp": 1, "chunk": 64, "prefix_cache": False}],
                [{"tp": tp, "kv_blocks": KV_BLOCKS, "overlap": overlap}])
    tdir = tempfile.mkdtemp(prefix="tandem-pdtier-")
    if tier:
        with_tier(c, f"{tdir}/tier")
    with c:
        pc.exact(c, args, model, t1, f"{label}: turn 1", hit=False)
        for i, o in enumerate(others):  # their KV pushes turn 1's blocks out of the pool
            pc.exact(c, args, model, o, f"{label}: other prompt {i}")
        n_before = len(pc.arrivals(c))
        cached = pc.exact(c, args, model, t2, f"{label}: turn 2")
        arr = pc.arrivals(c)
        held = arr[n_before][1] if len(arr) > n_before else -1
        if tier:
            check(held > 0 and cached is not None and cached >= held,
                  f"{label}: turn 2's Alloc held {held} positions (from the tier; "
                  f"cached_tokens {cached}): {arr}")
            pc.wait_for(lambda: tier_counters(c)[0] > 0, 5, step=0.2)
            reads, hits = tier_counters(c)
            check(reads > 0 and 0 < hits <= held,
                  f"{label}: tier reads {reads}, hit tokens {hits} (<= {held})")
            if tp > 1:  # the other prompts' Allocs evicted turn 1's blocks: their replies waited
                waits = re.findall(r"(\d+) Alloc replies held until every rank made (\d+) tier "
                                   r"copies", c.log("d0r0"))
                check(waits and sum(int(b) for _, b in waits) > 0,
                      f"{label}: Alloc replies held for the ranks' tier copies: {waits}")
        else:
            check(held == 0, f"{label}: turn 2's Alloc held nothing (the pool lost turn 1): {arr}")
        pc.idle(c, label)
    shutil.rmtree(tdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "prefill", "decode", "tandem", "synth-dir"):
        ap.add_argument("--" + k, required=True)
    args = ap.parse_args()
    # overlap: the Allocs arrive while a pass computes; their replies wait for the join
    for tier, tp, overlap in ((False, 1, False), (True, 1, False), (True, 2, False),
                              (True, 2, True)):
        try:
            run(args, tier, tp, overlap)
        except Exception as e:  # a crashed run is a failure, the others still run
            check(False, f"tier {tier} tp {tp}: {type(e).__name__}: {e}")
    print(f"{len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
