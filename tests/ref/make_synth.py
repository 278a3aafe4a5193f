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
  gemma2  gemma3's block without the Q/K norms, with the metadata Gemma2Model
          (conversion/gemma.py) writes: no rope keys (base 10000), attention.sliding_window
          (SWA_WINDOW; llama.cpp makes the even layers sliding), attn_logit_softcapping and
          final_logit_softcapping (GEMMA2_SOFTCAPS, small enough to bite); always tied (the
          converter writes no output.weight, llama.cpp reads none), so its post-norm
          weights are larger (GEMMA2_POST_NORM)
  smollm3 llama's block; layer 3 of the 6 (every 4th) has no rope
  granite llama's block with GRANITE_SCALES (embedding, attention, residual, logit)
  phi3    NEOX rope, fused attn_qkv (Q, K, V rows) and fused ffn_up (gate rows, then up)
  olmo2   no pre-norms; post_attention_norm / post_ffw_norm; NEOX rope; attn_q_norm and
          attn_k_norm over the whole projection (n_head * head_dim, n_head_kv * head_dim)

Mixture-of-experts architectures (make_moe_model; shapes from MOE_SHAPES, the named test
variants in MOE_VARIANTS):
  qwen3moe  qwen3's attention (NEOX rope, per-head Q/K RMSNorm, head_dim 64); every FFN a
            routed MoE: ffn_gate_inp (F32 router), softmax over the experts, top-k, weights
            renormalized; 3-D ffn_{gate,up,down}_exps. 4 layers, 8 experts top-2 (or 16 top-4),
            expert FFN width 128 (TP 2/4 cut ffn_down_exps into whole 32-blocks)
  deepseek2 MLA attention in the layout llama.cpp's converter writes today: attn_q, or
            attn_q_a / attn_q_a_norm / attn_q_b (q_lora_rank > 0); attn_kv_a_mqa (compressed
            KV then the shared rope key), attn_kv_a_norm, per-head attn_k_b / attn_v_b;
            NORM rope on the qk_rope_head_dim trailing dims of each query head and on the
            shared rope key; optional YaRN (DeepSeek-V2-Lite's parameters). Dense leading
            layers (leading_dense_block_count), then routed experts (sigmoid or softmax
            gating, exp_probs_b selection bias, group-limited top-k, normalized and scaled
            weights) plus shared experts (ffn_*_shexp). Optionally one multi-token-prediction
            block (nextn_predict_layers 1, blk.{n_layer}: a MoE layer plus nextn.eh_proj,
            enorm, hnorm, shared_head_norm, optional nextn.embed_tokens / shared_head_head;
            make_moe_model says which variant has which), and the oracle deepseek2-mtp-echo
            whose MTP block drafts the target's own next token (ECHO_TAIL)

--types mixed quantizes the 3-D expert tensors row by row like the 2-D matrices: gate/up
experts (rows of n_embd, whole 256-blocks) cycle through Q4_K, Q8_0 and Q4_0, down experts
(rows of n_ff_exp, which TP cuts) through 32-block types; routers and biases stay F32 as the
converter keeps them.

Default shapes split evenly for PP 2/3 (6 layers) and TP 2/4 (8 query heads, 4 KV heads,
n_ff 512), and every row-parallel slice (attn_output, ffn_down columns) stays a whole
number of 32-element quantization blocks.

The tokenizer is a minimal valid GPT-2 style byte-level BPE (pre "smollm"): 3 special
tokens, the 256 byte tokens in GPT-2 byte-to-unicode form, then merged tokens learned by a
few BPE steps on a fixed English text until the vocabulary is full.

Usage: make_synth.py --out PATH --arch ARCH (ARCHS) [--rope-freqs] [--tied]
                     [--types mixed|f32] [--seed N] [--tiny]
       make_synth.py --out PATH --variant NAME (MOE_VARIANTS) [--types ...] [--seed N]
                     [MoE shape flags: --n-expert, --n-expert-used, --n-ff-exp, --n-layer,
                      --q-lora-rank, --n-shared-exp, --yarn, --mtp, ...]
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
MOE_ARCHS = ["qwen3moe", "deepseek2"]
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3", "olmo2",
         "gemma2"] + MOE_ARCHS
# Embedding / LM-head types per architecture in --types mixed.
MIXED_EMBD = {"llama": QT.Q8_0, "qwen2": QT.Q4_0, "qwen3": QT.BF16, "gemma3": QT.Q8_0,
              "smollm3": QT.Q4_1, "granite": QT.F16, "phi3": QT.Q5_1, "olmo2": QT.Q8_0,
              "qwen3moe": QT.Q8_0, "deepseek2": QT.Q5_0, "gemma2": QT.Q4_0}
MIXED_OUTPUT = {"llama": QT.Q4_1, "qwen2": QT.F16, "qwen3": QT.Q8_0, "gemma3": QT.Q5_0,
                "smollm3": QT.Q8_0, "granite": QT.Q4_0, "phi3": QT.BF16, "olmo2": QT.Q5_1,
                "qwen3moe": QT.Q4_0, "deepseek2": QT.Q8_0}
# Expert tensors in --types mixed, one type per 3-D tensor: gate/up experts have rows of
# n_embd (whole 256-blocks: K types allowed; TP splits their rows, never a row), down experts
# rows of n_ff_exp, which TP cuts into n_ff_exp / tp columns: 32-block types only
MIXED_EXP_GATE_UP = [QT.Q4_K, QT.Q8_0, QT.Q4_0]
MIXED_EXP_DOWN = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1]

# MoE shapes: every head / expert count and width splits evenly for TP 2 and 4, and the
# row-parallel slices (attn_output, ffn_down_exps, ffn_down_shexp, ffn_down columns) stay
# whole 32-blocks at TP 4 (n_ff_exp 128 -> 32 per rank)
MOE_SHAPES = {
    # Qwen3-30B-A3B's structure (48 layers, 128 experts top-8, head_dim 128) scaled down.
    # n_ff (feed_forward_length) is written as the converter does but unused: llama.cpp
    # takes the expert width from expert_feed_forward_length
    "qwen3moe": dict(n_embd=256, n_head=8, n_head_kv=4, head_dim=64, n_ff=512, n_layer=4,
                     n_vocab=512, n_ctx=512, n_expert=8, n_expert_used=2, n_ff_exp=128),
    # DeepSeek-V3's structure (q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128,
    # 256 experts top-8 in 8 groups of which 4 are used, 1 shared expert, sigmoid gating with
    # the score-correction bias, weights normalized and scaled by 2.5) scaled down; n_ff is
    # the dense leading layers' FFN width
    "deepseek2": dict(n_embd=256, n_head=8, n_ff=512, n_layer=3, n_vocab=512, n_ctx=512,
                      n_dense_lead=1, q_lora_rank=96, kv_lora_rank=64, qk_rope=16, qk_nope=32,
                      v_head=32, n_expert=16, n_expert_used=4, n_ff_exp=128, n_shared=2,
                      n_group=4, n_group_used=2, gating="sigmoid", probs_bias=True,
                      weights_norm=True, weights_scale=2.5, yarn=None,
                      mtp=0, mtp_head=False, mtp_head_norm=True, echo=False),
}
# DeepSeek-V2-Lite's rope scaling as its GGUF carries it: rope.scaling.type yarn, factor 40,
# original_context_length 4096, yarn_log_multiplier = 0.1 * mscale_all_dim (0.707; the
# converter's legacy factor 0.1, which llama.cpp divides out again)
YARN_V2_LITE = dict(factor=40.0, orig_ctx=4096, log_mul=0.0707)
# Named MoE test models: make_moe_model shape overrides per variant (vs_llamacpp.py runs them;
# qwen3moe-e8 and deepseek2-v3 are MOE_SHAPES unchanged)
MOE_VARIANTS = {
    "qwen3moe-e8": dict(arch="qwen3moe"),
    "qwen3moe-e16": dict(arch="qwen3moe", n_expert=16, n_expert_used=4),
    # V3-style: q_lora_rank 96, 2 shared experts, sigmoid + bias, groups 4/2, plain rope
    "deepseek2-v3": dict(arch="deepseek2"),
    # q_lora_rank 0 (attn_q, as V2-Lite), 1 shared expert, V3-style routing
    "deepseek2-lite": dict(arch="deepseek2", q_lora_rank=0, n_shared=1),
    # deepseek2-v3 with V2-Lite's YaRN (softmax scale * mscale^2, interpolated rope)
    "deepseek2-yarn": dict(arch="deepseek2", yarn=YARN_V2_LITE),
    # DeepSeek-V2-Lite's routing: no expert_gating_func key (softmax), no bias, one expert
    # group (expert_group_count 1, used 1), no weight normalization, expert_weights_scale 1,
    # 2 shared experts, q_lora_rank 0, YaRN
    "deepseek2-v2lite": dict(arch="deepseek2", q_lora_rank=0, gating=None, probs_bias=False,
                             n_group=1, n_group_used=1, weights_norm=False, weights_scale=1.0,
                             yarn=YARN_V2_LITE),
    # deepseek2-v3 plus one multi-token-prediction (nextn) block (make_moe_model: MTP): its own
    # shared_head_norm; embedding and LM head the trunk's (no nextn.embed_tokens, no
    # nextn.shared_head_head)
    "deepseek2-mtp": dict(arch="deepseek2", mtp=1),
    # the MTP block with its own nextn.embed_tokens and nextn.shared_head_head but no
    # shared_head_norm (llama.cpp falls back to output_norm), on deepseek2-yarn's rope
    "deepseek2-mtp-head": dict(arch="deepseek2", mtp=1, mtp_head=True, mtp_head_norm=False,
                               yarn=YARN_V2_LITE),
    # an oracle for speed demonstrations (ECHO): the MTP block reproduces the target's choice
    "deepseek2-mtp-echo": dict(arch="deepseek2", mtp=1, echo=True, n_dense_lead=0),
}
# deepseek2-mtp-echo: the target's layers after layer 0 write their residual branches scaled
# by this (attn_output, ffn_down_exps, ffn_down_shexp): they cost full compute but move the
# hidden state by ~1e-3 of its size, so the target's choice is layer 0's but for near-ties
ECHO_TAIL = 1e-3
# granite's four scalars (the real 3.x files: embedding 12, attention 1/128 (head dim 128),
# residual 0.22, logit 8-16); milder here so that random weights keep greedy decoding
# from repeating one token: the embedding is written scaled down by the same factor
GRANITE_SCALES = dict(embedding=4.0, attention=0.15, residual=0.5, logit=2.5)
# archs whose Q, K RMSNorm is over the whole projection / per head
QK_NORM_WHOLE = ("olmo2",)
QK_NORM_HEAD = ("qwen3", "gemma3")
# gemma3's (and gemma2's) sliding window in the synthetic model: the 9- and 40-token
# prompts cross it
SWA_WINDOW = 8
# gemma2's soft-caps (the real files: attention 50, final 30, which random weights never
# reach): here about a quarter of the attention scores pass the cap (their rms is ~2: no Q/K
# norms) and the largest logits (~4) are squeezed by ~8%; together they move the logits by
# ~75% (rel L2) from the uncapped model's. tanh keeps the logits' order
GEMMA2_SOFTCAPS = dict(attn=2.0, final=8.0)
# gemma3's post-norm weights: the blocks' outputs (rms ~ this after their post-norm) must
# outweigh the tied embedding scaled by sqrt(n_embd) (rms ~2), or every logit is dominated
# by the current token's own embedding and greedy decoding repeats it
POST_NORM = 3.0
# gemma2 is always tied, so its current token's own logit is ~sqrt(n_embd) * 4 / rms(x):
# its blocks must outweigh the embedding far more (at 3, greedy decoding repeats one token)
GEMMA2_POST_NORM = 20.0


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


def quantize_q4_k(data):
    """(..., n) float32, n a multiple of 256 -> (..., n / 256 * 144) uint8 Q4_K super-blocks
    (gguf can dequantize Q4_K but not quantize to it). A plain affine quantizer in llama.cpp's
    layout: per 32-weight sub-block a scale and a min, 6-bit multiples of the super-block's
    f16 d and dmin, and 4-bit quants q with weight = d * sc * q - dmin * m."""
    x = np.asarray(data, dtype=np.float32)
    lead = x.shape[:-1]
    x = x.reshape(-1, 8, 32)                                          # (nb, 8, 32)
    nb = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)                              # (nb, 8), <= 0
    scale = (x.max(axis=-1) - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)                # (nb,)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    dmf = dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmf > 0, np.rint(mins / dmf), 0).clip(0, 63).astype(np.uint8)
        es = (df * sc)[..., None]                                     # (nb, 8, 1)
        em = (dmf * m)[..., None]
        q = np.where(es > 0, np.rint((x + em) / es), 0).clip(0, 15).astype(np.uint8)
    out = np.zeros((nb, 144), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    # scales: bytes 0-3 sc[0..3] | sc[4..7] >> 4 << 6, bytes 4-7 the same for the mins,
    # bytes 8-11 the low nibbles of sc[4..7] | those of m[4..7] << 4
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    # quants: byte 32 * c + l holds sub-block 2c's weight l (low nibble), 2c + 1's (high)
    q = q.reshape(nb, 4, 2, 32)
    out[:, 16:] = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(nb, 128)
    return out.reshape(lead + (-1,))


def add_matrix(w, name, data, qtype):
    """Adds a 2-D weight (numpy shape (rows, ne0)) stored as qtype; a 3-D one (numpy shape
    (n_expert, rows, ne0)) is quantized row by row the same way."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == QT.F32:
        w.add_tensor(name, data)
    elif qtype == QT.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        if qtype == QT.Q4_K:
            q = quantize_q4_k(data)
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


def add_vocab(w, n_vocab):
    """The tokenizer metadata (build_tokenizer's vocabulary) and the chat template."""
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


def make_model(out, arch, rope_freqs=False, tied=False, types="mixed", seed=0, shapes=None,
               head_dim=None, alignment=None, extra_kv=None):
    """Writes one model to out. alignment: write general.alignment explicitly (the GGUF
    reader tests need the key); extra_kv: a function called with the writer to add more
    metadata. MoE archs: make_moe_model (shapes: MOE_SHAPES[arch] or a full replacement)."""
    if arch in MOE_ARCHS:
        if rope_freqs:
            raise ValueError(f"{arch}: no rope_freqs.weight")
        return make_moe_model(out, arch, tied=tied, types=types, seed=seed, shapes=shapes,
                              head_dim=head_dim, alignment=alignment, extra_kv=extra_kv)
    s = dict(DEFAULT_SHAPES if shapes is None else shapes)
    if head_dim is not None:
        s["head_dim"] = head_dim
    n_embd, n_head, n_kv = s["n_embd"], s["n_head"], s["n_head_kv"]
    hd, n_ff, n_layer, n_vocab = s["head_dim"], s["n_ff"], s["n_layer"], s["n_vocab"]
    if arch == "gemma2":
        tied = True  # llama.cpp's gemma2 takes its LM head from token_embd only
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
    if arch in ("qwen3", "gemma3", "gemma2") or hd * n_head != n_embd:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch != "gemma2":  # Gemma2Model writes neither (llama.cpp: base 10000, n_rot head_dim)
        w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(eps)
    if arch != "gemma2":
        w.add_rope_dimension_count(hd)
    if arch in ("gemma3", "gemma2"):
        w.add_sliding_window(SWA_WINDOW)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_SOFTCAPS["attn"])
        w.add_final_logit_softcapping(GEMMA2_SOFTCAPS["final"])
    if arch == "granite":
        w.add_embedding_scale(GRANITE_SCALES["embedding"])
        w.add_attention_scale(GRANITE_SCALES["attention"])
        w.add_residual_scale(GRANITE_SCALES["residual"])
        w.add_logit_scale(GRANITE_SCALES["logit"])
    w.add_vocab_size(n_vocab)
    w.add_file_type(0 if types == "f32" else 1)

    add_vocab(w, n_vocab)
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
    # gemma3/2 multiply the embedding by sqrt(n_embd) at run time: scaled down the same way
    embd_scale = 2.0 / np.sqrt(n_embd) if tied or arch in ("gemma3", "gemma2") else 1.0
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

    post = arch in ("gemma3", "gemma2", "olmo2")
    post_w = GEMMA2_POST_NORM if arch == "gemma2" else POST_NORM
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
            w.add_tensor(p + "post_attention_norm.weight", norm_weight(n_embd, post_w))
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
            w.add_tensor(p + "post_ffw_norm.weight", norm_weight(n_embd, post_w))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def moe_shapes(arch, **overrides):
    """MOE_SHAPES[arch] with overrides (unknown keys refused)."""
    s = dict(MOE_SHAPES[arch])
    for k, v in overrides.items():
        if k not in s:
            raise ValueError(f"{arch}: unknown shape key {k!r}")
        s[k] = v
    return s


def variant_kwargs(name, types="f32", seed=1):
    """make_model keyword arguments of MOE_VARIANTS[name]."""
    v = dict(MOE_VARIANTS[name])
    arch = v.pop("arch")
    return dict(arch=arch, types=types, seed=seed, shapes=moe_shapes(arch, **v))


class _TensorLog:
    """A GGUFWriter stand-in that writes through and remembers what it wrote (add_tensor's
    arguments), to write the same tensors again under other names (replay)."""

    def __init__(self, w):
        self.w = w
        self.log = []

    def add_tensor(self, name, data, **kw):
        self.log.append((name, data, kw))
        self.w.add_tensor(name, data, **kw)

    def replay(self, w, old_prefix, new_prefix):
        for name, data, kw in self.log:
            assert name.startswith(old_prefix), name
            w.add_tensor(new_prefix + name[len(old_prefix):], data.copy(), **kw)


def make_moe_model(out, arch, tied=False, types="mixed", seed=0, shapes=None, head_dim=None,
                   alignment=None, extra_kv=None):
    """Writes a qwen3moe or deepseek2 model: the metadata keys and tensors llama.cpp's
    converter writes for Qwen3-MoE / DeepSeek-V2/V3 (conversion/qwen.py, deepseek.py), in the
    shapes of shapes (default MOE_SHAPES[arch]).

    deepseek2 with shapes mtp = 1: one multi-token-prediction (nextn) block appended as
    llama.cpp's deepseek2 loader reads it (src/models/deepseek2.cpp; the V3.2 converter's
    layout): block_count = n_layer + 1 (llama.cpp's n_layer() = block_count -
    nextn_predict_layers), nextn_predict_layers 1, and blk.{n_layer} a full MoE layer (the
    same tensors as a trunk MoE layer, shared experts included) plus
      blk.{n_layer}.nextn.eh_proj.weight    (n_embd rows of 2 * n_embd: [enorm'd e | hnorm'd h])
      blk.{n_layer}.nextn.enorm.weight, .hnorm.weight              (n_embd)
      blk.{n_layer}.nextn.shared_head_norm.weight  (n_embd; mtp_head_norm, else none)
      blk.{n_layer}.nextn.embed_tokens.weight, .shared_head_head.weight  (n_vocab rows; mtp_head)
    The trunk is drawn first, so it equals the model without the block for the same seed.
    llama.cpp's MTP graph requires q_lora_rank > 0 and n_layer >= leading_dense_block_count.

    echo (with mtp 1, n_dense_lead 0): the oracle ECHO_TAIL describes. token_embd's rows
    have RMS exactly 1; the MTP block is a copy of layer 0 with eh_proj = [I | 0] (it reads
    the normed embedding, ignores h), enorm = hnorm = 1 and shared_head_norm = output_norm:
    its row for (x_p, any h) is the target's layer 0 at p, so it drafts the target's choice."""
    s = dict(MOE_SHAPES[arch] if shapes is None else shapes)
    if head_dim is not None:
        s["head_dim"] = head_dim
    ds = arch == "deepseek2"
    n_embd, n_head, n_layer, n_vocab = s["n_embd"], s["n_head"], s["n_layer"], s["n_vocab"]
    n_expert, n_used, n_ff_exp = s["n_expert"], s["n_expert_used"], s["n_ff_exp"]
    n_mtp = int(s.get("mtp", 0) or 0)
    echo = bool(s.get("echo", False))
    if n_mtp and not ds:
        raise ValueError(f"{arch}: MTP blocks are deepseek2's here")
    if n_mtp not in (0, 1):
        raise ValueError("mtp: llama.cpp's deepseek2 MTP graph runs a single nextn block")
    if n_mtp and (s["q_lora_rank"] <= 0 or n_layer < s["n_dense_lead"]):
        raise ValueError("mtp: llama.cpp's MTP graph needs q_lora_rank > 0 and a MoE block")
    if echo and (not n_mtp or s["n_dense_lead"] != 0 or s.get("mtp_head", False)):
        raise ValueError("echo: needs mtp 1, n_dense_lead 0 and the trunk's embedding / head")
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"tandem-synth-{arch}")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    # the converter's order: TextModel.set_gguf_parameters, then the model's own keys
    w.add_block_count(n_layer + n_mtp)
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(n_head)
    # deepseek2: MLA is stored as MQA (one KV head of kv_lora_rank + qk_rope dims)
    w.add_head_count_kv(1 if ds else s["n_head_kv"])
    w.add_rope_freq_base(10000.0 if ds else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    if ds:
        if s["n_group"]:
            w.add_expert_group_count(s["n_group"])
            w.add_expert_group_used_count(s["n_group_used"])
        if s["gating"] is not None:
            w.add_expert_gating_func({"softmax": gguf.ExpertGatingFuncType.SOFTMAX,
                                      "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}[s["gating"]])
    else:
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
    w.add_file_type(0 if types == "f32" else 1)
    if ds:
        w.add_leading_dense_block_count(s["n_dense_lead"])
        w.add_vocab_size(n_vocab)
        # llama.cpp requires the key unless the layer count is a "lite" one (26, 27, ...):
        # written, 0 meaning attn_q (no low-rank query)
        w.add_q_lora_rank(s["q_lora_rank"])
        kvl, dr, dn, dv = s["kv_lora_rank"], s["qk_rope"], s["qk_nope"], s["v_head"]
        w.add_kv_lora_rank(kvl)
        w.add_key_length(kvl + dr)
        w.add_value_length(kvl)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_shared_count(s["n_shared"])
        w.add_expert_weights_scale(s["weights_scale"])
        if s["weights_norm"]:
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(dr)
        if s["yarn"]:
            y = s["yarn"]
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(y["factor"])
            w.add_rope_scaling_orig_ctx_len(y["orig_ctx"])
            w.add_rope_scaling_yarn_log_mul(y["log_mul"])
        if n_mtp:
            w.add_nextn_predict_layers(n_mtp)
    else:
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_vocab_size(n_vocab)
    add_vocab(w, n_vocab)
    if extra_kv is not None:
        extra_kv(w)

    counter = [0, 0, 0]
    # tw: where the layer tensors go (the echo variant records layer 0's to copy them into
    # its MTP block); tail: the residual-branch scale of the current layer (ECHO_TAIL)
    tw, tail = w, 1.0

    def cycle(i, seq):
        if types == "f32":
            return QT.F32
        t = seq[counter[i] % len(seq)]
        counter[i] += 1
        return t

    def wtype():
        return cycle(0, MIXED_CYCLE)

    def normal(shape, scale):
        return rng.standard_normal(shape).astype(np.float32) * np.float32(scale)

    def norm_weight(n, scale=1.0):
        return (scale * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    def row_par(name, rows, cols, std):
        if types == "kquant" and cols % 256 == 0:
            q = q6k_matrix(rng, rows, cols, std * tail)
            tw.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT.Q6_K)
        else:
            add_matrix(tw, name, normal((rows, cols), std * tail), wtype())

    def experts(p):
        """The routed experts of one layer: 3-D (n_expert, rows, ne0) tensors."""
        gt = cycle(1, MIXED_EXP_GATE_UP)
        ut = cycle(1, MIXED_EXP_GATE_UP)
        if n_embd % 256:
            gt = QT.Q8_0 if gt == QT.Q4_K else gt
            ut = QT.Q8_0 if ut == QT.Q4_K else ut
        add_matrix(tw, p + "ffn_gate_exps.weight",
                   normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd)), gt)
        add_matrix(tw, p + "ffn_up_exps.weight",
                   normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd)), ut)
        add_matrix(tw, p + "ffn_down_exps.weight",
                   normal((n_expert, n_embd, n_ff_exp), 0.5 * tail / np.sqrt(n_ff_exp)),
                   cycle(2, MIXED_EXP_DOWN))

    embd_t = MIXED_EMBD[arch] if types != "f32" else QT.F32
    embd_scale = 2.0 / np.sqrt(n_embd) if tied else 1.0
    embd = normal((n_vocab, n_embd), embd_scale)
    if echo:  # rows of RMS 1: rmsnorm(e) * enorm (ones) is e itself, to eps
        e64 = embd.astype(np.float64)
        embd = (e64 / np.sqrt(np.mean(e64 * e64, axis=1, keepdims=True))).astype(np.float32)
    add_matrix(w, "token_embd.weight", embd, embd_t)
    output_norm = norm_weight(n_embd)
    w.add_tensor("output_norm.weight", output_norm)
    if not tied:
        out_t = MIXED_OUTPUT[arch] if types != "f32" else QT.F32
        add_matrix(w, "output.weight", normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd)), out_t)

    def layer(il, p):
        """One block's tensors (tw, tail: see above)."""
        tw.add_tensor(p + "attn_norm.weight", norm_weight(n_embd))
        if ds:
            dk = dn + dr
            if s["q_lora_rank"] > 0:
                ql = s["q_lora_rank"]
                add_matrix(tw, p + "attn_q_a.weight", normal((ql, n_embd), 1.0 / np.sqrt(n_embd)),
                           wtype())
                tw.add_tensor(p + "attn_q_a_norm.weight", norm_weight(ql))
                add_matrix(tw, p + "attn_q_b.weight", normal((n_head * dk, ql), 1.5 / np.sqrt(ql)),
                           wtype())
            else:
                add_matrix(tw, p + "attn_q.weight",
                           normal((n_head * dk, n_embd), 1.5 / np.sqrt(n_embd)), wtype())
            # rows: the compressed KV (kv_lora_rank), then the shared rope key (qk_rope)
            kv_a = np.concatenate([normal((kvl, n_embd), 1.0 / np.sqrt(n_embd)),
                                   normal((dr, n_embd), 1.5 / np.sqrt(n_embd))])
            add_matrix(tw, p + "attn_kv_a_mqa.weight", kv_a, wtype())
            tw.add_tensor(p + "attn_kv_a_norm.weight", norm_weight(kvl))
            # the converter's split of kv_b_proj (n_head, qk_nope + v_head, kv_lora_rank):
            # k_b transposed to (n_head, kv_lora_rank, qk_nope), v_b (n_head, v_head, kv_lora)
            add_matrix(tw, p + "attn_k_b.weight", normal((n_head, kvl, dn), 1.5 / np.sqrt(kvl)),
                       wtype())
            add_matrix(tw, p + "attn_v_b.weight", normal((n_head, dv, kvl), 1.0 / np.sqrt(kvl)),
                       wtype())
            row_par(p + "attn_output.weight", n_embd, n_head * dv, 0.5 / np.sqrt(n_head * dv))
        else:
            hd, n_kv = s["head_dim"], s["n_head_kv"]
            add_matrix(tw, p + "attn_q.weight",
                       normal((n_head * hd, n_embd), 1.5 / np.sqrt(n_embd)), wtype())
            add_matrix(tw, p + "attn_k.weight",
                       normal((n_kv * hd, n_embd), 1.5 / np.sqrt(n_embd)), wtype())
            add_matrix(tw, p + "attn_v.weight",
                       normal((n_kv * hd, n_embd), 1.0 / np.sqrt(n_embd)), wtype())
            tw.add_tensor(p + "attn_q_norm.weight", norm_weight(hd))
            tw.add_tensor(p + "attn_k_norm.weight", norm_weight(hd))
            row_par(p + "attn_output.weight", n_embd, n_head * hd, 0.5 / np.sqrt(n_head * hd))
        tw.add_tensor(p + "ffn_norm.weight", norm_weight(n_embd))
        if ds and il < s["n_dense_lead"]:
            n_ff = s["n_ff"]
            add_matrix(tw, p + "ffn_gate.weight", normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd)),
                       wtype())
            add_matrix(tw, p + "ffn_up.weight", normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd)),
                       wtype())
            row_par(p + "ffn_down.weight", n_embd, n_ff, 0.5 / np.sqrt(n_ff))
            return
        # the router stays F32 (the converter never quantizes ffn_gate_inp)
        tw.add_tensor(p + "ffn_gate_inp.weight",
                      normal((n_expert, n_embd), 1.0 / np.sqrt(n_embd)))
        if ds and s["probs_bias"]:
            # DeepSeek-V3's e_score_correction_bias: shifts the selection, not the weights
            tw.add_tensor(p + "exp_probs_b.bias", normal(n_expert, 0.2))
        experts(p)
        if ds and s["n_shared"]:
            n_sh = n_ff_exp * s["n_shared"]
            add_matrix(tw, p + "ffn_gate_shexp.weight",
                       normal((n_sh, n_embd), 1.0 / np.sqrt(n_embd)), wtype())
            add_matrix(tw, p + "ffn_up_shexp.weight",
                       normal((n_sh, n_embd), 1.0 / np.sqrt(n_embd)), wtype())
            row_par(p + "ffn_down_shexp.weight", n_embd, n_sh, 0.5 / np.sqrt(n_sh))

    rec = _TensorLog(w) if echo else None
    for il in range(n_layer + n_mtp):
        p = f"blk.{il}."
        tw = rec if echo and il == 0 else w
        tail = ECHO_TAIL if echo and 0 < il < n_layer else 1.0
        if echo and il == n_layer:  # the MTP block: layer 0's tensors, same types and values
            rec.replay(w, "blk.0.", p)
        else:
            layer(il, p)
        if il < n_layer:
            continue
        # the nextn tensors (the converter's order: after the block's own)
        if echo:
            eh = np.concatenate([np.eye(n_embd), np.zeros((n_embd, n_embd))], axis=1)
            add_matrix(w, p + "nextn.eh_proj.weight", eh.astype(np.float32), wtype())
            w.add_tensor(p + "nextn.enorm.weight", np.ones(n_embd, dtype=np.float32))
            w.add_tensor(p + "nextn.hnorm.weight", np.ones(n_embd, dtype=np.float32))
            w.add_tensor(p + "nextn.shared_head_norm.weight", output_norm.copy())
            continue
        if s.get("mtp_head", False):
            add_matrix(w, p + "nextn.embed_tokens.weight", normal((n_vocab, n_embd), 1.0),
                       QT.F32 if types == "f32" else MIXED_EMBD[arch])
        # input [enorm'd e | hnorm'd h] (2 * n_embd of RMS ~1): output RMS ~1
        add_matrix(w, p + "nextn.eh_proj.weight",
                   normal((n_embd, 2 * n_embd), 1.0 / np.sqrt(2 * n_embd)), wtype())
        w.add_tensor(p + "nextn.enorm.weight", norm_weight(n_embd))
        w.add_tensor(p + "nextn.hnorm.weight", norm_weight(n_embd))
        if s.get("mtp_head_norm", True):
            w.add_tensor(p + "nextn.shared_head_norm.weight", norm_weight(n_embd))
        if s.get("mtp_head", False):
            add_matrix(w, p + "nextn.shared_head_head.weight",
                       normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd)),
                       QT.F32 if types == "f32" else MIXED_OUTPUT[arch])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The MoE suite models' seeds: over test_reference.py's three synthetic prompts and 32 greedy
# tokens, ref_forward.py meets no top-2 logit gap below 2e-3 (relative; 2.9e-3 and 3.9e-3) and
# no routing gap (last selected vs first unselected expert / group score) below 3e-4
# (5.7e-4 and 3.0e-4), so a float32 rounding difference cannot flip a choice
SEED_QWEN3MOE, SEED_DEEPSEEK2 = 34, 9

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
    # always tied (llama.cpp's gemma2 has no output.weight): GEMMA2_POST_NORM keeps its greedy
    # decoding from repeating the current token
    "gemma2.gguf": dict(arch="gemma2", tied=True, types="mixed", seed=17, head_dim=64),
    # 6 query heads over 2 KV heads: decode tp 3 gives rank 1 both KV heads (common/td_tp.h)
    "gqa.gguf": dict(arch="qwen2", tied=False, types="mixed", seed=2,
                     shapes=dict(DEFAULT_SHAPES, n_head=6, n_head_kv=2)),
    "smollm3.gguf": dict(arch="smollm3", tied=True, types="mixed", seed=3),
    "granite.gguf": dict(arch="granite", tied=False, types="mixed", seed=10),
    "phi3.gguf": dict(arch="phi3", tied=False, types="mixed", seed=1),
    "olmo2.gguf": dict(arch="olmo2", tied=False, types="mixed", seed=2),
    # MoE (MOE_SHAPES defaults: qwen3moe 8 experts top-2; deepseek2 q_lora_rank 96, sigmoid
    # routing with bias and groups, 2 shared experts, plain rope). test_reference.py runs only
    # the files in its own SYNTH_MODELS list, so these are written but not yet tested there
    "qwen3moe.gguf": dict(arch="qwen3moe", tied=False, types="mixed", seed=SEED_QWEN3MOE),
    "deepseek2.gguf": dict(arch="deepseek2", tied=False, types="mixed", seed=SEED_DEEPSEEK2),
    # deepseek2.gguf's trunk (same seed: identical weights) plus one MTP (nextn) block
    # (MOE_VARIANTS deepseek2-mtp). Over the three synthetic prompts the MTP first draft's
    # top-2 logit gap is >= 4.2e-3 (relative) and the MTP block's routing gap >= 5.1e-4
    "deepseek2-mtp.gguf": dict(arch="deepseek2", tied=False, types="mixed", seed=SEED_DEEPSEEK2,
                               shapes=moe_shapes("deepseek2", mtp=1)),
    # the oracle MTP block (MOE_VARIANTS deepseek2-mtp-echo, ECHO_TAIL): its first draft is the
    # target's next greedy token in 503 of 504 steps of the numpy reference (mixed types); the
    # decode tests' proposer that agrees with its model (tests/decode/test_draft.c)
    "deepseek2-mtp-echo.gguf": dict(arch="deepseek2", tied=False, types="mixed",
                                    seed=SEED_DEEPSEEK2,
                                    shapes=moe_shapes("deepseek2", mtp=1, echo=True,
                                                      n_dense_lead=0)),
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
    ap.add_argument("--variant", choices=sorted(MOE_VARIANTS),
                    help="a named MoE test model (MOE_VARIANTS; implies its --arch)")
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
    g = ap.add_argument_group("MoE (qwen3moe, deepseek2; defaults in MOE_SHAPES)")
    g.add_argument("--n-layer", type=int, default=None, help="layers (qwen3moe 4, deepseek2 3)")
    g.add_argument("--n-embd", type=int, default=None,
                   help="embedding width (256; larger for benchmark models)")
    g.add_argument("--n-expert", type=int, default=None, help="routed experts (8 / 16)")
    g.add_argument("--n-expert-used", type=int, default=None, help="experts per token (2 / 4)")
    g.add_argument("--n-ff-exp", type=int, default=None, help="expert FFN width (128)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="deepseek2: 0 = attn_q (96)")
    g.add_argument("--n-shared-exp", type=int, default=None, help="deepseek2: shared experts (2)")
    g.add_argument("--n-dense-lead", type=int, default=None,
                   help="deepseek2: leading dense layers (1)")
    g.add_argument("--expert-groups", default=None, metavar="G,U",
                   help="deepseek2: expert_group_count, expert_group_used_count (4,2; 0,0: none)")
    g.add_argument("--gating", choices=["softmax", "sigmoid", "none"], default=None,
                   help="deepseek2: expert_gating_func (sigmoid; none: no key = softmax)")
    g.add_argument("--no-probs-bias", action="store_true", help="deepseek2: no exp_probs_b")
    g.add_argument("--yarn", action="store_true",
                   help="deepseek2: DeepSeek-V2-Lite's YaRN rope scaling (YARN_V2_LITE)")
    g.add_argument("--mtp", action="store_true",
                   help="deepseek2: append one MTP (nextn) block (make_moe_model)")
    a = ap.parse_args()
    if a.suite:
        make_suite(a.suite)
        return 0
    if a.variant:
        if a.arch and a.arch != MOE_VARIANTS[a.variant]["arch"]:
            ap.error(f"--variant {a.variant} is a {MOE_VARIANTS[a.variant]['arch']} model")
        a.arch = MOE_VARIANTS[a.variant]["arch"]
    if not a.out or not a.arch:
        ap.error("--out and --arch (or --variant) are required (or --suite DIR)")
    if a.arch in MOE_ARCHS:
        if a.tiny or a.rope_freqs:
            ap.error(f"--tiny and --rope-freqs are for the dense archs, not {a.arch}")
        shapes = (variant_kwargs(a.variant)["shapes"] if a.variant
                  else moe_shapes(a.arch))
        flags = dict(n_ff="n_ff", n_head="n_head", n_vocab="n_vocab", n_ctx="n_ctx", n_embd="n_embd",
                     head_dim="head_dim", n_layer="n_layer", n_expert="n_expert",
                     n_expert_used="n_expert_used", n_ff_exp="n_ff_exp",
                     q_lora_rank="q_lora_rank", n_shared_exp="n_shared",
                     n_dense_lead="n_dense_lead", n_head_kv="n_head_kv")
        for flag, key in flags.items():
            v = getattr(a, flag)
            if v is None:
                continue
            if key not in shapes:
                ap.error(f"--{flag.replace('_', '-')} does not apply to {a.arch}")
            shapes[key] = v
        if a.arch == "deepseek2":
            if a.expert_groups is not None:
                shapes["n_group"], shapes["n_group_used"] = (
                    int(x) for x in a.expert_groups.split(","))
            if a.gating is not None:
                shapes["gating"] = None if a.gating == "none" else a.gating
            if a.no_probs_bias:
                shapes["probs_bias"] = False
            if a.yarn:
                shapes["yarn"] = dict(YARN_V2_LITE)
            if a.mtp:
                shapes["mtp"] = 1
        elif a.expert_groups or a.gating or a.no_probs_bias or a.yarn or a.mtp:
            ap.error("--expert-groups, --gating, --no-probs-bias, --yarn and --mtp are "
                     "deepseek2's")
        make_model(a.out, a.arch, tied=a.tied, types=a.types, seed=a.seed, shapes=shapes)
        print(a.out)
        return 0
    head_dim = a.head_dim
    if head_dim is None and a.arch in ("qwen3", "gemma3", "gemma2") and not a.tiny:
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
