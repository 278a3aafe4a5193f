#!/usr/bin/env python3
"""ref_tokenizer.py: builds a Hugging Face `tokenizers` tokenizer from a GGUF's vocabulary.

Used by the reference tests to turn fixed prompt strings into token ids without the
engine's C tokenizer, and to decode ids for humans. Supports the GPT-2 style byte-level
BPE (tokenizer.ggml.model "gpt2") with the "smollm" pre-tokenizer (single digits, then the
GPT-2 split) that SmolLM2 and the synthetic models use; other pre-tokenizers fall back to
the plain GPT-2 split, which is good enough for choosing prompt ids.

Usage: ref_tokenizer.py --model PATH (--text TEXT | --chat TEXT | --decode 1,2,3)
"""
import argparse
import sys

import gguf
from tokenizers import Tokenizer, AddedToken, decoders, models, pre_tokenizers


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def from_gguf(path):
    """Returns a tokenizers.Tokenizer equivalent to the GGUF's gpt2 BPE vocabulary."""
    r = gguf.GGUFReader(path)
    kind = _field(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported here")
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _field(r, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    pre = _field(r, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # control tokens (type 3) are matched whole in the text, like llama.cpp's specials
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok


def chatml(user):
    """The ChatML prompt SmolLM2's template renders for one user message (with the
    template's default system message) and the generation prompt."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\n" + user +
            "<|im_end|>\n<|im_start|>assistant\n")


def encode(path, text):
    return from_gguf(path).encode(text, add_special_tokens=False).ids


def main():
    ap = argparse.ArgumentParser(description="tokenize with a GGUF's vocabulary (reference)")
    ap.add_argument("--model", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--chat", help="wrap in SmolLM2's ChatML prompt first")
    g.add_argument("--decode", help="comma- or space-separated ids")
    a = ap.parse_args()
    tok = from_gguf(a.model)
    if a.decode:
        ids = [int(x) for x in a.decode.replace(",", " ").split()]
        print(tok.decode(ids, skip_special_tokens=False))
    else:
        text = a.text if a.text is not None else chatml(a.chat)
        print(",".join(str(i) for i in tok.encode(text, add_special_tokens=False).ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
