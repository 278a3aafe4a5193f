#!/usr/bin/env python3
"""ref_forward.py: an independent numpy forward pass of Llama-family and Gemma 3 GGUF models.

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

The other architectures, each from its llama.cpp graph (src/models/<arch>.cpp):
  smollm3  llama, but layers with (il + 1) % 4 == 0 skip rope (n_no_rope_layer_step 4)
  granite  llama with x = embd * embedding_scale, scores * attention.scale (when set),
           x = x + residual_scale * block output (both blocks), logits / logit_scale
  phi3     qwen2-style NEOX rope, Q/K/V rows of attn_qkv, FFN silu(gate) * up with gate
           and up the two halves of ffn_up's rows (gate first); LongRoPE not modelled
  olmo2    no pre-norms: q, k, v = Wq x, ...; q = rmsnorm(q) * attn_q_norm over the whole
           projection (k likewise), NEOX rope; x = x + rmsnorm(Wo a) * post_attention_norm;
           x = x + rmsnorm(ffn(x)) * post_ffw_norm

Python API:
  logits_last(path, ids) -> np.ndarray (n_vocab,) float32
  greedy(path, ids, n)    -> list[int]
  RefModel(path).generate(ids, n) -> (tokens, per-step logits) for tie analysis

Command line:
  ref_forward.py --model PATH --ids 1,2,3 [--greedy N] [--out-logits FILE.f32] [--f64]
"""
import argparse
import sys

import numpy as np
import gguf


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


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
        if arch not in ("llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3",
                        "olmo2"):
            raise ValueError(f"{path}: unsupported architecture {arch!r}")
        self.arch = arch
        hp = lambda k, d=None: _field(r, f"{arch}.{k}", d)  # noqa: E731
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        self.eps = float(hp("attention.layer_norm_rms_epsilon",
                            1e-6 if arch == "gemma3" else 1e-5))
        self.freq_base = float(hp("rope.freq_base", 10000.0))
        self.neox = arch in ("qwen2", "qwen3", "gemma3", "phi3", "olmo2")
        self.gemma = arch == "gemma3"
        self.olmo2 = arch == "olmo2"
        self.nope_step = 4 if arch == "smollm3" else 0
        g = (lambda k, d: float(hp(k, d) or d)) if arch == "granite" else (lambda k, d: d)
        self.embd_mul = g("embedding_scale", 1.0)
        self.residual_mul = g("residual_scale", 1.0)
        self.logit_div = g("logit_scale", 1.0)
        self.attn_scale = g("attention.scale", 0.0)
        self.window = int(hp("attention.sliding_window", 0) or 0) if self.gemma else 0
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

        self.layers = []
        for il in range(self.n_layer):
            p = f"blk.{il}."
            L = {k: W(p + k + ".weight") for k in ("attn_output", "ffn_down")}
            for k in ("attn_norm", "ffn_norm"):
                L[k] = W(p + k + ".weight", required=not self.olmo2)
            qkv = W(p + "attn_qkv.weight", required=False)
            if qkv is None:
                for k in ("attn_q", "attn_k", "attn_v"):
                    L[k] = W(p + k + ".weight")
            else:  # fused: Q rows, then K, then V
                nq, nkv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
                L["attn_q"], L["attn_k"], L["attn_v"] = np.split(qkv, [nq, nq + nkv])
            gate = W(p + "ffn_gate.weight", required=False)
            up = W(p + "ffn_up.weight")
            if gate is None:  # phi3: ffn_up holds gate rows, then up rows
                gate, up = np.split(up, 2)
            L["ffn_gate"], L["ffn_up"] = gate, up
            for k in ("attn_q", "attn_k", "attn_v"):
                L[k + ".bias"] = W(p + k + ".bias", required=False)
            L["attn_q_norm"] = W(p + "attn_q_norm.weight", required=False)
            L["attn_k_norm"] = W(p + "attn_k_norm.weight", required=False)
            post = self.gemma or self.olmo2
            L["post_attention_norm"] = W(p + "post_attention_norm.weight", required=post)
            L["post_ffw_norm"] = W(p + "post_ffw_norm.weight", required=post)
            self.layers.append(L)

    # -- pieces ---------------------------------------------------------------------
    def rmsnorm(self, x, w):
        """x (..., n) * w (n,), normalized over the last axis."""
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)).astype(self.dtype) * w

    def is_swa(self, il):
        return self.window > 0 and il % 6 != 5

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

    def forward(self, ids, cache, all_rows=False):
        """Runs tokens ids (T,) after the cache's positions; returns the last row's logits
        (n_vocab,), or with all_rows every row's (T, n_vocab), and appends K/V to cache (a
        list with one (K, V) per layer, each (n_head_kv, S, head_dim))."""
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
            gate = h @ L["ffn_gate"].T                                   # (T, n_ff)
            up = h @ L["ffn_up"].T
            if self.gemma:
                g64 = gate.astype(np.float64)
                gl = 0.5 * g64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi)
                                                * (g64 + 0.044715 * g64 ** 3)))
                act = gl.astype(self.dtype) * up
            else:
                act = gate / (1.0 + np.exp(-gate.astype(np.float64))).astype(self.dtype) * up
            f = act @ L["ffn_down"].T
            if post:
                f = self.rmsnorm(f, L["post_ffw_norm"])
            x = x + f * self.dtype(self.residual_mul)
        rows = self.rmsnorm(x if all_rows else x[-1:], self.output_norm)  # (T or 1, n_embd)
        out = (rows @ self.output.T) / self.dtype(self.logit_div)          # (T or 1, n_vocab)
        out = out.astype(np.float32)
        return out if all_rows else out[0]

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


def main():
    ap = argparse.ArgumentParser(description="numpy reference forward pass of a GGUF model")
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--greedy", type=int, default=0, help="generate N tokens greedily")
    ap.add_argument("--out-logits", help="write the last position's logits (raw float32)")
    ap.add_argument("--f64", action="store_true", help="compute in float64")
    a = ap.parse_args()
    ids = [int(x) for x in a.ids.split(",") if x.strip()]
    m = load(a.model, np.float64 if a.f64 else np.float32)
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
