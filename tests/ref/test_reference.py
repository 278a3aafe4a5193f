#!/usr/bin/env python3
"""test_reference.py: the engine's correctness test against the numpy reference.

For the default model (--model) and for the synthetic models in --synth-dir (llama with
rope_freqs, qwen2, qwen3, gemma3 with a sliding window of 8, smollm3, granite, phi3, olmo2,
qwen3moe, deepseek2, gemma2 (soft-capped, a sliding window of 8 on its even layers),
deepseek2-mtp (deepseek2 plus an MTP block);
mixed weight types), and a fixed set of prompts given as token
ids (tokenized here with the GGUF's vocabulary, independent of the C tokenizer):

  1. `tandem logits --prompt-ids ... --kv-type f32` must give last-position logits with a
     relative L2 error below --tol (1e-3) against ref_forward.py;
  2. `tandem generate --prompt-ids ... --max-tokens 32 --ids --temperature 0 --kv-type f32`
     must produce the reference's greedy tokens. The engine may stop at an end-of-generation
     token (EOS or any control token); the comparison then ends there. If the sequences
     part at a step where the reference's top two logits are within --tie-tol (relative),
     the difference is a tie-break, not an engine bug: it is reported, not failed;
  3. with --kv-type f16 (one prompt per model) the logits error must stay below --f16-tol;
  4. models with a multi-token-prediction block (nextn_predict_layers, deepseek2-mtp): also
     `tandem logits ... --mtp` (the MTP's first-draft logits: the target runs the prompt and
     picks x_n greedily, the MTP block drafts the token after it; ref_forward.py's
     RefModel.mtp_draft) under the same tolerances, every prompt with f32 KV and the first
     with f16. An engine that refuses --mtp on such a model fails the check.

Prints every check's figures, the worst error, and "reference: N passed, M failed";
exits 1 if anything failed (including a missing or crashing engine).

Usage: test_reference.py --tandem BIN [--model PATH [--prompts 0,1,6] [--label NAME]]
                         [--synth-dir DIR] [--threads N]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402
import ref_tokenizer  # noqa: E402

# Default-model prompts: five chat turns, one plain continuation, one long prompt (several
# KV blocks). Chosen so the greedy continuations have no near-ties.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Tell me a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
    "Give me three tips for learning a new language.",
]
TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time,",
    ("Gravity is the force by which a planet or other body draws objects toward its "
     "center. The force of gravity keeps all of the planets in orbit around the sun. "
     "Earth's gravity is what keeps you on the ground and what makes things fall. "
     "Anything that has mass also has gravity. Objects with more mass have more gravity. "
     "Gravity also gets weaker with distance. So, the closer objects are to each other, "
     "the stronger their gravitational pull is. Earth's gravity comes from all its mass. "
     "All its mass makes a combined gravitational pull on all the mass in your body. "
     "That's what gives you weight. And if you were on a planet with less mass than "
     "Earth, you would weigh less than you do here. In summary, gravity is"),
]

SYNTH_MODELS = ["llama.gguf", "qwen2.gguf", "qwen3.gguf", "llama-f32.gguf", "gemma3.gguf",
                "smollm3.gguf", "granite.gguf", "phi3.gguf", "olmo2.gguf", "qwen3moe.gguf",
                "deepseek2.gguf", "gemma2.gguf", "deepseek2-mtp.gguf"]


def synth_prompts(n_vocab):
    """Fixed id prompts for the synthetic models: a single token, a short one starting
    with <|im_start|>, and 40 pseudo-random ids."""
    rng = np.random.default_rng(1234)
    return [[500], [1, 5, 100, 200, 300, 7, 8, 9, 10],
            [int(x) for x in rng.integers(3, n_vocab, size=40)]]


class Runner:
    def __init__(self, args):
        self.a = args
        self.passed = 0
        self.failed = 0
        self.worst = (0.0, "")
        self.ties = []

    def ok(self, msg):
        self.passed += 1
        print("ok    " + msg, flush=True)

    def fail(self, msg):
        self.failed += 1
        print("FAIL  " + msg, flush=True)

    def tandem(self, argv):
        cmd = [self.a.tandem] + argv
        if self.a.threads:
            cmd += ["--threads", str(self.a.threads)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=self.a.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {p.returncode}:\n{p.stderr[-2000:]}")
        return p.stdout

    def engine_logits(self, model, ids, kv_type, mtp=False):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "logits.f32")
            self.tandem(["logits", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
                         "--out", out, "--kv-type", kv_type] + (["--mtp"] if mtp else []))
            return np.fromfile(out, dtype="<f4")

    def engine_generate(self, model, ids, n, kv_type):
        out = self.tandem(["generate", "--model", model, "--prompt-ids",
                           ",".join(map(str, ids)), "--max-tokens", str(n), "--ids",
                           "--temperature", "0", "--kv-type", kv_type])
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if not lines:
            return []
        return [int(x) for x in lines[-1].split()]

    def check_logits(self, name, model, ref, ids, kv_type, tol, mtp=False):
        """Last-position logits, or with mtp the MTP's first-draft logits."""
        what = "mtp logits" if mtp else "logits"
        try:
            got = self.engine_logits(model, ids, kv_type, mtp)
        except Exception as e:  # engine missing, crashed, timed out or refused --mtp
            self.fail(f"{name} {what} kv={kv_type}: {e}")
            return
        want = ref.mtp_draft(ids)[2].astype(np.float32) if mtp else ref.logits_last(ids)
        if got.shape != want.shape:
            self.fail(f"{name} {what} kv={kv_type}: {got.size} values, expected {want.size}")
            return
        if not np.all(np.isfinite(got)):
            self.fail(f"{name} {what} kv={kv_type}: non-finite values")
            return
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        same_top = int(np.argmax(got)) == int(np.argmax(want))
        msg = (f"{name} {what} kv={kv_type}: rel L2 err {rel:.3e} (tol {tol:.0e}), "
               f"argmax {int(np.argmax(got))} vs ref {int(np.argmax(want))}")
        if kv_type == "f32" and rel > self.worst[0]:
            self.worst = (rel, f"{name} {what}" if mtp else name)
        if rel < tol:
            self.ok(msg)
        else:
            self.fail(msg)
        if not same_top and rel < tol:
            print(f"      note: argmax differs within tolerance", flush=True)

    def check_greedy(self, name, model, ref, ids, n):
        want, step_logits = ref.generate(ids, n)
        try:
            got = self.engine_generate(model, ids, n, "f32")
        except Exception as e:
            self.fail(f"{name} greedy: {e}")
            return
        # smallest relative top-2 gap the reference met, to show how safe the prompt is
        gaps = []
        for lg in step_logits:
            top2 = np.sort(lg)[-2:]
            gaps.append((top2[1] - top2[0]) / max(abs(top2[1]), 1.0))
        stops = ref.control_ids | ({ref.eos} if ref.eos is not None else set())
        desc = f"{name} greedy {n}: min top-2 gap {min(gaps):.1e}"
        if len(got) > n:
            self.fail(f"{desc}: engine produced {len(got)} tokens > {n}")
            return
        k = 0
        while k < len(got) and got[k] == want[k]:
            k += 1
        if k == len(got):
            if k == n:
                self.ok(f"{desc}: {n} tokens equal")
            elif k > 0 and want[k - 1] in stops or want[k] in stops:
                self.ok(f"{desc}: equal up to end-of-generation after {k} tokens")
            else:
                self.fail(f"{desc}: engine stopped after {k} tokens; reference goes on with "
                          f"{want[k:k + 5]}")
            return
        lg = step_logits[k]
        gap = float(lg[want[k]] - lg[got[k]])
        rel_gap = gap / max(abs(float(lg[want[k]])), 1.0)
        where = (f"step {k}: engine {got[k]} vs ref {want[k]} (ref logits {lg[got[k]]:.5f} vs "
                 f"{lg[want[k]]:.5f}, rel gap {rel_gap:.1e})")
        if rel_gap <= self.a.tie_tol:
            self.ties.append(f"{name} {where}")
            self.ok(f"{desc}: NEAR-TIE at {where}; not an engine bug, first {k} tokens equal")
        else:
            self.fail(f"{desc}: differs at {where}\n      ref    {want}\n      engine {got}")

    def run_model(self, label, model, prompts):
        try:
            ref = ref_forward.load(model)
        except Exception as e:
            self.fail(f"{label}: reference cannot load {model}: {e}")
            return
        mtp = ref.n_nextn > 0
        for i, ids in enumerate(prompts):
            name = f"{label}[{i}] ({len(ids)} ids)"
            self.check_logits(name, model, ref, ids, "f32", self.a.tol)
            self.check_greedy(name, model, ref, ids, self.a.n_gen)
            if mtp:
                self.check_logits(name, model, ref, ids, "f32", self.a.tol, mtp=True)
        if not self.a.no_f16:
            self.check_logits(f"{label}[0]", model, ref, prompts[0], "f16", self.a.f16_tol)
            if mtp:
                self.check_logits(f"{label}[0]", model, ref, prompts[0], "f16", self.a.f16_tol,
                                  mtp=True)


def main():
    ap = argparse.ArgumentParser(description="engine vs numpy reference")
    ap.add_argument("--tandem", required=True, help="the tandem binary")
    ap.add_argument("--model", default="", help="default model (empty: skip)")
    ap.add_argument("--synth-dir", default="", help="dir with llama/qwen2/qwen3.gguf (empty: skip)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max rel L2 logits error, f32 KV")
    ap.add_argument("--f16-tol", type=float, default=1e-2, help="same with f16 KV")
    ap.add_argument("--no-f16", action="store_true", help="skip the f16 KV checks")
    ap.add_argument("--tie-tol", type=float, default=1e-4,
                    help="relative top-2 gap under which a greedy difference is a tie")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per engine call, seconds")
    ap.add_argument("--prompts", default="",
                    help="--model prompts to run, by index (e.g. 0,1,6; empty: all): the numpy "
                         "reference of a larger model costs ~30 s per prompt on 2 cores")
    ap.add_argument("--label", default="default", help="name of the --model in the report")
    a = ap.parse_args()

    if not os.access(a.tandem, os.X_OK):
        print(f"FAIL  engine binary {a.tandem!r} is missing or not executable")
        print("reference: 0 passed, 1 failed")
        return 1
    if not a.model and not a.synth_dir:
        print("FAIL  nothing to test: give --model and/or --synth-dir")
        return 1

    r = Runner(a)
    if a.model:
        tok = ref_tokenizer.from_gguf(a.model)
        enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        prompts = [enc(ref_tokenizer.chatml(p)) for p in CHAT_PROMPTS]
        prompts += [enc(p) for p in TEXT_PROMPTS]
        if a.prompts:
            keep = [int(i) for i in a.prompts.split(",")]
            if any(i < 0 or i >= len(prompts) for i in keep):
                print(f"FAIL  --prompts {a.prompts}: indices are 0..{len(prompts) - 1}")
                return 1
            prompts = [prompts[i] for i in keep]
        r.run_model(a.label, a.model, prompts)
    if a.synth_dir:
        for f in SYNTH_MODELS:
            path = os.path.join(a.synth_dir, f)
            if not os.path.exists(path):
                r.fail(f"synthetic model {path} is missing (run the synth_models fixture)")
                continue
            n_vocab = ref_forward.load(path).n_vocab
            r.run_model(f[:-5], path, synth_prompts(n_vocab))

    print(f"worst f32 logits rel L2 error: {r.worst[0]:.3e} ({r.worst[1]})")
    for t in r.ties:
        print(f"near-tie (reported, not failed): {t}")
    print(f"reference: {r.passed} passed, {r.failed} failed")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
