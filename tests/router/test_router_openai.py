#!/usr/bin/env python3
"""test_router_openai.py: the official `openai` Python client against tandem-router + one tp1
decode instance: completions and chat, streaming and not, stop strings, seeds, /v1/models;
greedy text equals `tandem generate --temperature 0` for the same prompt. Runs on the
synthetic model and, with --model, on the default model too.

usage: test_router_openai.py --router BIN --decode BIN --tandem BIN --synth GGUF [--model GGUF]
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
import openai  # noqa: E402
from rtlib import Cluster, generate_text  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402



def gen(args, model, prompt, n, chat=False):
    t = generate_text(args, model, prompt, n, chat)
    return t[:-1] if t.endswith("\n") else t


def cli_ids(args, model, prompt, n, extra):
    """`tandem generate --temperature 0 --ignore-eos --ids` plus extra flags: the token ids."""
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt", prompt,
                        "--max-tokens", str(n), "--temperature", "0", "--threads", "1",
                        "--ignore-eos", "--ids"] + extra, capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr.decode(errors="replace"))
    return [int(t) for t in r.stdout.decode().replace(",", " ").split()]


def cli_text(args, model, prompt, n, extra):
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt", prompt,
                        "--max-tokens", str(n), "--temperature", "0", "--threads", "1",
                        "--ignore-eos"] + extra, capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr.decode(errors="replace"))
    out = r.stdout.decode("utf-8", errors="replace")
    return out[:-1] if out.endswith("\n") else out


def check_penalties(args, client, mid, model, name, prompt):
    """presence/frequency penalties change a greedy output, exactly as the sampler's CLI does,
    and make it less repetitive (more distinct tokens among the same number generated)."""
    n = 32
    plain = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    pen = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                    frequency_penalty=2.0, extra_body={"ignore_eos": True})
    pen = pen.choices[0].text
    check(pen != plain, f"{name}: frequency_penalty 2.0 changes the greedy output")
    want = cli_text(args, model, prompt, n, ["--frequency-penalty", "2"])
    check(pen == want, f"{name}: frequency_penalty 2.0 == tandem generate --frequency-penalty 2")
    a = cli_ids(args, model, prompt, n, [])
    b = cli_ids(args, model, prompt, n, ["--frequency-penalty", "2"])
    check(len(a) == n and len(b) == n and len(set(b)) > len(set(a)),
          f"{name}: frequency_penalty 2.0 is less repetitive: {len(set(b))} distinct of {n} "
          f"tokens against {len(set(a))}")
    pres = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                     presence_penalty=2.0, stream=True,
                                     extra_body={"ignore_eos": True})
    got = "".join(c.choices[0].text for c in pres if c.choices)
    want = cli_text(args, model, prompt, n, ["--presence-penalty", "2"])
    check(got == want and got != plain,
          f"{name}: streamed presence_penalty 2.0 == tandem generate --presence-penalty 2, "
          f"and differs from plain greedy")
    for extra, param in (({"guided_json": {"type": "object"}}, "guided_json"),
                         ({"logit_bias": {"5": 10}}, "logit_bias"),
                         ({"stream_options": {"continuous_usage_stats": True}},
                          "stream_options")):
        try:
            client.completions.create(model=mid, prompt=prompt, max_tokens=2, extra_body=extra)
            check(False, f"{name}: {param} is refused")
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(e.status_code == 400 and body.get("param") == param and param in str(e),
                  f"{name}: {param} is refused with a 400 naming it ({body})")


def stream_text(stream, chat):
    text, finishes, usage, n_chunks = "", [], None, 0
    for ch in stream:
        n_chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            text += piece
            finishes.append(c.finish_reason)
    return text, finishes, usage, n_chunks


def check_logprobs(client, mid, name, prompt, chat):
    """logprobs/top_logprobs (chat), logprobs (completions), echo with prompt logprobs and
    max_tokens 0; streamed == non-streamed; the greedy token's logprob is the best of its
    top_logprobs; the top alternatives' probabilities sum to at most 1."""
    import math
    n = 8
    msgs = [{"role": "user", "content": chat}]
    r = client.chat.completions.create(model=mid, messages=msgs, max_tokens=n, temperature=0,
                                       logprobs=True, top_logprobs=5,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    text = "".join(c.token for c in content)
    # control tokens (<|im_end|> under ignore_eos) show in logprobs, not in the content
    check(len(content) == r.usage.completion_tokens and
          (text == r.choices[0].message.content or "<|" in text or "bytes:" in text),
          f"{name}: chat logprobs: one entry per token, tokens spell the text "
          f"({len(content)} vs {r.usage.completion_tokens}: {text!r})")
    bad = [c for c in content if not (
        len(c.top_logprobs) == 5 and c.top_logprobs[0].token == c.token and
        abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6 and
        all(c.top_logprobs[j].logprob >= c.top_logprobs[j + 1].logprob for j in range(4)) and
        sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1 + 1e-5 and c.logprob <= 0 and
        (c.token.startswith("bytes:") or bytes(c.bytes) == c.token.encode()))]
    check(not bad, f"{name}: greedy token == the best of top_logprobs, sorted, sum of p <= 1 "
          f"({bad[:1]})")
    s = client.chat.completions.create(model=mid, messages=msgs, max_tokens=n, temperature=0,
                                       logprobs=True, top_logprobs=5, stream=True,
                                       extra_body={"ignore_eos": True})
    sc = [c for ch in s if ch.choices and ch.choices[0].logprobs
          for c in ch.choices[0].logprobs.content]
    check([(c.token, round(c.logprob, 5)) for c in sc] ==
          [(c.token, round(c.logprob, 5)) for c in content],
          f"{name}: streamed chat logprobs == non-streamed")
    r0 = client.chat.completions.create(model=mid, messages=msgs, max_tokens=2, temperature=0,
                                        logprobs=True)
    check(all(c.top_logprobs == [] for c in r0.choices[0].logprobs.content),
          f"{name}: logprobs without top_logprobs: no alternatives")
    # completions: the legacy shape
    c = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    check(len(lp.tokens) == n and "".join(lp.tokens) == c.choices[0].text and
          len(lp.top_logprobs) == n and all(len(t) <= 3 for t in lp.top_logprobs) and
          all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
          and lp.text_offset[0] == 0,
          f"{name}: completions logprobs (tokens, token_logprobs, top_logprobs, text_offset)")
    sc = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                   logprobs=3, stream=True, extra_body={"ignore_eos": True})
    toks, vals = [], []
    for ch in sc:
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            vals += ch.choices[0].logprobs.token_logprobs
    check(toks == lp.tokens and all(abs(a - b) < 1e-6 for a, b in zip(vals, lp.token_logprobs)),
          f"{name}: streamed completions logprobs == non-streamed")
    # echo: the prompt first, its first token's logprob null; max_tokens 0 answers the prompt
    e = client.completions.create(model=mid, prompt=prompt, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    el = e.choices[0].logprobs
    n_p = e.usage.prompt_tokens
    check(e.choices[0].text.startswith(prompt) and len(el.tokens) == n_p + 1 and
          el.token_logprobs[0] is None and el.top_logprobs[0] is None and
          all(v is not None and v <= 0 for v in el.token_logprobs[1:]),
          f"{name}: echo returns the prompt and its logprobs ({el.token_logprobs[:3]})")
    z = client.completions.create(model=mid, prompt=prompt, max_tokens=0, temperature=0,
                                  logprobs=1, echo=True)
    zl = z.choices[0].logprobs
    check(z.choices[0].text == e.choices[0].text[:len(z.choices[0].text)] and
          len(zl.tokens) == n_p and z.usage.completion_tokens == 0 and
          all(a == b or abs(a - b) < 1e-5 for a, b in zip(zl.token_logprobs[1:],
                                                          el.token_logprobs[1:n_p])),
          f"{name}: echo with max_tokens 0: the prompt only, same logprobs")
    zs = client.completions.create(model=mid, prompt=prompt, max_tokens=0, temperature=0,
                                   logprobs=1, echo=True, stream=True)
    st, sv = "", []
    for ch in zs:
        if ch.choices:
            st += ch.choices[0].text
            if ch.choices[0].logprobs:
                sv += ch.choices[0].logprobs.token_logprobs
    check(st == z.choices[0].text and len(sv) == n_p, f"{name}: streamed echo == non-streamed")
    for bad in ({"logprobs": 21}, {"logprobs": -1}):
        try:
            client.completions.create(model=mid, prompt=prompt, max_tokens=1, **bad)
            check(False, f"{name}: {bad} is refused")
        except openai.BadRequestError as ex:
            check("logprobs" in str(ex), f"{name}: {bad} is refused with a 400 naming logprobs")
    return el


def run_model(args, model, name, prompts, chats, n_tok):
    with Cluster(args, model) as cl:
        client = openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        ids = [m.id for m in client.models.list().data]
        check(len(ids) == 1, f"{name}: /v1/models lists one model ({ids})")
        mid = ids[0]
        m = client.models.retrieve(mid)
        check(m.id == mid and m.object == "model" and m.owned_by == "tandem",
              f"{name}: /v1/models/{{id}} answers the model object ({m})")
        try:
            client.models.retrieve("no-such-model")
            check(False, f"{name}: an unknown model id is 404")
        except openai.NotFoundError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(e.status_code == 404 and body.get("code") == "model_not_found" and
                  "no-such-model" in body.get("message", ""),
                  f"{name}: an unknown model id is 404 model_not_found ({body})")
        for p in prompts:
            want = gen(args, model, p, n_tok)
            r = client.completions.create(model=mid, prompt=p, max_tokens=n_tok, temperature=0)
            got = r.choices[0].text
            check(got == want, f"{name}: completion greedy == tandem generate for {p!r}"
                  + ("" if got == want else f": {got!r} != {want!r}"))
            check(r.object == "text_completion" and r.id.startswith("cmpl-")
                  and r.usage.completion_tokens >= 1
                  and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens,
                  f"{name}: completion fields and usage")
            s = client.completions.create(model=mid, prompt=p, max_tokens=n_tok, temperature=0,
                                          stream=True, stream_options={"include_usage": True})
            text, fins, usage, _ = stream_text(s, False)
            check(text == got, f"{name}: streamed completion == non-streamed for {p!r}")
            check(fins and fins[-1] in ("stop", "length") and all(f is None for f in fins[:-1]),
                  f"{name}: finish_reason only in the last content chunk ({fins[-3:]})")
            check(usage is not None and usage.completion_tokens == r.usage.completion_tokens,
                  f"{name}: usage chunk with include_usage")
            # stop strings: cut at the first occurrence, never a byte of the stop string
            if len(want) >= 8:
                k = len(want) // 2
                stop = want[k:k + 3]
                cut = want[:want.find(stop)]
                r2 = client.completions.create(model=mid, prompt=p, max_tokens=n_tok,
                                               temperature=0, stop=[stop, "never-in-output-xyz"])
                check(r2.choices[0].text == cut and r2.choices[0].finish_reason == "stop",
                      f"{name}: stop string {stop!r} cuts the text ({r2.choices[0].text!r} vs "
                      f"{cut!r}, {r2.choices[0].finish_reason})")
                s2 = client.completions.create(model=mid, prompt=p, max_tokens=n_tok,
                                               temperature=0, stop=stop, stream=True)
                text2, fins2, _, _ = stream_text(s2, False)
                check(text2 == cut and fins2[-1] == "stop",
                      f"{name}: streamed stop string {stop!r} ({text2!r} vs {cut!r})")
        for c in chats:
            want = gen(args, model, c, n_tok, chat=True)
            msgs = [{"role": "user", "content": c}]
            r = client.chat.completions.create(model=mid, messages=msgs, max_tokens=n_tok,
                                               temperature=0)
            got = r.choices[0].message.content
            check(got == want, f"{name}: chat greedy == tandem generate --chat for {c!r}"
                  + ("" if got == want else f": {got!r} != {want!r}"))
            check(r.object == "chat.completion" and r.choices[0].message.role == "assistant",
                  f"{name}: chat fields")
            s = client.chat.completions.create(model=mid, messages=msgs, max_tokens=n_tok,
                                               temperature=0, stream=True)
            text, fins, _, _ = stream_text(s, True)
            check(text == got and fins[-1] == r.choices[0].finish_reason,
                  f"{name}: streamed chat == non-streamed")
            parts = [{"role": "user", "content": [{"type": "text", "text": c[:3]},
                                                  {"type": "text", "text": c[3:]}]}]
            r3 = client.chat.completions.create(model=mid, messages=parts, max_tokens=n_tok,
                                                temperature=0, max_completion_tokens=n_tok)
            check(r3.choices[0].message.content == got, f"{name}: content as text parts")
        # seeds: same seed, same text; different seeds, (almost surely) different text
        p = prompts[0]
        outs = [client.completions.create(model=mid, prompt=p, max_tokens=n_tok, temperature=1.0,
                                          seed=s).choices[0].text for s in (7, 7, 8, 9)]
        check(outs[0] == outs[1], f"{name}: same seed, same text")
        check(len(set(outs[1:])) > 1, f"{name}: different seeds give different texts")
        r = client.completions.create(model=mid, prompt=p, max_tokens=3, temperature=0)
        check(r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 3,
              f"{name}: max_tokens bounds the output")
        try:
            client.completions.create(model=mid, prompt=p, max_tokens=4, n=2)
            check(False, f"{name}: n=2 is refused")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "n" in str(e), f"{name}: n=2 is refused with 400")
        check_penalties(args, client, mid, model, name, prompts[0])
        check_logprobs(client, mid, name, prompts[0], chats[0])
        rc = cl.stop()
        check(rc == 0, f"{name}: router exits 0 on SIGTERM (got {rc})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    t0 = time.time()
    run_model(args, args.synth, "synth", ["Hello world", "The quick brown fox", "1 2 3"],
              ["Hi there", "What is 2+2?"], 16)
    if args.model:
        run_model(args, args.model, "default", ["The capital of France is"],
                  ["What is the capital of France?"], 12)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
