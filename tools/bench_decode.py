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

With --tp CONFIGS (e.g. 1x1,2x1,1x2: tp x threads per rank) only part 2 runs, for those
configurations, at each batch of --batches with --max-tokens per request, and prints each
configuration's throughput against the first one's (strong scaling: tp2 x 1 against tp1 x 1).

usage: tools/bench_decode.py [--build build] [--model PATH]
                             [--tp 1x1,2x1 [--batches 1,4] [--max-tokens 128]]
       tools/bench_decode.py --compare BEFORE_BUILD [--build build] [--model PATH] --tp N
                             [--batches 4,16] [--rounds R]
  --compare: only the tensor-parallel decode at tp N x 1 thread, the build under test
  against BEFORE_BUILD (e.g. main), alternated R times per batch size in one run (the
  vocab-parallel LM head's figures in BENCHMARKS.md).
"""
import argparse
import os
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
args = ap.parse_args()
TANDEM = os.path.join(args.build, "bin", "tandem")
DECODE = os.path.join(args.build, "bin", "tandem-decode")
rnd = random.Random(1)


def start(tp, threads, port, step_tokens=256, decode=None):
    d = tempfile.mkdtemp(prefix="tandem-bench-")
    cfg = os.path.join(d, "c.yaml")
    with open(cfg, "w") as f:
        f.write(f"model: {args.model}\ndecode:\n  - name: b{port}\n    tp: {tp}\n"
                f"    threads: {threads}\n    kv_blocks: 4096\n    max_batch: 64\n"
                f"    step_tokens: {step_tokens}\n    port: {port}\n")
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
