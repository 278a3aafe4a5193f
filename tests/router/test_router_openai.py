#!/usr/bin/env python3
"""test_router_openai.py: the official `openai` Python client against tandem-router + one tp1
decode instance: completions and chat, streaming and not, stop strings, seeds, /v1/models,
n > 1 and batched prompts (indices, seeds, usage, limits, a disconnect that frees every choice);
greedy text equals `tandem generate --temperature 0` for the same prompt. Runs on the
synthetic model and, with --model, on the default model too.

usage: test_router_openai.py --router BIN --decode BIN --tandem BIN --synth GGUF [--model GGUF]
"""
import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
import openai  # noqa: E402
from rtlib import Cluster, generate_text, post  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import client_health, parse_metrics  # noqa: E402
from tdtest.waits import get_status, wait_for  # noqa: E402



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
                         ({"spaces_between_special_tokens": True},
                          "spaces_between_special_tokens"),
                         ({"stream_options": {"continuous_usage_stats": True}},
                          "stream_options")):
        try:
            client.completions.create(model=mid, prompt=prompt, max_tokens=2, extra_body=extra)
            check(False, f"{name}: {param} is refused")
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(e.status_code == 400 and body.get("param") == param and param in str(e),
                  f"{name}: {param} is refused with a 400 naming it ({body})")


def eos_id(model):
    """The model's EOS id from its GGUF metadata, or None."""
    import gguf
    f = gguf.GGUFReader(model).fields.get("tokenizer.ggml.eos_token_id")
    return int(f.parts[f.data[0]][0]) if f else None


def jpost(cl, path, body):
    status, _, out = post(cl.http_port, path, body)
    return status, json.loads(out)


def refused(client, mid, name, extra, param, what):
    try:
        client.completions.create(model=mid, prompt="Hi", max_tokens=4, extra_body=extra)
        check(False, f"{name}: {what} is refused")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(e.status_code == 400 and body.get("param") == param,
              f"{name}: {what} is a 400 naming {param} ({body.get('message')})")


def check_token_endpoints(args, cl, model, name, prompt):
    """/tokenize equals `tandem generate --tokenize` and the prompt a completion sees;
    /detokenize gives the text back; /version answers the project version."""
    mid = os.path.basename(model)
    st, tk = jpost(cl, "/tokenize", {"model": mid, "prompt": prompt})
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt", prompt,
                        "--tokenize", "--threads", "1"], capture_output=True, timeout=300)
    want = [int(t) for t in r.stdout.decode().strip().split(",")]
    check(st == 200 and tk["tokens"] == want and tk["count"] == len(want) and
          tk["max_model_len"] > 0, f"{name}: /tokenize == tandem generate --tokenize ({tk})")
    st, raw = jpost(cl, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    st2, dt = jpost(cl, "/detokenize", {"model": mid, "tokens": raw["tokens"]})
    check(st == 200 and st2 == 200 and dt["prompt"] == prompt,
          f"{name}: /detokenize(/tokenize(p)) == p ({dt})")
    msgs = [{"role": "user", "content": prompt}]
    st, ch = jpost(cl, "/tokenize", {"model": mid, "messages": msgs})
    client = openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0)
    u = client.chat.completions.create(model=mid, messages=msgs, max_tokens=1).usage
    check(st == 200 and ch["count"] == u.prompt_tokens,
          f"{name}: /tokenize of messages counts the chat's prompt tokens ({ch['count']} vs "
          f"{u.prompt_tokens})")
    # the chat's prompt is `tandem template`'s rendering: the same engine, the same variables
    mfile = os.path.join(tempfile.mkdtemp(prefix="tandem-tpl-"), "messages.json")
    with open(mfile, "w", encoding="utf-8") as f:
        json.dump(msgs, f)
    r = subprocess.run([args.tandem, "template", "--model", model, "--messages", mfile,
                        "--add-generation-prompt"], capture_output=True, timeout=60)
    st2, tt = jpost(cl, "/tokenize", {"prompt": r.stdout.decode("utf-8"),
                                      "add_special_tokens": False})
    check(r.returncode == 0 and st2 == 200 and tt["tokens"] == ch.get("tokens"),
          f"{name}: the chat's prompt tokens are `tandem template`'s rendering's")
    st, ng = jpost(cl, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    check(st == 200 and ng["count"] < ch["count"],
          f"{name}: add_generation_prompt false leaves out the assistant header")
    for path, body, param in (("/tokenize", {"prompt": prompt, "foo": 1}, "foo"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": prompt, "messages": msgs}, "prompt"),
                              ("/tokenize", {"prompt": prompt, "chat_template_kwargs": {}},
                               "chat_template_kwargs"),
                              ("/tokenize", {"messages": msgs, "chat_template_kwargs": 1},
                               "chat_template_kwargs"),
                              ("/tokenize", {"messages": msgs,
                                             "chat_template_kwargs": {"messages": []}},
                               "chat_template_kwargs"),
                              ("/detokenize", {"tokens": [1 << 30]}, "tokens"),
                              ("/detokenize", {"tokens": "12"}, "tokens")):
        st, err = jpost(cl, path, body)
        check(st == 400 and err["error"]["param"] == param,
              f"{name}: {path} {body} is a 400 naming {param} ({err})")
    st, err = jpost(cl, "/tokenize", {"model": "nope", "prompt": "x"})
    check(st == 404, f"{name}: /tokenize of an unknown model is 404")
    c = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=30)
    c.request("GET", "/version")
    v = json.loads(c.getresponse().read())
    cm = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../CMakeLists.txt")).read()
    want_v = re.search(r"project\(tandem VERSION ([0-9.]+)", cm).group(1)
    check(v.get("version") == want_v, f"{name}: /version is the CMake project version ({v})")
    return want


def check_params(args, cl, client, mid, model, name, prompt):
    """logit_bias, min_tokens, stop_token_ids, repetition_penalty, skip_special_tokens."""
    n = 8
    plain = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    a = cli_ids(args, model, prompt, n, [])
    # logit_bias +100 forces a token (greedy: every step), on both endpoints, streamed too
    _, tk = jpost(cl, "/tokenize", {"prompt": " the", "add_special_tokens": False})
    t = tk["tokens"][-1]
    _, forced = jpost(cl, "/detokenize", {"tokens": [t] * 4})
    r = client.completions.create(model=mid, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(t): 100}, extra_body={"ignore_eos": True})
    check(r.choices[0].text == forced["prompt"],
          f"{name}: logit_bias +100 forces token {t} ({r.choices[0].text!r})")
    s = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=4, temperature=0.7, seed=3, stream=True,
                                       logit_bias={str(t): 100}, extra_body={"ignore_eos": True})
    text, _, _, _ = stream_text(s, True)
    check(text == forced["prompt"], f"{name}: streamed chat with logit_bias +100 ({text!r})")
    r = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                  logit_bias={str(a[0]): -100}, extra_body={"ignore_eos": True})
    check(r.choices[0].text != plain,
          f"{name}: logit_bias -100 on the greedy token {a[0]} changes the output")
    # stop_token_ids: the request ends at the first listed id (not sent), finish "stop"
    k = next((i for i in range(1, n) if a[i] not in a[:i]), None)
    if k is not None:
        r = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [a[k]]})
        short = client.completions.create(model=mid, prompt=prompt, max_tokens=k, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
        check(r.choices[0].text == short and r.choices[0].finish_reason == "stop" and
              r.usage.completion_tokens == k + 1,
              f"{name}: stop_token_ids [{a[k]}] stops after {k} tokens with finish_reason "
              f"stop ({r.choices[0].text!r}, {r.choices[0].finish_reason}, {r.usage})")
    # min_tokens: EOS forced by logit_bias ends at once; min_tokens masks it for 3 tokens
    eos = eos_id(model)
    if eos is not None:
        for stream in (False, True):
            kw = dict(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                      logit_bias={str(eos): 100})
            r0 = client.completions.create(**kw)
            check(r0.choices[0].finish_reason == "stop" and r0.choices[0].text == "",
                  f"{name}: EOS at +100 ends the request at once")
            if not stream:
                r = client.completions.create(**kw, extra_body={"min_tokens": 3})
                got, fin, used = r.choices[0].text, r.choices[0].finish_reason, r.usage
            else:
                sr = client.completions.create(**kw, extra_body={"min_tokens": 3}, stream=True,
                                               stream_options={"include_usage": True})
                got, fins, used, _ = stream_text(sr, False)
                fin = fins[-1]
            check(fin == "stop" and used.completion_tokens == 4 and got != "",
                  f"{name}: min_tokens 3 masks EOS until 3 tokens (stream {stream}: {got!r}, "
                  f"{fin}, {used})")
    # repetition_penalty: vLLM's (whole history); the CLI's --repeat-penalty with its 64-token
    # window sees the same history for a prompt this short
    rp = client.completions.create(model=mid, prompt=prompt, max_tokens=n, temperature=0,
                                   extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    want = cli_text(args, model, prompt, n, ["--repeat-penalty", "1.5"])
    check(rp.choices[0].text == want and want != plain,
          f"{name}: repetition_penalty 1.5 changes the output, == tandem generate "
          f"--repeat-penalty 1.5 ({rp.choices[0].text!r} vs {want!r})")
    # skip_special_tokens: a control token (not an EOG one) forced into the output
    _, im = jpost(cl, "/tokenize", {"prompt": "<|im_start|>", "add_special_tokens": False})
    if len(im["tokens"]) == 1:
        ctl = im["tokens"][0]
        kw = dict(model=mid, prompt=prompt, max_tokens=2, temperature=0,
                  logit_bias={str(ctl): 100})
        hid = client.completions.create(**kw).choices[0].text
        shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False})
        check(hid == "" and shown.choices[0].text == "<|im_start|><|im_start|>",
              f"{name}: skip_special_tokens false keeps special tokens' text ({hid!r}, "
              f"{shown.choices[0].text!r})")
    nv = cl_vocab(model)
    refused(client, mid, name, {"logit_bias": {"abc": 1}}, "logit_bias", "a non-id key")
    refused(client, mid, name, {"logit_bias": {str(nv): 1}}, "logit_bias", "an id past the vocab")
    refused(client, mid, name, {"logit_bias": {"3": 100.5}}, "logit_bias", "a bias over 100")
    refused(client, mid, name, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias",
            "301 entries")
    refused(client, mid, name, {"min_tokens": 5}, "min_tokens", "min_tokens > max_tokens")
    refused(client, mid, name, {"stop_token_ids": [-1]}, "stop_token_ids", "a negative stop id")


def cl_vocab(model):
    import gguf
    f = gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"]
    return len(f.data)


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


def stream_choices(stream, chat):
    """Per choice index: (text, finish reasons in order), and the usage chunk's usage."""
    out, usage = {}, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            t, f = out.get(c.index, ("", []))
            out[c.index] = (t + ((c.delta.content or "") if chat else c.text),
                            f + [c.finish_reason])
    return out, usage


def sse_events(port, body, path="/v1/completions"):
    """A raw streamed request: (connection, a generator of parsed SSE payloads)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, json.dumps(dict(body, stream=True)),
              {"Content-Type": "application/json"})
    r = c.getresponse()

    def events():
        while True:
            line = r.readline()
            if not line or line.strip() == b"data: [DONE]":
                return
            if line.startswith(b"data: "):
                yield json.loads(line[6:])
    return c, events()


def check_best_of(client, kw, name, prompt, n_tok):
    """best_of 4, n 2: the 2 of the 4 candidates (= the choices of n 4 with the same seed)
    whose generated tokens have the highest cumulative logprob, highest first; logprobs only
    when asked; usage counts the 4 candidates; a batch ranks each prompt's own."""
    def cum(c):
        return sum(c.logprobs.token_logprobs)
    four = client.completions.create(prompt=prompt, n=4, seed=21, logprobs=0, **kw).choices
    best = sorted(four, key=lambda c: (-cum(c), c.index))[:2]
    r = client.completions.create(prompt=prompt, n=2, best_of=4, seed=21, logprobs=0, **kw)
    got = [(c.index, c.text, round(cum(c), 4)) for c in r.choices]
    want = [(i, c.text, round(cum(c), 4)) for i, c in enumerate(best)]
    check(len({c.text for c in four}) > 2 and got == want,
          f"{name}: best_of 4 n 2: the 2 highest cumulative logprobs of the 4, highest first "
          f"(got {got}; the 4: {[(c.text, round(cum(c), 4)) for c in four]})")
    r = client.completions.create(prompt=prompt, n=2, best_of=4, seed=21, **kw)
    check([c.text for c in r.choices] == [w[1] for w in want] and
          all(c.logprobs is None for c in r.choices) and r.usage.completion_tokens == 4 * n_tok,
          f"{name}: best_of without logprobs: the same choices, no logprobs, usage counts the "
          f"4 candidates ({r.usage})")
    b = client.completions.create(prompt=[prompt, "b"], n=1, best_of=3, seed=21, logprobs=0,
                                  **kw)
    want_b = []
    for p in (prompt, "b"):
        three = client.completions.create(prompt=p, n=3, seed=21, logprobs=0, **kw).choices
        want_b.append(max(three, key=lambda c: (cum(c), -c.index)).text)
    check([c.index for c in b.choices] == [0, 1] and [c.text for c in b.choices] == want_b,
          f"{name}: a batch with best_of 3: each prompt's best, indexes 0 and 1")


def check_choices(args, cl, client, mid, name, prompt, n_tok):
    """n > 1 and batched prompts (router/rt_choices.h): indices, seeds, greedy, streaming,
    usage, batches of strings and of token ids, limits, and a disconnect that frees all."""
    kw = dict(model=mid, max_tokens=n_tok, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompt, n=3, seed=11, **kw)
    texts = [c.text for c in r.choices]
    check([c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1,
          f"{name}: n=3 seeded: choices 0..2, not all equal ({texts})")
    r2 = client.completions.create(prompt=prompt, n=3, seed=11, **kw)
    check([c.text for c in r2.choices] == texts, f"{name}: n=3: the same seed, the same choices")
    one = client.completions.create(prompt=prompt, seed=11, **kw).choices[0].text
    check(one == texts[0], f"{name}: choice 0 of n=3 == the n=1 request with the seed")
    single = client.completions.create(prompt=prompt, **dict(kw, max_tokens=1))
    ptok = single.usage.prompt_tokens
    check(r.usage.prompt_tokens == ptok and r.usage.completion_tokens == 3 * n_tok and
          r.usage.total_tokens == ptok + 3 * n_tok,
          f"{name}: n=3 usage: the prompt once, every choice's tokens ({r.usage})")
    s = client.completions.create(prompt=prompt, n=3, seed=11, stream=True,
                                  stream_options={"include_usage": True}, **kw)
    per, usage = stream_choices(s, False)
    check(sorted(per) == [0, 1, 2] and [per[i][0] for i in range(3)] == texts and
          all(f[-1] == "length" and all(x is None for x in f[:-1]) for _, f in per.values()),
          f"{name}: n=3 streamed == non-streamed, each choice ends with its own finish_reason")
    check(usage is not None and usage.completion_tokens == 3 * n_tok and
          usage.prompt_tokens == ptok, f"{name}: n=3 streamed usage chunk ({usage})")
    g = client.completions.create(model=mid, prompt=prompt, max_tokens=n_tok, temperature=0, n=2)
    check(len(g.choices) == 2 and g.choices[0].text == g.choices[1].text,
          f"{name}: n=2 greedy: identical choices")
    # chat: non-streamed == streamed
    msgs = [{"role": "user", "content": prompt}]
    ckw = dict(model=mid, messages=msgs, max_tokens=n_tok, temperature=1.0, seed=5, n=2)
    cr = client.chat.completions.create(**ckw)
    cs, _ = stream_choices(client.chat.completions.create(stream=True, **ckw), True)
    check([c.index for c in cr.choices] == [0, 1] and
          [cs[i][0] for i in (0, 1)] == [c.message.content for c in cr.choices] and
          [cs[i][1][-1] for i in (0, 1)] == [c.finish_reason for c in cr.choices],
          f"{name}: chat n=2 streamed == non-streamed")
    # a batch of prompts: 2 x 2 choices in order, each equal to its prompt's own request
    b = client.completions.create(prompt=["a", "b"], n=2, seed=3, **kw)
    want = [c.text for p in ("a", "b")
            for c in client.completions.create(prompt=p, n=2, seed=3, **kw).choices]
    pa = client.completions.create(prompt="a", **dict(kw, max_tokens=1)).usage.prompt_tokens
    pb = client.completions.create(prompt="b", **dict(kw, max_tokens=1)).usage.prompt_tokens
    check([c.index for c in b.choices] == [0, 1, 2, 3] and [c.text for c in b.choices] == want,
          f"{name}: prompts [a, b] with n=2: 4 choices in order, as the single requests")
    check(b.usage.prompt_tokens == pa + pb and b.usage.completion_tokens == 4 * n_tok,
          f"{name}: batch usage: each prompt once ({b.usage}; {pa} + {pb})")
    bs, busage = stream_choices(client.completions.create(
        prompt=["a", "b"], n=2, seed=3, stream=True, stream_options={"include_usage": True},
        **kw), False)
    check([bs[i][0] for i in range(4)] == want and busage.prompt_tokens == pa + pb,
          f"{name}: streamed batch == non-streamed")
    ids = client.completions.create(prompt=[[1, 2, 3], [4, 5]], **dict(kw, max_tokens=2))
    check(len(ids.choices) == 2 and ids.usage.prompt_tokens == 5,
          f"{name}: a batch of token-id lists ({ids.usage})")
    # limits: refused before anything runs, with a 400 naming the parameter
    for extra, param in (({"n": 17}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                         ({"best_of": 17}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                         ({"prompt": ["x"] * 65}, "prompt")):
        try:
            client.completions.create(**dict(dict(model=mid, prompt=prompt, max_tokens=2),
                                             **extra))
            check(False, f"{name}: {extra} is refused")
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(e.status_code == 400 and body.get("param") == param,
                  f"{name}: {list(extra)} over the limit: 400 naming {param} ({body})")
    r = client.completions.create(model=mid, prompt=prompt, max_tokens=2, n=2, best_of=2)
    check(len(r.choices) == 2, f"{name}: best_of == n is served")
    check_best_of(client, kw, name, prompt, n_tok)
    # a client that leaves mid-stream: every choice is cancelled, nothing stays behind
    conn, ev = sse_events(cl.http_port, {"prompt": prompt, "n": 4, "max_tokens": 400,
                                         "temperature": 1.0, "ignore_eos": True})
    seen, oid = set(), None
    for e in ev:
        oid = e.get("id")
        seen.update(c["index"] for c in e.get("choices", []))
        if len(seen) == 4:
            break
    check(seen == {0, 1, 2, 3}, f"{name}: n=4 stream: every choice streams ({seen})")
    conn.sock.close()
    conn.close()
    idle = {}

    def freed():
        idle["decode"] = client_health(args.tandem, f"tcp://127.0.0.1:{cl.decode_ports[0]}",
                                       timeout=60)
        idle["router"] = parse_metrics(get_status(cl.http_port, "/metrics")[1].decode())
        return (idle["decode"].get("running") == "0" and idle["decode"].get("kv_used") == "0"
                and idle["router"].get(("tandem_router_requests_running", ())) == 0
                and idle["router"].get(("tandem_router_queue_length", ())) == 0)
    check(wait_for(freed, 20), f"{name}: n=4 stream closed mid-way: decode running 0, kv_used 0, "
          f"router running 0 ({idle.get('decode')})")
    closed = [ln for ln in cl.log().splitlines() if f"request {oid} " in ln]
    check(len(closed) == 4 and all("status 499" in ln for ln in closed),
          f"{name}: n=4 stream closed mid-way: its 4 choices were cancelled, not finished "
          f"({closed})")


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


# A thinking template whose generation prompt leaves the block open (DeepSeek R1's and QwQ's
# do): the answer is reasoning until a </think> (rt_reason.h)
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                  "{% endif %}{# </think> #}")


def check_reasoning(args, model, name, chat):
    """router.chat_template naming a file, and the reasoning parser end to end: the answer
    comes back as reasoning_content (then content after a </think>), streamed the same."""
    d = tempfile.mkdtemp(prefix="tandem-think-")
    path = os.path.join(d, "think.jinja")
    with open(path, "w", encoding="utf-8") as f:
        f.write(THINK_TEMPLATE)
    with Cluster(args, model, router_extra={"chat_template": path}) as cl:
        client = openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        msgs = [{"role": "user", "content": chat}]
        r = client.chat.completions.create(model=os.path.basename(model), messages=msgs,
                                           max_tokens=8, temperature=0)
        m = r.choices[0].message
        reasoning = (m.model_extra or {}).get("reasoning_content")
        check(isinstance(reasoning, str) and reasoning and "</think>" not in reasoning,
              f"{name}: an open thinking block comes back as reasoning_content ({m})")
        s = client.chat.completions.create(model=os.path.basename(model), messages=msgs,
                                           max_tokens=8, temperature=0, stream=True)
        sr, sc = "", ""
        for ch in s:
            if ch.choices:
                sr += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                sc += ch.choices[0].delta.content or ""
        check(sr == reasoning and sc == (m.content or ""),
              f"{name}: streamed reasoning_content and content == non-streamed ({sr!r}, {sc!r})")


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
        check_choices(args, cl, client, mid, name, p, 6)
        check_penalties(args, client, mid, model, name, prompts[0])
        check_token_endpoints(args, cl, model, name, prompts[0])
        check_params(args, cl, client, mid, model, name, prompts[0])
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
    ap.add_argument("--model-only", action="store_true",
                    help="only the real models' runs (tests/router.cmake: the synthetic "
                         "model's run under ASan, the real models' in Release)")
    args = ap.parse_args()
    if args.model_only and not args.model:
        ap.error("--model-only needs --model")
    t0 = time.time()
    if not args.model_only:
        run_model(args, args.synth, "synth", ["Hello world", "The quick brown fox", "1 2 3"],
                  ["Hi there", "What is 2+2?"], 16)
        check_reasoning(args, args.synth, "synth", "Hi there")
    if args.model:
        run_model(args, args.model, "default", ["The capital of France is"],
                  ["What is the capital of France?"], 12)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
