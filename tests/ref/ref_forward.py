#!/usr/bin/env python3
"""ref_forward.py: an independent numpy forward pass of Llama-family and Gemma GGUF models.

This is the reference the engine is tested against. It shares no code with the engine:
weights are read with gguf.GGUFReader and dequantized with gguf.quants.dequantize, and the
math follows llama.cpp's graph for these architectures:

  x = token_embd[ids]
  per layer:  h = rmsnorm(x) * attn_norm
              q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)       (qwen2 biases)
              q, k = rmsnorm_per_head(q) * q_norm, ... * k_norm   (qwen3, before rope)
              q, k = rope(q), rope(k)   llama: NORM, pairs (2i, 2i+1)
                                        qwen2/qwen3: NEOX, pairs (i, i + n_rot/2)
                                        theta_i = pos * base^(-2i/n_rot) / rope_freqs[i]
              a = softmax(q k^T / sqrt(head_dim), causal) v       (GQA: head h reads kv h / (n_head/n_kv))
              x = x + Wo a
              h = rmsnorm(x) * ffn_norm
              x = x + Wdown (silu(Wgate h) * Wup h)
  logits = Wout (rmsnorm(x) * output_norm)           (no output.weight: Wout = token_embd)

gemma3 (from llama.cpp's src/models/gemma3-iswa.cpp and the gemma3 case of
src/llama-model.cpp's load_hparams; Hugging Face's Gemma3 modelling says the same):
  x = token_embd[ids] * sqrt(n_embd)
  q, k per-head RMSNorm (attn_q_norm / attn_k_norm) before NEOX rope
  scores scaled by 1/sqrt(head_dim)
  sliding-window layers (all but every 6th, when attention.sliding_window is set): query at
  p sees keys p - window < j <= p, rope base 10000 unscaled; global layers: rope.freq_base
  x = x + rmsnorm(Wo a) * post_attention_norm
  x = x + rmsnorm(Wdown (gelu_tanh(Wgate h) * Wup h)) * post_ffw_norm
  (norm weights are stored with Gemma's +1 already added by the converter: used as is)

gemma2 (src/models/gemma2.cpp, load_arch_hparams and the graph; src/llama-graph.cpp
build_attn_mha for the soft-capping):
  gemma3's block without the Q/K norms: x = token_embd[ids] * sqrt(n_embd), NEOX rope,
  post_attention_norm / post_ffw_norm, GELU FFN
  q = q * attn_scale (1/sqrt(head_dim); 1/sqrt(n_embd / n_head) for the 46-layer 27B), then
  scores s = q k^T soft-capped: s = cap * tanh(s / cap), cap attn_logit_softcapping (50
  when absent), before the mask and the softmax
  sliding-window layers: il % pattern < pattern - 1 (attention.sliding_window_pattern, 2
  when absent: the even layers), window attention.sliding_window (4096 when absent), rope
  base rope.freq_base_swa or rope.freq_base (10000 when absent) like the global layers
  logits = cap * tanh(logits / cap), cap final_logit_softcapping (30 when absent)

The other architectures, each from its llama.cpp graph (src/models/<arch>.cpp):
  smollm3  llama, but layers with (il + 1) % 4 == 0 skip rope (n_no_rope_layer_step 4)
  granite  llama with x = embd * embedding_scale, scores * attention.scale (when set),
           x = x + residual_scale * block output (both blocks), logits / logit_scale
  phi3     qwen2-style NEOX rope, Q/K/V rows of attn_qkv, FFN silu(gate) * up with gate
           and up the two halves of ffn_up's rows (gate first); LongRoPE not modelled
  olmo2    no pre-norms: q, k, v = Wq x, ...; q = rmsnorm(q) * attn_q_norm over the whole
           projection (k likewise), NEOX rope; x = x + rmsnorm(Wo a) * post_attention_norm;
           x = x + rmsnorm(ffn(x)) * post_ffw_norm

Mixture-of-experts architectures:
  qwen3moe (src/models/qwen3moe.cpp): qwen3's attention (per-head Q/K RMSNorm, NEOX rope,
           scores / sqrt(head_dim)); every FFN routed:
             p = softmax(ffn_gate_inp h) over the n_expert experts; top = the n_expert_used
             largest p; w = p[top] / sum(p[top]) (always normalized: build_moe_ffn's norm_w is
             hard-coded true for qwen3moe, no expert_weights_scale)
             f = sum_j w_j * down_e (silu(gate_e h) * up_e h),  e = top[j]
  deepseek2 (src/models/deepseek2.cpp, MLA; written here decompressed, as plain MHA):
           q = Wq h, or Wq_b (rmsnorm(Wq_a h) * q_a_norm) (q_lora_rank > 0); per head the
               first qk_nope dims are q_nope, the last qk_rope dims q_pe
           [c | k_pe] = Wkv_a_mqa h;  c = rmsnorm(c) * kv_a_norm  (kv_lora_rank dims)
           per head h: k_nope = attn_k_b[h]^T c, v = attn_v_b[h] c (the converter's split of
               kv_b_proj; a legacy attn_kv_b is split the same way)
           NORM rope (pairs 2i, 2i+1; llama_model_rope_type) over q_pe and the single k_pe
               shared by every head, with YaRN when rope.scaling.type is yarn
           scores = (q_nope.k_nope + q_pe.k_pe) * kq_scale,
               kq_scale = mscale^2 / sqrt(qk_nope + qk_rope), mscale as llama.cpp computes it
               (yarn_params below: 1 + 0.1 * mscale_all_dim * ln(factor) for DeepSeek's files)
           layers < leading_dense_block_count: dense silu FFN; the others MoE + shared experts:
             p = sigmoid(logits) or softmax(logits) (expert_gating_func; none: softmax)
             s = p + exp_probs_b (selection only); with expert_group_count G > 1 a group's
                 score is the sum of its 2 best s, and only the expert_group_used_count best
                 groups stay selectable; top = the n_expert_used largest s
             w = p[top]; / max(sum, 6.1e-5) if expert_weights_norm; * expert_weights_scale
                 (when set and != 1)
             f = sum_j w_j expert_j(h) + down_shexp (silu(gate_shexp h) * up_shexp h)

Multi-token prediction (deepseek2 with nextn_predict_layers 1; src/models/deepseek2.cpp
graph_mtp, common/speculative.cpp draft-mtp): the last block (blk.{n_layer}, n_layer =
block_count - nextn_predict_layers) is not part of the trunk. The target's h_nextn is the
LM head's input rmsnorm(x) * output_norm, every row. The MTP block, its own causal sequence
with its own KV, runs row p = (token x_p, hidden h_p'):
  e = embed_tokens[x_p] (nextn.embed_tokens, else token_embd)
  x = eh_proj [rmsnorm(e) * enorm | rmsnorm(h_p') * hnorm]     (e first, then h)
  x = x + MLA(rmsnorm(x) * attn_norm); x = x + MoE+shared(rmsnorm(x) * ffn_norm)
  h_nextn = rmsnorm(x) * (nextn.shared_head_norm, else output_norm)
  logits = (nextn.shared_head_head, else the LM head) h_nextn
The first draft after a prompt x_0..x_{n-1}: x_n = argmax of the target's last logits; rows
p = 0..n with h_p' = h_{p-1} (the target's), h_{-1} = 0, at positions p; row n's logits.
Further drafts: the previous draft with row n's own h_nextn at n + 1, and so on.

Python API:
  logits_last(path, ids) -> np.ndarray (n_vocab,) float32
  greedy(path, ids, n)    -> list[int]
  RefModel(path).generate(ids, n) -> (tokens, per-step logits) for tie analysis
  mtp_first_draft_logits(path, ids) -> np.ndarray (n_vocab,) float64, the MTP's first draft
  RefModel(path).mtp_draft(ids, k) -> (x_n, k greedy drafts, first-draft logits)
  RefModel(path).mtp_rows(ids), mtp_acceptance(model, ids, n): every row's target and MTP
      logits; how often the first draft is the target's next greedy token

Command line:
  ref_forward.py --model PATH --ids 1,2,3 [--greedy N] [--out-logits FILE.f32] [--f64]
                 [--mtp K | --mtp-accept N]
"""
import argparse
import math
import sys

import numpy as np
import gguf


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3", "olmo2",
         "qwen3moe", "deepseek2", "gemma2")


def yarn_params(r, arch, hp, k_head):
    """The rope frequency scaling and attention scale llama.cpp derives for deepseek2
    (llama-model.cpp load_hparams, models/deepseek2.cpp load_arch_hparams and graph,
    llama-context.cpp's yarn_attn_factor, ggml's rope_yarn):
      freq_scale = 1 / rope.scaling.factor (1 without a factor or with type none);
      ext_factor = 1 for type yarn, else 0;
      log_mul = rope.scaling.yarn_log_multiplier / 0.1 (the converter writes 0.1 *
                mscale_all_dim; absent: 0);
      attn_factor (the context's yarn_attn_factor, given to ggml_rope_ext) =
          1                                                        if ext_factor == 0
          gm(F, m) / gm(F, log_mul) / (1 + 0.1 ln F)               if log_mul != 0
              (m = log_mul, or 1 when log_mul == 1;  gm(F, m) = 1 + 0.1 m ln F, 1 if F <= 1)
          gm(F, 1) / (1 + 0.1 ln F)                                otherwise
        times rope.scaling.attn_factor (default 1), F = 1 / freq_scale;
      the rope's cos / sin are scaled by attn_factor * (1 + 0.1 ln F) when ext_factor != 0
        (ggml cancels the division above: 1 for DeepSeek's files), by attn_factor otherwise;
      kq_scale = mscale^2 / sqrt(key_length_mla),
        mscale = attn_factor * (1 + 0.1 ln F) * (1 + 0.1 log_mul ln F)
        (= 1 + 0.1 mscale_all_dim ln(factor) for DeepSeek's files; 1 without scaling).
    beta_fast 32, beta_slow 1 (llama.cpp does not read the keys for deepseek2);
    n_ctx_orig = rope.scaling.original_context_length, else context_length."""
    stype = hp("rope.scaling.type", "linear") or "linear"
    factor = float(hp("rope.scaling.factor", 0.0) or hp("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if factor == 0.0 or stype == "none" else 1.0 / factor
    ext = 1.0 if stype == "yarn" else 0.0
    log_mul = float(hp("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    if arch == "deepseek2":
        log_mul /= float(np.float32(0.1))
    F = 1.0 / freq_scale

    def gm(sc, m):
        return 1.0 if sc <= 1.0 else 0.1 * m * math.log(sc) + 1.0

    attn = 1.0
    if ext != 0.0:
        if log_mul != 0.0:
            m = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
            attn = gm(F, m) / gm(F, log_mul)
        else:
            attn = gm(F, 1.0)
        attn /= 1.0 + 0.1 * math.log(F)
    attn *= float(hp("rope.scaling.attn_factor", 1.0) or 1.0)
    org = attn * (1.0 + 0.1 * math.log(F))
    mscale = org * (1.0 + 0.1 * log_mul * math.log(F))
    return dict(freq_scale=freq_scale, ext_factor=ext, beta_fast=32.0, beta_slow=1.0,
                n_ctx_orig=int(hp("rope.scaling.original_context_length", 0)
                               or hp("context_length")),
                rope_mscale=org if ext != 0.0 else attn, mscale=mscale,
                kq_scale=mscale * mscale / math.sqrt(k_head))


def tensor_f32(t):
    """Dequantizes a ReaderTensor to float32 in numpy order (ne reversed: rows, ne0)."""
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).reshape(shape))


class RefModel:
    """One GGUF model loaded fully dequantized; a KV cache per generate call."""

    def __init__(self, path, dtype=np.float32):
        self.path = path
        self.dtype = dtype
        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch not in ARCHS:
            raise ValueError(f"{path}: unsupported architecture {arch!r}")
        self.arch = arch
        hp = lambda k, d=None: _field(r, f"{arch}.{k}", d)  # noqa: E731
        # multi-token-prediction (nextn) blocks are appended after the trunk's layers:
        # llama.cpp's n_layer() = block_count - nextn_predict_layers
        self.n_nextn = int(hp("nextn_predict_layers", 0) or 0)
        self.n_layer = int(hp("block_count")) - self.n_nextn
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        self.eps = float(hp("attention.layer_norm_rms_epsilon",
                            1e-6 if arch in ("gemma3", "gemma2") else 1e-5))
        self.freq_base = float(hp("rope.freq_base", 10000.0))
        self.neox = arch in ("qwen2", "qwen3", "gemma3", "phi3", "olmo2", "qwen3moe", "gemma2")
        # the gemma block (embedding scale, GELU FFN, post-norms); gemma2's own parts below
        self.gemma = arch in ("gemma3", "gemma2")
        self.gemma2 = arch == "gemma2"
        self.olmo2 = arch == "olmo2"
        self.nope_step = 4 if arch == "smollm3" else 0
        g = (lambda k, d: float(hp(k, d) or d)) if arch == "granite" else (lambda k, d: d)
        self.embd_mul = g("embedding_scale", 1.0)
        self.residual_mul = g("residual_scale", 1.0)
        self.logit_div = g("logit_scale", 1.0)
        self.attn_scale = g("attention.scale", 0.0)
        self.window = int(hp("attention.sliding_window", 0) or 0) if self.gemma else 0
        self.swa_pattern = 6
        self.attn_cap = self.final_cap = 0.0
        if self.gemma2:
            self.window = int(hp("attention.sliding_window", 4096))
            self.swa_pattern = int(hp("attention.sliding_window_pattern", 2))
            self.attn_cap = float(hp("attn_logit_softcapping", 50.0))
            self.final_cap = float(hp("final_logit_softcapping", 30.0))
            if self.n_layer == 46:  # the 27B model (llama.cpp: LLM_TYPE_27B)
                self.attn_scale = 1.0 / math.sqrt(self.n_embd // self.n_head)
        self.mla = arch == "deepseek2"
        self._moe_hparams(r, hp)
        self.eos = _field(r, "tokenizer.ggml.eos_token_id")
        types = _field(r, "tokenizer.ggml.token_type")
        # tokens that end generation in llama.cpp: the EOS and the control tokens
        self.control_ids = set(i for i, t in enumerate(types or []) if t == 3)

        tensors = {t.name: t for t in r.tensors}

        def W(name, required=True):
            t = tensors.get(name)
            if t is None:
                if required:
                    raise ValueError(f"{path}: missing tensor {name}")
                return None
            return tensor_f32(t).astype(dtype, copy=False)

        self.tok_embd = W("token_embd.weight")          # (n_vocab, n_embd)
        self.n_vocab = self.tok_embd.shape[0]
        self.output_norm = W("output_norm.weight")      # (n_embd,)
        out = W("output.weight", required=False)        # (n_vocab, n_embd) or tied
        self.output = self.tok_embd if out is None else out
        ff = W("rope_freqs.weight", required=False)     # (n_rot/2,) llama3 frequency factors
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        inv = self.freq_base ** (-2.0 * i / self.n_rot)
        if ff is not None:
            inv = inv / ff.astype(np.float64)
        self.inv_freq = inv                             # (n_rot/2,)
        self.inv_freq_swa = 10000.0 ** (-2.0 * i / self.n_rot)
        if self.gemma2:  # the global layers' base unless the file says otherwise
            self.inv_freq_swa = float(hp("rope.freq_base_swa", self.freq_base)) ** (
                -2.0 * i / self.n_rot)

        self.layers = []
        for il in range(self.n_layer + self.n_nextn):
            p = f"blk.{il}."
            L = {"attn_output": W(p + "attn_output.weight")}
            for k in ("attn_norm", "ffn_norm"):
                L[k] = W(p + k + ".weight", required=not self.olmo2)
            if self.mla:
                self._load_mla(L, p, W)
            else:
                qkv = W(p + "attn_qkv.weight", required=False)
                if qkv is None:
                    for k in ("attn_q", "attn_k", "attn_v"):
                        L[k] = W(p + k + ".weight")
                else:  # fused: Q rows, then K, then V
                    nq, nkv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
                    L["attn_q"], L["attn_k"], L["attn_v"] = np.split(qkv, [nq, nq + nkv])
                for k in ("attn_q", "attn_k", "attn_v"):
                    L[k + ".bias"] = W(p + k + ".bias", required=False)
                L["attn_q_norm"] = W(p + "attn_q_norm.weight", required=False)
                L["attn_k_norm"] = W(p + "attn_k_norm.weight", required=False)
            moe = self.n_expert > 0 and il >= self.n_dense_lead
            if moe:
                L["ffn_gate_inp"] = W(p + "ffn_gate_inp.weight")           # (n_expert, n_embd)
                L["exp_probs_b"] = W(p + "exp_probs_b.bias", required=False)  # (n_expert,)
                for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                    L[k] = W(p + k + ".weight")      # (n_expert, n_ff_exp, n_embd) / down
                for k in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
                    L[k] = W(p + k + ".weight", required=self.mla)
            else:
                L["ffn_down"] = W(p + "ffn_down.weight")
                gate = W(p + "ffn_gate.weight", required=False)
                up = W(p + "ffn_up.weight")
                if gate is None:  # phi3: ffn_up holds gate rows, then up rows
                    gate, up = np.split(up, 2)
                L["ffn_gate"], L["ffn_up"] = gate, up
            post = self.gemma or self.olmo2
            L["post_attention_norm"] = W(p + "post_attention_norm.weight", required=post)
            L["post_ffw_norm"] = W(p + "post_ffw_norm.weight", required=post)
            self.layers.append(L)
        self.mtp = self._load_mtp(W) if self.n_nextn else None
        # routing diagnostics of the last forward calls: the smallest gap between the last
        # selected and the first unselected score (experts, and groups); a gap near float32
        # rounding means llama.cpp may pick another expert for a reason that is no bug
        self.min_route_gap = np.inf

    def _load_mtp(self, W):
        """The MTP block (src/models/deepseek2.cpp, load_arch_tensors and graph_mtp): the
        last of self.layers (a MoE MLA layer), taken out of the trunk, plus its nextn
        tensors; the optional ones fall back as llama.cpp's graph does."""
        if self.arch != "deepseek2" or self.n_nextn != 1:
            raise ValueError(f"{self.path}: {self.n_nextn} nextn blocks on {self.arch}: only "
                             "deepseek2 with one is modelled (llama.cpp runs one)")
        if self.n_layer < self.n_dense_lead or self.layers[-1].get("attn_q_a") is None:
            raise ValueError(f"{self.path}: llama.cpp's MTP block needs MoE and q_lora_rank > 0")
        p = f"blk.{self.n_layer}.nextn."
        M = {"layer": self.layers.pop(),
             "eh_proj": W(p + "eh_proj.weight"),          # (n_embd, 2 * n_embd): [e | h]
             "enorm": W(p + "enorm.weight"),
             "hnorm": W(p + "hnorm.weight")}
        hn = W(p + "shared_head_norm.weight", required=False)
        M["head_norm"] = self.output_norm if hn is None else hn
        head = W(p + "shared_head_head.weight", required=False)
        M["head"] = self.output if head is None else head
        emb = W(p + "embed_tokens.weight", required=False)
        M["embd"] = self.tok_embd if emb is None else emb
        if M["eh_proj"].shape != (self.n_embd, 2 * self.n_embd):
            raise ValueError(f"{self.path}: nextn.eh_proj is {M['eh_proj'].shape}")
        return M

    def _moe_hparams(self, r, hp):
        """Expert routing and MLA hyper-parameters, with llama.cpp's defaults
        (llama-model.cpp load_hparams, models/qwen3moe.cpp and deepseek2.cpp)."""
        arch = self.arch
        self.n_expert = int(hp("expert_count", 0) or 0)
        self.n_expert_used = int(hp("expert_used_count", 0) or 0)
        self.n_group = int(hp("expert_group_count", 0) or 0)
        self.n_group_used = int(hp("expert_group_used_count", 0) or 0)
        self.n_dense_lead = 0
        self.gating = 1               # softmax
        self.w_norm = arch == "qwen3moe"   # qwen3moe passes norm_w = true, ignores the key
        self.w_scale = 0.0
        if arch == "deepseek2":
            self.n_dense_lead = int(hp("leading_dense_block_count", 0) or 0)
            self.w_norm = bool(hp("expert_weights_norm", False))
            self.w_scale = float(hp("expert_weights_scale", 0.0) or 0.0)
            n_vocab = int(hp("vocab_size", 0) or len(_field(r, "tokenizer.ggml.tokens") or []))
            g = int(hp("expert_gating_func", 0) or 0)
            if g == 0:   # old DeepSeek V2 / V2.5 files: softmax (GLM 4.7 Lite: sigmoid)
                g = 2 if self.n_layer in (47, 48) and n_vocab == 154880 else 1
            self.gating = g
            self.kv_lora = int(hp("attention.kv_lora_rank"))
            k_mla = hp("attention.key_length_mla", None)
            v_mla = hp("attention.value_length_mla", None)
            # legacy (non-MLA) files: key_length / value_length are the MHA head sizes
            self.k_head = int(k_mla if k_mla else hp("attention.key_length"))
            self.v_head = int(v_mla if v_mla else hp("attention.value_length"))
            self.qk_nope = self.k_head - self.n_rot
            self.yarn = yarn_params(r, arch, hp, self.k_head)
        if self.gating not in (1, 2):
            raise ValueError(f"{self.path}: expert_gating_func {self.gating} not modelled")

    def _load_mla(self, L, p, W):
        """deepseek2's attention tensors, kept as stored (decompressed in attn_mla)."""
        L["attn_q"] = W(p + "attn_q.weight", required=False)              # (H*dk, n_embd)
        if L["attn_q"] is None:
            L["attn_q_a"] = W(p + "attn_q_a.weight")                      # (q_lora, n_embd)
            L["attn_q_a_norm"] = W(p + "attn_q_a_norm.weight")
            L["attn_q_b"] = W(p + "attn_q_b.weight")                      # (H*dk, q_lora)
        L["attn_kv_a_mqa"] = W(p + "attn_kv_a_mqa.weight")    # (kv_lora + n_rot, n_embd)
        L["attn_kv_a_norm"] = W(p + "attn_kv_a_norm.weight")
        kb = W(p + "attn_k_b.weight", required=False)         # (H, kv_lora, qk_nope)
        if kb is not None:
            L["wk"] = np.ascontiguousarray(kb.transpose(0, 2, 1))          # (H, nope, kv_lora)
            L["wv"] = W(p + "attn_v_b.weight")                # (H, v_head, kv_lora)
        else:  # legacy: kv_b_proj rows per head: qk_nope K rows, then v_head V rows
            kvb = W(p + "attn_kv_b.weight").reshape(self.n_head, self.qk_nope + self.v_head,
                                                    self.kv_lora)
            L["wk"] = np.ascontiguousarray(kvb[:, :self.qk_nope])
            L["wv"] = np.ascontiguousarray(kvb[:, self.qk_nope:])

    # -- pieces ---------------------------------------------------------------------
    def rmsnorm(self, x, w):
        """x (..., n) * w (n,), normalized over the last axis."""
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)).astype(self.dtype) * w

    def is_swa(self, il):
        return self.window > 0 and il % self.swa_pattern < self.swa_pattern - 1

    def rope(self, x, pos, inv_freq=None):
        """x (T, heads, head_dim) rotated in place over the first n_rot dims; pos (T,)."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        ang = pos[:, None].astype(np.float64) * inv_freq[None, :]       # (T, n_rot/2)
        cos = np.cos(ang)[:, None, :].astype(self.dtype)
        sin = np.sin(ang)[:, None, :].astype(self.dtype)
        half = self.n_rot // 2
        if self.neox:
            x0 = x[..., :half].copy()
            x1 = x[..., half:self.n_rot].copy()
            x[..., :half] = x0 * cos - x1 * sin
            x[..., half:self.n_rot] = x0 * sin + x1 * cos
        else:
            x0 = x[..., 0:self.n_rot:2].copy()
            x1 = x[..., 1:self.n_rot:2].copy()
            x[..., 0:self.n_rot:2] = x0 * cos - x1 * sin
            x[..., 1:self.n_rot:2] = x0 * sin + x1 * cos
        return x

    def forward(self, ids, cache, all_rows=False, out_h=None):
        """Runs tokens ids (T,) after the cache's positions; returns the last row's logits
        (n_vocab,), or with all_rows every row's (T, n_vocab), and appends K/V to cache (a
        list with one (K, V) per layer, each (n_head_kv, S, head_dim)). out_h: a list that
        gets every row's normed final hidden state (T, n_embd), the LM head's input (llama.cpp's
        h_nextn, the MTP block's h)."""
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        past = cache[0][0].shape[1] if cache else 0
        pos = np.arange(past, past + T)
        x = self.tok_embd[ids].astype(self.dtype)                        # (T, n_embd)
        if self.gemma:
            x = x * self.dtype(np.sqrt(self.n_embd))
        x = x * self.dtype(self.embd_mul)
        H, KV, hd = self.n_head, self.n_head_kv, self.head_dim
        g = H // KV
        scale = self.attn_scale or 1.0 / np.sqrt(hd)
        post = self.gemma or self.olmo2
        # causal mask over (T, past + T): query t sees keys j <= past + t
        mask = np.arange(past + T)[None, :] > (past + np.arange(T))[:, None]
        # sliding window: also masked when the key is window or more positions back
        mask_swa = mask | (np.arange(past + T)[None, :]
                           <= (past + np.arange(T))[:, None] - max(self.window, 1))
        for il, L in enumerate(self.layers):
            swa = self.is_swa(il)
            inv = self.inv_freq_swa if swa else self.inv_freq
            h = x if self.olmo2 else self.rmsnorm(x, L["attn_norm"])
            if self.mla:
                x = x + self.attn_mla(L, h, pos, cache, il, mask)
                h = self.rmsnorm(x, L["ffn_norm"])
                x = x + self.ffn(L, h)
                continue
            q = h @ L["attn_q"].T                                        # (T, H*hd)
            k = h @ L["attn_k"].T                                        # (T, KV*hd)
            v = h @ L["attn_v"].T
            if L["attn_q.bias"] is not None:
                q = q + L["attn_q.bias"]
                k = k + L["attn_k.bias"]
                v = v + L["attn_v.bias"]
            if self.olmo2:  # over the whole projection, before the heads are cut
                q = self.rmsnorm(q, L["attn_q_norm"])
                k = self.rmsnorm(k, L["attn_k_norm"])
            q = q.reshape(T, H, hd)
            k = k.reshape(T, KV, hd)
            v = v.reshape(T, KV, hd)
            if L["attn_q_norm"] is not None and not self.olmo2:
                q = self.rmsnorm(q, L["attn_q_norm"])
                k = self.rmsnorm(k, L["attn_k_norm"])
            if not self.nope_step or (il + 1) % self.nope_step != 0:
                q = self.rope(np.array(q), pos, inv)
                k = self.rope(np.array(k), pos, inv)
            k = k.transpose(1, 0, 2)                                     # (KV, T, hd)
            v = v.transpose(1, 0, 2)
            if len(cache) > il:
                K = np.concatenate([cache[il][0], k], axis=1)            # (KV, S, hd)
                V = np.concatenate([cache[il][1], v], axis=1)
                cache[il] = (K, V)
            else:
                K, V = k, v
                cache.append((K, V))
            qh = q.transpose(1, 0, 2).reshape(KV, g, T, hd)              # (KV, g, T, hd)
            if self.attn_cap:  # llama.cpp scales q, soft-caps q k^T, softmax at scale 1
                s = np.einsum("kgtd,ksd->kgts", qh * self.dtype(scale), K).astype(np.float64)
                s = self.attn_cap * np.tanh(s / self.attn_cap)
            else:
                s = np.einsum("kgtd,ksd->kgts", qh, K).astype(np.float64) * scale
            s[..., mask_swa if swa else mask] = -np.inf
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p = (p / p.sum(axis=-1, keepdims=True)).astype(self.dtype)
            a = np.einsum("kgts,ksd->kgtd", p, V)                        # (KV, g, T, hd)
            a = a.reshape(H, T, hd).transpose(1, 0, 2).reshape(T, H * hd)
            o = a @ L["attn_output"].T
            if post:
                o = self.rmsnorm(o, L["post_attention_norm"])
            x = x + o * self.dtype(self.residual_mul)
            h = x if self.olmo2 else self.rmsnorm(x, L["ffn_norm"])
            f = self.ffn(L, h)
            if post:
                f = self.rmsnorm(f, L["post_ffw_norm"])
            x = x + f * self.dtype(self.residual_mul)
        if out_h is not None:
            out_h.append(self.rmsnorm(x, self.output_norm))
            rows = out_h[-1] if all_rows else out_h[-1][-1:]
        else:
            rows = self.rmsnorm(x if all_rows else x[-1:], self.output_norm)  # (T|1, n_embd)
        out = (rows @ self.output.T) / self.dtype(self.logit_div)          # (T or 1, n_vocab)
        if self.final_cap:
            out = self.final_cap * np.tanh(out.astype(np.float64) / self.final_cap)
        out = out.astype(np.float32)
        return out if all_rows else out[0]

    def silu_ffn(self, h, gate_w, up_w, down_w):
        gate = h @ gate_w.T                                              # (T, n_ff)
        up = h @ up_w.T
        act = gate / (1.0 + np.exp(-gate.astype(np.float64))).astype(self.dtype) * up
        return act @ down_w.T

    def ffn(self, L, h):
        """The FFN block on the normed rows h (T, n_embd): dense, or routed experts (plus
        shared experts)."""
        if "ffn_gate_inp" in L:
            f = self.moe(L, h)
            if L.get("ffn_gate_shexp") is not None:
                f = f + self.silu_ffn(h, L["ffn_gate_shexp"], L["ffn_up_shexp"],
                                      L["ffn_down_shexp"])
            return f
        if self.gemma:
            gate = h @ L["ffn_gate"].T                                   # (T, n_ff)
            up = h @ L["ffn_up"].T
            g64 = gate.astype(np.float64)
            gl = 0.5 * g64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi)
                                            * (g64 + 0.044715 * g64 ** 3)))
            act = gl.astype(self.dtype) * up
            return act @ L["ffn_down"].T
        return self.silu_ffn(h, L["ffn_gate"], L["ffn_up"], L["ffn_down"])

    def moe(self, L, h):
        """llama.cpp's build_moe_ffn on rows h (T, n_embd): routing in float64 from the
        float32 router logits, then each selected expert's silu FFN, weighted and summed."""
        T = h.shape[0]
        E, k = self.n_expert, self.n_expert_used
        logits = (h @ L["ffn_gate_inp"].T).astype(np.float64)           # (T, E)
        if self.gating == 1:
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = e / e.sum(axis=-1, keepdims=True)
        else:
            probs = 1.0 / (1.0 + np.exp(-logits))
        sel = probs if L.get("exp_probs_b") is None else probs + L["exp_probs_b"]
        rows = np.arange(T)[:, None]
        if self.n_group > 1:
            G, U = self.n_group, self.n_group_used
            grp = sel.reshape(T, G, E // G)
            score = np.sort(grp, axis=-1)[..., -2:].sum(axis=-1)          # (T, G): best 2
            order = np.argsort(-score, axis=-1, kind="stable")
            ss = np.take_along_axis(score, order, axis=-1)
            self.min_route_gap = min(self.min_route_gap, float((ss[:, U - 1] - ss[:, U]).min()))
            drop = np.ones((T, G), dtype=bool)
            drop[rows, order[:, :U]] = False
            sel = np.where(np.repeat(drop, E // G, axis=1), -np.inf, sel)
        order = np.argsort(-sel, axis=-1, kind="stable")
        top = order[:, :k]                                               # (T, k)
        if k < E:
            ss = np.take_along_axis(sel, order[:, k - 1:k + 1], axis=-1)
            gap = ss[:, 0] - ss[:, 1]
            self.min_route_gap = min(self.min_route_gap, float(gap[np.isfinite(gap)].min(
                initial=np.inf)))
        wts = probs[rows, top]                                           # (T, k)
        if self.w_norm:
            wts = wts / np.maximum(wts.sum(axis=-1, keepdims=True), 6.103515625e-5)
        if self.w_scale not in (0.0, 1.0):
            wts = wts * self.w_scale
        wts = wts.astype(self.dtype)
        out = np.zeros_like(h)
        for e_id in np.unique(top):
            t_idx, j_idx = np.nonzero(top == e_id)
            y = self.silu_ffn(h[t_idx], L["ffn_gate_exps"][e_id], L["ffn_up_exps"][e_id],
                              L["ffn_down_exps"][e_id])
            out[t_idx] += wts[t_idx, j_idx][:, None] * y
        return out

    def rope_yarn_tables(self, pos):
        """(cos, sin), each (T, n_rot/2), of ggml's rope with YaRN (ggml-cpu rope_yarn):
        theta_extrap = pos * base^(-2i/n_rot), theta_interp = freq_scale * theta_extrap,
        mixed by the ramp over the correction dims [low, high] when ext_factor != 0; cos and
        sin carry the rope's magnitude scale."""
        y = self.yarn
        n = self.n_rot
        i = np.arange(n // 2, dtype=np.float64)
        extrap = pos[:, None].astype(np.float64) * self.freq_base ** (-2.0 * i / n)[None, :]
        theta = y["freq_scale"] * extrap
        if y["ext_factor"] != 0.0:
            def corr_dim(beta):
                return (n * np.log(y["n_ctx_orig"] / (beta * 2.0 * np.pi))
                        / (2.0 * np.log(self.freq_base)))
            low = max(0.0, np.floor(corr_dim(y["beta_fast"])))
            high = min(n - 1.0, np.ceil(corr_dim(y["beta_slow"])))
            ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
            mix = ramp * y["ext_factor"]
            theta = theta * (1.0 - mix) + extrap * mix
        return np.cos(theta) * y["rope_mscale"], np.sin(theta) * y["rope_mscale"]

    def attn_mla(self, L, h, pos, cache, il, mask):
        """deepseek2's attention, decompressed to plain MHA (every head its own K and V):
        returns Wo a (T, n_embd); appends K (H, T, qk_nope + n_rot), V (H, T, v_head)."""
        T = h.shape[0]
        H, dn, dr, kvl = self.n_head, self.qk_nope, self.n_rot, self.kv_lora
        if L["attn_q"] is not None:
            q = h @ L["attn_q"].T
        else:
            q = self.rmsnorm(h @ L["attn_q_a"].T, L["attn_q_a_norm"]) @ L["attn_q_b"].T
        q = q.reshape(T, H, dn + dr)
        kv = h @ L["attn_kv_a_mqa"].T                                    # (T, kvl + dr)
        c = self.rmsnorm(kv[:, :kvl], L["attn_kv_a_norm"])               # (T, kvl)
        cos, sin = self.rope_yarn_tables(pos)                            # (T, dr/2)
        cos, sin = cos[:, None, :].astype(self.dtype), sin[:, None, :].astype(self.dtype)

        def rope_norm(x):                                                # (T, heads, dr)
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = x0 * cos - x1 * sin
            out[..., 1::2] = x0 * sin + x1 * cos
            return out

        q_pe = rope_norm(q[..., dn:])                                    # (T, H, dr)
        k_pe = rope_norm(kv[:, None, kvl:])                              # (T, 1, dr)
        k_nope = np.einsum("tc,hdc->thd", c, L["wk"])                    # (T, H, dn)
        v = np.einsum("tc,hdc->thd", c, L["wv"])                         # (T, H, dv)
        qf = np.concatenate([q[..., :dn], q_pe], axis=-1)                # (T, H, dk)
        k = np.concatenate([k_nope, np.broadcast_to(k_pe, (T, H, dr))], axis=-1)
        k = k.transpose(1, 0, 2)                                         # (H, T, dk)
        v = v.transpose(1, 0, 2)                                         # (H, T, dv)
        if len(cache) > il:
            K = np.concatenate([cache[il][0], k], axis=1)
            V = np.concatenate([cache[il][1], v], axis=1)
            cache[il] = (K, V)
        else:
            K, V = k, v
            cache.append((K, V))
        sc = np.einsum("htd,hsd->hts", qf.transpose(1, 0, 2), K).astype(np.float64)
        sc = sc * self.yarn["kq_scale"]
        sc[:, mask] = -np.inf
        sc = sc - sc.max(axis=-1, keepdims=True)
        pr = np.exp(sc)
        pr = (pr / pr.sum(axis=-1, keepdims=True)).astype(self.dtype)
        a = np.einsum("hts,hsd->thd", pr, V).reshape(T, -1)              # (T, H*dv)
        return a @ L["attn_output"].T

    def mtp_forward(self, toks, hs, cache):
        """The MTP block (llama.cpp's graph_mtp) on rows (toks[t], hs[t]) after the cache's
        positions (its own KV: a list of one (K, V)): e = embed(tok) (nextn.embed_tokens, else
        token_embd), x = eh_proj [rmsnorm(e) * enorm | rmsnorm(h) * hnorm], then the block's
        MLA attention and MoE FFN (shared experts too) with residuals from x, then
        h_nextn = rmsnorm(x) * (shared_head_norm, else output_norm) and logits = (nextn
        shared_head_head, else the LM head) h_nextn. Returns (logits (T, n_vocab),
        h_nextn (T, n_embd)), both in the model's dtype."""
        M, L = self.mtp, self.mtp["layer"]
        toks = np.asarray(toks, dtype=np.int64)
        T = len(toks)
        past = cache[0][0].shape[1] if cache else 0
        pos = np.arange(past, past + T)
        e = M["embd"][toks].astype(self.dtype)
        h = np.asarray(hs, dtype=self.dtype).reshape(T, self.n_embd)
        x = np.concatenate([self.rmsnorm(e, M["enorm"]), self.rmsnorm(h, M["hnorm"])],
                           axis=1) @ M["eh_proj"].T                      # (T, n_embd)
        mask = np.arange(past + T)[None, :] > (past + np.arange(T))[:, None]
        x = x + self.attn_mla(L, self.rmsnorm(x, L["attn_norm"]), pos, cache, 0, mask)
        x = x + self.ffn(L, self.rmsnorm(x, L["ffn_norm"]))
        hn = self.rmsnorm(x, M["head_norm"])
        return hn @ M["head"].T, hn

    def mtp_rows(self, ids):
        """The target and the MTP block over one sequence ids (T,): returns (target logits
        (T, n_vocab), MTP logits (T, n_vocab)), where MTP row p = (ids[p], h_{p-1}) at
        position p (h the target's h_nextn rows, h_{-1} = 0) drafts the token after ids[p],
        as target row p chooses it (the driver's rows, common/speculative.cpp draft-mtp)."""
        if self.mtp is None:
            raise ValueError(f"{self.path}: no MTP (nextn) block")
        hs = []
        tl = self.forward(ids, [], all_rows=True, out_h=hs)
        h_in = np.concatenate([np.zeros((1, self.n_embd), self.dtype), hs[0][:-1]])
        ml, _ = self.mtp_forward(ids, h_in, [])
        return tl, ml

    def mtp_draft(self, ids, n_draft=1):
        """llama.cpp's draft-mtp after a prompt ids (n tokens): the target runs the prompt,
        x_n = argmax of its last logits; the MTP block runs rows p = 0..n (x_p, h_{p-1}),
        h_{-1} = 0, and row n's logits are the first draft's; each further draft feeds the
        previous one with the MTP's own h_nextn at the next position. Returns (x_n, drafts
        (n_draft greedy tokens), first-draft logits (n_vocab,) in the model's dtype)."""
        if self.mtp is None:
            raise ValueError(f"{self.path}: no MTP (nextn) block")
        ids = [int(t) for t in ids]
        hs = []
        lg = self.forward(ids, [], out_h=hs)
        x_n = int(np.argmax(lg))
        h_in = np.concatenate([np.zeros((1, self.n_embd), self.dtype), hs[0]])
        cache = []
        ml, hn = self.mtp_forward(ids + [x_n], h_in, cache)
        first = ml[-1]
        drafts = [int(np.argmax(first))]
        while len(drafts) < n_draft:
            ml, hn = self.mtp_forward([drafts[-1]], hn[-1:], cache)
            drafts.append(int(np.argmax(ml[-1])))
        return x_n, drafts, first

    # -- API ------------------------------------------------------------------------
    def logits_last(self, ids):
        return self.forward(ids, [])

    def logits_all(self, ids):
        """(T, n_vocab): row i is the distribution of the token after ids[:i + 1]."""
        return self.forward(ids, [], all_rows=True)

    def generate(self, ids, n):
        """Greedy decoding of n tokens (never stops early). Returns (tokens, logits), where
        logits[i] (n_vocab,) is the distribution token i was chosen from."""
        cache = []
        lg = self.forward(ids, cache)
        toks, all_logits = [], []
        for step in range(n):
            t = int(np.argmax(lg))
            toks.append(t)
            all_logits.append(lg)
            if step + 1 < n:
                lg = self.forward([t], cache)
        return toks, all_logits


_models = {}


def load(path, dtype=np.float32):
    """A cached RefModel (loading the 135M model takes a few seconds)."""
    key = (path, np.dtype(dtype).name)
    if key not in _models:
        _models[key] = RefModel(path, dtype)
    return _models[key]


def logits_last(path, ids):
    return load(path).logits_last(ids)


def greedy(path, ids, n):
    return load(path).generate(ids, n)[0]


def mtp_acceptance(m, ids, n):
    """Greedy decoding of n target tokens after ids; returns (hits, n): how many of the n
    steps after the first had the MTP's first draft (row p, RefModel.mtp_rows) equal to the
    target's own next choice, i.e. how often a one-token draft would be accepted."""
    toks, _ = m.generate(ids, n)
    seq = list(ids) + toks
    tl, ml = m.mtp_rows(seq[:-1])
    rows = range(len(ids), len(seq) - 1)  # row p drafts seq[p + 1]; row n-1 is the target's
    hits = sum(int(np.argmax(ml[p]) == seq[p + 1]) for p in rows)
    return hits, len(rows)


def mtp_first_draft_logits(path, ids, dtype=np.float64):
    """The MTP first-draft logits after prompt ids (RefModel.mtp_draft), float64 by default."""
    return load(path, dtype).mtp_draft(ids)[2]


def main():
    ap = argparse.ArgumentParser(description="numpy reference forward pass of a GGUF model")
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--greedy", type=int, default=0, help="generate N tokens greedily")
    ap.add_argument("--out-logits", help="write the last position's logits (raw float32)")
    ap.add_argument("--f64", action="store_true", help="compute in float64")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="MTP models: print x_n and K greedy MTP drafts; --out-logits then gets "
                         "the first draft's logits (what `tandem logits --mtp` writes)")
    ap.add_argument("--mtp-accept", type=int, default=0, metavar="N",
                    help="MTP models: over N greedy target tokens, how often the MTP's first "
                         "draft is the target's next token")
    a = ap.parse_args()
    ids = [int(x) for x in a.ids.split(",") if x.strip()]
    m = load(a.model, np.float64 if a.f64 else np.float32)
    if a.mtp:
        x_n, drafts, first = m.mtp_draft(ids, a.mtp)
        if a.out_logits:
            first.astype("<f4").tofile(a.out_logits)
        print(f"x_n {x_n} drafts {' '.join(map(str, drafts))}")
        return 0
    if a.mtp_accept:
        hit, n = mtp_acceptance(m, ids, a.mtp_accept)
        print(f"MTP first draft = target's next token: {hit}/{n} ({hit / n:.1%})")
        return 0
    lg = m.logits_last(ids)
    if a.out_logits:
        lg.astype("<f4").tofile(a.out_logits)
    top = np.argsort(-lg)[:5]
    print("top5:", " ".join(f"{int(t)}:{lg[t]:.4f}" for t in top), file=sys.stderr)
    if a.greedy:
        toks, _ = m.generate(ids, a.greedy)
        print(" ".join(str(t) for t in toks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
