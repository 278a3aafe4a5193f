#!/usr/bin/env python3
"""test_kquant_ref.py: the engine's K-quant and IQ4 dequantization against the gguf package's.

Writes a GGUF file holding random Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS tensors
(random bytes, so every scale, min and quant value occurs, with the fp16 scales d and dmin
replaced by random finite halves: either sign, subnormal ones, the largest ones), runs
`tandem dequant` on each and compares with gguf.quants.dequantize on the same bytes, bit
for bit. The bound is 0 ulp: every product d * scale * q is exact in float32 (at most 23
significant bits), so the only rounding is Q2_K/Q4_K/Q5_K's subtraction of dmin * min,
the same single step in numpy and in C whatever the compiler fuses
(kernels/cpu/cpu_kquant.c explains).

Usage: test_kquant_ref.py --tandem BIN [--seed N]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

QK_K = 256
# weights and bytes per block and the offsets of the fp16 scales inside it
LAYOUT = {QT.Q2_K: (QK_K, 84, (80, 82)), QT.Q3_K: (QK_K, 110, (108,)),
          QT.Q4_K: (QK_K, 144, (0, 2)), QT.Q5_K: (QK_K, 176, (0, 2)),
          QT.Q6_K: (QK_K, 210, (208,)), QT.IQ4_NL: (32, 18, (0,)),
          QT.IQ4_XS: (QK_K, 136, (0,))}


def random_halves(rng, n):
    """n random finite halves as uint16: a fifth subnormal, some the largest, either sign."""
    h = rng.integers(0, 0x7c00, size=n, dtype=np.uint16)
    h[rng.random(n) < 0.2] &= 0x03FF
    h[rng.random(n) < 0.05] = 0x7BFF
    h[rng.random(n) < 0.5] |= 0x8000
    return h


def random_tensor(rng, qtype, rows, cols):
    """(rows, cols / block * block bytes) uint8: random blocks with finite scales."""
    qk, bs, offs = LAYOUT[qtype]
    nb = rows * cols // qk
    blocks = rng.integers(0, 256, size=(nb, bs), dtype=np.uint8)
    for o in offs:
        blocks[:, o:o + 2] = random_halves(rng, nb).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // qk * bs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--seed", type=int, default=13)
    a = ap.parse_args()
    if not a.tandem or not os.access(a.tandem, os.X_OK):
        print(f"engine binary '{a.tandem}' is missing", file=sys.stderr)
        return 1
    rng = np.random.default_rng(a.seed)
    shapes = [(7, 5 * QK_K), (1, QK_K), (33, 3 * QK_K)]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kquant.gguf")
        w = gguf.GGUFWriter(path, "llama")
        tensors = {}
        for qtype in LAYOUT:
            for i, (rows, cols) in enumerate(shapes):
                name = f"{qtype.name.lower()}.{i}"
                q = random_tensor(rng, qtype, rows, cols)
                w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
                tensors[name] = (qtype, q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        for name, (qtype, q) in tensors.items():
            want = np.asarray(gguf.quants.dequantize(q, qtype), dtype=np.float32).reshape(-1)
            out = os.path.join(d, name + ".f32")
            cmd = [a.tandem, "dequant", "--model", path, "--tensor", name, "--out", out]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=120)
            if p.returncode != 0:
                print(f"FAIL {name}: `{' '.join(cmd)}` exited {p.returncode}: "
                      f"{p.stderr.strip()[-500:]}")
                failures += 1
                continue
            got = np.fromfile(out, dtype="<f4")
            if got.size != want.size:
                print(f"FAIL {name}: engine wrote {got.size} values, want {want.size}")
                failures += 1
                continue
            same = got.view(np.uint32) == want.view(np.uint32)
            if not same.all():
                i = int(np.argmin(same))
                print(f"FAIL {name} ({qtype.name}): {int((~same).sum())} of {want.size} values "
                      f"differ, first at {i}: {got[i]!r} vs {want[i]!r}")
                failures += 1
                continue
            print(f"ok   {name} ({qtype.name}, {want.size} values): bit-exact "
                  f"({int((want != 0).sum())} nonzero)")
    print(f"{len(tensors) - failures}/{len(tensors)} tensors bit-exact")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
