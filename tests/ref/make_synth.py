#!/usr/bin/env python3
"""make_synth.py: writes tiny synthetic GGUF models with random weights for the tests.

The files follow exactly the layout llama.cpp's converter produces for the Llama family
(tensor names, shapes, metadata keys), so the engine loads them like a real model and the
numpy reference in ref_forward.py can compute the same function independently:

  llama   NORM rope (pairs 2i, 2i+1), optional llama3 rope_freqs.weight
  qwen2   NEOX rope (pairs i, i+d/2), Q/K/V biases
  qwen3   NEOX rope, per-head RMSNorm of Q and K (attn_q_norm / attn_k_norm), explicit
          attention.key_length/value_length (head_dim != n_embd / n_head by default)
  gemma3  qwen3's attention plus post_attention_norm / post_ffw_norm, GELU FFN, embeddings
          scaled by sqrt(n_embd) at run time, attention.sliding_window (SWA_WINDOW, small
          so that the test prompts cross it) on all layers but every 6th
  smollm3 llama's block; layer 3 of the 6 (every 4th) has no rope
  granite llama's block with GRANITE_SCALES (embedding, attention, residual, logit)
  phi3    NEOX rope, fused attn_qkv (Q, K, V rows) and fused ffn_up (gate rows, then up)
  olmo2   no pre-norms; post_attention_norm / post_ffw_norm; NEOX rope; attn_q_norm and
          attn_k_norm over the whole projection (n_head * head_dim, n_head_kv * head_dim)

Default shapes split evenly for PP 2/3 (6 layers) and TP 2/4 (8 query heads, 4 KV heads,
n_ff 512), and every row-parallel slice (attn_output, ffn_down columns) stays a whole
number of 32-element quantization blocks.

The tokenizer is a minimal valid GPT-2 style byte-level BPE (pre "smollm"): 3 special
tokens, the 256 byte tokens in GPT-2 byte-to-unicode form, then merged tokens learned by a
few BPE steps on a fixed English text until the vocabulary is full.

Usage: make_synth.py --out PATH --arch ARCH (ARCHS) [--rope-freqs] [--tied]
                     [--types mixed|f32] [--seed N] [--tiny]
       make_synth.py --suite DIR     the models the tests use (see SUITE), plus
                                     llama.expect for the GGUF reader test
"""
import argparse
import collections
import os
import re
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

# Special tokens, in the order SmolLM2 numbers them.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Text the merges are learned from (any English text works; it only has to be fixed).
CORPUS = """
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital
of France is Paris, a city on the river Seine. Tell me a story about a little robot who
wanted to learn how to paint. Once upon a time there was a small robot that lived in a
workshop with an old painter. Every morning the painter mixed colors and the robot watched.
Numbers like 12, 345 and 2024 are split into digits. How many legs does a spider have?
A spider has eight legs. Write a haiku about the sea: waves fold into light, salt wind
carries the gull's cry, the tide keeps its time. Explain why the sky is blue: sunlight is
scattered by the molecules of the air, and blue light is scattered more than red light.
Hello, world! This is a test of the tokenizer, with punctuation; quotes "like this" and
apostrophes: it's, don't, we're, they'll, I'm, you've, she'd.
"""

# Shapes: the defaults satisfy the PP/TP divisibility above; --tiny is for the GGUF
# reader's malformed corpus and the fuzz seeds (small file, same structure).
DEFAULT_SHAPES = dict(n_embd=256, n_head=8, n_head_kv=4, head_dim=32, n_ff=512, n_layer=6,
                      n_vocab=512, n_ctx=512)
TINY_SHAPES = dict(n_embd=32, n_head=1, n_head_kv=1, head_dim=32, n_ff=32, n_layer=1,
                   n_vocab=264, n_ctx=64)

# Weight-matrix types cycled through in --types mixed (norms, biases and rope factors are
# always F32, as in llama.cpp's converter). 7 matrices per layer: with 8 types each role
# meets 6 of them over the 6 layers, and every type appears 5 or 6 times.
MIXED_CYCLE = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.F16, QT.BF16, QT.F32]
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3", "olmo2"]
# Embedding / LM-head types per architecture in --types mixed.
MIXED_EMBD = {"llama": QT.Q8_0, "qwen2": QT.Q4_0, "qwen3": QT.BF16, "gemma3": QT.Q8_0,
              "smollm3": QT.Q4_1, "granite": QT.F16, "phi3": QT.Q5_1, "olmo2": QT.Q8_0}
MIXED_OUTPUT = {"llama": QT.Q4_1, "qwen2": QT.F16, "qwen3": QT.Q8_0, "gemma3": QT.Q5_0,
                "smollm3": QT.Q8_0, "granite": QT.Q4_0, "phi3": QT.BF16, "olmo2": QT.Q5_1}
# granite's four scalars (the real 3.x files: embedding 12, attention 1/128 (head dim 128),
# residual 0.22, logit 8-16); milder here so that random weights keep greedy decoding
# from repeating one token: the embedding is written scaled down by the same factor
GRANITE_SCALES = dict(embedding=4.0, attention=0.15, residual=0.5, logit=2.5)
# archs whose Q, K RMSNorm is over the whole projection / per head
QK_NORM_WHOLE = ("olmo2",)
QK_NORM_HEAD = ("qwen3", "gemma3")
# gemma3's sliding window in the synthetic model: the 9- and 40-token prompts cross it
SWA_WINDOW = 8
# gemma3's post-norm weights: the blocks' outputs (rms ~ this after their post-norm) must
# outweigh the tied embedding scaled by sqrt(n_embd) (rms ~2), or every logit is dominated
# by the current token's own embedding and greedy decoding repeats it
POST_NORM = 3.0


def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer(n_vocab):
    """Returns (tokens, token_types, merges) for a byte-level BPE of exactly n_vocab tokens."""
    b2u = bytes_to_unicode()
    tokens = list(SPECIALS) + [b2u[b] for b in range(256)]
    types = [3] * len(SPECIALS) + [1] * 256  # 3 = control, 1 = normal
    if n_vocab < len(tokens):
        raise ValueError(f"vocab {n_vocab} is smaller than {len(tokens)} base tokens")
    known = set(tokens)
    merges = []

    # Pre-tokenize roughly like GPT-2 (digits alone, as smollm does) and learn merges.
    words = re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+",
                       CORPUS)
    counts = collections.Counter("".join(b2u[b] for b in w.encode()) for w in words)
    seqs = {w: list(w) for w in counts}
    while len(tokens) < n_vocab:
        pairs = collections.Counter()
        for w, c in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        # most frequent pair whose result is new; ties broken by the pair text
        best = None
        for (a, b), c in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
            if a + b not in known:
                best = (a, b)
                break
        if best is None:
            break
        a, b = best
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
        known.add(a + b)
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out

    # Corpus exhausted: pad with merges of two letters (always valid BPE merges).
    letters = [b2u[c] for c in b"etaoinshrdlucmfwypvbgkjqxz"]
    for a in letters:
        for b in letters:
            if len(tokens) >= n_vocab:
                break
            if a + b not in known:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
                types.append(1)
                known.add(a + b)
    assert len(tokens) == n_vocab, (len(tokens), n_vocab)
    return tokens, types, merges


def add_matrix(w, name, data, qtype):
    """Adds a 2-D weight (numpy shape (rows, ne0)) stored as qtype."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == QT.F32:
        w.add_tensor(name, data)
    elif qtype == QT.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def q6k_matrix(rng, rows, cols, std):
    """(rows, cols / 256 * 210) uint8 Q6_K super-blocks of random quants whose weights have
    about the given standard deviation (gguf cannot quantize to the K types; the engine's
    K-quant dequantizer is checked against gguf's elsewhere, so random quants suffice)."""
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, size=(nb, 210), dtype=np.uint8)
    sc = rng.integers(4, 17, size=(nb, 16)) * rng.choice([-1, 1], size=(nb, 16))
    blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    # q - 32 is uniform over [-32, 31] (std ~18.5); the scales' rms is ~11
    d = np.full(nb, std / (18.5 * 11.0), dtype=np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // 256 * 210)


def make_model(out, arch, rope_freqs=False, tied=False, types="mixed", seed=0, shapes=None,
               head_dim=None, alignment=None, extra_kv=None):
    """Writes one model to out. alignment: write general.alignment explicitly (the GGUF
    reader tests need the key); extra_kv: a function called with the writer to add more
    metadata."""
    s = dict(DEFAULT_SHAPES if shapes is None else shapes)
    if head_dim is not None:
        s["head_dim"] = head_dim
    n_embd, n_head, n_kv = s["n_embd"], s["n_head"], s["n_head_kv"]
    hd, n_ff, n_layer, n_vocab = s["head_dim"], s["n_ff"], s["n_layer"], s["n_vocab"]
    rng = np.random.default_rng(seed)
    eps = 1e-5 if arch in ("llama", "granite") else 1e-6
    freq_base = 10000.0 if arch in ("llama", "granite") else 1000000.0

    w = gguf.GGUFWriter(out, arch)
    # llama.cpp sets attributes of Phi-3's special tokens ("</s>", "<unk>", ...) in any model
    # whose name contains "phi3": not "phi3" here, so that llama.cpp loads this vocabulary
    w.add_name(f"tandem-synth-{arch}".replace("phi3", "phi_3"))
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(n_layer)
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if arch in ("qwen3", "gemma3") or hd * n_head != n_embd:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_dimension_count(hd)
    if arch == "gemma3":
        w.add_sliding_window(SWA_WINDOW)
    if arch == "granite":
        w.add_embedding_scale(GRANITE_SCALES["embedding"])
        w.add_attention_scale(GRANITE_SCALES["attention"])
        w.add_residual_scale(GRANITE_SCALES["residual"])
        w.add_logit_scale(GRANITE_SCALES["logit"])
    w.add_vocab_size(n_vocab)
    w.add_file_type(0 if types == "f32" else 1)

    tokens, ttypes, merges = build_tokenizer(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(0)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if extra_kv is not None:
        extra_kv(w)

    counter = [0]

    def wtype():
        """Next weight-matrix type: cycles through MIXED_CYCLE so every type appears in
        most roles across the layers."""
        if types == "f32":
            return QT.F32
        t = MIXED_CYCLE[counter[0] % len(MIXED_CYCLE)]
        counter[0] += 1
        return t

    def normal(shape, scale):
        return rng.standard_normal(shape).astype(np.float32) * np.float32(scale)

    def norm_weight(n, scale=1.0):
        return (scale * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    def row_par(name, rows, cols, std):
        """A row-parallel matrix (split by columns under TP): Q6_K in --types kquant, so
        that TP slices cut its 256-weight blocks and the loader re-quantizes them."""
        if types == "kquant":
            q = q6k_matrix(rng, rows, cols, std)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT.Q6_K)
        else:
            add_matrix(w, name, normal((rows, cols), std), wtype())

    # Scales keep the residual stream and the logits O(1): projections scaled by
    # 1/sqrt(fan_in), the embedding ~N(0, 1), the LM head a bit larger so the logits spread.
    # A tied embedding doubles as the LM head: scaled down like one, or every logit would
    # be dominated by the current token's own embedding and greedy decoding would repeat it.
    embd_t = MIXED_EMBD[arch] if types != "f32" else QT.F32
    # gemma3 multiplies the embedding by sqrt(n_embd) at run time: scaled down the same way
    embd_scale = 2.0 / np.sqrt(n_embd) if tied or arch == "gemma3" else 1.0
    if arch == "granite":
        embd_scale /= GRANITE_SCALES["embedding"]
    add_matrix(w, "token_embd.weight", normal((n_vocab, n_embd), embd_scale), embd_t)
    w.add_tensor("output_norm.weight", norm_weight(n_embd))
    if not tied:
        out_t = MIXED_OUTPUT[arch] if types != "f32" else QT.F32
        add_matrix(w, "output.weight", normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd)), out_t)
    if rope_freqs:
        # llama3 style: high-frequency pairs untouched, low-frequency ones slowed down
        ff = np.ones(hd // 2, dtype=np.float32)
        q = hd // 8
        ff[-2 * q:] = np.linspace(1.0, 8.0, 2 * q, dtype=np.float32)
        w.add_tensor("rope_freqs.weight", ff)

    post = arch in ("gemma3", "olmo2")
    for il in range(n_layer):
        p = f"blk.{il}."
        if arch != "olmo2":
            w.add_tensor(p + "attn_norm.weight", norm_weight(n_embd))
        wq = normal((n_head * hd, n_embd), 1.5 / np.sqrt(n_embd))
        wk = normal((n_kv * hd, n_embd), 1.5 / np.sqrt(n_embd))
        wv = normal((n_kv * hd, n_embd), 1.0 / np.sqrt(n_embd))
        if arch == "phi3":
            add_matrix(w, p + "attn_qkv.weight", np.concatenate([wq, wk, wv]), wtype())
        else:
            add_matrix(w, p + "attn_q.weight", wq, wtype())
            add_matrix(w, p + "attn_k.weight", wk, wtype())
            add_matrix(w, p + "attn_v.weight", wv, wtype())
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", normal(n_head * hd, 0.1))
            w.add_tensor(p + "attn_k.bias", normal(n_kv * hd, 0.1))
            w.add_tensor(p + "attn_v.bias", normal(n_kv * hd, 0.1))
        if arch in QK_NORM_HEAD:
            w.add_tensor(p + "attn_q_norm.weight", norm_weight(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm_weight(hd))
        if arch in QK_NORM_WHOLE:
            w.add_tensor(p + "attn_q_norm.weight", norm_weight(n_head * hd))
            w.add_tensor(p + "attn_k_norm.weight", norm_weight(n_kv * hd))
        row_par(p + "attn_output.weight", n_embd, n_head * hd, 0.5 / np.sqrt(n_head * hd))
        if post:
            w.add_tensor(p + "post_attention_norm.weight", norm_weight(n_embd, POST_NORM))
        if arch != "olmo2":
            w.add_tensor(p + "ffn_norm.weight", norm_weight(n_embd))
        gate = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        up = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        if arch == "phi3":
            add_matrix(w, p + "ffn_up.weight", np.concatenate([gate, up]), wtype())
        else:
            add_matrix(w, p + "ffn_gate.weight", gate, wtype())
            add_matrix(w, p + "ffn_up.weight", up, wtype())
        row_par(p + "ffn_down.weight", n_embd, n_ff, 0.5 / np.sqrt(n_ff))
        if post:
            w.add_tensor(p + "post_ffw_norm.weight", norm_weight(n_embd, POST_NORM))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The synthetic models the tests use: file name -> make_model arguments. The seeds are
# chosen so that greedy decoding of test_reference.py's prompts never meets a top-2 logit
# gap below 2e-3 (relative): a tie-break there would not be an engine bug.
SUITE = {
    "llama.gguf": dict(arch="llama", rope_freqs=True, tied=False, types="mixed", seed=6),
    "qwen2.gguf": dict(arch="qwen2", tied=False, types="mixed", seed=1),
    "qwen3.gguf": dict(arch="qwen3", tied=True, types="mixed", seed=1, head_dim=64),
    "llama-f32.gguf": dict(arch="llama", tied=True, types="f32", seed=3),
    # untied: with the tied head and the sqrt(n_embd) embedding scale, random weights make
    # every greedy step repeat the current token (the real gemma3 file tests the tied head)
    "gemma3.gguf": dict(arch="gemma3", tied=False, types="mixed", seed=1, head_dim=64),
    # 6 query heads over 2 KV heads: decode tp 3 gives rank 1 both KV heads (common/td_tp.h)
    "gqa.gguf": dict(arch="qwen2", tied=False, types="mixed", seed=2,
                     shapes=dict(DEFAULT_SHAPES, n_head=6, n_head_kv=2)),
    "smollm3.gguf": dict(arch="smollm3", tied=True, types="mixed", seed=3),
    "granite.gguf": dict(arch="granite", tied=False, types="mixed", seed=10),
    "phi3.gguf": dict(arch="phi3", tied=False, types="mixed", seed=1),
    "olmo2.gguf": dict(arch="olmo2", tied=False, types="mixed", seed=2),
}


def make_suite(d):
    import gguf_expect  # only the suite needs it
    os.makedirs(d, exist_ok=True)
    for name, kw in SUITE.items():
        make_model(os.path.join(d, name), **kw)
        print(os.path.join(d, name))
    gguf_expect.write_expect(os.path.join(d, "llama.gguf"), os.path.join(d, "llama.expect"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", metavar="DIR", help="write the test suite's models into DIR")
    ap.add_argument("--out")
    ap.add_argument("--arch", choices=ARCHS)
    ap.add_argument("--rope-freqs", action="store_true", help="add llama3 rope_freqs.weight")
    ap.add_argument("--tied", action="store_true", help="no output.weight (LM head = token_embd)")
    ap.add_argument("--types", choices=["mixed", "f32", "kquant"], default="mixed",
                    help="kquant: mixed, with attn_output and ffn_down in Q6_K")
    ap.add_argument("--n-ff", type=int, default=None, help="FFN width (default 512)")
    ap.add_argument("--n-head", type=int, default=None, help="query heads (default 8)")
    ap.add_argument("--n-head-kv", type=int, default=None, help="KV heads (default 4)")
    ap.add_argument("--n-vocab", type=int, default=None,
                    help="vocabulary size (default 512; odd: uneven vocab-parallel LM head)")
    ap.add_argument("--n-ctx", type=int, default=None,
                    help="context length (default 512): a request that runs to it lasts longer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=None,
                    help="per-head dim (default 32; qwen3 defaults to 64 != n_embd/n_head)")
    ap.add_argument("--tiny", action="store_true", help="a very small model (reader tests)")
    a = ap.parse_args()
    if a.suite:
        make_suite(a.suite)
        return 0
    if not a.out or not a.arch:
        ap.error("--out and --arch are required (or --suite DIR)")
    head_dim = a.head_dim
    if head_dim is None and a.arch in ("qwen3", "gemma3") and not a.tiny:
        head_dim = 64
    shapes = dict(TINY_SHAPES if a.tiny else DEFAULT_SHAPES)
    for k in ("n_ff", "n_head", "n_head_kv", "n_vocab", "n_ctx"):
        if getattr(a, k) is not None:
            shapes[k] = getattr(a, k)
    make_model(a.out, a.arch, rope_freqs=a.rope_freqs, tied=a.tied, types=a.types,
               seed=a.seed, shapes=shapes, head_dim=head_dim)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
