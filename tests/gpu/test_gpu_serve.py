#!/usr/bin/env python3
"""test_gpu_serve.py: a colocated cluster on the CUDA backend, through `tandem up` and the
OpenAI API (issue 14: the serving path on a GPU, not only the CLI):

  answers   8 different prompts sent at once (the decode node batches them) to
            POST /v1/completions, greedy, 24 tokens: each answer equals `tandem generate
            --backend cuda` of the same prompt, and (reported, not required) `--backend cpu`
  bench     with --bench: `tandem bench` at concurrency 1, 16 and 64 (256-token prompts,
            128 output tokens, greedy) and its JSON figures printed on one line each

Without a usable GPU it prints the reason on one line and exits 77 (ctest: skipped).

usage: test_gpu_serve.py --tandem BIN --model GGUF [--bench]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

SKIP = 77
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def prompts(n_vocab_guess=500):
    return [[1] + [(k * 97 + i * 31 + 7) % n_vocab_guess + 3 for i in range(5 + 9 * k)]
            for k in range(8)]


def generate(args, backend, ids, n):
    r = subprocess.run([args.tandem, "generate", "--model", args.model, "--prompt-ids",
                        ",".join(map(str, ids)), "--max-tokens", str(n), "--temperature", "0",
                        "--backend", backend], capture_output=True, timeout=600)
    if r.returncode:
        return None
    out = r.stdout.decode(errors="replace")
    return out[:-1] if out.endswith("\n") else out  # generate ends its text with one newline


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--backend", default="cuda", help="cpu: a dry run of this script here")
    args = ap.parse_args()
    probe = subprocess.run([args.tandem, "generate", "--model", args.model, "--prompt-ids", "1,2",
                            "--max-tokens", "1", "--temperature", "0", "--backend", args.backend],
                           capture_output=True, text=True, timeout=600)
    if probe.returncode:
        why = [l for l in probe.stderr.splitlines() if "cuda" in l.lower()]
        print(f"skipped: backend cuda does not run here: {why[0] if why else probe.stderr}")
        return SKIP
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-serve-") as d:
        port = free_port()
        cfg = os.path.join(d, "gpu.yaml")
        with open(cfg, "w") as f:
            f.write(f"model: {args.model}\nbackend: {args.backend}\nrun_dir: {d}/run\n"
                    f"router:\n  listen: 127.0.0.1:{port}\n  heartbeat_ms: 200\n"
                    f"decode:\n  - name: d0\n    tp: 1\n    port: {free_port()}\n"
                    f"    threads: 2\n    kv_blocks: 8192\n    max_batch: 64\n"
                    f"    step_tokens: 2048\n")
        t0 = time.time()
        r = subprocess.run([args.tandem, "up", "-d", cfg, "--timeout", "150"],
                           capture_output=True, text=True, timeout=240)
        if not check(r.returncode == 0, f"up -d on backend cuda in {time.time() - t0:.1f} s "
                                        f"({r.stderr.strip()[-600:]})"):
            for root, _, files in os.walk(f"{d}/run"):
                for n in files:
                    if n.endswith(".log"):
                        print(f"--- {n}\n" + open(os.path.join(root, n)).read()[-2000:])
            return 1
        try:
            url = f"http://127.0.0.1:{port}"
            ps = prompts()
            with ThreadPoolExecutor(len(ps)) as ex:
                got = list(ex.map(lambda p: post(url + "/v1/completions",
                                                 {"prompt": p, "max_tokens": 24,
                                                  "temperature": 0}), ps))
            for k, (p, (st, body)) in enumerate(zip(ps, got)):
                text = body["choices"][0]["text"] if st == 200 else None
                want = generate(args, args.backend, p, 24)
                check(text is not None and text == want,
                      f"prompt {k} ({len(p)} tokens): the served answer equals tandem generate "
                      f"--backend {args.backend} ({st} {text!r} vs {want!r})")
                cpu = generate(args, "cpu", p, 24)
                print(f"info prompt {k}: {args.backend} {'==' if cpu == want else '!='} cpu generate")
            if args.bench:
                for c in (1, 16, 64):
                    b = subprocess.run([args.tandem, "bench", "--url", url, "--concurrency",
                                        str(c), "--requests", str(max(8, 2 * c)),
                                        "--prompt-tokens", "256", "--max-tokens", "128",
                                        "--stream", "--json"],
                                       capture_output=True, text=True, timeout=600)
                    check(b.returncode == 0, f"bench concurrency {c}: {b.stdout.strip()}"
                                             f" {b.stderr.strip()[-300:]}")
        finally:
            subprocess.run([args.tandem, "down", cfg], capture_output=True, timeout=120)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
