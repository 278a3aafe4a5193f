#!/usr/bin/env python3
"""fake_router.py: a stand-in for tandem-router in the deployment tests, used when the real
router is not built (and to exercise `tandem up` and `tandem bench` on their own).

    fake_router.py --config FILE

Reads router.listen and the decode instances' host/port from the YAML (the test writes
them explicitly). GET /health: 200 once every decode instance's control port accepts a TCP
connection, else 503. GET /v1/models: one model "fake". POST /v1/completions: `max_tokens`
tokens of " tok"; with "stream": SSE over chunked transfer encoding, a usage chunk when
asked, then [DONE]; without: one JSON object with Content-Length.
"""
import argparse
import json
import re
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def load(path):
    text = open(path).read()
    listen = re.search(r"^\s*listen:\s*(\S+)", text, re.M).group(1)
    decodes = []
    for block in re.split(r"^\s*-\s*name:", text, flags=re.M)[1:]:
        host = re.search(r"^\s*host:\s*(\S+)", block, re.M)
        port = re.search(r"^\s*port:\s*(\d+)", block, re.M)
        decodes.append((host.group(1) if host else "127.0.0.1", int(port.group(1))))
    return listen, decodes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    listen, decodes = load(args.config)
    host, port = listen.rsplit(":", 1)

    def healthy():
        for h, p in decodes:
            try:
                socket.create_connection((h, p), timeout=1).close()
            except OSError:
                return False
        return True

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, status, obj):
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def do_GET(self):
            if self.path == "/health":
                ok = healthy()
                self.reply(200 if ok else 503, {"status": "ok" if ok else "no instance"})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
            else:
                self.reply(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                           "param": None, "code": None}})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", "0"))
            try:
                req = json.loads(self.rfile.read(n))
                max_tokens = int(req.get("max_tokens", 16))
            except (ValueError, TypeError):
                self.reply(400, {"error": {"message": "bad json", "type": "invalid_request_error",
                                           "param": None, "code": None}})
                return
            prompt = req.get("prompt")
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            usage = {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                     "total_tokens": n_prompt + max_tokens}
            base = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                    "model": "fake"}
            if not req.get("stream"):
                self.reply(200, dict(base, choices=[{"text": " tok" * max_tokens, "index": 0,
                                                     "finish_reason": "length"}], usage=usage))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()

            def event(data):
                b = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
                self.wfile.flush()

            for i in range(max_tokens):
                fin = "length" if i == max_tokens - 1 else None
                event(json.dumps(dict(base, choices=[{"text": " tok", "index": 0,
                                                      "finish_reason": fin}])))
                time.sleep(0.002)
            if (req.get("stream_options") or {}).get("include_usage"):
                event(json.dumps(dict(base, choices=[], usage=usage)))
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

    srv = ThreadingHTTPServer((host.strip("[]"), int(port)), H)
    srv.daemon_threads = True
    print(f"fake router on {listen}, decode {decodes}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
