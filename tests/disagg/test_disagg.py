#!/usr/bin/env python3
"""test_disagg.py: disaggregated serving end to end through the HTTP API: tandem-router,
tandem-prefill stages and tandem-decode ranks as real processes on loopback.

Cases (--case NAME runs one):
  dp       data-parallel attention on the synthetic deepseek2 and qwen3moe (decode[].dp 2,
           colocated and pp 2 -> dp 2): generate's output alone and several at once;
  moe      the same on the synthetic qwen3moe and deepseek2 (colocated tp 2, pp 2 -> tp 2 ep 2),
           with n > 1 and batched prompts through the openai client on deepseek2; pp 2 -> tp 2
           with the model's MTP block proposing (deepseek2-mtp, its oracle -echo);
  synth    greedy output equals `tandem generate` token for token on the synthetic llama,
           for prefill pp 1/2/3 x decode tp 1/2, prompts from 1 token to several chunks;
           and on a model whose decode ranks share KV heads (6 over 2 at tp 3); n > 1 and
           batched prompts (pp 2 x tp 2), with a client leaving an n=4 stream;
  default  the same on the default model: pp 2 x tp 1 and pp 2 x tp 3; then one prefill
           instance pushing in turn to a tp 1 and a tp 3 decode instance;
  (synth tp 1/2 and default) every prefill stage's KV pool is sliced for the decode
           ranks' heads and no transfer stages a byte (the stages' transfer log lines);
  retry    a prefill stage killed mid-prompt with a second prefill instance up: the request
           is retried there and still equals `tandem generate`; the killed stage restarts,
           rejoins, and its instance serves again;
  decode_dies  the decode rank killed mid-transfer: the client gets a clear error quickly,
           the prefill instance ends its transfer (no request, no KV block left), the
           restarted rank serves again;
  logprobs completions logprobs (top 5) with echo (prompt logprobs) and chat logprobs
           (top_logprobs 3), greedy: colocated and disaggregated (pp 1 and pp 2, prompts of one
           and of several chunks) agree within 1e-4; streamed == non-streamed; the
           synthetic llama (logprobs_default: the same on the default model, pp 2);
  grammar  structured output (response_format) at prefill pp 2 -> decode tp 3: two seeded
           temperature-1.0 json_schema outputs (prompts of one chunk and of several)
           validate, the first token (the last prefill stage's) obeys the mask against a
           logit_bias of +100 (grammar_many: ten seeded outputs, and json_object parses);
  share    decode[].share_cores true and auto (pp 2 -> tp 2): prompts of several chunks,
           each prefilled while the earlier ones decode, give `tandem generate`'s output; the
           stages paused for the decode's steps and the steps claimed the cores (exit logs);
  stalled  prefill stage 0 stopped (SIGSTOP) after taking a prompt, so its KV never comes:
           the decode side's deadline ends the request with an error, nothing leaks, and
           after SIGCONT the cluster serves again.
After every case every instance reports no request and no KV block in use.

usage: test_disagg.py --router BIN --prefill BIN --decode BIN --tandem BIN --synth-dir DIR
                      [--model GGUF] [--case NAME]
"""
import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from pdlib import Cluster, generate_text  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.waits import wait_for  # noqa: E402


WORDS = ("the quick brown fox jumps over the lazy dog while seven wise owls count stars "
         "above a quiet river that winds through old hills and green fields").split()


def text(n_words):
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def expect(args, model, prompts, n, cache={}):
    out = []
    for p in prompts:
        key = (model, p, n)
        if key not in cache:
            cache[key] = generate_text(args, model, p, n)
        out.append(cache[key])
    return out


def equal_outputs(c, args, model, prompts, label, n=16):
    want = expect(args, model, prompts, n)
    for p, w in zip(prompts, want):
        st, body = c.complete(p, n)
        got = body.get("choices", [{}])[0].get("text") if st == 200 else None
        ptok = body.get("usage", {}).get("prompt_tokens") if st == 200 else None
        check(st == 200 and got == w,
              f"{label}: {ptok} prompt tokens: equal to generate"
              + ("" if got == w else f" (status {st}: {str(body)[:300]!r} vs {w!r})"))


def penalized_output(c, args, model, prompt, label, n=24):
    """frequency/presence penalties through the disaggregated path: the text equals
    `tandem generate` with the same penalties, and differs from plain greedy."""
    flags = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5"]
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt", prompt,
                        "--max-tokens", str(n), "--temperature", "0", "--threads", "1",
                        "--ignore-eos"] + flags, capture_output=True, timeout=300)
    want = r.stdout.decode("utf-8", errors="replace").removesuffix("\n")
    st, body = c.complete(prompt, n, frequency_penalty=1.5, presence_penalty=0.5,
                          ignore_eos=True)
    got = body.get("choices", [{}])[0].get("text") if st == 200 else None
    st0, body0 = c.complete(prompt, n, ignore_eos=True)
    plain = body0.get("choices", [{}])[0].get("text") if st0 == 200 else None
    check(r.returncode == 0 and st == 200 and got == want and got != plain,
          f"{label}: penalties: equal to generate with them, unlike plain greedy (status {st})")


def token_post(c, path, body):
    h = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
    h.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = json.loads(h.getresponse().read())
    h.close()
    return out


def eos_id(model):
    import gguf
    f = gguf.GGUFReader(model).fields.get("tokenizer.ggml.eos_token_id")
    return int(f.parts[f.data[0]][0]) if f else None


def params_output(c, tandem, model, prompt, label):
    """logit_bias and min_tokens (with stop_token_ids) through the disaggregated path, with the
    official client. The first token is sampled by the last prefill stage, so these break there
    if the prefill wire does not carry the parameters."""
    import openai
    cl = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    t = token_post(c, "/tokenize", {"prompt": " the", "add_special_tokens": False})["tokens"][-1]
    forced = token_post(c, "/detokenize", {"tokens": [t] * 3})["prompt"]
    kw = dict(model=os.path.basename(model), prompt=prompt, temperature=0)
    r = cl.completions.create(**kw, max_tokens=3, logit_bias={str(t): 100},
                              extra_body={"ignore_eos": True})
    check(r.choices[0].text == forced,
          f"{label}: logit_bias +100 forces the first token too ({r.choices[0].text!r})")
    # -100 on the greedy first token: listed as a stop id too, it would end the request at once
    # ("stop") if the prefill stage ignored the bias; banned, another token comes ("length")
    first = int(subprocess.run([tandem, "generate", "--model", model, "--prompt", prompt,
                                "--max-tokens", "1", "--temperature", "0", "--threads", "1",
                                "--ignore-eos", "--ids"], capture_output=True,
                               timeout=300).stdout.split()[0])
    sb = {"stop_token_ids": [first], "ignore_eos": True}
    r0 = cl.completions.create(**kw, max_tokens=1, extra_body=sb)
    r = cl.completions.create(**kw, max_tokens=1, logit_bias={str(first): -100}, extra_body=sb)
    check(r0.choices[0].finish_reason == "stop" and r.choices[0].finish_reason == "length",
          f"{label}: logit_bias -100 bans the greedy first token {first} "
          f"({r0.choices[0].finish_reason}, {r.choices[0].finish_reason})")
    eos = eos_id(model)
    if eos is not None:
        r0 = cl.completions.create(**kw, max_tokens=8, logit_bias={str(eos): 100})
        r = cl.completions.create(**kw, max_tokens=8, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 3})
        check(r0.usage.completion_tokens == 1 and r0.choices[0].finish_reason == "stop" and
              r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop",
              f"{label}: min_tokens 3 masks EOS on the first token too ({r0.usage}, {r.usage})")
    # stop_token_ids are masked by min_tokens as well (they travel in the min_tokens list)
    sb = {"stop_token_ids": [t], "ignore_eos": True}
    r0 = cl.completions.create(**kw, max_tokens=8, logit_bias={str(t): 100}, extra_body=sb)
    r = cl.completions.create(**kw, max_tokens=8, logit_bias={str(t): 100},
                              extra_body=dict(sb, min_tokens=2))
    check(r0.usage.completion_tokens == 1 and r0.choices[0].finish_reason == "stop" and
          r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop",
          f"{label}: stop_token_ids end at once, min_tokens 2 holds them off ({r0.usage}, "
          f"{r.usage})")
def choices_output(c, args, model, label, n=8):
    """n > 1 and batched prompts through the disaggregated path (official openai client): every
    choice is its own pairing; greedy choices equal `tandem generate`, seeded ones are
    reproducible and choice 0 equals the n=1 request, streamed == non-streamed, a batch equals
    its prompts' own requests, and a client that leaves mid-stream leaves nothing behind."""
    import openai
    cl = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=300)
    mid = cl.models.list().data[0].id
    kw = dict(model=mid, max_tokens=n, extra_body={"ignore_eos": True})
    want = expect(args, model, ["a"], n)[0]
    g = cl.completions.create(prompt="a", n=2, temperature=0, **kw)
    check([x.text for x in g.choices] == [want, want],
          f"{label}: n=2 greedy: both choices equal generate")
    r = cl.completions.create(prompt="a", n=3, seed=9, temperature=1.0, **kw)
    texts = [x.text for x in r.choices]
    one = cl.completions.create(prompt="a", seed=9, temperature=1.0, **kw).choices[0].text
    check([x.index for x in r.choices] == [0, 1, 2] and len(set(texts)) > 1 and one == texts[0],
          f"{label}: n=3 seeded: 3 choices, not all equal, choice 0 == the n=1 request")
    per = {}
    for ch in cl.completions.create(prompt="a", n=3, seed=9, temperature=1.0, stream=True, **kw):
        for x in ch.choices:
            per[x.index] = per.get(x.index, "") + x.text
    check([per.get(i) for i in range(3)] == texts, f"{label}: n=3 streamed == non-streamed")
    b = cl.completions.create(prompt=["a", "b"], n=2, seed=4, temperature=1.0, **kw)
    single = [x.text for p in ("a", "b")
              for x in cl.completions.create(prompt=p, n=2, seed=4, temperature=1.0,
                                             **kw).choices]
    check([x.index for x in b.choices] == [0, 1, 2, 3] and [x.text for x in b.choices] == single,
          f"{label}: prompts [a, b] with n=2 == the single requests, in order")
    s = cl.completions.create(prompt=text(30), n=4, max_tokens=400, temperature=1.0, stream=True,
                              extra_body={"ignore_eos": True}, model=mid)
    seen, oid = set(), None
    for ch in s:
        oid = ch.id
        seen.update(x.index for x in ch.choices)
        if len(seen) == 4:
            break
    s.close()
    check(seen == {0, 1, 2, 3}, f"{label}: n=4 stream: every choice streams before the close")
    gone = lambda: [ln for ln in c.log("router").splitlines()  # noqa: E731
                    if f"request {oid} " in ln and "status 499" in ln]
    check(wait_for(lambda: len(gone()) == 4, 20),
          f"{label}: n=4 stream closed: its 4 choices were cancelled ({len(gone())} of 4)")


def kv_unstaged(c, pp, label, slices):
    """Every stage's KV pool is cut into `slices` head slices (one: head-major), and every
    request's KV went to the decode ranks without a staging pass (the stage's transfer log
    line says how many MiB of its puts were gathered into a staging buffer first)."""
    for s in range(pp):
        log = c.log(f"p0s{s}")
        check(f"{slices} head slice" in log,
              f"{label}: stage {s}'s KV pool has {slices} head slice(s)")
        staged = re.findall(r"puts \(([0-9.]+) MiB staged\)", log)
        check(staged and all(float(x) == 0 for x in staged),
              f"{label}: stage {s}: {len(staged)} transfers, none staged ({staged[:8]})")


def idle(c, label):
    ok, hs = c.wait_idle()
    check(ok, f"{label}: every instance idle, no KV block held: {hs}")


def case_synth(args):
    model = os.path.join(args.synth_dir, "llama.gguf")
    prompts = ["a", text(30), text(150)]
    for pp in (1, 2, 3):
        for tp in (1, 2):
            with Cluster(args, model, [{"pp": pp, "chunk": 64}], [{"tp": tp}]) as c:
                equal_outputs(c, args, model, prompts, f"synth pp{pp} tp{tp}")
                penalized_output(c, args, model, prompts[1], f"synth pp{pp} tp{tp}")
                for p in (prompts[0], prompts[2]):  # one chunk, several chunks
                    params_output(c, args.tandem, model, p, f"synth pp{pp} tp{tp}")
                if (pp, tp) == (2, 2):
                    choices_output(c, args, model, f"synth pp{pp} tp{tp}")
                idle(c, f"synth pp{pp} tp{tp}")
                # 4 KV heads: tp 2's ranks hold 2 each, one slice of a stage's sliced pool
                kv_unstaged(c, pp, f"synth pp{pp} tp{tp}", tp)
                codes = c.stop()
                check(all(v == 0 for v in codes.values()),
                      f"synth pp{pp} tp{tp}: SIGTERM, every process exits 0 ({codes})")
    # decode ranks that share KV heads (6 query heads over 2 KV heads at tp 3: rank 1 holds
    # both, ranks 0 and 2 one each): the transfer fills every copy, and pools differ in size
    model = os.path.join(args.synth_dir, "gqa.gguf")
    with Cluster(args, model, [{"pp": 2, "chunk": 64}], [{"tp": 3}]) as c:
        equal_outputs(c, args, model, prompts, "synth-gqa pp2 tp3")
        idle(c, "synth-gqa pp2 tp3")


def case_moe(args):
    """The mixture-of-experts models (qwen3moe; deepseek2: latent attention with its one
    latent KV head on every rank, sigmoid routing over expert groups, shared experts, a dense
    first layer): colocated tp 2 (every expert split across the ranks) and prefill pp 2 ->
    decode tp 2 with ep 2 (each rank holds half the experts whole) give `tandem generate`'s
    greedy output, colocated with two-batch overlap too (alone and 6 requests at once; a rank
    killed mid-stream: tbo_rank_dies); on deepseek2 disaggregated, the official openai client's n > 1 and
    batched prompts."""
    prompts = ["a", text(30), text(150)]
    for name in ("qwen3moe", "deepseek2"):
        model = os.path.join(args.synth_dir, f"{name}.gguf")
        # colocated with two-batch overlap: every step of 2 tokens or more (the prompts'
        # chunks, concurrent decode rows) runs as two micro-batches
        for pf, dc in (([], {"tp": 2, "tbo_min_tokens": 2}),
                       ([{"pp": 2, "chunk": 64}], {"tp": 2, "ep": 2})):
            label = (f"{name} {'pp2' if pf else 'colocated'} tp2{' ep2' if 'ep' in dc else ''}"
                     f"{' tbo' if 'tbo_min_tokens' in dc else ''}")
            with Cluster(args, model, pf, [dc]) as c:
                equal_outputs(c, args, model, prompts, label)
                if name == "deepseek2" and pf:
                    choices_output(c, args, model, label)
                if "tbo_min_tokens" in dc:
                    concurrent_outputs(c, args, model, prompts * 2, label)
                idle(c, label)
                if "tbo_min_tokens" in dc:
                    c.stop()  # the leader logs how many steps ran split as it stops
                    m = re.findall(r"two-batch overlap .*: (\d+) of (\d+) steps", c.log("d0r0"))
                    split, steps = (int(x) for x in m[-1]) if m else (0, 0)
                    check(0 < split < steps, f"{label}: {split} of {steps} steps ran split")
    # the model's MTP block proposing (speculative method mtp), pp 2 -> tp 2: the prompt's
    # hidden states stay on the stages (the block reads zeros for them), the output is
    # generate's; the oracle block's proposals are accepted
    for name in ("deepseek2-mtp", "deepseek2-mtp-echo"):
        model = os.path.join(args.synth_dir, f"{name}.gguf")
        label = f"{name} pp2 tp2 mtp"
        spec = {"method": "mtp", "adaptive": False, "max_tokens": 4}
        with Cluster(args, model, [{"pp": 2, "chunk": 64}], [{"tp": 2, "speculative": spec}]) as c:
            equal_outputs(c, args, model, prompts, label)
            idle(c, label)
            c.stop()  # the rank logs its speculation figures as it stops
            m = re.findall(r"speculation: (\d+) verifications, (\d+) proposed tokens, (\d+) "
                           r"accepted", c.log("d0r0"))
            v, p, a = (int(x) for x in m[-1]) if m else (0, 0, 0)
            check(v > 0 and p > 0 and (a > p // 2 if name.endswith("echo") else a <= p),
                  f"{label}: {v} verifications, {p} proposed, {a} accepted")
    tbo_rank_dies(args)


# three streams with nothing in common (no prefix affinity): the router spreads them over the
# instances, so at least one runs on the one whose process is killed
KILL_PROMPTS = [text(40), " ".join(reversed(WORDS)), "seven owls " * 9]
KILL_TOKENS = 380  # within the synthetic models' 512 positions


def streams_survive_kill(c, args, model, label, victim, where):
    """The three KILL_PROMPTS streamed at once; the process `victim` killed once each has its
    first token: a stream on `where` moves mid-way and every text equals generate."""
    want = expect(args, model, KILL_PROMPTS, KILL_TOKENS)
    outs, firsts, ths = [{}, {}, {}], [threading.Event() for _ in KILL_PROMPTS], []
    for p, o, f in zip(KILL_PROMPTS, outs, firsts):
        ths.append(threading.Thread(target=stream_complete, args=(c, p, KILL_TOKENS, o, f)))
        ths[-1].start()
    for f in firsts:
        f.wait(120)
    c.kill(victim)
    for th in ths:
        th.join(timeout=300)
    moved = re.findall(r"after (\d+) tokens: moving it", c.log("router"))
    check(moved and all(int(m) < KILL_TOKENS for m in moved),
          f"{label}: the router moved a stream on {where} mid-way (after {moved} tokens)")
    check([o.get("text") for o in outs] == want, f"{label}: every stream equals generate")


def tbo_rank_dies(args):
    """A follower of a tp 2 instance with two-batch overlap killed mid-stream (decode
    [{tp: 2, tbo_min_tokens: 2}, {tp: 1}], three streams, so the instance's steps run split and
    a micro-batch's all-reduce is posted when the rank goes): the streams on it move and every
    text equals generate; the restarted rank and its leader form the instance again, which
    serves (split again)."""
    model = os.path.join(args.synth_dir, "deepseek2.gguf")
    label = "deepseek2 tp2 tbo rank killed"
    with Cluster(args, model, [], [{"tp": 2, "tbo_min_tokens": 2}, {}]) as c:
        # the router is up once any instance is: wait for the tp 2 one, or the streams all
        # go to the other
        check(wait_for(lambda: c.decode_health(0).get("ready") == "1", 120),
              f"{label}: the tp 2 instance is ready")
        streams_survive_kill(c, args, model, label, "d0r1", "the instance")
        c.start_rank(0, 1)
        check(wait_for(lambda: c.decode_health(0).get("ready") == "1", 120),
              f"{label}: the restarted rank and its leader formed the instance again")
        concurrent_outputs(c, args, model, KILL_PROMPTS + ["a", text(20)], f"{label}, re-formed",
                           n=12)
        idle(c, label)
        c.stop()
        m = re.findall(r"two-batch overlap .*: (\d+) of (\d+) steps", c.log("d0r0"))
        check(m and int(m[-1][0]) > 0, f"{label}: the re-formed instance split steps ({m})")


def concurrent_outputs(c, args, model, prompts, label, n=16):
    """The prompts at once, so a dp group's members step together (each its own request):
    every text equals `tandem generate`'s."""
    want = expect(args, model, prompts, n)
    got = [None] * len(prompts)

    def one(i):
        st, body = c.complete(prompts[i], n)
        got[i] = body.get("choices", [{}])[0].get("text") if st == 200 else (st, body)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(got == want, f"{label}: {len(prompts)} prompts at once equal generate"
          + ("" if got == want else f" ({str(got)[:300]!r} vs {str(want)[:300]!r})"))


def case_dp(args):
    """Data-parallel attention (decode[].dp 2: two member instances, each its own requests and
    KV, every tensor whole but half the routed experts, a MoE layer's experts run for both
    members' tokens in lock step): colocated and pp 2 -> dp 2 give `tandem generate`'s greedy
    output one request at a time (the other member idle in every round) and several at once
    (the router spreads them over the members); both members ran rounds with rows of their
    own (their stop logs); the same with overlap; a member killed mid-stream (dp_member_dies)."""
    prompts = ["a", text(30), text(150)]
    for name in ("deepseek2", "qwen3moe"):
        model = os.path.join(args.synth_dir, f"{name}.gguf")
        for pf in ([], [{"pp": 2, "chunk": 64}]):
            label = f"{name} {'pp2' if pf else 'colocated'} dp2"
            with Cluster(args, model, pf, [{"dp": 2}]) as c:
                check(members_ready(c, label), f"{label}: both members ready")
                equal_outputs(c, args, model, prompts, label)
                concurrent_outputs(c, args, model, prompts + [text(60), "b", text(9)], label)
                if name == "deepseek2" and pf:  # the official openai client, n > 1, batches
                    choices_output(c, args, model, label)
                idle(c, label)
                c.stop()
                rounds = [re.findall(r"dp group: (\d+) rounds, (\d+) idle", c.log(f"d0.{k}r0"))
                          for k in range(2)]
                check(all(r and int(r[-1][0]) > int(r[-1][1]) for r in rounds),
                      f"{label}: both members ran rounds with rows of their own ({rounds})")
    # with overlap: each member's pass on its forward thread, its idle part between passes
    model = os.path.join(args.synth_dir, "deepseek2.gguf")
    label = "deepseek2 colocated dp2 overlap"
    with Cluster(args, model, [], [{"dp": 2, "overlap": True}]) as c:
        check(members_ready(c, label), f"{label}: both members ready")
        equal_outputs(c, args, model, prompts, label)
        concurrent_outputs(c, args, model, prompts + [text(60), "b", text(9)], label)
        idle(c, label)
    dp_member_dies(args)


def members_ready(c, label, timeout=120):
    """Every member of decode entry 0's dp group answers ready (the router is up as soon as
    any instance is)."""
    return wait_for(lambda: all(c.decode_health(0, k).get("ready") == "1"
                                for k in range(len(c.decode_names(0)))), timeout)


def dp_member_dies(args):
    """A member of a dp group killed mid-stream (decode [{dp: 2}, {tp: 1}], three streams):
    the requests on the group move (the group's other member fails its requests too: the experts it lacks are gone)
    and the client's text still equals generate; the killed member restarts, the group forms
    again and serves."""
    model = os.path.join(args.synth_dir, "deepseek2.gguf")
    label = "deepseek2 dp2 member killed"
    with Cluster(args, model, [], [{"dp": 2}, {}]) as c:
        members_ready(c, label)
        # member 0 at once: the group breaks, so a stream on either member moves
        streams_survive_kill(c, args, model, label, "d0.0r0", "the group")
        c.start_rank(0, 0, "d0.0")
        check(members_ready(c, label),
              f"{label}: the restarted member and the other formed the group again")
        concurrent_outputs(c, args, model, KILL_PROMPTS + ["a", text(20)], f"{label}, re-formed",
                           n=12)
        idle(c, label)


def case_default(args):
    prompts = ["The capital of France is", text(300)]
    for pp, tp in ((2, 1), (2, 3)):
        with Cluster(args, args.model, [{"pp": pp, "chunk": 128}], [{"tp": tp}]) as c:
            equal_outputs(c, args, args.model, prompts, f"default pp{pp} tp{tp}", n=24)
            penalized_output(c, args, args.model, prompts[0], f"default pp{pp} tp{tp}")
            params_output(c, args.tandem, args.model, prompts[0], f"default pp{pp} tp{tp}")
            idle(c, f"default pp{pp} tp{tp}")
            # 3 KV heads, one per rank at tp 3: the stages' pools are sliced 1/1/1
            kv_unstaged(c, pp, f"default pp{pp} tp{tp}", tp)
    # two decode instances, tp 1 and tp 3, taking requests in turn from one prefill instance:
    # its pool is cut for both (3 slices; tp 1's rank takes all three per run of blocks)
    with Cluster(args, args.model, [{"pp": 1, "chunk": 128}], [{"tp": 1}, {"tp": 3}],
                 routing="round_robin") as c:
        for _ in range(2):  # 3 prompts in turn over 2 instances: each serves every prompt
            equal_outputs(c, args, args.model, prompts + [text(100)], "default pp1 -> tp1 + tp3",
                          n=24)
        for i, d in enumerate(c.dc):
            arrived = c.log(f"d{i}r0").count(" arrived (")
            check(arrived >= 2, f"default pp1 -> tp1 + tp3: d{i} (tp {d['tp']}) took the KV of "
                                f"{arrived} requests")
        idle(c, "default pp1 -> tp1 + tp3")
        # the tp 3 ranks' heads are one slice each: nothing staged for them; the tp 1 rank
        # spans the 3 slices, so its pieces are gathered per block (as a head-major pool's
        # were for tp 3): the layout serves one of the two without staging, not both
        log = c.log("p0s0")
        check("3 head slices" in log, "default pp1 -> tp1 + tp3: the stage's pool has 3 slices")
        staged = {int(r): (int(n), float(x)) for r, n, x in re.findall(
            r"request (\d+): KV of (\d+) tokens in \d+ chunks, [0-9.]+ MiB in \d+ puts "
            r"\(([0-9.]+) MiB staged\)", log)}
        for i, d in enumerate(c.dc):
            ids = [int(r) for r in re.findall(r"request (\d+): KV of \d+ tokens from \d+ stages "
                                              r"arrived", c.log(f"d{i}r0"))]
            got = [staged.get(r) for r in ids]  # (tokens, staged MiB)
            # tp 1: every prompt with a whole block (16 tokens) staged its whole blocks
            ok = all(g is not None and (g[1] == 0 if d["tp"] == 3 else (g[1] > 0) == (g[0] >= 16))
                     for g in got)
            check(ids and ok, f"default pp1 -> tp1 + tp3: d{i} (tp {d['tp']}): (tokens, staged "
                              f"MiB) per request {got}")


def stream_complete(c, prompt, n, out, first):
    """A streamed greedy completion: its text into out["text"]; first is set at the first
    token (the prompt's prefill is over)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    try:
        h = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=300)
        h.request("POST", "/v1/completions", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        r = h.getresponse()
        text = ""
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:]).get("choices", [{}])[0].get("text") or ""
            first.set()
        out["text"] = text
        h.close()
    finally:
        first.set()


def case_share(args):
    """Each prompt (several chunks) is sent once the one before has its first token, so the
    stages prefill it alone (rows batched with another prompt's round differently) while the
    earlier ones decode: the stages' compute and the steps meet, and every output must still
    be `tandem generate`'s. Twice: share_cores true (every step claims), and auto with a
    period target every step beside the busy stages runs past (it leaves steps to the
    scheduler and claims for some, its probes; whether it then claims for all depends on how
    much this machine's scheduler stretches the steps, test_coreshare's case)."""
    model = os.path.join(args.synth_dir, "llama.gguf")
    # no two share a prefix: the stages compute each whole (no prefix-cache hits)
    prompts = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(120 + 5 * i))
               for i in range(5)] + [text(20)]
    want = expect(args, model, prompts, 48)
    for mode, itl in ((True, 20), ("auto", 0.2)):
        what = f"share {mode}"
        dc = {"tp": 2, "share_cores": mode, "itl_target_ms": itl}
        with Cluster(args, model, [{"pp": 2, "chunk": 64}], [dc]) as c:
            outs = [{} for _ in prompts]
            ths = []
            for p, o in zip(prompts, outs):
                first = threading.Event()
                ths.append(threading.Thread(target=stream_complete, args=(c, p, 48, o, first)))
                ths[-1].start()
                first.wait(300)
            for t in ths:
                t.join()
            same = sum(1 for o, w in zip(outs, want) if o.get("text") == w)
            check(same == len(prompts), f"{what}: {same}/{len(prompts)} outputs of overlapping "
                                        f"requests equal to generate")
            idle(c, "share")
            # /metrics (the router's, from the decode's Health): the claims, and the steps
            # auto left
            fam = ("tandem_decode_share_cores_claimed_steps_total" if mode is True
                   else "tandem_decode_share_cores_left_steps_total")
            got = None
            for _ in range(50):
                got = re.search(re.escape(fam) + r'\{[^}]*instance="d0"\} (\S+)', c.metrics())
                if got and float(got.group(1)) > 0:
                    break
                time.sleep(0.2)
            check(got is not None and float(got.group(1)) > 0,
                  f"{what}: /metrics {fam} of d0 {got.group(1) if got else None}")
            codes = c.stop()
            check(all(v == 0 for v in codes.values()), f"{what}: every process exits 0 ({codes})")
            m = re.search(r"shared cores \(decode\[\]\.share_cores\): (\d+) steps claimed them "
                          r".*; (\d+) waited", c.log("d0r0"))
            paused = [re.search(r"paused (\d+) times for decode steps", c.log(f"p0s{s}"))
                      for s in range(2)]
            check(m is not None and int(m.group(1)) > 0,
                  f"{what}: the decode's steps claimed the cores ({m.group(0) if m else None})")
            n_paused = [int(p.group(1)) if p else None for p in paused]
            check(None not in n_paused and sum(n_paused) > 0,
                  f"{what}: the stages paused for the steps (times per stage {n_paused})")
            if mode == "auto":
                a = re.search(r"shared cores, auto: (\d+) steps left to the scheduler; claiming "
                              r"began (\d+) times", c.log("d0r0"))
                check(a is not None and int(a.group(1)) > 0,
                      f"{what}: steps left to the scheduler beside the claims "
                      f"({a.group(0) if a else None})")


def background_complete(c, prompt, n, out):
    t0 = time.time()
    out["status"], out["body"] = c.complete(prompt, n)
    out["seconds"] = time.time() - t0


def case_retry(args):
    prompt = text(600)
    want = expect(args, args.model, [prompt], 8)[0]
    with Cluster(args, args.model, [{"pp": 2, "chunk": 128}, {"pp": 1, "chunk": 128}],
                 [{"tp": 1, "kv_blocks": 1024}]) as c:
        out = {}
        th = threading.Thread(target=background_complete, args=(c, prompt, 8, out))
        th.start()
        busy = None
        for _ in range(400):
            for i in (0, 1):
                if c.prefill_health(i).get("running") == "1":
                    busy = i
            if busy is not None:
                break
            time.sleep(0.05)
        check(busy is not None, f"retry: the prompt reached a prefill instance (p{busy})")
        victim = f"p{busy}s0" if busy is not None else "p0s0"
        time.sleep(0.3)
        c.kill(victim)
        th.join(timeout=300)
        text_out = out.get("body", {}).get("choices", [{}])[0].get("text")
        check(out.get("status") == 200 and text_out == want,
              f"retry: {victim} killed mid-prompt: retried elsewhere, equal to generate "
              f"(status {out.get('status')}, {str(out.get('body'))[:900]})")
        m = c.metrics()
        check("retries" in m, "retry: the router counts retries in /metrics")
        c.start_stage(busy if busy is not None else 0, 0)
        ok = wait_for(lambda: c.prefill_health(busy or 0).get("ready") == "1", 60,
                      last_look=False)
        check(ok, f"retry: restarted {victim} rejoins, its instance is ready again")
        equal_outputs(c, args, args.model, ["The capital of France is"], "retry: after restart")
        ok, hs = c.wait_idle()
        check(ok, f"retry: every instance idle, no KV block held: {hs}")


def case_decode_dies(args):
    prompt = text(600)
    with Cluster(args, args.model, [{"pp": 2, "chunk": 128}], [{"tp": 1, "kv_blocks": 1024}],
                 instance_timeout_ms=1500) as c:
        out = {}
        th = threading.Thread(target=background_complete, args=(c, prompt, 8, out))
        th.start()
        ok = wait_for(lambda: c.prefill_health().get("running") == "1", 60, last_look=False)
        check(ok, "decode_dies: the prompt is being prefilled")
        time.sleep(0.3)
        c.kill("d0r0")
        th.join(timeout=120)
        check((out.get("status") or 0) >= 500 and out.get("seconds", 99) < 30,
              f"decode_dies: the client gets an error in {out.get('seconds', 0):.1f} s "
              f"(status {out.get('status')}: {str(out.get('body'))[:200]})")
        ok = wait_for(lambda: (lambda h: h.get("running") == "0" and h.get("kv_used") == "0")(
            c.prefill_health()), 30, last_look=False)
        check(ok, f"decode_dies: the prefill instance dropped the transfer: {c.prefill_health()}")
        c.start_rank(0, 0)
        c.wait_health()
        equal_outputs(c, args, args.model, ["The capital of France is"],
                      "decode_dies: after the restart")
        idle(c, "decode_dies")


def case_stalled(args):
    prompt = text(600)
    with Cluster(args, args.model, [{"pp": 1, "chunk": 128}], [{"tp": 1}], timeout_ms=3000,
                 instance_timeout_ms=60000) as c:
        out = {}
        c.kill("p0s0", signal.SIGSTOP)
        th = threading.Thread(target=background_complete, args=(c, prompt, 8, out))
        th.start()
        th.join(timeout=120)
        c.kill("p0s0", signal.SIGCONT)
        check((out.get("status") or 0) >= 500 and out.get("seconds", 99) < 20,
              f"stalled: no KV ever comes: a clear error in {out.get('seconds', 0):.1f} s "
              f"(status {out.get('status')}: {str(out.get('body'))[:200]})")
        ok = wait_for(lambda: c.decode_health().get("kv_used") == "0", 20, last_look=False)
        check(ok, f"stalled: the decode instance freed the blocks: {c.decode_health()}")
        time.sleep(0.5)
        equal_outputs(c, args, args.model, ["The capital of France is"], "stalled: after SIGCONT")
        idle(c, "stalled")


def post(c, path, body, timeout=300):
    h = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    h.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = h.getresponse()
    data = r.read().decode(errors="replace")
    h.close()
    if not body.get("stream"):
        return r.status, json.loads(data)
    chunks = [json.loads(line[6:]) for line in data.split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    return r.status, chunks


def lp_requests(prompt, n):
    comp = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5, "echo": True,
            "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    return comp, chat


def lp_fetch(c, prompt, n):
    """(completions logprobs, chat logprobs content), non-streamed and streamed-joined."""
    comp, chat = lp_requests(prompt, n)
    st1, b1 = post(c, "/v1/completions", comp)
    st2, b2 = post(c, "/v1/chat/completions", chat)
    st3, ch3 = post(c, "/v1/completions", dict(comp, stream=True))
    st4, ch4 = post(c, "/v1/chat/completions", dict(chat, stream=True))
    if (st1, st2, st3, st4) != (200, 200, 200, 200):
        raise RuntimeError(f"status {st1} {st2} {st3} {st4}: {str(b1)[:300]} {str(b2)[:300]}")
    lp1 = b1["choices"][0]["logprobs"]
    lp2 = b2["choices"][0]["logprobs"]["content"]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in ch3:
        lp = ch["choices"][0].get("logprobs") if ch.get("choices") else None
        for k in joined:
            joined[k] += (lp or {}).get(k, [])
    content = []
    for ch in ch4:
        lp = ch["choices"][0].get("logprobs") if ch.get("choices") else None
        content += (lp or {}).get("content") or []
    return lp1, lp2, joined, content


def lp_close(a, b, tol=1e-4):
    """Two logprobs values (lists / dicts / numbers / None) equal up to tol."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(lp_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(lp_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    return a == b


def case_logprobs(args, models=None):
    models = models or [("synth", os.path.join(args.synth_dir, "llama.gguf"), 64)]
    for name, model, chunk in models:
        prompts = [text(6), text(3 * chunk // 2 + 17)]  # one chunk; several
        # the reference computes every prompt from token 0: a prefix cache hit (the 2nd prompt
        # extends the 1st) reuses KV prefilled in another batch shape, whose rounding moves
        # logprobs by ~1e-4 (docs/prefix-cache.md, "Exactness")
        with Cluster(args, model, [], [{"tp": 1, "prefix_cache": False}]) as c:
            ref = [lp_fetch(c, p, 6) for p in prompts]
        for pp in ((1, 2) if name == "synth" else (2,)):
            label = f"logprobs {name} pp{pp}"
            # the prefix caches off (prefill and decode): a hit (the chat prompts share their
            # template's first blocks; the decode side holds the previous request's) moves the
            # chunk boundaries, which moves logprobs by ~1.5e-4 against colocated (greedy tokens
            # stay equal: tests/disagg/test_prefix_cache.py)
            with Cluster(args, model, [{"pp": pp, "chunk": chunk, "prefix_cache": False}],
                         [{"tp": 1, "prefix_cache": False}]) as c:
                for p, want in zip(prompts, ref):
                    got = lp_fetch(c, p, 6)
                    n_prompt = len(got[0]["tokens"]) - 6
                    check(got[0]["token_logprobs"][0] is None and
                          all(isinstance(x, float) for x in got[0]["token_logprobs"][1:]),
                          f"{label}: {n_prompt} prompt tokens: echo gives every prompt "
                          "token's logprob but the first's")
                    check(lp_close(got[0], want[0]), f"{label}: {n_prompt} prompt tokens: "
                          "completions echo logprobs equal colocated within 1e-4"
                          + ("" if lp_close(got[0], want[0]) else
                             f" ({str(got[0])[:400]} vs {str(want[0])[:400]})"))
                    check(lp_close(got[1], want[1]), f"{label}: {n_prompt} prompt tokens: "
                          "chat logprobs equal colocated within 1e-4"
                          + ("" if lp_close(got[1], want[1]) else
                             f" ({str(got[1])[:400]} vs {str(want[1])[:400]})"))
                    check(lp_close(got[2], got[0], 0) and lp_close(got[3], got[1], 0),
                          f"{label}: {n_prompt} prompt tokens: streamed == non-streamed")
                idle(c, label)


def case_logprobs_default(args):
    case_logprobs(args, [("default", args.model, 64)])  # chunks as the decode steps


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}


def case_grammar(args, samples=2, many=False):
    """Structured output through the disaggregated path: the last prefill stage samples the
    first token under the grammar's mask (prefill pp 2 -> decode tp 3: the
    default model's 9 heads do not split in 2), the decode side the
    rest. Prompts of one chunk and of several (the schema travels with the LAST segment).
    many (grammar_many): 10 samples and json_object, not the logit_bias check."""
    import jsonschema
    import openai
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    with Cluster(args, args.model, [{"pp": 2, "chunk": 64}], [{"tp": 3}]) as c:
        cl = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        mid = os.path.basename(args.model)
        bad = []
        for i in range(samples):
            kw = dict(model=mid, max_tokens=160, temperature=1.0, seed=100 + i)
            if i % 2:
                r = cl.chat.completions.create(
                    messages=[{"role": "user", "content": "Describe a person as JSON."}],
                    response_format=rf, **kw)
                out = r.choices[0].message.content
            else:  # a prompt of several chunks
                r = cl.completions.create(prompt=text(120) + " A JSON record:",
                                          extra_body={"response_format": rf}, **kw)
                out = r.choices[0].text
            try:
                jsonschema.validate(json.loads(out), PERSON)
                if r.choices[0].finish_reason != "stop":
                    bad.append((i, r.choices[0].finish_reason, out))
            except (ValueError, jsonschema.ValidationError) as e:
                bad.append((i, str(e)[:80], out))
        check(not bad, f"grammar pp2 tp3: {samples} seeded temperature-1.0 json_schema outputs "
              "parse and validate" + ("" if not bad else f": {bad[:2]}"))
        if not many:
            grammar_first_token(c, cl, mid, rf)
            idle(c, "grammar pp2 tp3")
            return
        r = cl.chat.completions.create(model=mid, max_tokens=200, temperature=1.0, seed=7,
                                       messages=[{"role": "user", "content": "A JSON object."}],
                                       response_format={"type": "json_object"})
        out = r.choices[0].message.content
        try:
            ok = isinstance(json.loads(out), dict) and r.choices[0].finish_reason == "stop"
        except ValueError:
            ok = False
        check(ok, f"grammar pp2 tp3: a json_object output parses ({out!r})")
        idle(c, "grammar pp2 tp3")


def grammar_first_token(c, cl, mid, rf):
    """The first token is the prefill stage's: +100 on " the" would make it " the" without
    the mask (checked), and the output would not start with "{"."""
    import jsonschema
    t = token_post(c, "/tokenize", {"prompt": " the", "add_special_tokens": False})["tokens"][-1]
    kw = dict(model=mid, prompt="A JSON record:", max_tokens=1, temperature=0,
              logit_bias={str(t): 100})
    r0 = cl.completions.create(**kw)
    r = cl.completions.create(**dict(kw, max_tokens=120), extra_body={"response_format": rf})
    check(r0.choices[0].text == " the" and r.choices[0].text.startswith("{"),
          f"grammar pp2 tp3: the first token obeys the mask against logit_bias +100 "
          f"({r0.choices[0].text!r}, {r.choices[0].text[:20]!r})")
    try:
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)
        check(True, "grammar pp2 tp3: ... and the output validates")
    except (ValueError, jsonschema.ValidationError) as e:
        check(False, f"grammar pp2 tp3: ... and the output validates ({e})")


CASES = {"synth": case_synth, "moe": case_moe, "dp": case_dp, "default": case_default, "retry": case_retry,
         "decode_dies": case_decode_dies, "stalled": case_stalled, "share": case_share,
         "logprobs": case_logprobs,
         "grammar": case_grammar, "logprobs_default": case_logprobs_default,
         "grammar_many": lambda args: case_grammar(args, samples=10, many=True)}


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "prefill", "decode", "tandem", "synth-dir"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--case", default="",
                    help="comma-separated cases to run (default: all); tests/disagg.cmake runs "
                         "the fault cases under ASan and the default model's outputs in Release")
    ap.add_argument("--skip", default="", help="comma-separated cases not to run")
    args = ap.parse_args()
    wanted = [c for c in args.case.split(",") if c]
    skipped = [c for c in args.skip.split(",") if c]
    unknown = [c for c in wanted + skipped if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    for name, fn in CASES.items():
        if (wanted and name not in wanted) or name in skipped:
            continue
        if name not in ("synth", "moe", "dp", "logprobs", "share") and not (args.model and
                                                             os.path.exists(args.model)):
            print(f"skip {name}: no default model")
            continue
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            fn(args)
        except Exception as e:  # a crashed case is a failure, the others still run
            check(False, f"{name}: {type(e).__name__}: {e}")
        print(f"     ({name}: {time.time() - t0:.1f} s)", flush=True)
    print(f"{len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
