#!/usr/bin/env python3
"""test_prompt_logprobs.py: the prompt logprobs the API answers against the numpy reference.

On the synthetic llama model, /v1/completions with echo=True, logprobs=1, max_tokens=0 (the
lm-evaluation-harness loglikelihood request) for fixed token-id prompts; every prompt
token's logprob from the second on must equal log_softmax of the reference's logits at the
position before it (ref_forward.py, all rows of one forward pass), and the top-1
alternative must be the reference's argmax with its logprob. Served colocated (the decode
node computes them) and disaggregated with a 2-stage prefill pipeline (the last stage
does), both with f32 KV.

Tolerance: 1e-4 absolute. The engine and the reference compute in f32 from the same
dequantized weights (f32 KV here), so they differ only by rounding (summation order, FMA);
a logprob error is |e_t - sum_j p_j e_j| <= 2 max_j |e_j| for logit errors e, and the
observed worst is about 5e-6 (printed at the end), so 1e-4 leaves a 20x margin while any
real fault (a row off by one position, a wrong normalisation, f16 rounding of the
logits) is orders of magnitude larger. The top-1 alternative must match unless the
reference's top two are within the same 1e-4 (a tie, reported).

usage: test_prompt_logprobs.py --router BIN --decode BIN --prefill BIN --tandem BIN
                               --model SYNTH.gguf
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))  # tdtest
sys.path.insert(0, os.path.join(HERE, "..", "router"))
sys.path.insert(0, os.path.join(HERE, "..", "disagg"))
import pdlib  # noqa: E402
import ref_forward  # noqa: E402
import rtlib  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402

TOL = 1e-4


def prompts(n_vocab):
    rng = np.random.default_rng(4321)
    return [[1, 5, 100, 200, 300, 7, 8, 9, 10],
            [int(x) for x in rng.integers(3, n_vocab, size=40)],
            [int(x) for x in rng.integers(3, n_vocab, size=150)]]  # several KV blocks


def log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def check_prompt(name, port, ref, ids):
    status, _, body = rtlib.post(port, "/v1/completions", {
        "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    if not check(status == 200, f"{name}: {len(ids)} ids: 200 ({status} {body[:200]!r})"):
        return 0.0
    lp = json.loads(body)["choices"][0]["logprobs"]
    want = log_softmax(ref.logits_all(ids))                            # (T, n_vocab)
    got = lp["token_logprobs"]
    check(len(got) == len(ids) and got[0] is None,
          f"{name}: {len(ids)} prompt entries, the first null ({len(got)}, {got[:1]})")
    err, top_bad, ties = 0.0, [], 0
    for i in range(1, min(len(got), len(ids))):
        row = want[i - 1]
        err = max(err, abs(got[i] - row[ids[i]]))
        (tok, val), = lp["top_logprobs"][i].items()
        best = np.argsort(row)[::-1][:2]
        err = max(err, abs(val - row[best[0]]))
        if abs(val - row[best[0]]) > TOL:
            if row[best[0]] - row[best[1]] <= TOL:
                ties += 1
            else:
                top_bad.append(i)
    check(err <= TOL, f"{name}: {len(ids)} ids: max |logprob - reference| {err:.2e} <= {TOL}")
    check(not top_bad, f"{name}: top-1 alternative = the reference's argmax "
          f"(bad positions {top_bad[:5]}, ties {ties})")
    return err


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "decode", "prefill", "tandem", "model"):
        ap.add_argument("--" + k, required=True)
    args = ap.parse_args()
    ref = ref_forward.load(args.model)
    ps = prompts(ref.tok_embd.shape[0])
    worst = 0.0
    shapes = (("colocated", lambda: rtlib.Cluster(args, args.model,
                                                  decode_extra={"kv_dtype": "f32"})),
              ("disaggregated pp2", lambda: pdlib.Cluster(
                  args, args.model, [{"pp": 2}], [{"tp": 1, "kv_dtype": "f32"}])))
    for name, make in shapes:
        try:
            with make() as c:
                for ids in ps:
                    worst = max(worst, check_prompt(name, c.http_port, ref, ids))
        except Exception as e:  # a crashed shape is a failure; the other still runs
            check(False, f"{name}: {type(e).__name__}: {e}")
    print(f"worst |logprob error| {worst:.2e}; {len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
