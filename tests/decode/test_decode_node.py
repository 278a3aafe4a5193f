#!/usr/bin/env python3
"""test_decode_node.py: tandem-decode as it is deployed: real processes, one per TP rank,
the control plane over loopback TCP, the test client (`tandem client`) as the user.

Checks (each a separate case, all must pass):
  tp1 / tp3 on the default model, tp2 / tp4 on synthetic models: greedy outputs equal
    `tandem generate` token for token;
  16 concurrent requests (different prompt lengths, max tokens, seeds): each equals its
    output when run alone (deterministic: true); and 8 on the default model with prompts
    of up to 400 tokens, whose attention rows are cut across threads;
  pool pressure: a pool too small for all at once still completes every request with the
    same outputs (preempted requests too, recomputed bit for bit; also on the default
    model); a request larger than the pool is refused with a clear error; the pool reports 0
    blocks used afterwards;
  speculative decoding (prompt lookup, pinned: every proposal verified) on the default
    model: greedy at tp 3 equal to `tandem generate`, seeded sampling equal to speculation
    off, with proposals accepted (the node's log); by a draft model: the default model as
    its own draft at tp 1 (nearly every proposal accepted) and a synthetic model with
    another of its vocabulary at tp 2, greedy equal to `tandem generate`;
  cancel mid-generation finishes the request as cancelled and frees its blocks;
  bytes that are not a message get an error reply and the node keeps serving;
  an idle instance uses (almost) no CPU;
  killing one rank mid-request: the client gets an error, no hang; the leader and the other
    ranks stay up (not ready, waiting for the rank: test_rejoin.py restarts it) and exit 0
    on SIGTERM.

usage: test_decode_node.py --decode BIN --tandem BIN --synth-dir DIR
                          [--model GGUF [--model-cases all|kill|only]]
"""
import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import client_health, write_yaml  # noqa: E402
from tdtest.ports import free_port  # noqa: E402
from tdtest.procs import spawn, stop  # noqa: E402
from tdtest.synth import long_context_llama  # noqa: E402


class Instance:
    """One decode instance: tp processes started from a generated YAML."""

    def __init__(self, args, model, tp, threads=1, kv_blocks=512, step_tokens=128, max_batch=32,
                 name=None, decode_extra=None, doc_extra=None):
        """decode_extra: more fields of the instance; doc_extra: more top-level sections
        (test_pd_decode.py: a prefill instance and kvxfer)."""
        self.args = args
        self.tp = tp
        self.dir = tempfile.mkdtemp(prefix="tandem-dc-")
        self.cfg = os.path.join(self.dir, "cluster.yaml")
        for attempt in range(3):
            self.port = free_port()
            self.name = name or f"d{self.port}"
            write_yaml(self.cfg, {
                "model": model,
                "decode": [{"name": self.name, "tp": tp, "threads": threads,
                            "kv_blocks": kv_blocks, "step_tokens": step_tokens,
                            "max_batch": max_batch, "port": self.port, **(decode_extra or {})}],
                **(doc_extra or {})})
            self.url = f"tcp://127.0.0.1:{self.port}"
            self.procs = []
            order = list(range(tp))
            random.shuffle(order)  # ranks start in any order
            for r in order:
                p = spawn([args.decode, "--config", self.cfg, "--instance", self.name,
                           "--rank", str(r)], os.path.join(self.dir, f"rank{r}.log"), mode="w")
                self.procs.append((r, p))
            try:
                self.wait_ready()
                return
            except RuntimeError:
                # followers wait for a leader without limit: never leave them behind (SIGTERM:
                # they remove their shared-memory KV pools)
                self.stop()
                # another process on this machine took the port since: try another one
                if attempt < 2 and "Address in use" in self.log(0):
                    continue
                raise

    def rank_proc(self, r):
        return next(p for rr, p in self.procs if rr == r)

    def client(self, *extra, timeout=300):
        return subprocess.run([self.args.tandem, "client", "--url", self.url, *extra],
                              capture_output=True, text=True, timeout=timeout)

    def wait_ready(self, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            r = self.client("--health", "--timeout-ms", "2000", timeout=30)
            if r.returncode == 0 and "ready 1" in r.stdout:
                return
            for rr, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"rank {rr} exited with {p.returncode}: {self.log(rr)}")
            time.sleep(0.2)
        raise RuntimeError("instance did not become ready: " + self.log(0))

    def health(self):
        return client_health(self.args.tandem, self.url, timeout=300,
                             extra=("--timeout-ms", "5000"))

    def log(self, r):
        return self.log_all(r)[-3000:]

    def log_all(self, r=0):
        with open(os.path.join(self.dir, f"rank{r}.log")) as f:
            return f.read()

    def cpu_seconds(self):
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for _, p in self.procs:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def stop(self):
        stop([p for _, p in self.procs], timeout=20)


def generate_ids(args, model, ids, n):
    r = subprocess.run([args.tandem, "generate", "--model", model, "--prompt-ids",
                        ",".join(map(str, ids)), "--max-tokens", str(n), "--temperature", "0",
                        "--ids", "--threads", "1"], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError("generate failed: " + r.stderr)
    return r.stdout.split()


def node_ids(inst, ids, n):
    r = inst.client("--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(n))
    if r.returncode:
        return None, r.stderr
    fields = r.stdout.split()
    return fields[1:], fields[0]


def prompts_for(vocab, count, seed):
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(rnd.randint(3, 60))] for _ in range(count)]


CHAT_PROMPTS = [
    # ChatML renderings of short questions, tokenized for SmolLM2 (ids are the model's).
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
     407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
     520, 9531, 198],
]


def case_equals_generate(args, model, tp, prompts, n_tokens, label):
    inst = Instance(args, model, tp)
    try:
        for i, ids in enumerate(prompts):
            want = generate_ids(args, model, ids, n_tokens)
            got, finish = node_ids(inst, ids, n_tokens)
            check(got == want, f"{label}: prompt {i} ({len(ids)} tokens): node {finish} "
                               f"{' '.join(got or [])[:80]} vs generate {' '.join(want)[:80]}")
    finally:
        inst.stop()


SAMPLED = ("--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05")
# speculation on every decode row that has a proposal (not only where it pays), with
# single-token matches: as many verifications as the requests allow
SPEC_PINNED = {"speculative": {"method": "ngram", "adaptive": False, "max_tokens": 6,
                               "ngram_min": 1}}


def spec_accepted(log):
    m = re.findall(r"speculation: (\d+) verifications, (\d+) proposed tokens, (\d+) accepted", log)
    return [int(x) for x in m[-1]] if m else [0, 0, 0]


def case_spec(args, model):
    """Speculative decoding (prompt lookup) keeps every token: greedy at tp 3 against
    `tandem generate` (no speculation there), seeded sampling at tp 1 against the node with
    speculation off, on prompts a
    model copies from (a repeated stretch of tokens: prompt lookup's case) and a chat prompt;
    the node's log shows proposals verified and accepted."""
    rnd = random.Random(11)
    stretch = [rnd.randrange(1000, 40000) for _ in range(24)]
    prompts = [stretch * 3 + stretch[:5], CHAT_PROMPTS[0]]
    inst = Instance(args, model, 3, decode_extra=SPEC_PINNED)
    try:
        for i, ids in enumerate(prompts):
            want = generate_ids(args, model, ids, 40)
            got, finish = node_ids(inst, ids, 40)
            check(got == want, f"speculation tp3: prompt {i}: node {finish} "
                               f"{' '.join(got or [])[:80]} vs generate {' '.join(want)[:80]}")
    finally:
        inst.stop()
    v, p, a = spec_accepted(inst.log_all(0))
    check(v > 0 and a > 0 and a <= p, f"speculation tp3: {v} verifications, {p} proposed, "
                                      f"{a} accepted")
    # seeded sampling: the same tokens with speculation off and on (tandem generate's
    # single thread cuts attention differently from a 2-thread rank: not a reference here)
    outs = []
    for extra in ({"speculative": {"method": "off"}}, SPEC_PINNED):
        inst = Instance(args, model, 1, threads=2, decode_extra=extra)
        try:
            outs.append([inst.client("--prompt-ids", ",".join(map(str, ids)), "--max-tokens",
                                     "40", *SAMPLED, "--seed", str(5 + i)).stdout.split()[1:]
                         for i, ids in enumerate(prompts)])
        finally:
            inst.stop()
    for i in range(len(prompts)):
        check(outs[0][i] == outs[1][i] and len(outs[0][i]) > 1,
              f"speculation sampled: prompt {i}: on {' '.join(outs[1][i])[:80]} vs off "
              f"{' '.join(outs[0][i])[:80]}")
    v, p, a = spec_accepted(inst.log_all(0))
    check(v > 0 and a > 0, f"speculation sampled: {v} verifications, {a} accepted")


def case_spec_draft(args, model, draft, tp, prompts, n_tokens, label, oracle=None):
    """Speculative decoding by a draft model (decode[].speculative.draft), or with draft None
    by the model's own MTP block (method mtp): greedy output equal to `tandem generate`. A
    proposer that agrees with the model (the model as its own draft; oracle True: the
    synthetic echo MTP block, make_synth.py) proposes what greedy decoding samples, so every
    proposal is accepted but those of a request's last verification (past its stop token or
    its length; and the draft's rows are batched, the target's solo: a near tie may still
    differ)."""
    spec = {"draft": draft} if draft else {"method": "mtp"}
    inst = Instance(args, model, tp, decode_extra={
        "speculative": dict(spec, adaptive=False, max_tokens=4)})
    try:
        for i, ids in enumerate(prompts):
            want = generate_ids(args, model, ids, n_tokens)
            got, finish = node_ids(inst, ids, n_tokens)
            check(got == want, f"{label}: prompt {i}: node {finish} {' '.join(got or [])[:80]} "
                               f"vs generate {' '.join(want)[:80]}")
    finally:
        inst.stop()
    log = inst.log_all(0)
    v, p, a = spec_accepted(log)
    named = "by the model's MTP block" if not draft else "by a draft model: " + draft
    check(named in log and "draft model:" in log, f"{label}: the log names the draft and its work")
    if oracle if oracle is not None else draft == model:
        check(v > 0 and p > 0 and a >= p - 4 * len(prompts),
              f"{label}: {v} verifications, {p} proposed, {a} accepted")


def write_requests(path, reqs):
    with open(path, "w") as f:
        for max_tokens, temp, seed, ids in reqs:
            f.write(f"{max_tokens} {temp} {seed} {','.join(map(str, ids))}\n")


def run_requests(inst, reqs, top_k=40):
    path = os.path.join(inst.dir, f"reqs-{random.randrange(1 << 30)}.txt")
    write_requests(path, reqs)
    r = inst.client("--requests", path, "--top-k", str(top_k))
    return r.returncode, r.stdout.splitlines(), r.stderr


def case_concurrent(args, model, vocab, kv_blocks, label, expect_preempt=False, n=16, max_len=120,
                    top_k=40, max_tokens=None, temperature=0.8):
    """n requests of 2..max_len prompt tokens at once, then each alone. On the default model
    (max_len 400) a row's attention over a few hundred keys is cut across the two threads,
    so its output depends on its batch unless each solo row is cut as if it were alone:
    before that, 4-6 of 12 such requests differed between runs (BENCHMARKS.md). Sampling
    over the whole vocabulary (top_k 0) makes a last-bit change in the logits visible."""
    rnd = random.Random(7)
    reqs = []
    for i in range(n):
        ids = [rnd.randrange(vocab) for _ in range(rnd.randint(2, max_len))]
        reqs.append((max_tokens or rnd.randint(4, 40), 0.0 if i % 4 == 0 else temperature,
                     100 + i, ids))
    # deterministic: prefill rows too are computed as if alone, so a request's output never
    # depends on its batch (decode[].deterministic, docs/config.md); adaptive_threads: the
    # steps run on 2 or 1 of the pool's threads (at least one step in 16 on the count not
    # chosen), which must not change a token either
    inst = Instance(args, model, 1, threads=2, kv_blocks=kv_blocks, step_tokens=64,
                    decode_extra={"deterministic": True, "adaptive_threads": True})
    try:
        rc, together, err = run_requests(inst, reqs, top_k)
        check(rc == 0 and len(together) == n, f"{label}: {n} concurrent requests finished ({err.strip()[:200]})")
        alone = []
        for r in reqs:
            rc1, out, err1 = run_requests(inst, [r], top_k)
            alone.append(out[0] if out else "")
        same = sum(1 for a, b in zip(together, alone) if a == b)
        # a preempted request is recomputed: its prompt and tokens go through prefill
        # chunks; with deterministic every row of those is a solo row (matmuls and attention
        # as if alone, the way each token was first computed), so its KV comes back bit for
        # bit and even its sampled tokens agree (before attention cut solo rows alone, only
        # 2 of 8 agreed on the default model)
        check(same == n, f"{label}: {same}/{n} outputs equal to the request alone")
        if expect_preempt:
            # whether the pool runs short depends on how the requests' arrivals and ends
            # interleave: on a fast build they can end before the pool fills (0 preemptions
            # in 1 of 3 Release runs). Until one preempts, the batch runs again (at most 4
            # more times), each run's outputs again equal to the requests alone.
            for _ in range(4):
                if "preempted" in inst.log_all():
                    break
                rc, again, err = run_requests(inst, reqs, top_k)
                same = sum(1 for a, b in zip(again, alone) if a == b)
                check(rc == 0 and same == n,
                      f"{label}: again, {same}/{n} outputs equal to the request alone")
            log = inst.log_all()
            check("preempted" in log, f"{label}: the pool was short enough to preempt "
                                      f"({log.count('preempted')} preemptions)")
        h = inst.health()
        check(h.get("kv_used") == "0", f"{label}: 0 KV blocks in use afterwards (health {h})")
        if expect_preempt:
            big = [(kv_blocks * 16, 0.0, 1, [1, 2, 3])]
            rc2, out2, err2 = run_requests(inst, big)
            check(rc2 != 0 and "never fit" in err2, f"{label}: a request larger than the pool is refused: {err2.strip()[:160]}")
    finally:
        inst.stop()


def case_cancel_garbage_idle(args, model):
    inst = Instance(args, model, 1, threads=2)
    try:
        r = inst.client("--prompt-ids", "1,2,3,4", "--max-tokens", "100000", "--cancel-after", "3")
        fields = r.stdout.split()
        check(fields[:1] == ["cancelled"] and len(fields) >= 4,
              f"cancel: finished as '{fields[:1]}' after {len(fields) - 1} tokens")
        time.sleep(0.3)
        h = inst.health()
        check(h.get("kv_used") == "0" and h.get("running") == "0", f"cancel: blocks freed (health {h})")
        r = inst.client("--garbage", "--prompt-ids", "5,6,7", "--max-tokens", "4")
        check(r.returncode == 0 and r.stdout.startswith("length"),
              f"garbage answered with an error and the node keeps serving: {r.stderr.strip()[:160]}")
        time.sleep(0.5)
        c0 = inst.cpu_seconds()
        time.sleep(10)  # the measure: CPU time of an idle instance over 10 s
        used = inst.cpu_seconds() - c0
        check(used < 0.5, f"idle instance used {used:.3f} s of CPU in 10 s (limit 5 % of a core)")
    finally:
        inst.stop()


def case_kill_rank(args, model, tp, delay):
    inst = Instance(args, model, tp)
    try:
        client = subprocess.Popen([args.tandem, "client", "--url", inst.url, "--prompt-ids", "1,2,3",
                                   "--max-tokens", "100000", "--ignore-eos", "--timeout-ms", "60000"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        check(client.poll() is None, "kill rank: the request is still running when a rank is killed")
        inst.rank_proc(1).kill()
        t0 = time.time()
        out, err = client.communicate(timeout=60)
        check(client.returncode != 0 and ("error" in out or "error" in err),
              f"kill rank: client got an error after {time.time() - t0:.1f} s: {err.strip()[:160]}")
        h = {}
        end = time.time() + 10
        while time.time() < end and h.get("ready") != "0":
            h = inst.health()
            time.sleep(0.05)
        check(h.get("ready") == "0", f"kill rank: the leader reports not ready (health {h})")
        alive = [r for r, p in inst.procs if r != 1 and p.poll() is None]
        check(len(alive) == tp - 1, f"kill rank: the other ranks keep running ({alive})")
    finally:
        inst.stop()
    codes = [(r, p.returncode) for r, p in inst.procs if r != 1]
    check(all(c == 0 for _, c in codes), f"kill rank: the others exit 0 on SIGTERM ({codes})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--model-cases", choices=("all", "kill", "only"), default="all",
                    help="with --model: all (the synthetic cases, kill rank on the model, the "
                         "model's own cases), kill (the synthetic cases, kill rank on the model: "
                         "the synthetic model ends a request too fast to be killed mid-way "
                         "without ASan), only (the model's own cases). tests/decode.cmake runs "
                         "kill under ASan and only in Release")
    args = ap.parse_args()
    if args.model_cases != "all" and not args.model:
        ap.error("--model-cases kill|only needs --model")
    random.seed(os.getpid())
    synth = os.path.join(args.synth_dir, "llama.gguf")
    synth_vocab = 512
    cases = [
        ("tp2 synthetic", lambda: case_equals_generate(args, synth, 2, prompts_for(synth_vocab, 3, 1), 12, "tp2 synthetic")),
        ("tp4 synthetic", lambda: case_equals_generate(args, os.path.join(args.synth_dir, "qwen2.gguf"), 4, prompts_for(synth_vocab, 3, 2), 12, "tp4 synthetic qwen2")),
        ("concurrent", lambda: case_concurrent(args, synth, synth_vocab, 512, "concurrent")),
        ("pool pressure", lambda: case_concurrent(args, synth, synth_vocab, 24, "pool pressure", expect_preempt=True)),
        ("cancel/garbage/idle", lambda: case_cancel_garbage_idle(args, synth)),
        ("draft synthetic", lambda: case_spec_draft(
            args, synth, os.path.join(args.synth_dir, "qwen2.gguf"), 2,
            prompts_for(synth_vocab, 2, 4), 16, "draft tp2 synthetic (qwen2 draft)")),
        # the model's own multi-token prediction block (deepseek2 nextn): an oracle block that
        # agrees with its model, and a random one, at tp 2 (the leader holds the block whole)
        ("mtp synthetic", lambda: [case_spec_draft(
            args, os.path.join(args.synth_dir, f"deepseek2-{v}.gguf"), None, 2,
            prompts_for(synth_vocab, 2, 5), 16, f"mtp tp2 synthetic ({v})", oracle=v == "mtp-echo")
            for v in ("mtp-echo", "mtp")]),
        # a request killed mid-way must outlast the delay: the default model's (8K context)
        # does, the synthetic model's would reach its 512-token context first on a quiet
        # machine, so it runs on a 4096-token copy
        ("kill rank", lambda: case_kill_rank(args, args.model or long_context_llama(),
                                             3 if args.model else 2, 1.0 if args.model else 0.2)),
    ]
    if args.model_cases == "only":
        cases = []
    if args.model and args.model_cases != "kill":
        prompts = CHAT_PROMPTS + prompts_for(49152, 2, 3)
        cases.insert(0, ("tp1 default", lambda: case_equals_generate(args, args.model, 1, prompts, 24, "tp1 default model")))
        cases.insert(1, ("tp3 default", lambda: case_equals_generate(args, args.model, 3, prompts, 24, "tp3 default model")))
        cases.insert(2, ("concurrent default", lambda: case_concurrent(
            args, args.model, 49152, 512, "concurrent default model", n=8, max_len=400, top_k=0,
            max_tokens=48, temperature=1.0)))
        cases.insert(4, ("speculation default", lambda: case_spec(args, args.model)))
        cases.insert(5, ("draft default", lambda: case_spec_draft(
            args, args.model, args.model, 1, CHAT_PROMPTS + prompts_for(49152, 1, 5), 32,
            "draft tp1 default model (itself)")))
        cases.insert(3, ("pool pressure default", lambda: case_concurrent(
            args, args.model, 49152, 40, "pool pressure default model", expect_preempt=True,
            n=8, max_len=400, top_k=0, max_tokens=48, temperature=1.0)))
    for name, fn in cases:
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # a case that crashes is a failure, the others still run
            check(False, f"{name}: {type(e).__name__}: {e}")
        print(f"     ({name}: {time.time() - t0:.1f} s)", flush=True)
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
