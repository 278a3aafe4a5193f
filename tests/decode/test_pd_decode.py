#!/usr/bin/env python3
"""test_pd_decode.py: tandem-decode in disaggregated mode: real rank processes receive the
prompt KV through kvxfer from a stand-in prefill (pd_writer: the real engine prefills the
prompt in 3 chunks, samples the first token, pushes each chunk's KV over UCX), driven by
pd_client (Alloc, the AllocReply targets, the token stream).

Cases (--case, one per ctest entry):
  default_tp1  default model, tp 1, UCX tcp, 1 stage: greedy outputs of 2 prompts equal
               `tandem generate`; a seeded sampled request (temperature 0.9, top-k 40) gives
               the same tokens as the same request submitted colocated (the decode sampler
               skips the draw of the prefill's first token); Alloc refusals: n_stages 0
               (ERR_INVALID), a request larger than the pool (ERR_NO_SPACE).
  default_tp3  default model, tp 3 (followers' pools in shared memory), UCX posix,cma,self,
               2 stages (layers split in halves): greedy equals generate; seeded equals
               colocated; no KV segment of the instance is left in /dev/shm.
  synth_tp2    synthetic llama (4 KV heads, 6 layers), tp 2, tcp, 2 stages: 3 prompts equal
               generate; max_tokens 1 finishes at the first token.
  faults       synthetic, tp 2, tcp, kvxfer.timeout_ms 4000, a 64-block pool:
               the writer SIGKILLed after its first chunk -> ErrorEvent ERR_PEER_FAILED naming
               the rank, finish error, blocks back to 0, a colocated Submit still served;
               cancel while a writer is mid-transfer -> finish cancelled, the writer sees its
               request aborted, blocks back to 0; two Allocs nobody writes fill the pool, a
               third is refused ERR_BUSY, both end ERR_TIMEOUT after the deadline, blocks back
               to 0; SIGTERM with a transfer in flight ends it with ERR_SHUTDOWN; a rank
               killed during a transfer fails the request and the leader stays up, not
               ready (test_rejoin.py restarts the rank and checks the re-formed instance).
Every case ends with kv_used 0 in Health and, after SIGTERM, the leader's last line
"kvxfer: 0 transfers alive, dec_requests 0,..." (no kvxfer request record leaked).

usage: test_pd_decode.py --case C --decode BIN --tandem BIN --client BIN --writer BIN
                         --synth-dir DIR [--model GGUF]
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from test_decode_node import CHAT_PROMPTS, Instance, generate_ids  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.procs import shm_left  # noqa: E402

SEEDED = ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]


def instance(args, model, tp, tls, timeout_ms=20000, kv_blocks=256):
    extra = {"prefill": [{"name": "p0"}],  # never started: it makes the decode disaggregated
             "kvxfer": {"ucx_tls": tls, "timeout_ms": timeout_ms}}
    return Instance(args, model, tp, kv_blocks=kv_blocks, doc_extra=extra)


class Transfer:
    """One Alloc by pd_client and, unless no_writer, a pd_writer pushing its KV."""

    def __init__(self, args, inst, model, ids, n, rid, stages, tls, sampling=(), delay_ms=0,
                 no_writer=False, client_extra=()):
        self.inst = inst
        self.client = subprocess.Popen(
            [args.client, "--url", inst.url, "--prompt-ids", ",".join(map(str, ids)),
             "--max-tokens", str(n), "--request-id", str(rid), "--stages", str(stages),
             *sampling, *client_extra], stdout=subprocess.PIPE, text=True)
        self.reply = self.client.stdout.readline().split()
        self.writer = None
        self.t_reply = time.time()
        if self.reply[:1] != ["TARGETS"] or no_writer:
            return
        self.writer = subprocess.Popen(
            [args.writer, "--model", model, "--prompt-ids", ",".join(map(str, ids)),
             "--request-id", str(rid), "--targets", ",".join(self.reply[2:]), "--stages",
             str(stages), "--tls", tls, "--delay-ms", str(delay_ms), *sampling],
            stdout=subprocess.PIPE, text=True)

    def writer_line(self):
        return self.writer.stdout.readline().strip()

    def finish(self, timeout=120):
        """(final line fields, error lines, writer output lines)"""
        wout = []
        if self.writer:
            rest, _ = self.writer.communicate(timeout=timeout)
            wout = rest.split("\n")
        # the client waits for the leader's events: if the leader died meanwhile, say so now
        # (UCX 1.13 aborted it that way when its tcp put emulation lost a writer: kvxfer/README)
        end = time.time() + timeout
        while self.client.poll() is None and time.time() < end:
            leader = self.inst.rank_proc(0)
            if leader.poll() is not None and leader.returncode != 0:  # 0: a SIGTERM's stop
                self.client.kill()
                self.client.communicate()
                tail = [l for l in self.inst.log(0).splitlines() if l.strip()][-3:]
                check(False, f"the decode leader died (exit {leader.returncode}) during the "
                             f"request: {' | '.join(tail)[-400:]}")
                raise RuntimeError("the decode leader died")
            time.sleep(0.1)
        out, _ = self.client.communicate(timeout=max(1, end - time.time()))
        lines = [l for l in out.split("\n") if l]
        errors = [l for l in lines if l.startswith("ERROR")]
        final = lines[-1].split() if lines else []
        return final, errors, wout


def colocated(args, inst, ids, n, rid, sampling=()):
    r = subprocess.run([args.client, "--url", inst.url, "--prompt-ids", ",".join(map(str, ids)),
                        "--max-tokens", str(n), "--request-id", str(rid), "--submit", *sampling],
                       capture_output=True, text=True, timeout=300)
    return r.stdout.split()


def wait_kv_zero(inst, label, timeout=10):
    end = time.time() + timeout
    h = {}
    while time.time() < end:
        h = inst.health()
        if h.get("kv_used") == "0" and h.get("running") == "0" and h.get("waiting") == "0":
            break
        time.sleep(0.1)
    check(h.get("kv_used") == "0" and h.get("waiting") == "0",
          f"{label}: KV blocks back to 0, nothing waiting or transferring (health {h})")


def stop_and_check_leaks(inst, label):
    inst.stop()
    log = inst.log(0)
    line = next((l for l in log.splitlines() if "kvxfer:" in l and "dec_requests" in l), "")
    zeros = ",".join(["0"] * inst.tp)
    check(f"0 transfers alive, dec_requests {zeros}" in line,
          f"{label}: no kvxfer request left on any rank: '{line.strip()[-80:]}'")
    left = shm_left(f"tandem-kv-{inst.name}-")
    check(not left, f"{label}: no KV pool segment left in /dev/shm ({left})")


def equals_generate(args, inst, model, prompts, n, stages, tls, label, rid0):
    for i, ids in enumerate(prompts):
        want = generate_ids(args, model, ids, n)
        t = Transfer(args, inst, model, ids, n, rid0 + i, stages, tls)
        final, errors, wout = t.finish()
        check(final[1:] == want and not errors,
              f"{label}: prompt {i} ({len(ids)} tokens, {stages} stage(s)): {' '.join(final)[:90]} "
              f"vs generate {' '.join(want)[:80]} {errors} writer {' '.join(wout)[-60:]}")
    log = inst.log(0)
    check(f"request {rid0}: KV of {len(prompts[0])} tokens from {stages} stages arrived" in log,
          f"{label}: the leader logged the arrival with its transfer time")


def seeded_equals_colocated(args, inst, model, ids, stages, tls, label, rid):
    t = Transfer(args, inst, model, ids, 24, rid, stages, tls, sampling=SEEDED)
    final, errors, _ = t.finish()
    colo = colocated(args, inst, ids, 24, rid + 1, SEEDED)
    check(final == colo and len(final) > 2 and not errors,
          f"{label}: seeded disaggregated {' '.join(final)[:70]} == colocated {' '.join(colo)[:70]}")


def case_default(args, tp):
    model = args.model
    stages, tls = (1, "tcp") if tp == 1 else (2, "posix,cma,self")
    label = f"default tp{tp}"
    inst = instance(args, model, tp, tls)
    try:
        if tp > 1:
            left = shm_left(f"tandem-kv-{inst.name}-")
            check(not left, f"{label}: the leader unlinked the followers' KV segments ({left})")
        rnd = random.Random(3)
        prompts = CHAT_PROMPTS + [[rnd.randrange(49152) for _ in range(45)]]
        equals_generate(args, inst, model, prompts, 16, stages, tls, label, 100)
        seeded_equals_colocated(args, inst, model, CHAT_PROMPTS[0], stages, tls, label, 200)
        if tp == 1:
            t = Transfer(args, inst, model, [1, 2, 3], 4, 300, 0, tls, no_writer=True)
            t.client.wait(timeout=30)
            check(t.reply[:2] == ["REFUSED", "ERR_INVALID"], f"{label}: n_stages 0 refused: {t.reply}")
            t = Transfer(args, inst, model, [1, 2, 3], 8000, 301, 1, tls, no_writer=True)
            t.client.wait(timeout=30)
            check(t.reply[:2] == ["REFUSED", "ERR_NO_SPACE"],
                  f"{label}: a request larger than the pool refused: {' '.join(t.reply)[:120]}")
        wait_kv_zero(inst, label)
    finally:
        stop_and_check_leaks(inst, label)


def case_synth_tp2(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    inst = instance(args, model, 2, "tcp")
    label = "synthetic tp2"
    try:
        rnd = random.Random(11)
        prompts = [[rnd.randrange(512) for _ in range(rnd.randint(5, 60))] for _ in range(3)]
        equals_generate(args, inst, model, prompts, 12, 2, "tcp", label, 100)
        want = generate_ids(args, model, prompts[0], 1)
        t = Transfer(args, inst, model, prompts[0], 1, 150, 2, "tcp")
        final, errors, _ = t.finish()
        check(final == ["length"] + want, f"{label}: max_tokens 1 ends at the first token: {final}")
        wait_kv_zero(inst, label)
    finally:
        stop_and_check_leaks(inst, label)


def case_faults(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    inst = instance(args, model, 2, "tcp", timeout_ms=4000, kv_blocks=64)
    label = "faults"
    rnd = random.Random(5)
    ids = [rnd.randrange(512) for _ in range(48)]
    try:
        # the writer dies after its first chunk landed on both ranks
        t = Transfer(args, inst, model, ids, 16, 10, 2, "tcp", delay_ms=30000)
        first = t.writer_line()
        check(first == "CHUNK 0", f"kill: the writer sent its first chunk ({first})")
        t.writer.kill()
        t0 = time.time()
        final, errors, _ = t.finish()
        took = time.time() - t0
        check(final[:1] == ["error"] and len(errors) == 1 and "ERR_PEER_FAILED" in errors[0]
              and "failed on rank" in errors[0],
              f"kill: error event after {took:.1f} s: {errors} then {final}")
        check(took < 3.5, f"kill: noticed in {took:.1f} s, before the transfer deadline")
        wait_kv_zero(inst, "kill")
        colo = colocated(args, inst, ids, 8, 11)
        check(colo[:1] == ["length"] and len(colo) == 9,
              f"kill: the instance still serves a colocated request: {colo}")

        # cancel while the writer is between chunks (every rank accepted it)
        t = Transfer(args, inst, model, ids, 16, 20, 2, "tcp", delay_ms=1500)
        first = t.writer_line()
        t.client.send_signal(signal.SIGUSR1)
        final, errors, wout = t.finish()
        check(first == "CHUNK 0" and final == ["cancelled"] and not errors,
              f"cancel: finished {final} {errors}")
        check(any(l.startswith("DONE failed") for l in wout),
              f"cancel: the writer's request was aborted: {wout}")
        wait_kv_zero(inst, "cancel")

        # Allocs nobody writes: the pool fills up, then the deadline frees it
        big = [rnd.randrange(512) for _ in range(400)]  # 25 of 64 blocks each
        a = Transfer(args, inst, model, big, 8, 30, 1, "tcp", no_writer=True)
        b = Transfer(args, inst, model, big, 8, 31, 1, "tcp", no_writer=True)
        c = Transfer(args, inst, model, big, 8, 32, 1, "tcp", no_writer=True)
        check(a.reply[:1] == ["TARGETS"] and b.reply[:1] == ["TARGETS"],
              "timeout: two Allocs reserved their blocks")
        check(c.reply[:2] == ["REFUSED", "ERR_BUSY"], f"busy: a third is refused: {' '.join(c.reply)[:120]}")
        h = inst.health()  # published at once when an Alloc takes blocks
        check(h.get("kv_used") == "50" and h.get("waiting") == "2",
              f"timeout: 2 x 25 blocks held by 2 transferring requests (health {h})")
        for x in (a, b):
            final, errors, _ = x.finish(timeout=30)
            took = time.time() - x.t_reply
            check(final[:1] == ["error"] and len(errors) == 1 and "ERR_TIMEOUT" in errors[0],
                  f"timeout: {errors} then {final}")
            check(3.5 < took < 8, f"timeout: ended {took:.1f} s after the Alloc (deadline 4 s)")
        c.finish()
        wait_kv_zero(inst, "timeout")

        # SIGTERM with a transfer in flight: it ends with ERR_SHUTDOWN, nothing leaks; the
        # follower's signal first, as `tandem down` or a pod's deletion may deliver them (the
        # leader must not take the follower's exit for a failure of the instance)
        t = Transfer(args, inst, model, ids, 8, 40, 1, "tcp", no_writer=True)
        inst.rank_proc(1).send_signal(signal.SIGTERM)
        time.sleep(0.1)
    finally:
        stop_and_check_leaks(inst, label)
    final, errors, _ = t.finish(timeout=30)
    check(final[:1] == ["error"] and len(errors) == 1 and "ERR_SHUTDOWN" in errors[0],
          f"sigterm: the transferring request ended with {errors} then {final}")

    # a rank dies while a transfer is in flight: the request fails, the leader waits for it
    inst = instance(args, model, 2, "tcp", timeout_ms=4000, kv_blocks=64)
    try:
        t = Transfer(args, inst, model, ids, 8, 50, 1, "tcp", no_writer=True)
        inst.rank_proc(1).kill()
        final, errors, _ = t.finish(timeout=30)
        check(final[:1] == ["error"] and len(errors) == 1,
              f"rank killed: the transferring request failed: {errors} then {final}")
        h = inst.health()
        check(inst.rank_proc(0).poll() is None and h.get("ready") == "0",
              f"rank killed: the leader stays up, not ready (health {h})")
    finally:
        inst.stop()
    check(inst.rank_proc(0).returncode == 0,
          f"rank killed: the leader exits 0 on SIGTERM ({inst.rank_proc(0).returncode})")


def main():
    ap = argparse.ArgumentParser()
    for a in ("--case", "--decode", "--tandem", "--client", "--writer", "--synth-dir"):
        ap.add_argument(a, required=True)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    random.seed(os.getpid())
    cases = {
        "default_tp1": lambda: case_default(args, 1),
        "default_tp3": lambda: case_default(args, 3),
        "synth_tp2": lambda: case_synth_tp2(args),
        "faults": lambda: case_faults(args),
    }
    if args.case.startswith("default") and not args.model:
        print("skipped: no default model")
        return 0
    t0 = time.time()
    try:
        cases[args.case]()
    except Exception as e:  # a crash is a failure with its reason
        check(False, f"{args.case}: {type(e).__name__}: {e}")
    print(f"     ({args.case}: {time.time() - t0:.1f} s)")
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
