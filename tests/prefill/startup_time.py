#!/usr/bin/env python3
"""startup_time.py: how long `tandem up` of a cluster YAML takes to serve: from the launch
to the router's GET /health answering 200, to `tandem up` saying the cluster is up, and to
the first completion (8 tokens, greedy). Runs the YAML with its ports moved to free ones
and its run_dir in a temporary directory, so it does not collide with a running cluster.
Each start is stopped with SIGINT before the next. The profile cache is $TANDEM_CACHE, or
with --fresh-cache an empty directory of its own (the first start then measures).

As a test (--max-cached-s S, with --fresh-cache): the first start measures the stage
profile, every later start loads it (prefill stage 0's log says which) and completes the
request, and the fastest of them answers /health 200 within S seconds; exit 1 otherwise.

usage: startup_time.py --tandem BIN [--config deploy/local.yaml] [--model GGUF] [--runs N]
                       [--keep DIR] [--extra "ARGS"] [--fresh-cache] [--budget-ms MS]
                       [--max-cached-s S]
Prints one line per start: "start K: health X s, up Y s, first completion Z s".
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.ports import free_port  # noqa: E402


def moved_config(path, tmp, model="", budget_ms=None):
    text = open(path).read()
    if model:
        text = re.sub(r"(?m)^model: \S+", f"model: {model}", text)
    if budget_ms is not None:
        text = re.sub(r"profile_budget_ms: \d+", f"profile_budget_ms: {budget_ms}", text)
    text = re.sub(r"listen: 127\.0\.0\.1:\d+", f"listen: 127.0.0.1:{free_port()}", text)
    text = re.sub(r"(\n    port: )\d+", lambda m: f"{m.group(1)}{free_port()}", text)
    text = re.sub(r"run_dir: \S+", f"run_dir: {tmp}/run", text)
    out = os.path.join(tmp, "cluster.yaml")
    open(out, "w").write(text)
    port = int(re.search(r"listen: 127\.0\.0\.1:(\d+)", text).group(1))
    return out, port


def get(url, timeout=1.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception as e:
        return getattr(e, "code", None)


def complete(port):
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read())


def one_start(args, cfg, port, k, extra, env):
    t0 = time.monotonic()
    outp = os.path.join(os.path.dirname(cfg), f"up{k}.out")
    with open(outp, "w") as f:
        up = subprocess.Popen([args.tandem, "up", cfg, *extra], stdout=f,
                              stderr=subprocess.STDOUT, start_new_session=True, env=env)
    t_health = t_up = t_done = None
    try:
        while time.monotonic() - t0 < 600:
            if up.poll() is not None:
                break
            if t_up is None and "is up in" in open(outp, errors="replace").read():
                t_up = time.monotonic() - t0
            if t_health is None and get(f"http://127.0.0.1:{port}/health", 0.5) == 200:
                t_health = time.monotonic() - t0
            if t_health is not None and t_up is not None:
                break
            time.sleep(0.02)
        try:
            st, body = complete(port)
            t_done = time.monotonic() - t0
            text = body["choices"][0]["text"]
        except Exception as e:
            text = f"error: {e}"
    finally:  # never leave a cluster running
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    print(f"start {k}: health {fmt(t_health)} s, up {fmt(t_up)} s, first completion "
          f"{fmt(t_done)} s ({text!r})", flush=True)
    return open(outp, errors="replace").read(), t_health, t_done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--config", default="deploy/local.yaml")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep", default="", help="copy the run directory's logs here")
    ap.add_argument("--extra", default="", help="more `tandem up` arguments, e.g. --reprofile")
    ap.add_argument("--model", default="", help="replace the YAML's model")
    ap.add_argument("--fresh-cache", action="store_true")
    ap.add_argument("--budget-ms", type=int, default=None, help="replace profile_budget_ms")
    ap.add_argument("--max-cached-s", type=float, default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-startup-")
    cfg, port = moved_config(args.config, tmp, args.model, args.budget_ms)
    env = dict(os.environ)
    if args.fresh_cache:
        env["TANDEM_CACHE"] = os.path.join(tmp, "cache")
    fails, cached = [], []
    for k in range(args.runs):
        out, t_health, t_done = one_start(args, cfg, port, k + 1, args.extra.split(), env)
        if args.keep:
            d = os.path.join(args.keep, f"start{k + 1}")
            os.makedirs(d, exist_ok=True)
            subprocess.run(f"cp -r {tmp}/run/* {d}/", shell=True)
            open(os.path.join(d, "up.out"), "w").write(out)
        if args.max_cached_s is None:
            continue
        logs = glob.glob(os.path.join(tmp, "run", "*", "prefill-*-0.log"))
        log = "".join(open(p, errors="replace").read() for p in logs)
        want = "measuring the stage profile" if k == 0 else "stage profile loaded from the cache"
        if not logs or want not in log:
            fails.append(f"start {k + 1}: stage 0's log does not say '{want}'")
        if k > 0 and (t_health is None or t_done is None):
            fails.append(f"start {k + 1}: /health 200 after {t_health} s, completion after "
                         f"{t_done} s")
        if k > 0 and t_health is not None:
            cached.append(t_health)
    # the fastest cached start must be within the bound: each loaded the profile (its log
    # says so, checked above), and a start slowed by the rest of a busy machine (CI runs
    # other tests beside this one; 3.7 s once under ASan against 1.7 s) says nothing of it
    if args.max_cached_s is not None and args.runs > 1 and \
            (not cached or min(cached) > args.max_cached_s):
        fails.append(f"the fastest cached start served /health after "
                     f"{min(cached) if cached else None} s (at most {args.max_cached_s} s)")
    shutil.rmtree(tmp, ignore_errors=True)
    for f in fails:
        print("FAIL " + f)
    if args.max_cached_s is not None:
        print(f"{len(fails)} failed")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
