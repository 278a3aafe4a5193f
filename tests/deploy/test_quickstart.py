#!/usr/bin/env python3
"""test_quickstart.py: what a new user does first, on a fresh copy of the repository.

  1. copy the working tree (tracked files and untracked files git does not ignore: what a
     clone of this tree would hold, uncommitted changes included) into a temp dir, so there
     is no build directory;
  2. scripts/run.sh --port N there (setup.sh, a Release build into build/, `tandem up
     deploy/local.yaml --port N`: the default disaggregated cluster on the default model),
     in its own process group as a terminal runs it;
  3. the example request is printed only once the cluster answers (GET /health is 200 when
     the line appears); that printed curl, the Quick start's curl and its Python example
     (README.md, port 8000 replaced by N) run as written and answer sensibly ("Paris");
  4. a completion and a chat completion through the official openai client, temperature 0;
  5. Ctrl-C (SIGINT to the process group): run.sh exits 0, no process of the cluster is
     left (the pids `tandem status --json` named, their process groups, anything running a
     binary of the copy) and the router and control ports are free again.

Why a copy of the working tree rather than `git clone`: ctest tests the tree it was
configured from, uncommitted changes included; a clone would test the last commit. Outside
a git checkout the tree is copied without build*/ and .git.

The port N is picked free, below the ephemeral range, with N+1 and N+2 free too (`tandem up
--port N` puts the decode and prefill control ports there). The cluster's run directory
(~/.cache/tandem/run/local-N) is removed at the end.

usage: test_quickstart.py --source-dir DIR [--keep]
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.ports import can_bind as _can_bind, free_port as _free_port  # noqa: E402
from tdtest.procs import alive, leftovers, proc_stat, read  # noqa: E402
from tdtest.waits import http_status  # noqa: E402

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


def can_bind(port):
    return _can_bind(port, reuse=True)  # as the servers bind


def free_port():
    """N with N, N+1, N+2 free (router, d0, p0 under --port N), below the ephemeral range."""
    return _free_port(3, reuse=True)


def copy_tree(src, dst):
    """The working tree as a fresh clone would hold it (see the module comment)."""
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "-z", "-co", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for root, dirs, names in os.walk(src):
            dirs[:] = [d for d in dirs if d != ".git" and not d.startswith("build")]
            files += [os.path.relpath(os.path.join(root, n), src) for n in names]
    n = 0
    for f in files:
        s = os.path.join(src, f)
        if not os.path.isfile(s):  # deleted in the working tree, or a submodule
            continue
        d = os.path.join(dst, f)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        shutil.copy2(s, d)
        n += 1
    return n


def readme_examples(readme, port):
    """The Quick start's curl (a ```sh block with curl) and Python example, on port."""
    text = read(readme)
    start = text.find("## Quick start")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    curl = next((b for lang, b in blocks if lang == "sh" and "curl" in b), None)
    py = next((b for lang, b in blocks if lang == "python"), None)
    fix = lambda s: s.replace("127.0.0.1:8000", f"127.0.0.1:{port}") if s else s
    return fix(curl), fix(py)


def chat_text(out):
    try:
        return json.loads(out)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def try_client(base):
    """A completion and a chat completion through the official client, temperature 0."""
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is",
                                  max_tokens=16, temperature=0)
    text = r.choices[0].text
    check(bool(text.strip()) and r.choices[0].finish_reason in ("stop", "length")
          and 1 <= r.usage.completion_tokens <= 16,
          f"openai client: completions.create answers ({text!r}, {r.usage.completion_tokens} "
          f"tokens, {r.choices[0].finish_reason})")
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    text = r.choices[0].message.content or ""
    check("Paris" in text, f"openai client: chat at temperature 0 says Paris ({text!r})")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def check_ports(repo, port, run_dir, pids):
    """While the cluster runs: the copy of the YAML with the moved ports is what every
    process reads; a busy router or control port stops `tandem up` before it starts
    anything; a second up of the same cluster is refused."""
    tandem = os.path.join(repo, "build/bin/tandem")
    copy = os.path.join(run_dir, "local.yaml")
    text = read(copy) if os.path.exists(copy) else ""
    check(f"listen: 127.0.0.1:{port}" in text and f"port: {port + 1}" in text
          and f"port: {port + 2}" in text,
          f"--port {port}: {copy} has the router on {port}, d0 on {port + 1}, p0 on {port + 2}")
    cfgs = {c[c.index("--config") + 1] for c in map(cmdline, pids) if "--config" in c}
    check(cfgs == {copy}, f"every process reads the copy ({cfgs})")
    cases = [("local-colocated.yaml", port, f"port {port} (router.listen"),
             ("local-colocated.yaml", port - 1, f"port {port} (decode d0's control port"),
             ("local.yaml", port - 2, f"port {port} (prefill p0's control port"),
             ("local.yaml", port, "already running")]
    for yaml, p, want in cases:
        if p != port and not can_bind(p):
            print(f"skip --port {p}: taken by something else")
            continue
        t0 = time.time()
        r = subprocess.run([tandem, "up", f"deploy/{yaml}", "--port", str(p)], cwd=repo,
                           capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and want in r.stderr and "starting cluster" not in r.stderr,
              f"up {yaml} --port {p} stops before it starts anything, in "
              f"{time.time() - t0:.1f} s: {r.stderr.strip()[:300]!r}")
        if p != port:
            shutil.rmtree(os.path.join(os.path.dirname(run_dir),
                                       f"{yaml[:-5]}-{p}"), ignore_errors=True)


def check_reprofile(tmp, repo):
    """`tandem up --reprofile` passes --reprofile to prefill stage 0 only (fake binaries
    that record their command line; the flag itself is tandem-prefill's)."""
    fake = os.path.join(tmp, "fakebin")
    rec = os.path.join(tmp, "argv")
    os.makedirs(fake, exist_ok=True)
    os.makedirs(rec, exist_ok=True)
    for role in ("decode", "prefill", "router"):
        path = os.path.join(fake, f"tandem-{role}")
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\necho "$@" > {rec}/{role}-$$\nexec sleep 60\n')
        os.chmod(path, 0o755)
    port = free_port()
    env = dict(os.environ, TANDEM_BIN=fake)
    r = subprocess.run([os.path.join(repo, "build/bin/tandem"), "up", "deploy/local.yaml",
                        "--port", str(port), "--reprofile", "--timeout", "2", "--grace", "2"],
                       cwd=repo, capture_output=True, text=True, timeout=60, env=env)
    argv = [read(os.path.join(rec, f)).split() for f in sorted(os.listdir(rec))]
    prefill = {a[a.index("--stage") + 1]: a for a in argv if "--stage" in a}
    check(r.returncode != 0 and set(prefill) == {"0", "1"}
          and "--reprofile" in prefill["0"] and "--reprofile" not in prefill["1"]
          and all("--reprofile" not in a for a in argv if "--stage" not in a),
          f"up --reprofile: prefill stage 0 alone gets --reprofile ({argv})")
    shutil.rmtree(os.path.expanduser(f"~/.cache/tandem/run/local-{port}"), ignore_errors=True)


def run(args):
    tmp = tempfile.mkdtemp(prefix="tandem-quickstart-")
    repo = os.path.join(tmp, "repo")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run_dir = os.path.expanduser(f"~/.cache/tandem/run/local-{port}")
    log_path = os.path.join(tmp, "run.log")
    proc = None
    pgids = set()
    t_start = time.time()
    try:
        n = copy_tree(args.source_dir, repo)
        check(n > 0 and not os.path.exists(os.path.join(repo, "build")),
              f"a fresh copy of the tree: {n} files, no build directory ({repo})")
        env = dict(os.environ)
        for k in ("TANDEM_BUILD_DIR", "TANDEM_BIN"):  # a new user has neither
            env.pop(k, None)
        log = open(log_path, "w")
        t0 = time.time()
        proc = subprocess.Popen(["bash", "scripts/run.sh", "--port", str(port)], cwd=repo,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        pgids.add(proc.pid)
        # the example is the last thing printed at start-up
        ready, health_then = False, 0
        while time.time() - t0 < 420 and proc.poll() is None:
            out = read(log_path)
            if "try: curl" in out:
                health_then = http_status(base + "/health")
                ready = True
                break
            time.sleep(0.2)
        out = read(log_path)
        if not check(ready, f"run.sh prints the example request in {time.time() - t0:.1f} s "
                            f"(exit {proc.poll()}; its output is below)"):
            return
        check(health_then == 200,
              f"GET /health is 200 when the example appears (got {health_then})")
        i_up, i_try = out.find("is up"), out.find("try: curl")
        check(0 <= i_up < i_try, "the example comes after the 'is up' line")
        st = subprocess.run([os.path.join(repo, "build/bin/tandem"), "status",
                             "deploy/local.yaml", "--port", str(port), "--json"], cwd=repo,
                            capture_output=True, text=True, timeout=60)
        status = json.loads(st.stdout) if st.returncode == 0 else None
        pids = [p["pid"] for p in status["processes"]] if status else []
        sup = status["supervisor"]["pid"] if status else None
        check(status is not None and len(pids) == 4 and all(pids)
              and [p["state"] for p in status["processes"]] == ["running"] * 4
              and sup is not None and (proc_stat(sup) or ("", 0))[1] == proc.pid,
              f"tandem status --port {port}: 4 processes running under run.sh's tandem up "
              f"({st.stdout.strip()[:400]} {st.stderr.strip()[:300]})")
        pgids.update(pids)

        m = re.search(r"try: (curl .*)$", out, re.M)
        r = subprocess.run(["bash", "-c", m.group(1)], capture_output=True, text=True,
                           timeout=120)
        text = chat_text(r.stdout)
        check(r.returncode == 0 and text is not None and "Paris" in text,
              f"the printed example answers sensibly ({text!r}; {r.stdout[:300]!r} "
              f"{r.stderr[:200]!r})")
        curl, py = readme_examples(os.path.join(repo, "README.md"), port)
        if check(curl is not None and py is not None, "README's Quick start has a curl and a "
                                                      "Python example"):
            r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                               timeout=120)
            text = chat_text(r.stdout)
            check(r.returncode == 0 and text is not None and "Paris" in text,
                  f"README's curl answers sensibly ({text!r}; {r.stdout[:300]!r})")
            r = subprocess.run([sys.executable, "-c", py], capture_output=True, text=True,
                               timeout=180)
            check(r.returncode == 0 and len(r.stdout.strip()) > 10,
                  f"README's Python example runs ({r.stdout.strip()!r} {r.stderr[-600:]!r})")
        try_client(base)
        check_ports(repo, port, run_dir, pids)

        # Ctrl-C: the terminal sends SIGINT to the foreground process group
        t1 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        out = read(log_path)
        check(rc == 0, f"Ctrl-C: run.sh exits 0 in {time.time() - t1:.1f} s (exit {rc}; "
                       f"{out[-800:]!r})")
        left = [p for p in pids + [proc.pid] if alive(p)]
        check(not left, f"the pids of the cluster and its supervisor are gone ({left})")
        lo = leftovers(tmp, pgids)
        check(not lo, f"no process of the copy or in their process groups is left ({lo})")
        busy = [q for q in (port, port + 1, port + 2) if not can_bind(q)]
        check(not busy, f"the router and control ports {port}..{port + 2} are free ({busy})")
        check_reprofile(tmp, repo)
    except Exception as ex:  # report, never hang or leave processes behind
        check(False, f"unexpected {type(ex).__name__}: {ex}")
    finally:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        for pid, _ in leftovers(tmp, pgids):
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if os.path.exists(log_path) and FAILS:
            print("---- run.sh output (tail) ----\n" + read(log_path)[-4000:], flush=True)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"quickstart: {time.time() - t_start:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (debugging)")
    args = ap.parse_args()
    run(args)
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
