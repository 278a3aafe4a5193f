#!/usr/bin/env python3
"""bench_ep.py: expert parallelism against tensor-parallel experts and data-parallel attention
(BENCHMARKS.md "Mixture of experts"), one mixture-of-experts model served colocated on N
processes:
  split  (ep 1) one decode instance of tp N, every expert split across the ranks (each rank a
         column slice of every expert);
  ep     (ep N) the same instance with the experts divided whole among the ranks (each rank
         its share, every token);
  dp     (dp N) N member instances of tp 1, each its own requests and KV with every tensor
         whole but its share of the experts, which run for every member's tokens;
  split-tboM, ep-tboM  the same with two-batch overlap for steps of at least M tokens
         (decode[].tbo_min_tokens M).
After each run the leader's stop log gives the share of its step time spent in all-reduces
(their waits included: what the overlap hides) and, with the overlap, the steps it split.
The clusters are brought up in turn (`tandem up -d`), each loaded by `tandem bench` with the
same prompts (greedy, fixed lengths, --ignore-eos); the order rotates per repetition so that
drift on a shared machine falls on all. Reports output tokens/s, TTFT and ITL per run.

usage: tools/bench_ep.py --model GGUF [--build build] [--tp 2] [--threads 1] [--reps 2]
                         [--configs split,ep] [--concurrency 4] [--requests 16]
                         [--prompt-tokens 128] [--max-tokens 64]
"""
import argparse
import json
import os
import re
import socket
import subprocess
import tempfile


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def yaml(d, a, conf):
    path = os.path.join(d, f"{conf}.yaml")
    base_conf, _, tbo = conf.partition("-tbo")
    shape = {"split": f"tp: {a.tp}\n    ep: 1", "ep": f"tp: {a.tp}\n    ep: {a.tp}",
             "dp": f"dp: {a.tp}"}[base_conf]
    if tbo:
        shape += f"\n    tbo_min_tokens: {int(tbo)}"
    base = free_port()
    while conf == "dp" and base + a.tp > 65535:
        base = free_port()
    with open(path, "w") as f:
        f.write(f"model: {a.model}\nrun_dir: {d}/run-{conf}\n"
                f"router:\n  listen: 127.0.0.1:{a.port}\n"
                f"decode:\n  - name: d0\n    {shape}\n"
                f"    threads: {a.threads}\n    port: {base}\n    kv_memory: 256MiB\n")
    return path


def run(a, d, conf):
    cfg = yaml(d, a, conf)
    tandem = os.path.join(a.build, "bin", "tandem")
    subprocess.run([tandem, "up", "-d", cfg, "--timeout", "300"], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        out = subprocess.run([tandem, "bench", "--url", f"http://127.0.0.1:{a.port}",
                              "--concurrency", str(a.concurrency), "--requests", str(a.requests),
                              "--prompt-tokens", str(a.prompt_tokens), "--max-tokens",
                              str(a.max_tokens), "--stream", "--ignore-eos", "--json"],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out)
    finally:
        subprocess.run([tandem, "down", cfg], stdout=subprocess.DEVNULL)


def stop_figures(d, conf):
    """The leader's stop-log figures: all-reduce share of the step time, steps split."""
    out = {}
    for root, _, files in os.walk(os.path.join(d, f"run-{conf}")):
        for fn in files:
            if not fn.endswith(".log"):
                continue
            with open(os.path.join(root, fn), errors="replace") as f:
                text = f.read()
            m = re.findall(r"mean step ([0-9.]+) ms, allreduce \d+ x [0-9.]+ us \(([0-9.]+)% of "
                           r"step time\)", text)
            if m:
                out["mean_step_ms"], out["allreduce_share_pct"] = (float(x) for x in m[-1])
            m = re.findall(r"two-batch overlap .*: (\d+) of (\d+) steps", text)
            if m:
                out["tbo_split_steps"], out["steps"] = (int(x) for x in m[-1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", default="build")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--configs", default="split,ep", help="of split, ep, dp, split-tboM, ep-tboM")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    a.port = free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ep-") as d:
        confs = a.configs.split(",")
        for rep in range(a.reps):
            for conf in confs[rep % len(confs):] + confs[:rep % len(confs)]:
                r = run(a, d, conf)
                r.update(stop_figures(d, conf))
                print(json.dumps({"rep": rep, "config": conf, "n": a.tp, **r}), flush=True)


if __name__ == "__main__":
    main()
