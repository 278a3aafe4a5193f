#!/usr/bin/env python3
"""test_prefix_cache.py: the prefill stages' prefix cache (issue 16 item 3) end to end:
tandem-router, tandem-prefill stages and tandem-decode ranks as real processes on loopback.

Cases (--case NAME runs one):
  hit      turn 2 of a conversation (its prompt extends turn 1's) takes turn 1's whole blocks
           from every stage's cache (usage.prompt_tokens_details.cached_tokens > 0) and its
           greedy output equals `tandem generate` (a cold run) token for token: synthetic
           llama at prefill pp 1/2/3 x decode tp 1/2; the default model at pp 2; a repeated
           prompt hits too; a prompt sent again, of whole blocks or with a tail, is cached to
           its last token (cached_tokens = prompt_tokens - 1: the stages copy its last block,
           whole or the cached tail, and compute one token) and stays exact; with
           prefix_cache: false on both nothing is cached; and the decode instance, which
           decoded turn 1, holds its blocks: turn 2's Alloc shares them and the
           stages push only the rest (the decode log's "N held here", the router's
           tandem_kv_transfer_bytes: exactly the rest's share of the bytes a whole push moves);
  evict    a 1 MiB cache (21 blocks of the synthetic llama at pp 1): conversations that do
           not fit evict each other (Health counts evictions), every output stays exact;
  restart  a prefill stage killed and restarted (its cache is gone): the chain re-forms, the
           stages start with empty caches, the next turn is exact (a miss on the stages; its
           cached_tokens are what the decode side held), the one after hits again;
  abort    a client leaves while its cached prefix is being pushed (a long prompt hitting a
           cached prefix, whose Alloc shares the decode side's blocks): no block stays held,
           and the same request afterwards hits and is exact;
  dcrestart the decode rank killed and restarted (its cache is gone): the next turn's Alloc
           holds nothing (the whole prompt is pushed) and is exact, the one after holds again.
After every case every instance reports no request and no KV block in use.

usage: test_prefix_cache.py --router BIN --prefill BIN --decode BIN --tandem BIN
                            --synth-dir DIR [--model GGUF] [--case NAME]
"""
import argparse
import http.client
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from pdlib import Cluster, generate_text  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while seven wise owls count stars "
         "above a quiet river that winds through old hills and green fields").split()
OTHER = ("a small red boat sails past the harbour wall as gulls circle over fishing nets "
         "and children run along the sandy shore").split()


def text(n_words, words=WORDS):
    return " ".join(words[i % len(words)] for i in range(n_words))


_WANT = {}


def want(args, model, prompt, n=12):
    if (model, prompt, n) not in _WANT:
        _WANT[(model, prompt, n)] = generate_text(args, model, prompt, n)
    return _WANT[(model, prompt, n)]


def ask(c, prompt, n=12):
    st, body = c.complete(prompt, n)
    if st != 200:
        return None, None, f"status {st}: {str(body)[:300]}"
    u = body.get("usage", {})
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    return body["choices"][0]["text"], cached, u.get("prompt_tokens")


def exact(c, args, model, prompt, label, hit=None, n=12):
    """The output equals generate's; hit True: some cached tokens, False: none."""
    got, cached, ptok = ask(c, prompt, n)
    w = want(args, model, prompt, n)
    ok = got == w and (hit is None or (hit and cached and cached > 0) or
                       (hit is False and cached == 0))
    check(ok, f"{label}: {ptok} prompt tokens, {cached} cached: equal to generate"
          + ("" if got == w else f" ({got!r} vs {w!r})"))
    return cached


def idle(c, label):
    ok, hs = c.wait_idle()
    check(ok, f"{label}: every instance idle, no KV block held: {hs}")


def health(c):
    h = c.prefill_health()
    return h


def kv_bytes(c):
    """(sum, count) of the router's tandem_kv_transfer_bytes: KV bytes pushed per prefill."""
    m = c.metrics()
    got = [re.search(rf"^tandem_kv_transfer_bytes_{k}\S* (\S+)$", m, re.M) for k in ("sum", "count")]
    return (float(got[0].group(1)), int(got[1].group(1))) if all(got) else (0.0, 0)


def arrivals(c, key="d0r0"):
    """(prompt tokens, positions held) of each transfer the decode leader saw arrive."""
    return [(int(a), int(b)) for a, b in
            re.findall(r"KV of (\d+) tokens from \d+ stages arrived \((\d+) held here", c.log(key))]


def pushed(c, n):
    """Wait until n prefills reported their bytes; their sum."""
    got = []

    def done():
        got[:] = [kv_bytes(c)]
        return got[0][1] >= n
    wait_for(done, 10, step=0.2)
    return got[0][0]


def check_partial(c, label, before, n_done):
    """The last transfer (the n_done-th) held a prefix and pushed exactly the rest's share of
    the bytes per token the first (turn 1, nothing held) pushed. before: bytes until then."""
    arr = arrivals(c)
    total = pushed(c, n_done)
    if not check(len(arr) >= n_done, f"{label}: {len(arr)} transfers arrived, {n_done} expected"):
        return 0
    (n1, h1), (n, h) = arr[0], arr[n_done - 1]
    first = kv_bytes_first[id(c)]
    got = total - before
    check(h1 == 0 and h > 0 and abs(got * n1 - first * (n - h)) < 1e-6 * first * n,
          f"{label}: {h} of {n} positions held by the decode instance, {got:.0f} bytes pushed "
          f"(turn 1: {first:.0f} for {n1}; a whole push: {first * n / n1:.0f})")
    return h


kv_bytes_first = {}


def partial_turns(c, args, model, t1, t2, label):
    """Turn 1, turn 2 (a hit on both sides, the push partial), turn 2 again (more held)."""
    exact(c, args, model, t1, label + " turn 1", hit=False)
    kv_bytes_first[id(c)] = pushed(c, 1)
    cached = exact(c, args, model, t2, label + " turn 2", hit=True)
    h2 = check_partial(c, label + " turn 2", kv_bytes_first[id(c)], 2)
    check(cached is not None and cached >= h2,
          f"{label}: turn 2's cached_tokens {cached} >= the {h2} the decode side held")
    before = pushed(c, 2)
    again = exact(c, args, model, t2, label + " turn 2 again", hit=True)
    h3 = check_partial(c, label + " turn 2 again", before, 3)
    check(h3 > h2, f"{label}: turn 2 again holds more (turn 2's answer too): {h3} > {h2}")
    return cached, again


def repeats(c, args, model, label, bs=16):
    """A prompt of whole blocks and one with a tail (a last partial block of >= 2 tokens),
    each sent again: the second run is cached to its last token (every stage copies the last
    block, whole or the cached tail, and computes that token) and is exact."""
    found = {}
    for n in range(40, 80):  # the first word counts whose prompts have each shape
        prompt = text(n, OTHER)
        got, cached, ptok = ask(c, prompt)
        if got is None:
            break
        shape = "whole blocks" if ptok % bs == 0 else "a tail" if ptok % bs >= 2 else None
        if shape and shape not in found:
            found[shape] = (prompt, ptok)
            check(got == want(args, model, prompt), f"{label}: {shape}: the first run is exact")
        if len(found) == 2:
            break
    for shape in ("whole blocks", "a tail"):
        if not check(shape in found, f"{label}: a prompt of {shape} among the probes"):
            continue
        prompt, ptok = found[shape]
        cached = exact(c, args, model, prompt, f"{label} {shape} again", hit=True)
        check(cached == ptok - 1, f"{label}: {shape}: cached to its last token: {cached} of {ptok}")


def conversation(n1, n2, words=WORDS):
    t1 = text(n1, words)
    return t1, t1 + " " + text(n2, OTHER)


def case_hit(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    t1, t2 = conversation(90, 40)
    for pp in (1, 2, 3):
        for tp in (1, 2):
            label = f"hit synth pp{pp} tp{tp}"
            with Cluster(args, model, [{"pp": pp, "chunk": 64}], [{"tp": tp}]) as c:
                cached, again = partial_turns(c, args, model, t1, t2, label)
                check(again and cached and again > cached,
                      f"{label}: the repeated prompt hits turn 2's blocks too ({cached}, {again})")
                hits = []

                def counted():  # Health is republished every 100 ms
                    h = health(c)
                    hits[:] = [int(h.get(f"prefix_cache_hit_tokens_s{s}", -1)) for s in range(pp)]
                    return all(x == cached + again for x in hits)
                wait_for(counted, 5, step=0.2)
                check(all(x == cached + again for x in hits),
                      f"{label}: every stage's Health counts the hit tokens ({hits})")
                repeats(c, args, model, label)
                idle(c, label)
    label = "hit synth prefix_cache off"
    with Cluster(args, model, [{"pp": 2, "chunk": 64, "prefix_cache": False}],
                 [{"tp": 1, "prefix_cache": False}]) as c:
        exact(c, args, model, t1, label + " turn 1", hit=False)
        exact(c, args, model, t2, label + " turn 2", hit=False)
        check([h for _, h in arrivals(c)] == [0, 0], f"{label}: nothing held: {arrivals(c)}")
        idle(c, label)
    # the stages compute the whole prompt (no cache there), the decode side holds turn 1
    label = "hit synth prefill cache off, decode on"
    with Cluster(args, model, [{"pp": 2, "chunk": 64, "prefix_cache": False}],
                 [{"tp": 2}]) as c:
        partial_turns(c, args, model, t1, t2, label)
        idle(c, label)
    if args.model and os.path.exists(args.model):
        label = "hit default pp2"
        t1, t2 = conversation(120, 30)
        with Cluster(args, args.model, [{"pp": 2, "chunk": 64}], [{"tp": 1}]) as c:
            partial_turns(c, args, args.model, t1, t2, label)
            idle(c, label)


def case_evict(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = "evict synth pp1 1 MiB"
    a1, a2 = conversation(110, 20)
    b1, b2 = conversation(110, 20, OTHER)
    with Cluster(args, model, [{"pp": 1, "chunk": 64, "prefix_cache_mb": 1}],
                 [{"tp": 1}]) as c:
        exact(c, args, model, a1, label + " A turn 1", hit=False)
        exact(c, args, model, a2, label + " A turn 2", hit=True)
        exact(c, args, model, b1, label + " B turn 1", hit=False)
        exact(c, args, model, b2, label + " B turn 2", hit=True)
        exact(c, args, model, a2, label + " A turn 2 again (evicted in part)")
        h = health(c)
        ev = int(h.get("prefix_cache_evicted_blocks_s0", 0))
        check(ev > 0, f"{label}: Health counts evictions ({ev})")
        idle(c, label)


def case_restart(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = "restart synth pp2"
    t1, t2 = conversation(90, 30)
    t3 = t2 + " " + text(20)
    with Cluster(args, model, [{"pp": 2, "chunk": 64}], [{"tp": 1}]) as c:
        exact(c, args, model, t1, label + " turn 1", hit=False)
        exact(c, args, model, t2, label + " turn 2", hit=True)
        c.kill("p0s1")
        c.start_stage(0, 1)
        deadline = time.time() + 60
        while time.time() < deadline and health(c).get("ready") != "1":
            time.sleep(0.2)
        time.sleep(1.0)  # the router sees the instance ready again
        # a miss on the stages; the decode instance still holds turn 2 (usage reports that)
        cached = exact(c, args, model, t3, label + " turn 3 after the restart")
        held = arrivals(c)[-1][1]
        check(held > 0 and cached == held,
              f"{label}: turn 3's cached_tokens {cached} are the decode side's {held}")
        exact(c, args, model, t3 + " " + text(5, OTHER), label + " turn 4", hit=True)
        idle(c, label)


def case_abort(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = "abort synth pp2"
    t1, t2 = conversation(70, 50)
    with Cluster(args, model, [{"pp": 2, "chunk": 64}], [{"tp": 1}]) as c:
        exact(c, args, model, t1, label + " turn 1", hit=False)
        dc_hits = dc_hit_tokens(c)
        for delay in (0.02, 0.05, 0.1, 0.2):
            h = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
            h.request("POST", "/v1/completions",
                      json.dumps({"prompt": t2, "max_tokens": 64, "temperature": 0,
                                  "stream": True}).encode(),
                      {"Content-Type": "application/json"})
            time.sleep(delay)
            h.close()  # the client leaves: the router cancels on both sides
        idle(c, label + " after the aborts")
        hits = int(health(c).get("prefix_cache_hit_tokens_s1", 0))
        check(hits > 0, f"{label}: the aborted requests took cached blocks ({hits} tokens)")
        more = []
        wait_for(lambda: more.append(dc_hit_tokens(c)) or more[-1] > dc_hits, 5, step=0.2)
        check(more and more[-1] > dc_hits,
              f"{label}: the aborted requests' Allocs shared the decode side's blocks "
              f"({dc_hits} -> {more[-1] if more else None} hit tokens)")
        exact(c, args, model, t2, label + " the same request afterwards", hit=True)
        idle(c, label)


def dc_hit_tokens(c):
    m = re.search(r'^vllm:prefix_cache_hits_total\{.*instance="d0"\} (\S+)$', c.metrics(), re.M)
    return float(m.group(1)) if m else -1.0


def case_dcrestart(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = "dcrestart synth pp2"
    t1, t2 = conversation(90, 30)
    t3 = t2 + " " + text(20)
    with Cluster(args, model, [{"pp": 2, "chunk": 64}], [{"tp": 1}]) as c:
        exact(c, args, model, t1, label + " turn 1", hit=False)
        exact(c, args, model, t2, label + " turn 2", hit=True)
        n_before = len(arrivals(c))
        check(n_before == 2 and arrivals(c)[1][1] > 0, f"{label}: turn 2 held a prefix: "
              f"{arrivals(c)}")
        c.kill("d0r0")
        c.start_rank(0, 0)
        deadline = time.time() + 60
        while time.time() < deadline and c.decode_health().get("ready") != "1":
            time.sleep(0.2)
        time.sleep(1.0)  # the router sees the instance ready again
        exact(c, args, model, t3, label + " turn 3 after the restart", hit=True)  # prefill hits
        arr = arrivals(c)[n_before:]  # the log goes on across the restart
        check(len(arr) == 1 and arr[0][1] == 0,
              f"{label}: the restarted decode rank held nothing for turn 3: {arr}")
        exact(c, args, model, t3 + " " + text(5, OTHER), label + " turn 4", hit=True)
        arr = arrivals(c)[n_before:]
        check(len(arr) == 2 and arr[1][1] > 0, f"{label}: turn 4 held a prefix again: {arr}")
        idle(c, label)


CASES = {"hit": case_hit, "evict": case_evict, "restart": case_restart, "abort": case_abort,
         "dcrestart": case_dcrestart}


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "prefill", "decode", "tandem", "synth-dir"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--case", default="")
    args = ap.parse_args()
    for name, fn in CASES.items():
        if args.case and name != args.case:
            continue
        print(f"== {name}", flush=True)
        try:
            fn(args)
        except Exception as e:  # a crashed case is a failure, the others still run
            check(False, f"{name}: {type(e).__name__}: {e}")
    print(f"{len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
