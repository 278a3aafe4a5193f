#!/usr/bin/env python3
"""test_promise.py: instances that die keep their promise (docs/operations.md): a request in
flight on any stage or rank of any instance that is killed completes (it moves) with the text
of an uninterrupted run, or, when nothing can take it within router.migrate_wait_ms, ends with
a clear error only once that wait ran out.

A cluster under `tandem up -d` (the supervisor restarts what dies): the router
(router.migrate_wait_ms --wait-ms), a prefill instance p0 of pp 2 and a decode instance d0 of
tp 2, on a synthetic llama with a 4096-token context (tdtest/synth.py: a 512-token one
prefills too fast to be killed mid-prompt) or --model (--tp 3 for SmolLM2's 9 heads). Each
case sends a greedy streamed request with a long prompt of its own (cold: no prefix cache
anywhere holds it), kills one process with SIGKILL and checks the request:

  prefill-1   prefill stage 1, a third into the prefill (issue 44: 503 no_instance or
              prefill_failed 0.5 s after the kill, while the stage was back 1.6 s later)
  prefill-0   prefill stage 0 (the instance's leader), a third into the prefill
  decode-1    decode rank 1, a third into the prefill (its KV transfer in flight)
  decode-0    decode rank 0 (the leader), a third into the prefill (the restarted leader
              maps rank 1's renewed KV pool: kn_kv_mem_renew_pool once unlinked its name)
  stream-1    decode rank 1 after --kill-after tokens of a --tokens-token answer (the router
              counts a move)
  wait-out    the supervisor stopped (SIGSTOP), prefill stage 1 killed a third into the prefill:
              nothing can take the request, so it ends with 503 instance_unavailable naming
              router.migrate_wait_ms, no sooner than the wait after the kill (and within 5 s
              of it); then the supervisor goes on (SIGCONT) and the cluster serves again

The first five: the request ends with [DONE], finish_reason "length", no error, and its text
equals the same request's uninterrupted run (sent after the cluster serves again). After the
cases: no leak on any survivor, every process runs, `tandem down` leaves nothing behind, no
sanitizer report in any log.

usage: test_promise.py --tandem BIN --decode BIN --prefill BIN --router BIN --synth-dir DIR
                       [--model GGUF] [--wait-ms MS] [--asan] [--cases LIST]
"""
import argparse
import json
import os
import signal
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from chaoslib import ChaosCluster, model_name  # noqa: E402
from test_migrate import Stream, kill, wait_serving, wait_tokens  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.procs import alive  # noqa: E402
from tdtest.synth import long_context_llama  # noqa: E402

# case -> (process killed, when: "prefill" a third into the prefill, "stream" after tokens)
KILLS = {"prefill-1": ("prefill-p0-1", "prefill"), "prefill-0": ("prefill-p0-0", "prefill"),
         "decode-1": ("decode-d0-1", "prefill"), "decode-0": ("decode-d0-0", "prefill"),
         "stream-1": ("decode-d0-1", "stream")}


class Prompts:
    """Long cold prompts: a new token sequence for every request that must prefill."""

    def __init__(self, n, vocab):
        self.n, self.k, self.vocab = n, 0, vocab

    def next(self):
        self.k += 1
        return [(37 * i + 101 * self.k) % (self.vocab - 100) + 50 for i in range(self.n)]


def moves(cl):
    return (cl.metrics() or {}).get(("tandem_router_migrations_total", ()), 0)


def kill_mid_prefill(cl, args, body, ttft, key):
    """Starts the stream, kills key a third into its prefill: (stream, killed pid, time,
    whether no token had come yet)."""
    s = Stream(cl.host, cl.port, body, args.deadline).start()
    time.sleep(max(0.05, ttft / 3))
    old, t_kill = kill(cl, key)
    return s, old, t_kill, not s.times


def case_kill(cl, args, base, prompts, ttft, case, figures):
    key, when = KILLS[case]
    if when == "prefill":
        body = dict(base, prompt=prompts.next(), max_tokens=args.short_tokens)
        s, old, t_kill, first = kill_mid_prefill(cl, args, body, ttft, key)
        check(old != 0, f"{case}: {key} killed (kill -9)")
        if not first:
            print(f"  {case}: the first token came before the kill (prefill faster than timed)",
                  flush=True)
        figures[f"{case}_before_first_token"] = first
    else:
        body = dict(base, prompt=prompts.next()[:32], max_tokens=args.tokens)
        moves0 = moves(cl)
        s = Stream(cl.host, cl.port, body, args.deadline).start()
        check(wait_tokens(s, args.kill_after, 60), f"{case}: {args.kill_after} chunks first")
        old, t_kill = kill(cl, key)
        check(old != 0, f"{case}: {key} killed (kill -9) after {len(s.times)} chunks")
    s.join()
    if when == "stream":  # the kill landed mid-stream: the router moved the request
        check(moves(cl) > moves0, f"{case}: the stream moved ({moves(cl) - moves0} moves)")
    took = time.time() - t_kill
    figures[f"{case}_kill_to_end_s"] = round(took, 3)
    check(cl.wait_restarted(key, old, 60) is not None and wait_serving(cl, 60),
          f"{case}: {key} restarted and serving again")
    ref = Stream(cl.host, cl.port, body, args.deadline).start().join()
    check(ref.done and not ref.error, f"{case}: uninterrupted run: {ref.ended} {ref.error}")
    n = body["max_tokens"]
    check(s.done and not s.error and s.finish == "length" and
          (s.usage or {}).get("completion_tokens") == n and s.text == ref.text,
          f"{case}: killed {key}: the request completes with the uninterrupted text (ended "
          f"{took:.2f} s after the kill; status {s.status}, ended {s.ended}, error {s.error}, "
          f"finish {s.finish}, tokens {(s.usage or {}).get('completion_tokens')} of {n}, "
          f"equal {s.text == ref.text})")


def case_wait_out(cl, args, base, prompts, ttft, figures):
    """Nothing can take the request (the supervisor is stopped): the error comes once
    router.migrate_wait_ms ran out, not before."""
    sup = cl.pid_file(cl.rdir, "up")[0]
    if not check(sup and alive(sup), f"wait-out: the supervisor runs (pid {sup})"):
        return
    key = "prefill-p0-1"
    body = dict(base, prompt=prompts.next(), max_tokens=args.short_tokens)
    os.kill(sup, signal.SIGSTOP)
    try:
        s, old, t_kill, first = kill_mid_prefill(cl, args, body, ttft, key)
        s.join()
        took = time.time() - t_kill
    finally:
        os.kill(sup, signal.SIGCONT)
    wait_s = args.wait_ms / 1000.0
    figures["wait_out_kill_to_error_s"] = round(took, 3)
    check(first, "wait-out: killed before the first token")
    err = s.error or ""
    check(s.status == 503 and "instance_unavailable" in err and "migrate_wait_ms" in err,
          f"wait-out: 503 instance_unavailable naming router.migrate_wait_ms (status "
          f"{s.status}, ended {s.ended}, error {err[:300]})")
    check(wait_s - 0.3 <= took <= wait_s + 5,
          f"wait-out: the error came {took:.2f} s after the kill (the wait: {wait_s:.1f} s)")
    check(cl.wait_restarted(key, old, 60) is not None and wait_serving(cl, 60),
          f"wait-out: the supervisor went on, {key} restarted, serving again")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for b in ("tandem", "decode", "prefill", "router"):
        ap.add_argument(f"--{b}", required=True)
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--model", default="",
                    help="default: the synthetic llama with a 4096-token context")
    ap.add_argument("--tp", type=int, default=2, help="decode tp (SmolLM2's 9 heads: 3)")
    ap.add_argument("--wait-ms", type=int, default=8000, help="router.migrate_wait_ms")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="prompt tokens (0: 1500 with --model, 2000 on the synthetic model)")
    ap.add_argument("--short-tokens", type=int, default=12, help="answer of the prefill kills")
    ap.add_argument("--tokens", type=int, default=600, help="answer of the stream kill")
    ap.add_argument("--kill-after", type=int, default=24, help="stream kill: chunks before")
    ap.add_argument("--deadline", type=float, default=120.0, help="client side, seconds")
    ap.add_argument("--asan", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cases", default=",".join(list(KILLS) + ["wait-out"]))
    args = ap.parse_args()
    args.real = bool(args.model)
    args.long_prompt = args.long_prompt or (1500 if args.real else 2000)
    args.model = args.model or long_context_llama(4096)
    env_extra = {}
    if args.asan:
        supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "lsan.supp")
        env_extra["LSAN_OPTIONS"] = (os.environ.get("LSAN_OPTIONS", "") +
                                     f":suppressions={supp}").lstrip(":")
    # migrate_wait_ms short (the wait-out case waits it) but above a restart + re-formation;
    # instance_timeout_ms above a restart, so a killed leader is seen restarting (a new event
    # epoch) as under the supervisor of the report; kvxfer.timeout_ms and the request
    # deadline with room for a long prompt under a sanitizer build
    cl = ChaosCluster(args, args.model, tp=args.tp, pp=2, env_extra=env_extra,
                      xfer_timeout_ms=60000, request_timeout_ms=120000, instance_timeout_ms=3000,
                      router_extra={"migrate_wait_ms": args.wait_ms, "max_migrations": 3})
    print(f"promise: prefill pp 2 + decode tp {args.tp}, model {args.model}, "
          f"{args.long_prompt}-token prompts, router.migrate_wait_ms {args.wait_ms}", flush=True)
    figures = {}
    t0 = time.time()
    try:
        r = cl.up()
        if not check(r.returncode == 0, f"tandem up -d ({r.stderr.strip()[-300:]})"):
            return 1
        model = model_name(cl.host, cl.port)
        base = {"temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if model:
            base["model"] = model
        prompts = Prompts(args.long_prompt, 3000 if args.real else 500)  # synthetic: 512 ids
        # how long a cold prefill of the long prompt takes: the kills land a third into it
        timing = Stream(cl.host, cl.port, dict(base, prompt=prompts.next(), max_tokens=2),
                        args.deadline).start().join()
        check(timing.done and not timing.error, f"timing run: {timing.ended} {timing.error}")
        ttft = timing.times[0] - timing.t0 if timing.times else 1.0
        figures["long_prompt_ttft_s"] = round(ttft, 3)
        print(f"  cold prefill of {args.long_prompt} tokens: first token after {ttft:.2f} s",
              flush=True)
        for case in args.cases.split(","):
            tc = time.time()
            if case == "wait-out":
                case_wait_out(cl, args, base, prompts, ttft, figures)
            else:
                case_kill(cl, args, base, prompts, ttft, case, figures)
            print(f"  {case}: {time.time() - tc:.1f} s", flush=True)

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
    figures["wall_s"] = round(time.time() - t0, 1)
    print("promise figures: " + json.dumps(figures), flush=True)
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
