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
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port(n=1):
    """A port p such that p .. p+n-1 are all free on loopback right now."""
    while True:
        base = random.randint(20000, 59000)
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def proc_status(pid):
    """The kB fields of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile, RssShmem, ...) and
    'State'; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        v = v.strip()
        if k == "State":
            out["State"] = v.split()[0]
        elif v.endswith(" kB"):
            out[k] = int(v[:-3])
    return out


def alive(pid):
    st = proc_status(pid)
    return st is not None and st.get("State") not in ("Z", "X")


_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            pass
    return out


class SoakCluster:
    def __init__(self, args, model, decodes, kv_blocks=256, max_batch=16, step_tokens=128,
                 threads=1, env_extra=None, prefills=()):
        self.args = args
        self.model = model
        self.dir = tempfile.mkdtemp(prefix="tandem-soak-")
        self.bin = os.path.join(self.dir, "bin")
        os.mkdir(self.bin)
        os.symlink(os.path.abspath(args.decode), os.path.join(self.bin, "tandem-decode"))
        os.symlink(os.path.abspath(args.router), os.path.join(self.bin, "tandem-router"))
        if prefills:
            os.symlink(os.path.abspath(args.prefill), os.path.join(self.bin, "tandem-prefill"))
        self.env = dict(os.environ, TANDEM_BIN=self.bin, **(env_extra or {}))
        # unique instance names: the decode node's shm segment is /dev/shm/tandem-NAME-pPORT
        tag = f"{os.getpid() % 100000}{random.randrange(1000)}"
        self.decodes = [(f"soak{tag}{name}", tp) for name, tp in decodes]
        self.prefills = [(f"soak{tag}{name}", pp) for name, pp in prefills]
        self.port = free_port(1 + len(decodes) + len(prefills))
        self.decode_ports = [self.port + 1 + i for i in range(len(decodes))]
        self.prefill_ports = [self.port + 1 + len(decodes) + i for i in range(len(prefills))]
        self.url = f"http://127.0.0.1:{self.port}"
        lines = [f"model: {model}", f"run_dir: {self.dir}/run", "router:",
                 f"  listen: 127.0.0.1:{self.port}", "  heartbeat_ms: 100",
                 "  instance_timeout_ms: 10000", "decode:"]
        for i, (name, tp) in enumerate(self.decodes):
            lines += [f"  - name: {name}", f"    tp: {tp}", f"    threads: {threads}",
                      f"    kv_blocks: {kv_blocks}", f"    max_batch: {max_batch}",
                      f"    step_tokens: {step_tokens}", f"    port: {self.decode_ports[i]}"]
        if prefills:
            lines.append("prefill:")
        for i, (name, pp) in enumerate(self.prefills):
            lines += [f"  - name: {name}", f"    pp: {pp}", f"    threads: {threads}",
                      "    chunk_size: 128", "    kv_tokens: 8192", "    max_queue: 64",
                      "    profile_budget_ms: 0", f"    port: {self.prefill_ports[i]}"]
        if prefills:  # one host: shared memory only, as deploy/local.yaml
            lines += ["kvxfer:", "  ucx_tls: posix,cma,self", "  timeout_ms: 60000"]
        self.cfg = os.path.join(self.dir, "soak.yaml")
        with open(self.cfg, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.procs = []

    # --- tandem CLI ------------------------------------------------------------------------
    def tandem(self, *a, timeout=300):
        return subprocess.run([self.args.tandem, *a], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def status(self):
        r = self.tandem("status", self.cfg, "--json", timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def up(self, timeout=240):
        r = self.tandem("up", "-d", self.cfg, "--timeout", str(timeout), timeout=timeout + 60)
        if r.returncode == 0:
            st = self.status()
            self.procs = st["processes"] if st else []
        return r

    def down(self, grace=30):
        return self.tandem("down", self.cfg, "--grace", str(grace), timeout=grace * 3 + 60)

    def shm_names(self):
        return [f"/dev/shm/tandem-{name}-p{port}"
                for (name, _), port in zip(self.decodes, self.decode_ports)]

    def leftovers(self):
        """Live processes whose command line mentions the temp dir (the test itself aside)."""
        found = []
        me = os.getpid()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if self.dir in cmd and "test_soak" not in cmd and alive(pid):
                found.append((int(pid), cmd.replace("\0", " ")[:120]))
        return found

    def logs(self, tail=3000):
        out = {}
        rdir = os.path.join(self.dir, "run", "soak")
        if os.path.isdir(rdir):
            for n in sorted(os.listdir(rdir)):
                if n.endswith(".log"):
                    with open(os.path.join(rdir, n), errors="replace") as f:
                        out[n] = f.read()[-tail:] if tail else f.read()
        return out

    def cleanup(self, keep=False):
        """Kills every leftover (only processes of this test's temp dir, by pid)."""
        for pid, _ in self.leftovers():
            for fn in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    fn()
                except OSError:
                    pass
        for path in self.shm_names():
            try:
                os.unlink(path)
            except OSError:
                pass
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)

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
        r = subprocess.run([self.args.tandem, "client", "--url",
                            f"tcp://127.0.0.1:{port or self.decode_ports[i]}", "--health"],
                           capture_output=True, text=True, timeout=timeout, env=self.env)
        f = r.stdout.split()
        d = {f[k]: f[k + 1] for k in range(0, len(f) - 1, 2)}
        return {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in d.items()} \
            if r.returncode == 0 else None

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


def wait_for(pred, timeout, step=0.2):
    """(ok, seconds waited)."""
    t0 = time.time()
    while True:
        try:
            if pred():
                return True, time.time() - t0
        except (OSError, ValueError, http.client.HTTPException, subprocess.TimeoutExpired):
            pass
        if time.time() - t0 > timeout:
            return False, time.time() - t0
        time.sleep(step)
