#!/usr/bin/env python3
"""startup_time.py: how long `tandem up` of a cluster YAML takes to serve: from the launch
to the router's GET /health answering 200, to `tandem up` saying the cluster is up, and to
the first completion (8 tokens, greedy). Runs the YAML with its ports moved to free ones
and its run_dir in a temporary directory, so it does not collide with a running cluster.
Each start is stopped with SIGINT before the next. The profile cache is $TANDEM_CACHE
(set it to an empty directory for a first start).

usage: startup_time.py --tandem BIN [--config deploy/local.yaml] [--runs N] [--reprofile-first]
Prints one line per start: "start K: health X s, up Y s, first completion Z s".
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def moved_config(path, tmp):
    text = open(path).read()
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


def one_start(args, cfg, port, k, extra):
    t0 = time.monotonic()
    outp = os.path.join(os.path.dirname(cfg), f"up{k}.out")
    with open(outp, "w") as f:
        up = subprocess.Popen([args.tandem, "up", cfg, *extra], stdout=f,
                              stderr=subprocess.STDOUT, start_new_session=True)
    t_health = t_up = None
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
    t_done = None
    try:
        st, body = complete(port)
        t_done = time.monotonic() - t0
        text = body["choices"][0]["text"]
    except Exception as e:
        text = f"error: {e}"
    up.send_signal(signal.SIGINT)
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    print(f"start {k}: health {fmt(t_health)} s, up {fmt(t_up)} s, first completion "
          f"{fmt(t_done)} s ({text!r})", flush=True)
    return open(outp, errors="replace").read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--config", default="deploy/local.yaml")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep", default="", help="copy the run directory's logs here")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-startup-")
    cfg, port = moved_config(args.config, tmp)
    for k in range(args.runs):
        out = one_start(args, cfg, port, k + 1, [])
        if args.keep:
            d = os.path.join(args.keep, f"start{k + 1}")
            os.makedirs(d, exist_ok=True)
            subprocess.run(f"cp -r {tmp}/run/* {d}/", shell=True)
            open(os.path.join(d, "up.out"), "w").write(out)


if __name__ == "__main__":
    main()
