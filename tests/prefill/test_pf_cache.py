#!/usr/bin/env python3
"""test_pf_cache.py: tandem-prefill's stage-0 profile cache and its SIGTERM while profiling,
on the synthetic model, with TANDEM_CACHE in a temporary directory.

Checks:
  a first start measures the profile and caches it (one file in $TANDEM_CACHE/profiles);
  a second start of the same configuration loads it (no measuring; the same cost model);
  another thread count is another key: measured again, a second file;
  a corrupt cache file is ignored with a warning, measured again and rewritten (the next
    start loads it);
  --reprofile measures even though a profile is cached; on stage 1 it is refused;
  a cache that cannot be written (TANDEM_CACHE is a file) is a warning: the stage serves;
  SIGTERM while stage 0 profiles: exit 0 within 2 s, nothing cached; with pp 2, SIGINT to
    stage 0 and SIGTERM to stage 1 while stage 0 profiles: both exit 0 within 2 s;
  with --model (the default model): SIGTERM in the middle of a forward that takes seconds
    (2560 tokens of 15 layers): the process does not wait for it, exit 0 within 2 s.

usage: test_pf_cache.py --prefill BIN --synth-dir DIR [--model GGUF]
"""
import argparse
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import write_yaml  # noqa: E402
from tdtest.ports import free_port  # noqa: E402
from tdtest.procs import read, spawn, stop  # noqa: E402
from tdtest.waits import wait_text  # noqa: E402

STOP_S = 2.0  # SIGTERM to exit while profiling


class Stage:
    """tandem-prefill stages of instance p0 of a config written into dir."""

    def __init__(self, args, dir, cache, pp=1, threads=1, chunk=128, budget=2000, extra=(),
                 model=None):
        self.args, self.dir, self.pp, self.extra = args, dir, pp, list(extra)
        self.cfg = write_yaml(os.path.join(dir, f"c-{pp}-{threads}-{chunk}-{budget}.yaml"), {
            "model": model or args.model,
            "prefill": [{"name": "p0", "pp": pp, "chunk_size": chunk, "port": free_port(),
                         "kv_tokens": max(2048, 2 * chunk), "threads": threads,
                         "profile_budget_ms": budget}],
            "decode": [{"name": "d0", "port": free_port()}],
            "kvxfer": {"ucx_tls": "sm,tcp,self"}})
        self.env = dict(os.environ, TANDEM_CACHE=cache)
        self.procs, self.logs = {}, {}

    def start(self):
        for s in range(self.pp):
            self.logs[s] = os.path.join(self.dir, f"s{s}-{time.monotonic_ns()}.log")
            self.procs[s] = spawn([self.args.prefill, "--config", self.cfg, "--instance", "p0",
                                   "--stage", str(s), *(self.extra if s == 0 else [])],
                                  self.logs[s], env=self.env, mode="w")
        return self

    def log(self, s=0):
        return read(self.logs[s])

    def wait_log(self, pattern, timeout=120):
        return wait_text(self.logs[0], pattern, timeout, regex=True, procs=[self.procs[0]])

    def wait_ready(self):
        return self.wait_log(r"p0: ready|stages joined: ready")

    def stop(self, sigs=None):
        """Signal every stage; returns ([exit codes], seconds until the last one exited)."""
        t0 = time.monotonic()
        for s, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(sigs[s] if sigs else signal.SIGTERM)
        codes = stop(self.procs.values(), sig=None, timeout=60)
        return codes, time.monotonic() - t0


def fit_line(log):
    m = re.search(r"dynamic chunking: (f\(l\).*)|(no usable cost model.*)", log)
    return m.group(0) if m else None


def profiles(cache):
    return sorted(glob.glob(os.path.join(cache, "profiles", "stage-*.profile")))


def cached_runs(args, dir):
    cache = os.path.join(dir, "cache")
    # first start: measured, stored
    st = Stage(args, dir, cache).start()
    ready = st.wait_ready()
    log = st.log()
    codes, _ = st.stop()
    check(ready and "measuring the stage profile (no cached profile)" in log
          and "stage profile cached in" in log, "first start: measured and cached")
    files = profiles(cache)
    check(len(files) == 1, f"first start: one profile file ({files})")
    check(codes == [0], f"first start: SIGTERM, exit 0 ({codes})")
    first_fit = fit_line(log)

    # second start: loaded, same cost model
    st = Stage(args, dir, cache).start()
    ready = st.wait_ready()
    log = st.log()
    codes, _ = st.stop()
    check(ready and "stage profile loaded from the cache" in log and "measuring" not in log,
          "second start: the profile is loaded from the cache, not measured")
    check(first_fit is not None and fit_line(log) == first_fit,
          f"second start: the same cost model ({fit_line(log)})")
    check(codes == [0], f"second start: exit 0 ({codes})")

    # another key: 2 threads
    st = Stage(args, dir, cache, threads=2).start()
    ready = st.wait_ready()
    log = st.log()
    st.stop()
    check(ready and "measuring the stage profile (no cached profile)" in log,
          "2 threads: another key, measured")
    check(len(profiles(cache)) == 2, f"2 threads: a second profile file ({profiles(cache)})")

    # a corrupt file: ignored with a warning, measured, rewritten
    for path in files:
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(b"\x00garbage\n")
    st = Stage(args, dir, cache).start()
    ready = st.wait_ready()
    log = st.log()
    codes, _ = st.stop()
    check(ready and "ignoring the cached profile" in log
          and "measuring the stage profile (the cached one is unusable)" in log
          and "stage profile cached in" in log,
          "corrupt cache file: warned, measured again and rewritten")
    check(codes == [0], f"corrupt cache file: no crash, exit 0 ({codes})")
    st = Stage(args, dir, cache).start()
    ready = st.wait_ready()
    log = st.log()
    st.stop()
    check(ready and "stage profile loaded from the cache" in log,
          "after the corrupt file was rewritten: loaded")

    # --reprofile
    before = os.stat(files[0]).st_mtime_ns
    st = Stage(args, dir, cache, extra=["--reprofile"]).start()
    ready = st.wait_ready()
    log = st.log()
    codes, _ = st.stop()
    check(ready and "measuring the stage profile (--reprofile)" in log
          and os.stat(files[0]).st_mtime_ns != before, "--reprofile: measured and stored anew")
    check(codes == [0], f"--reprofile: exit 0 ({codes})")

    # --reprofile on a stage that does not profile is an error, not ignored
    r = subprocess.run([args.prefill, "--config", st.cfg, "--instance", "p0", "--stage", "1",
                        "--reprofile"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 1 and "--reprofile is for stage 0" in r.stderr,
          f"--reprofile on stage 1: refused ({r.returncode}: {r.stderr.strip()})")

    # a cache that cannot be written
    blocker = os.path.join(dir, "not-a-dir")
    open(blocker, "w").close()
    st = Stage(args, dir, blocker).start()
    ready = st.wait_ready()
    log = st.log()
    codes, _ = st.stop()
    check(ready and "cannot cache the stage profile" in log and codes == [0],
          f"unwritable cache: a warning, the stage serves, exit 0 ({codes})")


def stop_while_profiling(args, dir):
    cache = os.path.join(dir, "cache-stop")
    # chunks of 256: forwards of at most 320 tokens; 16 lengths x 3 passes last seconds
    st = Stage(args, dir, cache, chunk=256, budget=60000).start()
    measuring = st.wait_log(r"measuring the stage profile")
    time.sleep(0.5)
    alive = st.procs[0].poll() is None
    codes, took = st.stop()
    log = st.log()
    check(measuring and alive and "stopped while profiling" in log,
          "SIGTERM while profiling: the profile stops")
    check(codes == [0] and took < STOP_S,
          f"SIGTERM while profiling: exit 0 in {took:.2f} s (< {STOP_S} s) ({codes})")
    check(profiles(cache) == [], "SIGTERM while profiling: nothing cached")

    st = Stage(args, dir, cache, pp=2, chunk=256, budget=60000).start()
    measuring = st.wait_log(r"measuring the stage profile")
    time.sleep(0.5)
    codes, took = st.stop({0: signal.SIGINT, 1: signal.SIGTERM})
    check(measuring and codes == [0, 0] and took < STOP_S,
          f"pp 2, SIGINT to stage 0 / SIGTERM to stage 1 while stage 0 profiles: both exit 0 "
          f"in {took:.2f} s ({codes})")


def stop_mid_forward(args, dir):
    """The default model's warm-up forward of 2560 tokens takes seconds: not waited for."""
    cache = os.path.join(dir, "cache-mid")
    st = Stage(args, dir, cache, pp=2, chunk=2048, budget=60000, model=args.model_default)
    st.pp = 1  # stage 0 only: it profiles alone
    st.start()
    measuring = st.wait_log(r"measuring the stage profile")
    time.sleep(0.3)
    codes, took = st.stop()
    log = st.log()
    check(measuring and "without waiting for the forward in progress" in log,
          "default model, SIGTERM inside a long forward: not waited for")
    check(codes == [0] and took < STOP_S,
          f"default model, SIGTERM inside a long forward: exit 0 in {took:.2f} s ({codes})")
    check(profiles(cache) == [], "default model, SIGTERM inside a long forward: nothing cached")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--model", dest="model_default", default="")
    args = ap.parse_args()
    args.model = os.path.join(args.synth_dir, "llama.gguf")
    with tempfile.TemporaryDirectory(prefix="tandem-pfcache-") as dir:
        cached_runs(args, dir)
        stop_while_profiling(args, dir)
        if args.model_default and os.path.exists(args.model_default):
            stop_mid_forward(args, dir)
        else:
            print("skip the long forward on the default model (no --model given)")
    print(f"{len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
