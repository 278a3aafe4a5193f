#!/usr/bin/env python3
"""tok_reference.py: independent references for the tokenizer tests.

Each --case writes reference data under --out and runs the C test driver on it; the exit
code is the driver's. References:
  smollm2, smollm2_nospecial: the model's vocab and merges loaded into a HF `tokenizers`
      BPE with SmolLM2's own pre-tokenizer (Digits(individual) + ByteLevel regex);
      with and without its control tokens as added tokens (parse_special on / off).
  llama3, qwen2: a byte-level BPE trained here with `tokenizers` using the Llama 3 / Qwen2
      split regex, written as a GGUF holding only tokenizer metadata.
  spm: a small SentencePiece BPE model (byte_fallback) trained here, written as a GGUF;
      reference ids are sentencepiece's own encode.
  unsupported: a GGUF with an unknown pre-tokenizer or tokenizer model must fail with
      TD_EUNSUPP.
"""
import argparse
import os
import random
import subprocess
import sys

import numpy as np

CORPUS = [
    "Hello world",
    "hello world",
    " Hello",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "new\nlines\n\n\nand\r\nwindows\r\n",
    "   \n  \n\t \n",
    " ",
    "\n",
    "a  b   c    d",
    "The year 2024 had 365 days; pi is 3.14159265358979",
    "1234567890123 and 12 and 1",
    "x=1+2*3-4/5; y==z != w",
    "def foo(bar, baz=None):\n    return bar ** 2  # comment\n",
    "for (int i = 0; i < n; i++) { sum += a[i]; }",
    "if x:\n\tprint('tab indented')\n",
    "I'm sure you're right, they've said we'll go, it's John's and I'd",
    "DON'T SHOUT, I'LL SEE, WE'RE OK, THEY'VE GONE",
    "'s 't 're quoted 'words' and \"double\"",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u6f22\u5b57",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "emoji \U0001F600\U0001F60D\U0001F44D\U0001F3FD and \u2764\ufe0f family \U0001F468\u200d\U0001F469\u200d\U0001F467",
    "combining: e\u0301 a\u0300 n\u0303 \u0915\u093f \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u05e2\u05d1\u05e8\u05d9\u05ea",
    "nbsp\u00a0here and\u3000ideographic\u2003em space",
    "math: \u2211 \u222b \u221a2 \u2248 1.41 \u00b2\u00b3 \u2155 \u0663\u0664",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more<|im_start|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhey<|eot_id|>",
    "<s>[INST] hi [/INST]</s>",
    "<|im_start",
    "!!!??? ... ,,, ;;; ---",
    "https://example.com/path?query=1&b=2#frag",
    "email@example.com, @handle #tag $100 50% ^caret ~tilde",
    "ALLCAPS lowercase MiXeD CamelCase snake_case kebab-case",
    "a",
    "",
    "\u00ff\u0100\u0101 \u1e9e",
    "lots of words " * 20,
]

INVALID = [
    b"bad \xff byte",
    b"\xc3\x28 invalid 2-byte",
    b"truncated \xe2\x82",
    b"\x80\x81 lone continuation",
    b"overlong \xc0\x80 and \xed\xa0\x80 surrogate",
    b"ok \xf0\x9f\x98 truncated emoji \xf0\x9f\x98\x80",
    b"\xf5\xf8\xfe\xff",
]

TRAIN_TEXT = None


def train_texts():
    global TRAIN_TEXT
    if TRAIN_TEXT is None:
        rnd = random.Random(1234)
        words = ("the of and to in is was for on that with as by at from his her they we you "
                 "it this be are have had not but what all were when there can an your which "
                 "their said if do will each about how up out them then she many some so these "
                 "would other into has more two time like no way could people my than first "
                 "water been call who oil its now find long down day did get come made may part "
                 "token tokenizer model language serving engine prefill decode cache kernel").split()
        lines = []
        for _ in range(1500):
            n = rnd.randint(3, 14)
            ws = [rnd.choice(words) for _ in range(n)]
            if rnd.random() < 0.3:
                ws[0] = ws[0].capitalize()
            if rnd.random() < 0.2:
                ws.insert(rnd.randint(0, n), str(rnd.randint(0, 100000)))
            if rnd.random() < 0.1:
                ws.insert(rnd.randint(0, n), rnd.choice(["I'm", "don't", "we'll", "it's", "they've"]))
            lines.append(" ".join(ws) + rnd.choice([".", ",", "!", "?", "", "\n", ";"]))
        lines += CORPUS * 3
        TRAIN_TEXT = lines
    return TRAIN_TEXT


def strict_replace(b):
    """Each byte that does not start a valid UTF-8 sequence becomes U+FFFD (td_utf8_decode)."""
    out = []
    i = 0
    while i < len(b):
        c = b[i]
        n = 1 if c < 0x80 else 2 if 0xC2 <= c <= 0xDF else 3 if 0xE0 <= c <= 0xEF else 4 if 0xF0 <= c <= 0xF4 else 0
        if n:
            try:
                out.append(b[i:i + n].decode("utf-8"))
                i += n
                continue
            except UnicodeDecodeError:
                pass
        out.append("\ufffd")
        i += 1
    return "".join(out).encode("utf-8")


def write_case(out_dir, name, items, meta):
    """items: (bytes, ids or None, expected decoded bytes)"""
    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, name + ".corpus")
    expect = os.path.join(out_dir, name + ".expect")
    with open(corpus, "w") as f:
        for b, _, _ in items:
            f.write((b.hex() if b else "") + "\n" if b else "\n")
    with open(expect, "w") as f:
        for k, v in meta.items():
            f.write("#%s %s\n" % (k, " ".join(map(str, v)) if isinstance(v, (list, tuple)) else v))
        for b, ids, text in items:
            head = "skip" if ids is None else "ids " + " ".join(map(str, ids))
            f.write("%s | text %s\n" % (head, text.hex()))
    return corpus, expect


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


# ---------------------------------------------------------------- GGUF helpers

def gguf_tokenizer_fields(path):
    from gguf import GGUFReader
    r = GGUFReader(path)

    def arr(key):
        f = r.fields[key]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in arr("tokenizer.ggml.token_type")]
    merges = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.merges")]

    def scalar(key, default=None):
        if key not in r.fields:
            return default
        f = r.fields[key]
        v = f.parts[f.data[0]]
        return v[0].item() if hasattr(v[0], "item") else v[0]

    return dict(tokens=tokens, types=types, merges=merges, bos=scalar("tokenizer.ggml.bos_token_id"),
                eos=scalar("tokenizer.ggml.eos_token_id"), add_bos=scalar("tokenizer.ggml.add_bos_token"))


# llama.cpp's end-of-generation names (common/tok_special.c: without "</s>" and "<reponame>")
EOG_NAMES = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
             "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
             "<fim-repo>", "<REPO>", "<|file_sep|>"}


def eog_ids(tokens, eos):
    s = {i for i, t in enumerate(tokens) if t in EOG_NAMES}
    if eos is not None:
        s.add(eos)
    return sorted(s)


def write_gguf(path, tokens, types, model, pre=None, merges=None, scores=None, bos=None, eos=None,
               unk=None, add_bos=None, add_space_prefix=None):
    import gguf
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- BPE cases

def hf_bpe(tokens, merges, pretok, special_ids, ignore_merges=False):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    vocab = {t: i for i, t in enumerate(tokens)}
    mg = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=mg, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pretok
    tok.decoder = decoders.ByteLevel()
    if special_ids:
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    return tok


def bpe_items(tok, corpus):
    items = []
    for s in corpus:
        ids = tok.encode(s, add_special_tokens=False).ids
        items.append((s.encode("utf-8"), ids, s.encode("utf-8")))
    for b in INVALID:
        items.append((b, None, strict_replace(b)))
    return items


def case_smollm2(a, parse_special):
    from tokenizers import pre_tokenizers
    f = gguf_tokenizer_fields(a.model)
    pretok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    specials = [i for i, t in enumerate(f["types"]) if t in (3, 4)] if parse_special else \
        [i for i, t in enumerate(f["types"]) if t == 4]
    tok = hf_bpe(f["tokens"], f["merges"], pretok, specials)
    name = "smollm2" if parse_special else "smollm2_nospecial"
    items = bpe_items(tok, CORPUS)
    # sanity: the reference is not trivially empty
    assert sum(len(ids) for _, ids, _ in items if ids) > 500
    meta = {"n_vocab": len(f["tokens"]), "bos": f["bos"], "eos": f["eos"],
            "add_bos": int(bool(f["add_bos"])), "eog": eog_ids(f["tokens"], f["eos"])}
    corpus, expect = write_case(a.out, name, items, meta)
    return run([a.tok_bin, "--model", a.model, "--corpus", corpus, "--expect", expect,
                "--parse-special", "1" if parse_special else "0"])


LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def case_trained_bpe(a, kind):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    regex, pre = (LLAMA3_RE, "llama-bpe") if kind == "llama3" else (QWEN2_RE, "qwen2")
    pretok = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pretok
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(train_texts(), trainer)
    vocab = t.get_vocab()
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    import json
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(t.to_str())["model"]["merges"]]
    types = [3 if s in specials else 1 for s in tokens]
    special_ids = [i for i, s in enumerate(tokens) if s in specials]
    ref = hf_bpe(tokens, merges, pretok, special_ids, ignore_merges=(kind == "llama3"))
    path = os.path.join(a.out, kind + ".gguf")
    os.makedirs(a.out, exist_ok=True)
    bos, eos = tokens.index(specials[0]), tokens.index(specials[1] if kind == "llama3" else "<|endoftext|>")
    write_gguf(path, tokens, types, "gpt2", pre=pre, merges=merges, bos=bos, eos=eos)
    items = bpe_items(ref, CORPUS + train_texts()[:200])
    meta = {"n_vocab": len(tokens), "bos": bos, "eos": eos,
            "add_bos": 1 if kind == "llama3" else 0, "eog": eog_ids(tokens, eos)}
    corpus, expect = write_case(a.out, kind, items, meta)
    return run([a.tok_bin, "--model", path, "--corpus", corpus, "--expect", expect, "--parse-special", "1"])


# ---------------------------------------------------------------- SentencePiece

def case_spm(a):
    import io

    import sentencepiece as spm
    buf = io.BytesIO()
    texts = [s for s in train_texts() if s.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=700, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, character_coverage=0.9995,
        allow_whitespace_only_pieces=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)
    path = os.path.join(a.out, "spm.gguf")
    os.makedirs(a.out, exist_ok=True)
    write_gguf(path, tokens, types, "llama", scores=[float(x) for x in np.array(scores, dtype=np.float32)],
               bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id())
    items = []
    for s in CORPUS + train_texts()[:200]:
        items.append((s.encode("utf-8"), sp.encode(s), s.encode("utf-8")))
    for b in INVALID:
        # byte fallback keeps every byte; the detokenizer then replaces invalid sequences
        items.append((b, None, b.decode("utf-8", errors="replace").encode("utf-8")))
    meta = {"n_vocab": n, "bos": sp.bos_id(), "eos": sp.eos_id(), "add_bos": 1,
            "eog": eog_ids(tokens, sp.eos_id())}
    corpus, expect = write_case(a.out, "spm", items, meta)
    return run([a.tok_bin, "--model", path, "--corpus", corpus, "--expect", expect, "--parse-special", "0"])


def case_unsupported(a):
    os.makedirs(a.out, exist_ok=True)
    rc = 0
    # rwkv is a llama.cpp tokenizer type Tandem does not implement (t5, Unigram, is: its
    # charsmap cases are test_tok_corpus --charsmap-cases)
    for name, model, pre in (("unsupp_pre", "gpt2", "no-such-pre"), ("unsupp_rwkv", "rwkv", None)):
        path = os.path.join(a.out, name + ".gguf")
        tokens = ["a", "b", "ab"]
        write_gguf(path, tokens, [1, 1, 1], model, pre=pre, merges=["a b"])
        rc |= run([a.tok_bin, "--model", path, "--expect-create-fail", "-5"])
    return rc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--model")
    ap.add_argument("--tok-bin", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    c = a.case
    if c == "smollm2":
        rc = case_smollm2(a, True)
    elif c == "smollm2_nospecial":
        rc = case_smollm2(a, False)
    elif c in ("llama3", "qwen2"):
        rc = case_trained_bpe(a, c)
    elif c == "spm":
        rc = case_spm(a)
    elif c == "unsupported":
        rc = case_unsupported(a)
    else:
        print("unknown case", c)
        rc = 2
    sys.exit(1 if rc else 0)


if __name__ == "__main__":
    main()
