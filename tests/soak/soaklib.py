"""soaklib.py: the cluster side of the soak test (tests/soak/test_soak.py).

    cl = SoakCluster(args, model, decodes=[("d0", 1)], prefills=[("p0", 2)])
    cl.up()                  # tandem up -d on a generated YAML (random ports, temp run dir)
    cl.procs                 # [{"role","instance","rank","pid","log"}] from tandem status --json
    cl.metrics()             # the router's /metrics as {(name, labels): value}
    cl.instance_health(i)    # tandem client --url tcp://127.0.0.1:PORT --health, as a dict
    cl.prefill_health(i)     # the same for prefill instance i (its stage 0)
    cl.down()                # tandem down; then cl.leftovers() lists what is still running
    cl.cleanup()             # kills whatever mentions the temp dir, removes it

Every process is started by `tandem up -d` with TANDEM_BIN pointing at a temp bin dir of
symlinks (tandem-decode, tandem-router, tandem-prefill), so its command line names the temp
dir and leftovers() finds it even if the pid files are gone. With prefill instances the
cluster is disaggregated (every request is prefilled by a prefill instance, KV over shared
memory as in deploy/local.yaml); without, the decode instances prefill their own prompts.
"""
import http.client
import os
import random

from tdtest.cluster import UpCluster, client_health, parse_metrics
from tdtest.ports import free_port


class SoakCluster(UpCluster):
    def __init__(self, args, model, decodes, kv_blocks=256, max_batch=16, step_tokens=128,
                 threads=1, env_extra=None, prefills=()):
        super().__init__(args.tandem, "tandem-soak-",
                         {"decode": args.decode, "router": args.router,
                          "prefill": args.prefill if prefills else None},
                         exclude="test_soak", env_extra=env_extra)
        self.args = args
        self.model = model
        # unique instance names: the decode node's shm segment is /dev/shm/tandem-NAME-pPORT
        tag = f"{os.getpid() % 100000}{random.randrange(1000)}"
        self.decodes = [(f"soak{tag}{name}", tp) for name, tp in decodes]
        self.prefills = [(f"soak{tag}{name}", pp) for name, pp in prefills]
        self.port = free_port(1 + len(decodes) + len(prefills))
        self.decode_ports = [self.port + 1 + i for i in range(len(decodes))]
        self.prefill_ports = [self.port + 1 + len(decodes) + i for i in range(len(prefills))]
        self.url = f"http://127.0.0.1:{self.port}"
        doc = {"model": model, "run_dir": f"{self.dir}/run",
               "router": {"listen": f"127.0.0.1:{self.port}", "heartbeat_ms": 100,
                          "instance_timeout_ms": 10000},
               "decode": [{"name": name, "tp": tp, "threads": threads, "kv_blocks": kv_blocks,
                           "max_batch": max_batch, "step_tokens": step_tokens,
                           "port": self.decode_ports[i]}
                          for i, (name, tp) in enumerate(self.decodes)]}
        if prefills:
            doc["prefill"] = [{"name": name, "pp": pp, "threads": threads, "chunk_size": 128,
                               "kv_tokens": 8192, "max_queue": 64, "profile_budget_ms": 0,
                               # the prefix cache touches its pages as it fills up to its
                               # budget: a small one is full within the warm-up, so growth
                               # after it is a leak, not the cache filling
                               "prefix_cache_mb": 8,
                               "port": self.prefill_ports[i]}
                              for i, (name, pp) in enumerate(self.prefills)]
            # one host: shared memory only, as deploy/local.yaml
            doc["kvxfer"] = {"ucx_tls": "posix,cma,self", "timeout_ms": 60000}
        self.write_config("soak.yaml", doc)
        self.procs = []

    def up(self, timeout=240):
        r = super().up(timeout)
        if r.returncode == 0:
            st = self.status()
            self.procs = st["processes"] if st else []
        return r

    def shm_names(self):
        return [f"/dev/shm/tandem-{name}-p{port}"
                for (name, _), port in zip(self.decodes, self.decode_ports)]

    def logs(self, tail=3000):
        return self.logs_of(self.run_dir("soak"), tail)

    def cleanup(self, keep=False):
        """Kills every leftover (only processes of this test's temp dir, by pid)."""
        super().cleanup(keep, shm=self.shm_names())

    # --- observation -------------------------------------------------------------------------
    def label(self, p):
        if p["role"] == "router":
            return "router"
        short = p['instance'][len('soak'):].lstrip('0123456789')
        return f"{short}.{'s' if p['role'] == 'prefill' else 'r'}{p['rank']}"

    def metrics(self, timeout=30):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request("GET", "/metrics")
            r = c.getresponse()
            body = r.read().decode(errors="replace")
            return parse_metrics(body) if r.status == 200 else None
        finally:
            c.close()

    def instance_health(self, i, timeout=60, port=None):
        return client_health(self.args.tandem,
                             f"tcp://127.0.0.1:{port or self.decode_ports[i]}",
                             timeout=timeout, env=self.env, typed=True)

    def prefill_health(self, i, timeout=60):
        return self.instance_health(0, timeout, port=self.prefill_ports[i])

    def http_get(self, path, timeout=30):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

