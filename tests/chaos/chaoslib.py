"""chaoslib.py: what the chaos suite (tests/chaos/test_chaos.py) drives and observes.

    cl = ChaosCluster(args, tp=2)          # YAML: router + prefill p0 (pp 2) + decode d0 (tp 2)
    cl.up()                                # tandem up -d (the detached supervisor)
    cl.pid("prefill-p0-1")                 # (pid, restarts) from the run directory's pid file
    cl.wait_restarted("router-router-0", old_pid, 60)   # the supervisor started a new one
    cl.idle(30)                            # no leak on any survivor (health + router /metrics)
    cl.down()

    load = Load(host, port, model, concurrency=4, deadline_s=30)
    load.start(); ...; load.stop()         # stop() waits for every request in flight
    load.results                           # [Result]: t0, t1, outcome, detail, stream

Outcomes of one request (Result.outcome):
    ok       200 with a complete answer (JSON with a finish_reason, or SSE ending in [DONE])
    error    a clear error: an HTTP error status with an OpenAI error object, or an SSE error
             event followed by [DONE]
    refused  the connection was refused (nothing listens: the router is down)
    cut      the connection broke mid-answer without an error (the router process died)
    hung     no end within the request's deadline (the client gave up)
    bad      anything else (malformed answer)
    dropped  the client closed the connection on purpose (drop_clients)
"""
import http.client
import json
import os
import random
import socket
import struct
import subprocess
import threading
import time
import traceback

from tdtest.cluster import UpCluster, client_health, parse_metrics, yaml_text
from tdtest.ports import free_port
from tdtest.procs import alive, read

OK, ERROR, REFUSED, CUT, HUNG, BAD, DROPPED = ("ok", "error", "refused", "cut", "hung", "bad",
                                              "dropped")


def chaos_yaml(model, run_dir, listen, router_port, pf_hosts, pf_port, dc_host, dc_port, tp,
               ucx_tls, xfer_timeout_ms, instance_timeout_ms=2000, pp=2, request_timeout_ms=30000,
               colocated=False, kv_dtype=None, router_extra=None):
    """The cluster YAML: the router's own deadline per request (request_timeout_ms, 504 past
    it) is below the clients' (--deadline), so a request that hangs inside the cluster is
    the router's failure to answer, not the client's impatience. colocated: no prefill
    instance (the decode instance prefills). kv_dtype: decode[].kv_dtype (None: the default).
    router_extra: more router keys (e.g. migrate_wait_ms)."""
    doc = {"model": model, "run_dir": run_dir,
           "router": {"listen": f"{listen}:{router_port}", "heartbeat_ms": 100,
                      "instance_timeout_ms": instance_timeout_ms,
                      "request_timeout_ms": request_timeout_ms, "drain_timeout_ms": 5000,
                      **(router_extra or {})}}
    if not colocated:
        doc["prefill"] = [{"name": "p0", "pp": pp, "chunk_size": 64, "threads": 1,
                           "hosts": list(pf_hosts[:pp]), "port": pf_port, "kv_tokens": 4096,
                           "profile_budget_ms": 0}]
    doc["decode"] = [{"name": "d0", "tp": tp, "threads": 1, "host": dc_host, "port": dc_port,
                      "kv_blocks": 256, "max_batch": 16}]
    if kv_dtype:
        doc["decode"][0]["kv_dtype"] = kv_dtype
    doc["kvxfer"] = {"ucx_tls": ucx_tls, "timeout_ms": xfer_timeout_ms}
    return yaml_text(doc)


class ChaosCluster(UpCluster):
    """A disaggregated cluster on loopback under `tandem up -d`: router, prefill p0 (pp 2,
    synthetic model, fixed chunks of 64) and decode d0 (tp ranks). TANDEM_BIN points at a
    temp dir of symlinks, so every process's command line names the temp dir (leftovers)."""

    def __init__(self, args, model, tp=2, xfer_timeout_ms=10000, env_extra=None, pp=2,
                 colocated=False, request_timeout_ms=30000, kv_dtype=None,
                 instance_timeout_ms=2000, router_extra=None):
        super().__init__(args.tandem, "tandem-chaos-",
                         {"decode": args.decode, "prefill": args.prefill,
                          "router": args.router}, exclude="test_chaos", env_extra=env_extra)
        self.args = args
        self.tp = tp
        self.pp = 0 if colocated else pp
        self.port = free_port(1)
        self.dc_port = free_port(1)
        self.pf_port = free_port(1)
        self.host = "127.0.0.1"
        self.cfg = os.path.join(self.dir, "chaos.yaml")
        with open(self.cfg, "w") as f:
            f.write(chaos_yaml(model, f"{self.dir}/run", "127.0.0.1", self.port,
                               ["127.0.0.1", "127.0.0.1"], self.pf_port, "127.0.0.1",
                               self.dc_port, tp, "posix,cma,self", xfer_timeout_ms,
                               instance_timeout_ms=instance_timeout_ms, pp=pp,
                               colocated=colocated, request_timeout_ms=request_timeout_ms,
                               kv_dtype=kv_dtype, router_extra=router_extra))
        self.rdir = self.run_dir("chaos")

    # --- processes, from the pid files ("PID STARTTIME RESTARTS", docs/deploy.md) -----------
    def keys(self):
        return ([f"decode-d0-{r}" for r in range(self.tp)] +
                [f"prefill-p0-{s}" for s in range(self.pp)] + ["router-router-0"])

    def pid(self, key):
        return self.pid_file(self.rdir, key)

    def wait_restarted(self, key, old_pid, timeout):
        """Time at which the pid file names a live process other than old_pid, or None."""
        end = time.time() + timeout
        while time.time() < end:
            pid, _ = self.pid(key)
            if pid and pid != old_pid and alive(pid):
                return time.time()
            time.sleep(0.05)
        return None

    def all_running(self):
        return all(self.pid(k)[0] and alive(self.pid(k)[0]) for k in self.keys())

    def log(self, key):
        return read(os.path.join(self.rdir, key + ".log"))

    def logs(self):
        return self.logs_of(self.rdir)

    # --- observation --------------------------------------------------------------------
    def client_health(self, url, ns=None):
        return client_health(self.args.tandem, url, env=self.env, ns=ns, typed=True)

    def decode_health(self):
        return self.client_health(f"tcp://{self.dc_host_for_client()}:{self.dc_port}",
                                  self.dc_ns())

    def prefill_health(self):
        return self.client_health(f"tcp://{self.pf_host_for_client()}:{self.pf_port}",
                                  self.pf_ns())

    def dc_host_for_client(self):
        return "127.0.0.1"

    def pf_host_for_client(self):
        return "127.0.0.1"

    def dc_ns(self):
        return None

    def pf_ns(self):
        return None

    def metrics(self):
        c = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            c.request("GET", "/metrics")
            r = c.getresponse()
            body = r.read().decode(errors="replace")
            return parse_metrics(body) if r.status == 200 else None
        finally:
            c.close()

    def leaks(self):
        """(clean, description): every survivor idle and registered: decode and prefill
        leaders say kv_used 0, running 0, waiting 0 (prefill: ready 1); the router's gauges
        say nothing queued or running, no KV block used, both instances up."""
        bad = []
        dh = self.decode_health()
        ph = self.prefill_health() if self.pp else None
        for name, h in (("decode d0", dh), ("prefill p0", ph)):
            if name == "prefill p0" and not self.pp:
                continue  # colocated
            if h is None:
                bad.append(f"{name}: no health answer")
                continue
            for k in ("kv_used", "running", "waiting"):
                if h.get(k) != 0:
                    bad.append(f"{name} {k} {h.get(k)}")
        if ph is not None and ph.get("ready") != 1:
            bad.append(f"prefill p0 ready {ph.get('ready')}")
        try:
            m = self.metrics()
        except (OSError, http.client.HTTPException) as e:
            m = None
            bad.append(f"router /metrics: {e}")
        if m is not None:
            want = {("tandem_router_queue_length", ()): 0,
                    ("tandem_router_requests_running", ()): 0,
                    ("tandem_instance_up", (("instance", "d0"),)): 1,
                    ("tandem_instance_running", (("instance", "d0"),)): 0,
                    ("tandem_instance_waiting", (("instance", "d0"),)): 0,
                    ("tandem_instance_kv_blocks_used", (("instance", "d0"),)): 0}
            if self.pp:
                want.update({
                    ("tandem_prefill_instance_up", (("instance", "p0"),)): 1,
                    ("tandem_prefill_instance_requests", (("instance", "p0"),)): 0,
                    ("tandem_prefill_instance_running", (("instance", "p0"),)): 0,
                    ("tandem_prefill_instance_waiting", (("instance", "p0"),)): 0,
                    ("tandem_prefill_instance_queued_prompt_tokens", (("instance", "p0"),)): 0})
            for k, v in want.items():
                if m.get(k) != v:
                    bad.append(f"router {k[0]}{dict(k[1]) or ''} {m.get(k)} (want {v})")
        elif not bad:
            bad.append("router /metrics: no answer")
        return not bad, "; ".join(bad) or (f"decode {dh}, prefill {ph}")

    def idle(self, timeout):
        """(clean, seconds, description): waits until leaks() is clean."""
        t0 = time.time()
        clean, desc = False, ""
        while True:
            try:
                clean, desc = self.leaks()
            except (OSError, subprocess.TimeoutExpired, ValueError) as e:
                clean, desc = False, f"{type(e).__name__}: {e}"
            if clean or time.time() - t0 > timeout:
                return clean, time.time() - t0, desc
            time.sleep(0.3)

    def cleanup(self, keep=False):
        """Kills what is left of this test's processes (by pid) and removes the temp dir."""
        super().cleanup(keep, shm=(f"/dev/shm/tandem-d0-p{self.dc_port}",))


# --- load --------------------------------------------------------------------------------------
class Result:
    __slots__ = ("t0", "t1", "outcome", "detail", "stream", "status")

    def __init__(self, stream):
        self.t0 = time.time()
        self.t1 = 0.0
        self.outcome = BAD
        self.detail = ""
        self.stream = stream
        self.status = None


def error_object(data):
    try:
        e = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    return e if isinstance(e, dict) and e.get("message") else None


def abort(conn, rst):
    """Closes the client side: RST (SO_LINGER 0) or FIN."""
    s = conn.sock
    if s is not None:
        try:
            if rst:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass
    conn.close()


def one_request(host, port, body, deadline_s, drop_after=None, rst=False):
    """Sends one /v1/completions request and classifies how it ended (module docstring).
    drop_after: close the connection after that many SSE events (0: right after sending)."""
    res = Result(bool(body.get("stream")))
    end = res.t0 + deadline_s
    conn = http.client.HTTPConnection(host, port, timeout=deadline_s)
    try:
        try:
            conn.connect()
        except ConnectionRefusedError as e:
            res.outcome, res.detail = REFUSED, str(e)
            return res
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        if drop_after == 0:
            abort(conn, rst)
            res.outcome, res.detail = DROPPED, "before the answer"
            return res
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            data = resp.read()
            e = error_object(data)
            res.outcome = ERROR if e and resp.status >= 400 else BAD
            res.detail = f"{resp.status} {(e or {}).get('message', data[:200])}"
            return res
        if not res.stream:
            data = resp.read()
            try:
                r = json.loads(data)
                fin = r["choices"][0]["finish_reason"]
            except (ValueError, KeyError, IndexError, TypeError):
                res.outcome, res.detail = BAD, f"200 without a completion: {data[:200]!r}"
                return res
            res.outcome = OK if fin in ("stop", "length") else BAD
            res.detail = f"finish_reason {fin}"
            return res
        n, err = 0, None
        while True:
            if drop_after is not None and n >= drop_after:
                abort(conn, rst)
                res.outcome, res.detail = DROPPED, f"after {n} events"
                return res
            if conn.sock:
                conn.sock.settimeout(max(0.05, end - time.time()))
            line = resp.readline()
            if not line:
                res.outcome, res.detail = CUT, f"stream ended without [DONE] after {n} events"
                return res
            if not line.strip():
                continue
            if not line.startswith(b"data: "):
                res.outcome, res.detail = BAD, f"bad SSE line {line[:100]!r}"
                return res
            payload = line[6:].strip()
            n += 1
            if payload == b"[DONE]":
                if err:
                    res.outcome, res.detail = ERROR, f"SSE error event: {err}"
                else:
                    res.outcome, res.detail = OK, f"{n} events"
                return res
            ev = json.loads(payload)
            if "error" in ev:
                err = (ev["error"] or {}).get("message", payload[:200])
    except socket.timeout:
        res.outcome, res.detail = HUNG, f"no end within the {deadline_s:.0f} s deadline"
        return res
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        res.outcome, res.detail = CUT, f"{type(e).__name__}: {e}"
        return res
    except ValueError as e:
        res.outcome, res.detail = BAD, f"{type(e).__name__}: {e}"
        return res
    finally:
        res.t1 = time.time()
        conn.close()
        if res.outcome != HUNG and res.t1 - res.t0 > deadline_s + 1:
            res.detail = f"ended after {res.t1 - res.t0:.1f} s, past the deadline ({res.detail})"
            res.outcome = HUNG


def random_body(rng, model):
    """A /v1/completions body: token-id prompt (mostly short, some over several 64-token
    chunks), 4..24 tokens, greedy, streamed half of the time."""
    n = rng.randint(4, 60) if rng.random() < 0.7 else rng.randint(61, 300)
    body = {"prompt": [rng.randrange(100, 500) for _ in range(n)],
            "max_tokens": rng.randint(4, 24), "temperature": 0}
    if model:
        body["model"] = model
    if rng.random() < 0.5:
        body["stream"] = True
    return body


class Load:
    """Steady load: `concurrency` threads, each sending one request at a time (a short pause
    after a failed one, so a down router is not hammered) until stop()."""

    def __init__(self, host, port, model, concurrency, deadline_s, seed):
        self.host, self.port, self.model = host, port, model
        self.concurrency, self.deadline_s, self.seed = concurrency, deadline_s, seed
        self.results = []
        self.mu = threading.Lock()
        self.halt = threading.Event()
        self.crashes = []
        self.threads = []

    def worker(self, i):
        rng = random.Random(self.seed * 1000 + i)
        try:
            while not self.halt.is_set():
                r = one_request(self.host, self.port, random_body(rng, self.model),
                                self.deadline_s)
                with self.mu:
                    self.results.append(r)
                if r.outcome != OK:
                    self.halt.wait(0.05)
        except Exception:  # a bug in the test itself: reported, not swallowed
            self.crashes.append(traceback.format_exc())

    def start(self):
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True)
                        for i in range(self.concurrency)]
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        """Stops issuing and waits for the requests in flight (each bounded by its deadline).
        Returns the threads still running after that bound (a hang in the client)."""
        self.halt.set()
        end = time.time() + self.deadline_s + 10
        for t in self.threads:
            t.join(max(0.1, end - time.time()))
        return [t for t in self.threads if t.is_alive()]

    def first_ok_after(self, t):
        """End time of the first successful request sent at or after t, or None."""
        with self.mu:
            ends = [r.t1 for r in self.results if r.outcome == OK and r.t0 >= t]
        return min(ends) if ends else None

    def wait_ok_after(self, t, timeout):
        end = time.time() + timeout
        while time.time() < end:
            got = self.first_ok_after(t)
            if got:
                return got
            time.sleep(0.05)
        return None

    def snapshot(self):
        with self.mu:
            return list(self.results)


def drop_clients(host, port, model, n, seed, deadline_s):
    """n streaming requests (long answers) whose client goes away: right after sending, or
    after 1..6 SSE events; half by FIN, half by RST. Returns their Results."""
    rng = random.Random(seed)
    out = []
    mu = threading.Lock()

    def run(i):
        body = {"prompt": [rng.randrange(100, 500) for _ in range(rng.randint(8, 200))],
                "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        if model:
            body["model"] = model
        r = one_request(host, port, body, deadline_s, drop_after=0 if i % 4 == 0 else 1 + i % 6,
                        rst=i % 2 == 1)
        with mu:
            out.append(r)

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(deadline_s + 10)
    return out


def model_name(host, port):
    try:
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/v1/models")
        return json.loads(c.getresponse().read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException):
        return None
    finally:
        c.close()
