#!/usr/bin/env python3
"""test_router_http.py: tandem-router at the HTTP level (raw sockets and http.client), one
tp1 decode instance on the synthetic model. Cases (--case, default all):
  sse        SSE framing byte for byte (HTTP/1.1 chunked and HTTP/1.0), [DONE], headers
  keepalive  several requests (JSON, SSE, GET) on one connection
  concurrent 256 streams open at once all complete with the right text
  errors     a table of bad requests: exact status and an OpenAI error object each;
             401 with an API key configured; /health and /metrics
  logs       timestamps on every line; one info line per finished request (id, endpoint,
             status, finish, prompt/output tokens equal to the usage, TTFT, total time,
             instance); a 400 logged at info without the prompt; /health, /metrics,
             /v1/models polls counted apart, not in tandem_router_requests_total; a clean
             start and stop logs no warn/error line (router and decode)
  fuzz       random and mutated requests for TANDEM_HTTP_FUZZ_SECONDS (default 20), then the
             router still serves

usage: test_router_http.py --router BIN --decode BIN --tandem BIN --synth GGUF [--case C]
"""
import argparse
import http.client
import json
import os
import random
import re
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from rtlib import Cluster, post  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402



def jansson_dumps(obj):
    """json.dumps as jansson's JSON_COMPACT writes it (UTF-8, \\u00XX upper case)."""
    s = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return re.sub(r"\\u00([0-9a-f]{2})", lambda m: "\\u00" + m.group(1).upper(), s)


def raw_request(port, data, timeout=60):
    """Send bytes, read until the server closes: the raw response bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            break
        if not b:
            break
        out += b
    s.close()
    return out


def dechunk(body):
    out, i = b"", 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            return out, body[j + 2:]
        out += body[j + 2:j + 2 + n]
        if body[j + 2 + n:j + 4 + n] != b"\r\n":
            raise ValueError("bad chunk trailer")
        i = j + 4 + n


def req_bytes(path, body, version="1.1", extra=""):
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n").encode() + data


def case_sse(cl):
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0}
    st, _, full = post(cl.http_port, "/v1/completions", body)
    full = json.loads(full)
    text, finish = full["choices"][0]["text"], full["choices"][0]["finish_reason"]
    for version in ("1.1", "1.0"):
        raw = raw_request(cl.http_port, req_bytes("/v1/completions", dict(body, stream=True),
                                                  version))
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        hdr = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        check(re.match(r"HTTP/1\.[01] 200 ", lines[0]) is not None,
              f"sse {version}: status line {lines[0]}")
        check(hdr.get("content-type") == "text/event-stream", f"sse {version}: content type")
        if version == "1.1":
            check(hdr.get("transfer-encoding") == "chunked", "sse 1.1: chunked")
            try:
                payload, trailer = dechunk(rest)
                check(trailer == b"\r\n", "sse 1.1: nothing after the last chunk")
            except ValueError:
                check(False, "sse 1.1: chunked framing")
                continue
        else:
            check("transfer-encoding" not in hdr, "sse 1.0: not chunked")
            payload = rest
        events = payload.split(b"\n\n")
        check(events[-1] == b"" and events[-2] == b"data: [DONE]",
              f"sse {version}: ends with exactly 'data: [DONE]\\n\\n'")
        objs = [json.loads(e[6:]) for e in events[:-2] if e.startswith(b"data: ")]
        check(len(objs) == len(events) - 2, f"sse {version}: every event is one 'data: ' line")
        first = objs[0]
        # rebuild every event from the texts: the bytes must be identical
        want = b""
        got_text = ""
        for o in objs:
            c = o["choices"][0]
            got_text += c["text"]
            want += b"data: " + jansson_dumps({
                "id": first["id"], "object": "text_completion", "created": first["created"],
                "model": first["model"],
                "choices": [{"index": 0, "text": c["text"], "logprobs": None,
                             "finish_reason": c["finish_reason"]}]}).encode() + b"\n\n"
        want += b"data: [DONE]\n\n"
        check(payload == want, f"sse {version}: bytes equal the expected framing")
        check(got_text == text and objs[-1]["choices"][0]["finish_reason"] == finish,
              f"sse {version}: text and finish_reason equal the non-streamed response")
    # chat: role chunk first, finish_reason in the last chunk, usage chunk when asked
    raw = raw_request(cl.http_port, req_bytes("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}, "1.0"))
    payload = raw.partition(b"\r\n\r\n")[2]
    events = [json.loads(e[6:]) for e in payload.split(b"\n\n")[:-2]]
    check(events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""},
          "sse chat: role chunk first")
    check(events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1,
          "sse chat: usage chunk last")
    check(events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
          and all(e["choices"][0]["finish_reason"] is None for e in events[:-2]),
          "sse chat: finish_reason only on the last content chunk")
    check(all(e.get("usage", 0) is None for e in events[:-1]),
          "sse chat: usage null on the other chunks")


def case_keepalive(cl):
    c = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=60)
    socks = set()
    ok = True
    for i in range(3):
        c.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 4}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        ok &= r.status == 200 and "choices" in json.loads(r.read())
        socks.add(id(c.sock))
        c.request("POST", "/v1/completions",
                  json.dumps({"prompt": "Hi", "max_tokens": 4, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        ok &= r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")
        socks.add(id(c.sock))
        c.request("GET", "/health")
        r = c.getresponse()
        ok &= r.status == 200
        r.read()
        socks.add(id(c.sock))
        c.request("POST", "/v1/completions", b"{bad json", {"Content-Type": "application/json"})
        r = c.getresponse()
        ok &= r.status == 400
        r.read()
        socks.add(id(c.sock))
    c.close()
    check(ok, "keepalive: JSON, SSE, GET and errors answered on one connection")
    check(len(socks) == 1, f"keepalive: one TCP connection for 12 requests ({len(socks)})")


def case_concurrent(cl, n=256):
    prompts = ["Hello world", "The quick brown fox", "1 2 3", "Once upon a time"]
    want = {}
    for p in prompts:
        st, _, b = post(cl.http_port, "/v1/completions", {"prompt": p, "max_tokens": 8,
                                                          "temperature": 0})
        want[p] = json.loads(b)["choices"][0]["text"]
    barrier = threading.Barrier(n, timeout=120)
    results = [None] * n

    def worker(i):
        p = prompts[i % len(prompts)]
        try:
            c = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=240)
            c.connect()
            barrier.wait()
            c.request("POST", "/v1/completions",
                      json.dumps({"prompt": p, "max_tokens": 8, "temperature": 0,
                                  "stream": True}), {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            c.close()
            events = data.split(b"\n\n")
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
            results[i] = (r.status, events[-2] == b"data: [DONE]", text == want[p])
        except Exception as e:  # noqa: BLE001
            results[i] = ("exception", repr(e))

    t0 = time.time()
    th = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join(300)
    good = sum(1 for r in results if r == (200, True, True))
    bad = [r for r in results if r != (200, True, True)][:3]
    check(good == n, f"concurrent: {good}/{n} streams complete with the right text "
          f"in {time.time() - t0:.1f} s {bad}")


ERR_TABLE = [
    # (name, method, path, body bytes or obj, status, param)
    ("malformed JSON", "POST", "/v1/completions", b"{\"prompt\": ", 400, None),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "POST", "/v1/chat/completions", b"", 400, None),
    ("prompt wrong type", "POST", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens string", "POST", "/v1/completions", {"prompt": "a", "max_tokens": "10"}, 400,
     "max_tokens"),
    ("temperature string", "POST", "/v1/completions", {"prompt": "a", "temperature": "hot"}, 400,
     "temperature"),
    ("stream not bool", "POST", "/v1/completions", {"prompt": "a", "stream": "yes"}, 400,
     "stream"),
    ("stop wrong type", "POST", "/v1/completions", {"prompt": "a", "stop": 5}, 400, "stop"),
    ("five stop strings", "POST", "/v1/completions", {"prompt": "a", "stop": list("abcde")}, 400,
     "stop"),
    ("messages string", "POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", "POST", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("message without role", "POST", "/v1/chat/completions", {"messages": [{"content": "x"}]},
     400, "messages"),
    ("unknown role", "POST", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages"),
    ("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe abc"}', 400, None),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": -1}, 400,
     "max_tokens"),
    ("zero max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     "max_tokens"),
    ("huge max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 10 ** 9}, 400,
     "max_tokens"),
    ("enormous max_tokens", "POST", "/v1/completions", b'{"prompt": "a", "max_tokens": 1e300}',
     400, "max_tokens"),
    ("max_tokens over the context", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 4000},
     400, "max_tokens"),
    ("negative temperature", "POST", "/v1/completions", {"prompt": "a", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p > 1", "POST", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("prompt over the context", "POST", "/v1/completions", {"prompt": [1] * 600}, 400, "prompt"),
    ("token id outside the vocabulary", "POST", "/v1/completions", {"prompt": [1, 99999]}, 400,
     "prompt"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("n = 0", "POST", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("n over router.max_n", "POST", "/v1/completions", {"prompt": "a", "n": 17}, 400, "n"),
    ("best_of below n", "POST", "/v1/completions", {"prompt": "a", "n": 4, "best_of": 2}, 400,
     "best_of"),
    ("best_of above n streamed", "POST", "/v1/completions",
     {"prompt": "a", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("best_of on chat", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "best_of": 1}, 400, "best_of"),
    ("an empty prompt in a batch", "POST", "/v1/completions", {"prompt": ["a", ""]}, 400,
     "prompt"),
    ("an empty id list in a batch", "POST", "/v1/completions", {"prompt": [[1, 2], []]}, 400,
     "prompt"),
    ("a string then ids", "POST", "/v1/completions", {"prompt": ["a", 5]}, 400, "prompt"),
    ("a batch over router.max_batch_prompts", "POST", "/v1/completions",
     {"prompt": ["a"] * 65}, 400, "prompt"),
    ("echo not a bool", "POST", "/v1/completions", {"prompt": "a", "echo": 1}, 400, "echo"),
    ("logprobs 21", "POST", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("chat logprobs 2", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, 400, "logprobs"),
    ("top_logprobs alone", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs 21", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("max_tokens 0 without echo", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0},
     400, "max_tokens"),
    ("unknown model", "POST", "/v1/completions", {"prompt": "a", "model": "gpt-17"}, 404,
     "model"),
    ("10 MB body", "POST", "/v1/completions",
     b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
    ("unknown path", "POST", "/v1/nothing", {"prompt": "a"}, 404, None),
    ("unknown GET path", "GET", "/index.html", None, 404, None),
    ("GET on completions", "GET", "/v1/completions", None, 405, None),
    ("DELETE on models", "DELETE", "/v1/models", None, 405, None),
    ("unknown model id", "GET", "/v1/models/gpt-17", None, 404, "model"),
    ("DELETE on a model", "DELETE", "/v1/models/gpt-17", None, 405, None),
    ("unknown field", "POST", "/v1/completions", {"prompt": "a", "guided_regex": "a"}, 400,
     "guided_regex"),
    ("max_completion_tokens on completions", "POST", "/v1/completions",
     {"prompt": "a", "max_completion_tokens": 2}, 400, "max_completion_tokens"),
    ("message name not a string", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "name": 7}]}, 400, "messages"),
    ("tool_choice required", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("frequency_penalty > 2", "POST", "/v1/completions", {"prompt": "a", "frequency_penalty": 3},
     400, "frequency_penalty"),
    ("POST on health", "POST", "/health", {}, 405, None),
]


def request(port, method, path, body, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, data, h)
    r = c.getresponse()
    out = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, out


def is_error_object(body):
    try:
        e = json.loads(body)["error"]
        return (isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str)
                and "param" in e and "code" in e)
    except (ValueError, KeyError, TypeError):
        return False


def case_errors(cl, args):
    for name, method, path, body, status, param in ERR_TABLE:
        st, hd, out = request(cl.http_port, method, path, body)
        ok = st == status and is_error_object(out) and hd.get("content-type") == "application/json"
        if ok and param is not None:
            ok = json.loads(out)["error"]["param"] == param
        check(ok, f"errors: {name}: {status}" + ("" if ok else f" (got {st} {out[:200]!r})"))
    st, hd, out = request(cl.http_port, "GET", "/v1/models", None)
    check(st == 200 and json.loads(out)["data"][0]["object"] == "model", "errors: /v1/models 200")
    st, hd, out = request(cl.http_port, "GET", "/health", None)
    check(st == 200, "errors: /health 200")
    st, hd, out = request(cl.http_port, "GET", "/metrics", None)
    text = out.decode()
    want = ["tandem_router_requests_total{status=\"400\"}",
            "tandem_router_time_to_first_token_seconds_bucket",
            "tandem_router_time_per_output_token_seconds_bucket",
            "tandem_router_e2e_request_latency_seconds_count", "tandem_router_prompt_tokens_total",
            "tandem_router_generation_tokens_total", "tandem_router_queue_length",
            "tandem_instance_running{instance=\"d0\"}", "tandem_instance_waiting{instance=\"d0\"}",
            "tandem_instance_kv_usage_ratio{instance=\"d0\"}", "tandem_instance_up{instance=\"d0\"} 1"]
    missing = [w for w in want if w not in text]
    check(st == 200 and hd.get("content-type", "").startswith("text/plain") and not missing,
          f"errors: /metrics has every series {missing}")
    # after the table the router still serves
    st, _, out = request(cl.http_port, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
    check(st == 200, "errors: still serving after the table")


TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [\w.-]+\[\d+\] "
                   r"(debug|info|warn|error): ")
REQ_RE = re.compile(r" info: router: request (\S+) (/v1/\S+)( stream)? status (\d+) "
                    r"(finish|error) (\S+) prompt_tokens (\d+) output_tokens (\d+) "
                    r"ttft_ms (\S+) total_ms (\d+)( decode (\S+))?")


def read_log(cl, name="router.log"):
    with open(os.path.join(cl.dir, name), errors="replace") as f:
        return f.read()


def wait_log(cl, pred, timeout=10):
    """The router log once pred(log) holds (the line of a request may follow its answer)."""
    end = time.time() + timeout
    while True:
        log = read_log(cl)
        if pred(log) or time.time() > end:
            return log
        time.sleep(0.05)


def request_line(log, oid):
    for line in log.splitlines():
        m = REQ_RE.search(line)
        if m and m.group(1) == oid:
            return m
    return None


def metric_samples(port, name):
    """{labels string: value} of one metric family from /metrics."""
    st, _, out = request(port, "GET", "/metrics", None)
    got = {}
    for line in out.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            k, v = line.rsplit(" ", 1)
            got[k[len(name):]] = float(v)
    return got


def case_logs(cl, args):
    port = cl.http_port
    # a finished request: one line with its id and the usage's token counts
    st, _, out = request(port, "POST", "/v1/completions",
                         {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 6, "temperature": 0,
                          "ignore_eos": True})
    body = json.loads(out)
    oid, usage = body["id"], body["usage"]
    log = wait_log(cl, lambda lg: request_line(lg, oid) is not None)
    m = request_line(log, oid)
    ok = (m is not None and st == 200 and m.group(2) == "/v1/completions" and not m.group(3) and
          m.group(4) == "200" and m.group(5) == "finish" and
          int(m.group(7)) == usage["prompt_tokens"] == 7 and
          int(m.group(8)) == usage["completion_tokens"] == 6 and m.group(9).isdigit() and
          int(m.group(9)) <= int(m.group(10)) and m.group(12) == "d0")
    check(ok, f"logs: a completion's line: id, endpoint, 200, prompt 7 and output 6 tokens, "
          f"ttft <= total, decode d0 ({m.group(0) if m else None!r}, usage {usage})")
    check(sum(1 for ln in log.splitlines() if f" request {oid} " in ln) == 1,
          "logs: exactly one line for it")
    # a stream: its line says so, with the usage chunk's counts
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions",
              json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                          "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}),
              {"Content-Type": "application/json"})
    events = [json.loads(e[6:]) for e in c.getresponse().read().split(b"\n\n")
              if e.startswith(b"data: {")]
    c.close()
    oid, usage = events[0]["id"], events[-1].get("usage") or {}
    m = request_line(wait_log(cl, lambda lg: request_line(lg, oid) is not None), oid)
    check(m is not None and m.group(2) == "/v1/chat/completions" and m.group(3) == " stream" and
          m.group(4) == "200" and int(m.group(7)) == usage.get("prompt_tokens") and
          int(m.group(8)) == usage.get("completion_tokens") == 5,
          f"logs: a stream's line ({m.group(0) if m else None!r}, usage {usage})")

    # polls are not API requests: they leave tandem_router_requests_total alone
    before = metric_samples(port, "tandem_router_requests_total")
    http0 = metric_samples(port, "tandem_router_http_requests_total")
    for _ in range(25):
        request(port, "GET", "/health", None)
    for _ in range(3):
        request(port, "GET", "/metrics", None)
    request(port, "GET", "/v1/models", None)
    request(port, "GET", "/favicon.ico", None)
    after = metric_samples(port, "tandem_router_requests_total")
    http1 = metric_samples(port, "tandem_router_http_requests_total")
    d = {k: http1.get(k, 0) - http0.get(k, 0) for k in http1}
    check(after == before, f"logs: 25 /health, 3 /metrics, /v1/models, a 404 leave "
          f"tandem_router_requests_total as it was ({before} -> {after})")
    check(d.get('{path="/health",status="200"}') == 25 and
          d.get('{path="/metrics",status="200"}') == 3 + 2 and  # + metric_samples' own two
          d.get('{path="/v1/models",status="200"}') == 1 and
          d.get('{path="other",status="404"}') == 1,
          f"logs: tandem_router_http_requests_total counts them by path ({d})")

    # a 400: one info line with status, path and param, never the prompt; counted once
    secret = "okapi-marmalade-7319"
    n400 = metric_samples(port, "tandem_router_requests_total").get('{status="400"}', 0)
    st, _, out = request(port, "POST", "/v1/completions", {"prompt": secret, "max_tokens": -1})
    log = wait_log(cl, lambda lg: "refused POST /v1/completions status 400" in lg)
    lines = [ln for ln in log.splitlines()
             if " info: router: refused POST /v1/completions status 400 " in ln and
             " param max_tokens " in ln]
    check(st == 400 and len(lines) >= 1, f"logs: a 400 is logged at info with its param "
          f"({lines[-1:]})")
    check(secret not in log, "logs: the 400's prompt text is not in the log")
    n400b = metric_samples(port, "tandem_router_requests_total").get('{status="400"}', 0)
    check(n400b == n400 + 1, f"logs: the 400 counts once in tandem_router_requests_total "
          f"({n400} -> {n400b})")
    # the other endings have their line too: a deadline passed (504), a client gone (499)
    st, _, out = request(port, "POST", "/v1/completions",
                         {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True},
                         {"X-Tandem-Timeout-Ms": "1"})
    oid = (json.loads(out).get("error") or {}).get("code")
    log = wait_log(cl, lambda lg: " status 504 error request_timeout " in lg)
    check(st == 504 and oid == "request_timeout" and
          any(m and m.group(4) == "504" and m.group(6) == "request_timeout"
              for m in map(REQ_RE.search, log.splitlines())),
          f"logs: a request past its deadline: a line with status 504 error request_timeout "
          f"({st})")
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(req_bytes("/v1/completions", {"prompt": "Hello", "max_tokens": 400,
                                            "ignore_eos": True, "stream": True}))
    first = s.recv(4096)
    s.close()
    log = wait_log(cl, lambda lg: " status 499 error client_closed " in lg)
    m = [m for m in map(REQ_RE.search, log.splitlines())
         if m and m.group(4) == "499" and m.group(6) == "client_closed"]
    check(first.startswith(b"HTTP/1.1 200") and len(m) == 1 and m[0].group(3) == " stream" and
          int(m[0].group(8)) < 400,
          f"logs: a client that leaves mid-stream: a line with status 499 error client_closed "
          f"({m[0].group(0) if m else None!r})")
    bad = [ln for ln in log.splitlines() if ln and not TS_RE.match(ln)]
    check(not bad, f"logs: every router line starts with a UTC timestamp, program and pid "
          f"{bad[:2]}")


def case_clean_stop(args):
    """A clean start and stop: no warn or error line in the router's or the decode's log."""
    with Cluster(args, args.synth) as cl:
        st, _, _ = request(cl.http_port, "POST", "/v1/completions",
                           {"prompt": "Hello", "max_tokens": 4})
        rc = cl.stop()
        logs = read_log(cl) + read_log(cl, "d0.log")
    bad = [ln for ln in logs.splitlines() if re.search(r"\] (warn|error): ", ln)]
    check(st == 200 and rc == 0 and not bad,
          f"clean stop: no warn/error line in the router and decode logs (rc {rc}) {bad[:3]}")
    check(any(TS_RE.match(ln) for ln in read_log(cl, "d0.log").splitlines()),
          "clean stop: the decode node's lines are timestamped too")


def case_api_key(args):
    with Cluster(args, args.synth, api_key="sekrit") as cl:
        body = {"prompt": "a", "max_tokens": 2}
        st, _, out = request(cl.http_port, "POST", "/v1/completions", body)
        check(st == 401 and is_error_object(out), "api key: missing -> 401")
        st, _, out = request(cl.http_port, "POST", "/v1/completions", body,
                             {"Authorization": "Bearer wrong"})
        check(st == 401 and is_error_object(out), "api key: wrong -> 401")
        st, _, out = request(cl.http_port, "GET", "/v1/models", None,
                             {"Authorization": "Bearer wrong"})
        check(st == 401, "api key: /v1/models needs it too")
        st, _, out = request(cl.http_port, "POST", "/v1/completions", body,
                             {"Authorization": "Bearer sekrit"})
        check(st == 200, "api key: right key -> 200")
        check(request(cl.http_port, "GET", "/health", None)[0] == 200,
              "api key: /health needs no key")


def mutate(b, rnd):
    b = bytearray(b)
    for _ in range(rnd.randint(1, 8)):
        op = rnd.randrange(5)
        if op == 0 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif op == 1 and b:
            del b[rnd.randrange(len(b)):][:rnd.randint(1, 20)]
        elif op == 2:
            i = rnd.randrange(len(b) + 1)
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 20)))
        elif op == 3 and b:
            i = rnd.randrange(len(b))
            b[i:i] = b[i:i + rnd.randint(1, 50)] * rnd.randint(1, 30)
        elif op == 4:
            b = b[:rnd.randrange(len(b) + 1)]
    return bytes(b)


def case_fuzz(cl):
    seconds = float(os.environ.get("TANDEM_HTTP_FUZZ_SECONDS", "20"))
    rnd = random.Random(int(os.environ.get("TANDEM_HTTP_FUZZ_SEED", "1")))
    seeds_json = [
        json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0.5, "stop": ["a"]}),
        json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "stream": True, "stream_options": {"include_usage": True}}),
        json.dumps({"messages": [{"role": "system", "content": [{"type": "text", "text": "x"}]},
                                 {"role": "user", "content": "y"}], "max_tokens": 2}),
    ]
    paths = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
    end = time.time() + seconds
    n_raw = n_json = 0
    bad_status = []
    while time.time() < end:
        if rnd.random() < 0.5:
            # well-formed HTTP, mutated JSON: must get 200 or an OpenAI error object
            path = paths[rnd.randrange(2)]
            body = mutate(seeds_json[rnd.randrange(len(seeds_json))].encode(), rnd)
            try:
                st, hd, out = request(cl.http_port, "POST", path, body)
            except (OSError, http.client.HTTPException) as e:
                bad_status.append(("exception", repr(e)))
                continue
            n_json += 1
            if st != 200 and not (st in (400, 404, 413) and is_error_object(out)):
                bad_status.append((st, body[:80], out[:120]))
        else:
            # raw bytes: a mutated whole request, or garbage; any answer (or none) is fine
            path = paths[rnd.randrange(len(paths))]
            method = rnd.choice(["GET", "POST", "PUT", "HEAD", "OPTIONS", "G\x00T"])
            body = seeds_json[rnd.randrange(len(seeds_json))].encode()
            req = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                   f"Connection: close\r\n\r\n").encode() + body
            data = mutate(req, rnd) if rnd.random() < 0.8 else bytes(
                rnd.randrange(256) for _ in range(rnd.randint(1, 2000)))
            try:
                s = socket.create_connection(("127.0.0.1", cl.http_port), timeout=5)
                s.sendall(data)
                if rnd.random() < 0.5:
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(3)
                    while s.recv(65536):
                        pass
                s.close()
            except OSError:
                pass
            n_raw += 1
    check(not bad_status, f"fuzz: {n_json} mutated JSON requests answered 200 or with an error "
          f"object {bad_status[:3]}")
    check(cl.router.poll() is None, f"fuzz: router alive after {n_raw} raw requests")
    st, _, out = request(cl.http_port, "POST", "/v1/completions",
                         {"prompt": "Hello world", "max_tokens": 4, "temperature": 0})
    check(st == 200 and json.loads(out)["choices"][0]["finish_reason"] in ("stop", "length"),
          "fuzz: still serves a completion")
    check(request(cl.http_port, "GET", "/health", None)[0] == 200, "fuzz: /health 200")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--case", default="all")
    args = ap.parse_args()
    t0 = time.time()
    cases = ["sse", "keepalive", "concurrent", "errors", "logs", "fuzz"] if args.case == "all" else \
        args.case.split(",")
    with Cluster(args, args.synth, max_batch=64) as cl:
        for c in cases:
            t = time.time()
            if c == "sse":
                case_sse(cl)
            elif c == "keepalive":
                case_keepalive(cl)
            elif c == "concurrent":
                case_concurrent(cl)
            elif c == "errors":
                case_errors(cl, args)
            elif c == "logs":
                case_logs(cl, args)
            elif c == "fuzz":
                case_fuzz(cl)
            print(f"case {c}: {time.time() - t:.1f} s", flush=True)
        rc = cl.stop()
        check(rc == 0, f"router exits 0 on SIGTERM (got {rc}): {cl.log()[-600:] if rc else ''}")
    if "errors" in cases:
        case_api_key(args)
    if "logs" in cases:
        case_clean_stop(args)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
