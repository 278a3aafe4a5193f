#!/usr/bin/env python3
"""test_router_pfcache.py: cache-aware choice of the prefill instance fed by the prefill
leaders' KV events (docs/prefix-cache.md, "KV events"): real processes, two prefill
instances and one decode instance on the synthetic model, router.routing: cache_aware.
  stick    turn 1 of a conversation goes to some prefill instance P (by load); the router's
           index of P becomes exact from P's events (index_exact 1, events applied, no gap,
           index_blocks > 0); turn 2 goes to P *for its match*
           (cache_route_hits_total{role="prefill"} of P + 1) and P's stage cache serves it
           (prefix_cache_hit_tokens_s0 grows)
  evict    prefix_cache_mb 1 (21 blocks): after turn 1 on P, distinct prompts evict P's
           blocks (Health prefix_cache_evicted_blocks_s0 > 0; removed events applied: the
           router's index of P holds at most the 21 blocks P can); turn 2 of the first
           conversation is then not sent to P for a match (no hit counted on P)
  restart  pp 2: after turns 1-2 on P, P's stage 1 is killed and restarted: stage 0 (the
           leader, same process, same boot id) re-forms the chain and clears its cache
           (a CLEARED event): the router's index of P is empty while still exact, so turn 3
           goes by load, not by the stale match; turn 4 goes for its match to wherever turn
           3 went. Without the events the router would keep P's blocks (the leader did not
           restart) and send turn 3 to P for a prefix P no longer holds.
  leader   pp 1: P's stage 0 (the leader) is killed and restarted: a new process (new boot
           id, events from 1): the router drops P's index (index_drops_total + 1), which is
           exact again from the new events, and turn 3 is not sent to P by a stale match.

usage: test_router_pfcache.py --router BIN --prefill BIN --decode BIN --tandem BIN
       --synth GGUF [--case C]
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "disagg"))
from pdlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import parse_metrics  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while seven wise owls count stars "
         "above a quiet river that winds through old hills and green fields").split()


def text(n_words, shift=0):
    return " ".join(WORDS[(i + shift) % len(WORDS)] for i in range(n_words))


def conv(k, turns):
    """Conversation k's prompt at turn `turns`: its own opening, then growing history."""
    head = f"Conversation {k} asks about item {k * 7 + 3}: " + text(60, k)
    return head + "".join(f" Turn {t}: " + text(12, t + k) for t in range(2, turns + 1))


class PfCluster(Cluster):
    def __init__(self, args, prefill):
        super().__init__(args, args.synth, prefill, [{"tp": 1}], instance_timeout_ms=60000)
        with open(self.cfg) as f:
            y = f.read()
        with open(self.cfg, "w") as f:
            f.write(y.replace("router:\n", "router:\n  routing: cache_aware\n", 1))

    def series(self, name, inst):
        m = parse_metrics(self.metrics())
        return m.get((f"tandem_router_cache_route_{name}",
                      (("instance", inst), ("role", "prefill"))), 0.0)

    def routed(self):
        """Prefill choices the router counted (for a match or by load), over the instances."""
        return sum(self.series(k, f"p{j}") for k in ("hits_total", "load_total")
                   for j in range(len(self.pf)))

    def ask(self, prompt, label):
        """Send prompt; the prefill instance that served it (router log), or None. Returns
        once /metrics (published by the router's loop now and then) counts its choice."""
        before = self.routed()
        st, body = self.complete(prompt, n=4)
        check(wait_for(lambda: self.routed() >= before + 1, 10, step=0.05),
              f"{label}: the router's metrics count the choice")
        check(st == 200, f"{label}: status {st} {str(body)[:200]}")
        rid = body.get("id", "")
        found = {}

        def look():
            m = re.search(rf"router: request {re.escape(rid)} .* prefill (\w+)", self.log("router"))
            if m:
                found["p"] = m.group(1)
            return m is not None
        wait_for(look, 20)
        return found.get("p")

    def wait_blocks(self, inst, cond, timeout=20):
        return wait_for(lambda: cond(self.series("index_blocks", inst)), timeout, step=0.1)

    def pf_health(self, inst):
        return self.health(f"tcp://127.0.0.1:{self.pf[int(inst[1:])]['port']}")


def exact_index(c, p, label):
    ok = wait_for(lambda: c.series("index_exact", p) == 1 and c.series("index_blocks", p) > 0,
                  20, step=0.1)
    check(ok, f"{label}: the router's index of {p} is exact from its KV events "
          f"(exact {c.series('index_exact', p)}, blocks {c.series('index_blocks', p)}, "
          f"events {c.series('events_total', p)})")
    check(c.series("events_total", p) > 0 and c.series("event_gaps_total", p) == 0,
          f"{label}: events applied from {p}, no gap")


def turn2_sticks(c, label, prompt1, prompt2):
    """Turn 1 somewhere (P), turn 2 to P for its match. Returns P."""
    p = c.ask(prompt1, label + " turn 1")
    check(p is not None, f"{label}: turn 1 served by prefill {p}")
    if p is None:
        return None
    exact_index(c, p, label)
    hits0 = c.series("hits_total", p)
    hit_tok0 = int(c.pf_health(p).get("prefix_cache_hit_tokens_s0", 0))
    p2 = c.ask(prompt2, label + " turn 2")
    check(p2 == p and c.series("hits_total", p) == hits0 + 1,
          f"{label}: turn 2 goes to {p} for its match (went to {p2}, hits "
          f"{hits0} -> {c.series('hits_total', p)})")
    got = {}

    def served():  # the leader's Health is a snapshot of the last 100 ms
        got["t"] = int(c.pf_health(p).get("prefix_cache_hit_tokens_s0", 0))
        return got["t"] > hit_tok0
    wait_for(served, 10, step=0.1)
    hit_tok = got.get("t", 0)
    check(hit_tok > hit_tok0, f"{label}: {p}'s stage cache served turn 2 ({hit_tok0} -> {hit_tok})")
    return p


def case_stick(args):
    label = "stick"
    with PfCluster(args, [{"pp": 1}, {"pp": 1}]) as c:
        turn2_sticks(c, label, conv(0, 1), conv(0, 2))


def case_evict(args):
    label = "evict"
    pf = {"pp": 1, "prefix_cache_mb": 1}
    with PfCluster(args, [dict(pf), dict(pf)]) as c:
        p = c.ask(conv(0, 1), label + " turn 1")
        exact_index(c, p, label)
        held = c.series("index_blocks", p)
        for k in range(1, 13):  # distinct conversations, by load over both instances
            c.ask(conv(k, 1), f"{label} filler {k}")
        ev = int(c.pf_health(p).get("prefix_cache_evicted_blocks_s0", 0))
        check(ev > held, f"{label}: {p} evicted {ev} blocks (turn 1 held {held})")
        time.sleep(0.5)  # the last events reach the router
        blocks = c.series("index_blocks", p)
        check(c.series("index_exact", p) == 1 and c.series("event_gaps_total", p) == 0 and
              0 < blocks <= 21, f"{label}: {p}'s index exact after its evictions, "
              f"{blocks} blocks (at most its 21)")
        hits0 = c.series("hits_total", p)
        p2 = c.ask(conv(0, 2), label + " turn 2")
        check(c.series("hits_total", p) == hits0,
              f"{label}: turn 2 not sent to {p} for an evicted prefix (went to {p2})")


def case_restart(args):
    label = "restart"
    with PfCluster(args, [{"pp": 2}, {"pp": 2}]) as c:
        p = turn2_sticks(c, label, conv(0, 1), conv(0, 2))
        if p is None:
            return
        drops0 = c.series("index_drops_total", p)
        c.kill(f"{p}s1")
        c.start_stage(int(p[1:]), 1)
        ok = wait_for(lambda: c.pf_health(p).get("ready") == "1", 90, step=0.2)
        check(ok, f"{label}: {p} ready again after its stage 1 restarted")
        ok = c.wait_blocks(p, lambda b: b == 0)
        check(ok and c.series("index_exact", p) == 1,
              f"{label}: {p}'s cache cleared (CLEARED event): the router's index is empty "
              f"and exact (blocks {c.series('index_blocks', p)}, exact "
              f"{c.series('index_exact', p)}, drops {drops0} -> "
              f"{c.series('index_drops_total', p)})")
        time.sleep(0.5)  # the router sees the instance alive again
        hits0 = c.series("hits_total", p)
        p3 = c.ask(conv(0, 3), label + " turn 3")
        check(c.series("hits_total", p) == hits0,
              f"{label}: turn 3 not sent to {p} by stale knowledge (went to {p3})")
        if p3:
            exact_index(c, p3, label + " after turn 3")
            h3 = c.series("hits_total", p3)
            p4 = c.ask(conv(0, 4), label + " turn 4")
            check(p4 == p3 and c.series("hits_total", p3) == h3 + 1,
                  f"{label}: turn 4 follows turn 3 to {p3} for its match (went to {p4})")


def case_leader(args):
    label = "leader"
    with PfCluster(args, [{"pp": 1}, {"pp": 1}]) as c:
        p = turn2_sticks(c, label, conv(0, 1), conv(0, 2))
        if p is None:
            return
        drops0 = c.series("index_drops_total", p)
        c.kill(f"{p}s0")
        c.start_stage(int(p[1:]), 0)
        ok = wait_for(lambda: c.pf_health(p).get("ready") == "1", 90, step=0.2)
        check(ok, f"{label}: {p} ready again after its leader restarted")
        ok = wait_for(lambda: c.series("index_drops_total", p) > drops0 and
                      c.series("index_exact", p) == 1 and c.series("index_blocks", p) == 0,
                      20, step=0.1)
        check(ok, f"{label}: a new leader process (boot id): {p}'s index dropped "
              f"({drops0} -> {c.series('index_drops_total', p)}), exact again from its new "
              f"events (exact {c.series('index_exact', p)}, blocks "
              f"{c.series('index_blocks', p)})")
        time.sleep(0.5)
        hits0 = c.series("hits_total", p)
        p3 = c.ask(conv(0, 3), label + " turn 3")
        check(c.series("hits_total", p) == hits0,
              f"{label}: turn 3 not sent to {p} by stale knowledge (went to {p3})")


CASES = {"stick": case_stick, "evict": case_evict, "restart": case_restart,
         "leader": case_leader}


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "prefill", "decode", "tandem", "synth"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--case", default="all", choices=["all"] + list(CASES))
    args = ap.parse_args()
    for name, fn in CASES.items():
        if args.case in ("all", name):
            t0 = time.time()
            fn(args)
            print(f"case {name}: {time.time() - t0:.1f} s", flush=True)
    if FAILS:
        print(f"{len(FAILS)} checks failed", flush=True)
        return 1
    print("all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
