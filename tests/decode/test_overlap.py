#!/usr/bin/env python3
"""test_overlap.py: decode[].overlap (the leader streams and serves its inbox while the next
step computes) gives every request the tokens of the sequential path.

Two colocated clusters (`tandem up -d`: router + one tp1 decode instance, default model),
one with `overlap: true`, one with `overlap: false`, started side by side; the same batch of
requests goes to both at once (so they share steps, and finish at different steps of the
batch) and every answer must be identical, token for token (the completions' logprobs name
every token):
  greedy to max_tokens; seeded sampling (temperature 0.8, seed); a stop string that ends a
  request mid-batch; a chat request that ends with EOS; JSON mode (grammar); n = 3 with a
  seed; a streamed request cancelled after 3 chunks (what it got is a prefix of the same
  request's full answer, and the instance frees its KV: health shows 0 running).

usage: test_overlap.py --tandem BIN --decode BIN --router BIN --model GGUF
"""
import argparse
import http.client
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import UpCluster, client_health  # noqa: E402
from tdtest.ports import free_port  # noqa: E402

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
REQUESTS = [
    ("greedy", COMP, {"prompt": "The capital of France is", "max_tokens": 20, "temperature": 0,
                      "ignore_eos": True, "logprobs": 1}),
    ("seeded", COMP, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8,
                      "seed": 11, "ignore_eos": True, "logprobs": 1}),
    ("stop string", COMP, {"prompt": "1, 2, 3, 4,", "max_tokens": 40, "temperature": 0,
                           "stop": [" 9"], "logprobs": 1}),
    ("eos", CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48,
                   "temperature": 0, "logprobs": True}),
    ("json mode", CHAT, {"messages": [{"role": "user", "content": "A person as JSON."}],
                         "max_tokens": 40, "temperature": 0.7, "seed": 3,
                         "response_format": {"type": "json_object"}, "logprobs": True}),
    ("n=3", COMP, {"prompt": "My favourite colour is", "max_tokens": 12, "temperature": 0.9,
                   "seed": 5, "n": 3, "ignore_eos": True, "logprobs": 1}),
]
CANCEL_BODY = {"prompt": "Count: one, two,", "max_tokens": 200, "temperature": 0,
               "ignore_eos": True, "stream": True}


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data) if data.startswith(b"{") else data.decode(errors="replace")


def tokens_of(status, resp):
    """What must be identical: per choice, the text, the finish reason and the token list
    (logprobs' tokens), or the error."""
    if status != 200 or not isinstance(resp, dict):
        return ("error", status, str(resp)[:200])
    out = []
    for ch in resp.get("choices", []):
        text = ch.get("text", (ch.get("message") or {}).get("content"))
        lp = ch.get("logprobs") or {}
        toks = lp.get("tokens") or [e.get("token") for e in (lp.get("content") or [])]
        out.append((ch.get("index"), text, ch.get("finish_reason"), tuple(toks or ())))
    return tuple(sorted(out, key=lambda x: x[0]))


def stream_cancel(port, body, n_chunks, out):
    """A streamed request closed after n_chunks text chunks: out gets the text it got."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", COMP, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    text, got = "", 0
    for line in r:
        if line.startswith(b"data: {"):
            ch = json.loads(line[6:])["choices"][0]
            if ch.get("text"):
                text += ch["text"]
                got += 1
                if got == n_chunks:
                    break
    c.close()  # the router cancels the request on the decode node
    out.append(text)


def batch(port):
    """Every request at once (and the cancelled stream among them); their answers."""
    res, ths = {}, []

    def one(name, path, body):
        res[name] = tokens_of(*post(port, path, body))

    for name, path, body in REQUESTS:
        ths.append(threading.Thread(target=one, args=(name, path, body)))
    cancelled = []
    ths.append(threading.Thread(target=stream_cancel, args=(port, CANCEL_BODY, 3, cancelled)))
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    res["cancelled prefix"] = cancelled[0] if cancelled else None
    return res


def cluster(args, overlap):
    cl = UpCluster(args.tandem, f"tandem-overlap-{int(overlap)}-",
                   {"decode": args.decode, "router": args.router}, exclude="test_overlap")
    port, dc_port = free_port(1), free_port(1)
    cl.dc_url = f"tcp://127.0.0.1:{dc_port}"
    cl.write_config("ov.yaml", {
        "model": args.model, "run_dir": os.path.join(cl.dir, "run"),
        "router": {"listen": f"127.0.0.1:{port}"},
        "decode": [{"name": "d0", "tp": 1, "threads": 1, "kv_blocks": 1024, "max_batch": 16,
                    "deterministic": True, "overlap": overlap, "port": dc_port}]})
    return cl, port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    t0 = time.time()
    on, port_on = cluster(args, True)
    off, port_off = cluster(args, False)
    ups = {}
    try:
        ths = [threading.Thread(target=lambda k, c: ups.__setitem__(k, c.up(timeout=120)),
                                args=(k, c)) for k, c in (("on", on), ("off", off))]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        for k, r in ups.items():
            check(r.returncode == 0, f"cluster with overlap {k} up: {r.stderr.strip()[-300:]}")
        if FAILS:
            return 1
        res = {}
        ths = [threading.Thread(target=lambda k, p: res.__setitem__(k, batch(p)), args=(k, p))
               for k, p in (("on", port_on), ("off", port_off))]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        for name, _, _ in REQUESTS:
            a, b = res["on"][name], res["off"][name]
            check(a == b and a and a[0] != "error",
                  f"{name}: overlap on and off answer the same tokens ({str(a)[:160]} | "
                  f"{str(b)[:160]})")
        check(res["on"]["stop string"][0][2] == "stop",
              f"stop string: finished by the stop string ({res['on']['stop string']})")
        check(res["on"]["eos"][0][2] == "stop", f"eos: finished by EOS ({res['on']['eos']})")
        check(len(res["on"]["n=3"]) == 3 and len({c[1] for c in res["on"]["n=3"]}) > 1,
              f"n=3: three different choices ({res['on']['n=3']})")
        try:
            json.loads(res["on"]["json mode"][0][1])
            check(True, "json mode: the answer parses as JSON")
        except (ValueError, TypeError, IndexError):
            # a length-capped document is cut; it must then at least be JSON's beginning
            check(res["on"]["json mode"][0][2] == "length" and
                  res["on"]["json mode"][0][1].lstrip().startswith("{"),
                  f"json mode: JSON or a cut JSON document ({res['on']['json mode']})")
        # the cancelled stream: a prefix of the same request's full answer (sequential path)
        st, full = post(port_off, COMP, dict(CANCEL_BODY, stream=False))
        full_text = full["choices"][0]["text"] if st == 200 else ""
        for k in ("on", "off"):
            got = res[k]["cancelled prefix"]
            check(got and full_text.startswith(got),
                  f"cancelled stream (overlap {k}): got {got!r}, a prefix of {full_text[:80]!r}")
        for k, c in (("on", on), ("off", off)):
            h = {}
            for _ in range(50):
                h = client_health(args.tandem, c.dc_url, extra=("--timeout-ms", "2000"))
                if h.get("running") == "0" and h.get("kv_used") == "0":
                    break
                time.sleep(0.1)
            check(h.get("running") == "0" and h.get("kv_used") == "0",
                  f"overlap {k}: nothing running and no KV block used afterwards ({h})")
    finally:
        for c in (on, off):
            if c.cfg:
                c.down(grace=10)
            c.cleanup()
    print(f"     ({time.time() - t0:.1f} s)")
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
