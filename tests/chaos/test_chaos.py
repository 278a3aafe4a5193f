#!/usr/bin/env python3
"""test_chaos.py: the chaos suite (issue 7): faults injected into a disaggregated cluster
under steady load, and the supervisor of `tandem up` that repairs them.

Cases (--case, one ctest each; tests/chaos.cmake):
  supervise  `tandem up` restarts what dies, without load: foreground up, the router killed
             -> "restarting it in 0.5 s", a new router, its log appended ("---- tandem up:
             restart 1 ..."), /health 200 again; killed twice more at once -> back-off 1 s
             then 2 s, `tandem status` says "restarting" meanwhile, restarts 3; SIGTERM to
             up -> everything stopped, exit 0. Then `up -d`: the detached supervisor (status
             --json "supervisor") restarts a killed prefill stage 1 (up.log says so);
             `tandem down` stops the supervisor and every process; nothing left behind.
  faults     router + prefill p0 (pp 2) + decode d0 (tp --decode-tp, default 2) on the
             synthetic model under `tandem up -d`, steady load from --concurrency client
             threads (/v1/completions, token-id prompts of 4..300 tokens over 64-token
             chunks, 4..24 tokens, half streamed; the client gives each request --deadline,
             40 s, the router's router.request_timeout_ms is 30 s), then in
             turn: kill -9 the router; kill -9 prefill stage 1; kill -9 prefill stage 0;
             kill -9 a decode rank (the last rank in odd rounds, rank 0 in even ones);
             SIGSTOP prefill stage 1 for --stop-seconds (past stage 0's 5 s heartbeat
             silence) then SIGCONT; drop clients mid-stream (streams closed by FIN or RST
             right after the request or after 1..6 events). TANDEM_CHAOS_ROUNDS (--rounds,
             default 1) repeats the whole list on the same cluster.
  netns      two "hosts": the prefill instance (both stages) in one network namespace, the
             decode instance and the router in another, joined by a veth link (KV and
             control over UCX tcp), a third link from the root namespace for the clients;
             every process started by its deploy/start-*.sh through `ip netns exec`. Under
             load the link between the prefill and the decode namespaces is cut (`ip link
             set DEV down`) for --cut-seconds, then restored. Skipped (77) when network
             namespaces cannot be created (not root).

After each fault:
  - every request the load issued ended within its deadline (no hang): success or a clear
    error (an HTTP error status with an OpenAI error object, or an SSE error event then
    [DONE]); a broken connection ("cut") only when the router itself was killed, for the
    requests it was serving; "refused" only while the router was down;
  - repair (the supervisor started the killed process again / SIGCONT / the link is up) ->
    the first successful request sent after it: the recovery time, within --recover-timeout;
  - no leak on the survivors once the load stopped: decode d0's and prefill p0's leaders
    answer Health with kv_used 0, running 0, waiting 0 (prefill: ready 1) and the router's
    /metrics say queue 0, running 0, KV blocks used 0, both instances up (registered), no
    prefill attempt open (within --idle-timeout);
  - every process of the cluster runs; `tandem bench` (6 requests, streamed) has 0 errors.
At the end: `tandem down`, nothing left behind, no sanitizer report in any process log, and
a summary table (markdown) to paste into BENCHMARKS.md; --json FILE writes it as JSON.

usage: test_chaos.py --case supervise|faults|netns --tandem BIN --decode BIN --prefill BIN
                     --router BIN --synth-dir DIR --source-dir DIR [--rounds N] [--asan]
                     [--concurrency C] [--deadline S] [--decode-tp N] [--json FILE] [--keep]
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from chaoslib import (BAD, CUT, DROPPED, ERROR, HUNG, OK, REFUSED, ChaosCluster,  # noqa: E402
                      Load, chaos_yaml, drop_clients, model_name)
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.procs import alive, read, spawn, stop  # noqa: E402
from tdtest.waits import wait_text  # noqa: E402

SKIP = 77  # ctest SKIP_RETURN_CODE


def sanitizer_reports(logs):
    return {n: t[max(0, t.find("ERROR: ")):][:600] for n, t in logs.items()
            if "Sanitizer" in t or "runtime error:" in t}


# --- supervise ---------------------------------------------------------------------------------
def case_supervise(args):
    cl = ChaosCluster(args, args.model, tp=1)
    err_path = os.path.join(cl.dir, "up.err")
    up = None
    try:
        with open(err_path, "w") as err:
            up = subprocess.Popen([args.tandem, "up", cl.cfg, "--timeout", "200"],
                                  stdout=subprocess.PIPE, stderr=err, env=cl.env)
        ok = wait_text(err_path, "Ctrl-C or SIGTERM stops the cluster", 220)
        if not check(ok, f"foreground up: the cluster is up ({read(err_path)[-500:]!r})"):
            return
        check("a process that dies is restarted" in read(err_path),
              "up says that a process that dies is restarted")
        rkey = "router-router-0"
        old, _ = cl.pid(rkey)
        first_log = cl.log(rkey)
        t0 = time.time()
        os.kill(old, signal.SIGKILL)
        t_new = cl.wait_restarted(rkey, old, 30)
        text = read(err_path)
        check(t_new is not None and "router (pid %d) was killed by signal 9" % old in text
              and "restarting it in 0.5 s" in text and "router restarted (pid" in text,
              f"kill -9 the router: restarted by up after {((t_new or t0) - t0):.2f} s "
              f"({text.strip().splitlines()[-1:]})")
        new, restarts = cl.pid(rkey)
        check(restarts == 1, f"the pid file counts the restart ({restarts})")
        end, h = time.time() + 60, None
        while time.time() < end and h != 200:
            try:
                c = http.client.HTTPConnection("127.0.0.1", cl.port, timeout=5)
                c.request("GET", "/health")
                h = c.getresponse().status
                c.close()
            except (OSError, http.client.HTTPException):
                h = None
            time.sleep(0.1)
        check(h == 200, f"/health 200 again {time.time() - t0:.1f} s after the kill")
        log = cl.log(rkey)
        check(log.startswith(first_log) and f"---- tandem up: restart 1 of router" in log
              and f"pid {old}, was killed by signal 9" in log,
              "the router's log is appended to, with a line saying so")
        # twice more, each at once: back-off 1 s, then 2 s; status says restarting meanwhile
        for n, backoff in ((2, "1.0"), (3, "2.0")):
            pid, _ = cl.pid(rkey)
            os.kill(pid, signal.SIGKILL)
            ok = wait_text(err_path, f"restarting it in {backoff} s", 10)
            st = cl.status()
            states = {p["role"]: (p["state"], p["restarts"]) for p in st["processes"]} \
                if st else {}
            if n == 3:
                check(states.get("router") == ("restarting", 2),
                      f"tandem status during the back-off: router restarting, 2 restarts "
                      f"({states.get('router')})")
            t_new = cl.wait_restarted(rkey, pid, 30)
            check(ok and t_new is not None, f"kill {n}: back-off {backoff} s, restarted")
        st = cl.status()
        rt = [p for p in st["processes"] if p["role"] == "router"][0] if st else {}
        check(rt.get("state") == "running" and rt.get("restarts") == 3,
              f"tandem status: router running, 3 restarts ({rt})")
        plain = cl.tandem("status", cl.cfg).stdout.strip().splitlines()
        check(any(l.split()[0] == "router" and l.split()[-2:] == ["3", "running"] for l in plain),
              f"plain status: RESTARTS column ({plain[-1:]})")
        check(st and st.get("supervisor", {}).get("pid") == up.pid,
              f"status --json names the supervisor ({st.get('supervisor') if st else None})")
        pids = [cl.pid(k)[0] for k in cl.keys()]
        up.send_signal(signal.SIGTERM)
        rc = up.wait(timeout=120)
        check(rc == 0 and not any(alive(p) for p in pids),
              f"SIGTERM to up: exit {rc}, every process stopped")
    finally:
        if up and up.poll() is None:
            up.kill()
            up.wait()
        left = cl.leftovers()
        cl.cleanup(keep=bool(FAILS) or args.keep)
    check(not left, f"foreground: nothing left ({left})")

    # detached: the supervisor keeps supervising; down stops it
    cl = ChaosCluster(args, args.model, tp=1)
    try:
        r = cl.up(timeout=200)
        if not check(r.returncode == 0 and "supervising in the background" in r.stderr,
                     f"up -d: up, supervising in the background ({r.stderr.strip()[-300:]})"):
            return
        st = cl.status()
        sup = st["supervisor"]["pid"] if st else None
        check(sup and alive(sup) and st["supervisor"]["state"] == "running",
              f"status --json: the detached supervisor runs (pid {sup})")
        key = "prefill-p0-1"
        old, _ = cl.pid(key)
        os.kill(old, signal.SIGKILL)
        t_new = cl.wait_restarted(key, old, 30)
        # the supervisor writes the new pid file, then its "restarted" line: wait for both
        up_path = os.path.join(cl.rdir, "up.log")
        logged = wait_text(up_path, "prefill p0 stage 1 restarted", 5)
        up_log = read(up_path)
        check(t_new is not None and logged,
              f"kill -9 prefill stage 1: the detached supervisor restarted it (up.log: "
              f"{up_log.strip().splitlines()[-1:]})")
        ok, took, desc = cl.idle(60)
        check(ok, f"the restarted stage rejoined: prefill ready, nothing leaked ({took:.1f} s; "
                  f"{desc})")
        pids = [cl.pid(k)[0] for k in cl.keys()] + [sup]
        t0 = time.time()
        d = cl.down()
        check(d.returncode == 0 and not any(alive(p) for p in pids if p),
              f"tandem down: supervisor and every process stopped in {time.time() - t0:.1f} s")
        st = cl.status()
        check(st and all(p["state"] == "stopped" for p in st["processes"])
              and st["supervisor"]["state"] == "stopped", "status after down: all stopped")
        check("SIGKILL" not in d.stderr, f"nobody needed SIGKILL ({d.stderr.strip()[-200:]})")
        bad = sanitizer_reports(cl.logs())
        check(not bad, f"no sanitizer report in the process logs {bad}")
    finally:
        left = cl.leftovers()
        cl.cleanup(keep=bool(FAILS) or args.keep)
    check(not left, f"detached: nothing left ({left})")


# --- faults under load ------------------------------------------------------------------------
class Row:
    def __init__(self, name):
        self.name = name
        self.counts = {}
        self.repair_s = None      # fault -> repaired (process restarted, SIGCONT, link up)
        self.recovery_s = None    # repaired -> first successful request sent after it
        self.idle_s = None        # load stopped -> no leak anywhere
        self.also = ""            # other processes the supervisor restarted meanwhile

    def as_dict(self):
        return {"fault": self.name, "requests": sum(self.counts.values()), **self.counts,
                "repair_s": self.repair_s, "recovery_s": self.recovery_s,
                "leak_free_after_s": self.idle_s, "also_restarted": self.also}


def run_fault(cl, args, name, inject, seed, model, rows, cut_ok=False):
    """One fault under load (module docstring: after each fault)."""
    print(f"\n--- {name} ---", flush=True)
    row = Row(name)
    rows.append(row)
    before = {k: cl.pid(k) for k in cl.keys()}
    load = Load(cl.host, cl.port, model, args.concurrency, args.deadline, seed).start()
    time.sleep(args.pre)
    t_f = time.time()
    t_rep, extra = inject()
    if not check(t_rep is not None, f"{name}: repaired"):
        load.stop()
        return
    row.repair_s = None if getattr(inject, "no_repair", False) else t_rep - t_f
    t_ok = load.wait_ok_after(t_rep, args.recover_timeout)
    if t_ok:
        row.recovery_s = t_ok - t_rep
    check(t_ok is not None, f"{name}: a request sent after the repair succeeded "
                            f"(recovery {row.recovery_s if t_ok else float('nan'):.2f} s)")
    time.sleep(args.post)
    stuck = load.stop()
    check(not stuck and not load.crashes,
          f"{name}: every client thread ended ({len(stuck)} stuck) {load.crashes[:1]}")
    results = load.snapshot() + extra
    for r in results:
        row.counts[r.outcome] = row.counts.get(r.outcome, 0) + 1
    late = [r for r in results if r.outcome in (HUNG, BAD)]
    check(not late, f"{name}: every request ended within its {args.deadline:.0f} s deadline with "
                    f"a success or a clear error ({len(late)} not: "
                    f"{[(r.outcome, r.detail) for r in late[:3]]})")
    cuts = [r for r in results if r.outcome == CUT and not (cut_ok and r.t0 <= t_f + 0.2)]
    check(not cuts, f"{name}: no connection broken without an error"
                    f"{' (but those the dying router served)' if cut_ok else ''} "
                    f"({len(cuts)}: {[r.detail for r in cuts[:3]]})")
    refused = [r for r in results if r.outcome == REFUSED and not (cut_ok and r.t0 <= t_rep + 30)]
    check(not refused, f"{name}: no connection refused while the router runs ({len(refused)})")
    errs = [r.detail for r in results if r.outcome == ERROR]
    print(f"     outcomes {row.counts}; repair {t_rep - t_f:.2f} s, recovery "
          f"{row.recovery_s if row.recovery_s is not None else float('nan'):.2f} s"
          + (f"; errors e.g. {sorted(set(e[:90] for e in errs))[:3]}" if errs else ""),
          flush=True)
    clean, took, desc = cl.idle(args.idle_timeout)
    row.idle_s = took if clean else None
    check(clean, f"{name}: no leak on the survivors {took:.1f} s after the load stopped "
                 f"({desc})")
    after = {k: cl.pid(k) for k in cl.keys()}
    row.also = ", ".join(k for k in cl.keys() if after[k][1] > before[k][1]
                         and k != getattr(inject, "victim", None))
    check(cl.all_running(), f"{name}: every process runs "
                            f"({ {k: v for k, v in after.items()} })")
    b = cl.tandem("bench", "--url", f"http://{cl.host}:{cl.port}", "--concurrency", "2",
                  "--requests", "6", "--prompt-tokens", "80", "--max-tokens", "8", "--stream",
                  "--json", "--timeout-ms", str(int(args.deadline * 1000)), timeout=300)
    try:
        s = json.loads(b.stdout)
    except ValueError:
        s = {}
    check(b.returncode == 0 and s.get("errors") == 0 and s.get("completed") == 6,
          f"{name}: tandem bench afterwards: {s.get('completed')} of 6 completed, "
          f"{s.get('errors')} errors ({b.stderr.strip()[-200:]})")


def kill_fault(cl, key):
    def inject():
        old, _ = cl.pid(key)
        os.kill(old, signal.SIGKILL)
        return cl.wait_restarted(key, old, 60), []
    inject.victim = key
    return inject


def stop_fault(cl, key, hold):
    """SIGSTOP, hold, SIGCONT; meanwhile prefill stage 0 is asked for Health every 0.5 s: it
    must keep answering (its loop must not wait on the stopped stage) and say ready 0 once
    it declared the stage silent (5 s). Closing the old chain must not wait on the stopped
    stage either: its log line "the old stage chain closed in N ms" says N < 500 (a graceful
    close of the endpoints toward the stopped stage blocked stage 0's loop for 1.0-1.3 s)."""
    def inject():
        pid, _ = cl.pid(key)
        n_closed = cl.log("prefill-p0-0").count("the old stage chain closed in")
        polls = []
        done = threading.Event()

        def poll():
            while not done.is_set():
                t = time.time()
                try:
                    h = cl.prefill_health()
                except subprocess.TimeoutExpired:
                    h = None
                polls.append((t - t0, time.time() - t, h))
                done.wait(max(0.0, 0.5 - (time.time() - t)))
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            time.sleep(hold)
        finally:
            os.kill(pid, signal.SIGCONT)
            done.set()
        t_rep = time.time()
        poller.join(40)
        slow = [(round(a, 1), round(b, 1)) for a, b, h in polls if h is None or b > 3]
        check(not slow, f"{key} stopped: prefill stage 0 answered every Health poll within 3 s "
                        f"({len(polls)} polls; unanswered or slow at (t, took): {slow[:6]})")
        if hold > 6:
            seen = [round(a, 1) for a, b, h in polls
                    if h and h.get("ready") == 0 and a + b <= t_rep - t0]
            check(seen, f"{key} stopped: stage 0 declared it gone (Health ready 0) from "
                        f"t = {seen[0] if seen else None} s (its heartbeat silence is 5 s)")
            closed = re.findall(r"the old stage chain closed in (\d+) ms",
                                cl.log("prefill-p0-0"))[n_closed:]
            check(closed and all(int(ms) < 500 for ms in closed),
                  f"{key} stopped: stage 0 closed the old stage chain without waiting for the "
                  f"stopped stage ({closed} ms)")
        return t_rep, []
    return inject


def drop_fault(cl, model, seed, args):
    def inject():
        res = drop_clients(cl.host, cl.port, model, 12, seed, args.deadline)
        check(sum(r.outcome == DROPPED for r in res) >= 10,
              f"drop clients: {sum(r.outcome == DROPPED for r in res)} of 12 dropped "
              f"({sorted(set(r.outcome for r in res))})")
        return time.time(), [r for r in res if r.outcome != DROPPED]
    inject.no_repair = True  # nothing to repair: the recovery counts from the drops' end
    return inject


def print_table(rows, title):
    print(f"\n=== {title} ===")
    print("| fault | requests | ok | clear errors | refused | cut | hung/bad | repair s | "
          "recovery s | leak-free after s | also restarted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f = (lambda v: f"{v:.2f}" if v is not None else "-")
    for r in rows:
        c = r.counts
        print(f"| {r.name} | {sum(v for k, v in c.items() if k != DROPPED)} | {c.get(OK, 0)} | "
              f"{c.get(ERROR, 0)} | {c.get(REFUSED, 0)} | {c.get(CUT, 0)} | "
              f"{c.get(HUNG, 0) + c.get(BAD, 0)} | {f(r.repair_s)} | {f(r.recovery_s)} | "
              f"{f(r.idle_s)} | {r.also or '-'} |")


def warmup(cl, args, model, seed):
    load = Load(cl.host, cl.port, model, args.concurrency, args.deadline, seed).start()
    time.sleep(args.pre)
    load.stop()
    res = load.snapshot()
    n_ok = sum(r.outcome == OK for r in res)
    bad = [(r.outcome, r.detail) for r in res if r.outcome != OK]
    check(res and n_ok == len(res), f"warm-up: {n_ok} of {len(res)} requests ok ({bad[:3]})")


def case_faults(args):
    cl = ChaosCluster(args, args.model, tp=args.decode_tp, xfer_timeout_ms=args.xfer_timeout_ms,
                      env_extra=args.env_extra)
    rows = []
    t_start = time.time()
    try:
        r = cl.up(timeout=240)
        if not check(r.returncode == 0, f"tandem up -d: cluster up in {time.time() - t_start:.1f} s"
                                        f" ({(r.stdout + r.stderr).strip()[-600:]})"):
            return rows
        model = model_name(cl.host, cl.port)
        check(model is not None, f"GET /v1/models: {model}")
        seed = args.seed
        warmup(cl, args, model, seed)
        for rnd in range(1, args.rounds + 1):
            tag = f" (round {rnd})" if args.rounds > 1 else ""
            rank = args.decode_tp - 1 if rnd % 2 else 0
            faults = [
                ("kill -9 router", kill_fault(cl, "router-router-0"), True),
                ("kill -9 prefill stage 1", kill_fault(cl, "prefill-p0-1"), False),
                ("kill -9 prefill stage 0", kill_fault(cl, "prefill-p0-0"), False),
                (f"kill -9 decode rank {rank}", kill_fault(cl, f"decode-d0-{rank}"), False),
                (f"SIGSTOP prefill stage 1 {args.stop_seconds:.0f} s",
                 stop_fault(cl, "prefill-p0-1", args.stop_seconds), False),
                ("drop clients mid-stream", drop_fault(cl, model, seed, args), False),
            ]
            for name, inject, cut_ok in faults:
                seed += 1
                if args.only and not any(o in name for o in args.only.split(",")):
                    continue
                run_fault(cl, args, name + tag, inject, seed, model, rows, cut_ok)
        st = cl.status()
        restarts = {f"{p['role']}-{p['instance']}-{p['rank']}": p["restarts"]
                    for p in (st["processes"] if st else [])}
        print(f"\nrestarts: {restarts}")
    finally:
        pids = [cl.pid(k)[0] for k in cl.keys()]
        d = cl.down()
        check(d.returncode == 0, f"tandem down exits 0 ({d.stderr.strip()[-300:]})")
        end = time.time() + 30
        while time.time() < end and (any(alive(p) for p in pids if p) or cl.leftovers()):
            time.sleep(0.2)
        check(not cl.leftovers(), f"nothing left after down ({cl.leftovers()})")
        bad = sanitizer_reports(cl.logs())
        check(not bad, f"no sanitizer report in the process logs {bad}")
        up_log = read(os.path.join(cl.rdir, "up.log"))
        print("supervisor (up.log):\n  " + "\n  ".join(
            l for l in up_log.splitlines() if l.startswith("tandem:")))
        crashes = [l for l in up_log.splitlines() if "was killed by signal" in l
                   and "signal 9 " not in l]
        check(not crashes, f"no process crashed (only the kill -9 victims died by a signal): "
                           f"{crashes}")
        cl.cleanup(keep=args.keep or bool(FAILS))
        if args.keep or FAILS:
            print(f"logs kept in {cl.rdir}")
    print(f"faults: {time.time() - t_start:.1f} s")
    return rows


# --- netns: cut the link between the prefill and the decode hosts ------------------------------
def sh(*cmd, check_rc=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check_rc and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class NetnsCluster(ChaosCluster):
    """Prefill p0 (both stages) in namespace ns_p, decode d0 and the router in ns_d; veth
    links root <-> ns_d (clients) and ns_d <-> ns_p (control + KV over UCX tcp)."""

    def __init__(self, args, model, ns_p, ns_d, net, dev_dp, dev_pd, env_extra):
        super().__init__(args, model, tp=1, xfer_timeout_ms=args.xfer_timeout_ms,
                         env_extra=env_extra)
        self.ns_p, self.ns_d = ns_p, ns_d
        self.host = f"{net}.2"
        self.dc_addr, self.pf_addr = f"{net}.5", f"{net}.6"
        self.dev_dp, self.dev_pd = dev_dp, dev_pd
        with open(self.cfg, "w") as f:
            f.write(chaos_yaml(args.model, f"{self.dir}/run", self.host, self.port,
                               [self.pf_addr, self.pf_addr], self.pf_port, self.dc_addr,
                               self.dc_port, 1, "tcp", args.xfer_timeout_ms,
                               instance_timeout_ms=2000))
        self.procs = {}

    def dc_host_for_client(self):
        return self.dc_addr

    def pf_host_for_client(self):
        return self.pf_addr

    def dc_ns(self):
        return self.ns_d

    def pf_ns(self):
        return self.ns_p

    def start(self, name, ns, script, *a, dev):
        env = dict(self.env, UCX_NET_DEVICES=dev) if dev else self.env
        self.procs[name] = spawn(
            ["ip", "netns", "exec", ns, os.path.join(self.args.source_dir, "deploy", script),
             self.cfg, *a], os.path.join(self.dir, f"{name}.log"), env=env, new_session=True)

    def keys(self):
        return list(self.procs)

    def pid(self, key):
        return self.procs[key].pid, 0

    def all_running(self):
        return all(p.poll() is None for p in self.procs.values())

    def logs(self):
        return {k: read(os.path.join(self.dir, f"{k}.log")) for k in self.procs}

    def stop(self):
        keys = list(self.procs)
        return dict(zip(keys, stop([self.procs[k] for k in keys], timeout=60, group=True)))


def case_netns(args):
    if shutil.which("ip") is None:
        print("SKIP netns: no 'ip' command")
        return [], SKIP
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns_p, ns_d = f"tcp{tag}", f"tcd{tag}"
    probe = subprocess.run(["ip", "netns", "add", ns_p], capture_output=True, text=True)
    if probe.returncode:
        print(f"SKIP netns: 'ip netns add' is not permitted here ({probe.stderr.strip()}); run "
              f"as root to cut a link between two hosts")
        return [], SKIP
    rows = []
    cl = None
    t_start = time.time()
    try:
        sh("ip", "netns", "add", ns_d)
        used = sh("ip", "-4", "addr").stdout
        k = next(k for k in random.sample(range(1, 250), 249) if f"10.78.{k}." not in used)
        net = f"10.78.{k}"
        root_dev, dr_dev = f"cr{tag}a", f"cr{tag}b"   # root <-> ns_d: .1 / .2
        dp_dev, pd_dev = f"cx{tag}d", f"cx{tag}p"     # ns_d <-> ns_p: .5 / .6
        sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", dr_dev)
        sh("ip", "link", "set", dr_dev, "netns", ns_d)
        sh("ip", "addr", "add", f"{net}.1/30", "dev", root_dev)
        sh("ip", "link", "set", root_dev, "up")
        sh("ip", "-n", ns_d, "addr", "add", f"{net}.2/30", "dev", dr_dev)
        sh("ip", "-n", ns_d, "link", "set", dr_dev, "up")
        sh("ip", "link", "add", dp_dev, "type", "veth", "peer", "name", pd_dev)
        sh("ip", "link", "set", dp_dev, "netns", ns_d)
        sh("ip", "link", "set", pd_dev, "netns", ns_p)
        sh("ip", "-n", ns_d, "addr", "add", f"{net}.5/30", "dev", dp_dev)
        sh("ip", "-n", ns_p, "addr", "add", f"{net}.6/30", "dev", pd_dev)
        for ns, dev in ((ns_d, dp_dev), (ns_p, pd_dev)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        cl = NetnsCluster(args, args.model, ns_p, ns_d, net, dp_dev, pd_dev, args.env_extra)
        cl.start("decode-d0-0", ns_d, "start-decode.sh", "d0", "0", dev=dp_dev)
        cl.start("prefill-p0-1", ns_p, "start-prefill.sh", "p0", "1", dev=pd_dev)
        cl.start("prefill-p0-0", ns_p, "start-prefill.sh", "p0", "0", dev=pd_dev)
        cl.start("router-router-0", ns_d, "start-router.sh", dev=None)
        ok, took, desc = cl.idle(180)
        if not check(ok and cl.all_running(),
                     f"two hosts: prefill p0 in ns {ns_p} ({cl.pf_addr}), decode d0 and the "
                     f"router in ns {ns_d} ({cl.dc_addr}, {cl.host}): ready in "
                     f"{time.time() - t_start:.1f} s ({desc})"):
            for n, t in cl.logs().items():
                print(f"--- {n}\n{t[-1500:]}")
            return rows, 0
        model = model_name(cl.host, cl.port)
        seed = args.seed + 100
        warmup(cl, args, model, seed)

        def cut():
            sh("ip", "-n", ns_p, "link", "set", pd_dev, "down")
            try:
                time.sleep(args.cut_seconds)
            finally:
                sh("ip", "-n", ns_p, "link", "set", pd_dev, "up")
            return time.time(), []
        run_fault(cl, args, f"cut prefill <-> decode link {args.cut_seconds:.0f} s", cut,
                  seed + 1, model, rows)
    finally:
        if cl:
            codes = cl.stop()
            check(all(c == 0 for c in codes.values()), f"SIGTERM: every process exits 0 ({codes})")
            bad = sanitizer_reports(cl.logs())
            check(not bad, f"no sanitizer report in the process logs {bad}")
            if FAILS:
                for n, t in cl.logs().items():
                    print(f"--- {n} (last lines)\n{t[-2000:]}")
        for ns in (ns_p, ns_d):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"cr{tag}a"], capture_output=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        check(ns_p not in left and ns_d not in left, "namespaces removed")
        if cl:
            check(not cl.leftovers(), f"nothing left ({cl.leftovers()})")
            cl.cleanup(keep=args.keep or bool(FAILS))
    print(f"netns: {time.time() - t_start:.1f} s")
    return rows, 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True, choices=["supervise", "faults", "netns"])
    for b in ("tandem", "decode", "prefill", "router"):
        ap.add_argument(f"--{b}", required=True)
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--model", default="", help="default: the synthetic llama of --synth-dir")
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("TANDEM_CHAOS_ROUNDS") or 1))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=40.0, help="per request, seconds")
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--xfer-timeout-ms", type=int, default=10000, help="kvxfer.timeout_ms")
    ap.add_argument("--pre", type=float, default=2.0, help="load before each fault, seconds")
    ap.add_argument("--post", type=float, default=2.0, help="load after the recovery, seconds")
    ap.add_argument("--stop-seconds", type=float, default=7.0)
    ap.add_argument("--cut-seconds", type=float, default=6.0)
    ap.add_argument("--recover-timeout", type=float, default=90.0)
    ap.add_argument("--idle-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=int(os.environ.get("TANDEM_CHAOS_SEED") or 0))
    ap.add_argument("--asan", action="store_true", help="the binaries are sanitizer builds")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    ap.add_argument("--only", default="", help="faults: only those whose name contains one of "
                                               "these comma-separated strings")
    args = ap.parse_args()
    for b in (args.tandem, args.decode, args.prefill, args.router):
        if not os.access(b, os.X_OK):
            print(f"FAIL {b} is not built")
            return 1
    args.model = args.model or os.path.join(args.synth_dir, "llama.gguf")
    args.seed = args.seed or random.randrange(1, 1 << 20)
    args.env_extra = {}
    if args.asan:
        supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "lsan.supp")
        args.env_extra["LSAN_OPTIONS"] = (os.environ.get("LSAN_OPTIONS", "") +
                                          f":suppressions={supp}").lstrip(":")
    print(f"chaos {args.case}: model {args.model}, seed {args.seed} (TANDEM_CHAOS_SEED), "
          f"rounds {args.rounds}, concurrency {args.concurrency}, deadline {args.deadline:.0f} s",
          flush=True)
    t0 = time.time()
    rc = 0
    rows = []
    if args.case == "supervise":
        case_supervise(args)
    elif args.case == "faults":
        rows = case_faults(args)
    else:
        rows, rc = case_netns(args)
    if rows:
        print_table(rows, f"chaos {args.case} (seed {args.seed}, concurrency {args.concurrency})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "seed": args.seed, "rows": [r.as_dict() for r in rows],
                       "seconds": round(time.time() - t0, 1), "fails": FAILS}, f, indent=1)
    print(f"chaos {args.case}: {time.time() - t0:.1f} s")
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
        return 1
    return rc


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # run the finally blocks
    sys.exit(main())
