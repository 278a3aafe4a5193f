"""rtlib.py: start a small Tandem cluster (decode instances + tandem-router) for the router
tests, from a generated YAML with random ports; every process is killed on exit.

    with Cluster(args, model) as c:      # waits for GET /health == 200
        c.url                            # http://127.0.0.1:PORT
"""
import atexit
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time

_PROCS = []


def _kill_all():
    for p in _PROCS:
        if p.poll() is None:
            p.kill()
            p.wait()


atexit.register(_kill_all)
signal.signal(signal.SIGTERM, lambda *a: (_kill_all(), os._exit(1)))


FAILS = []  # what failed, for the test's exit status


def check(cond, what):
    """Record one check: print it, remember a failure, go on."""
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILS.append(what)


def free_port():
    while True:
        port = random.randint(20000, 60000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()


class Cluster:
    def __init__(self, args, model, n_decode=1, api_key="", max_queue=256, max_batch=64,
                 kv_blocks=1024, heartbeat_ms=200, instance_timeout_ms=6000, extra_router="",
                 router_env=None):
        self.router_env = router_env
        self.args = args
        self.model = model
        self.dir = tempfile.mkdtemp(prefix="tandem-rt-")
        self.http_port = free_port()
        self.decode_ports = [free_port() for _ in range(n_decode)]
        self.cfg = os.path.join(self.dir, "cluster.yaml")
        with open(self.cfg, "w") as f:
            f.write(f"model: {model}\n"
                    f"router:\n"
                    f"  listen: 127.0.0.1:{self.http_port}\n"
                    f"  api_key: \"{api_key}\"\n"
                    f"  max_queue: {max_queue}\n"
                    f"  heartbeat_ms: {heartbeat_ms}\n"
                    f"  instance_timeout_ms: {instance_timeout_ms}\n{extra_router}"
                    f"decode:\n")
            for i, port in enumerate(self.decode_ports):
                f.write(f"  - name: d{i}\n"
                        f"    tp: 1\n"
                        f"    threads: 1\n"
                        f"    kv_blocks: {kv_blocks}\n"
                        f"    max_batch: {max_batch}\n"
                        f"    step_tokens: 64\n"
                        f"    port: {port}\n")
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.decode = {}
        self.router = None

    def __enter__(self):
        for i in range(len(self.decode_ports)):
            self.start_decode(i)
        self.start_router()
        self.wait_health(200)
        return self

    def __exit__(self, *exc):
        self.stop()

    def _spawn(self, argv, logname, env=None):
        log = open(os.path.join(self.dir, logname), "a")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, **env) if env else None)
        _PROCS.append(p)
        return p

    def start_decode(self, i):
        self.decode[i] = self._spawn([self.args.decode, "--config", self.cfg, "--instance", f"d{i}",
                                      "--rank", "0"], f"d{i}.log")

    def kill_decode(self, i):
        p = self.decode[i]
        p.kill()
        p.wait()

    def start_router(self):
        self.router = self._spawn([self.args.router, "--config", self.cfg], "router.log",
                                  self.router_env)

    def log(self, name="router.log"):
        with open(os.path.join(self.dir, name), errors="replace") as f:
            return f.read()[-4000:]

    def status(self, path):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            return r.status
        except OSError:
            return None

    def wait_health(self, want, timeout=180):
        end = time.time() + timeout
        while time.time() < end:
            if self.status("/health") == want:
                return
            if self.router.poll() is not None:
                raise RuntimeError("router exited: " + self.log())
            time.sleep(0.1)
        raise RuntimeError(f"/health never answered {want}: " + self.log() + self.log("d0.log"))

    def kv_used(self, i=0):
        r = subprocess.run([self.args.tandem, "client", "--url",
                            f"tcp://127.0.0.1:{self.decode_ports[i]}", "--health"],
                           capture_output=True, text=True, timeout=60)
        f = r.stdout.split()
        d = {f[k]: f[k + 1] for k in range(0, len(f) - 1, 2)}
        return int(d.get("kv_used", -1))

    def stop(self):
        procs = ([self.router] if self.router else []) + list(self.decode.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rc = self.router.returncode if self.router else 0
        return rc


def post(port, path, body, headers=None, timeout=120):
    """One request on a fresh connection: (status, headers dict, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = body if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
    c.request("POST", path, data, h)
    r = c.getresponse()
    out = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, out


def generate_text(args, model, prompt, n, chat=False):
    """`tandem generate --temperature 0` text for a prompt (or a chat message)."""
    r = subprocess.run([args.tandem, "generate", "--model", model, "--chat" if chat else "--prompt",
                        prompt, "--max-tokens", str(n), "--temperature", "0", "--threads", "1"],
                       capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr.decode(errors="replace"))
    return r.stdout.decode("utf-8", errors="replace")
