#!/usr/bin/env python3
"""test_rejoin.py: a decode instance outlives the loss of a rank: the leader fails what is in
flight, reports Health.ready = false, waits for the rank (refusing work with ERR_BUSY
"re-forming (waiting for rank R)"), and serves again once a restarted rank joined; the
surviving ranks never restart. Real rank processes, the `tandem client` (colocated) or
pd_client + pd_writer (disaggregated) as the user.

Cases (--case, one per ctest entry):
  synth_tp2    synthetic llama, tp 2, colocated:
                 SIGKILL the follower mid-request -> the client gets an error event, ready
                 goes false, Submit is refused (ERR_BUSY, names the missing rank); the
                 follower restarted -> ready again (time printed), a request equals
                 `tandem generate`;
                 SIGKILL the leader -> the follower stays up and waits; the leader restarted
                 -> the follower joins it, it serves (equals generate);
                 SIGTERM the follower -> it exits 0, the leader re-forms after its restart;
                 SIGTERM the leader -> it exits 0, the follower waits; restarted -> serves;
                 SIGTERM everything -> every rank exits 0, nothing left in /dev/shm.
  default_tp3  default model, tp 3: the same with follower rank 2 (and the leader: two
               surviving followers join the new one).
  pd_tp2       synthetic llama, tp 2, disaggregated (a YAML prefill instance, KV pushed by
               pd_writer): the follower SIGKILLed while a writer is between chunks -> ready
               false, Alloc refused ERR_BUSY; the follower restarted at once -> ready again
               (once the aborted transfer is final), the request ended with an error and the
               writer's request was aborted; Alloc works again and its output equals
               generate; no KV block, kvxfer request or /dev/shm segment leaks.
Rejoin times (restart of the process -> Health ready) are printed as "rejoin: ...".

usage: test_rejoin.py --case C --decode BIN --tandem BIN --synth-dir DIR [--model GGUF]
                      [--client BIN --writer BIN]  (pd_tp2)
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from test_decode_node import Instance, generate_ids, node_ids  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.synth import long_context_llama  # noqa: E402
from tdtest.procs import shm_left as _shm_left, spawn  # noqa: E402

READY_LIMIT = 60  # seconds from a restart to ready (model load included); typically ~1 s
TIMES = []


def start_rank(inst, r):
    """(Re)start rank r of inst; its log continues in rankR.log."""
    p = spawn([inst.args.decode, "--config", inst.cfg, "--instance", inst.name, "--rank", str(r)],
              os.path.join(inst.dir, f"rank{r}.log"))
    inst.procs = [(rr, pp) for rr, pp in inst.procs if rr != r] + [(r, p)]
    return p


def health(inst):
    """The leader's Health as a dict ({} when it does not answer)."""
    r = inst.client("--health", "--timeout-ms", "1000", timeout=30)
    if r.returncode:
        return {}
    out = r.stdout.split()
    return {out[i]: out[i + 1] for i in range(0, len(out) - 1, 2)}


def wait_health(inst, pred, timeout):
    """Seconds until pred(health) holds, or None after timeout."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred(health(inst)):
            return time.time() - t0
        time.sleep(0.05)
    return None


def is_ready(h):
    return h.get("ready") == "1"


def not_ready(h):
    return h.get("ready") == "0"


def equals_generate(inst, model, vocab, seed, label):
    rnd = random.Random(seed)
    ids = [rnd.randrange(vocab) for _ in range(rnd.randint(5, 40))]
    want = generate_ids(inst.args, model, ids, 12)
    got, finish = node_ids(inst, ids, 12)
    check(got == want, f"{label}: output equals generate ({finish}: {' '.join(got or [])[:60]} "
                       f"vs {' '.join(want)[:60]})")


def rejoin(inst, r, label):
    """Restart rank r and wait for the instance to be ready; record the time."""
    start_rank(inst, r)
    dt = wait_health(inst, is_ready, READY_LIMIT)
    check(dt is not None, f"{label}: ready again after rank {r} restarted "
                          f"({'%.2f s' % dt if dt is not None else 'no'}): {inst.log(0)[-300:] if dt is None else ''}")
    if dt is not None:
        TIMES.append((label, dt))
        print(f"     rejoin: {label}: rank {r} restarted -> ready in {dt:.2f} s", flush=True)


def lose_follower_mid_request(inst, r, sig, label):
    """A request runs; follower r gets sig; the client must get an error event."""
    client = subprocess.Popen([inst.args.tandem, "client", "--url", inst.url, "--prompt-ids",
                               "1,2,3", "--max-tokens", "100000", "--ignore-eos",
                               "--timeout-ms", "60000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = wait_health(inst, lambda h: h.get("running") == "1", 30)
    check(running is not None and client.poll() is None,
          f"{label}: a request is running when rank {r} gets signal {sig}")
    proc = inst.rank_proc(r)
    proc.send_signal(sig)
    t0 = time.time()
    out, err = client.communicate(timeout=60)
    check(client.returncode != 0 and "error event" in err,
          f"{label}: the client got an error event after {time.time() - t0:.1f} s: "
          f"{err.strip()[:200]}")
    code = proc.wait(timeout=30)
    if sig == signal.SIGTERM:
        check(code == 0, f"{label}: rank {r} exited 0 on SIGTERM (status {code})")
    dt = wait_health(inst, not_ready, 10)
    check(dt is not None, f"{label}: Health ready went false (after {dt} s)")
    check(inst.rank_proc(0).poll() is None, f"{label}: the leader is still running")
    refused = inst.client("--prompt-ids", "1,2,3", "--max-tokens", "2", timeout=30)
    check(refused.returncode != 0 and f"re-forming (waiting for rank {r})" in refused.stderr,
          f"{label}: Submit refused while re-forming: {refused.stderr.strip()[:160]}")


def lose_leader(inst, sig, label):
    p0 = inst.rank_proc(0)
    p0.send_signal(sig)
    code = p0.wait(timeout=30)
    if sig == signal.SIGTERM:
        check(code == 0, f"{label}: the leader exited 0 on SIGTERM (status {code})")
    time.sleep(0.3)
    alive = [r for r, p in inst.procs if r > 0 and p.poll() is None]
    check(len(alive) == inst.tp - 1, f"{label}: the followers stay up ({alive})")
    waiting = all("left the instance" in inst.log(r) for r in alive)
    check(waiting, f"{label}: the followers went back to the rendezvous")


def shm_left(inst):
    return _shm_left(f"tandem-{inst.name}-", f"tandem-kv-{inst.name}-")


def stop_all(inst, label):
    for _, p in inst.procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for r, p in inst.procs:
        try:
            codes.append((r, p.wait(timeout=20)))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append((r, "hung"))
    check(all(c == 0 for _, c in codes), f"{label}: every rank exited 0 on SIGTERM ({codes})")
    check(not shm_left(inst), f"{label}: nothing left in /dev/shm ({shm_left(inst)})")


def case_colocated(args, model, vocab, tp, label):
    inst = Instance(args, model, tp)
    try:
        f = tp - 1
        lose_follower_mid_request(inst, f, signal.SIGKILL, f"{label} kill rank {f}")
        rejoin(inst, f, f"{label} kill rank {f}")
        equals_generate(inst, model, vocab, 1, f"{label} kill rank {f}")

        lose_leader(inst, signal.SIGKILL, f"{label} kill leader")
        rejoin(inst, 0, f"{label} kill leader")
        equals_generate(inst, model, vocab, 2, f"{label} kill leader")

        lose_follower_mid_request(inst, f, signal.SIGTERM, f"{label} sigterm rank {f}")
        rejoin(inst, f, f"{label} sigterm rank {f}")
        equals_generate(inst, model, vocab, 3, f"{label} sigterm rank {f}")

        lose_leader(inst, signal.SIGTERM, f"{label} sigterm leader")
        rejoin(inst, 0, f"{label} sigterm leader")
        equals_generate(inst, model, vocab, 4, f"{label} sigterm leader")
        log0 = inst.log(0)
        check("re-formed in" in log0, f"{label}: the leader logged its re-formations")
    finally:
        stop_all(inst, label)


def case_pd(args):
    import test_pd_decode as pd  # noqa: E402 (its Transfer drives pd_client and pd_writer)
    model = os.path.join(args.synth_dir, "llama.gguf")
    label = "pd tp2"
    inst = pd.instance(args, model, 2, "tcp", timeout_ms=6000, kv_blocks=64)
    rnd = random.Random(5)
    ids = [rnd.randrange(512) for _ in range(48)]
    try:
        # the follower dies while the writer is between chunks (every rank accepted it); it
        # is restarted at once, so the leader may have to wait for the aborted transfer
        t = pd.Transfer(args, inst, model, ids, 8, 10, 2, "tcp", delay_ms=1500)
        first = t.writer_line()
        check(first == "CHUNK 0", f"{label}: the writer sent its first chunk ({first})")
        inst.rank_proc(1).kill()
        dt = wait_health(inst, not_ready, 10)
        check(dt is not None, f"{label}: Health ready went false")
        busy = pd.Transfer(args, inst, model, ids, 8, 11, 1, "tcp", no_writer=True)
        busy.client.wait(timeout=30)
        check(busy.reply[:2] == ["REFUSED", "ERR_BUSY"] and "re-forming" in " ".join(busy.reply),
              f"{label}: Alloc refused while re-forming: {' '.join(busy.reply)[:140]}")
        rejoin(inst, 1, label)
        final, errors, wout = t.finish(timeout=60)
        check(final[:1] == ["error"] and len(errors) == 1,
              f"{label}: the transferring request failed: {errors} then {final}")
        check(any(l.startswith("DONE failed") for l in wout),
              f"{label}: the writer's request was aborted: {wout}")
        pd.equals_generate(args, inst, model, [ids], 12, 2, "tcp", f"{label} after rejoin", 20)
        pd.wait_kv_zero(inst, label)
    finally:
        pd.stop_and_check_leaks(inst, label)
    check(not shm_left(inst), f"{label}: nothing left in /dev/shm ({shm_left(inst)})")


def main():
    ap = argparse.ArgumentParser()
    for a in ("--case", "--decode", "--tandem", "--synth-dir"):
        ap.add_argument(a, required=True)
    for a in ("--model", "--client", "--writer"):
        ap.add_argument(a, default="")
    args = ap.parse_args()
    random.seed(os.getpid())
    cases = {
        "synth_tp2": lambda: case_colocated(args, long_context_llama(), 512, 2, "synthetic tp2"),
        "default_tp3": lambda: case_colocated(args, args.model, 49152, 3, "default tp3"),
        "pd_tp2": lambda: case_pd(args),
    }
    if args.case == "default_tp3" and not args.model:
        print("skipped: no default model")
        return 0
    t0 = time.time()
    try:
        cases[args.case]()
    except Exception as e:  # a crash is a failure with its reason
        check(False, f"{args.case}: {type(e).__name__}: {e}")
    print(f"     ({args.case}: {time.time() - t0:.1f} s; rejoin times: "
          + ", ".join(f"{l} {dt:.2f} s" for l, dt in TIMES) + ")")
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
