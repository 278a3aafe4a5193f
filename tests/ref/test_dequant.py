#!/usr/bin/env python3
"""test_dequant.py: the engine's dequantization against the gguf package's dequantizers.

`tandem dequant --model PATH --tensor NAME --out FILE.f32` writes a whole tensor as raw
little-endian float32; this compares it with gguf.quants.dequantize on the same bytes:

  F32, F16, BF16, Q8_0, Q4_0,  bit-exact (each value is one conversion or one product of an
  Q5_0                         fp16 scale and a small integer: exactly one rounding)
  Q4_1, Q5_1                   d * q + m has two roundings in numpy; a C compiler may fuse
                               them into one FMA (gcc contracts by default in gnu11), so each
                               value may differ by at most 2^-23 * (qmax |d| + |m|) of its
                               block (the product's rounding error; qmax 15 or 31); the
                               number of values that are bit-exact is printed

Tensors: every tensor of the synthetic mixed-type llama model (all eight types, most in
every role) and, with --model, one tensor of each type present in the default model plus
token_embd.weight (Q8_0) and output_norm.weight.

Usage: test_dequant.py --tandem BIN [--model PATH] [--synth-dir DIR]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402

EXACT = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q5_0}
# Types with a min m: (bytes per block, largest quant); d and m are the first two halves.
WITH_MIN = {QT.Q4_1: (20, 15), QT.Q5_1: (24, 31)}


def fma_bound(t):
    """Per-element allowed |difference| for a Q4_1/Q5_1 tensor (see the top comment)."""
    block_bytes, qmax = WITH_MIN[t.tensor_type]
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, block_bytes)  # (n_blocks, bytes)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    b = np.float32(2.0 ** -23) * (qmax * np.abs(d) + np.abs(m))
    return np.repeat(b, 32)


def check(tandem, model, t, timeout):
    """Returns (ok, message) for one tensor."""
    want = ref_forward.tensor_f32(t).reshape(-1)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "t.f32")
        cmd = [tandem, "dequant", "--model", model, "--tensor", t.name, "--out", out]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=timeout)
        if p.returncode != 0:
            return False, f"`{' '.join(cmd)}` exited {p.returncode}: {p.stderr.strip()[-500:]}"
        got = np.fromfile(out, dtype="<f4")
    name = f"{os.path.basename(model)}:{t.name} ({t.tensor_type.name}, {want.size} values)"
    if got.size != want.size:
        return False, f"{name}: engine wrote {got.size} values"
    same = got.view(np.uint32) == want.view(np.uint32)
    n_exact = int(same.sum())
    if t.tensor_type in EXACT:
        if n_exact == want.size:
            return True, f"{name}: bit-exact"
        i = int(np.argmin(same))
        return False, (f"{name}: {want.size - n_exact} values differ, first at {i}: "
                       f"{got[i]!r} vs {want[i]!r}")
    if t.tensor_type in WITH_MIN:
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bound = fma_bound(t)
        bad = diff > bound
        if not np.all(np.isfinite(got)) or bad.any():
            i = int(np.argmax(bad)) if bad.any() else int(np.argmax(~np.isfinite(got)))
            return False, (f"{name}: {int(bad.sum())} values beyond the FMA bound, first at "
                           f"{i}: {got[i]!r} vs {want[i]!r} (bound {bound[i]:.3e})")
        return True, f"{name}: {n_exact}/{want.size} bit-exact, rest within the FMA bound"
    return False, f"{name}: type {t.tensor_type.name} is not covered by this test"


def main():
    ap = argparse.ArgumentParser(description="engine dequantization vs gguf.quants")
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", default="", help="default model (empty: skip)")
    ap.add_argument("--synth-dir", default="", help="dir with llama.gguf (empty: skip)")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    if not os.access(a.tandem, os.X_OK):
        print(f"FAIL  engine binary {a.tandem!r} is missing or not executable")
        print("dequant: 0 passed, 1 failed")
        return 1

    jobs = []  # (model path, ReaderTensor)
    if a.synth_dir:
        path = os.path.join(a.synth_dir, "llama.gguf")
        if not os.path.exists(path):
            print(f"FAIL  synthetic model {path} is missing")
            print("dequant: 0 passed, 1 failed")
            return 1
        r = gguf.GGUFReader(path)
        jobs += [(path, t) for t in r.tensors]
        types = {t.tensor_type for t in r.tensors}
        missing = (EXACT | set(WITH_MIN)) - types
        if missing:
            print(f"FAIL  synthetic model lacks types {sorted(x.name for x in missing)}")
            return 1
    if a.model:
        r = gguf.GGUFReader(a.model)
        picked, seen = [], set()
        for t in r.tensors:
            if t.tensor_type not in seen or t.name in ("token_embd.weight", "output_norm.weight"):
                seen.add(t.tensor_type)
                picked.append(t)
        jobs += [(a.model, t) for t in picked]
    if not jobs:
        print("FAIL  nothing to test: give --model and/or --synth-dir")
        return 1

    passed = failed = 0
    for model, t in jobs:
        try:
            ok, msg = check(a.tandem, model, t, a.timeout)
        except Exception as e:  # timeout or unreadable output
            ok, msg = False, f"{t.name}: {e}"
        print(("ok    " if ok else "FAIL  ") + msg, flush=True)
        passed += ok
        failed += not ok
    print(f"dequant: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
