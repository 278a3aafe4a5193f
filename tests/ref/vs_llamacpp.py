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

Multi-token-prediction variants (deepseek2-mtp, deepseek2-mtp-head, deepseek2-mtp-echo: a
deepseek2 trunk plus one nextn block) get, after the rows above, one "mtp" row per prompt:
a C++ program (MTP_CPP) drives llama.cpp's MTP context as common/speculative.cpp's
draft-mtp does (LLAMA_CONTEXT_TYPE_MTP beside the target context, the target's h_nextn rows
shifted right by one with a zero row first, then the draft step at position n with
x_n = the target's greedy token, then --n-draft - 1 further drafts each fed the MTP's own
h_nextn) and writes the first draft's logits. Checked: the numpy reference's
RefModel.mtp_draft (float64) within --tol of them, the same x_n and the same greedy drafts;
with the engine, `tandem logits --mtp` within --tol and the same first draft. The numpy
reference's first-draft acceptance over --n-gen greedy target tokens is shown (information:
~0 for random MTP weights, ~1 for deepseek2-mtp-echo). Building MTP_CPP needs a C++
compiler and src/llama-ext.h of the tree; a tree without them fails the MTP rows.

Usage: vs_llamacpp.py --tandem BIN [--llama-dir DIR] [--arch smollm3,granite,...]
                      [--model PATH ...] [--n-gen 16] [--n-draft 4] [--tol 1e-4]
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

# What both programs share: the log silenced, argmax, and the context every comparison runs
# (F32 KV cache, flash attention off: float32 throughout with F32 weights), as f32_params().
PRELUDE = r"""
static void quiet(enum ggml_log_level l, const char *t, void *u) { (void)l; (void)t; (void)u; }

static int argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static struct llama_context_params f32_params(void)
{
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    return cp;
}
"""

LOGITS_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

@PRELUDE@

/* usage: prog MODEL IDS N_GEN OUT.f32 -> last-position logits in OUT, greedy ids on stdout */
int main(int argc, char **argv)
{
    if (argc != 5) return 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    struct llama_context_params cp = f32_params();
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

MTP_CPP = r"""
// llama.cpp's MTP first-draft logits, driven as common/speculative.cpp's draft-mtp does
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "llama.h"
#include "llama-ext.h"   // llama_set_embeddings_nextn, llama_get_embeddings_nextn(_ith)

@PRELUDE@

// one batch row: token id at pos with the hidden row h (the MTP's "embedding" input)
static int put(llama_batch_ext *b, llama_token id, llama_pos pos, const float *h, int n_embd,
               bool out)
{
    int idx = llama_batch_ext_add_token(b, 0, id);
    if (idx < 0) return idx;
    if (!llama_batch_ext_set_pos(b, idx, &pos)) return -10;
    llama_embd e = { h, 1, (size_t)n_embd };
    if (!llama_batch_ext_set_embd_token(b, idx, e)) return -11;
    if (out && !llama_batch_ext_set_output_logits(b, idx, true)) return -12;
    return idx;
}

/* usage: prog MODEL IDS N_DRAFT OUT.f32 -> OUT: the MTP's first-draft logits (n_vocab
   floats); stdout: "x_n d_1 .. d_N_DRAFT" (the target's greedy token after the prompt, then
   the MTP's greedy draft chain) */
int main(int argc, char **argv)
{
    if (argc != 5) return 2;
    if (!getenv("LLCPP_VERBOSE")) llama_log_set(quiet, NULL);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    if (llama_model_n_layer_nextn(model) != 1) return 13;
    llama_context_params cp = f32_params();
    llama_context *tgt = llama_init_from_model(model, cp);
    if (!tgt) return 4;
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;   // common_speculative_init_result's draft context
    cp.ctx_other = tgt;
    llama_context *dft = llama_init_from_model(model, cp);
    if (!dft) return 14;
    llama_set_embeddings_nextn(tgt, true, /*masked*/ false);
    llama_set_embeddings_nextn(dft, true, /*masked*/ true);

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_embd = llama_model_n_embd_out(model);
    std::vector<llama_token> ids;
    for (char *s = strtok(argv[2], ","); s; s = strtok(NULL, ",")) ids.push_back(atoi(s));
    const int n = (int)ids.size();
    const int n_draft = atoi(argv[3]);
    if (n < 1 || n_draft < 1) return 2;

    // the target over the prompt: x_n from its last logits, every row's h_nextn
    if (llama_decode(tgt, llama_batch_get_one(ids.data(), n))) return 5;
    const llama_token x_n = argmax(llama_get_logits_ith(tgt, -1), n_vocab);
    const float *h_tgt = llama_get_embeddings_nextn(tgt);
    if (!h_tgt) return 15;
    std::vector<float> h(h_tgt, h_tgt + (size_t)n * n_embd);

    // process(): the MTP's KV over the prompt, row p = (x_p, h_{p-1}), h_{-1} = 0 (pending_h)
    std::vector<float> zero((size_t)n_embd, 0.0f);
    llama_batch_ext *b = llama_batch_ext_init(dft);
    for (int p = 0; p < n; p++)
        if (put(b, ids[p], p, p ? &h[(size_t)(p - 1) * n_embd] : zero.data(), n_embd, false) < 0)
            return 16;
    if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, b)) return 17;

    // draft(): (x_n, h_{n-1}) at pos n, then each draft with the MTP's own h_nextn
    std::vector<float> hrow(h.end() - n_embd, h.end());
    llama_token tok = x_n;
    printf("%d", x_n);
    for (int i = 0; i < n_draft; i++) {
        llama_batch_ext_clear(b);
        int idx = put(b, tok, n + i, hrow.data(), n_embd, true);
        if (idx < 0) return 18;
        if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, b)) return 19;
        const float *ml = llama_get_logits_ith(dft, idx);
        const float *hn = llama_get_embeddings_nextn_ith(dft, idx);
        if (!ml || !hn) return 20;
        if (i == 0) {
            FILE *f = fopen(argv[4], "wb");
            if (!f || fwrite(ml, sizeof(float), (size_t)n_vocab, f) != (size_t)n_vocab) return 6;
            fclose(f);
        }
        tok = argmax(ml, n_vocab);
        printf(" %d", tok);
        memcpy(hrow.data(), hn, (size_t)n_embd * sizeof(float));
    }
    printf("\n");
    llama_batch_ext_free(b);
    llama_free(dft);
    llama_free(tgt);
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
        f.write(LOGITS_C.replace("@PRELUDE@", PRELUDE))
    subprocess.run(["cc", "-O1", "-o", exe, src, "-I", os.path.join(llama_dir, "include"),
                    "-I", os.path.join(llama_dir, "ggml", "include"), "-L", lib, "-lllama",
                    "-Wl,-rpath," + lib], check=True)
    return exe


def build_mtp_helper(llama_dir, d):
    """MTP_CPP built against the tree (its src/ for the staging header llama-ext.h)."""
    lib = os.path.join(llama_dir, "build", "bin")
    src = os.path.join(d, "llcpp_mtp.cpp")
    exe = os.path.join(d, "llcpp_mtp")
    with open(src, "w") as f:
        f.write(MTP_CPP.replace("@PRELUDE@", PRELUDE))
    p = subprocess.run(["c++", "-std=c++17", "-O1", "-o", exe, src,
                        "-I", os.path.join(llama_dir, "include"),
                        "-I", os.path.join(llama_dir, "ggml", "include"),
                        "-I", os.path.join(llama_dir, "src"), "-L", lib, "-lllama",
                        "-Wl,-rpath," + lib], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if p.returncode:
        raise RuntimeError(f"cannot build the llama.cpp MTP helper (a tree without MTP?):\n"
                           f"{p.stderr[-1500:]}")
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


def compare_mtp(a, helper, label, path, d, tol, engine=True):
    """The MTP rows of one MTP model (see the module docstring); returns the failures."""
    fails = 0
    ref = ref_forward.load(path, np.float64)
    for i, ids in enumerate(prompts(ref.n_vocab)):
        s = ",".join(map(str, ids))
        out_l, out_t = os.path.join(d, "mtp.f32"), os.path.join(d, "tmtp.f32")
        msg = f"{label}[{i}] mtp ({len(ids)} ids): "
        try:
            if helper is None:
                raise RuntimeError("no llama.cpp MTP helper (its build failed above)")
            ll_out = [int(t) for t in run([helper, path, s, str(a.n_draft), out_l]).split()]
        except Exception as e:
            print(f"FAIL  {msg}llama.cpp: {e}", flush=True)
            fails += 1
            continue
        ll_xn, ll_dr = ll_out[0], ll_out[1:]
        ll = np.fromfile(out_l, dtype="<f4")
        bad = False
        td_err = None
        if engine:
            try:
                run([a.tandem, "logits", "--model", path, "--prompt-ids", s, "--out", out_t,
                     "--kv-type", "f32", "--mtp"])
                td = np.fromfile(out_t, dtype="<f4")
                e_td = rel(td, ll) if td.shape == ll.shape else np.inf
                same = td.size == ll.size and int(np.argmax(td)) == ll_dr[0]
                msg += (f"tandem vs llama.cpp rel L2 {e_td:.2e}, first draft "
                        f"{'identical' if same else 'DIFFER'}, ")
                bad |= e_td > tol or not same
            except Exception as e:  # crashed, or refused --mtp: the error follows the row
                msg += "tandem FAILED, "
                td_err = str(e).strip()
                bad = True
        ref.min_route_gap = np.inf
        x_n, dr, first = ref.mtp_draft(ids, a.n_draft)
        e_ref = rel(first, ll)
        same_x = x_n == ll_xn
        same_dr = dr == ll_dr
        msg += (f"numpy ref vs llama.cpp {e_ref:.2e} (min routing gap {ref.min_route_gap:.1e}), "
                f"x_n {'identical' if same_x else 'DIFFER'}, "
                f"drafts {a.n_draft} {'identical' if same_dr else 'DIFFER'}")
        bad |= e_ref > tol or not same_x or not same_dr
        fails += bad
        print(("FAIL  " if bad else "ok    ") + msg, flush=True)
        if td_err:
            print("      " + td_err.replace("\n", "\n      "), flush=True)
        if not (same_x and same_dr):
            print(f"      llama.cpp x_n {ll_xn} drafts {ll_dr}\n"
                  f"      numpy ref x_n {x_n} drafts {dr}")
    # information: how often the numpy MTP's first draft is the target's next greedy token
    hit, n = ref_forward.mtp_acceptance(ref, prompts(ref.n_vocab)[0], a.n_gen)
    print(f"      {label}: numpy MTP first draft = target's next greedy token {hit}/{n} "
          f"(prompt 0, {a.n_gen} tokens)", flush=True)
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
    ap.add_argument("--n-draft", type=int, default=4,
                    help="MTP models: greedy drafts compared with llama.cpp's")
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
        mtp_helper = False  # built on the first MTP model
        for label, arch, kw in synth_models([x for x in a.arch.split(",") if x]):
            path = os.path.join(d, f"{label}-f32.gguf")
            kw = dict(kw)
            make_synth.make_model(path, kw.pop("arch"), **kw)
            fails += compare(a, helper, f"{label}-f32", path, d, True,
                             max(a.tol, ARCH_TOL.get(arch, 0.0)), engine=not a.no_engine,
                             check_ref=a.no_engine or arch in make_synth.MOE_ARCHS)
            if (kw.get("shapes") or {}).get("mtp"):
                if mtp_helper is False:
                    try:
                        mtp_helper = build_mtp_helper(a.llama_dir, d)
                    except Exception as e:
                        print(f"FAIL  {e}", flush=True)
                        mtp_helper = None
                        fails += 1
                fails += compare_mtp(a, mtp_helper, f"{label}-f32", path, d, a.tol,
                                     engine=not a.no_engine)
        for path in a.model:
            fails += compare(a, helper, os.path.basename(path), path, d, False, a.tol,
                             engine=not a.no_engine)
    print(f"vs_llamacpp: {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
