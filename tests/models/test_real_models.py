#!/usr/bin/env python3
"""test_real_models.py: a real model file (the Qwen2.5-Coder 0.5B Q4_K_M of scripts/fetch_model.py)
served through `tandem up` in several cluster shapes gives the same greedy answers in each.

Each shape is one cluster under `tandem up -d` (router with the chat template from the model
file; 1 thread per prefill stage, 2 threads per decode rank at tp 1 and 1 at tp 2: the test
runs alone, RUN_SERIAL, on CI's 2 cores), started, asked the fixed prompt set of PROMPTS one
request at a time through the HTTP API, and taken down (nothing left behind, no sanitizer
report):

  colocated     decode d0 tp 1 that prefills its own prompts
  pd            prefill p0 pp 1 -> decode d0 tp 1
  pd_pp2        prefill p0 pp 2 -> decode d0 tp 1
  colocated_tp2 decode d0 tp 2 (colocated)
  pd_tp2        prefill p0 pp 1 -> decode d0 tp 2 (the KV heads sliced between the ranks)

The first shape of --shapes is the reference: every other shape must give, prompt by prompt,
the same text, finish_reason and usage (prompt and completion tokens). Checked in every shape
too: the chat answer to "What is the capital of France?" contains "Paris" (not for --base: a
base model, such as the Gemma 3 270M file, has no chat tuning and no chat template of its
own, --chat-template names the family to render with). The prompts are
greedy (temperature 0) with max_tokens 32: chat and completions, each once plain and once
streamed. Requests are sent one at a time, so no answer depends on what else is batched with
it. Printed per shape: wall seconds and the CPU seconds of its processes (from /proc, read
before `tandem down`), which do not depend on what else the machine runs.

usage: test_real_models.py --tandem BIN --decode BIN --prefill BIN --router BIN --model GGUF
                           [--shapes colocated,pd,pd_pp2] [--chat-template F] [--base]
                           [--asan] [--keep]
Exit status 0 when every check passed, 1 otherwise.
"""
import argparse
import http.client
import json
import os
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import FAILS, check, context, summary  # noqa: E402
from tdtest.cluster import UpCluster  # noqa: E402
from tdtest.ports import free_port  # noqa: E402

MAX_TOKENS = 32
PARIS = "capital"  # the name of the prompt whose answer must contain "Paris"

# (name, path, body): greedy, max_tokens 32 (request()); "stream" ones are read as SSE. Four
# prompts, each endpoint once plain and once streamed: the test must stay within a few minutes
# of a sanitizer build on 2 cores (tests/models.cmake gives the measured time).
PROMPTS = [
    ("capital", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    ("code", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "You are a concise assistant."},
                   {"role": "user", "content": "Write a Python function that reverses a string."}],
      "stream": True}),
    ("count", "/v1/completions", {"prompt": "1, 2, 3, 4, 5,"}),
    ("story", "/v1/completions",
     {"prompt": "Once upon a time, in a small village by the sea, there lived", "stream": True}),
]
SHAPES = {
    # name: (prefill pp or 0 for none, decode tp)
    "colocated": (0, 1),
    "pd": (1, 1),
    "pd_pp2": (2, 1),
    "colocated_tp2": (0, 2),
    "pd_tp2": (1, 2),
}


def cluster_doc(model, run_dir, port, pf_port, dc_port, pp, tp, chat_template=""):
    """The YAML of one shape: 1 thread per prefill stage, 2 // tp per decode rank (2 cores),
    no chunking profile (fixed 64-token chunks), KV over shared memory; deadlines with room
    for a sanitizer build."""
    doc = {"model": model, "run_dir": run_dir,
           "router": {"listen": f"127.0.0.1:{port}", "chat_template": chat_template,
                      "heartbeat_ms": 100, "request_timeout_ms": 300000}}
    if pp:
        doc["prefill"] = [{"name": "p0", "pp": pp, "chunk_size": 64, "threads": 1,
                           "hosts": ["127.0.0.1"] * pp, "port": pf_port, "kv_tokens": 4096,
                           "profile_budget_ms": 0}]
    doc["decode"] = [{"name": "d0", "tp": tp, "threads": max(1, 2 // tp), "host": "127.0.0.1",
                      "port": dc_port, "kv_blocks": 256, "max_batch": 8}]
    doc["kvxfer"] = {"ucx_tls": "posix,cma,self", "timeout_ms": 300000}
    return doc


def request(port, path, body, timeout=300):
    """One request: {"status", "text", "finish", "usage", "error"}; SSE when body says
    stream (with include_usage), JSON otherwise."""
    body = dict(body, max_tokens=MAX_TOKENS, temperature=0)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    chat = path.endswith("/chat/completions")
    out = {"status": None, "text": "", "finish": None, "usage": None, "error": None}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200 or not body.get("stream"):
            data = json.loads(r.read() or b"{}")
            if r.status != 200:
                out["error"] = data.get("error")
                return out
            ch = data["choices"][0]
            out["text"] = ch["message"]["content"] if chat else ch["text"]
            out["finish"], out["usage"] = ch.get("finish_reason"), data.get("usage")
            return out
        done = False
        for line in r:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                out["error"] = ev["error"]
            if ev.get("usage"):
                out["usage"] = ev["usage"]
            for ch in ev.get("choices", []):
                out["text"] += (ch.get("delta", {}).get("content") or "") if chat \
                    else (ch.get("text") or "")
                out["finish"] = ch.get("finish_reason") or out["finish"]
        if not done:
            out["error"] = out["error"] or "stream ended without [DONE]"
        return out
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        c.close()


def cpu_seconds(rdir):
    """User + system CPU seconds of the live processes named by the pid files of rdir (the
    supervisor's up.pid aside, if any), from /proc/PID/stat; None when one cannot be read."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for n in sorted(os.listdir(rdir)):
        if not n.endswith(".pid") or n == "up.pid":
            continue
        try:
            with open(os.path.join(rdir, n)) as f:
                pid = int(f.read().split()[0])
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        total += (int(rest[11]) + int(rest[12])) / tick  # utime, stime (fields 14, 15)
    return total


def usage_pair(a):
    u = a.get("usage") or {}
    return u.get("prompt_tokens"), u.get("completion_tokens")


def run_shape(args, name, env_extra):
    """Starts shape name, sends PROMPTS, takes it down: ({prompt: answer} or None, seconds)."""
    pp, tp = SHAPES[name]
    t0 = time.time()
    cl = UpCluster(args.tandem, f"tandem-models-{name}-",
                   {"decode": args.decode, "prefill": args.prefill, "router": args.router},
                   exclude="test_real_models", env_extra=env_extra)
    port, pf_port, dc_port = free_port(1), free_port(1), free_port(1)
    cl.write_config("models.yaml", cluster_doc(args.model, os.path.join(cl.dir, "run"), port,
                                               pf_port, dc_port, pp, tp, args.chat_template))
    rdir = cl.run_dir("models")
    context(f"shape {name}: logs in {rdir}" if args.keep else f"shape {name}")
    answers = None
    try:
        r = cl.up(timeout=args.up_timeout)
        ok = r.returncode == 0
        said = " | ".join(r.stderr.strip().splitlines()[-4:])  # the error lines of `up`
        if not check(ok, f"{name}: tandem up -d: " + (f"ready in {time.time() - t0:.1f} s" if ok
                         else f"failed after {time.time() - t0:.1f} s: {said}")):
            return None, time.time() - t0
        answers = {}
        for pname, path, body in PROMPTS:
            t1 = time.time()
            a = request(port, path, body)
            answers[pname] = a
            check(a["status"] == 200 and not a["error"] and a["finish"] in ("stop", "length"),
                  f"{name}: {pname}: {time.time() - t1:.1f} s, status {a['status']}, finish "
                  f"{a['finish']}, tokens {usage_pair(a)}, error {a['error']}: {a['text']!r}")
        if not args.base:
            check("Paris" in answers[PARIS]["text"],
                  f"{name}: the answer to {PARIS!r} names Paris")
        cpu = cpu_seconds(rdir)
        print(f"{name}: {time.time() - t0:.1f} s since up, CPU seconds of its processes: "
              f"{cpu if cpu is None else round(cpu, 1)}", flush=True)
        r = cl.down()
        check(r.returncode == 0, f"{name}: tandem down ({r.stderr.strip()[-200:]})")
        time.sleep(0.3)
        left = cl.leftovers()
        check(not left, f"{name}: nothing left behind {left}")
        reports = [n for n, t in cl.logs_of(rdir).items()
                   if "ERROR: AddressSanitizer" in t or "runtime error:" in t
                   or "ERROR: LeakSanitizer" in t]
        check(not reports, f"{name}: no sanitizer report in the logs {reports}")
    finally:
        if FAILS or args.keep:
            for n, t in cl.logs_of(rdir, tail=4000).items():
                print(f"---- {name}: {n} (end)\n{t}")
        cl.cleanup(keep=args.keep, shm=(f"/dev/shm/tandem-d0-p{dc_port}",))
    return answers, time.time() - t0


def compare(ref_name, ref, name, got):
    """Every prompt of got equals ref's: text, finish_reason, prompt and completion tokens."""
    for pname, _, _ in PROMPTS:
        a, b = ref[pname], got[pname]
        same = (a["text"], a["finish"], usage_pair(a)) == (b["text"], b["finish"], usage_pair(b))
        check(same, f"{name} == {ref_name}: {pname}" +
              ("" if same else f": {b['text']!r} {usage_pair(b)} vs {a['text']!r} "
                               f"{usage_pair(a)}"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for b in ("tandem", "decode", "prefill", "router"):
        ap.add_argument(f"--{b}", required=True)
    ap.add_argument("--model", required=True, help="the GGUF file every shape serves")
    ap.add_argument("--shapes", default="colocated,pd,pd_pp2",
                    help=f"comma-separated, the first is the reference ({', '.join(SHAPES)})")
    ap.add_argument("--chat-template", default="",
                    help="router.chat_template, for files without one (gemma3 270M: gemma)")
    ap.add_argument("--base", action="store_true",
                    help="a base model: no check that the chat answer names Paris")
    ap.add_argument("--up-timeout", type=int, default=300, help="tandem up --timeout, s")
    ap.add_argument("--asan", action="store_true", help="the binaries are sanitizer builds")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs and print logs")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        ap.error(f"unknown shape(s) {unknown} (known: {', '.join(SHAPES)})")
    if not os.path.isfile(args.model):
        ap.error(f"model file {args.model} not found (scripts/setup.sh --models qwen0.5b)")
    env_extra = {}
    if args.asan:
        supp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "lsan.supp")
        env_extra["LSAN_OPTIONS"] = (os.environ.get("LSAN_OPTIONS", "") +
                                     f":suppressions={supp}").lstrip(":")
    print(f"models: {os.path.basename(args.model)}, shapes {shapes}", flush=True)
    t0 = time.time()
    results, times = {}, {}
    for s in shapes:
        results[s], times[s] = run_shape(args, s, env_extra)
    ref_name = shapes[0]
    ref = results[ref_name]
    for s in shapes[1:]:
        if ref is None or results[s] is None:
            check(False, f"{s} == {ref_name}: not compared (a shape did not serve)")
            continue
        compare(ref_name, ref, s, results[s])
    print("models: seconds per shape " + json.dumps({k: round(v, 1) for k, v in times.items()})
          + f", total {time.time() - t0:.1f}", flush=True)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
