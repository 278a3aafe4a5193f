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

--decode-tp N: the decode instance has N ranks (the default model: 1, 3 or 9).
--compare [NAME=]BUILD,...: disaggregated only, the build under test ("new") against each
BUILD's binaries (NAME: its label, default "old"), alternated request by request (every
cluster up at once, one serving at a time, the order rotated per repetition); besides TTFT
each request's KV transfer as the prefill stage logs it (its chunks' handed -> landed times
summed, and the MiB its puts staged first when the build reports it).
--head-major: (with or without --compare) one more cluster of the build under test whose prefill stage
keeps its KV pool head-major (TANDEM_PF_KV_SLICED=0), labelled "headmajor": the layout alone.

usage: tools/bench_disagg.py [--build build] [--model PATH] [--reps N] [--lengths L,...]
                             [--decode-tp N] [--compare [NAME=]BUILD,... [--head-major]]
"""
import argparse
import http.client
import json
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
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--lengths", default="512,2048,4096")
ap.add_argument("--decode-tp", type=int, default=1)
ap.add_argument("--compare", default="")
ap.add_argument("--head-major", action="store_true")
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


def cluster(disagg, bin_dir=BIN, env=None):
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
        f.write(f"decode:\n  - name: d0\n    tp: {args.decode_tp}\n    threads: 1\n"
                f"    kv_blocks: 1024\n"
                f"    step_tokens: 512\n    port: {free_port()}\n"
                f"kvxfer:\n  ucx_tls: posix,cma,self\n  timeout_ms: 300000\n")
    argv = [[os.path.join(bin_dir, "tandem-decode"), "--config", cfg, "--instance", "d0",
             "--rank", str(r)] for r in range(args.decode_tp)]
    if disagg:
        argv.append([os.path.join(bin_dir, "tandem-prefill"), "--config", cfg, "--instance",
                     "p0", "--stage", "0"])
    argv.append([os.path.join(bin_dir, "tandem-router"), "--config", cfg])
    procs = [subprocess.Popen(a, stderr=open(os.path.join(d, f"{i}.log"), "w"),
                              env={**os.environ, **(env or {})})
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
    cluster.prefill_log = os.path.join(d, f"{args.decode_tp}.log") if disagg else None
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


XFER = re.compile(r"([0-9.]+) MiB in (\d+) puts(?: \(([0-9.]+) MiB staged\))?; "
                  r"transfer ([0-9.]+) ms")


def transfers(log):
    with open(log) as f:
        return XFER.findall(f.read())


def next_transfer(log, seen):
    """(MiB, puts, staged MiB or None, transfer ms) of the prefill stage's request after the
    first `seen` ones (it logs a request's transfer once its last chunk landed)."""
    for _ in range(200):
        m = transfers(log)
        if len(m) > seen:
            mib, puts, staged, ms = m[seen]
            return float(mib), int(puts), float(staged) if staged else None, float(ms)
        time.sleep(0.05)
    raise RuntimeError(f"{log}: no transfer line after {seen}")


def compare():
    """The build under test against args.compare, alternated request by request."""
    builds = [("new", BIN, None)]
    for i, c in enumerate(c for c in args.compare.split(",") if c):
        name, _, path = c.rpartition("=")
        builds.append((name or ("old" if i == 0 else f"old{i}"), os.path.join(path, "bin"), None))
    if args.head_major:
        builds.append(("headmajor", BIN, {"TANDEM_PF_KV_SLICED": "0"}))
    up = {}
    for name, b, env in builds:
        procs, port = cluster(True, b, env)
        up[name] = (procs, port, cluster.prefill_log)
        ttft(port, prompt_of(50, f"warm-up {name}"))
        next_transfer(cluster.prefill_log, 0)
    rows = {}
    for n in [int(x) for x in args.lengths.split(",")]:
        for k in range(args.reps):
            for name, _, _ in builds[k % len(builds):] + builds[:k % len(builds)]:
                procs, port, log = up[name]
                seen = len(transfers(log))
                t = ttft(port, prompt_of(int(n * 0.75), f"run {k} of {n}"))
                mib, puts, staged, ms = next_transfer(log, seen)
                rows.setdefault((name, n), []).append((t, ms))
                print(f"{name} ~{n} tokens rep {k}: TTFT {t * 1000:.0f} ms, KV {mib:.1f} MiB in "
                      f"{puts} puts, staged {'-' if staged is None else f'{staged:.1f} MiB'}, "
                      f"transfer {ms:.1f} ms", flush=True)
        w = rows[("new", n)]
        med = lambda v, i: statistics.median(x[i] for x in v)  # noqa: E731
        for name, _, _ in builds[1:]:
            o = rows[(name, n)]
            print(f"~{n} tokens, decode tp {args.decode_tp}: new / {name} TTFT median "
                  f"{med(w, 0) / med(o, 0):.3f}, transfer median {med(w, 1):.1f} / "
                  f"{med(o, 1):.1f} ms = {med(w, 1) / med(o, 1):.3f}; pairs new/{name} "
                  "transfer: " + ", ".join(f"{a[1] / b[1]:.2f}" for a, b in zip(w, o)),
                  flush=True)
    for procs, _, _ in up.values():
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)


if args.compare or args.head_major:
    compare()
    raise SystemExit(0)
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
