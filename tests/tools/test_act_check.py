#!/usr/bin/env python3
"""test_act_check.py: cpu_act auto measures, per model, whether the q8 activation mode (else
the q16 one) keeps the model's greedy answers, caches the verdict, and serves in the mode it
chose (kernels/act_check.h).

  --cache MODEL    the verdict's cache on any model (a synthetic one under ASan: the check is
                   the same code whatever the model): measured once, then read; a damaged file
                   is refused and measured again; two processes that start together measure
                   once (the lock); TANDEM_CPU_ACT with an unknown value is an error
  --default MODEL  the default model (SmolLM2-135M Q4_1) answers the quick start's question
                   wrongly in q8 and as float32 does in q16: auto chooses q16, and the answer
                   is "Paris"
  --qwen MODEL     Qwen2.5-Coder 0.5B: every prompt agrees, auto chooses q8
tests/cli.cmake runs --cache under ASan (cli_act_check) and the two real files' verdicts in
Release (cli_act_check_models), where their forward passes take seconds, not a minute.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("tandem")
ap.add_argument("--cache", default="", help="model for the cache cases")
ap.add_argument("--default", default="", help="the default model (its q16 verdict)")
ap.add_argument("--qwen", default="", help="Qwen2.5-Coder 0.5B (its q8 verdict)")
ARGS = ap.parse_args()
BIN = ARGS.tandem
fails = 0


def check(ok, what, detail=""):
    global fails
    print(("ok   " if ok else "FAIL ") + what + ("" if ok else ": " + detail))
    if not ok:
        fails += 1


def generate(cache, model, act="auto", wait=True):
    env = dict(os.environ, TANDEM_CACHE=cache, TANDEM_CPU_ACT=act)
    p = subprocess.Popen([BIN, "generate", "--model", model, "--chat",
                          "What is the capital of France?", "--max-tokens", "12",
                          "--temperature", "0"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err


def chosen(err):
    """The mode auto chose, from its log line ("cpu_act auto: f32 (...)"), or None."""
    m = re.search(r"cpu_act auto: (f32|q8|q16)\b", err)
    return m.group(1) if m else None


def cache_cases(tmp, model):
    cache = os.path.join(tmp, "cache")
    rc, out, err = generate(cache, model)
    mode = chosen(err)
    check(rc == 0 and mode is not None and "comparing" in err,
          f"auto measures and chooses a mode ({mode})", err[-1500:])
    files = glob.glob(os.path.join(cache, "act", "*.act"))
    want = "\nact %s\n" % mode
    check(len(files) == 1 and want in open(files[0]).read(), "the verdict is cached",
          str(files))
    if len(files) != 1:
        return

    rc, out, err = generate(cache, model)
    check(rc == 0 and chosen(err) == mode and "cached in" in err and "comparing" not in err,
          "a second start reads the cache", err[-1500:])

    text = open(files[0]).read()
    flipped = "act %s" % ("f32" if mode != "f32" else "q8")
    with open(files[0], "w") as f:
        f.write(text.replace(want.strip(), flipped))  # a verdict changed by hand: the checksum
    rc, out, err = generate(cache, model)
    check(rc == 0 and "refused" in err and "comparing" in err and chosen(err) == mode,
          "a damaged cache file is refused and measured again", err[-1500:])
    def verdict(t):  # the file but the time the check took (and the checksum over it)
        return [l for l in t.splitlines() if not l.startswith(("check_ms", "end "))]
    check(verdict(open(files[0]).read()) == verdict(text), "and written again whole")

    cache2 = os.path.join(tmp, "cache2")
    procs = [generate(cache2, model, wait=False) for _ in range(2)]
    res = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    measured = sum("comparing" in e for _, e, _ in res)
    check(all(r == 0 and chosen(e) == mode for _, e, r in res) and measured == 1,
          "two processes starting together measure once", f"measured {measured}")

    rc, out, err = generate(cache, model, act="q4")
    check(rc == 1 and "TANDEM_CPU_ACT=q4" in err, "an unknown TANDEM_CPU_ACT is an error",
          f"rc {rc} {err[-500:]}")


if not (ARGS.cache or ARGS.default or ARGS.qwen):
    sys.exit("test_act_check.py: nothing to check (give --cache, --default or --qwen)")
with tempfile.TemporaryDirectory() as tmp:
    if ARGS.cache:
        cache_cases(tmp, ARGS.cache)
    if ARGS.default:
        rc, out, err = generate(os.path.join(tmp, "default"), ARGS.default)
        check(rc == 0 and chosen(err) == "q16" and "Paris" in out,
              "default model: auto chooses q16 (q8 answers the quick start's question wrongly)"
              " and the answer is Paris", err[-1500:] + out)
    if ARGS.qwen:
        rc, out, err = generate(os.path.join(tmp, "qwen"), ARGS.qwen)
        check(rc == 0 and chosen(err) == "q8" and "Paris" in out,
              "Qwen2.5-Coder 0.5B: auto chooses q8 and answers right", err[-1500:] + out)

print(f"{fails} failed")
sys.exit(1 if fails else 0)
