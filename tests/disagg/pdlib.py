"""pdlib.py: a disaggregated Tandem cluster for the tests: router + prefill instances
(one process per stage) + decode instances (one process per rank), started from a
generated YAML on loopback, with helpers to kill, restart and inspect each process.
"""
import http.client
import json
import os
import signal
import tempfile

from tdtest.cluster import client_health, generate_text as _generate_text, write_yaml
from tdtest.ports import free_port
from tdtest.procs import Procs
from tdtest.waits import get_status, wait_for, wait_http


class Cluster:
    """prefill: list of dicts (pp, chunk, ...); decode: list of dicts (tp, ...; dp: the YAML
    entry d{i} is a data-parallel group whose members d{i}.{k} run one process each, at the
    entry's port + k)."""

    def __init__(self, args, model, prefill, decode, timeout_ms=60000, heartbeat_ms=100,
                 instance_timeout_ms=4000, ucx_tls="sm,tcp,self", routing=None):
        self.args, self.model = args, model
        self.dir = tempfile.mkdtemp(prefix="tandem-pd-")
        self.http_port = free_port()
        self.pf, self.dc = prefill, decode
        for p in prefill + decode:
            p.setdefault("port", free_port())
        self.cfg = write_yaml(os.path.join(self.dir, "cluster.yaml"), {
            "model": model,
            "router": {"listen": f"127.0.0.1:{self.http_port}", "heartbeat_ms": heartbeat_ms,
                       "instance_timeout_ms": instance_timeout_ms,
                       **({"routing": routing} if routing else {})},
            "prefill": [{"name": f"p{i}", "pp": p.get("pp", 1), "chunk_size": p.get("chunk", 64),
                         "threads": 1, "port": p["port"], "kv_tokens": p.get("kv_tokens", 4096),
                         "profile_budget_ms": p.get("profile_ms", 0),
                         **{k: p[k] for k in ("prefix_cache", "prefix_cache_mb") if k in p}}
                        for i, p in enumerate(prefill)],
            "decode": [{"name": f"d{i}", "tp": d.get("tp", 1), "threads": 1,
                        "kv_blocks": d.get("kv_blocks", 512), "port": d["port"],
                        "step_tokens": 64,
                        **{k: d[k] for k in ("prefix_cache", "kv_dtype", "overlap", "ep", "dp",
                                             "share_cores", "itl_target_ms", "speculative",
                                             "tbo_min_tokens")
                           if k in d}}
                       for i, d in enumerate(decode)],
            "kvxfer": {"ucx_tls": ucx_tls, "timeout_ms": timeout_ms}})
        self.ps = Procs(self.dir)
        self.procs = self.ps.procs
        self.url = f"http://127.0.0.1:{self.http_port}"

    # ---- processes ----
    def start_stage(self, i, s):
        self.ps.spawn(f"p{i}s{s}", [self.args.prefill, "--config", self.cfg, "--instance",
                                    f"p{i}", "--stage", str(s)])

    def decode_names(self, i):
        """The instances of decode entry i: d{i}, or its dp group's members."""
        dp = self.dc[i].get("dp", 1)
        return [f"d{i}"] if dp == 1 else [f"d{i}.{k}" for k in range(dp)]

    def start_rank(self, i, r, name=None):
        name = name or f"d{i}"
        self.ps.spawn(f"{name}r{r}", [self.args.decode, "--config", self.cfg, "--instance",
                                      name, "--rank", str(r)])

    def start_router(self):
        self.ps.spawn("router", [self.args.router, "--config", self.cfg])

    def kill(self, key, sig=signal.SIGKILL):
        self.ps.kill(key, sig)

    def log(self, key):
        return self.ps.log(key)

    def __enter__(self):
        for i, d in enumerate(self.dc):
            for name in self.decode_names(i):
                for r in range(d.get("tp", 1)):
                    self.start_rank(i, r, name)
        for i, p in enumerate(self.pf):
            for s in range(p.get("pp", 1)):
                self.start_stage(i, s)
        self.start_router()
        self.wait_health()
        return self

    def stop(self):
        return self.ps.stop(timeout=30)

    def __exit__(self, *exc):
        self.stop()

    # ---- HTTP ----
    def status(self, path):
        return get_status(self.http_port, path)

    def wait_health(self, timeout=120):
        ok = wait_http(self.http_port, 200, timeout, proc=self.procs["router"])
        if ok is None:
            raise RuntimeError("router exited: " + self.log("router")[-3000:])
        if not ok:
            raise RuntimeError("/health never 200:\n" + self.log("router")[-3000:] +
                               self.log("p0s0")[-2000:] + self.log("d0r0")[-2000:])
        return True

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
        return client_health(self.args.tandem, url, timeout=30)

    def decode_health(self, i=0, k=0):
        return self.health(f"tcp://127.0.0.1:{self.dc[i]['port'] + k}")

    def prefill_health(self, i=0):
        return self.health(f"tcp://127.0.0.1:{self.pf[i]['port']}")

    def wait_idle(self, timeout=30):
        """Every instance leader: no request and no KV block held."""
        hs = []

        def idle():
            hs[:] = [self.decode_health(i, k) for i in range(len(self.dc))
                     for k in range(len(self.decode_names(i)))] + \
                    [self.prefill_health(i) for i in range(len(self.pf))]
            return all(h.get("kv_used") == "0" and h.get("running") == "0" and
                       h.get("waiting") == "0" for h in hs)
        return wait_for(idle, timeout, step=0.2, last_look=False), hs


def generate_text(args, model, prompt, n):
    return _generate_text(args.tandem, model, prompt, n, strip_newline=True)
