#!/usr/bin/env python3
"""fetch_corpus.py: fetches the chat-template and vocab corpus from PyPI (issue 41).

The corpus is llama.cpp's models/templates/*.jinja (the chat templates of many model families,
as their authors published them) and models/ggml-vocab-* (tokenizer-only GGUFs with their
.inp/.out test strings). llama-cpp-python's sdist vendors llama.cpp whole, so one pinned sdist
from PyPI (the one place reachable from CI) carries both. This script downloads it with
`pip download --no-deps --no-binary :all:`, checks size and sha256 against the pins below,
extracts only those files, writes a manifest (sha256, size, path of each) as the marker file
`.complete`, and renames the directory into place. So a corpus directory under its final name
is always complete and verified; a failed or interrupted fetch leaves only a hidden
`.fetch-corpus-*` directory that is removed on the way out (and that no caller reads).

Layout: DIR/llama-cpp-python-0.3.36/{templates/*.jinja, vocab/ggml-vocab-*, .complete}

Usage: fetch_corpus.py [--dir DIR] [--pip PYTHON]
  DIR defaults to ~/.cache/tandem/corpus. Prints the corpus directory on stdout; progress and
  errors go to stderr. Exit status 0 when the corpus is in place and verified, 1 otherwise
  (2: bad usage). A corpus already present whose files match its manifest is not fetched again.
Never commit a corpus file: they are others' work under their own licences, and large.
"""
import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

CORPUS = {
    "name": "llama-cpp-python-0.3.36",
    "req": "llama-cpp-python==0.3.36",
    "sdist": "llama_cpp_python-0.3.36.tar.gz",
    "size": 76589250,
    "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    # llama.cpp's models/ inside the sdist: templates/*.jinja and ggml-vocab-* come from here
    "models": "llama_cpp_python-0.3.36/vendor/llama.cpp/models/",
}
MARKER = ".complete"
CHUNK = 1 << 20


class FetchError(Exception):
    pass


def log(msg):
    print(f"fetch_corpus: {msg}", file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def verified(corpus_dir):
    """True when corpus_dir has its marker and every file the marker lists matches its size
    and sha256 (about 75 MB to hash: a fraction of a second)."""
    try:
        with open(os.path.join(corpus_dir, MARKER), encoding="utf-8") as f:
            lines = [line.split(None, 2) for line in f if line.strip()]
    except OSError:
        return False
    if not lines:
        return False
    for entry in lines:
        if len(entry) != 3:
            return False
        digest, size, rel = entry
        path = os.path.join(corpus_dir, rel.rstrip("\n"))
        try:
            if os.path.getsize(path) != int(size) or sha256_of(path) != digest:
                return False
        except (OSError, ValueError):
            return False
    return True


def download(pip_python, dest):
    """pip download of the pinned sdist into dest; returns its path."""
    cmd = [pip_python, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--no-deps", "--no-binary", ":all:", "--no-cache-dir", "-d", dest, CORPUS["req"]]
    # --no-binary: the sdist is what vendors llama.cpp (the wheels carry only the library);
    # --no-cache-dir: the extracted corpus is the cache
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip download failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    path = os.path.join(dest, CORPUS["sdist"])
    if not os.path.isfile(path):
        raise FetchError(f"pip download left no {CORPUS['sdist']} in {dest}: {os.listdir(dest)}")
    return path


def check_sdist(path):
    n = os.path.getsize(path)
    digest = sha256_of(path)
    if n != CORPUS["size"] or digest != CORPUS["sha256"]:
        raise FetchError(f"{os.path.basename(path)} is {n} bytes, sha256 {digest}; "
                         f"expected {CORPUS['size']} bytes, sha256 {CORPUS['sha256']}")


def destination(member_name):
    """Where a member of the sdist goes in the corpus ("templates/X.jinja", "vocab/X"), or
    None when it is not part of the corpus. Only direct children of the two places count, so
    no member can name a path outside the corpus."""
    models = CORPUS["models"]
    if not member_name.startswith(models):
        return None
    rest = member_name[len(models):]
    if rest.startswith("templates/"):
        base = rest[len("templates/"):]
        if "/" not in base and base.endswith(".jinja") and base != ".jinja":
            return "templates/" + base
    elif "/" not in rest and rest.startswith("ggml-vocab-"):
        return "vocab/" + rest
    return None


def extract(sdist, out_dir):
    """Extracts the corpus files into out_dir; returns [(sha256, size, relative path)]."""
    manifest = []
    os.makedirs(os.path.join(out_dir, "templates"))
    os.makedirs(os.path.join(out_dir, "vocab"))
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            rel = destination(m.name)
            if rel is None:
                continue
            if not m.isfile():  # a link or device under a corpus name: not from this sdist
                raise FetchError(f"{m.name} in the sdist is not a regular file")
            h = hashlib.sha256()
            with tar.extractfile(m) as src, open(os.path.join(out_dir, rel), "wb") as dst:
                while b := src.read(CHUNK):
                    dst.write(b)
                    h.update(b)
            manifest.append((h.hexdigest(), m.size, rel))
    kinds = {rel.split("/")[0] for _, _, rel in manifest}
    if kinds != {"templates", "vocab"}:
        raise FetchError(f"the sdist has no {CORPUS['models']}templates/*.jinja or ggml-vocab-*")
    return sorted(manifest, key=lambda e: e[2])


def write_marker(out_dir, manifest):
    path = os.path.join(out_dir, MARKER)
    with open(path, "w", encoding="utf-8") as f:
        for digest, size, rel in manifest:
            f.write(f"{digest} {size} {rel}\n")
        f.flush()
        os.fsync(f.fileno())


def install(tmp_dir, final):
    """Renames tmp_dir to final. A directory already there (incomplete, damaged or made by
    hand) is first moved aside, since rename cannot replace a non-empty directory."""
    old = None
    if os.path.lexists(final):
        old = tempfile.mkdtemp(prefix=".old-corpus-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(old, "corpus"))
    os.rename(tmp_dir, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def fetch(cache, pip_python):
    """Ensures cache/<corpus name> is present and verified. Returns its path; raises
    FetchError."""
    final = os.path.join(cache, CORPUS["name"])
    if verified(final):
        log(f"present: {final}")
        return final
    if os.path.exists(final):
        log(f"{final} is incomplete or does not match its manifest; fetching again")
    os.makedirs(cache, exist_ok=True)
    # in the cache directory, so the final rename stays on one filesystem (atomic)
    tmp = tempfile.mkdtemp(prefix=".fetch-corpus-", dir=cache)
    try:
        t0 = time.monotonic()
        log(f"downloading {CORPUS['req']} (sdist, {CORPUS['size']} bytes)")
        sdist = download(pip_python, tmp)
        check_sdist(sdist)
        t1 = time.monotonic()
        out = os.path.join(tmp, CORPUS["name"])
        manifest = extract(sdist, out)
        os.unlink(sdist)
        write_marker(out, manifest)
        install(out, final)
        ntpl = sum(1 for _, _, rel in manifest if rel.startswith("templates/"))
        log(f"installed {final} ({ntpl} templates, {len(manifest) - ntpl} vocab files; "
            f"download {t1 - t0:.1f} s, extract {time.monotonic() - t1:.1f} s)")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _on_signal(signum, _frame):
    # turns SIGTERM/SIGHUP into an exception so fetch()'s cleanup runs
    raise SystemExit(128 + signum)


def main():
    ap = argparse.ArgumentParser(description="fetch the chat-template corpus from PyPI")
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "tandem",
                                                  "corpus"),
                    help="the corpus cache directory (default: ~/.cache/tandem/corpus)")
    ap.add_argument("--pip", default=sys.executable,
                    help="the python whose pip downloads the sdist (default: this one)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    try:
        print(fetch(a.dir, a.pip), flush=True)
    except (FetchError, OSError, tarfile.TarError) as e:
        log(f"FAILED: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
