#!/usr/bin/env python3
"""bench_ep.py: expert parallelism against tensor-parallel experts (BENCHMARKS.md "Mixture of
experts"), one mixture-of-experts model served colocated by one decode instance of tp N:
  ep 1   every expert split across the N ranks (each rank a column slice of every expert);
  ep N   the experts divided whole among the ranks (each rank its share, every token).
The two clusters are brought up in turn (`tandem up -d`), each loaded by `tandem bench` with
the same prompts (greedy, fixed lengths, --ignore-eos); the order alternates per repetition so
that drift on a shared machine falls on both. Reports output tokens/s, TTFT and ITL per run.

usage: tools/bench_ep.py --model GGUF [--build build] [--tp 2] [--threads 1] [--reps 2]
                         [--concurrency 4] [--requests 16] [--prompt-tokens 128]
                         [--max-tokens 64]
"""
import argparse
import json
import os
import socket
import subprocess
import tempfile


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def yaml(d, a, ep):
    path = os.path.join(d, f"ep{ep}.yaml")
    with open(path, "w") as f:
        f.write(f"model: {a.model}\nrun_dir: {d}/run-ep{ep}\n"
                f"router:\n  listen: 127.0.0.1:{a.port}\n"
                f"decode:\n  - name: d0\n    tp: {a.tp}\n    ep: {ep}\n"
                f"    threads: {a.threads}\n    port: {free_port()}\n    kv_memory: 256MiB\n")
    return path


def run(a, d, ep):
    cfg = yaml(d, a, ep)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", default="build")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    a.port = free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ep-") as d:
        for rep in range(a.reps):
            for ep in ((1, a.tp) if rep % 2 == 0 else (a.tp, 1)):
                r = run(a, d, ep)
                print(json.dumps({"rep": rep, "ep": ep, "tp": a.tp, **r}), flush=True)


if __name__ == "__main__":
    main()
