#!/usr/bin/env python3
"""make_malformed.py: a corpus of broken GGUF files for the reader's tests and the fuzzer.

Writes into --out:
  valid.gguf     a tiny synthetic model (make_synth --tiny, mixed types, explicit
                 general.alignment) plus one metadata key of every value type
  valid.expect   what a correct reader must report for it (gguf_expect.py format)
  NNN-*.gguf     mutations of valid.gguf, each breaking one thing: truncated at many offsets
                 (inside the header, metadata, tensor infos and data), wrong magic, versions
                 0/1/99, huge tensor/metadata counts, huge string and array lengths, unknown
                 value/element/tensor types, nested arrays, n_dims 0/5, zero and overflowing
                 dimensions, rows that are not whole blocks, offsets past the end or
                 misaligned, duplicate tensor names and keys, NUL bytes in names, bad
                 general.alignment; and a few valid variants (version 2, trailing bytes,
                 no tensors, header only)
  manifest.txt   one line per file: "<expect>\t<file>\t<description>", expect being
                 "error" (the reader must fail cleanly with a message), "ok" (it must
                 succeed) or "any" (either, without crashing: the mutation makes the rest of
                 the file parse as something else)

The offsets of every field are found by parsing valid.gguf here, independently of the C
reader. Usage: make_malformed.py --out DIR
"""
import argparse
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as VT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_synth  # noqa: E402
import gguf_expect  # noqa: E402

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
U64_MAX = 2**64 - 1


def extra_kv(w):
    """One key of every value type, with values at the edges of their ranges."""
    w.add_uint8("tandem.test.u8", 200)
    w.add_int8("tandem.test.i8", -100)
    w.add_uint16("tandem.test.u16", 60000)
    w.add_int16("tandem.test.i16", -30000)
    w.add_uint32("tandem.test.u32", 4000000000)
    w.add_int32("tandem.test.i32", -2000000000)
    w.add_uint64("tandem.test.u64", 2**40)
    w.add_uint64("tandem.test.u64big", U64_MAX)
    w.add_int64("tandem.test.i64", -(2**40))
    w.add_float32("tandem.test.f32", 1.5)
    w.add_float64("tandem.test.f64", 2.25)
    w.add_bool("tandem.test.bool", True)
    w.add_string("tandem.test.str", "h\u00e9llo w\u00f6rld")
    w.add_key_value("tandem.test.arr_f32", [1.0, -2.5, 3.25], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("tandem.test.arr_i64", [1, -2, 3], VT.ARRAY, sub_type=VT.INT64)
    w.add_key_value("tandem.test.arr_u8", [7], VT.ARRAY, sub_type=VT.UINT8)


class Layout:
    """Offsets of every field of a GGUF file (little-endian, version 2 or 3)."""

    def __init__(self, b):
        self.b = b
        pos = 24
        self.n_tensors, self.n_kv = struct.unpack_from("<QQ", b, 8)
        self.kvs = []
        for _ in range(self.n_kv):
            kv = {"start": pos}
            (klen,) = struct.unpack_from("<Q", b, pos)
            kv["key"] = b[pos + 8:pos + 8 + klen].decode()
            kv["key_off"] = pos + 8
            pos += 8 + klen
            kv["type_off"] = pos
            (t,) = struct.unpack_from("<I", b, pos)
            kv["type"] = t
            pos += 4
            kv["val_off"] = pos
            if t == VT.STRING:
                (n,) = struct.unpack_from("<Q", b, pos)
                pos += 8 + n
            elif t == VT.ARRAY:
                et, n = struct.unpack_from("<IQ", b, pos)
                kv["elem"], kv["n"], kv["n_off"] = et, n, pos + 4
                pos += 12
                kv["elems_off"] = pos
                if et == VT.STRING:
                    for _ in range(n):
                        (sl,) = struct.unpack_from("<Q", b, pos)
                        pos += 8 + sl
                else:
                    pos += n * SCALAR_SIZE[et]
            else:
                pos += SCALAR_SIZE[t]
            kv["end"] = pos
            self.kvs.append(kv)
        self.alignment = 32
        for kv in self.kvs:
            if kv["key"] == "general.alignment":
                (self.alignment,) = struct.unpack_from("<I", b, kv["val_off"])
        self.tensors = []
        for _ in range(self.n_tensors):
            t = {"start": pos}
            (nl,) = struct.unpack_from("<Q", b, pos)
            t["name"] = b[pos + 8:pos + 8 + nl].decode()
            t["name_off"] = pos + 8
            pos += 8 + nl
            t["ndims_off"] = pos
            (nd,) = struct.unpack_from("<I", b, pos)
            t["ndims"] = nd
            pos += 4
            t["dims_off"] = pos
            t["ne"] = list(struct.unpack_from(f"<{nd}Q", b, pos))
            pos += 8 * nd
            t["type_off"] = pos
            (t["type"],) = struct.unpack_from("<I", b, pos)
            pos += 4
            t["offset_off"] = pos
            (t["offset"],) = struct.unpack_from("<Q", b, pos)
            pos += 8
            blck, tsize = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t["type"])]
            t["nbytes"] = int(np.prod(t["ne"])) // blck * tsize
            self.tensors.append(t)
        self.info_end = pos
        self.data_start = (pos + self.alignment - 1) // self.alignment * self.alignment
        self.data_end = max(self.data_start + t["offset"] + t["nbytes"] for t in self.tensors)

    def kv(self, key):
        return next(k for k in self.kvs if k["key"] == key)

    def tensor(self, name):
        return next(t for t in self.tensors if t["name"] == name)


def patch(b, off, fmt, *vals):
    """A copy of b with struct fmt packed at off."""
    c = bytearray(b)
    struct.pack_into(fmt, c, off, *vals)
    return bytes(c)


def splice(b, L, off, n):
    """A copy of b without the n bytes at off (inside the metadata or tensor infos), the
    tensor data moved to the next aligned offset: tensor offsets are relative to the data
    section, so the file stays valid when the removed bytes were a whole value."""
    head = b[:off] + b[off + n:L.info_end]
    pad = (-len(head)) % L.alignment
    return head + b"\0" * pad + b[L.data_start:]


def build_corpus(out):
    os.makedirs(out, exist_ok=True)
    valid = os.path.join(out, "valid.gguf")
    make_synth.make_model(valid, "llama", tied=True, types="mixed", seed=7,
                          shapes=make_synth.TINY_SHAPES, alignment=32, extra_kv=extra_kv)
    gguf_expect.write_expect(valid, os.path.join(out, "valid.expect"))
    b = open(valid, "rb").read()
    L = Layout(b)
    assert L.data_end <= len(b), (L.data_end, len(b))

    entries = []

    def add(expect, slug, desc, data):
        name = f"{len(entries):03d}-{slug}.gguf"
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        entries.append((expect, name, desc))

    # --- truncations -------------------------------------------------------------------
    cuts = set(range(0, 25))                       # every offset inside the header
    for kv in L.kvs[:3] + L.kvs[-3:]:              # inside a few metadata entries
        cuts |= {kv["start"] + 4, kv["key_off"] + 1, kv["type_off"] + 2, kv["val_off"],
                 kv["end"] - 1}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.chat_template"):
        kv = L.kv(key)
        cuts |= {kv["val_off"] + 3, (kv["val_off"] + kv["end"]) // 2, kv["end"] - 1}
        if "n_off" in kv:
            cuts |= {kv["n_off"] + 4, kv["elems_off"] + 9}
    for t in L.tensors[:2] + L.tensors[-1:]:       # inside tensor infos, field by field
        cuts |= {t["start"] + 3, t["name_off"] + 2, t["ndims_off"] + 1, t["dims_off"] + 8,
                 t["type_off"] + 3, t["offset_off"], t["offset_off"] + 7}
    cuts |= {L.info_end, L.data_start, L.data_start + 1}
    for t in L.tensors:                            # inside each tensor's data
        s = L.data_start + t["offset"]
        cuts |= {s + t["nbytes"] // 2, s + t["nbytes"] - 1}
    cuts |= {L.data_end - 1}
    for c in sorted(x for x in cuts if x < L.data_end):
        add("error", f"trunc-{c}", f"truncated to {c} bytes (data ends at {L.data_end})", b[:c])

    # --- header --------------------------------------------------------------------------
    add("error", "magic-ggug", "wrong magic GGUG", b"GGUG" + b[4:])
    add("error", "magic-ggml", "wrong magic GGML (old format)", b"GGML" + b[4:])
    add("error", "magic-zero", "zero magic", b"\0\0\0\0" + b[4:])
    for v in (0, 1, 99):
        add("error", f"version-{v}", f"version {v}", patch(b, 4, "<I", v))
    add("ok", "version-2", "version 2 (same layout)", patch(b, 4, "<I", 2))
    for n in (2**63, 2**32, U64_MAX, 10**6):
        add("error", f"tensors-{n}", f"tensor count {n}", patch(b, 8, "<Q", n))
    for n in (2**63, 2**40, U64_MAX, 10**6):
        add("error", f"kvs-{n}", f"metadata count {n}", patch(b, 16, "<Q", n))
    add("any", "tensors-plus1", "one tensor more than present", patch(b, 8, "<Q", L.n_tensors + 1))
    add("any", "kvs-plus1", "one key more than present", patch(b, 16, "<Q", L.n_kv + 1))
    add("error", "kvs-minus1-tensors-plus1", "one key fewer, one tensor more",
        patch(patch(b, 16, "<Q", L.n_kv - 1), 8, "<Q", L.n_tensors + 1))

    # --- metadata ----------------------------------------------------------------------------
    name_kv = L.kv("general.name")
    for n in (2**63, U64_MAX, len(b)):
        add("error", f"strlen-{n}", f"general.name string length {n}",
            patch(b, name_kv["val_off"], "<Q", n))
    first = L.kvs[0]
    for n in (2**63, U64_MAX, 0):
        add("error", f"keylen-{n}", f"first key length {n}", patch(b, first["start"], "<Q", n))
    add("error", "key-nul", "NUL byte inside a key", patch(b, first["key_off"] + 2, "<B", 0))
    toks = L.kv("tokenizer.ggml.tokens")
    ttype = L.kv("tokenizer.ggml.token_type")
    for n in (2**62, 2**61 + 1, U64_MAX, toks["n"] * 4):
        add("error", f"strarr-{n}", f"token string array length {n}",
            patch(b, toks["n_off"], "<Q", n))
    for n in (2**62, 2**62 + 1, U64_MAX, 10**7):
        add("error", f"i32arr-{n}", f"token_type int32 array length {n}",
            patch(b, ttype["n_off"], "<Q", n))
    add("error", "strarr-elem-len", "token string element length past end of file",
        patch(b, toks["elems_off"], "<Q", 2**40))
    u8 = L.kv("tandem.test.u8")
    for t in (13, 255, 0xFFFFFFFF):
        add("error", f"vtype-{t}", f"unknown value type {t}", patch(b, u8["type_off"], "<I", t))
    for t in (13, 0xFFFFFFFF):
        add("error", f"elemtype-{t}", f"unknown array element type {t}",
            patch(b, ttype["val_off"], "<I", t))
    add("error", "nested-array", "array of arrays", patch(b, ttype["val_off"], "<I", VT.ARRAY))
    # duplicate key: rename tandem.test.i8 to tandem.test.u8 (same length)
    i8 = L.kv("tandem.test.i8")
    add("error", "dup-key", "the same key twice",
        patch(b, i8["key_off"] + len("tandem.test."), "<B", ord("u")))
    al = L.kv("general.alignment")
    for v in (0, 3, 48, 2**31 + 1):
        add("error", f"alignment-{v}", f"general.alignment {v}", patch(b, al["val_off"], "<I", v))
    add("error", "alignment-f32", "general.alignment stored as f32",
        patch(b, al["type_off"], "<I", VT.FLOAT32))
    add("error", "alignment-str", "general.alignment stored as a string",
        patch(b, al["type_off"], "<I", VT.STRING))

    # --- tensor infos ---------------------------------------------------------------------------
    q8 = next(t for t in L.tensors if t["type"] == gguf.GGMLQuantizationType.Q8_0)
    t2 = next(t for t in L.tensors if t["ndims"] == 2)
    t0 = L.tensors[0]
    for nd in (0, 5, 0xFFFFFFFF):
        add("error", f"ndims-{nd}", f"tensor '{t0['name']}' n_dims {nd}",
            patch(b, t0["ndims_off"], "<I", nd))
    add("error", "dim0-zero", f"tensor '{t2['name']}' ne[0] = 0", patch(b, t2["dims_off"], "<Q", 0))
    add("error", "dim1-zero", f"tensor '{t2['name']}' ne[1] = 0", patch(b, t2["dims_off"] + 8, "<Q", 0))
    add("error", "dims-overflow", f"tensor '{t2['name']}' ne = 2^32 x 2^32 (product overflows)",
        patch(b, t2["dims_off"], "<QQ", 2**32, 2**32))
    add("error", "dims-2^62x4", f"tensor '{t2['name']}' ne = 2^62 x 4",
        patch(b, t2["dims_off"], "<QQ", 2**62, 4))
    add("error", "dim-2^63", f"tensor '{t2['name']}' ne[1] = 2^63",
        patch(b, t2["dims_off"] + 8, "<Q", 2**63))
    add("error", "dim-umax", f"tensor '{t2['name']}' ne[1] = 2^64-1",
        patch(b, t2["dims_off"] + 8, "<Q", U64_MAX))
    add("error", "dims-large", f"tensor '{t2['name']}' ne[1] = 2^20 (data past end)",
        patch(b, t2["dims_off"] + 8, "<Q", 2**20))
    add("error", "dims-q8-2^58", f"Q8_0 tensor '{q8['name']}' ne[0] = 2^58 (bytes overflow)",
        patch(b, q8["dims_off"], "<Q", 2**58))
    add("error", "q8-partial-block", f"Q8_0 tensor '{q8['name']}' ne[0] = 33 (not whole blocks)",
        patch(b, q8["dims_off"], "<Q", 33))
    for ty in (4, 5, 31, 39, 40, 0xFFFFFFFF):
        add("error", f"ttype-{ty}", f"tensor '{t0['name']}' unknown type {ty}",
            patch(b, t0["type_off"], "<I", ty))
    last = max(L.tensors, key=lambda t: t["offset"])
    for off in (2**40, U64_MAX - 31, len(b) - L.data_start + 32 * 4):
        add("error", f"offset-{off}", f"tensor '{last['name']}' offset {off} (past end)",
            patch(b, last["offset_off"], "<Q", off))
    for d in (1, 16):
        add("error", f"offset-misaligned-{d}", f"tensor '{t0['name']}' offset + {d} (misaligned)",
            patch(b, t0["offset_off"], "<Q", t0["offset"] + d))
    add("error", "tname-nul", "NUL byte inside a tensor name",
        patch(b, t0["name_off"] + 1, "<B", 0))
    for n in (0, 2**63, U64_MAX):
        add("error", f"tnamelen-{n}", f"tensor name length {n}", patch(b, t0["start"], "<Q", n))
    # duplicate tensor name: blk.0.attn_k.weight -> blk.0.attn_q.weight
    k = L.tensor("blk.0.attn_k.weight")
    add("error", "dup-tensor", "the same tensor name twice",
        patch(b, k["name_off"] + len("blk.0.attn_"), "<B", ord("q")))

    # --- valid variants ----------------------------------------------------------------------------
    add("ok", "trailing-bytes", "valid file followed by 100 extra bytes", b + b"\x55" * 100)
    add("ok", "header-only", "header with no keys and no tensors",
        struct.pack("<IIQQ", 0x46554747, 3, 0, 0))
    add("error", "header-only-trunc", "23-byte header", struct.pack("<IIQQ", 0x46554747, 3, 0, 0)[:23])
    # keys only: cut the file after the metadata and set the tensor count to 0
    add("ok", "no-tensors", "all the keys, no tensors",
        patch(b[:L.kvs[-1]["end"]], 8, "<Q", 0))

    # empty values (the gguf writer cannot write them): splice the bytes out
    a8 = L.kv("tandem.test.arr_u8")
    add("ok", "empty-array", "a u8 array of 0 elements",
        splice(patch(b, a8["n_off"], "<Q", 0), L, a8["elems_off"], 1))
    st = L.kv("tandem.test.str")
    (slen,) = struct.unpack_from("<Q", b, st["val_off"])
    add("ok", "empty-string", "a string of 0 bytes",
        splice(patch(b, st["val_off"], "<Q", 0), L, st["val_off"] + 8, slen))

    with open(os.path.join(out, "manifest.txt"), "w") as f:
        f.write("# expect\tfile\tdescription (generated by make_malformed.py)\n")
        for e in entries:
            f.write("\t".join(e) + "\n")
    return len(entries)


def main():
    ap = argparse.ArgumentParser(description="write the malformed GGUF corpus")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    n = build_corpus(a.out)
    print(f"{a.out}: valid.gguf + {n} variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
