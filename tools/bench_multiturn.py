#!/usr/bin/env python3
"""bench_multiturn.py: the multi-turn chat benchmark of issue 16 (prefix caching) for BENCHMARKS.md.

Several conversations run at once, each TURNS turns long, all with the same system prompt; each
turn appends the model's answer and a new user message to the history, so turn k's prompt
extends turn k-1's. Requests are streamed chat completions (raw HTTP, one connection per
request); TTFT is the time from sending the request to the first chunk with content.

Configurations, each a fresh cluster started with `tandem up -d` from YAML written here (one
compute thread per process, the same model file, the same workload):
  pd_on     disaggregated: router (routing load) + prefill p0 (pp 2) + decode d0, d1 (tp 1),
            prefill[].prefix_cache and decode[].prefix_cache true
  pd_off    the same with both caches off
  pd_aware  pd_on with router.routing cache_aware (decode and prefill instances chosen by
            prefix; with one prefill instance only the decode choice can differ)
  co_aware  colocated: router + decode d0, d1 (tp 1), decode prefix cache on,
            router.routing cache_aware
  co_load   the same with router.routing load (the most free KV blocks, then the fewest
            requests: conversations move between the instances, round robin-like)
  co_off    colocated, routing load, decode prefix cache off (not in the default set)
  co_rr     colocated, decode prefix cache on, router.routing round_robin (instances in
            turn: the plain balancer the issue measures cache-aware routing against)
  pd_rr     pd_on with router.routing round_robin
  co_aware_b1  co_aware with router.cache_aware.balance_abs_threshold 1 (not in the default
            set): the balance test at 1 request of difference instead of 32
--decode-instances N (default 2) sets the number of decode instances of every configuration.
--prefill-instances N gives the pd_* clusters N prefill instances (p0.., pp --prefill-pp
each, default 2), so that prefill routing matters too (pd_aware: by the prefill leaders' KV
events, docs/prefix-cache.md "KV events").
--think-ms MEAN: independent arrivals: before each of its turns after the first, a
conversation waits a think time drawn from an exponential distribution of mean MEAN ms
(seeded per conversation: the same waits in every configuration; --seed changes them), so
the conversations drift apart and round robin is not locked in step with them (0: none, the
next turn goes as soon as the answer is in).
Rounds alternate the configurations (A B C D, A B C D, ...), so drift hits all of them.

Per configuration and round: TTFT p50/p99 of turns 2+ (seconds), output tok/s (completion
tokens over the round's wall time), hit rate (cached_tokens / prompt_tokens over turns 2+,
from usage.prompt_tokens_details), (disaggregated) the prefill hit rate (prompt tokens the
prefill instances' stage caches served, from their Health, over the prompt tokens of turns
2+: what the choice of the prefill instance saves), mean prompt tokens of turn 1 and of the last turn, and
(disaggregated) the KV bytes the prefill stages pushed per request (all turns, from the
router's tandem_kv_transfer_bytes). At the
end: the medians over rounds and the ratios pd_off/pd_on and co_load/co_aware (TTFT p50,
medians of the per-round ratios).

usage: tools/bench_multiturn.py [--build build] [--model GGUF] [--rounds 2] [--convs 4]
         [--turns 6] [--system-words 300] [--user-words 20] [--max-tokens 24]
         [--configs pd_on,pd_off,co_aware,co_load] [--prefill-instances 1] [--prefill-pp 2]
         [--think-ms 0] [--seed 0] [--json FILE] [--keep]
       tools/bench_multiturn.py --smoke --build build --model SYNTH.gguf
         (one round, 2 conversations x 3 turns, short prompts; checks that every request
          succeeds, that cached_tokens is 0 with the caches off and > 0 on turns 2+ with them
          on; exit 1 otherwise: the ctest deploy_bench_multiturn_smoke)
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education river garden winter summer market letter paper music window table mountain "
         "bread light stone field paint robot engine bridge valley island forest").split()

CONFIGS = {
    "pd_on": dict(disagg=True, cache=True, routing="load"),
    "pd_off": dict(disagg=True, cache=False, routing="load"),
    "pd_aware": dict(disagg=True, cache=True, routing="cache_aware"),
    "co_aware": dict(disagg=False, cache=True, routing="cache_aware"),
    "co_load": dict(disagg=False, cache=True, routing="load"),
    "co_off": dict(disagg=False, cache=False, routing="load"),
    "co_rr": dict(disagg=False, cache=True, routing="round_robin"),
    "pd_rr": dict(disagg=True, cache=True, routing="round_robin"),
    "co_aware_b1": dict(disagg=False, cache=True, routing="cache_aware", balance_abs=1),
}


_PORT_RNG = random.Random()  # its own, unseeded: the workload's seeds stay reproducible
_PORTS_GIVEN = set()


def free_port():
    """A loopback port free now, never one this process handed out before (nothing binds a
    chosen port until `tandem up`, so two picks of the kernel's "any free port" could be the
    same: a prefill instance once got its decode instance's control port), and below the
    kernel's ephemeral range (32768 up), so no outgoing connection takes it meanwhile (as
    tests/tdtest/ports.py)."""
    for _ in range(1000):
        p = _PORT_RNG.randint(20000, 32700)
        if p in _PORTS_GIVEN:
            continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            s.close()
        _PORTS_GIVEN.add(p)
        return p
    raise RuntimeError("no free loopback port below 32700")


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Cluster:
    """One configuration's cluster, started with `tandem up -d` and stopped with `tandem down`."""

    def __init__(self, args, name, conf):
        self.args, self.name = args, name
        self.dir = tempfile.mkdtemp(prefix=f"tandem-bench-mt-{name}-")
        self.port = free_port()
        self.cfg = os.path.join(self.dir, "cluster.yaml")
        with open(self.cfg, "w") as f:
            f.write(self.yaml(conf))
        self.env = dict(os.environ, TANDEM_BIN=os.path.abspath(os.path.join(args.build, "bin")))
        self.tandem = os.path.join(args.build, "bin", "tandem")

    def prefill_hit_tokens(self):
        """Prompt tokens the prefill instances' stage 0 caches served (Health), or None."""
        total = None
        for port in self.pf_ports:
            r = subprocess.run([self.tandem, "client", "--url", f"tcp://127.0.0.1:{port}",
                                "--health"], capture_output=True, text=True, timeout=30)
            m = re.search(r"prefix_cache_hit_tokens_s0 (\d+)", r.stdout)
            if m:
                total = (total or 0) + int(m.group(1))
        return total

    def yaml(self, c):
        a, on = self.args, "true" if c["cache"] else "false"
        self.pf_ports = []
        y = [f"model: {a.model}", f"run_dir: {self.dir}/run", "router:",
             f"  listen: 127.0.0.1:{self.port}", f"  routing: {c['routing']}",
             "  max_prompt_tokens: 16384"]
        if "balance_abs" in c:
            y += ["  cache_aware:", f"    balance_abs_threshold: {c['balance_abs']}"]
        y.append("decode:")
        for i in range(a.decode_instances):
            y += [f"  - name: d{i}", "    tp: 1", "    threads: 1", f"    kv_blocks: {a.kv_blocks}",
                  "    max_batch: 16", "    step_tokens: 256", f"    prefix_cache: {on}",
                  f"    port: {free_port()}"]
        if c["disagg"]:
            y.append("prefill:")
            for j in range(a.prefill_instances):
                self.pf_ports.append(free_port())
                y += [f"  - name: p{j}", f"    pp: {a.prefill_pp}", "    threads: 1",
                      "    chunk_size: 256",
                      "    dynamic_chunking: false", "    profile_budget_ms: 0",
                      "    kv_tokens: 8192", f"    prefix_cache: {on}",
                      f"    prefix_cache_mb: {a.prefix_cache_mb}", f"    port: {self.pf_ports[-1]}"]
            y += ["kvxfer:", "  ucx_tls: posix,cma,self", "  timeout_ms: 120000"]
        return "\n".join(y) + "\n"

    def up(self):
        r = subprocess.run([self.tandem, "up", "-d", self.cfg, "--timeout", "240"], env=self.env,
                           capture_output=True, text=True, timeout=300)
        if r.returncode:
            self.down()
            raise RuntimeError(f"{self.name}: tandem up failed: {r.stderr.strip()[-800:]}")

    def down(self):
        subprocess.run([self.tandem, "down", self.cfg], env=self.env, capture_output=True,
                       timeout=180)
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def chat(port, messages, max_tokens):
    """One streamed chat completion: (ttft s, total s, answer text, usage dict)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, parts, usage = None, [], None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(piece)
    total = time.perf_counter() - t0
    c.close()
    if ttft is None or usage is None:
        raise RuntimeError(f"no content or no usage (ttft {ttft}, usage {usage})")
    return ttft, total, "".join(parts), usage


def conversation(args, port, system, k, out):
    rng = random.Random(1000 + k)
    think = random.Random(args.seed * 7919 + 5000 + k)  # apart from the text: same prompts
    msgs = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        if turn and args.think_ms > 0:
            time.sleep(think.expovariate(1000.0 / args.think_ms))
        msgs.append({"role": "user", "content": f"Question {turn + 1}: {text(rng, args.user_words)}?"})
        ttft, total, answer, usage = chat(port, msgs, args.max_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append({"conv": k, "turn": turn + 1, "ttft": ttft, "total": total,
                    "prompt": usage["prompt_tokens"], "cached": cached,
                    "completion": usage["completion_tokens"]})
        msgs.append({"role": "assistant", "content": answer})


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def workload(args, port):
    system = "You are a helpful assistant. " + text(random.Random(7), args.system_words)
    out, errs = [], []

    def run(k):
        try:
            conversation(args, port, system, k, out)
        except Exception as e:  # reported, fails the round
            errs.append(f"conversation {k}: {e}")

    t0 = time.perf_counter()
    ths = [threading.Thread(target=run, args=(k,)) for k in range(args.convs)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    if errs:
        raise RuntimeError("; ".join(errs))
    later = [r for r in out if r["turn"] >= 2]
    return {"ttft_p50": statistics.median(r["ttft"] for r in later),
            "ttft_p99": pct([r["ttft"] for r in later], 99),
            "ttft1_p50": statistics.median(r["ttft"] for r in out if r["turn"] == 1),
            "out_tok_s": sum(r["completion"] for r in out) / wall,
            "hit_rate": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
            "prompt_t1": statistics.mean(r["prompt"] for r in out if r["turn"] == 1),
            "prompt_last": statistics.mean(r["prompt"] for r in out if r["turn"] == args.turns),
            "wall_s": wall, "requests": out}


def kv_bytes_per_request(port):
    """The router's tandem_kv_transfer_bytes sum / count (KV bytes the prefill stages pushed
    per request; disaggregated only), or None."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode(errors="replace")
    c.close()
    got = {}
    for line in text.splitlines():
        for k in ("sum", "count"):
            if line.startswith(f"tandem_kv_transfer_bytes_{k}"):
                got[k] = float(line.rsplit(" ", 1)[1])
    return got["sum"] / got["count"] if got.get("count") else None


def smoke_check(args, name, res):
    """The smoke mode's checks: every turn answered; cached_tokens 0 with the caches off, > 0
    on every turn 2+ with them on where a hit is certain (cache-aware routing, or one prefill
    instance: blind routing over several may send a turn where nothing of it is yet)."""
    bad = []
    conf = CONFIGS[name]
    for r in res["requests"]:
        if r["completion"] < 1:
            bad.append(f"{name} conv {r['conv']} turn {r['turn']}: no completion token")
        if not conf["cache"] and r["cached"]:
            bad.append(f"{name} conv {r['conv']} turn {r['turn']}: cached_tokens {r['cached']} "
                       f"with the caches off")
        sure = conf["routing"] == "cache_aware" or (conf["disagg"] and args.prefill_instances == 1)
        if conf["cache"] and r["turn"] >= 2 and sure and not 0 < r["cached"] < r["prompt"]:
            bad.append(f"{name} conv {r['conv']} turn {r['turn']}: cached_tokens {r['cached']} of "
                       f"{r['prompt']} with the cache on")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--user-words", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--prefix-cache-mb", type=int, default=128)
    ap.add_argument("--prefill-instances", type=int, default=1)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--prefill-pp", type=int, default=2, help="pp of each prefill instance")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="mean exponential think time before each turn after the first")
    ap.add_argument("--seed", type=int, default=0, help="seed of the think times")
    ap.add_argument("--configs", default="pd_on,pd_off,co_aware,co_load")
    ap.add_argument("--json", help="write every request's figures here")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (logs)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.convs, args.turns = 1, 2, 3
        args.system_words, args.user_words, args.max_tokens = 60, 6, 4
        args.kv_blocks, args.prefix_cache_mb = 128, 8
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        ap.error(f"unknown configuration(s) {unknown} (known: {', '.join(CONFIGS)})")
    for v in ("rounds", "convs", "turns", "max_tokens", "kv_blocks", "prefix_cache_mb",
              "prefill_instances", "prefill_pp"):
        if getattr(args, v) < 1:
            ap.error(f"--{v.replace('_', '-')} must be >= 1")
    if args.think_ms < 0:
        ap.error("--think-ms must be >= 0")
    if args.turns < 2:
        ap.error("--turns must be >= 2 (the figures are of turns 2+)")
    if not os.access(os.path.join(args.build, "bin", "tandem"), os.X_OK):
        ap.error(f"no {args.build}/bin/tandem (build first, or give --build)")
    if not os.path.isfile(args.model):
        ap.error(f"no model file {args.model}")

    results = {n: [] for n in names}
    failures = []
    for rnd in range(args.rounds):
        for n in names:
            cl = Cluster(args, n, CONFIGS[n])
            t0 = time.time()
            cl.up()
            try:
                res = workload(args, cl.port)
                res["kv_bytes_req"] = kv_bytes_per_request(cl.port)
                pf_hit = cl.prefill_hit_tokens()
                res["pf_hit_rate"] = None if pf_hit is None else \
                    pf_hit / max(1, sum(r["prompt"] for r in res["requests"] if r["turn"] >= 2))
            finally:
                cl.down()
            results[n].append(res)
            print(f"round {rnd + 1} {n:9s} ttft p50 {res['ttft_p50']:.3f} s p99 "
                  f"{res['ttft_p99']:.3f} s (turn 1 p50 {res['ttft1_p50']:.3f} s)  out "
                  f"{res['out_tok_s']:.1f} tok/s  hit {100 * res['hit_rate']:.1f} %  prompt "
                  f"{res['prompt_t1']:.0f}..{res['prompt_last']:.0f} tok  workload "
                  f"{res['wall_s']:.1f} s (with start/stop {time.time() - t0:.1f} s)"
                  + (f"  KV pushed {res['kv_bytes_req'] / 1e6:.2f} MB/request"
                     if res["kv_bytes_req"] else "")
                  + (f"  prefill hit {100 * res['pf_hit_rate']:.1f} %"
                     if res["pf_hit_rate"] is not None else ""), flush=True)
            if args.smoke:
                failures += smoke_check(args, n, res)

    def med(n, k):
        return statistics.median(r[k] for r in results[n])

    print("\nmedians over rounds:")
    for n in names:
        print(f"  {n:9s} ttft p50 {med(n, 'ttft_p50'):.3f} s  p99 {med(n, 'ttft_p99'):.3f} s  "
              f"out {med(n, 'out_tok_s'):.1f} tok/s  hit {100 * med(n, 'hit_rate'):.1f} %")
    for a, b in (("pd_off", "pd_on"), ("pd_on", "pd_aware"), ("co_load", "co_aware"),
                 ("co_off", "co_load"), ("co_rr", "co_aware"), ("pd_rr", "pd_aware"),
                 ("co_load", "co_aware_b1"), ("co_aware", "co_aware_b1")):
        if a in results and b in results:
            r50 = [x["ttft_p50"] / y["ttft_p50"] for x, y in zip(results[a], results[b])]
            r99 = [x["ttft_p99"] / y["ttft_p99"] for x, y in zip(results[a], results[b])]
            tok = [y["out_tok_s"] / x["out_tok_s"] for x, y in zip(results[a], results[b])]
            print(f"  {a}/{b}: ttft p50 x{statistics.median(r50):.2f} "
                  f"(rounds {', '.join(f'{v:.2f}' for v in r50)}), p99 x{statistics.median(r99):.2f}, "
                  f"output tok/s {b}/{a} x{statistics.median(tok):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if failures:
        print("SMOKE FAILED:\n  " + "\n  ".join(failures))
        return 1
    if args.smoke:
        print("smoke: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
