"""procs.py: processes a test starts (each with a log file) and the checks that none is left.

    p = spawn(argv, log_path, env=None)          # stdout and stderr appended to log_path
    stop([p, ...], timeout=30)                   # SIGTERM, wait, SIGKILL past the timeout
    ps = Procs(dir); ps.spawn("router", argv)    # named processes, logs dir/NAME.log
    leftovers(needle)                            # live processes whose command line has needle
"""
import os
import signal
import subprocess


def read(path, default=""):
    """The text of a file (undecodable bytes replaced), default if it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


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


def proc_stat(pid):
    """(state, pgid) of a pid from /proc/PID/stat, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[2])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid):
    """pid exists and is not a zombie (an orphan waits for init to reap it)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ").strip()
    except OSError:
        return ""


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def spawn(argv, log, env=None, mode="a", new_session=False):
    """Starts argv with stdout and stderr going to the file log (opened with mode); env: the
    whole environment (None: this process's). Returns the Popen."""
    with open(log, mode) as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)


def stop(procs, sig=signal.SIGTERM, timeout=30, group=False):
    """Sends sig (None: nothing) to every live process of procs, waits for each up to timeout
    seconds and SIGKILLs the ones still there (group: their process group). Returns the exit
    codes in the order of procs."""
    procs = list(procs)
    for p in procs:
        if sig is not None and p.poll() is None:
            p.send_signal(sig)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
            codes.append(p.wait())
    return codes


class Procs:
    """Named processes of one test, each logging to DIR/NAME.log (appended across restarts)."""

    def __init__(self, dir):
        self.dir = dir
        self.procs = {}  # name -> Popen, in start order

    def spawn(self, name, argv, env=None, mode="a"):
        self.procs[name] = spawn(argv, self.log_path(name), env=env, mode=mode)
        return self.procs[name]

    def __getitem__(self, name):
        return self.procs[name]

    def log_path(self, name):
        return os.path.join(self.dir, f"{name}.log")

    def log(self, name):
        return read(self.log_path(name))

    def kill(self, name, sig=signal.SIGKILL):
        """Sends sig to one process; waits for it when sig ends it (SIGKILL, SIGTERM)."""
        p = self.procs[name]
        p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait()

    def stop(self, timeout=30):
        """SIGTERM to all, SIGKILL past timeout; {name: exit code}."""
        names = list(self.procs)
        return dict(zip(names, stop([self.procs[n] for n in names], timeout=timeout)))


def leftovers(needle, exclude=None, pgids=()):
    """Live processes (this one aside) whose command line mentions needle (and not exclude,
    the test script's own name) or whose process group is in pgids: [(pid, command[:120])]."""
    found = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        st = proc_stat(int(d))
        if st is None or st[0] in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if (needle in cmd and not (exclude and exclude in cmd)) or st[1] in pgids:
            found.append((int(d), cmd.replace("\0", " ")[:120]))
    return found


def kill_pids(pids):
    """SIGKILL to each pid's process group and to the pid itself (errors ignored)."""
    for pid in pids:
        for fn in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                fn()
            except OSError:
                pass


def unlink_all(paths):
    """Removes files that may be left behind (shared-memory segments); missing ones are fine."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def shm_left(*prefixes):
    """Names in /dev/shm that start with one of prefixes (segments a test's processes left)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefixes)]
