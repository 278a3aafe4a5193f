#!/usr/bin/env python3
"""test_router_limits.py: deadlines, fairness, drain and limits of tandem-router, one tp1
decode instance (max_batch 1, so the router gives it at most 4 requests) on the synthetic
model, router.max_queue 4, an API key. The synthetic model is too fast to catch a request
in flight, so the decode process is paused (SIGSTOP) to hold requests and resumed
(SIGCONT) to let them finish; instance_timeout_ms is long enough that a pause does not make
it dead. Cases (--case, default all, in this order):
  deadline  504 request_timeout (JSON) while the instance holds the request, streamed or
            not; the YAML default (1.5 s), the body's "timeout" and X-Tandem-Timeout-Ms (the
            smaller wins), a longer one than the default within the maximum, over the
            maximum or malformed: 400; time queued counts; the instance's KV blocks are
            freed (the requests were cancelled there); the timeouts metric by state
  fairness  one client (127.0.0.1) fills the instance and the queue: its newcomers get 429;
            a request from 127.0.0.2 and one from 127.0.0.3 get in (each evicting the first
            client's newest queued request with 429) and are served round robin, before the
            first client's later queued requests; the evictions metric
  limits    headers over 32 KiB: 431; a body over the limit (1 MiB for 8192 prompt tokens):
            413; the router log at the default level holds neither the prompt texts nor
            the API key
  drain_timeout  SIGTERM with requests held longer than drain_timeout_ms (1 s): new
            requests get 503 + Retry-After, /health 503 "draining"; the held ones get 503
            shutting_down after the drain; exit 0 within drain_timeout + 2 s; their KV
            blocks are freed once the instance runs again
  drain     router restarted with drain_timeout_ms 10000: SIGTERM while a stream is in
            flight; the stream completes normally (finish_reason, [DONE], no error) once
            the instance runs again; exit 0 right after it

usage: test_router_limits.py --router BIN --decode BIN --tandem BIN --synth GGUF [--case C]
"""
import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from rtlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402

KEY = "sk-limits-4242-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET_PROMPT = "zebra quartz lantern prompt"


def request(port, body, headers=None, source="127.0.0.1", path="/v1/completions", timeout=60):
    """One request on a fresh connection from `source`: (status, headers, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                   source_address=(source, 0))
    h = {"Content-Type": "application/json"}
    h.update(AUTH)
    h.update(headers or {})
    data = body if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
    c.request("POST" if body is not None else "GET", path, data if body is not None else None, h)
    r = c.getresponse()
    out = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, out


def get(port, path):
    return request(port, None, path=path)


def err_code(out):
    try:
        return json.loads(out)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def body(n=8, timeout=None, stream=False):
    b = {"prompt": SECRET_PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    if timeout is not None:
        b["timeout"] = timeout
    if stream:
        b["stream"] = True
    return b


class Async:
    """A request in a thread; .result = (status, headers, body, seconds), .t_end."""

    def __init__(self, port, b, headers=None, source="127.0.0.1"):
        self.result, self.t_end = None, None

        def run():
            t0 = time.time()
            try:
                st, hd, out = request(port, b, headers, source)
            except (OSError, http.client.HTTPException) as e:
                st, hd, out = None, {}, repr(e).encode()
            self.t_end = time.time()
            self.result = (st, hd, out, self.t_end - t0)

        self.th = threading.Thread(target=run)
        self.th.start()

    def wait(self, timeout=60):
        self.th.join(timeout)
        return self.result


def metric(port, name):
    st, _, out = get(port, "/metrics")
    m = re.search(rb"^" + re.escape(name.encode()) + rb" (\S+)$", out, re.M)
    return float(m.group(1)) if m else None


class Paused:
    """with Paused(cl): the decode instance is stopped (SIGSTOP) inside the block."""

    def __init__(self, cl):
        self.p = cl.decode[0]

    def __enter__(self):
        self.p.send_signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        self.p.send_signal(signal.SIGCONT)


def case_deadline(cl):
    port = cl.http_port
    with Paused(cl):
        t0 = time.time()
        st, hd, out = request(port, body(timeout=0.5))
        took = time.time() - t0
        check(st == 504 and err_code(out) == "request_timeout" and 0.45 <= took < 1.5,
              f"deadline: body timeout 0.5 s: {st} {err_code(out)} after {took:.2f} s")
        e = json.loads(out)["error"] if st == 504 else {}
        check(e.get("type") == "server_error" and "within its timeout of 500 ms" in
              e.get("message", ""), f"deadline: error object {e}")
        t0 = time.time()
        st, hd, out = request(port, body(stream=True), {"X-Tandem-Timeout-Ms": "700"})
        took = time.time() - t0
        check(st == 504 and err_code(out) == "request_timeout" and
              hd.get("content-type") == "application/json" and 0.65 <= took < 1.6,
              f"deadline: header 700 ms, streaming, nothing sent yet: JSON {st} after {took:.2f} s")
        t0 = time.time()
        st, hd, out = request(port, body(timeout=5), {"X-Tandem-Timeout-Ms": "600"})
        took = time.time() - t0
        check(st == 504 and 0.55 <= took < 1.5, f"deadline: the smaller of body 5 s and header "
              f"600 ms: {st} after {took:.2f} s")
        t0 = time.time()
        st, hd, out = request(port, body())
        took = time.time() - t0
        check(st == 504 and 1.45 <= took < 2.5, f"deadline: the YAML default 1.5 s: {st} after "
              f"{took:.2f} s")
        for b, h, what in [(body(timeout=21), None, "body timeout 21 s > max 20 s"),
                           (body(timeout=0), None, "body timeout 0"),
                           (body(timeout="5"), None, "body timeout as a string"),
                           (body(), {"X-Tandem-Timeout-Ms": "20001"}, "header over the max"),
                           (body(), {"X-Tandem-Timeout-Ms": "1.5"}, "header not an integer"),
                           (body(), {"X-Tandem-Timeout-Ms": "0"}, "header 0")]:
            st, hd, out = request(port, b, h)
            param = json.loads(out)["error"]["param"] if st == 400 else None
            check(st == 400 and param in ("timeout", "X-Tandem-Timeout-Ms"),
                  f"deadline: {what}: 400 ({st} {param})")
        # fill the instance (4 requests, longer than the default timeout), then one queued
        held = [Async(port, body(n=16, timeout=15)) for _ in range(4)]
        time.sleep(0.5)
        t0 = time.time()
        st, hd, out = request(port, body(timeout=0.6))
        took = time.time() - t0
        check(st == 504 and "queued" in json.loads(out)["error"]["message"] and took < 1.5,
              f"deadline: time queued counts: {st} after {took:.2f} s")
        time.sleep(1.6)  # the held ones outlive the YAML default
    res = [h.wait() for h in held]
    check(all(r and r[0] == 200 for r in res), f"deadline: 4 requests with timeout 15 s (> the "
          f"default) held 2.6 s complete: {[r[0] if r else None for r in res]}")
    check(wait_for(lambda: cl.kv_used() == 0, 15), "deadline: the instance's KV blocks are free "
          "again (the timed-out requests were cancelled there)")
    q = metric(port, 'tandem_router_request_timeouts_total{state="queued"}')
    w = metric(port, 'tandem_router_request_timeouts_total{state="waiting"}')
    check(q == 1 and w == 4, f"deadline: timeouts metric queued {q} waiting {w}")


def case_fairness(cl):
    port = cl.http_port
    ev0 = metric(port, "tandem_router_queue_evictions_total") or 0
    with Paused(cl):
        greedy = []
        for _ in range(8):  # 4 on the instance, 4 queued
            greedy.append(Async(port, body(n=200, timeout=15)))
            time.sleep(0.1)
        late = [request(port, body(n=200, timeout=15)) for _ in range(2)]
        check(all(r[0] == 429 and err_code(r[2]) == "queue_full" and "retry-after" in r[1]
                  for r in late), f"fairness: the greedy client's newcomers get 429 "
              f"{[r[0] for r in late]}")
        quiet = Async(port, body(n=200, timeout=15), source="127.0.0.2")
        time.sleep(0.3)
        other = Async(port, body(n=200, timeout=15), source="127.0.0.3")
        time.sleep(0.3)
        evicted = [g for g in greedy if g.result is not None]
        check(len(evicted) == 2 and all(g.result[0] == 429 and b"holds the most" in g.result[2]
                                        for g in evicted),
              f"fairness: two of the greedy client's queued requests were refused for the "
              f"quieter clients ({[g.result[0] for g in evicted]})")
        check(greedy[7] in evicted and greedy[6] in evicted, "fairness: its newest ones")
    res = [g.wait() for g in greedy]
    rq, ro = quiet.wait(), other.wait()
    check(rq and rq[0] == 200 and ro and ro[0] == 200,
          f"fairness: the quiet clients are served ({rq and rq[0]}, {ro and ro[0]})")
    check([r[0] for r in res[:6]] == [200] * 6, f"fairness: the greedy client's other "
          f"requests complete {[r[0] for r in res]}")
    # one request at a time on the instance, FIFO there: completion order == dispatch order.
    # Round robin: greedy #5, 127.0.0.2, 127.0.0.3, greedy #6 (FIFO would serve #6 first)
    order = sorted([(g.t_end, f"g{i + 1}") for i, g in enumerate(greedy[:6])] +
                   [(quiet.t_end, "q2"), (other.t_end, "q3")])
    names = [n for _, n in order]
    check(names[4:] == ["g5", "q2", "q3", "g6"], f"fairness: round robin dispatch {names}")
    ev = (metric(port, "tandem_router_queue_evictions_total") or 0) - ev0
    check(ev == 2, f"fairness: evictions metric +{ev}")


def case_limits(cl):
    port = cl.http_port
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (40 << 10) +
              b"\r\nContent-Length: 2\r\n\r\n{}")
    data = b""
    while True:
        try:
            b = s.recv(65536)
        except OSError:
            break
        if not b:
            break
        data += b
    s.close()
    check(data.startswith(b"HTTP/1.1 431"), f"limits: 40 KiB of headers: {data[:40]!r}")
    st, hd, out = request(port, b'{"prompt": "' + b"a" * (1 << 20) + b'"}')
    check(st == 413 and err_code(out) == "request_too_large" and b"1048576" in out,
          f"limits: a body over 1 MiB: {st}")
    st, hd, out = request(port, {"messages": [{"role": "user", "content": SECRET_PROMPT}],
                                 "max_tokens": 4}, path="/v1/chat/completions")
    check(st == 200, f"limits: a chat request ({st})")
    log = open(os.path.join(cl.dir, "router.log"), errors="replace").read()
    check(SECRET_PROMPT not in log and "zebra" not in log, "limits: no prompt text in the log")
    # (not "4242" alone: a pid, a time or a request id in the log may contain it)
    check(KEY not in log and "limits-4242" not in log and "4242-secret" not in log,
          "limits: no API key in the log")


def case_drain_timeout(cl):
    port = cl.http_port
    with Paused(cl):
        held = [Async(port, body(n=16, timeout=15)), Async(port, body(n=16, timeout=15,
                                                                        stream=True))]
        time.sleep(0.5)
        t0 = time.time()
        cl.router.send_signal(signal.SIGTERM)
        ok503 = wait_for(lambda: request(port, body())[0] == 503, 2)
        st, hd, out = request(port, body())
        check(ok503 and st == 503 and err_code(out) == "shutting_down" and
              hd.get("retry-after") == "1" and hd.get("connection", "").lower() == "close",
              f"drain_timeout: a new request gets 503 shutting_down, Retry-After, close ({st})")
        st, hd, out = get(port, "/health")
        check(st == 503 and b'"draining"' in out, f"drain_timeout: /health 503 draining ({st})")
        res = [h.wait(10) for h in held]
        took = time.time() - t0
        check(all(r and r[0] == 503 and err_code(r[2]) == "shutting_down" for r in res),
              f"drain_timeout: the held requests end with 503 after {took:.2f} s "
              f"({[r and r[0] for r in res]})")
        try:
            rc = cl.router.wait(5)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.time() - t0
        check(rc == 0 and took < 3.0, f"drain_timeout: exit {rc} after {took:.2f} s "
              f"(drain 1 s + 2 s)")
    check(wait_for(lambda: cl.kv_used() == 0, 15),
          "drain_timeout: the instance's KV blocks are free again")


def case_drain(cl):
    with open(cl.cfg) as f:
        text = f.read()
    with open(cl.cfg, "w") as f:
        f.write(text.replace("drain_timeout_ms: 1000", "drain_timeout_ms: 10000"))
    cl.start_router()
    cl.wait_health(200)
    port = cl.http_port
    events = []

    def stream():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        h = {"Content-Type": "application/json"}
        h.update(AUTH)
        c.request("POST", "/v1/completions", json.dumps(body(n=24, timeout=15, stream=True)), h)
        r = c.getresponse()
        events.append(r.status)
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
        c.close()

    with Paused(cl):
        th = threading.Thread(target=stream)
        th.start()
        time.sleep(0.5)
        cl.router.send_signal(signal.SIGTERM)
        check(wait_for(lambda: get(port, "/health")[0] == 503, 2), "drain: /health 503")
        st, hd, out = request(port, body())
        check(st == 503 and err_code(out) == "shutting_down", f"drain: new request 503 ({st})")
        time.sleep(1.0)
        check(cl.router.poll() is None, "drain: the router waits for the open stream")
        t_resume = time.time()
    th.join(30)
    datas = [json.loads(e) for e in events[1:-1]]
    check(events and events[0] == 200 and events[-1] == b"[DONE]" and
          not any("error" in d for d in datas) and
          datas[-1]["choices"][0]["finish_reason"] == "length",
          f"drain: the stream completes normally ({len(events)} events)")
    try:
        rc = cl.router.wait(5)
    except subprocess.TimeoutExpired:
        rc = None
    took = time.time() - t_resume
    check(rc == 0 and took < 3, f"drain: exit {rc} {took:.2f} s after the instance resumed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--case", default="all")
    args = ap.parse_args()
    t0 = time.time()
    cases = (["deadline", "fairness", "limits", "drain_timeout", "drain"] if args.case == "all"
             else args.case.split(","))
    supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lsan.supp")
    lsan = (os.environ.get("LSAN_OPTIONS", "") + f":suppressions={supp}").lstrip(":")
    extra = {"request_timeout_ms": 1500, "max_request_timeout_ms": 20000,
             "drain_timeout_ms": 1000}
    with Cluster(args, args.synth, api_key=KEY, max_queue=4, max_batch=1, heartbeat_ms=100,
                 instance_timeout_ms=60000, router_extra=extra,
                 router_env={"LSAN_OPTIONS": lsan}) as cl:
        for c in cases:
            t = time.time()
            {"deadline": case_deadline, "fairness": case_fairness, "limits": case_limits,
             "drain_timeout": case_drain_timeout, "drain": case_drain}[c](cl)
            print(f"case {c}: {time.time() - t:.1f} s", flush=True)
        if cl.router.poll() is None:
            rc = cl.stop()
            check(rc == 0, f"router exits 0 on SIGTERM (got {rc})")
        else:
            cl.stop()
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
