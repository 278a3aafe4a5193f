#!/usr/bin/env python3
"""test_router_faults.py: tandem-router when things go wrong, one tp1 decode instance on the
synthetic model.
  disconnect  clients that close mid-stream: their requests are cancelled on the instance,
              whose KV pool is back to 0 blocks used shortly after (tandem client --health)
  kill        the decode instance is killed mid-stream: streams end with an SSE error event
              then [DONE], a non-streamed request gets 503, /health turns 503, new requests
              get 503; after a restart of the instance the same router serves again
  shutdown    SIGTERM to the router with streams open: each ends with [DONE] (an error event
              before it), the router exits 0

usage: test_router_faults.py --router BIN --decode BIN --tandem BIN --synth GGUF [--case C]
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from rtlib import Cluster, post  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402



LONG = {"prompt": "Hello world", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


def open_stream(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    return c, r


def read_event(r):
    """One SSE event's payload (bytes without 'data: '), or None at the end."""
    line = r.readline()
    if not line:
        return None
    blank = r.readline()
    if not line.startswith(b"data: ") or blank != b"\n":
        raise ValueError(f"bad SSE framing: {line[:80]!r} {blank!r}")
    return line[6:].rstrip(b"\n")


def case_disconnect(cl, n=12):
    streams = [open_stream(cl.http_port, LONG) for _ in range(n)]
    for c, r in streams:
        read_event(r)  # generation has started
    t0 = time.time()
    for c, r in streams:
        c.sock.close()
        c.close()
    freed = wait_for(lambda: cl.kv_used() == 0, 20)
    took = time.time() - t0
    check(freed, f"disconnect: {n} streams closed mid-way, instance kv_used 0 after {took:.1f} s")
    # and the router serves normally afterwards
    st, _, out = post(cl.http_port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    check(st == 200, "disconnect: still serving")


def case_kill(cl, args):
    streams = [open_stream(cl.http_port, LONG) for _ in range(6)]
    for c, r in streams:
        read_event(r)
    result = {}

    def blocking():
        result["st"] = post(cl.http_port, "/v1/completions", LONG, timeout=120)

    th = threading.Thread(target=blocking)
    th.start()
    time.sleep(0.05)
    cl.kill_decode(0)
    t0 = time.time()
    n_error = n_done = 0
    for c, r in streams:
        last, err = None, None
        try:
            while True:
                ev = read_event(r)
                if ev is None:
                    break
                if ev != b"[DONE]" and "error" in json.loads(ev):
                    err = json.loads(ev)["error"]
                last = ev
        except (OSError, ValueError, http.client.HTTPException) as e:
            print("stream exception", repr(e))
        c.close()
        n_done += last == b"[DONE]"
        n_error += err is not None and bool(err.get("message"))
    th.join(120)
    check(n_done == len(streams), f"kill: every stream ends with [DONE] ({n_done})")
    check(n_error >= 1, f"kill: streams cut short end with an error event ({n_error} of "
          f"{len(streams)}) after {time.time() - t0:.1f} s")
    st = result.get("st")
    check(st is not None and st[0] in (200, 503), f"kill: non-streamed request answered "
          f"({st[0] if st else None})")
    if st and st[0] == 503:
        check("error" in json.loads(st[2]) and "retry-after" in st[1],
              "kill: 503 carries an error object and Retry-After")
    check(wait_for(lambda: cl.status("/health") == 503, 30), "kill: /health turns 503")
    st, hd, out = post(cl.http_port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    check(st == 503 and "error" in json.loads(out), f"kill: new request gets 503 ({st})")
    cl.start_decode(0)
    check(wait_for(lambda: cl.status("/health") == 200, 120), "kill: /health 200 after restart")
    st, hd, out = post(cl.http_port, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4,
                                                          "temperature": 0})
    check(st == 200 and json.loads(out)["usage"]["completion_tokens"] >= 1,
          f"kill: the same router serves again ({st})")
    c, r = open_stream(cl.http_port, {"prompt": "Hi", "max_tokens": 4})
    evs = []
    while True:
        ev = read_event(r)
        if ev is None:
            break
        evs.append(ev)
    c.close()
    check(evs and evs[-1] == b"[DONE]", "kill: streaming works again")


def case_shutdown(cl):
    streams = [open_stream(cl.http_port, LONG) for _ in range(8)]
    for c, r in streams:
        read_event(r)
    cl.router.send_signal(signal.SIGTERM)
    ends = []
    for c, r in streams:
        last = None
        try:
            while True:
                ev = read_event(r)
                if ev is None:
                    break
                last = ev
        except (OSError, ValueError, http.client.HTTPException) as e:
            last = repr(e)
        c.close()
        ends.append(last)
    check(all(e == b"[DONE]" for e in ends), f"shutdown: open streams end with [DONE] {ends[:2]}")
    try:
        rc = cl.router.wait(30)
    except subprocess.TimeoutExpired:
        rc = None
    check(rc == 0, f"shutdown: router exits 0 ({rc})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--case", default="all")
    args = ap.parse_args()
    t0 = time.time()
    cases = ["disconnect", "kill", "shutdown"] if args.case == "all" else args.case.split(",")
    # a short instance timeout so the kill is noticed quickly; the synthetic model's steps
    # are short even under sanitizers
    supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lsan.supp")
    lsan = (os.environ.get("LSAN_OPTIONS", "") + f":suppressions={supp}").lstrip(":")
    with Cluster(args, args.synth, instance_timeout_ms=2000, heartbeat_ms=100,
                 router_env={"LSAN_OPTIONS": lsan}) as cl:
        for c in cases:
            t = time.time()
            if c == "disconnect":
                case_disconnect(cl)
            elif c == "kill":
                case_kill(cl, args)
            elif c == "shutdown":
                case_shutdown(cl)
            print(f"case {c}: {time.time() - t:.1f} s", flush=True)
        rc = cl.stop()
        check(rc == 0, f"router exits 0 on SIGTERM (got {rc}) {cl.log()[-1500:] if rc else ''}")
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
