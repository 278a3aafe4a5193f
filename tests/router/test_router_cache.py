#!/usr/bin/env python3
"""test_router_cache.py: cache-aware routing end to end, two tp1 decode instances on the
synthetic model (colocated).
  stick    router.routing: cache_aware; 4 conversations of 5 turns (growing prefixes, each
           turn's prompt = the previous one + a new line), each round's turns sent at once:
           every turn after the first lands where the conversation's first turn did, by
           cache (tandem_router_cache_route_hits_total), and both instances are used
  spread   the same workload with the default routing (load): turns of one conversation land
           on both instances; no cache series in /metrics
  restart  cache_aware: the instance holding a conversation is killed and restarted (the
           router's instance timeout is long, so it is the restart that is noticed, not a
           death): its index is dropped (index_drops_total, index_blocks 0) and the next turn
           is routed by load, not by the stale match; the turn after goes by cache to
           wherever that one went
  KV events (stick, restart): the decode nodes report the blocks their caches store and
           evict (Health.kv_event_*): each instance's index is exact
           (tandem_router_cache_route_index_exact 1, events applied, no gap), and after one
           request it holds exactly the whole blocks the node computed, prompt and
           generated tokens ((prompt + completion - 1) // block_size: the estimate would
           hold the prompt's only); after the restart, exact again from the new process

usage: test_router_cache.py --router BIN --decode BIN --tandem BIN --synth GGUF [--case C]
"""
import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from rtlib import Cluster, post  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import parse_metrics  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402

N_CONV, N_TURNS = 4, 5
# first turns long against the later additions: a turn's match (the previous turn's whole
# blocks) is well above the default cache_threshold (0.5) of its prompt
_STORY = (" Every morning the painter mixed colors and the robot watched. Explain why the sky"
          " is blue: sunlight is scattered by the molecules of the air, and blue light is"
          " scattered more than red light. Write a haiku about the sea.")
FIRST = ["The robot lived in a workshop with an old painter." + _STORY,
         "A spider has eight legs; how many legs do two spiders have?" + _STORY,
         "Numbers like 12, 345 and 2024 are split into digits." + _STORY,
         "Waves fold into light, salt wind carries the gull's cry." + _STORY]
TURN = " Turn {k}: why?"


def prompt(conv, turns):
    """Conversation conv's prompt at its turn `turns` (1-based): a growing prefix."""
    return FIRST[conv] + "".join(TURN.format(k=k) for k in range(2, turns + 1))


def metrics(cl):
    with urllib.request.urlopen(f"{cl.url}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def cache_series(m, name, inst):
    return m.get((f"tandem_router_cache_route_{name}",
                  (("instance", inst), ("role", "decode"))), 0.0)


def served_by(cl, rid, timeout=20):
    """The decode instance of request rid, from the router's one line per request."""
    pat = re.compile(rf"router: request {re.escape(rid)} .* decode (\w+)")
    found = {}

    def look():
        with open(os.path.join(cl.dir, "router.log"), errors="replace") as f:
            m = pat.search(f.read())
        if m:
            found["i"] = m.group(1)
        return m is not None
    wait_for(look, timeout)
    return found.get("i")


BLOCK = 16  # the decode instances' block_size (the default)
USAGE = {}  # request id -> its usage


def one(cl, conv, turn, out):
    body = {"prompt": prompt(conv, turn), "max_tokens": 160, "temperature": 0,
            "ignore_eos": True}
    st, _, data = post(cl.http_port, "/v1/completions", body)
    out[conv] = json.loads(data)["id"] if st == 200 else None
    if st == 200:
        USAGE[out[conv]] = json.loads(data)["usage"]
    check(st == 200, f"conversation {conv} turn {turn}: status {st}")


def run_round(cl, turn, order):
    """Turn `turn` of every conversation at once (released together, posted in `order` a
    millisecond apart: the load order spreads them by the router's own counts, the health
    figures being the same); {conv: instance}."""
    ids = {}
    ths = []
    start = threading.Barrier(len(order))
    def post_at(conv, delay):
        start.wait(30)
        time.sleep(delay)
        one(cl, conv, turn, ids)
    for k, conv in enumerate(order):
        th = threading.Thread(target=post_at, args=(conv, 0.002 * k))
        th.start()
        ths.append(th)
    for th in ths:
        th.join(120)
    return {c: served_by(cl, ids[c]) if ids.get(c) else None for c in order}


def kv_free(cl):
    m = metrics(cl)
    return [m.get(("tandem_instance_kv_blocks_free", (("instance", i),)), -1) for i in ("d0", "d1")]


def workload(cl):
    """{conv: [instance of turn 1, turn 2, ...]}; each round starts one conversation later
    (under the load order a conversation then changes place in the sequence)."""
    # the load order compares the free KV blocks of the last health answers first: wait
    # until both idle instances report the same, so the first round spreads by the
    # router's own counts
    same = wait_for(lambda: len(set(kv_free(cl))) == 1 and kv_free(cl)[0] > 0, 30)
    print("kv_blocks_free before the first round:", kv_free(cl), flush=True)
    check(same, "both instances report the same free KV blocks before the first round")
    where = {c: [] for c in range(N_CONV)}
    for turn in range(1, N_TURNS + 1):
        order = [(turn - 1 + k) % N_CONV for k in range(N_CONV)]
        for c, inst in run_round(cl, turn, order).items():
            where[c].append(inst)
    return where


def case_stick(args):
    with Cluster(args, args.synth, n_decode=2, router_extra={"routing": "cache_aware"}) as cl:
        where = workload(cl)
        print("cache_aware:", where, flush=True)
        for c, insts in where.items():
            check(None not in insts and len(set(insts)) == 1,
                  f"stick: conversation {c} stays on one instance ({insts})")
        used = {i for insts in where.values() for i in insts}
        check(used == {"d0", "d1"}, f"stick: both instances are used ({used})")
        m = metrics(cl)
        hits = sum(cache_series(m, "hits_total", i) for i in ("d0", "d1"))
        load = sum(cache_series(m, "load_total", i) for i in ("d0", "d1"))
        toks = sum(cache_series(m, "matched_tokens_total", i) for i in ("d0", "d1"))
        check(hits == N_CONV * (N_TURNS - 1) and load == N_CONV,
              f"stick: {hits:g} requests routed by cache, {load:g} by load")
        check(toks > 0 and all(cache_series(m, "index_blocks", i) > 0 for i in ("d0", "d1")),
              f"stick: matched tokens counted ({toks:g}), both indexes hold blocks")
        ev = [(cache_series(m, "index_exact", i), cache_series(m, "events_total", i),
               cache_series(m, "event_gaps_total", i)) for i in ("d0", "d1")]
        check(all(x == 1 and n > 0 and g == 0 for x, n, g in ev),
              f"stick: both indexes fed by KV events, exact, no gap ((exact, events, gaps): {ev})")
        check(cl.stop() == 0, "stick: router exits 0")


def case_spread(args):
    with Cluster(args, args.synth, n_decode=2) as cl:  # the default routing: load
        where = workload(cl)
        print("load:", where, flush=True)
        moved = [c for c, insts in where.items() if len(set(insts)) > 1]
        check(all(None not in v for v in where.values()) and moved,
              f"spread: with load routing conversations change instance ({moved})")
        names = {k[0] for k in metrics(cl)}
        check(not any(n.startswith("tandem_router_cache_route_") for n in names),
              "spread: no cache-aware series with load routing")
        check(cl.stop() == 0, "spread: router exits 0")


def turn(cl, conv, k, out=None):
    out = {} if out is None else out
    one(cl, conv, k, out)
    return served_by(cl, out[conv]) if out.get(conv) else None


def check_exact(cl, inst, other, rid, what):
    """After request rid alone on inst, a fresh process: the router's index of inst holds
    exactly the whole blocks the node computed (prompt and generated tokens but the last),
    as its KV events said; the other instance's is exact and empty."""
    u = USAGE.get(rid, {})
    want = (u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) - 1) // BLOCK
    est = u.get("prompt_tokens", 0) // BLOCK  # what the router's estimate would hold
    got = {}

    def settled():  # the events come with the node's next Health
        m = metrics(cl)
        got["v"] = [(cache_series(m, "index_blocks", i), cache_series(m, "index_exact", i),
                     cache_series(m, "event_gaps_total", i)) for i in (inst, other)]
        # both: the other instance's index turns exact with its own first Health's events
        return got["v"][0] == (want, 1.0, 0.0) and got["v"][1][:2] == (0.0, 1.0)
    ok = wait_for(settled, 10)
    print(f"{what}: usage {u}, index (blocks, exact, gaps) of {inst}, {other}: {got.get('v')}",
          flush=True)
    check(ok and want > est and got["v"][1][:2] == (0.0, 1.0),
          f"{what}: {inst}'s index holds exactly the {want} blocks its node stored "
          f"(the estimate: {est}), {other}'s is exact and empty ({got.get('v')})")


def case_restart(args):
    # a long instance timeout: the restart is noticed by the new boot id / event epoch
    with Cluster(args, args.synth, n_decode=2, instance_timeout_ms=60000,
                 router_extra={"routing": "cache_aware"}) as cl:
        out = {}
        first = turn(cl, 0, 1, out)
        if first:
            check_exact(cl, first, "d1" if first == "d0" else "d0", out[0], "restart: turn 1")
        check(turn(cl, 0, 2) == first and turn(cl, 0, 3) == first,
              f"restart: conversation 0 stays on {first}")
        h = int(first[1])
        m0 = metrics(cl)
        check(cache_series(m0, "index_blocks", first) > 0, "restart: its index holds blocks")
        cl.kill_decode(h)
        cl.start_decode(h)
        dropped = wait_for(lambda: cache_series(metrics(cl), "index_drops_total", first) >= 1, 60)
        check(dropped, f"restart: {first}'s index dropped after its restart")
        check(cache_series(metrics(cl), "index_blocks", first) == 0,
              f"restart: {first}'s index is empty")
        check(wait_for(lambda: cl.status("/health") == 200, 60) and
              wait_for(lambda: metrics(cl).get(("tandem_instance_up", (("instance", first),)))
                       == 1.0, 60), f"restart: {first} serves again")
        m1 = metrics(cl)
        nxt = turn(cl, 0, 4)
        m2 = metrics(cl)
        hits = [cache_series(m2, "hits_total", i) - cache_series(m1, "hits_total", i)
                for i in ("d0", "d1")]
        load = [cache_series(m2, "load_total", i) - cache_series(m1, "load_total", i)
                for i in ("d0", "d1")]
        m_ev = metrics(cl)
        check(cache_series(m_ev, "index_exact", first) == 1.0,
              f"restart: {first}'s index is exact again, from the new process's events")
        check(nxt is not None and hits == [0, 0] and sum(load) == 1,
              f"restart: the next turn went by load to {nxt}, not by stale knowledge "
              f"(hits {hits}, load {load})")
        again = turn(cl, 0, 5)
        m3 = metrics(cl)
        check(again == nxt and cache_series(m3, "hits_total", nxt) ==
              cache_series(m2, "hits_total", nxt) + 1,
              f"restart: the turn after goes by cache where the prefix now is ({again})")
        check(cl.stop() == 0, "restart: router exits 0")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--case", default="all")
    args = ap.parse_args()
    t0 = time.time()
    cases = ["stick", "spread", "restart"] if args.case == "all" else args.case.split(",")
    for c in cases:
        t = time.time()
        {"stick": case_stick, "spread": case_spread, "restart": case_restart}[c](args)
        print(f"case {c}: {time.time() - t:.1f} s", flush=True)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
