#!/usr/bin/env python3
"""bench_prefill.py: the prefill-node benchmark of BENCHMARKS.md (Release build).

A prefill instance of the default model (one thread per stage process) pushes the KV of
each prompt into pf_sink (tests/prefill/pf_sink.c, a stand-in decode rank that does no
compute, so the figures are the prefill path's alone). Time to first token = from sending
Prefill to the PrefillDone event (every stage's KV has landed and been flushed).

  1. strong scaling: TTFT of 2K, 4K and 8K-token prompts with pp 1 and pp 2 (fixed chunks
     of 512, so only the pipeline differs);
     efficiency = T(pp1) / (2 x T(pp2)) (target >= 0.85 at 8K);
  2. dynamic against fixed chunks at pp 2, 8K tokens: fixed chunk sizes 256 / 512 / 1024,
     then dynamic chunking with an initial size of 2-3x the best fixed one (smoothing
     0.75) (target: dynamic >= 3 % faster than the best fixed size).

  3. --planner (alone): the chunk planner at pp 2 on a 6K-token prompt (--planner-tokens):
     fixed chunks of 256 / 512 / 1024 (dynamic off), dynamic from an initial 1024
     (--dyn-chunk) with the start-up fit only (TANDEM_PF_ONLINE_REFIT=0) and self-tuning
     (online refit), and chunk_size left out (the model picks each request's initial
     chunk), start-up fit only and self-tuning; --only picks plans; --rounds rounds, the
     order reversed every other round, one fresh instance per measurement; TTFT medians as
     ratios to the best fixed size, with the load average.

usage: tools/bench_prefill.py [--build build] [--model PATH] [--reps N] [--quick]
                              [--lengths N,N] [--only-dynamic]
                              [--planner [--rounds N] [--planner-tokens N] [--dyn-chunk C]
                                         [--only WORD,WORD]]
"""
import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="build")
ap.add_argument("--model", default=os.path.expanduser(
    "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
ap.add_argument("--reps", type=int, default=1)
ap.add_argument("--quick", action="store_true", help="2K only (smoke run)")
ap.add_argument("--only-dynamic", action="store_true", help="part 2 only")
ap.add_argument("--lengths", help="comma-separated prompt lengths of part 1 (strong scaling "
                "only, part 2 skipped), e.g. 1024 for a larger model")
ap.add_argument("--planner", action="store_true", help="part 3 only (chunk planner)")
ap.add_argument("--rounds", type=int, default=2, help="part 3: rounds (alternated)")
ap.add_argument("--planner-tokens", type=int, default=6144, help="part 3: prompt tokens")
ap.add_argument("--only", help="part 3: plans whose name contains one of these "
                "comma-separated words, e.g. 'fixed 512,start-up'")
ap.add_argument("--dyn-chunk", type=int, default=1024, help="part 3: dynamic initial chunk")
args = ap.parse_args()
BIN = os.path.join(args.build, "bin")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Instance:
    def __init__(self, pp, chunk, dynamic, smooth=0.75, env=None):
        """chunk None: chunk_size left out (the model picks it per request)."""
        self.pp = pp
        self.dir = tempfile.mkdtemp(prefix="tandem-bench-pf-")
        self.port = free_port()
        cfg = os.path.join(self.dir, "c.yaml")
        chunk_line = "" if chunk is None else f"    chunk_size: {chunk}\n"
        with open(cfg, "w") as f:
            f.write(f"model: {args.model}\nprefill:\n  - name: b\n    pp: {pp}\n"
                    f"{chunk_line}    dynamic_chunking: {str(dynamic).lower()}\n"
                    f"    smooth_factor: {smooth}\n    threads: 1\n    port: {self.port}\n"
                    f"    kv_tokens: 8448\n    profile_budget_ms: 30000\n"
                    f"decode:\n  - name: d\n    port: {free_port()}\n"
                    f"kvxfer:\n  ucx_tls: posix,cma,self\n  timeout_ms: 300000\n")
        self.procs = [subprocess.Popen([os.path.join(BIN, "tandem-prefill"), "--config", cfg,
                                        "--instance", "b", "--stage", str(s)],
                                       stderr=open(os.path.join(self.dir, f"s{s}.log"), "w"),
                                       env=dict(os.environ, **(env or {})))
                      for s in range(pp)]
        self.url = f"tcp://127.0.0.1:{self.port}"
        for _ in range(1200):
            if "ready" in open(os.path.join(self.dir, "s0.log"), errors="replace").read():
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("prefill instance not ready: " + self.dir)

    def fit_line(self):
        log = open(os.path.join(self.dir, "s0.log"), errors="replace").read()
        m = re.search(r"dynamic chunking: (.*)", log)
        return m.group(1) if m else "fixed chunks"

    def ttft(self, n, rid):
        env = dict(os.environ, PF_SINK_STAGES=str(self.pp))
        r = subprocess.run([os.path.join(BIN, "pf_sink"), "--model", args.model, "--url",
                            self.url, "--tokens", str(n), "--id", str(rid), "--no-check",
                            "--timeout", "300000", "--tls", "posix,cma,self"], capture_output=True, text=True, env=env,
                           timeout=900)
        m = re.search(r"ok ttft_ms (\d+) kv_ms (\d+) chunks (.*)", r.stdout)
        if not m:
            raise RuntimeError(f"pf_sink: {r.stdout} {r.stderr[-500:]}")
        return int(m.group(1)), m.group(3).strip()

    def log_lines(self, pattern):
        log = open(os.path.join(self.dir, "s0.log"), errors="replace").read()
        return re.findall(pattern, log)

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.wait(timeout=60)


rid = [0]


def measure(inst, n):
    ts, chunks = [], ""
    for _ in range(args.reps):
        rid[0] += 1
        t, chunks = inst.ttft(n, rid[0])
        ts.append(t)
    return statistics.median(ts), chunks


def planner():
    n = args.planner_tokens
    dc = args.dyn_chunk
    configs = [(f"fixed {c}", c, False, None) for c in (256, 512, 1024)]
    configs += [(f"dynamic {dc}, start-up fit only", dc, True, {"TANDEM_PF_ONLINE_REFIT": "0"}),
                (f"dynamic {dc}, self-tuning", dc, True, {"TANDEM_PF_ONLINE_REFIT": "1"}),
                ("chunk_size left out (model-chosen), start-up fit only", None, True,
                 {"TANDEM_PF_ONLINE_REFIT": "0"}),
                ("chunk_size left out (model-chosen), self-tuning", None, True,
                 {"TANDEM_PF_ONLINE_REFIT": "1"})]
    if args.only:
        configs = [c for c in configs if any(w in c[0] for w in args.only.split(","))]
        if not any(c[0].startswith("fixed") for c in configs):
            raise SystemExit("--only: keep at least one fixed size (the reference)")
    print(f"## chunk planner, pp 2, {n} tokens, {args.rounds} rounds alternated; "
          f"load average at start {os.getloadavg()} ({os.cpu_count()} CPUs)", flush=True)
    ts = {name: [] for name, *_ in configs}
    for r in range(args.rounds):
        for name, chunk, dyn, env in configs if r % 2 == 0 else configs[::-1]:
            inst = Instance(2, chunk, dyn, 0.75, env)
            rid[0] += 1
            t, chunks = inst.ttft(n, rid[0])
            ts[name].append(t)
            chosen = inst.log_lines(r"initial chunk (\d+) \(")
            models = inst.log_lines(r"cost model after (\d+) chunks: ([a-z -]+)")
            print(f"  round {r + 1} {name}: TTFT {t} ms; chunks [{chunks[:120]}]"
                  f"{'; initial chunk ' + chosen[-1] if chosen else ''}"
                  f"{'; last model: ' + ' '.join(models[-1]) if models else ''}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            inst.stop()
    med = {k: statistics.median(v) for k, v in ts.items()}
    best = min((k for k in med if k.startswith("fixed")), key=med.get)
    print(f"## medians, ratio TTFT / TTFT({best}) (< 1: faster); load average at end "
          f"{os.getloadavg()}")
    for k, v in ts.items():
        print(f"  {k:50s} {med[k]:8.0f} ms  ratio {med[k] / med[best]:.3f}  "
              f"rounds {v}")


if args.planner:
    planner()
    raise SystemExit(0)

if args.lengths:
    lengths = [int(x) for x in args.lengths.split(",")]
else:
    lengths = [] if args.only_dynamic else [2048] if args.quick else [2048, 4096, 8192 - 64]
print("## strong scaling (fixed chunks of 512)")
res = {}
for pp in (1, 2) if lengths else ():
    inst = Instance(pp, 512, False)
    print(f"pp{pp}: {inst.fit_line()}")
    for n in lengths:
        res[(pp, n)], chunks = measure(inst, n)
        print(f"  pp{pp} {n:5d} tokens: TTFT {res[(pp, n)]:7d} ms  chunks [{chunks[:80]}]",
              flush=True)
    inst.stop()
for n in lengths:
    print(f"  {n:5d} tokens: efficiency T(pp1) / (2 T(pp2)) = "
          f"{res[(1, n)] / (2 * res[(2, n)]):.3f}")

if not args.quick and not args.lengths:
    n = 8192 - 64
    print(f"## dynamic against fixed chunks, pp 2, {n} tokens")
    fixed = {}
    for c in (256, 512, 1024):
        inst = Instance(2, c, False)
        fixed[c], _ = measure(inst, n)
        print(f"  fixed {c:5d}: TTFT {fixed[c]} ms", flush=True)
        inst.stop()
    best = min(fixed, key=fixed.get)
    for mult in (2, 3):
        inst = Instance(2, best * mult, True, 0.75)
        t, chunks = measure(inst, n)
        print(f"  dynamic, initial {best * mult}, smoothing 0.75: TTFT {t} ms "
              f"({100 * (fixed[best] - t) / fixed[best]:+.1f} % vs fixed {best}); "
              f"chunks [{chunks[:100]}]; {inst.fit_line()}", flush=True)
        inst.stop()
