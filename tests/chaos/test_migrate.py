#!/usr/bin/env python3
"""test_migrate.py: no stream is left hanging when the process serving it dies, and a
request whose decode instance dies mid-stream moves (migration, docs/operations.md).

A cluster under `tandem up -d` (the supervisor restarts what dies): the router, a prefill
instance p0 with one stage and a decode instance d0 with one rank (--colocated: no prefill
instance, the decode instance prefills), on the synthetic model or --model. Cases, in turn:

  reference   a greedy stream of --tokens tokens (ignore_eos) and the same request without
              streaming: the uninterrupted texts
  decode      the same stream; after --kill-after tokens, kill -9 of decode rank 0 (its only
              process: the supervisor has it back within a second). The stream must end with
              [DONE], finish_reason "length", usage.completion_tokens == --tokens, no SSE
              error, and its text must equal the reference (nothing repeated or missing).
              Measured: kill -> next token (the migration time).
  seeded      the same sampled (temperature 0.9, seed 11): the text equals the
              uninterrupted seeded run's (the sampler skips the draws made before the move)
  penalized   greedy with frequency_penalty 1.5 and presence_penalty 0.5, killed the same way:
              the text equals the uninterrupted penalized run's, which differs from the plain
              greedy one (the tokens generated before the move keep counting)
  logprobs    the same greedy stream with logprobs 3, killed the same way: its tokens and
              their logprobs (and top-3 alternatives) equal the uninterrupted run's within
              1e-4 with --kv-dtype f32, 2e-2 with f16 KV: the new instance re-prefills the
              prompt and the tokens before the move, and a prefill attends to its own
              chunk's K/V before their rounding to f16 while decode read them back rounded
              (measured on the synthetic model, the same move without a kill: 4.7e-4 with
              f16 KV, 2.5e-6 with f32; the default model, this case: under 1e-3 on AMD
              EPYC, 0.0091 on an Intel Xeon, where the sgemm kernels differ)
  nonstream   the same without streaming: kill -9 while it generates; the JSON answer equals
              the reference
  opt-out     "migrate": false, killed the same way: an SSE error event and [DONE] within
              --end-within seconds (never a hang)
  prefill     (disaggregated only) a long prompt (--long-prompt tokens, 64-token chunks);
              kill -9 of prefill stage 0 while it prefills: the request still completes, and
              its text equals the uninterrupted run of the same request
After the cases: no leak on any survivor (decode and prefill health, router gauges), every
process runs, `tandem down` leaves nothing behind, no sanitizer report in any log.
--json FILE writes the measured times (BENCHMARKS.md "Migration").

usage: test_migrate.py --tandem BIN --decode BIN --prefill BIN --router BIN --synth-dir DIR
                       [--model GGUF] [--colocated] [--tokens N] [--kill-after K] [--asan]
                       [--kv-dtype f16|f32]
"""
import argparse
import http.client
import json
import os
import re
import signal
import sys
import threading
import time

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from chaoslib import ChaosCluster, model_name  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.procs import alive  # noqa: E402


class Stream:
    """One streamed /v1/completions request read on a thread: the text, the time of every
    chunk with text, the finish reason, usage, any SSE error, and how it ended."""

    def __init__(self, host, port, body, deadline_s):
        self.host, self.port, self.body, self.deadline_s = host, port, body, deadline_s
        self.text, self.times, self.finish, self.usage = "", [], None, None
        self.error, self.done, self.status, self.ended = None, False, None, None
        self.lp_tokens, self.lps, self.tops = [], [], []  # the chunks' logprobs, in order
        self.oid = None
        self.t = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.t0 = time.time()
        self.t.start()
        return self

    def join(self):
        self.t.join(self.deadline_s + 5)
        return self

    def run(self):
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.deadline_s)
        try:
            c.request("POST", "/v1/completions", json.dumps(self.body).encode(),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            if r.status != 200:
                self.error = r.read()[:300].decode(errors="replace")
                self.ended = "status"
                return
            while True:
                line = r.readline()
                if not line:
                    self.ended = "cut"
                    return
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    self.done, self.ended = True, "done"
                    return
                ev = json.loads(payload)
                if "error" in ev:
                    self.error = ev["error"].get("message")
                    continue
                if ev.get("usage"):
                    self.usage = ev["usage"]
                self.oid = self.oid or ev.get("id")
                for ch in ev.get("choices", []):
                    lp = ch.get("logprobs") or {}
                    self.lp_tokens += lp.get("tokens", [])
                    self.lps += lp.get("token_logprobs", [])
                    self.tops += lp.get("top_logprobs", [])
                    if ch.get("text"):
                        self.text += ch["text"]
                        self.times.append(time.time())
                    if ch.get("finish_reason"):
                        self.finish = ch["finish_reason"]
        except OSError as e:  # socket.timeout included: the client gave up
            self.ended = f"{type(e).__name__}: {e}"
        finally:
            c.close()


def post(host, port, body, timeout):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def wait_tokens(s, n, timeout):
    end = time.time() + timeout
    while len(s.times) < n and s.ended is None and time.time() < end:
        time.sleep(0.005)
    return len(s.times) >= n


def kill(cl, key):
    pid, _ = cl.pid(key)
    if not pid or not alive(pid):
        return 0, 0.0
    os.kill(pid, signal.SIGKILL)
    return pid, time.time()


def wait_serving(cl, timeout):
    """After a restart: a one-token request succeeds (the instance re-registered)."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            st, _ = post(cl.host, cl.port, {"prompt": [1, 2, 3], "max_tokens": 1,
                                            "temperature": 0}, 30)
            if st == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def case_decode(cl, args, base, ref, ref_text, figures):
    """Decode rank killed mid-stream: the stream goes on where it stopped."""
    s = Stream(cl.host, cl.port, dict(base, stream=True, stream_options={"include_usage": True}),
               args.deadline).start()
    check(wait_tokens(s, args.kill_after, 60), f"{args.kill_after} chunks before the kill")
    n_before = len(s.times)
    old, t_kill = kill(cl, "decode-d0-0")
    check(old != 0, "decode rank 0 killed (kill -9)")
    s.join()
    # the stall the client saw: the longest pause between chunks from the kill on (chunks
    # already on their way when it died arrive right after it)
    ts = [t_kill] + [t for t in s.times if t > t_kill]
    gap = max((b - a for a, b in zip(ts, ts[1:])), default=None)
    gaps = sorted(b - a for a, b in zip(ref.times, ref.times[1:]))
    figures["decode_kill_to_next_token_s"] = round(gap, 3) if gap is not None else None
    figures["median_token_gap_s"] = round(gaps[len(gaps) // 2], 5) if gaps else None
    check(s.done and not s.error and s.finish == "length",
          f"killed stream ended with [DONE], finish_reason length, no error "
          f"(ended {s.ended}, finish {s.finish}, error {s.error})")
    check((s.usage or {}).get("completion_tokens") == args.tokens,
          f"usage.completion_tokens {(s.usage or {}).get('completion_tokens')} == {args.tokens}")
    check(s.text == ref.text, f"the migrated text equals the uninterrupted one "
                              f"({len(s.text)} vs {len(ref.text)} chars; {n_before} chunks "
                              f"before the kill)")
    check(gap is not None and gap < 10, f"longest pause after the kill: "
                                        f"{gap if gap is None else round(gap, 2)} s")
    check(cl.wait_restarted("decode-d0-0", old, 60) is not None, "the supervisor restarted it")
    check(wait_serving(cl, 60), "serving again")
    m = cl.metrics() or {}
    moves = m.get(("tandem_router_migrations_total", ()))
    paused = m.get(("tandem_router_migration_pause_seconds_count", ()))
    check(moves and moves >= 1 and paused and paused >= 1,
          f"/metrics: migrations_total {moves}, migration_pause_seconds_count {paused}")


def case_seeded(cl, args, base, ref, ref_text, figures):
    """Sampled with a seed: the moved stream draws on from where it stopped (the sampler
    skips the draws made before the move), so it equals the uninterrupted seeded run."""
    body = dict(base, stream=True, temperature=0.9, top_p=0.95, seed=11)
    sref = Stream(cl.host, cl.port, body, args.deadline).start().join()
    again = Stream(cl.host, cl.port, body, args.deadline).start().join()
    check(sref.done and again.done and sref.text == again.text and sref.text != ref.text,
          "seeded reference: two runs agree and differ from the greedy one")
    s = Stream(cl.host, cl.port, body, args.deadline).start()
    check(wait_tokens(s, args.kill_after, 60), "seeded: tokens before the kill")
    old, _ = kill(cl, "decode-d0-0")
    s.join()
    check(s.done and not s.error and s.text == sref.text,
          f"seeded stream killed mid-way: the text equals the uninterrupted seeded run "
          f"(ended {s.ended}, error {s.error}, {len(s.text)} vs {len(sref.text)} chars)")
    check(cl.wait_restarted("decode-d0-0", old, 60) is not None and wait_serving(cl, 60),
          "restarted and serving again")


def case_penalized(cl, args, base, ref, ref_text, figures):
    """Presence and frequency penalties across a move: the new instance counts the tokens
    generated before it (they end the resumed prompt, Sampling.skip_samples of them)."""
    body = dict(base, stream=True, frequency_penalty=1.5, presence_penalty=0.5)
    pref = Stream(cl.host, cl.port, body, args.deadline).start().join()
    again = Stream(cl.host, cl.port, body, args.deadline).start().join()
    check(pref.done and again.done and pref.text == again.text and pref.text != ref.text,
          "penalized reference: two runs agree and differ from the plain greedy one")
    s = Stream(cl.host, cl.port, body, args.deadline).start()
    check(wait_tokens(s, args.kill_after, 60), "penalized: tokens before the kill")
    old, _ = kill(cl, "decode-d0-0")
    s.join()
    check(s.done and not s.error and s.text == pref.text,
          f"penalized stream killed mid-way: the text equals the uninterrupted penalized run "
          f"(ended {s.ended}, error {s.error}, {len(s.text)} vs {len(pref.text)} chars)")
    check(cl.wait_restarted("decode-d0-0", old, 60) is not None and wait_serving(cl, 60),
          "restarted and serving again")


def lp_diff(a, b):
    """The largest |logprob difference| between two streams' tokens and top alternatives;
    None when their tokens or alternatives differ."""
    if a.lp_tokens != b.lp_tokens or len(a.lps) != len(b.lps) or len(a.tops) != len(b.tops):
        return None
    d = max((abs(x - y) for x, y in zip(a.lps, b.lps)), default=0.0)
    for ta, tb in zip(a.tops, b.tops):
        if set(ta) != set(tb):
            return None
        d = max([d] + [abs(ta[k] - tb[k]) for k in ta])
    return d


def case_logprobs(cl, args, base, ref, ref_text, figures):
    """Logprobs across a move: the tokens generated after it carry the logprobs (and top
    alternatives) of an uninterrupted run, within 1e-4 with f32 KV, 2e-2 with f16 (the
    module's docstring says why)."""
    body = dict(base, stream=True, logprobs=3)
    lref = Stream(cl.host, cl.port, body, args.deadline).start().join()
    check(lref.done and lref.text == ref.text and len(lref.lps) == args.tokens and
          all(len(t) == 3 for t in lref.tops),
          f"logprobs reference: the greedy text, {len(lref.lps)} logprobs with 3 alternatives")
    for attempt in range(3):  # a stream that ended before the kill landed moved nothing
        moves0 = (cl.metrics() or {}).get(("tandem_router_migrations_total", ()), 0)
        s = Stream(cl.host, cl.port, body, args.deadline).start()
        check(wait_tokens(s, args.kill_after, 60), "logprobs: tokens before the kill")
        n_before = len(s.lps)
        old, _ = kill(cl, "decode-d0-0")
        s.join()
        check(cl.wait_restarted("decode-d0-0", old, 60) is not None and wait_serving(cl, 60),
              "restarted and serving again")
        moved = (cl.metrics() or {}).get(("tandem_router_migrations_total", ()), 0) > moves0
        # how many tokens the router held when it moved the request (rt_dispatch.c's log):
        # the rest were generated, with their logprobs, after the move
        at = re.findall(rf"{re.escape(s.oid or '-')}: .* after (\d+) tokens: moving it",
                        "".join(cl.logs().values()))
        after = args.tokens - int(at[0]) if moved and at else 0
        if after > 0:
            break
    figures["logprobs_tokens_after_move"] = after
    check(after > 0, f"logprobs: the stream moved with {after} of {args.tokens} tokens still to "
                     f"generate ({attempt + 1} tries)")
    d = lp_diff(s, lref)
    # f16 KV: the re-prefill (sgemm, K/V used before their f16 rounding) and the decode steps
    # (dot path, K/V read back rounded) differ by f16 ulps (11-bit significand), and logits of
    # magnitude 10-30 then move by up to ~1e-2 (see the module's docstring for the figures);
    # a wrong position or token moves logprobs by 0.1 and more, and changes the text.
    tol = 1e-4 if args.kv_dtype == "f32" else 2e-2
    figures["logprobs_max_diff_after_move"] = d
    check(s.done and not s.error and s.text == lref.text and d is not None and d <= tol,
          f"logprobs stream killed mid-way ({n_before} before the kill): the same tokens and "
          f"alternatives, logprobs within {tol} of the uninterrupted run ({args.kv_dtype} KV; "
          f"max diff {d}; ended {s.ended}, error {s.error})")


def case_nonstream(cl, args, base, ref, ref_text, figures):
    """Not streamed: killed mid-way, the answer is still whole."""
    res = {}

    def plain():
        try:
            res["r"] = post(cl.host, cl.port, base, args.deadline)
        except OSError as e:
            res["r"] = (0, {"error": str(e)})
    th = threading.Thread(target=plain, daemon=True)
    th.start()
    time.sleep(max(0.2, (ref.times[-1] - ref.t0) / 3) if ref.times else 0.5)
    old, _ = kill(cl, "decode-d0-0")
    th.join(args.deadline + 5)
    st, body = res.get("r", (0, {}))
    text = body.get("choices", [{}])[0].get("text") if st == 200 else None
    check(st == 200 and text == ref_text,
          f"non-streamed request killed mid-way: {st}, text equal {text == ref_text}")
    check(cl.wait_restarted("decode-d0-0", old, 60) is not None and wait_serving(cl, 60),
          "restarted and serving again")


def case_optout(cl, args, base, ref, ref_text, figures):
    """"migrate": false: an SSE error event and [DONE], quickly."""
    s = Stream(cl.host, cl.port, dict(base, stream=True, migrate=False), args.deadline).start()
    check(wait_tokens(s, args.kill_after, 60), "opt-out: tokens before the kill")
    old, t_kill = kill(cl, "decode-d0-0")
    s.join()
    took = time.time() - t_kill
    check(s.done and s.error and took < args.end_within,
          f'"migrate": false: SSE error event and [DONE] {took:.2f} s after the kill '
          f"(ended {s.ended}, error {s.error})")
    figures["optout_kill_to_error_s"] = round(took, 3)
    check(cl.wait_restarted("decode-d0-0", old, 60) is not None and wait_serving(cl, 60),
          "restarted and serving again")


def case_prefill(cl, args, base, ref, ref_text, figures):
    """Prefill stage 0 killed while it prefills a long prompt: the request completes."""
    if args.colocated:
        return
    # two long prompts of the same length: A times a cold prefill, B is the one killed. B must
    # be cold too (A's blocks would be in the stages' prefix cache: a hit prefills in no
    # time), and its reference runs after the kill (the restarted stage's cache is empty)
    timing_body = dict(base, prompt=[(7 * k) % 400 + 20 for k in range(args.long_prompt)],
                       max_tokens=16, stream=True)
    long_body = dict(timing_body, prompt=[(11 * k) % 400 + 20 for k in range(args.long_prompt)])
    timing = Stream(cl.host, cl.port, timing_body, args.deadline).start().join()
    check(timing.done and not timing.error,
          f"long prompt, uninterrupted: {timing.ended} {timing.error}")
    ttft = timing.times[0] - timing.t0 if timing.times else 1.0
    figures["long_prompt_ttft_s"] = round(ttft, 3)
    s = Stream(cl.host, cl.port, long_body, args.deadline).start()
    time.sleep(max(0.05, ttft / 3))  # about a third into the prefill
    old, t_kill = kill(cl, "prefill-p0-0")
    first = not s.times
    s.join()
    check(first, "the prefill stage was killed before the first token")
    check(cl.wait_restarted("prefill-p0-0", old, 60) is not None and wait_serving(cl, 60),
          "prefill restarted and serving again")
    ref_long = Stream(cl.host, cl.port, long_body, args.deadline).start().join()
    check(ref_long.done and not ref_long.error,
          f"long prompt B, uninterrupted: {ref_long.ended} {ref_long.error}")
    check(s.done and not s.error and s.text == ref_long.text,
          f"prefill stage killed mid-prompt: the request completed with the same text "
          f"(ended {s.ended}, error {s.error}, equal {s.text == ref_long.text})")
    if s.times:
        figures["prefill_kill_to_first_token_s"] = round(s.times[0] - t_kill, 3)


CASES = {"decode": case_decode, "seeded": case_seeded, "penalized": case_penalized,
         "logprobs": case_logprobs, "nonstream": case_nonstream,
         "optout": case_optout, "prefill": case_prefill}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for b in ("tandem", "decode", "prefill", "router"):
        ap.add_argument(f"--{b}", required=True)
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--model", default="", help="default: the synthetic llama of --synth-dir")
    ap.add_argument("--colocated", action="store_true")
    ap.add_argument("--tokens", type=int, default=120, help="tokens of the killed stream")
    ap.add_argument("--kill-after", type=int, default=40, help="tokens before the kill")
    ap.add_argument("--long-prompt", type=int, default=600, help="prefill case, tokens")
    ap.add_argument("--end-within", type=float, default=10.0, help="opt-out: seconds")
    ap.add_argument("--deadline", type=float, default=120.0, help="client side, seconds")
    ap.add_argument("--asan", action="store_true")
    ap.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16",
                    help="decode[].kv_dtype (the logprobs case's tolerance depends on it)")
    ap.add_argument("--instance-timeout-ms", type=int, default=2000,
                    help="router.instance_timeout_ms: below a stage's restart time (e.g. 300) "
                         "the router marks the killed prefill stage dead before it is back")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cases",
                    default="decode,seeded,penalized,logprobs,nonstream,optout,prefill")
    args = ap.parse_args()
    args.model = args.model or os.path.join(args.synth_dir, "llama.gguf")
    env_extra = {}
    if args.asan:
        supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "lsan.supp")
        env_extra["LSAN_OPTIONS"] = (os.environ.get("LSAN_OPTIONS", "") +
                                     f":suppressions={supp}").lstrip(":")
    # kvxfer.timeout_ms covers a whole transfer, prefill included: room for the long prompt
    # of the prefill case under a sanitizer build on a busy machine
    # and the router's deadline per request room for a whole stream of the default model
    # under ASan (~0.15 s a token on a busy machine) plus a move
    cl = ChaosCluster(args, args.model, tp=1, pp=1, colocated=args.colocated,
                      env_extra=env_extra, xfer_timeout_ms=60000, request_timeout_ms=120000,
                      kv_dtype=args.kv_dtype,
                      instance_timeout_ms=args.instance_timeout_ms)
    shape = ("colocated tp 1" if args.colocated else "pp 1 prefill + tp 1 decode") + \
        f", {args.kv_dtype} KV"
    print(f"migrate: {shape}, model {args.model}", flush=True)
    figures = {"shape": shape}
    try:
        r = cl.up()
        if not check(r.returncode == 0, f"tandem up -d ({r.stderr.strip()[-300:]})"):
            return 1
        model = model_name(cl.host, cl.port)
        base = {"prompt": [11, 12, 13, 14, 15, 16, 17, 18], "max_tokens": args.tokens,
                "temperature": 0, "ignore_eos": True}
        if model:
            base["model"] = model

        # reference: uninterrupted, streamed and not
        ref = Stream(cl.host, cl.port, dict(base, stream=True), args.deadline).start().join()
        check(ref.done and ref.finish == "length" and not ref.error,
              f"reference stream: {ref.ended}, finish {ref.finish}, error {ref.error}")
        st, ref_json = post(cl.host, cl.port, base, args.deadline)
        ref_text = ref_json.get("choices", [{}])[0].get("text") if st == 200 else None
        check(ref_text == ref.text, "reference: the streamed and the plain answers agree")

        for case in args.cases.split(","):
            CASES[case](cl, args, base, ref, ref_text, figures)

        clean, secs, desc = cl.idle(30)
        check(clean, f"no leak on the survivors after {secs:.1f} s ({desc})")
        check(cl.all_running(), "every process runs")
        r = cl.down()
        check(r.returncode == 0, f"tandem down ({r.stderr.strip()[-200:]})")
        time.sleep(0.5)
        check(not cl.leftovers(), f"nothing left behind: {cl.leftovers()}")
        reports = {n: t for n, t in cl.logs().items()
                   if "ERROR: AddressSanitizer" in t or "runtime error:" in t
                   or "ERROR: LeakSanitizer" in t}
        check(not reports, f"no sanitizer report ({list(reports)})")
    finally:
        if FAILS or args.keep:
            for n, t in cl.logs().items():
                print(f"---- {n} (last 40 lines)")
                print("\n".join(t.splitlines()[-40:]))
        cl.cleanup(keep=args.keep)
    print("migration figures: " + json.dumps(figures), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "fails": FAILS}, f, indent=1)
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    sys.exit(main())
