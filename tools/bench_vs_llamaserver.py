#!/usr/bin/env python3
"""bench_vs_llamaserver.py: a Tandem cluster against llama.cpp's llama-server on one machine,
serving the same GGUF file to the same load (issue 17, BENCHMARKS.md "Serving against
llama-server").

Each round starts one server, warms it up, measures, stops it, then does the same for the
other (the order alternates between rounds, so drift and neighbours hit both alike):

  Tandem:       tandem up CONFIG               (default deploy/local.yaml, as scripts/run.sh)
  llama-server: llama-server -m MODEL -t T -tb T -np CLIENTS -c CLIENTS x (P + M + 64)
                --host 127.0.0.1 --port LLAMA_PORT   (continuous batching and its prompt
                cache on, as they are by default)

The load is `tandem bench` (tools/cmd_loadgen.c) against /v1/completions of either server:
CLIENTS concurrent streaming clients, REQUESTS prompts of P random token ids, M output
tokens each (greedy, --ignore-eos, so both servers generate the same number of tokens):
  warm-up   CLIENTS requests of another seed (first-request costs, not measured)
  fresh     prompt seed 100 x round + 1: prompts neither server has seen
  repeated  the same seed again: the prompts of `fresh` once more (what a prefix cache
            serves: Tandem's radix cache, llama-server's per-slot prompt cache)
Reported per run: output tokens/s, TTFT p50/p99, ITL p99 and TPOT p50 (ms); per round and
over the rounds (medians) the Tandem / llama-server ratios. The 1-minute load average is
logged before each run: other jobs on the machine show there.

llama.cpp is built from source outside this repository (never committed), e.g. from the
sdist of llama-cpp-python (BENCHMARKS.md gives the build flags used):
  cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON ... && \\
  cmake --build build --target llama-server

usage: tools/bench_vs_llamaserver.py --llama-bin DIR [--build build] [--config deploy/local.yaml]
        [--model GGUF] [--clients 16] [--requests 48] [--prompt-tokens 256] [--max-tokens 64]
        [--rounds 2] [--threads 2] [--llama-port 8090] [--json-out FILE] [--no-llama]
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="build")
ap.add_argument("--llama-bin", help="directory with llama-server (required without --no-llama)")
ap.add_argument("--config", default="deploy/local.yaml")
ap.add_argument("--model", help="GGUF for llama-server (default: the config's model)")
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--requests", type=int, default=48)
ap.add_argument("--prompt-tokens", type=int, default=256)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--threads", type=int, default=2, help="llama-server's -t and -tb")
ap.add_argument("--llama-port", type=int, default=8090)
ap.add_argument("--startup-s", type=int, default=300)
ap.add_argument("--json-out")
ap.add_argument("--no-llama", action="store_true",
                help="Tandem alone (configurations against each other, one run each)")
args = ap.parse_args()
TANDEM = os.path.join(args.build, "bin", "tandem")
LOG_DIR = os.path.expanduser("~/.cache/tandem/bench-vs-llamaserver")


def config_value(key):
    """A top-level scalar (model) or the router's listen address from the YAML (the keys this
    script needs; the cluster itself reads the file with libyaml)."""
    with open(args.config) as f:
        text = f.read()
    if key == "model":
        m = re.search(r"^model:\s*(\S+)", text, re.M)
        return os.path.expanduser(m.group(1)) if m else None
    m = re.search(r"^router:\s*\n(?:[ \t]+.*\n)*?[ \t]+listen:\s*(\S+)", text, re.M)
    return m.group(1) if m else "127.0.0.1:8000"


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 (not up yet: refused, 503 loading, reset)
        return False


def start(side, log):
    if side == "tandem":
        listen = config_value("listen")
        cmd = [TANDEM, "up", args.config]
    else:
        listen = f"127.0.0.1:{args.llama_port}"
        ctx = args.clients * (args.prompt_tokens + args.max_tokens + 64)
        cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", MODEL, "-t", str(args.threads),
               "-tb", str(args.threads), "-np", str(args.clients), "-c", str(ctx),
               "--host", "127.0.0.1", "--port", str(args.llama_port)]
    url = f"http://{listen}"
    if healthy(url):
        sys.exit(f"something already answers on {url}: stop it first")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    end = time.time() + args.startup_s
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"{side} exited with {proc.returncode} while starting (log {log.name})")
        if healthy(url):
            return proc, url
        time.sleep(1)
    stop(proc)
    sys.exit(f"{side} did not answer /health within {args.startup_s} s (log {log.name})")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(url, seed, requests):
    cmd = [TANDEM, "bench", "--url", url, "--concurrency", str(args.clients), "--requests",
           str(requests), "--prompt-tokens", str(args.prompt_tokens), "--max-tokens",
           str(args.max_tokens), "--stream", "--json", "--ignore-eos", "--prompt-seed", str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        s = json.loads(r.stdout)
    except ValueError:
        sys.exit(f"tandem bench against {url} failed ({r.returncode}): {r.stderr[-1500:]}")
    if r.returncode != 0 or s["errors"]:
        sys.exit(f"tandem bench against {url}: {s['errors']} errors: {r.stderr[-1500:]}")
    return s


KEYS = [("tok/s", "output_tokens_per_s"), ("ttft50", "ttft_ms_p50"), ("ttft99", "ttft_ms_p99"),
        ("itl99", "itl_ms_p99"), ("tpot50", "tpot_ms_p50")]


def line(s):
    return "  ".join(f"{k} {s[j]:8.1f}" for k, j in KEYS)


if not args.no_llama and not args.llama_bin:
    sys.exit("--llama-bin is required (or --no-llama)")
MODEL = args.model or config_value("model")
if not MODEL or not os.path.exists(MODEL):
    sys.exit(f"no model file: {MODEL} (--model, or the config's model)")
os.makedirs(LOG_DIR, exist_ok=True)
print(f"model {MODEL}; {args.clients} clients, {args.requests} requests of {args.prompt_tokens} "
      f"prompt + {args.max_tokens} output tokens (greedy, ignore_eos); Tandem {args.config}; "
      f"llama-server -t {args.threads} -np {args.clients}", flush=True)
res = {"tandem": [], "llama": []}
for rnd in range(args.rounds):
    order = ["tandem", "llama"] if rnd % 2 == 0 else ["llama", "tandem"]
    if args.no_llama:
        order = ["tandem"]
    seed = 100 * rnd + 1
    for side in order:
        with open(os.path.join(LOG_DIR, f"{side}-round{rnd + 1}.log"), "w") as log:
            proc, url = start(side, log)
            try:
                bench(url, 100 * rnd + 50, args.clients)  # warm-up, another seed
                out = {"round": rnd + 1}
                for kind in ("fresh", "repeated"):
                    out[kind + "_load"] = load1()
                    out[kind] = bench(url, seed, args.requests)
                    print(f"round {rnd + 1} {side:6s} {kind:8s} load {out[kind + '_load']:.2f}  "
                          f"{line(out[kind])}", flush=True)
            finally:
                stop(proc)
        res[side].append(out)
    for kind in ("fresh", "repeated") if not args.no_llama else ():
        t, l = res["tandem"][-1][kind], res["llama"][-1][kind]
        print(f"round {rnd + 1} {kind:8s} tandem/llama-server: output "
              f"{t['output_tokens_per_s'] / l['output_tokens_per_s']:.2f}x, TTFT p50 "
              f"{t['ttft_ms_p50'] / l['ttft_ms_p50']:.2f}x, ITL p99 "
              f"{t['itl_ms_p99']:.0f} vs {l['itl_ms_p99']:.0f} ms", flush=True)

print(f"== medians over {args.rounds} round(s)")
for kind in ("fresh", "repeated") if not args.no_llama else ():
    med = {side: {j: statistics.median(r[kind][j] for r in res[side]) for _, j in KEYS}
           for side in res}
    t, l = med["tandem"], med["llama"]
    print(f"  {kind:8s} tandem       {line(t)}\n  {kind:8s} llama-server {line(l)}\n"
          f"  {kind:8s} output {t['output_tokens_per_s'] / l['output_tokens_per_s']:.2f}x, "
          f"TTFT p50 {t['ttft_ms_p50'] / l['ttft_ms_p50']:.2f}x (lower is better), ITL p99 "
          f"{t['itl_ms_p99']:.0f} vs {l['itl_ms_p99']:.0f} ms")
if args.json_out:
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "model": MODEL, "runs": res}, f, indent=1)
