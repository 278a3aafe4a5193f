#!/usr/bin/env python3
"""test_devstage.py: the device paths of tensor parallelism and the KV transfer, run on the
cpu-dev backend (the cpu kernels behind a device backend's contract, kernels/cpu/cpu_dev.h)
with real processes through `tandem up`:

  colocated   one decode instance of tp 2 (--tp N) (its all-reduces and the LM head's gather staged
              through host memory, engine_stage.c)
  disagg      a prefill instance of pp 2 (each chunk's KV downloaded to the pool's host copy
              before the push) + a decode instance of tp 2 (KV received into the host copy,
              uploaded before the first step reads it)

Each cluster runs once on backend cpu and once on cpu-dev: 6 prompts in two waves of 3 sent
at once (the second wave's KV lands in blocks the first freed), then 2 prompts extending the
second wave's (the decode side's prefix cache holds their first blocks: in the disaggregated
cluster only the rest is transferred), greedy, 16 tokens; every
cpu-dev answer must equal the cpu answer, the decode log must name cpu-dev (the backend
really ran), and in the disaggregated cluster every request's KV must have arrived by
transfer, from prefill stages whose KV pools are sliced for the decode ranks (no byte
staged).

usage: test_devstage.py --tandem BIN --model GGUF [--tp N]
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import check, summary  # noqa: E402
from tdtest.ports import free_port  # noqa: E402

def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


PROMPTS = [[1] + [(k * 97 + i * 31 + 7) % 400 + 3 for i in range(6 + 23 * k)] for k in range(6)]
EXTENDED = [p + [(i * 13 + 5) % 400 + 3 for i in range(40)] for p in PROMPTS[4:]]


def config(d, model, backend, disagg, port, tp):
    y = (f"model: {model}\nbackend: {backend}\nrun_dir: {d}/run\n"
         f"router:\n  listen: 127.0.0.1:{port}\n  heartbeat_ms: 200\n")
    if disagg:
        y += (f"prefill:\n  - name: p0\n    pp: 2\n    chunk_size: 32\n    threads: 1\n"
              f"    port: {free_port()}\n    kv_tokens: 2048\n")
    y += (f"decode:\n  - name: d0\n    tp: {tp}\n    port: {free_port()}\n    threads: 1\n"
          f"    kv_memory: 16MiB\n    max_batch: 16\n")
    y += "kvxfer:\n  ucx_tls: posix,cma,self\n  timeout_ms: 30000\n"
    path = os.path.join(d, f"{backend}.yaml")
    with open(path, "w") as f:
        f.write(y)
    return path


def logs(d):
    out = ""
    for p in sorted(glob.glob(f"{d}/run/**/*.log", recursive=True)):
        out += f"--- {os.path.basename(p)}\n" + open(p, errors="replace").read()[-1500:]
    return out


def serve(args, backend, disagg):
    """The answers of one cluster, or None."""
    with tempfile.TemporaryDirectory(prefix="tandem-devstage-") as d:
        port = free_port()
        cfg = config(d, args.model, backend, disagg, port, args.tp)
        t0 = time.time()
        r = subprocess.run([args.tandem, "up", "-d", cfg, "--timeout", "60"],
                           capture_output=True, text=True, timeout=120)
        shape = f"pp 2 + tp {args.tp}" if disagg else f"colocated tp {args.tp}"
        if not check(r.returncode == 0, f"{shape} on {backend}: up in {time.time() - t0:.1f} s "
                                        f"({r.stderr.strip()[-400:]})"):
            print(logs(d))
            subprocess.run([args.tandem, "down", cfg], capture_output=True, timeout=60)
            return None
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            got = []
            # two waves: the second reuses the KV blocks the first freed, on every rank; a
            # third extends the second's prompts: the decode side shares the blocks it holds
            # (whose device copies are current) and only the rest is transferred
            for wave in (PROMPTS[:3], PROMPTS[3:], EXTENDED):
                with ThreadPoolExecutor(len(wave)) as ex:
                    got += list(ex.map(lambda p: post(url, {"prompt": p, "max_tokens": 16,
                                                            "temperature": 0}), wave))
            texts = [b["choices"][0]["text"] if st == 200 else None for st, b in got]
            check(all(t is not None for t in texts),
                  f"{shape} on {backend}: every prompt answered ({[st for st, _ in got]})")
            dlog = "".join(open(p, errors="replace").read()
                           for p in glob.glob(f"{d}/run/**/*d0*.log", recursive=True))
            check(backend != "cpu-dev" or "cpu-dev" in dlog,
                  f"{shape} on {backend}: the decode log names the backend")
            if disagg:  # the decode ranks computed from received KV, not their own prefill
                arrived, n = dlog.count(" arrived ("), len(PROMPTS) + len(EXTENDED)
                check(arrived == n, f"{shape} on {backend}: KV of {arrived} of {n} requests arrived")
                held = sum(int(m) > 0 for m in re.findall(r"\((\d+) held here", dlog))
                check(held >= len(EXTENDED), f"{shape} on {backend}: {held} requests found "
                                             f"blocks held on the decode side (>= {len(EXTENDED)})")
                # the stages' pools are sliced for the decode ranks (the device pool and its
                # host copy alike), so every rank's heads were put without staging
                plog = "".join(open(p, errors="replace").read()
                               for p in glob.glob(f"{d}/run/**/*p0*.log", recursive=True))
                slices = [int(m) for m in re.findall(r"(\d+) head slices?\)", plog)]
                staged = re.findall(r"puts \(([0-9.]+) MiB staged\)", plog)
                check(len(slices) == 2 and all(n > 1 for n in slices) == (args.tp > 1),
                      f"{shape} on {backend}: the stages' KV pools have {slices} head slices")
                check(staged and all(float(x) == 0 for x in staged),
                      f"{shape} on {backend}: {len(staged)} stage transfers, none staged")
            return texts
        finally:
            subprocess.run([args.tandem, "down", cfg], capture_output=True, timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2, help="decode ranks (must divide the heads)")
    args = ap.parse_args()
    for disagg in (False, True):
        want = serve(args, "cpu", disagg)
        got = serve(args, "cpu-dev", disagg)
        shape = f"pp 2 + tp {args.tp}" if disagg else f"colocated tp {args.tp}"
        for k, p in enumerate(PROMPTS + EXTENDED):
            a = want[k] if want else None
            b = got[k] if got else None
            check(a is not None and a == b,
                  f"{shape}: prompt {k} ({len(p)} tokens) on cpu-dev equals cpu ({b!r} vs {a!r})")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
