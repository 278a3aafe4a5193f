#!/usr/bin/env python3
"""test_soak.py: the soak test (issue 7): a cluster started by `tandem up -d` on a generated
YAML under steady load with client cancellations, checked for errors, leaks and memory growth.

Cluster (--shape), on the synthetic model (or --model GGUF: the manual long mode on a real
model), random ports, a temp run dir:
  disagg     (default) the default shape of deploy/local.yaml: tandem-router + prefill
             instance p0 (pp 2: two tandem-prefill stages, chunks of 128, kv_tokens 8192) +
             decode instance d0 (tp 1); every request is prefilled by p0 and its KV pushed
             into d0 over shared memory (posix,cma,self); kv_blocks 256, max_batch 16;
  colocated  tandem-router + decode instance d0 (tp 1) + decode instance d1 (tp 2), which
             prefill their own prompts; kv_blocks 256, max_batch 16 per instance.

Load: --concurrency (default 16) client threads, each one request at a time on a fresh
connection, for --seconds (default $TANDEM_SOAK_SECONDS, else 30):
  - /v1/completions (token-id prompts of 1..400 tokens, or text) and /v1/chat/completions,
    streaming or not (streams sometimes with stream_options.include_usage), max_tokens
    1..64, greedy or sampled with a seed, top_p/top_k/stop/ignore_eos now and then;
  - ~10% of requests are streams the client cancels by closing the connection at a random
    point: right after sending the request, or after k SSE events (half by FIN, half by
    RST via SO_LINGER 0);
  - ~2% deliberately invalid requests (malformed JSON, out-of-range fields, n over router.max_n, unsupported
    fields, a prompt over router.max_prompt_tokens, an unknown model): the expected 4xx with
    an OpenAI error object.
Every answer is checked (status, JSON shape, SSE framing, [DONE], finish_reason,
completion_tokens <= max_tokens); anything else is an "unexpected" outcome.

Sampled once a second: VmRSS and RssAnon (/proc/PID/status) of the router, of every prefill
stage and of every decode rank, the router's /metrics (KV blocks used per instance, queue,
running).

Checks at the end:
  1. zero unexpected outcomes (every request: success, its expected 4xx, or cancelled by us)
     and no 5xx in the router's tandem_router_requests_total;
  2. within --drain-timeout (30 s) after the load stops: the router's
     tandem_instance_kv_blocks_used{instance} is 0 for every decode instance, queue and
     running 0 (disagg: tandem_prefill_instance_{requests,running,waiting} 0 too), and
     `tandem client --url tcp://127.0.0.1:PORT --health` of each decode instance and of
     prefill stage 0 says kv_used 0, running 0, waiting 0;
  3. resident memory: for every process, growth of VmRSS from the end of the warm-up
     window (the first --warmup seconds, default max(10 s, 25% of the run)) to the highest
     sample after it is below --rss-bound-mb (20 MiB, absolute; see BOUND below);
  4. every process of the cluster is still alive (the same pids as after `up`);
  5. `tandem down` exits 0, `tandem status` says stopped, no process mentions the temp dir,
     the decode nodes' /dev/shm segments are gone and (sanitizer builds) no log holds a
     sanitizer report.
A summary (requests by outcome, tokens, RSS per process at warm-up / peak / end) is printed,
and with --json FILE written as JSON.

BOUND: an absolute bound, not a relative one. The processes are small (the synthetic model's
decode rank is tens of MB), so 15% of their RSS is a few MB, less than legitimate one-off
growth after warm-up: the KV pool is an anonymous mapping touched lazily, so a new KV
high-water mark adds up to kv_blocks x 48 KiB = 12 MiB on the tp-1 rank of the synthetic
model. 20 MiB still catches a leak of ~4 KiB per request over the few thousand requests of
the 120 s run. KV POOL: with --model the pool is 64 blocks per rank (SmolLM2-135M: 368 KiB
a block on tp 1, 23 MiB in all), which 16 streams of up to ~460 tokens fill during the
warm-up, so its lazily touched pages are all resident before the growth is measured; the
instances then also queue requests (ERR_BUSY / waiting), which is part of what is soaked. With --asan the sanitizer's quarantine of freed memory is capped
(ASAN_OPTIONS quarantine_size_mb=4) so it does not read as growth.

Manual long mode on the default model (not a ctest):
  TANDEM_SOAK_SECONDS=600 python tests/soak/test_soak.py --tandem build/bin/tandem \
      --decode build/bin/tandem-decode --router build/bin/tandem-router \
      --synth build/test-data/synth/llama.gguf --model "$TANDEM_MODEL"

usage: test_soak.py --tandem BIN --decode BIN --router BIN [--prefill BIN] --synth GGUF
                    [--shape disagg|colocated] [--model GGUF]
                    [--seconds S] [--concurrency C] [--warmup S] [--rss-bound-mb MB]
                    [--drain-timeout S] [--kv-blocks N] [--asan] [--json FILE] [--seed N]
                    [--keep]
"""
import argparse
import http.client
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import traceback

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from soaklib import SoakCluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.procs import alive, proc_status  # noqa: E402
from tdtest.waits import wait_timed  # noqa: E402


WORDS = ("the quick brown fox jumps over lazy dog what is capital of France Paris a city on "
         "river Seine tell me story about little robot who wanted to learn how paint once upon "
         "time there was small that lived in workshop with an old painter every morning mixed "
         "colors and watched numbers like 12 345 2024 are split into digits many legs does "
         "spider have eight write haiku sea waves fold light salt wind carries gull's cry tide "
         "keeps its explain why sky blue sunlight scattered by molecules air more than red "
         "hello world this test tokenizer punctuation quotes apostrophes it's don't we're "
         "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c \U0001f600").split()


# --- one request --------------------------------------------------------------------------
class Outcome:
    OK, EXPECTED_4XX, CANCELLED, UNEXPECTED = "ok", "expected_4xx", "cancelled", "unexpected"


def length_pick(rng):
    """Prompt length in tokens, 1..400: mostly short, some medium, some long."""
    u = rng.random()
    if u < 0.4:
        return rng.randint(1, 32)
    if u < 0.8:
        return rng.randint(33, 160)
    return rng.randint(161, 400)


def text_pick(rng, max_words):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


INVALID = [
    # (label, path, raw body, expected status)
    ("malformed json", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens -1 stream", "/v1/completions",
     {"prompt": "hi", "max_tokens": -1, "stream": True}, 400),
    ("n over router.max_n", "/v1/completions", {"prompt": "hi", "n": 17}, 400),
    ("temperature 5", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400),
    ("prompt over max_prompt_tokens", "/v1/completions",
     {"prompt": [150] * 9000, "max_tokens": 4}, 400),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400),
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
]


class Result:
    __slots__ = ("kind", "outcome", "detail", "status", "prompt_tokens", "completion_tokens",
                 "seconds", "t_end")

    def __init__(self, kind):
        self.kind = kind
        self.outcome = None
        self.detail = ""
        self.status = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.seconds = 0.0
        self.t_end = 0.0


def make_request(rng, model_name, cancel_p, invalid_p):
    """(kind, path, body (dict or bytes), expected status, cancel point or None)."""
    if rng.random() < invalid_p:
        label, path, body, want = rng.choice(INVALID)
        return f"invalid:{label}", path, body, want, None
    chat = rng.random() < 0.35
    cancel = None
    stream = rng.random() < 0.5
    if rng.random() < cancel_p:
        stream = True
        cancel = -1  # decided below, once max_tokens is known
    body = {"max_tokens": rng.randint(1, 64)}
    if model_name and rng.random() < 0.5:
        body["model"] = model_name
    if rng.random() < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice([0.7, 1.0, 1.3])
        if rng.random() < 0.7:
            body["seed"] = rng.randint(0, 2 ** 31 - 1)
        if rng.random() < 0.3:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["stop"] = rng.choice([".", ["the", "\n"], "ro"])
    if chat:
        path = "/v1/chat/completions"
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": text_pick(rng, 20)})
        msgs.append({"role": "user", "content": text_pick(rng, 80)})
        if rng.random() < 0.2:
            msgs += [{"role": "assistant", "content": text_pick(rng, 30)},
                     {"role": "user", "content": [{"type": "text", "text": text_pick(rng, 20)}]}]
        body["messages"] = msgs
    else:
        path = "/v1/completions"
        if rng.random() < 0.7:
            body["prompt"] = [rng.randrange(100, 500) for _ in range(length_pick(rng))]
        else:
            body["prompt"] = text_pick(rng, 120)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if cancel is not None:
        # a point inside the stream: 0 = right after sending the request, before any answer
        body["max_tokens"] = max(body["max_tokens"], 8)
        body["ignore_eos"] = True
        body.pop("stop", None)
        cancel = 0 if rng.random() < 0.2 else rng.randint(1, body["max_tokens"] - 2)
    kind = ("chat" if chat else "cmpl") + ("-stream" if stream else "") + \
        ("-cancel" if cancel is not None else "")
    return kind, path, body, 200, cancel


def abort_conn(conn, rng):
    """Closes the client side abruptly: FIN, or RST (SO_LINGER 0) half of the time."""
    s = conn.sock
    if s is not None:
        try:
            if rng.random() < 0.5:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass
    conn.close()


def read_sse(resp, res, body, chat, cancel_at, conn, rng):
    """Reads the SSE stream; cancels after cancel_at events. Returns the outcome."""
    n_events = 0
    finish = None
    usage = None
    got_done = False
    n_tokens_chunks = 0
    want_usage = bool(body.get("stream_options", {}).get("include_usage"))
    while True:
        if cancel_at is not None and n_events >= cancel_at:
            abort_conn(conn, rng)
            res.detail = f"cancelled after {n_events} events"
            return Outcome.CANCELLED
        line = resp.readline()
        if not line:
            break
        blank = resp.readline()
        if not line.startswith(b"data: ") or blank != b"\n":
            res.detail = f"bad SSE framing: {line[:100]!r} {blank[:20]!r}"
            return Outcome.UNEXPECTED
        payload = line[6:].rstrip(b"\n")
        n_events += 1
        if payload == b"[DONE]":
            got_done = True
            if resp.readline():
                res.detail = "data after [DONE]"
                return Outcome.UNEXPECTED
            break
        ev = json.loads(payload)
        if "error" in ev:
            res.detail = f"SSE error event: {payload[:300]!r}"
            return Outcome.UNEXPECTED
        if ev.get("usage"):
            usage = ev["usage"]
        ch = ev.get("choices")
        if ch:
            c0 = ch[0]
            if chat:
                if "delta" not in c0:
                    res.detail = f"chat chunk without delta: {payload[:200]!r}"
                    return Outcome.UNEXPECTED
            elif not isinstance(c0.get("text"), str):
                res.detail = f"chunk without text: {payload[:200]!r}"
                return Outcome.UNEXPECTED
            if c0.get("finish_reason"):
                finish = c0["finish_reason"]
            piece = (c0.get("delta") or {}).get("content") if chat else c0.get("text")
            n_tokens_chunks += bool(piece)
    if cancel_at is not None:
        # the stream ended before our cancel point: it counts as a normal completion
        res.detail = f"finished before the cancel point ({n_events} < {cancel_at} events)"
    if not got_done:
        res.detail = f"stream ended without [DONE] after {n_events} events"
        return Outcome.UNEXPECTED
    if finish not in ("stop", "length"):
        res.detail = f"stream without a finish_reason ({finish!r})"
        return Outcome.UNEXPECTED
    if want_usage:
        if not usage:
            res.detail = "include_usage but no usage chunk"
            return Outcome.UNEXPECTED
        res.prompt_tokens = usage.get("prompt_tokens", 0)
        res.completion_tokens = usage.get("completion_tokens", 0)
        if not 1 <= res.completion_tokens <= body["max_tokens"]:
            res.detail = (f"completion_tokens {res.completion_tokens} vs max {body['max_tokens']} "
                          f"(finish_reason {finish})")
            return Outcome.UNEXPECTED
        if body.get("ignore_eos") and "stop" not in body and \
                res.completion_tokens != body["max_tokens"]:
            res.detail = (f"ignore_eos: {res.completion_tokens} tokens, "
                          f"max_tokens {body['max_tokens']}")
            return Outcome.UNEXPECTED
    else:
        res.completion_tokens = n_tokens_chunks  # a lower bound: chunks with text
    return Outcome.OK


def check_json_answer(res, body, chat, data):
    r = json.loads(data)
    ch = r.get("choices")
    if not isinstance(ch, list) or len(ch) != 1:
        res.detail = f"no choices: {data[:300]!r}"
        return Outcome.UNEXPECTED
    c0 = ch[0]
    text = c0.get("message", {}).get("content") if chat else c0.get("text")
    if not isinstance(text, str):
        res.detail = f"no text: {data[:300]!r}"
        return Outcome.UNEXPECTED
    if c0.get("finish_reason") not in ("stop", "length"):
        res.detail = f"finish_reason {c0.get('finish_reason')!r}"
        return Outcome.UNEXPECTED
    u = r.get("usage") or {}
    res.prompt_tokens = u.get("prompt_tokens", 0)
    res.completion_tokens = u.get("completion_tokens", 0)
    if res.prompt_tokens < 1 or not 1 <= res.completion_tokens <= body["max_tokens"]:
        res.detail = f"usage {u} vs max_tokens {body['max_tokens']}, text {text[:40]!r}"
        return Outcome.UNEXPECTED
    if body.get("ignore_eos") and "stop" not in body and \
            res.completion_tokens != body["max_tokens"]:
        res.detail = f"ignore_eos: {res.completion_tokens} tokens, max {body['max_tokens']}"
        return Outcome.UNEXPECTED
    return Outcome.OK


def run_one(port, rng, model_name, cancel_p, invalid_p, timeout):
    kind, path, body, want, cancel_at = make_request(rng, model_name, cancel_p, invalid_p)
    res = Result(kind)
    chat = path.endswith("chat/completions")
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        if cancel_at == 0:
            abort_conn(conn, rng)
            res.detail = "cancelled before the answer"
            res.outcome = Outcome.CANCELLED
            return res
        resp = conn.getresponse()
        res.status = resp.status
        if want != 200:
            out = resp.read()
            try:
                err = json.loads(out).get("error", {})
            except (ValueError, AttributeError):
                err = {}
            if resp.status == want and isinstance(err, dict) and err.get("message"):
                res.outcome = Outcome.EXPECTED_4XX
            else:
                res.outcome = Outcome.UNEXPECTED
                res.detail = f"wanted {want}, got {resp.status}: {out[:300]!r}"
            return res
        if resp.status != 200:
            res.outcome = Outcome.UNEXPECTED
            res.detail = f"status {resp.status}: {resp.read()[:300]!r}"
            return res
        if body.get("stream"):
            ctype = resp.getheader("Content-Type", "")
            if not ctype.startswith("text/event-stream"):
                res.outcome = Outcome.UNEXPECTED
                res.detail = f"stream with Content-Type {ctype!r}"
                return res
            res.outcome = read_sse(resp, res, body, chat, cancel_at, conn, rng)
        else:
            res.outcome = check_json_answer(res, body, chat, resp.read())
        return res
    except (OSError, ValueError, http.client.HTTPException) as e:
        res.outcome = Outcome.UNEXPECTED
        res.detail = f"{kind}: {type(e).__name__}: {e}"
        return res
    finally:
        res.seconds = time.time() - t0
        res.t_end = time.time()
        conn.close()
        if res.outcome == Outcome.UNEXPECTED:
            res.detail = f"{path} {json.dumps(body)[:200] if isinstance(body, dict) else body[:60]!r}" \
                         f" -> {res.detail}"


class Load:
    def __init__(self, port, model_name, concurrency, seconds, seed, cancel_p=0.10,
                 invalid_p=0.02, timeout=600):
        self.port = port
        self.model_name = model_name
        self.concurrency = concurrency
        self.seconds = seconds
        self.seed = seed
        self.cancel_p = cancel_p
        self.invalid_p = invalid_p
        self.timeout = timeout
        self.results = []
        self.mu = threading.Lock()
        self.stop_at = None
        self.crashes = []

    def worker(self, i):
        rng = random.Random(self.seed * 1000 + i)
        # worker 0 starts with an invalid request, so every soak has at least one (at 2 % a
        # run of ~160 requests had none 4 % of the time, and the check below failed)
        invalid_p = 1.0 if i == 0 and self.invalid_p > 0 else self.invalid_p
        try:
            while time.time() < self.stop_at:
                r = run_one(self.port, rng, self.model_name, self.cancel_p, invalid_p,
                            self.timeout)
                invalid_p = self.invalid_p
                with self.mu:
                    self.results.append(r)
        except Exception:  # a bug in the test itself: reported, not swallowed
            self.crashes.append(traceback.format_exc())

    def start(self):
        self.t0 = time.time()
        self.stop_at = self.t0 + self.seconds
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True)
                        for i in range(self.concurrency)]
        for t in self.threads:
            t.start()

    def join(self, timeout):
        end = time.time() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.time()))
        self.t_end = time.time()
        return [t for t in self.threads if t.is_alive()]

    def snapshot(self):
        with self.mu:
            return list(self.results)


class Sampler(threading.Thread):
    """Once a second: RSS of every process, the router's KV / queue gauges."""

    def __init__(self, cl, period=1.0):
        super().__init__(daemon=True)
        self.cl = cl
        self.period = period
        self.samples = []  # (t, {label: {"VmRSS", "RssAnon"}}, {"kv": {inst: used}, ...})
        self.halt = threading.Event()
        self.metric_errors = 0

    def sample(self):
        rss = {}
        for p in self.cl.procs:
            st = proc_status(p["pid"])
            rss[self.cl.label(p)] = None if st is None else {
                "VmRSS": st.get("VmRSS", 0), "RssAnon": st.get("RssAnon", 0)}
        gauges = {}
        try:
            m = self.cl.metrics(timeout=10)
            for (name, labels), v in (m or {}).items():
                if name == "tandem_instance_kv_blocks_used":
                    gauges.setdefault("kv", {})[dict(labels)["instance"]] = v
                elif name == "tandem_router_queue_length":
                    gauges["queue"] = v
                elif name == "tandem_router_requests_running":
                    gauges["running"] = v
        except (OSError, http.client.HTTPException):
            self.metric_errors += 1
        return time.time(), rss, gauges

    def run(self):
        while not self.halt.is_set():
            self.samples.append(self.sample())
            self.halt.wait(self.period)


# --- the test ------------------------------------------------------------------------------
def model_name_of(cl):
    st, out = cl.http_get("/v1/models")
    try:
        return json.loads(out)["data"][0]["id"] if st == 200 else None
    except (ValueError, KeyError, IndexError):
        return None


def statuses(m):
    return {dict(l)["status"]: int(v) for (n, l), v in m.items()
            if n == "tandem_router_requests_total"}


def kv_idle(cl):
    """(idle?, description) from the router's /metrics and each instance's health."""
    m = cl.metrics(timeout=10) or {}
    desc = []
    idle = bool(m)
    for name, _ in cl.decodes:
        for g in ("kv_blocks_used", "running", "waiting"):
            v = m.get((f"tandem_instance_{g}", (("instance", name),)))
            desc.append(f"router:{name[4:].lstrip('0123456789')}.{g}={v}")
            idle &= v == 0
    for g in ("tandem_router_queue_length", "tandem_router_requests_running"):
        v = m.get((g, ()))
        desc.append(f"{g[13:]}={v}")
        idle &= v == 0
    for name, _ in cl.prefills:
        for g in ("requests", "running", "waiting", "queued_prompt_tokens"):
            v = m.get((f"tandem_prefill_instance_{g}", (("instance", name),)))
            desc.append(f"router:{name[4:].lstrip('0123456789')}.{g}={v}")
            idle &= v == 0
    healths = [(name, cl.instance_health(i, timeout=30)) for i, (name, _) in
               enumerate(cl.decodes)]
    healths += [(name, cl.prefill_health(i, timeout=30)) for i, (name, _) in
                enumerate(cl.prefills)]
    for name, h in healths:
        short = name[4:].lstrip("0123456789")
        if h is None:
            desc.append(f"{short}: no health reply")
            idle = False
            continue
        desc.append(f"{short}: kv_used {h.get('kv_used')} running {h.get('running')} "
                    f"waiting {h.get('waiting')}")
        idle &= h.get("kv_used") == 0 and h.get("running") == 0 and h.get("waiting") == 0
    return idle, ", ".join(desc)


def rss_report(sampler, cl, warmup_end):
    """{label: {"warmup", "peak_after", "end", "growth_kb", "anon_warmup", "anon_end"}}."""
    out = {}
    for p in cl.procs:
        lab = cl.label(p)
        series = [(t, r[lab]) for t, r, _ in sampler.samples if r.get(lab)]
        if not series:
            continue
        before = [s for t, s in series if t <= warmup_end]
        after = [s for t, s in series if t > warmup_end]
        w = before[-1] if before else series[0][1]
        after = after or [series[-1][1]]
        out[lab] = {"pid": p["pid"], "first": series[0][1]["VmRSS"], "warmup": w["VmRSS"],
                    "peak_after": max(s["VmRSS"] for s in after), "end": after[-1]["VmRSS"],
                    "anon_warmup": w["RssAnon"], "anon_end": after[-1]["RssAnon"]}
        out[lab]["growth_kb"] = out[lab]["peak_after"] - out[lab]["warmup"]
        # flatness: the second half of the measured window alone (a one-off step such as a
        # new KV high-water mark shows in growth_kb, a steady leak in both)
        t_w = max(t for t, _ in series if t <= warmup_end) if before else series[0][0]
        t_mid = (t_w + series[-1][0]) / 2
        mid = [s for t, s in series if t <= t_mid][-1]
        out[lab]["mid"] = mid["VmRSS"]
        out[lab]["growth_2nd_half_kb"] = out[lab]["end"] - mid["VmRSS"]
    return out


def summarize(results, load_seconds):
    by_outcome, by_kind, details = {}, {}, []
    tokens_out = tokens_in = 0
    for r in results:
        by_outcome[r.outcome] = by_outcome.get(r.outcome, 0) + 1
        k = by_kind.setdefault(r.kind if not r.kind.startswith("invalid:") else "invalid", {})
        k[r.outcome] = k.get(r.outcome, 0) + 1
        if r.outcome == Outcome.OK:
            tokens_out += r.completion_tokens
            tokens_in += r.prompt_tokens
        if r.outcome == Outcome.UNEXPECTED:
            details.append(r.detail)
    lat = sorted(r.seconds for r in results if r.outcome == Outcome.OK)
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None)
    return {"requests": len(results), "by_outcome": by_outcome, "by_kind": by_kind,
            "completion_tokens": tokens_out, "prompt_tokens_reported": tokens_in,
            "requests_per_s": len(results) / load_seconds if load_seconds else 0,
            "e2e_s_p50": pct(0.5), "e2e_s_p99": pct(0.99), "unexpected": details}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--prefill", default="", help="tandem-prefill (needed by --shape disagg)")
    ap.add_argument("--shape", choices=["disagg", "colocated"],
                    default=os.environ.get("TANDEM_SOAK_SHAPE") or "disagg")
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", default="", help="soak this model instead (manual long mode)")
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("TANDEM_SOAK_SECONDS") or 30))
    ap.add_argument("--concurrency", type=int,
                    default=int(os.environ.get("TANDEM_SOAK_CONCURRENCY") or 16))
    ap.add_argument("--warmup", type=float, default=None)
    ap.add_argument("--rss-bound-mb", type=float, default=20.0)
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="KV blocks per rank (default 256; 64 with --model, see KV POOL)")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--asan", action="store_true", help="the binaries are sanitizer builds")
    ap.add_argument("--json", default="")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("TANDEM_SOAK_SEED") or 0))
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()
    for b in (args.tandem, args.decode, args.router) + \
            ((args.prefill,) if args.shape == "disagg" else ()):
        if not os.access(b, os.X_OK):
            print(f"FAIL {b} is not built")
            return 1
    model = args.model or args.synth
    seed = args.seed or random.randrange(1, 1 << 30)
    warmup = args.warmup if args.warmup is not None else max(10.0, 0.25 * args.seconds)
    warmup = min(warmup, 0.5 * args.seconds)
    print(f"soak: {args.shape}, model {model}, {args.seconds:.0f} s, concurrency "
          f"{args.concurrency}, "
          f"warm-up {warmup:.0f} s, seed {seed} (TANDEM_SOAK_SEED={seed} repeats the request mix)",
          flush=True)
    env_extra = {}
    if args.asan:
        supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "lsan.supp")
        env_extra["LSAN_OPTIONS"] = (os.environ.get("LSAN_OPTIONS", "") +
                                     f":suppressions={supp}").lstrip(":")
        # freed memory parked in the quarantine (256 MB by default) would read as growth
        env_extra["ASAN_OPTIONS"] = (os.environ.get("ASAN_OPTIONS", "") +
                                     ":quarantine_size_mb=4").lstrip(":")
    kv_blocks = args.kv_blocks or (64 if args.model else 256)
    if args.shape == "disagg":  # deploy/local.yaml's shape
        cl = SoakCluster(args, model, [("d0", 1)], kv_blocks=kv_blocks, env_extra=env_extra,
                         prefills=[("p0", 2)])
    else:
        cl = SoakCluster(args, model, [("d0", 1), ("d1", 2)], kv_blocks=kv_blocks,
                         env_extra=env_extra)
    n_procs = 1 + sum(tp for _, tp in cl.decodes) + sum(pp for _, pp in cl.prefills)
    t_start = time.time()
    sampler = None
    load = None
    report = {"shape": args.shape, "model": os.path.basename(model), "seconds": args.seconds,
              "kv_blocks": kv_blocks,
              "concurrency": args.concurrency, "seed": seed, "warmup_s": warmup}
    try:
        r = cl.up(timeout=300)
        if not check(r.returncode == 0, f"tandem up -d: cluster up in {time.time() - t_start:.1f} s "
                                        f"({(r.stdout + r.stderr).strip()[-800:]})"):
            return 1
        labels = [cl.label(p) for p in cl.procs]
        check(len(cl.procs) == n_procs and all(p["state"] == "running" for p in cl.procs),
              f"status: {n_procs} processes running ({labels})")
        name = model_name_of(cl)
        check(name is not None, f"GET /v1/models: {name}")

        # `tandem up` polls /health until 200: the 503s it saw are not the soak's
        status_base = statuses(cl.metrics() or {})
        sampler = Sampler(cl)
        sampler.start()
        load = Load(cl.port, name, args.concurrency, args.seconds, seed)
        load.start()
        warmup_end = load.t0 + warmup
        last = time.time()
        while time.time() < load.stop_at:
            time.sleep(min(5.0, max(0.1, load.stop_at - time.time())))
            if time.time() - last >= 5 or time.time() >= load.stop_at:
                last = time.time()
                res = load.snapshot()
                s = sampler.samples[-1] if sampler.samples else None
                kv = s[2].get("kv", {}) if s else {}
                print(f"  t={time.time() - load.t0:5.0f} s  requests {len(res)}  unexpected "
                      f"{sum(r.outcome == Outcome.UNEXPECTED for r in res)}  kv_used "
                      f"{[int(v) for v in kv.values()]}  queue {s[2].get('queue') if s else None}",
                      flush=True)
        stuck = load.join(timeout=max(120.0, 2 * args.seconds))
        load_seconds = load.t_end - load.t0
        check(not stuck, f"every client thread finished within the join timeout "
                         f"({len(stuck)} still running)")
        check(not load.crashes, f"no crash in the load generator itself {load.crashes[:1]}")
        results = load.snapshot()
        summ = summarize(results, args.seconds)
        report.update(summ)
        report["load_seconds"] = load_seconds

        # 2. KV gauges back to 0 used
        ok, took = wait_timed(lambda: kv_idle(cl)[0], args.drain_timeout, step=0.5)
        idle, desc = kv_idle(cl)
        report["kv_drain_s"] = round(took, 1) if ok else None
        check(ok, f"nothing held anywhere (KV blocks, requests) {took:.1f} s after the load "
                  f"stopped ({desc})")
        sampler.halt.set()
        sampler.join(30)
        samp_end = sampler.sample()
        sampler.samples.append(samp_end)

        # 1. outcomes
        bo = summ["by_outcome"]
        check(summ["requests"] > 0 and bo.get(Outcome.OK, 0) > 0,
              f"requests sent: {summ['requests']} ({bo})")
        check(bo.get(Outcome.UNEXPECTED, 0) == 0,
              f"zero unexpected outcomes ({bo.get(Outcome.UNEXPECTED, 0)}): "
              + "; ".join(summ["unexpected"][:5]))
        n_cancel = bo.get(Outcome.CANCELLED, 0)
        check(n_cancel >= 1 or summ["requests"] < 30,
              f"client cancellations happened ({n_cancel}, "
              f"{100.0 * n_cancel / max(1, summ['requests']):.1f}%)")
        check(bo.get(Outcome.EXPECTED_4XX, 0) >= 1 or summ["requests"] < 50,
              f"invalid requests answered with their 4xx ({bo.get(Outcome.EXPECTED_4XX, 0)})")
        m = cl.metrics() or {}
        by_status = {k: v - status_base.get(k, 0) for k, v in statuses(m).items()
                     if v - status_base.get(k, 0)}
        report["router_requests_total"] = by_status
        check(not any(s.startswith("5") for s in by_status),
              f"no 5xx in tandem_router_requests_total during the soak ({by_status}; before "
              f"it: {status_base})")
        report["router_generation_tokens_total"] = int(
            m.get(("tandem_router_generation_tokens_total", ()), 0))
        kv_peak = {}
        for _, _, g in sampler.samples:
            for inst, v in g.get("kv", {}).items():
                kv_peak[inst[4:].lstrip("0123456789")] = max(
                    kv_peak.get(inst[4:].lstrip("0123456789"), 0), int(v))
        report["kv_blocks_used_peak"] = kv_peak
        check(sampler.metric_errors == 0,
              f"/metrics answered every sample ({sampler.metric_errors} failures)")

        # 3. memory
        rss = rss_report(sampler, cl, warmup_end)
        report["rss_kb"] = rss
        bound_kb = args.rss_bound_mb * 1024
        for lab, v in rss.items():
            check(v["growth_kb"] < bound_kb,
                  f"{lab} (pid {v['pid']}): VmRSS {v['warmup'] / 1024:.1f} MiB after warm-up, "
                  f"peak after {v['peak_after'] / 1024:.1f}, end {v['end'] / 1024:.1f}: "
                  f"growth {v['growth_kb'] / 1024:+.1f} MiB < {args.rss_bound_mb:.0f} MiB "
                  f"(RssAnon {v['anon_warmup'] / 1024:.1f} -> {v['anon_end'] / 1024:.1f})")

        # 4. alive
        dead = [cl.label(p) for p in cl.procs if not alive(p["pid"])]
        check(not dead, f"every process alive at the end (dead: {dead})")
        st = cl.status()
        check(st and all(p["state"] == "running" for p in st["processes"]),
              f"tandem status: all running ({[p['state'] for p in st['processes']] if st else st})")
        check(cl.http_get("/health")[0] == 200, "GET /health is 200 after the soak")
    finally:
        if sampler:
            sampler.halt.set()
        if load and load.stop_at:
            load.stop_at = 0
        # 5. down
        pids = [p["pid"] for p in cl.procs]
        t0 = time.time()
        d = cl.down()
        report["down_s"] = round(time.time() - t0, 1)
        check(d.returncode == 0, f"tandem down exits 0 in {time.time() - t0:.1f} s "
                                 f"({d.stderr.strip()[-300:]})")
        gone, _ = wait_timed(lambda: not any(alive(p) for p in pids) and not cl.leftovers(), 30)
        check(gone, f"nothing left running after down ({[p for p in pids if alive(p)]} "
                    f"{cl.leftovers()})")
        st = cl.status()
        check(st and all(p["state"] == "stopped" for p in st["processes"]),
              f"tandem status after down: all stopped "
              f"({[p['state'] for p in st['processes']] if st else st})")
        left_shm = [p for p in cl.shm_names() if os.path.exists(p)]
        check(not left_shm, f"no /dev/shm segment left ({left_shm})")
        logs = cl.logs(tail=0)
        bad = {n: t[t.find("ERROR: "):][:600] for n, t in logs.items()
               if "Sanitizer" in t or "runtime error:" in t}
        check(not bad, f"no sanitizer report in the process logs {bad}")
        errs = [f"{n}: {line.strip()[:200]}" for n, t in logs.items() for line in t.splitlines()
                if "error" in line.lower() or "warn" in line.lower()]
        report["log_errors"] = errs
        if errs:
            print("note: error/warning lines in the process logs (not a failure by themselves):\n  "
                  + "\n  ".join(errs[:12]))
        cl.cleanup(keep=args.keep or bool(FAILS))
        if args.keep or FAILS:
            print(f"logs kept in {cl.dir}/run/soak")

    # summary
    print("\n=== soak summary ===")
    print(f"{args.shape}: model {report['model']}, load {report.get('load_seconds', 0):.1f} s at concurrency "
          f"{args.concurrency}, seed {seed}")
    print(f"requests {report.get('requests')}: {report.get('by_outcome')}  "
          f"({report.get('requests_per_s', 0):.1f} req/s; successful e2e p50 "
          f"{report.get('e2e_s_p50') or 0:.2f} s, p99 {report.get('e2e_s_p99') or 0:.2f} s)")
    for k, v in sorted(report.get("by_kind", {}).items()):
        print(f"  {k:22s} {v}")
    print(f"completion tokens (successful requests, as reported) {report.get('completion_tokens')}, "
          f"router generation_tokens_total {report.get('router_generation_tokens_total')}")
    print(f"router requests_total by status {report.get('router_requests_total')}")
    print(f"KV blocks used, peak per instance {report.get('kv_blocks_used_peak')}; "
          f"back to 0 after {report.get('kv_drain_s')} s")
    print(f"{'process':10s} {'first':>8s} {'warm-up':>8s} {'mid':>8s} {'peak':>8s} {'end':>8s} "
          f"{'growth':>8s} {'2nd half':>8s}  (VmRSS MiB; RssAnon warm-up -> end)")
    for lab, v in report.get("rss_kb", {}).items():
        print(f"{lab:10s} {v['first'] / 1024:8.1f} {v['warmup'] / 1024:8.1f} "
              f"{v['mid'] / 1024:8.1f} {v['peak_after'] / 1024:8.1f} {v['end'] / 1024:8.1f} "
              f"{v['growth_kb'] / 1024:+8.2f} {v['growth_2nd_half_kb'] / 1024:+8.2f}"
              f"  ({v['anon_warmup'] / 1024:.1f} -> {v['anon_end'] / 1024:.1f})")
    print(f"total {time.time() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # run the finally: tandem down
    sys.exit(main())
