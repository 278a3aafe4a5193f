#!/usr/bin/env python3
"""gguf_expect.py: writes what a correct GGUF reader must report for a file.

The C reader test (tests/common/test_gguf.c) checks td_gguf against these lines, which
come from the gguf package's GGUFReader (an independent implementation). One fact per line,
fields separated by single spaces; strings are hex-encoded ("-" when empty):

  version V | alignment A | n_kv N | n_tensors N
  kv I KEY VTYPE                       every key, in file order, with its value type
  int KEY VALUE / uint KEY VALUE       integer scalars (signed / unsigned types)
  float KEY BITS                       F32/F64 scalars: the bits of float32(value), decimal
  bool KEY 0|1
  str KEY LEN HEX
  arr KEY ELEMTYPE N
  arrstr KEY I LEN HEX                 first, middle and last element of string arrays
  arrint KEY N SUM                     integer arrays whose elements all fit int32
  arrf32 KEY I BITS                    first, middle and last element of float arrays
  tensor NAME TYPE NDIMS NE0 NE1 NE2 NE3 FILE_OFFSET NBYTES CHECKSUM

CHECKSUM = sum over the tensor's bytes of byte[i] * (i % 251 + 1), modulo 2^64.
Usage: gguf_expect.py MODEL.gguf OUT.expect
"""
import struct
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as VT

INT_TYPES = {VT.UINT8: "uint", VT.UINT16: "uint", VT.UINT32: "uint", VT.UINT64: "uint",
             VT.INT8: "int", VT.INT16: "int", VT.INT32: "int", VT.INT64: "int"}
CHUNK = 251 * 4096  # a multiple of 251, so the weight pattern restarts in every chunk
_WEIGHTS = (np.arange(CHUNK, dtype=np.uint64) % 251) + 1


def checksum(data):
    """The CHECKSUM above over a uint8 array."""
    data = np.asarray(data).reshape(-1).view(np.uint8)
    total = 0
    for s in range(0, data.size, CHUNK):
        c = data[s:s + CHUNK].astype(np.uint64)
        total += int(np.dot(c, _WEIGHTS[:c.size]))
    return total % 2**64


def hexs(b):
    return b.hex() if b else "-"


def f32bits(v):
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def write_expect(path, out):
    r = gguf.GGUFReader(path)
    lines = []
    lines.append(f"version {int(r.fields['GGUF.version'].contents())}")
    lines.append(f"alignment {r.alignment}")
    fields = [(k, f) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    lines.append(f"n_kv {len(fields)}")
    lines.append(f"n_tensors {len(r.tensors)}")
    for i, (key, f) in enumerate(fields):
        vt = f.types[0]
        lines.append(f"kv {i} {key} {int(vt)}")
        if vt in INT_TYPES:
            lines.append(f"{INT_TYPES[vt]} {key} {int(f.parts[-1][0])}")
        elif vt in (VT.FLOAT32, VT.FLOAT64):
            lines.append(f"float {key} {f32bits(np.float32(f.parts[-1][0]))}")
        elif vt == VT.BOOL:
            lines.append(f"bool {key} {int(bool(f.parts[-1][0]))}")
        elif vt == VT.STRING:
            b = bytes(f.parts[-1])
            lines.append(f"str {key} {len(b)} {hexs(b)}")
        elif vt == VT.ARRAY:
            et = f.types[1] if len(f.types) > 1 else VT.UINT8
            n = len(f.data)
            lines.append(f"arr {key} {int(et)} {n}")
            picks = sorted({0, n // 2, n - 1}) if n else []
            if et == VT.STRING:
                for j in picks:
                    b = bytes(f.parts[f.data[j]])
                    lines.append(f"arrstr {key} {j} {len(b)} {hexs(b)}")
            elif et in INT_TYPES:
                vals = [int(f.parts[d][0]) for d in f.data]
                if all(-2**31 <= v < 2**31 for v in vals):
                    lines.append(f"arrint {key} {n} {sum(vals)}")
            elif et in (VT.FLOAT32, VT.FLOAT64):
                for j in picks:
                    lines.append(f"arrf32 {key} {j} {f32bits(np.float32(f.parts[f.data[j]][0]))}")
    for t in r.tensors:
        ne = [int(x) for x in t.shape] + [1] * (4 - len(t.shape))
        raw = np.asarray(r.data[t.data_offset:t.data_offset + t.n_bytes])
        lines.append(f"tensor {t.name} {int(t.tensor_type)} {len(t.shape)} "
                     f"{ne[0]} {ne[1]} {ne[2]} {ne[3]} {t.data_offset} {t.n_bytes} "
                     f"{checksum(raw)}")
    with open(out, "w") as fo:
        fo.write("\n".join(lines) + "\n")
    return len(lines)


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    n = write_expect(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {n} facts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
