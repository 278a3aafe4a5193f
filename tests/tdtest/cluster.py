"""cluster.py: a Tandem cluster for a test: its YAML, its bin directory, `tandem up -d` and the
views of it a test checks (pid files, logs, Health of a node, the router's /metrics).

    text = yaml_text({"model": m, "router": {"listen": "127.0.0.1:P"},
                      "decode": [{"name": "d0", "tp": 2, "port": Q}]})
    cl = UpCluster(tandem, "tandem-soak-", {"decode": bin, "router": bin}, exclude="test_soak")
    cl.write_config("soak.yaml", doc); cl.up(); ...; cl.down(); cl.leftovers(); cl.cleanup()
"""
import json
import os
import re
import shutil
import subprocess
import tempfile

from .procs import kill_pids, leftovers, read, unlink_all


def _scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):  # a nested mapping (router.membership): flow style
        return "{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}"
    v = str(v)
    return json.dumps(v) if v == "" else v


def yaml_text(doc):
    """The YAML config.c reads, from doc: {key: scalar | {key: scalar} (a section) |
    [{key: scalar}] (a list of instances)}; lists of scalars are written inline ([a, b]);
    keys keep their order; an empty list writes the key alone."""
    lines = []
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines += [f"  {kk}: {_scalar(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list) and (not v or isinstance(v[0], dict)):
            lines.append(f"{k}:")
            for item in v:
                for j, (kk, vv) in enumerate(item.items()):
                    lines.append(f"  {'- ' if j == 0 else '  '}{kk}: {_scalar(vv)}")
        else:
            lines.append(f"{k}: {_scalar(v)}")
    return "\n".join(lines) + "\n"


def write_yaml(path, doc):
    with open(path, "w") as f:
        f.write(yaml_text(doc))
    return path


def bin_dir(root, **roles):
    """root/bin holding a symlink tandem-ROLE -> path for each role=path (a path of None or ''
    is skipped): the TANDEM_BIN of `tandem up`, so every process's command line names root
    (leftovers() finds them by it). Returns the bin directory."""
    b = os.path.join(root, "bin")
    os.makedirs(b, exist_ok=True)
    for role, path in roles.items():
        if path:
            name = "tandem" if role == "tandem" else f"tandem-{role}"
            os.symlink(os.path.abspath(path), os.path.join(b, name))
    return b


def parse_health(stdout, typed=False):
    """`tandem client --health` output ("key value key value ...") as a dict; typed: numbers
    as ints."""
    f = stdout.split()
    d = {f[k]: f[k + 1] for k in range(0, len(f) - 1, 2)}
    if typed:
        d = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in d.items()}
    return d


def client_health(tandem, url, timeout=30, env=None, ns=None, typed=False, extra=()):
    """Health of the node at url (tcp://HOST:PORT) through `tandem client --health` (in network
    namespace ns if given). typed: numbers as ints, None when the client fails; otherwise the
    strings of whatever it printed."""
    cmd = [tandem, "client", "--url", url, "--health", *extra]
    if ns:
        cmd = ["ip", "netns", "exec", ns] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if typed and r.returncode != 0:
        return None
    return parse_health(r.stdout, typed)


_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text):
    """Prometheus text as {(name, ((label, value), ...) sorted): float}."""
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


def generate_text(tandem, model, prompt, n, chat=False, strip_newline=False):
    """`tandem generate --temperature 0` text for a prompt (chat: a chat message);
    strip_newline: without the newline the CLI ends its output with."""
    r = subprocess.run([tandem, "generate", "--model", model, "--chat" if chat else "--prompt",
                        prompt, "--max-tokens", str(n), "--temperature", "0", "--threads", "1"],
                       capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr.decode(errors="replace"))
    out = r.stdout.decode("utf-8", errors="replace")
    return out[:-1] if strip_newline and out.endswith("\n") else out


class UpCluster:
    """A cluster run by `tandem up -d` from a temp dir: dir/bin is its TANDEM_BIN (symlinks to
    the binaries in roles), dir holds the YAML files and the run directory. exclude: the test
    script's name, which leftovers() does not count."""

    def __init__(self, tandem, prefix, roles, exclude, env_extra=None):
        self.tandem_bin = tandem
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.bin = bin_dir(self.dir, **roles)
        self.env = dict(os.environ, TANDEM_BIN=self.bin, **(env_extra or {}))
        self.exclude = exclude
        self.cfg = None

    def write_config(self, name, doc):
        """Writes doc (yaml_text) as dir/NAME and makes it the config up/down/status use."""
        self.cfg = write_yaml(os.path.join(self.dir, name), doc)
        return self.cfg

    def tandem(self, *a, timeout=300):
        return subprocess.run([self.tandem_bin, *a], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def up(self, timeout=240):
        return self.tandem("up", "-d", self.cfg, "--timeout", str(timeout), timeout=timeout + 60)

    def down(self, grace=30):
        return self.tandem("down", self.cfg, "--grace", str(grace), timeout=grace * 3 + 60)

    def status(self, cfg=None, timeout=60):
        """`tandem status --json` as a dict, None when it fails."""
        r = self.tandem("status", cfg or self.cfg, "--json", timeout=timeout)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def run_dir(self, cluster):
        """The run directory of the cluster named cluster (the config's file name)."""
        return os.path.join(self.dir, "run", cluster)

    def pid_file(self, rdir, key):
        """(pid, restarts) from the pid file rdir/KEY.pid ("PID STARTTIME RESTARTS",
        docs/deploy.md); (0, 0) when it is missing or unreadable."""
        try:
            with open(os.path.join(rdir, key + ".pid")) as f:
                v = f.read().split()
            return int(v[0]), int(v[2]) if len(v) > 2 else 0
        except (OSError, ValueError, IndexError):
            return 0, 0

    @staticmethod
    def logs_of(rdir, tail=0):
        """{NAME.log: text (its last tail characters if tail)} of the run directory rdir."""
        out = {}
        if os.path.isdir(rdir):
            for n in sorted(os.listdir(rdir)):
                if n.endswith(".log"):
                    text = read(os.path.join(rdir, n))
                    out[n] = text[-tail:] if tail else text
        return out

    def leftovers(self):
        """Live processes whose command line mentions the temp dir (the test itself aside)."""
        return leftovers(self.dir, exclude=self.exclude)

    def cleanup(self, keep=False, shm=()):
        """Kills what is left of this test's processes (by pid), removes the shared-memory
        segments shm and, unless keep, the temp dir."""
        kill_pids([pid for pid, _ in self.leftovers()])
        unlink_all(shm)
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)

