#!/usr/bin/env python3
"""bench_decode.py: the decode-node benchmark of BENCHMARKS.md (Release build).

  1. decode throughput at batch 1, 4, 16, 64 (128 tokens per request, ignore EOS) of one
     tp1 instance, next to `tandem bench-engine`'s single-process batch-1 decode measured
     in the same run (the ratio is what the node's scheduling and control plane cost);
  2. tensor parallelism: mean step time and all-reduce share of tp3 x 1 thread against
     tp1 x 3 threads (same total threads; the default model has 3 KV heads, so tp2 is not
     possible; both oversubscribe a 2-core machine equally);
  3. colocated mode: time per output token of 4 running requests while a 2048-token
     prompt is prefilled, against the same run without it (target: within 2x), for a
     per-step token budget of 256 and of 32 (the budget trades TPOT against the long
     prompt's time to first token).

With --itl TARGETS (e.g. 0,60: decode[].itl_target_ms, 0 = no cap) only the bounded-stall
comparison runs: a colocated cluster (`tandem up -d`: router + one tp1 x 2-thread decode
instance, step_tokens 512, prefix cache off) per target, alternated --rounds times; in each,
--decoders streamed requests (32-token prompts, 160 output tokens, ignore EOS) decode while
--long prompts of 1024-2048 random token ids (16 output tokens) arrive 1.5 s apart. Printed:
the decoders' inter-token latency p50/p99 (every gap between two streamed chunks), the long
prompts' TTFT p50/p99, and the output tokens/s of the whole run.

With --overlap THREADS (e.g. 1,2) only the overlap comparison runs: a tp1 instance with
decode[].overlap true, then false, per thread count and batch (--batches, 1,16), alternated
--rounds times, next to `tandem bench-engine` at the same thread count in each round; it
prints each run's tokens/s and the leader's per-step breakdown (inbox, plan, encode,
forward, commit, token events), then the medians and the paired on/off ratios.

With --tp CONFIGS (e.g. 1x1,2x1,1x2: tp x threads per rank) only part 2 runs, for those
configurations, at each batch of --batches with --max-tokens per request, and prints each
configuration's throughput against the first one's (strong scaling: tp2 x 1 against tp1 x 1).

With --node THREADS (e.g. 1,2) only the node against the bare engine runs: per round and
thread count, `tandem bench-engine`'s batch-1 decode, then a tp1 instance (sequential loop)
at each batch of --batches (1,16); with --compare BEFORE_BUILD the BEFORE build's instance
runs next to this build's in each round, the order swapped every round. It prints each run's
tokens/s (x engine at batch 1: from the submit to the last token, and from its decode steps
alone, 1 / time per output token, the engine's own measure) and the leader's per-step commit
time (sampling, stop rules, events), then the medians, each build's node/engine ratio and the
after/before paired ratios.

usage: tools/bench_decode.py [--build build] [--model PATH]
       tools/bench_decode.py --itl 0,60 [--rounds R] [--decoders 12] [--long 6]
                             [--tp 1x1,2x1 [--batches 1,4] [--max-tokens 128]]
       tools/bench_decode.py --overlap 1,2 [--batches 1,16] [--rounds R]
       tools/bench_decode.py --node 1,2 [--compare BEFORE_BUILD] [--batches 1,16] [--rounds R]
       tools/bench_decode.py --compare BEFORE_BUILD [--build build] [--model PATH] --tp N
                             [--batches 4,16] [--rounds R]
  --compare: only the tensor-parallel decode at tp N x 1 thread, the build under test
  against BEFORE_BUILD (e.g. main), alternated R times per batch size in one run (the
  vocab-parallel LM head's figures in BENCHMARKS.md).
"""
import argparse
import http.client
import json
import os
import shutil
import socket
import threading
import random
import re
import signal
import subprocess
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="build")
ap.add_argument("--model", default=os.path.expanduser(
    "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
ap.add_argument("--compare", metavar="BEFORE_BUILD",
                help="tp N x 1 thread, this build against BEFORE_BUILD, alternated")
ap.add_argument("--tp", help="only part 2, these configurations: TPxTHREADS,... "
                "(with --compare: one tp size)")
ap.add_argument("--batches", default=None, help="with --tp: batches to run (4; --compare: 4,16)")
ap.add_argument("--max-tokens", type=int, default=128, help="with --tp: tokens per request")
ap.add_argument("--rounds", type=int, default=3, help="with --compare: rounds per batch size")
ap.add_argument("--overlap", metavar="THREADS",
                help="only decode[].overlap on against off (and bench-engine), alternated "
                "--rounds times, for these thread counts (e.g. 1,2) at --batches (1,16)")
ap.add_argument("--node", metavar="THREADS",
                help="only the tp1 node against bench-engine (with --compare: and the BEFORE "
                "build's node), alternated --rounds times, for these thread counts at --batches")
ap.add_argument("--itl", help="only the bounded-stall comparison: itl_target_ms values, e.g. 0,60")
ap.add_argument("--decoders", type=int, default=12, help="with --itl: requests decoding")
ap.add_argument("--long", type=int, default=6, help="with --itl: long prompts arriving")
args = ap.parse_args()
TANDEM = os.path.join(args.build, "bin", "tandem")
DECODE = os.path.join(args.build, "bin", "tandem-decode")
rnd = random.Random(1)


def start(tp, threads, port, step_tokens=256, decode=None, overlap=None):
    d = tempfile.mkdtemp(prefix="tandem-bench-")
    cfg = os.path.join(d, "c.yaml")
    with open(cfg, "w") as f:
        f.write(f"model: {args.model}\ndecode:\n  - name: b{port}\n    tp: {tp}\n"
                f"    threads: {threads}\n    kv_blocks: 4096\n    max_batch: 64\n"
                f"    step_tokens: {step_tokens}\n    port: {port}\n")
        if overlap is not None:
            f.write(f"    overlap: {'true' if overlap else 'false'}\n")
    procs = [subprocess.Popen([decode or DECODE, "--config", cfg, "--instance", f"b{port}", "--rank", str(r)],
                              stderr=open(os.path.join(d, f"r{r}.log"), "w")) for r in range(tp)]
    url = f"tcp://127.0.0.1:{port}"
    for _ in range(300):
        r = subprocess.run([TANDEM, "client", "--url", url, "--health", "--timeout-ms", "1000"],
                           capture_output=True, text=True)
        if "ready 1" in r.stdout:
            break
        time.sleep(0.2)
    return procs, url, d


def stop(procs, d):
    # the leader first: it publishes the stop plan; the followers then leave the instance and
    # wait for their leader to form it again (rejoin), so each gets its own SIGTERM
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(timeout=30)
    for p in procs[1:]:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    with open(os.path.join(d, "r0.log")) as f:
        return f.read()


def run(url, n, max_tokens, prompt_len=16):
    path = tempfile.mktemp()
    with open(path, "w") as f:
        for i in range(n):
            ids = ",".join(str(rnd.randrange(1000, 40000)) for _ in range(prompt_len))
            f.write(f"{max_tokens} 0.8 {i} {ids}\n")
    r = subprocess.run([TANDEM, "client", "--url", url, "--requests", path, "--stats",
                        "--ignore-eos", "--timeout-ms", "600000"], capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("stats:")][0].split()[1:]
    return {line[i]: float(line[i + 1]) for i in range(0, len(line), 2)}


STEP_RE = r"mean step ([0-9.]+) ms, allreduce (\d+) x ([0-9.]+) us \(([0-9.]+)% of step"


def compare(tp, batches):
    """tp N x 1 thread, this build against the BEFORE build, alternated per batch size."""
    builds = (("before", os.path.join(args.compare, "bin", "tandem-decode")), ("after", DECODE))
    res = {}
    port = 9740
    for b in batches:
        for k in range(args.rounds):
            for label, decode in builds:
                port += 1
                procs, url, d = start(tp, 1, port, decode=decode)
                run(url, 1, 8)  # warm-up
                s = run(url, b, 128)
                log = stop(procs, d)
                m = re.search(STEP_RE, log)
                g = re.search(r"logit gather (\d+) x ([0-9.]+) us", log)
                res.setdefault((b, label), []).append((s["tok_per_s"], float(m.group(1))))
                gather = f", logit gather {g.group(2)} us" if g else ""
                print(f"tp{tp} batch {b:2d} round {k} {label:6s}: {s['tok_per_s']:7.1f} tok/s, "
                      f"mean step {m.group(1)} ms{gather}", flush=True)
    for b in batches:
        med = {}
        for label, _ in builds:
            tps = sorted(x[0] for x in res[(b, label)])
            step = sorted(x[1] for x in res[(b, label)])
            med[label] = (tps[len(tps) // 2], step[len(step) // 2])
        # each round's after/before pair ran back to back: its ratio is the least noisy
        pair = sorted(a[0] / p[0] for a, p in zip(res[(b, "after")], res[(b, "before")]))
        print(f"tp{tp} batch {b:2d}: median before {med['before'][0]:.1f} tok/s "
              f"({med['before'][1]:.2f} ms/step), after {med['after'][0]:.1f} tok/s "
              f"({med['after'][1]:.2f} ms/step), ratio of medians "
              f"{med['after'][0] / med['before'][0]:.3f}, median of paired ratios "
              f"{pair[len(pair) // 2]:.3f} (range {pair[0]:.3f}-{pair[-1]:.3f})")




def tp_part(configs, batches, max_tokens):
    """Part 2: one instance per configuration and batch; throughput against the first one."""
    for b in batches:
        base = None
        for i, (tp, threads) in enumerate(configs):
            procs, url, d = start(tp, threads, 9710 + 10 * i + tp)
            run(url, 1, 4)  # warm-up
            s = run(url, b, max_tokens)
            log = stop(procs, d)
            m = re.search(r"mean step ([0-9.]+) ms, allreduce (\d+) x ([0-9.]+) us \(([0-9.]+)% of step",
                          log)
            base = base or s["tok_per_s"]
            print(f"tp{tp} x {threads} threads, batch {b}: {s['tok_per_s']:6.2f} tok/s "
                  f"({s['tok_per_s'] / base:.2f} x tp{configs[0][0]} x {configs[0][1]}), "
                  f"tpot {s['tpot_ms']:.1f} ms, step {m.group(1)} ms, allreduce {m.group(3)} us "
                  f"each, {m.group(4)}% of step time", flush=True)


def free_port():
    so = socket.socket()
    so.bind(("127.0.0.1", 0))
    port = so.getsockname()[1]
    so.close()
    return port


def stream(port, prompt, max_tokens, out):
    """One streamed completion: out gets (submit time, [arrival time of every chunk])."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times = []
    for line in r:
        if line.startswith(b"data: {") and b'"text"' in line:
            times.append(time.perf_counter())
    c.close()
    out.append((t0, times))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def itl_round(target, seed):
    """One cluster with itl_target_ms = target; the decoders' gaps, the long prompts' TTFTs."""
    d = tempfile.mkdtemp(prefix="tandem-bench-itl-")
    port, cfg = free_port(), os.path.join(d, "c.yaml")
    with open(cfg, "w") as f:
        f.write(f"model: {args.model}\nrun_dir: {d}/run\nrouter:\n  listen: 127.0.0.1:{port}\n"
                f"  max_prompt_tokens: 8192\ndecode:\n  - name: d0\n    tp: 1\n    threads: 2\n"
                f"    kv_blocks: 4096\n    max_batch: 64\n    step_tokens: 512\n"
                f"    prefix_cache: false\n    itl_target_ms: {target}\n    port: {free_port()}\n")
    env = dict(os.environ, TANDEM_BIN=os.path.abspath(os.path.join(args.build, "bin")))
    r = subprocess.run([TANDEM, "up", "-d", cfg, "--timeout", "120"], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise RuntimeError(f"tandem up: {r.stderr[-500:]}")
    try:
        g = random.Random(seed)
        ids = lambda n: [g.randrange(1000, 40000) for _ in range(n)]
        stream(port, ids(16), 4, [])  # warm-up
        dec, lng, ths = [], [], []
        t_start = time.perf_counter()
        for _ in range(args.decoders):
            ths.append(threading.Thread(target=stream, args=(port, ids(32), 160, dec)))
            ths[-1].start()
        time.sleep(1.0)
        for _ in range(args.long):
            ths.append(threading.Thread(target=stream,
                                        args=(port, ids(g.randrange(1024, 2049)), 16, lng)))
            ths[-1].start()
            time.sleep(1.5)
        for t in ths:
            t.join()
        wall = time.perf_counter() - t_start
    finally:
        subprocess.run([TANDEM, "down", cfg], env=env, capture_output=True)
        shutil.rmtree(d, ignore_errors=True)
    gaps = [(b - a) * 1e3 for _, ts in dec for a, b in zip(ts, ts[1:])]
    ttft = [(ts[0] - t0) for t0, ts in lng]
    n_out = sum(len(ts) for _, ts in dec + lng)
    return gaps, ttft, n_out / wall


def itl_part(targets):
    res = {t: ([], [], []) for t in targets}
    for k in range(args.rounds):
        for t in targets:  # alternated: each round runs every target once, back to back
            gaps, ttft, tps = itl_round(t, 100 + k)
            res[t][0].extend(gaps)
            res[t][1].extend(ttft)
            res[t][2].append(tps)
            print(f"round {k} itl_target_ms {t}: ITL p50 {pct(gaps, .5):.1f} p99 "
                  f"{pct(gaps, .99):.1f} ms, long TTFT p50 {pct(ttft, .5):.2f} p99 "
                  f"{pct(ttft, .99):.2f} s, output {tps:.1f} tok/s", flush=True)
    for t in targets:
        gaps, ttft, tps = res[t]
        print(f"all rounds, itl_target_ms {t}: ITL p50 {pct(gaps, .5):.1f} p99 {pct(gaps, .99):.1f} "
              f"max {max(gaps):.0f} ms ({len(gaps)} gaps), long TTFT p50 {pct(ttft, .5):.2f} p99 "
              f"{pct(ttft, .99):.2f} s, output {sum(tps) / len(tps):.1f} tok/s (mean of rounds)")


PHASES_RE = r"per step \(ms, % of the loop\): (.*)"


def overlap_part(threads_list, batches):
    """decode[].overlap on against off, alternated per round, next to bench-engine's batch-1
    decode measured in each round (the ratio to the bare engine)."""
    res = {}
    port = 9760
    for k in range(args.rounds):
        for threads in threads_list:
            eng = subprocess.run([TANDEM, "bench-engine", "--model", args.model, "--threads",
                                  str(threads), "--reps", "1", "--json"], capture_output=True,
                                 text=True).stdout
            e = float(re.search(r'"decode_tps": ([0-9.]+)', eng).group(1))
            res.setdefault(("engine", threads, 1), []).append(e)
            print(f"round {k} engine {threads} threads batch 1: {e:.1f} tok/s", flush=True)
            for b in batches:
                for ov in (True, False):
                    port += 1
                    procs, url, d = start(1, threads, port, overlap=ov)
                    run(url, 1, 8)  # warm-up
                    s = run(url, b, 128)
                    log = stop(procs, d)
                    ph = re.search(PHASES_RE, log)
                    ho = re.search(r"overlap per step \(ms\): (.*)", log)
                    res.setdefault((ov, threads, b), []).append(s["tok_per_s"])
                    print(f"round {k} overlap {'on ' if ov else 'off'} {threads} threads batch "
                          f"{b:2d}: {s['tok_per_s']:7.1f} tok/s, tpot {s['tpot_ms']:.2f} ms"
                          f"{' (' + str(round(s['tok_per_s'] / e, 3)) + ' x engine)' if b == 1 else ''}"
                          f"\n    {ph.group(1) if ph else ''}"
                          f"{chr(10) + '    ' + ho.group(1) if ho else ''}", flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    for threads in threads_list:
        e = med(res[("engine", threads, 1)])
        for b in batches:
            on, off = res[(True, threads, b)], res[(False, threads, b)]
            pair = sorted(a / o for a, o in zip(on, off))
            print(f"{threads} threads batch {b:2d}: overlap on {med(on):.1f}, off {med(off):.1f} "
                  f"tok/s (medians); on/off paired ratio median {med(pair):.3f} (range "
                  f"{pair[0]:.3f}-{pair[-1]:.3f})"
                  + (f"; x engine ({e:.1f}): on {med(on) / e:.3f}, off {med(off) / e:.3f}"
                     if b == 1 else ""))


def node_part(threads_list, batches, before):
    """The tp1 node (sequential loop) against bench-engine's batch-1 decode in each round;
    with before, that build's node too, alternated (order swapped every round)."""
    builds = [("after", DECODE)]
    if before:
        builds.insert(0, ("before", os.path.join(before, "bin", "tandem-decode")))
    res = {}
    port = 9800
    med = lambda xs: sorted(xs)[len(xs) // 2]
    for k in range(args.rounds):
        for threads in threads_list:
            eng = subprocess.run([TANDEM, "bench-engine", "--model", args.model, "--threads",
                                  str(threads), "--reps", "1", "--json"], capture_output=True,
                                 text=True).stdout
            e = float(re.search(r'"decode_tps": ([0-9.]+)', eng).group(1))
            res.setdefault(("engine", threads), []).append(e)
            print(f"round {k} engine {threads} threads batch 1: {e:.1f} tok/s", flush=True)
            for b in batches:
                for label, decode in (builds if k % 2 == 0 else builds[::-1]):
                    port += 1
                    procs, url, d = start(1, threads, port, decode=decode, overlap=False)
                    run(url, 1, 8)  # warm-up
                    s = run(url, b, 128)
                    log = stop(procs, d)
                    ph = re.search(r"per step \(ms, % of the loop\): loop ([0-9.]+), "
                                   r"inbox\+transfers\+health ([0-9.]+) \(([0-9.]+)%.*"
                                   r"commit ([0-9.]+) \(([0-9.]+)%", log)
                    res.setdefault((label, threads, b), []).append(s["tok_per_s"])
                    # the engine's figure is decode steps only (no prefill), so the node's
                    # is its time per output token after the first; tok_per_s (from the
                    # submit to the last token) also holds the connect and the prefill
                    dec = 1000.0 / s["tpot_ms"] if s.get("tpot_ms") else 0.0
                    if b == 1:
                        res.setdefault((label + "/engine", threads), []).append(dec / e)
                        res.setdefault((label + "/engine wall", threads), []).append(s["tok_per_s"] / e)
                    x_eng = (f" ({s['tok_per_s'] / e:.3f} x engine; decode steps {dec:.1f} tok/s, "
                             f"{dec / e:.3f} x engine; ttft {s.get('ttft_ms', 0):.0f} ms)"
                             if b == 1 else "")
                    phases = (f", loop {ph.group(1)} ms/step, inbox {ph.group(2)} ms "
                              f"({ph.group(3)}%), commit {ph.group(4)} ms ({ph.group(5)}%)"
                              if ph else "")
                    print(f"round {k} {label:6s} {threads} threads batch {b:2d}: "
                          f"{s['tok_per_s']:7.1f} tok/s{x_eng}{phases}", flush=True)
    for threads in threads_list:
        for b in batches:
            line = f"{threads} threads batch {b:2d}:"
            for label, _ in builds:
                line += f" {label} {med(res[(label, threads, b)]):.1f} tok/s"
                if b == 1:
                    line += (f" ({med(res[(label + '/engine wall', threads)]):.3f} x engine; "
                             f"decode steps {med(res[(label + '/engine', threads)]):.3f} x engine)")
            if before:
                pair = sorted(a / o for a, o in zip(res[("after", threads, b)],
                                                    res[("before", threads, b)]))
                line += (f"; after/before paired median {med(pair):.3f} "
                         f"(range {pair[0]:.3f}-{pair[-1]:.3f})")
            print(line, flush=True)


if args.node:
    node_part([int(x) for x in args.node.split(",")],
              [int(x) for x in (args.batches or "1,16").split(",")], args.compare)
    raise SystemExit(0)
if args.overlap:
    overlap_part([int(x) for x in args.overlap.split(",")],
                 [int(x) for x in (args.batches or "1,16").split(",")])
    raise SystemExit(0)
if args.itl:
    itl_part([float(x) for x in args.itl.split(",")])
    raise SystemExit(0)
if args.compare:
    compare(int(args.tp or 3), [int(x) for x in (args.batches or "4,16").split(",")])
    raise SystemExit(0)
if args.tp:
    tp_part([tuple(int(x) for x in c.split("x")) for c in args.tp.split(",")],
            [int(x) for x in (args.batches or "4").split(",")], args.max_tokens)
    raise SystemExit(0)

engine = subprocess.run([TANDEM, "bench-engine", "--model", args.model, "--threads", "2",
                         "--reps", "1", "--json"], capture_output=True, text=True).stdout
m = re.search(r'"decode_tps": ([0-9.]+)', engine)
engine_tg = float(m.group(1))
print(f"engine (bench-engine, 2 threads) decode batch 1: {engine_tg:.1f} tok/s")

procs, url, d = start(1, 2, 9700)
run(url, 1, 16)  # warm-up
for b in (1, 4, 16, 64):
    s = run(url, b, 128)
    extra = f"  ({s['tok_per_s'] / engine_tg:.2f} x engine batch 1)" if b == 1 else ""
    print(f"node tp1 x 2 threads, batch {b:2d}: {s['tok_per_s']:7.1f} tok/s, "
          f"tpot {s['tpot_ms']:.2f} ms{extra}")
stop(procs, d)

tp_part(((1, 3), (3, 1)), (4,), 128)

for step_tokens in (256, 16):
    for label, with_prefill in (("without", False), ("with", True)):
        procs, url, d = start(1, 2, 9720 + with_prefill + 2 * (step_tokens == 16),
                              step_tokens=step_tokens)
        path = tempfile.mktemp()
        with open(path, "w") as f:
            for i in range(4):
                f.write(f"256 0.8 {i} " + ",".join(str(rnd.randrange(1000, 40000)) for _ in range(16)) + "\n")
        a = subprocess.Popen([TANDEM, "client", "--url", url, "--requests", path, "--stats",
                              "--ignore-eos", "--timeout-ms", "600000"], stdout=subprocess.PIPE, text=True)
        ttft = ""
        if with_prefill:
            time.sleep(0.5)
            long_ids = ",".join(str(rnd.randrange(1000, 40000)) for _ in range(2048))
            t0 = time.time()
            subprocess.run([TANDEM, "client", "--url", url, "--prompt-ids", long_ids, "--max-tokens", "1",
                            "--timeout-ms", "600000"], capture_output=True)
            ttft = f", the 2048-token prompt's first token after {time.time() - t0:.2f} s"
        out = a.communicate()[0]
        stop(procs, d)
        line = [l for l in out.splitlines() if l.startswith("stats:")][0].split()[1:]
        s = {line[i]: float(line[i + 1]) for i in range(0, len(line), 2)}
        print(f"colocated, step_tokens {step_tokens}, 4 running requests {label} a 2048-token "
              f"prefill: tpot {s['tpot_ms']:.2f} ms, longest gap {s['max_gap_ms']:.0f} ms{ttft}")
