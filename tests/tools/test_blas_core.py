#!/usr/bin/env python3
"""test_blas_core.py: a BLAS that misreads the CPU is corrected or reported (cpu_blas.h).

OpenBLAS on a VM that masks the CPU's model runs its "Prescott" kernels (no AVX) on an
AVX-512 machine; OPENBLAS_CORETYPE=Prescott makes any machine do the same. Then:
  - by default Tandem re-executes with the core for the CPU: bench-engine --json reports a
    core that fits, and the one OpenBLAS had chosen (blas_fixed_from);
  - TANDEM_BLAS_CORE=keep keeps Prescott: reported (blas_fits false) with a warning;
  - TANDEM_BLAS_CORE=Haswell asks for that core by name; a name that is no core is an error
    with exit status 1;
  - the start-up log says what runs (the node processes log the same lines: every process
    opens its model through kn_runtime_open).
usage: test_blas_core.py TANDEM_BIN MODEL.gguf
"""
import json
import os
import subprocess
import sys

BIN, MODEL = sys.argv[1], sys.argv[2]
fails = 0


def check(ok, what, detail=""):
    global fails
    print(("ok   " if ok else "FAIL ") + what + ("" if ok else ": " + detail))
    if not ok:
        fails += 1


def bench(**env):
    e = dict(os.environ)
    for k in ("OPENBLAS_CORETYPE", "TANDEM_BLAS_CORE", "TANDEM_BLAS_FIXED_FROM"):
        e.pop(k, None)
    e.update(env)
    p = subprocess.run([BIN, "bench-engine", "--model", MODEL, "--reps", "1", "--batch", "2",
                        "--gen", "4", "--json"], env=e, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


rc, out, err = bench()
check(rc == 0, "bench-engine runs", err[-2000:])
base = json.loads(out)
print(f"     this machine: cpu {base['cpu_isa']} ({base['cpu_features']}), "
      f"OpenBLAS core {base['blas_core']} ({base['blas_core_isa']})")
for k in ("cpu_isa", "cpu_features", "blas_core", "blas_core_isa", "blas_fits",
          "blas_fixed_from", "paths"):
    check(k in base, f"--json has {k}")
check("batch " in base["paths"] and "solo " in base["paths"],
      "--json names each weight type's products", base["paths"])

if base["cpu_isa"] in ("sse", "unknown"):
    # no core older than this CPU exists to correct: nothing more to test here
    print("     CPU without AVX: the correction cannot be exercised here")
else:
    rc, out, err = bench(OPENBLAS_CORETYPE="Prescott")
    j = json.loads(out) if rc == 0 else {}
    check(rc == 0 and j.get("blas_fits") is True and j.get("blas_core_isa") == base["cpu_isa"]
          and j.get("blas_fixed_from") == "Prescott",
          "OPENBLAS_CORETYPE=Prescott is corrected to the CPU's core",
          f"rc {rc}, {out.strip()} {err[-1000:]}")
    check("OpenBLAS chose Prescott" in err, "the correction is logged", err[-1000:])

    rc, out, err = bench(OPENBLAS_CORETYPE="Prescott", TANDEM_BLAS_CORE="keep")
    j = json.loads(out) if rc == 0 else {}
    check(rc == 0 and j.get("blas_core") == "Prescott" and j.get("blas_fits") is False
          and j.get("blas_fixed_from") == "",
          "TANDEM_BLAS_CORE=keep keeps Prescott and reports it", f"rc {rc}, {out.strip()}")
    check("older than this cpu" in err and "warn" in err, "the mismatch is a warning",
          err[-1000:])

    rc, out, err = bench(TANDEM_BLAS_CORE="Haswell")
    j = json.loads(out) if rc == 0 else {}
    check(rc == 0 and j.get("blas_core") == "Haswell", "TANDEM_BLAS_CORE=Haswell asks for it",
          f"rc {rc}, {out.strip()} {err[-500:]}")

rc, out, err = bench(TANDEM_BLAS_CORE="Pentium9000")
check(rc == 1 and "TANDEM_BLAS_CORE=Pentium9000" in err, "an unknown core name is an error",
      f"rc {rc}, {err[-500:]}")

# the start-up report, as every process logs it when it opens its model
e = dict(os.environ, OPENBLAS_CORETYPE="Prescott")
e.pop("TANDEM_BLAS_CORE", None)
e.pop("TANDEM_BLAS_FIXED_FROM", None)
p = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt", "hi", "--max-tokens", "2"],
                   env=e, capture_output=True, text=True, timeout=300)
check(p.returncode == 0 and "blas OpenBLAS core" in p.stderr and "products by weight type" in
      p.stderr, "generate logs what runs", p.stderr[-1000:])

print(f"{fails} failed")
sys.exit(1 if fails else 0)
