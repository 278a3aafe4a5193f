"""pdlib.py: a disaggregated Tandem cluster for the tests: router + prefill instances
(one process per stage) + decode instances (one process per rank), started from a
generated YAML on loopback, with helpers to kill, restart and inspect each process.
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILS.append(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Cluster:
    """prefill: list of dicts (pp, chunk, ...); decode: list of dicts (tp, ...)."""

    def __init__(self, args, model, prefill, decode, timeout_ms=60000, heartbeat_ms=100,
                 instance_timeout_ms=4000, ucx_tls="sm,tcp,self"):
        self.args, self.model = args, model
        self.dir = tempfile.mkdtemp(prefix="tandem-pd-")
        self.http_port = free_port()
        self.pf, self.dc = prefill, decode
        self.cfg = os.path.join(self.dir, "cluster.yaml")
        with open(self.cfg, "w") as f:
            f.write(f"model: {model}\nrouter:\n  listen: 127.0.0.1:{self.http_port}\n"
                    f"  heartbeat_ms: {heartbeat_ms}\n"
                    f"  instance_timeout_ms: {instance_timeout_ms}\nprefill:\n")
            for i, p in enumerate(prefill):
                p.setdefault("port", free_port())
                f.write(f"  - name: p{i}\n    pp: {p.get('pp', 1)}\n"
                        f"    chunk_size: {p.get('chunk', 64)}\n    threads: 1\n"
                        f"    port: {p['port']}\n    kv_tokens: {p.get('kv_tokens', 4096)}\n"
                        f"    profile_budget_ms: {p.get('profile_ms', 0)}\n")
            f.write("decode:\n")
            for i, d in enumerate(decode):
                d.setdefault("port", free_port())
                f.write(f"  - name: d{i}\n    tp: {d.get('tp', 1)}\n    threads: 1\n"
                        f"    kv_blocks: {d.get('kv_blocks', 512)}\n    port: {d['port']}\n"
                        f"    step_tokens: 64\n")
            f.write(f"kvxfer:\n  ucx_tls: {ucx_tls}\n  timeout_ms: {timeout_ms}\n")
        self.procs = {}
        self.url = f"http://127.0.0.1:{self.http_port}"

    # ---- processes ----
    def _spawn(self, key, argv):
        log = open(os.path.join(self.dir, f"{key}.log"), "a")
        self.procs[key] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def start_stage(self, i, s):
        self._spawn(f"p{i}s{s}", [self.args.prefill, "--config", self.cfg, "--instance", f"p{i}",
                                  "--stage", str(s)])

    def start_rank(self, i, r):
        self._spawn(f"d{i}r{r}", [self.args.decode, "--config", self.cfg, "--instance", f"d{i}",
                                  "--rank", str(r)])

    def start_router(self):
        self._spawn("router", [self.args.router, "--config", self.cfg])

    def kill(self, key, sig=signal.SIGKILL):
        p = self.procs[key]
        p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait()

    def log(self, key):
        try:
            with open(os.path.join(self.dir, f"{key}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self):
        for i, d in enumerate(self.dc):
            for r in range(d.get("tp", 1)):
                self.start_rank(i, r)
        for i, p in enumerate(self.pf):
            for s in range(p.get("pp", 1)):
                self.start_stage(i, s)
        self.start_router()
        self.wait_health()
        return self

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for k, p in self.procs.items():
            try:
                codes[k] = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[k] = p.wait()
        return codes

    def __exit__(self, *exc):
        self.stop()

    # ---- HTTP ----
    def status(self, path):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
            c.close()
            return r.status, body
        except OSError:
            return None, b""

    def wait_health(self, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            if self.status("/health")[0] == 200:
                return True
            if self.procs["router"].poll() is not None:
                raise RuntimeError("router exited: " + self.log("router")[-3000:])
            time.sleep(0.1)
        raise RuntimeError("/health never 200:\n" + self.log("router")[-3000:] +
                           self.log("p0s0")[-2000:] + self.log("d0r0")[-2000:])

    def complete(self, prompt, n=16, timeout=300, **extra):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
        body.update(extra)
        c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        c.request("POST", "/v1/completions", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, {"raw": data.decode(errors="replace")}

    def metrics(self):
        return self.status("/metrics")[1].decode(errors="replace")

    # ---- node health through `tandem client --health` ----
    def health(self, url):
        r = subprocess.run([self.args.tandem, "client", "--url", url, "--health"],
                           capture_output=True, text=True, timeout=30)
        f = r.stdout.split()
        return {f[k]: f[k + 1] for k in range(0, len(f) - 1, 2)}

    def decode_health(self, i=0):
        return self.health(f"tcp://127.0.0.1:{self.dc[i]['port']}")

    def prefill_health(self, i=0):
        return self.health(f"tcp://127.0.0.1:{self.pf[i]['port']}")

    def wait_idle(self, timeout=30):
        """Every instance leader: no request and no KV block held."""
        end = time.time() + timeout
        hs = []
        while time.time() < end:
            hs = [self.decode_health(i) for i in range(len(self.dc))] + \
                 [self.prefill_health(i) for i in range(len(self.pf))]
            if all(h.get("kv_used") == "0" and h.get("running") == "0" and
                   h.get("waiting") == "0" for h in hs):
                return True, hs
            time.sleep(0.2)
        return False, hs


def generate_text(args, model, prompt, n):
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt", prompt,
                        "--max-tokens", str(n), "--temperature", "0", "--threads", "1"],
                       capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr.decode(errors="replace"))
    out = r.stdout.decode("utf-8", errors="replace")
    return out[:-1] if out.endswith("\n") else out  # the CLI ends its output with a newline
