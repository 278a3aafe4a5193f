#!/usr/bin/env python3
"""vs_llamacpp.py: the engine and the numpy reference against llama.cpp itself.

llama.cpp is never part of the repository: give the directory of a llama.cpp source tree
built with its shared library (build/bin/libllama.so beside include/llama.h), for example
the sources of the llama-cpp-python sdist. Without --llama-dir, or when that directory
has no built library, the script prints "skipped" and exits 0 (CI has no llama.cpp).

A small C program (LOGITS_C below) is compiled against the library into a temporary
directory; for each model and prompt it writes llama.cpp's last-position logits (F32 KV
cache, flash attention off, so the whole computation is float32 on both sides when the
weights are F32) and its greedy tokens. For each model the script then reports:
  - relative L2 of the engine's last-position logits against llama.cpp's,
  - the same for ref_forward.py against llama.cpp,
  - whether the greedy tokens (--n-gen) are identical,
and fails (exit 1) when a relative L2 exceeds --tol (1e-4; 1e-3 for gemma3/2, ARCH_TOL) or a
greedy sequence differs.

The models: by default the synthetic F32 models of every dense architecture make_synth.py
writes (--arch), written into a temporary directory; --model adds real files.

Mixture-of-experts models (--arch qwen3moe,deepseek2, or single make_synth.MOE_VARIANTS
names such as deepseek2-yarn): an arch name runs all of its variants. For these (and for
every model under --no-engine) the numpy reference is checked too: its relative L2 must
stay below the tolerance and its greedy tokens must equal llama.cpp's; the smallest routing
gap the reference met (last selected vs first unselected expert or group score) is shown,
since a gap near float32 rounding would make a different choice no bug. --no-engine skips
the engine altogether (no --tandem needed). The default --arch runs every dense and MoE
architecture.

Usage: vs_llamacpp.py --tandem BIN [--llama-dir DIR] [--arch smollm3,granite,...]
                      [--model PATH ...] [--n-gen 16] [--tol 1e-4]
       vs_llamacpp.py --no-engine --llama-dir DIR --arch qwen3moe,deepseek2
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_synth  # noqa: E402
import ref_forward  # noqa: E402

LOGITS_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

static void quiet(enum ggml_log_level l, const char *t, void *u) { (void)l; (void)t; (void)u; }

static int argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* usage: prog MODEL IDS N_GEN OUT.f32 -> last-position logits in OUT, greedy ids on stdout */
int main(int argc, char **argv)
{
    if (argc != 5) return 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 4;
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_token ids[512];
    int n = 0;
    for (char *s = strtok(argv[2], ","); s && n < 512; s = strtok(NULL, ","))
        ids[n++] = atoi(s);
    if (llama_decode(ctx, llama_batch_get_one(ids, n))) return 5;
    float *lg = llama_get_logits_ith(ctx, -1);
    FILE *f = fopen(argv[4], "wb");
    if (!f || fwrite(lg, sizeof(float), (size_t)n_vocab, f) != (size_t)n_vocab) return 6;
    fclose(f);
    int n_gen = atoi(argv[3]);
    for (int i = 0; i < n_gen; i++) {
        llama_token t = argmax(lg, n_vocab);
        printf("%s%d", i ? " " : "", t);
        if (i + 1 == n_gen) break;
        if (llama_decode(ctx, llama_batch_get_one(&t, 1))) return 7;
        lg = llama_get_logits_ith(ctx, -1);
    }
    printf("\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""

SYNTH_ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3", "olmo2",
               "gemma2"]
# llama.cpp's CPU GELU rounds its input to f16 and reads a table (ggml-cpu/vec.h,
# GGML_GELU_FP16), so a GELU model differs from the exact float32 function by ~4e-4 there:
# the engine and ref_forward.py agree with each other to ~1e-6 on these models
ARCH_TOL = {"gemma3": 1e-3, "gemma2": 1e-3}


def build_helper(llama_dir, d):
    lib = os.path.join(llama_dir, "build", "bin")
    src = os.path.join(d, "llcpp_logits.c")
    exe = os.path.join(d, "llcpp_logits")
    with open(src, "w") as f:
        f.write(LOGITS_C)
    subprocess.run(["cc", "-O1", "-o", exe, src, "-I", os.path.join(llama_dir, "include"),
                    "-I", os.path.join(llama_dir, "ggml", "include"), "-L", lib, "-lllama",
                    "-Wl,-rpath," + lib], check=True)
    return exe


def prompts(n_vocab):
    rng = np.random.default_rng(1234)
    return [[1, 5, 100, 200, 300, 7, 8, 9, 10],
            [int(x) for x in rng.integers(3, n_vocab, size=40)]]


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {p.returncode}: {p.stderr[-1500:]}")
    return p.stdout


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare(a, helper, label, path, d, with_ref, tol, engine=True, check_ref=False):
    """Returns the number of failures for one model. engine: run the engine (a failure is
    fatal); check_ref: the numpy reference's rel L2 and greedy tokens against llama.cpp
    count as checks."""
    fails = 0
    ref = ref_forward.load(path) if with_ref else None
    n_vocab = ref.n_vocab if ref is not None else None
    for i, ids in enumerate(prompts(n_vocab or 32000)):
        s = ",".join(map(str, ids))
        out_l, out_t = os.path.join(d, "l.f32"), os.path.join(d, "t.f32")
        ll_toks = run([helper, path, s, str(a.n_gen), out_l]).split()
        ll = np.fromfile(out_l, dtype="<f4")
        msg = f"{label}[{i}] ({len(ids)} ids): "
        bad = False
        td_toks = None
        if engine:
            run([a.tandem, "logits", "--model", path, "--prompt-ids", s, "--out", out_t,
                 "--kv-type", "f32"])
            td = np.fromfile(out_t, dtype="<f4")
            gen = run([a.tandem, "generate", "--model", path, "--prompt-ids", s, "--max-tokens",
                       str(a.n_gen), "--ids", "--temperature", "0", "--kv-type", "f32",
                       "--ignore-eos"])
            td_toks = [ln for ln in gen.splitlines() if ln.strip()][-1].split()
            e_td = rel(td, ll)
            msg += f"tandem vs llama.cpp rel L2 {e_td:.2e}, "
            bad |= e_td > tol
        r_toks = None
        if ref is not None:
            ref.min_route_gap = np.inf
            e_ref = rel(ref.logits_last(ids), ll)
            msg += f"numpy ref vs llama.cpp {e_ref:.2e}"
            if check_ref:
                r_toks = [str(t) for t in ref.generate(ids, a.n_gen)[0]]
                bad |= e_ref > tol
            if ref.n_expert:
                msg += f" (min routing gap {ref.min_route_gap:.1e})"
            msg += ", "
        if td_toks is not None:
            same = td_toks == ll_toks
            msg += f"greedy {a.n_gen} {'identical' if same else 'DIFFER'}"
            bad |= not same
        if r_toks is not None:
            same_ref = r_toks == ll_toks
            msg += (", " if td_toks is not None else "") + \
                f"ref greedy {a.n_gen} {'identical' if same_ref else 'DIFFER'}"
            bad |= not same_ref
        msg = msg.rstrip(", ")
        fails += bad
        print(("FAIL  " if bad else "ok    ") + msg, flush=True)
        if td_toks is not None and td_toks != ll_toks:
            print(f"      llama.cpp {' '.join(ll_toks)}\n      tandem    {' '.join(td_toks)}")
        if r_toks is not None and r_toks != ll_toks:
            print(f"      llama.cpp {' '.join(ll_toks)}\n      numpy ref {' '.join(r_toks)}")
    return fails


def synth_models(names):
    """(label, arch, make_model kwargs) for --arch: a dense arch, an MoE arch (all of its
    MOE_VARIANTS) or one variant name."""
    out = []
    for name in names:
        if name in make_synth.MOE_ARCHS:
            for v in make_synth.MOE_VARIANTS:
                if make_synth.MOE_VARIANTS[v]["arch"] == name:
                    out.append((v, name, make_synth.variant_kwargs(v, types="f32", seed=1)))
        elif name in make_synth.MOE_VARIANTS:
            out.append((name, make_synth.MOE_VARIANTS[name]["arch"],
                        make_synth.variant_kwargs(name, types="f32", seed=1)))
        elif name in make_synth.ARCHS:
            kw = dict(arch=name, tied=name in ("smollm3", "gemma2"), types="f32", seed=1)
            if name in ("qwen3", "gemma3", "gemma2"):
                kw["head_dim"] = 64
            out.append((name, name, kw))
        else:
            raise SystemExit(f"vs_llamacpp: unknown --arch {name!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description="engine vs llama.cpp (logits, greedy)")
    ap.add_argument("--tandem", default="")
    ap.add_argument("--no-engine", action="store_true",
                    help="only the numpy reference against llama.cpp (no --tandem needed)")
    ap.add_argument("--llama-dir", default=os.environ.get("TANDEM_LLAMACPP_DIR", ""))
    ap.add_argument("--arch", default=",".join(SYNTH_ARCHS + list(make_synth.MOE_ARCHS)),
                    help="dense archs, MoE archs (all their variants) or MoE variant names")
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    if not a.no_engine and not a.tandem:
        ap.error("--tandem BIN is required (or --no-engine)")
    lib = os.path.join(a.llama_dir, "build", "bin", "libllama.so") if a.llama_dir else ""
    if not lib or not os.path.exists(lib):
        print(f"skipped: no llama.cpp build (--llama-dir {a.llama_dir!r})")
        return 0
    fails = 0
    with tempfile.TemporaryDirectory() as d:
        helper = build_helper(a.llama_dir, d)
        for label, arch, kw in synth_models([x for x in a.arch.split(",") if x]):
            path = os.path.join(d, f"{label}-f32.gguf")
            kw = dict(kw)
            make_synth.make_model(path, kw.pop("arch"), **kw)
            fails += compare(a, helper, f"{label}-f32", path, d, True,
                             max(a.tol, ARCH_TOL.get(arch, 0.0)), engine=not a.no_engine,
                             check_ref=a.no_engine or arch in make_synth.MOE_ARCHS)
        for path in a.model:
            fails += compare(a, helper, os.path.basename(path), path, d, False, a.tol,
                             engine=not a.no_engine)
    print(f"vs_llamacpp: {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
