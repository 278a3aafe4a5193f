"""rtlib.py: start a small Tandem cluster (decode instances + tandem-router) for the router
tests, from a generated YAML with random ports; every process is killed on exit.

    with Cluster(args, model) as c:      # waits for GET /health == 200
        c.url                            # http://127.0.0.1:PORT
"""
import atexit
import http.client
import json
import os
import signal
import tempfile

from tdtest.cluster import client_health, generate_text as _generate_text, write_yaml
from tdtest.ports import free_port
from tdtest.procs import spawn, stop
from tdtest.waits import get_status, wait_http

_PROCS = []


def _kill_all():
    for p in _PROCS:
        if p.poll() is None:
            p.kill()
            p.wait()


atexit.register(_kill_all)
signal.signal(signal.SIGTERM, lambda *a: (_kill_all(), os._exit(1)))


class Cluster:
    def __init__(self, args, model, n_decode=1, api_key="", max_queue=256, max_batch=64,
                 kv_blocks=1024, heartbeat_ms=200, instance_timeout_ms=6000, router_extra=None,
                 router_env=None, decode_extra=None):
        """router_extra: more router fields ({name: value}, after the others); decode_extra:
        more fields of every decode instance."""
        self.router_env = router_env
        self.args = args
        self.model = model
        self.dir = tempfile.mkdtemp(prefix="tandem-rt-")
        self.http_port = free_port()
        self.decode_ports = [free_port() for _ in range(n_decode)]
        self.cfg = write_yaml(os.path.join(self.dir, "cluster.yaml"), {
            "model": model,
            "router": {"listen": f"127.0.0.1:{self.http_port}", "api_key": json.dumps(api_key),
                       "max_queue": max_queue, "heartbeat_ms": heartbeat_ms,
                       "instance_timeout_ms": instance_timeout_ms, **(router_extra or {})},
            "decode": [{"name": f"d{i}", "tp": 1, "threads": 1, "kv_blocks": kv_blocks,
                        "max_batch": max_batch, "step_tokens": 64, "port": port,
                        **(decode_extra or {})}
                       for i, port in enumerate(self.decode_ports)]})
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
        p = spawn(argv, os.path.join(self.dir, logname),
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
        return get_status(self.http_port, path)[0]

    def wait_health(self, want, timeout=180):
        ok = wait_http(self.http_port, want, timeout, proc=self.router)
        if ok is None:
            raise RuntimeError("router exited: " + self.log())
        if not ok:
            raise RuntimeError(f"/health never answered {want}: " + self.log() +
                               self.log("d0.log"))

    def kv_used(self, i=0):
        d = client_health(self.args.tandem, f"tcp://127.0.0.1:{self.decode_ports[i]}",
                          timeout=60)
        return int(d.get("kv_used", -1))

    def stop(self):
        procs = ([self.router] if self.router else []) + list(self.decode.values())
        stop(procs, timeout=30)
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
    return _generate_text(args.tandem, model, prompt, n, chat=chat)
