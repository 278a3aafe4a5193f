#!/usr/bin/env python3
"""test_act_check.py: cpu_act auto measures, per model, whether the q8 activation mode keeps
the model's greedy answers, caches the verdict, and serves in the mode it chose
(kernels/act_check.h).

  - the default model (SmolLM2-135M Q4_1) answers the quick start's question wrongly in q8:
    auto chooses f32, and the answer is "Paris";
  - with Qwen2.5-Coder 0.5B (when given) every prompt agrees: auto chooses q8;
  - the verdict is cached: a second start reads it; a damaged file is refused and measured
    again; two processes that start together measure once (the lock);
  - TANDEM_CPU_ACT with an unknown value is an error.
usage: test_act_check.py TANDEM_BIN DEFAULT_MODEL.gguf|- [QWEN05.gguf]
  ("-": the default model's cases are not run; tests/cli.cmake runs them under ASan and the
  Qwen case in Release)
"""
import glob
import os
import subprocess
import sys
import tempfile

BIN, MODEL = sys.argv[1], sys.argv[2]
QWEN = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
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


def default_model_cases(tmp):
    cache = os.path.join(tmp, "c1")
    rc, out, err = generate(cache, MODEL)
    check(rc == 0 and "cpu_act auto: f32" in err and "comparing" in err,
          "default model: auto measures and chooses f32", err[-1500:])
    check("Paris" in out, "default model: the quick start's answer", out)
    files = glob.glob(os.path.join(cache, "act", "*.act"))
    check(len(files) == 1 and "\nq8 0\n" in open(files[0]).read(), "the verdict is cached",
          str(files))

    rc, out, err = generate(cache, MODEL)
    check(rc == 0 and "cpu_act auto: f32" in err and "cached in" in err and "comparing" not in err,
          "a second start reads the cache", err[-1500:])

    text = open(files[0]).read()
    with open(files[0], "w") as f:
        f.write(text.replace("q8 0", "q8 1"))  # a verdict changed by hand: the checksum
    rc, out, err = generate(cache, MODEL)
    check(rc == 0 and "refused" in err and "cpu_act auto: f32" in err,
          "a damaged cache file is refused and measured again", err[-1500:])
    def verdict(t):  # the file but the time the check took (and the checksum over it)
        return [l for l in t.splitlines() if not l.startswith(("check_ms", "end "))]
    check(verdict(open(files[0]).read()) == verdict(text), "and written again whole")

    cache2 = os.path.join(tmp, "c2")
    procs = [generate(cache2, MODEL, wait=False) for _ in range(2)]
    res = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    measured = sum("comparing" in e for _, e, _ in res)
    check(all(r == 0 and "cpu_act auto: f32" in e for _, e, r in res) and measured == 1,
          "two processes starting together measure once", f"measured {measured}")

    rc, out, err = generate(cache, MODEL, act="q4")
    check(rc == 1 and "TANDEM_CPU_ACT=q4" in err, "an unknown TANDEM_CPU_ACT is an error",
          f"rc {rc} {err[-500:]}")


if MODEL == "-" and not QWEN:
    sys.exit("test_act_check.py: nothing to check (no default model and no Qwen file)")
with tempfile.TemporaryDirectory() as tmp:
    if MODEL != "-":
        default_model_cases(tmp)
    if QWEN:
        cache = os.path.join(tmp, "c1")
        rc, out, err = generate(cache, QWEN)
        check(rc == 0 and "cpu_act auto: q8" in err and "Paris" in out,
              "Qwen2.5-Coder 0.5B: auto chooses q8 and answers right", err[-1500:] + out)
    else:
        print("     no Qwen2.5-Coder 0.5B file given: its q8 verdict not checked")

print(f"{fails} failed")
sys.exit(1 if fails else 0)
