#!/usr/bin/env python3
"""test_deploy.py: `tandem up/down/status`, `tandem bench` and the start scripts, with real
processes.

Cases (--case, one ctest each):
  up_down     up -d on a generated YAML (router + decode tp1 + decode tp2, synthetic model)
              -> status: all running -> POST /v1/completions answers -> down -> status:
              all stopped, no process left
  foreground  up in the foreground: SIGTERM stops everything (exit 0); a second run where a
              decode rank is killed under --no-restart: up reports it, stops the rest and
              exits non-zero
  bad_model   a decode instance that cannot start (no such model file): up -d exits
              non-zero, prints the log tail, leaves no process behind
  bench       tandem bench (plain and --stream) against the cluster: requests == N,
              errors == 0, sane numbers
  netns       two "hosts": network namespaces with veth links, the router in one and the
              decode instance in the other, each started by its deploy/start-*.sh; an HTTP
              request from the root namespace is answered (skipped when namespaces cannot be
              created)
 Disaggregated (router + prefill p0 with pp 2 + decode d0; skipped without tandem-prefill):
  prefill_up_down     up -d returns only once stage 0 said ready -> status: decode, both
                      prefill stages and the router running, their logs and pid files ->
                      a completion (with the real router: equal to tandem generate, and
                      prefilled by p0) -> down -> all stopped, nothing left
  prefill_foreground  foreground up --no-restart; SIGKILL of prefill stage 1: up reports
                      it, stops the rest, exits non-zero; a stage that cannot start (bad
                      layer_partition): up -d fails with its log tail and leaves nothing
                      behind
  prefill_scripts     deploy/start-prefill.sh: one stage per call, stage 1 started first,
                      decode and router by their scripts; ready, a completion, SIGTERM ->
                      every stage exits 0; `all`: both stages under one script, SIGTERM ->
                      exit 0; a stage killed -> the script stops the other, exits non-zero
  secure              the YAML's security section: mutual TLS on every control socket, a
                      request served; clients without the cluster's certificate refused and
                      logged; a missing file stops up; UCX on the loopback device only

--router BIN: the real tandem-router; without it tests/deploy/fake_router.py stands in (it
checks the decode ports for /health and answers with fixed text), and the output says so.
--prefill BIN: tandem-prefill (default: next to --decode); the prefill cases skip (77)
without it.

usage: test_deploy.py --case NAME --tandem BIN --decode BIN [--router BIN] [--prefill BIN]
                      --synth-dir DIR --source-dir DIR
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import UpCluster, write_yaml  # noqa: E402
from tdtest.ports import free_port as _free_port  # noqa: E402
from tdtest.procs import alive as running, children, read, stop  # noqa: E402
from tdtest.waits import wait_for, wait_line  # noqa: E402

SKIP = 77  # ctest SKIP_RETURN_CODE


def free_port():
    """A base port P for a cluster: P is the router, P+1.. the decode instances, P+50.. the
    prefill instances."""
    return _free_port(4, also=(50, 51))


class Env(UpCluster):
    """A temp dir with a bin dir (TANDEM_BIN: tandem-decode + router) and YAML files."""

    def __init__(self, args):
        router = args.router or os.path.join(args.source_dir, "tests/deploy/fake_router.py")
        prefill = args.prefill or os.path.join(os.path.dirname(args.decode), "tandem-prefill")
        self.prefill = prefill if os.access(prefill, os.X_OK) else None
        # start-prefill.sh ... all reads the stage count with `tandem status`
        super().__init__(args.tandem, "tandem-deploy-",
                         {"decode": args.decode, "router": router, "prefill": self.prefill,
                          "tandem": args.tandem}, exclude="test_deploy")
        self.args = args
        self.model = os.path.join(args.synth_dir, "llama.gguf")  # 6 layers: pp 2 = 3 + 3

    def yaml(self, name, decodes, model=None, listen_host="127.0.0.1", decode_host=None,
             prefills=(), backend=None):
        """decodes: list of (name, tp); prefills: list of (name, pp[, {more fields}]).
        Returns (path, router port); the prefill instances' ports are in self.pf_port."""
        port = free_port()
        doc = {"model": model or self.model, "run_dir": f"{self.dir}/run",
               "router": {"listen": f"{listen_host}:{port}", "heartbeat_ms": 100,
                          "instance_timeout_ms": 3000},
               "decode": [dict({"name": dname, "tp": tp, "kv_blocks": 256, "max_batch": 16,
                                "step_tokens": 128, "port": port + 1 + i},
                               **({"host": decode_host} if decode_host else {}))
                          for i, (dname, tp) in enumerate(decodes)]}
        if backend:
            doc["backend"] = backend
        self.pf_port = {}
        for i, (pname, pp, *extra) in enumerate(prefills):
            self.pf_port[pname] = port + 50 + i
            doc.setdefault("prefill", []).append(
                {"name": pname, "pp": pp, "chunk_size": 64, "kv_tokens": 4096,
                 "profile_budget_ms": 1000, "port": port + 50 + i, **(extra[0] if extra else {})})
        if prefills:  # one host: shared memory only, as deploy/local.yaml
            doc["kvxfer"] = {"ucx_tls": "posix,cma,self", "timeout_ms": 20000}
        return write_yaml(os.path.join(self.dir, name + ".yaml"), doc), port

    def status(self, cfg):
        return super().status(cfg, timeout=300)


def http(url, body=None, timeout=120):
    """(status, parsed JSON or text)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def model_name(base):
    st, m = http(base + "/v1/models", timeout=30)
    try:
        return m["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None


PROMPT = [1, 104, 205, 306, 407]


def generate_text(e):
    """What `tandem generate` (greedy, 8 tokens) makes of PROMPT: the expected completion."""
    r = subprocess.run([e.args.tandem, "generate", "--model", e.model, "--prompt-ids",
                        ",".join(map(str, PROMPT)), "--max-tokens", "8", "--temperature", "0",
                        "--threads", "1"], capture_output=True, timeout=300)
    return r.stdout.decode(errors="replace").rstrip("\n") if r.returncode == 0 else None


def check_completion(base, label, e):
    """POST /v1/completions answers; with the real router, exactly as `tandem generate`."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    name = model_name(base)
    if name:
        body["model"] = name
    st, r = http(base + "/v1/completions", body)
    ok = (st == 200 and isinstance(r, dict) and isinstance(r.get("choices"), list)
          and r["choices"] and isinstance(r["choices"][0].get("text"), str)
          and r["choices"][0].get("finish_reason") in ("stop", "length")
          and 1 <= r.get("usage", {}).get("completion_tokens", 0) <= 8)
    check(ok, f"{label}: POST /v1/completions answers 200 with a completion "
              f"({st} {json.dumps(r)[:200]})")
    if ok and e.args.router:
        want = generate_text(e)
        got = r["choices"][0]["text"]
        check(got == want, f"{label}: the completion equals tandem generate ({got!r} vs {want!r})")


def states(st):
    return [p["state"] for p in st["processes"]] if st else None


def case_up_down(e):
    cfg, port = e.yaml("updown", [("d0", 1), ("d1", 2)])
    t0 = time.time()
    r = e.tandem("up", "-d", cfg, "--timeout", "150", timeout=240)
    if not check(r.returncode == 0, f"up -d exits 0 in {time.time() - t0:.1f} s "
                                    f"({r.stderr.strip()[-600:]})"):
        return
    check(f"http://127.0.0.1:{port}" in r.stdout, f"up -d prints the endpoint: {r.stdout.strip()}")
    st = e.status(cfg)
    check(st and len(st["processes"]) == 4 and states(st) == ["running"] * 4,
          f"status --json: 4 processes running ({states(st)})")
    plain = e.tandem("status", cfg).stdout.strip().splitlines()
    check(len(plain) == 4 and all(l.split()[-1] == "running" for l in plain),
          f"status: one line per process, all running ({plain})")
    rdir = st["run_dir"] if st else ""
    names = sorted(os.listdir(rdir)) if os.path.isdir(rdir) else []
    want = ["decode-d0-0", "decode-d1-0", "decode-d1-1", "router-router-0"]
    check(all(f"{w}.log" in names and f"{w}.pid" in names for w in want),
          f"run directory holds a log and a pid file per process ({names})")
    r2 = e.tandem("up", "-d", cfg, "--timeout", "30", timeout=60)
    check(r2.returncode != 0 and "already running" in r2.stderr,
          f"a second up -d is refused while running ({r2.stderr.strip()[:160]})")
    check(http(f"http://127.0.0.1:{port}/health", timeout=30)[0] == 200, "GET /health is 200")
    check_completion(f"http://127.0.0.1:{port}", "up_down", e)
    pids = [p["pid"] for p in st["processes"]] if st else []
    t0 = time.time()
    r = e.tandem("down", cfg, timeout=120)
    check(r.returncode == 0, f"down exits 0 in {time.time() - t0:.1f} s ({r.stderr.strip()[:300]})")
    st = e.status(cfg)
    check(states(st) == ["stopped"] * 4, f"status after down: all stopped ({states(st)})")
    alive = [p for p in pids if running(p)]
    check(not alive and not e.leftovers(), f"no process left after down ({alive} {e.leftovers()})")
    r = e.tandem("down", cfg, timeout=60)
    check(r.returncode == 0 and "not running" in r.stdout, "down again: 'not running', exit 0")
    up_down_moved(e, cfg)


def up_down_moved(e, cfg):
    """--port N moves the cluster: up derives a copy of the YAML (tools/up_config.c) with the
    router on N and the decode instances' control ports N+1, N+2; status and down take the
    same --port. (The only other test of it, deploy_quickstart, runs a Release build.)"""
    for _ in range(3):  # another process may take N+1 or N+2 meanwhile: up says so
        p = free_port()
        r = e.tandem("up", "-d", cfg, "--port", str(p), "--timeout", "150", timeout=240)
        if r.returncode == 0 or "in use" not in r.stderr:
            break
    if not check(r.returncode == 0, f"up -d --port {p} exits 0 ({r.stderr.strip()[-600:]})"):
        return
    check(f"http://127.0.0.1:{p}" in r.stdout, f"--port {p}: up -d prints the moved endpoint")
    check_completion(f"http://127.0.0.1:{p}", "up_down --port", e)
    st = e.tandem("status", cfg, "--port", str(p), "--json", timeout=120)
    ok = st.returncode == 0 and states(json.loads(st.stdout)) == ["running"] * 4
    check(ok, f"--port {p}: status --port --json: 4 processes running ({st.stdout.strip()[:200]})")
    r = e.tandem("down", cfg, "--port", str(p), timeout=120)
    check(r.returncode == 0 and not e.leftovers(),
          f"--port {p}: down --port exits 0, nothing left ({r.stderr.strip()[:200]})")


def start_fg(e, cfg, *extra):
    err = open(os.path.join(e.dir, f"fg-{random.randrange(1 << 30)}.err"), "w+")
    p = subprocess.Popen([e.args.tandem, "up", cfg, "--timeout", "150", *extra],
                         stdout=subprocess.PIPE, stderr=err, env=e.env)
    out = wait_line(p, "is up", 180)
    return p, out, err


def read_err(err):
    err.seek(0)
    return err.read()


def case_foreground(e):
    cfg, port = e.yaml("fg", [("d0", 1)])
    p, out, err = start_fg(e, cfg)
    try:
        if not check("is up" in out, f"foreground up reports the cluster up ({out.strip()} "
                                     f"{read_err(err)[-600:]})"):
            return
        st = e.status(cfg)
        check(states(st) == ["running"] * 2, f"status while up runs: all running ({states(st)})")
        check_completion(f"http://127.0.0.1:{port}", "foreground", e)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=90)
        check(rc == 0, f"SIGTERM: up exits 0 in {time.time() - t0:.1f} s "
                       f"({read_err(err)[-300:].strip()})")
        st = e.status(cfg)
        check(states(st) == ["stopped"] * 2, f"status after SIGTERM: all stopped ({states(st)})")
        check(not e.leftovers(), f"no process left after SIGTERM ({e.leftovers()})")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

    # A rank dying while the cluster runs, --no-restart: up reports it and stops everything,
    # exit != 0 (the restarts are tested by chaos_supervise, tests/chaos/test_chaos.py).
    p, out, err = start_fg(e, cfg, "--no-restart")
    try:
        if not check("is up" in out, "foreground up (second run) is up"):
            return
        st = e.status(cfg)
        victim = st["processes"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        rc = p.wait(timeout=90)
        text = read_err(err)
        check(rc != 0 and "while running" in text and "killed by signal 9" in text,
              f"a killed decode rank: up reports it and exits {rc} "
              f"({text.strip().splitlines()[-1:] if text.strip() else ''})")
        check(not e.leftovers(), f"no process left after the failure ({e.leftovers()})")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def case_bad_model(e):
    cfg, port = e.yaml("bad", [("d0", 1)], model=os.path.join(e.dir, "no-such-model.gguf"))
    t0 = time.time()
    r = e.tandem("up", "-d", cfg, "--timeout", "120", timeout=240)
    check(r.returncode != 0, f"up -d with a missing model exits {r.returncode} in "
                             f"{time.time() - t0:.1f} s")
    check("last lines of" in r.stderr and "no-such-model" in r.stderr,
          f"the failing process's log tail is printed ({r.stderr.strip()[-500:]})")
    check("did not come up" in r.stderr, "up says the cluster did not come up")
    st = e.status(cfg)
    check(states(st) == ["stopped"] * 2, f"status: all stopped ({states(st)})")
    check(not e.leftovers(), f"no process left behind ({e.leftovers()})")
    # A missing binary is reported before anything runs.
    env = dict(e.env, TANDEM_BIN=os.path.join(e.dir, "nowhere"))
    good, _ = e.yaml("nobin", [("d0", 1)])
    r = subprocess.run([e.args.tandem, "up", "-d", good, "--timeout", "30"], capture_output=True,
                       text=True, timeout=120, env=env)
    check(r.returncode != 0 and "cannot run" in r.stderr,
          f"missing binaries: clear error ({r.stderr.strip()[:200]})")
    check(not e.leftovers(), "no process left behind (missing binaries)")
    # backend: cuda where no GPU is usable: the decode rank refuses at start with the reason
    # (never a silent CPU run); skipped where a GPU is present
    if subprocess.run(["sh", "-c", "nvidia-smi -L"], capture_output=True).returncode != 0:
        cfg, _ = e.yaml("cuda", [("d0", 1)], backend="cuda")
        r = e.tandem("up", "-d", cfg, "--timeout", "60", timeout=180)
        check(r.returncode != 0 and "backend 'cuda'" in r.stderr,
              f"backend cuda without a GPU: up fails naming it ({r.stderr.strip()[-300:]})")
        check(not e.leftovers(), "no process left behind (backend cuda)")


def case_bench(e):
    cfg, port = e.yaml("bench", [("d0", 1)])
    r = e.tandem("up", "-d", cfg, "--timeout", "150", timeout=240)
    if not check(r.returncode == 0, f"up -d ({r.stderr.strip()[-400:]})"):
        return
    try:
        url = f"http://127.0.0.1:{port}"
        for extra in ([], ["--stream"]):
            label = "bench" + (" --stream" if extra else "")
            t0 = time.time()
            b = e.tandem("bench", "--url", url, "--concurrency", "4", "--requests", "12",
                         "--prompt-tokens", "16", "--max-tokens", "8", "--json", *extra,
                         timeout=300)
            try:
                s = json.loads(b.stdout)
            except ValueError:
                check(False, f"{label}: JSON output ({b.stdout[:200]} {b.stderr[-300:]})")
                continue
            check(b.returncode == 0 and s["requests"] == 12 and s["completed"] == 12
                  and s["errors"] == 0, f"{label}: 12 requests, 0 errors in "
                                        f"{time.time() - t0:.1f} s (rc {b.returncode}, "
                                        f"{b.stderr.strip()[-300:]})")
            check(0 < s["total_output_tokens"] <= 12 * 8 and s["output_tokens_per_s"] > 0
                  and s["requests_per_s"] > 0, f"{label}: throughput "
                                               f"{s['output_tokens_per_s']:.1f} tok/s, "
                                               f"{s['total_output_tokens']} tokens")
            check(s["e2el_ms_p50"] and s["e2el_ms_p50"] <= s["e2el_ms_p99"],
                  f"{label}: latency percentiles ordered")
            if extra:
                check(s["ttft_ms_p50"] is not None and 0 < s["ttft_ms_p50"] <= s["ttft_ms_p90"]
                      <= s["ttft_ms_p99"] and s["tpot_ms_p50"] is not None
                      and s["itl_ms_p50"] is not None,
                      f"{label}: ttft p50 {s['ttft_ms_p50']}, tpot p50 {s['tpot_ms_p50']}, "
                      f"itl p50 {s['itl_ms_p50']}")
            else:
                check(s["ttft_ms_p50"] is None, f"{label}: no TTFT without streaming")
        # fresh prompts (another seed) and every requested token (the server ignores EOS)
        f = e.tandem("bench", "--url", url, "--requests", "4", "--max-tokens", "8", "--json",
                     "--prompt-seed", "7", "--ignore-eos", timeout=300)
        try:
            fs = json.loads(f.stdout)
        except ValueError:
            fs = {}
        check(f.returncode == 0 and fs.get("total_output_tokens") == 32,
              f"bench --ignore-eos --prompt-seed: 4 x 8 tokens ({fs.get('total_output_tokens')}, "
              f"{f.stderr.strip()[-300:]})")
        t = e.tandem("bench", "--url", url, "--requests", "2", "--max-tokens", "4", timeout=300)
        check(t.returncode == 0 and "output throughput" in t.stdout,
              f"bench text report ({t.stdout.strip()[:300]})")
        bad = e.tandem("bench", "--url", "http://127.0.0.1:1", "--requests", "2", "--json",
                       timeout=120)
        try:
            errs = json.loads(bad.stdout)["errors"]
        except (ValueError, KeyError):
            errs = None
        check(bad.returncode != 0 and errs == 2,
              f"bench against a closed port: exit {bad.returncode}, errors {errs}")
    finally:
        e.tandem("down", cfg, timeout=120)
        check(not e.leftovers(), "no process left after down")


def need_prefill(e):
    if e.prefill:
        print(f"prefill: {e.prefill}", flush=True)
        return True
    print("SKIP: tandem-prefill is not built (pass --prefill BIN or build it next to "
          "tandem-decode)", flush=True)
    return False


def prefilled_by(e, rdir_or_log, label):
    """With the real router: stage 0's log shows a request prefilled by the instance."""
    if not e.args.router:
        return
    text = read(rdir_or_log)
    check(" tokens in " in text and "request " in text,
          f"{label}: prefill stage 0 logged a prefilled request ({text.strip()[-300:]!r})")


PF_PROCS = [("decode", "d0", 0), ("prefill", "p0", 0), ("prefill", "p0", 1),
            ("router", "router", 0)]


def case_prefill_up_down(e):
    if not need_prefill(e):
        return SKIP
    cfg, port = e.yaml("pf", [("d0", 1)], prefills=[("p0", 2)])
    t0 = time.time()
    r = e.tandem("up", "-d", cfg, "--timeout", "200", timeout=300)
    if not check(r.returncode == 0, f"up -d with a prefill instance exits 0 in "
                                    f"{time.time() - t0:.1f} s ({r.stderr.strip()[-600:]})"):
        return
    st = e.status(cfg)
    rdir = st["run_dir"] if st else ""
    log0 = os.path.join(rdir, "prefill-p0-0.log")
    # up returned: stage 0 must already have said ready (its Health.ready is what up waits for)
    check("ready" in read(log0), f"prefill stage 0 said 'ready' before up returned "
                                 f"({read(log0).strip()[-300:]!r})")
    got = [(p["role"], p["instance"], p["rank"]) for p in st["processes"]] if st else None
    check(got == PF_PROCS and states(st) == ["running"] * 4,
          f"status --json: decode, prefill stages 0 and 1, router, all running "
          f"({got} {states(st)})")
    plain = e.tandem("status", cfg).stdout.strip().splitlines()
    check(len(plain) == 4 and [l.split()[:3] for l in plain][1:3] ==
          [["prefill", "p0", "0"], ["prefill", "p0", "1"]]
          and all(l.split()[-1] == "running" for l in plain),
          f"status: one line per process, prefill stages listed ({plain})")
    names = sorted(os.listdir(rdir)) if os.path.isdir(rdir) else []
    want = ["decode-d0-0", "prefill-p0-0", "prefill-p0-1", "router-router-0"]
    check(all(f"{w}.log" in names and f"{w}.pid" in names for w in want),
          f"run directory holds a log and a pid file per process ({names})")
    h = e.tandem("client", "--url", f"tcp://127.0.0.1:{e.pf_port['p0']}", "--health",
                 timeout=60)
    check(h.returncode == 0 and "ready 1" in h.stdout,
          f"prefill stage 0 answers Health with ready ({h.stdout.strip()} {h.stderr.strip()})")
    check_completion(f"http://127.0.0.1:{port}", "prefill_up_down", e)
    prefilled_by(e, log0, "prefill_up_down")
    pids = [p["pid"] for p in st["processes"]] if st else []
    t0 = time.time()
    r = e.tandem("down", cfg, timeout=120)
    check(r.returncode == 0, f"down exits 0 in {time.time() - t0:.1f} s ({r.stderr.strip()[:300]})")
    check("SIGKILL" not in r.stderr, f"every process stopped on SIGTERM ({r.stderr.strip()[:300]})")
    st = e.status(cfg)
    check(states(st) == ["stopped"] * 4, f"status after down: all stopped ({states(st)})")
    alive = [p for p in pids if running(p)]
    check(not alive and not e.leftovers(), f"no process left after down ({alive} {e.leftovers()})")


def case_prefill_foreground(e):
    if not need_prefill(e):
        return SKIP
    cfg, port = e.yaml("pffg", [("d0", 1)], prefills=[("p0", 2)])
    p, out, err = start_fg(e, cfg, "--no-restart")
    try:
        if not check("is up" in out, f"foreground up with a prefill instance is up ({out.strip()} "
                                     f"{read_err(err)[-600:]})"):
            return
        st = e.status(cfg)
        victim = [q["pid"] for q in st["processes"]
                  if q["role"] == "prefill" and q["rank"] == 1][0]
        os.kill(victim, signal.SIGKILL)
        rc = p.wait(timeout=90)
        text = read_err(err)
        check(rc != 0 and "prefill p0 stage 1" in text and "killed by signal 9" in text
              and "while running" in text,
              f"a killed prefill stage: up reports it and exits {rc} "
              f"({text.strip().splitlines()[-3:] if text.strip() else ''})")
        st = e.status(cfg)
        check(states(st) == ["stopped"] * 4, f"status after the failure: all stopped "
                                             f"({states(st)})")
        check(not e.leftovers(), f"no process left after the failure ({e.leftovers()})")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # A prefill instance that cannot start (its layer partition does not fit the model).
    bad, _ = e.yaml("pfbad", [("d0", 1)], prefills=[("p0", 2, {"layer_partition": [1, 2]})])
    t0 = time.time()
    r = e.tandem("up", "-d", bad, "--timeout", "120", timeout=240)
    check(r.returncode != 0 and "did not come up" in r.stderr and "prefill-p0-" in r.stderr,
          f"a prefill stage that cannot start: up -d exits {r.returncode} in "
          f"{time.time() - t0:.1f} s with the stage's log tail ({r.stderr.strip()[-500:]})")
    st = e.status(bad)
    check(states(st) == ["stopped"] * 4, f"status: all stopped ({states(st)})")
    check(not e.leftovers(), f"no process left behind ({e.leftovers()})")


def popen_script(e, name, argv):
    log = open(os.path.join(e.dir, f"script-{name}.log"), "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=e.env,
                            start_new_session=True)


def wait_pf_ready(e, procs, timeout=120):
    """Until prefill p0's stage 0 answers Health with ready (or a process exits)."""
    end = time.time() + timeout
    while time.time() < end:
        if any(p.poll() is not None for p in procs):
            return False
        h = e.tandem("client", "--url", f"tcp://127.0.0.1:{e.pf_port['p0']}", "--health",
                     timeout=60)
        if "ready 1" in h.stdout:
            return True
        time.sleep(0.3)
    return False


def stop_procs(procs, sig=signal.SIGTERM, timeout=60):
    return stop(procs, sig, timeout, group=True)


def case_prefill_scripts(e):
    if not need_prefill(e):
        return SKIP
    cfg, port = e.yaml("pfsh", [("d0", 1)], prefills=[("p0", 2)])
    d = os.path.join(e.args.source_dir, "deploy")
    procs = {}
    try:
        # stage 1 first (it retries until stage 0 is there), stage 0 last
        procs["p0-1"] = popen_script(e, "p0-1", [f"{d}/start-prefill.sh", cfg, "p0", "1"])
        procs["d0-0"] = popen_script(e, "d0-0", [f"{d}/start-decode.sh", cfg, "d0", "0"])
        procs["router"] = popen_script(e, "router", [f"{d}/start-router.sh", cfg])
        time.sleep(1)
        procs["p0-0"] = popen_script(e, "p0-0", [f"{d}/start-prefill.sh", cfg, "p0", "0"])
        ok = wait_pf_ready(e, procs.values())
        check(ok, f"stage 1 started before stage 0: stage 0 ready "
                  f"({read(os.path.join(e.dir, 'script-p0-0.log')).strip()[-300:]!r})")
        exe = os.path.realpath(e.prefill)
        check(all(os.path.realpath(f"/proc/{procs[k].pid}/exe") == exe for k in ("p0-0", "p0-1")),
              "start-prefill.sh STAGE execs tandem-prefill (the script's pid is the stage's)")
        base = f"http://127.0.0.1:{port}"
        end, hs = time.time() + 60, None
        while time.time() < end and hs != 200:
            try:
                hs = http(base + "/health", timeout=5)[0]
            except OSError:
                hs = None
            time.sleep(0.3)
        if check(hs == 200, "router /health 200 (every process from its start script)"):
            check_completion(base, "start scripts", e)
            prefilled_by(e, os.path.join(e.dir, "script-p0-0.log"), "start scripts")
        order = ["router", "p0-0", "p0-1", "d0-0"]
        codes = stop_procs([procs[k] for k in order])
        check(codes[1:3] == [0, 0], f"SIGTERM: both prefill stages exit 0 ({dict(zip(order, codes))})")
    finally:
        stop_procs(procs.values(), signal.SIGKILL, 10)

    # `all`: every stage of the instance under one script
    p = popen_script(e, "all", [f"{d}/start-prefill.sh", cfg, "p0", "all"])
    try:
        ok = wait_pf_ready(e, [p])
        kids = children(p.pid)
        check(ok and len(kids) == 2, f"start-prefill.sh p0 all: 2 stages, stage 0 ready "
                                     f"({kids} {read(os.path.join(e.dir, 'script-all.log'))[-300:]!r})")
        rc = stop_procs([p])[0]
        check(rc == 0 and not any(running(k) for k in kids),
              f"SIGTERM to the script: every stage stopped, exit {rc}")
    finally:
        stop_procs([p], signal.SIGKILL, 10)
    p = popen_script(e, "all2", [f"{d}/start-prefill.sh", cfg, "p0", "all"])
    try:
        ok = wait_pf_ready(e, [p])
        kids = children(p.pid)
        if check(ok and len(kids) == 2, "start-prefill.sh p0 all (second run): ready"):
            os.kill(kids[-1], signal.SIGKILL)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rc = None
            text = read(os.path.join(e.dir, "script-all2.log"))
            check(rc not in (0, None) and not any(running(k) for k in kids)
                  and "stopping the others" in text,
                  f"a stage killed: the script stops the other and exits {rc} "
                  f"({text.strip()[-200:]!r})")
    finally:
        stop_procs([p], signal.SIGKILL, 10)
    return 0


def sh(*cmd, check_rc=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check_rc and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def case_netns(e):
    if shutil.which("ip") is None:
        print("SKIP netns: no 'ip' command")
        return SKIP
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns_r, ns_d = f"tdr{tag}", f"tdd{tag}"
    probe = subprocess.run(["ip", "netns", "add", ns_r], capture_output=True, text=True)
    if probe.returncode:
        print(f"SKIP netns: 'ip netns add' is not permitted here ({probe.stderr.strip()}); "
              f"run as root to test two hosts")
        return SKIP
    procs = []
    try:
        sh("ip", "netns", "add", ns_d)
        used = sh("ip", "-4", "addr").stdout
        k = next(k for k in random.sample(range(1, 250), 249) if f"10.77.{k}." not in used)
        a, b = f"10.77.{k}", f"10.77.{k}"
        # root <-> router namespace: 10.77.k.1 / .2 ; router <-> decode namespace: .9 / .10
        sh("ip", "link", "add", f"ve{tag}a", "type", "veth", "peer", "name", f"ve{tag}b")
        sh("ip", "link", "set", f"ve{tag}b", "netns", ns_r)
        sh("ip", "addr", "add", f"{a}.1/30", "dev", f"ve{tag}a")
        sh("ip", "link", "set", f"ve{tag}a", "up")
        sh("ip", "-n", ns_r, "addr", "add", f"{a}.2/30", "dev", f"ve{tag}b")
        sh("ip", "-n", ns_r, "link", "set", f"ve{tag}b", "up")
        sh("ip", "link", "add", f"vx{tag}a", "type", "veth", "peer", "name", f"vx{tag}b")
        sh("ip", "link", "set", f"vx{tag}a", "netns", ns_r)
        sh("ip", "link", "set", f"vx{tag}b", "netns", ns_d)
        sh("ip", "-n", ns_r, "addr", "add", f"{b}.9/30", "dev", f"vx{tag}a")
        sh("ip", "-n", ns_d, "addr", "add", f"{b}.10/30", "dev", f"vx{tag}b")
        for ns, dev in ((ns_r, f"vx{tag}a"), (ns_d, f"vx{tag}b")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        cfg, port = e.yaml("twohost", [("d0", 1)], listen_host=f"{a}.2",
                           decode_host=f"{b}.10")
        scripts = os.path.join(e.args.source_dir, "deploy")
        for name, ns, cmd in (("decode", ns_d, ["start-decode.sh", cfg, "d0", "0"]),
                              ("router", ns_r, ["start-router.sh", cfg])):
            log = open(os.path.join(e.dir, f"netns-{name}.log"), "w")
            procs.append((name, subprocess.Popen(
                ["ip", "netns", "exec", ns, os.path.join(scripts, cmd[0]), *cmd[1:]],
                stdout=log, stderr=subprocess.STDOUT, env=e.env, start_new_session=True)))
        base = f"http://{a}.2:{port}"
        end, st = time.time() + 150, None
        while time.time() < end:
            if any(p.poll() is not None for _, p in procs):
                break
            try:
                st = http(base + "/health", timeout=5)[0]
            except OSError:
                st = None
            if st == 200:
                break
            time.sleep(0.3)
        logs = {n: open(os.path.join(e.dir, f"netns-{n}.log")).read()[-500:] for n, _ in procs}
        if check(st == 200, f"two hosts: router {a}.2 (ns {ns_r}) reaches decode {b}.10 "
                            f"(ns {ns_d}): /health 200 from the root namespace ({logs})"):
            check_completion(base, "two hosts", e)
        where = {n: sh("ip", "netns", "identify", str(p.pid), check_rc=False).stdout.strip()
                 for n, p in procs}
        check(where == {"decode": ns_d, "router": ns_r},
              f"each process runs in its own namespace ({where})")
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in (ns_r, ns_d):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"ve{tag}a"], capture_output=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        check(ns_r not in left and ns_d not in left, "namespaces removed")
    return 0


def case_secure(e):
    """The YAML's security section (docs/control-plane.md, "Security"): a missing file stops up
    at once, naming it; with the cluster's certificates (tests/ctrl/make_certs.sh) every control
    socket speaks mutual TLS (router, prefill stages, decode, up's readiness probe, tandem client
    with --tls-*) and a request is served; a client without a certificate, or with another
    CA's, gets no answer and the decode leader logs the refused handshakes. The KV plane's UCX
    uses the loopback device only (the YAML's hosts are 127.0.0.1)."""
    if not need_prefill(e):
        return SKIP
    certs = os.path.join(e.dir, "certs")
    r = subprocess.run(["sh", os.path.join(e.args.source_dir, "tests/ctrl/make_certs.sh"), certs])
    if r.returncode == SKIP:
        print("SKIP: openssl is not installed (Debian package openssl)", flush=True)
        return SKIP
    if not check(r.returncode == 0, "make_certs.sh made the certificates"):
        return

    def pem(n):
        return os.path.join(certs, n)

    cfg, port = e.yaml("sec", [("d0", 1)], prefills=[("p0", 2)])
    base = read(cfg).replace("ucx_tls: posix,cma,self", "ucx_tls: sm,tcp,self")

    def write(ca):
        with open(cfg, "w") as f:
            f.write(base + f"security:\n  ca: {ca}\n  cert: {pem('node.pem')}\n"
                           f"  key: {pem('node.key')}\n")

    write(pem("missing-ca.pem"))
    r = e.tandem("up", "-d", cfg, "--timeout", "60", timeout=120)
    check(r.returncode != 0 and "security.ca: cannot read" in r.stderr
          and "missing-ca.pem" in r.stderr,
          f"a missing security.ca: up fails naming it ({r.returncode} {r.stderr.strip()[-300:]})")
    write(pem("ca.pem"))
    r = e.tandem("up", "-d", cfg, "--timeout", "200", timeout=300)
    if not check(r.returncode == 0, f"up -d with security exits 0 ({r.stderr.strip()[-600:]})"):
        return
    st = e.status(cfg)
    rdir = st["run_dir"] if st else ""
    dlog, plog = (os.path.join(rdir, f"{n}.log") for n in ("decode-d0-0", "prefill-p0-0"))
    check(f"serving on tls+tcp://127.0.0.1:{port + 1}" in read(dlog)
          and "serving on tls+tcp://" in read(plog),
          "decode and prefill leaders serve on tls+tcp://")
    check("kvx ucx: network devices lo " in read(dlog) + read(plog),
          "the KV plane's UCX uses the loopback device (the hosts are 127.0.0.1)")
    check_completion(f"http://127.0.0.1:{port}", "secure", e)
    prefilled_by(e, plog, "secure")
    tls = ["--tls-ca", pem("ca.pem"), "--tls-cert", pem("node.pem"), "--tls-key", pem("node.key")]
    durl = f"tcp://127.0.0.1:{port + 1}"
    g = e.tandem("client", "--url", durl, "--prompt-ids", "1,2,3,4", "--max-tokens", "4", *tls,
                 timeout=120)
    check(g.returncode == 0, f"tandem client with the cluster's certificate is served "
                             f"({g.stdout.strip()} {g.stderr.strip()[-300:]})")
    h = e.tandem("client", "--url", f"tcp://127.0.0.1:{e.pf_port['p0']}", "--health", *tls,
                 timeout=60)
    check(h.returncode == 0 and "ready 1" in h.stdout,
          f"prefill stage 0 answers Health over TLS ({h.stdout.strip()} {h.stderr.strip()})")
    bad = [("no certificate (plain tcp)", []),
           ("another CA's certificate",
            ["--tls-ca", pem("ca.pem"), "--tls-cert", pem("other.pem"), "--tls-key",
             pem("other.key")])]
    for what, extra in bad:
        r = e.tandem("client", "--url", durl, "--health", "--timeout-ms", "3000", *extra,
                     timeout=60)
        check(r.returncode != 0 and "ready" not in r.stdout,
              f"{what}: no answer ({r.returncode} {r.stdout.strip()} {r.stderr.strip()[-200:]})")
    check(wait_for(lambda: "TLS handshake failed" in read(dlog), 15),
          f"the decode leader logs the refused connections "
          f"({[l for l in read(dlog).splitlines() if 'refused' in l][-2:]})")
    r = e.tandem("down", cfg, timeout=120)
    check(r.returncode == 0, f"down exits 0 ({r.stderr.strip()[:300]})")


CASES = {"up_down": case_up_down, "foreground": case_foreground, "bad_model": case_bad_model,
         "bench": case_bench, "netns": case_netns, "prefill_up_down": case_prefill_up_down,
         "prefill_foreground": case_prefill_foreground, "prefill_scripts": case_prefill_scripts,
         "secure": case_secure}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--router", default="")
    ap.add_argument("--prefill", default="")
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    print(f"router: {args.router or 'tests/deploy/fake_router.py (tandem-router not built)'}",
          flush=True)
    if args.router and not os.access(args.router, os.X_OK):
        print(f"FAIL {args.router} is not built (build the tandem-router target)")
        return 1
    e = Env(args)
    t0 = time.time()
    try:
        rc = CASES[args.case](e)
    finally:
        left = e.leftovers()
        e.cleanup()
    check(not left, f"{args.case}: no process left at exit ({left})")
    print(f"{args.case}: {time.time() - t0:.1f} s", flush=True)
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
        return 1
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
