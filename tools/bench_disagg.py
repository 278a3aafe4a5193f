#!/usr/bin/env python3
"""bench_disagg.py: disaggregation overhead of BENCHMARKS.md (Release build).

Time to first token through the HTTP API (streaming; first content chunk) for the same
prompts on two clusters of the default model, one compute thread per process:
  colocated:      router + decode instance (tp 1) that prefills in chunks of 512 itself;
  disaggregated:  router + prefill instance (pp 1, chunks of 512, fixed) + decode (tp 1),
                  KV over UCX shared memory (posix,cma,self).
The same work is computed either way (one thread, the same chunk size); the ratio is what
the disaggregated path adds: the Alloc/Prefill/KvTarget round trips, the KV transfer that
is not hidden behind compute, the notice and the decode node's pick-up (target <= 1.10).

usage: tools/bench_disagg.py [--build build] [--model PATH] [--reps N]
"""
import argparse
import http.client
import json
import os
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
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--lengths", default="512,2048,4096")
args = ap.parse_args()
BIN = os.path.join(args.build, "bin")
WORDS = ("the quick brown fox jumps over the lazy dog while seven wise owls count stars "
         "above a quiet river that winds through old hills and green fields").split()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cluster(disagg):
    d = tempfile.mkdtemp(prefix="tandem-bench-pd-")
    http_port = free_port()
    cfg = os.path.join(d, "c.yaml")
    with open(cfg, "w") as f:
        f.write(f"model: {args.model}\nrouter:\n  listen: 127.0.0.1:{http_port}\n"
                f"  max_prompt_tokens: 8192\n")
        if disagg:
            f.write(f"prefill:\n  - name: p0\n    pp: 1\n    chunk_size: 512\n"
                    f"    dynamic_chunking: false\n    threads: 1\n    port: {free_port()}\n"
                    f"    kv_tokens: 8192\n")
        f.write(f"decode:\n  - name: d0\n    threads: 1\n    kv_blocks: 1024\n"
                f"    step_tokens: 512\n    port: {free_port()}\n"
                f"kvxfer:\n  ucx_tls: posix,cma,self\n  timeout_ms: 300000\n")
    argv = [[os.path.join(BIN, "tandem-decode"), "--config", cfg, "--instance", "d0", "--rank", "0"]]
    if disagg:
        argv.append([os.path.join(BIN, "tandem-prefill"), "--config", cfg, "--instance", "p0",
                     "--stage", "0"])
    argv.append([os.path.join(BIN, "tandem-router"), "--config", cfg])
    procs = [subprocess.Popen(a, stderr=open(os.path.join(d, f"{i}.log"), "w"))
             for i, a in enumerate(argv)]
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    return procs, http_port


def ttft(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    while True:
        line = r.readline()
        if not line:
            raise RuntimeError("stream ended without a token")
        if line.startswith(b"data: {") and b'"text"' in line:
            t = time.time() - t0
            r.read()
            c.close()
            return t
        if b'"error"' in line:
            raise RuntimeError(line.decode())


def prompt_of(n_words, salt):
    return f"{salt}. " + " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


lengths = [int(x) for x in args.lengths.split(",")]
res = {}
for disagg in (False, True):
    procs, port = cluster(disagg)
    ttft(port, prompt_of(50, "warm-up"))
    for n in lengths:
        ts = [ttft(port, prompt_of(int(n * 0.75), f"run {k} of {n}")) for k in range(args.reps)]
        res[(disagg, n)] = statistics.median(ts)
        print(f"{'disaggregated' if disagg else 'colocated    '} ~{n} tokens: TTFT median "
              f"{res[(disagg, n)] * 1000:.0f} ms ({', '.join(f'{t * 1000:.0f}' for t in ts)})",
              flush=True)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(timeout=60)
for n in lengths:
    print(f"~{n} tokens: disaggregated / colocated TTFT = {res[(True, n)] / res[(False, n)]:.3f}")
