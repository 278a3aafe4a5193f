#!/usr/bin/env python3
"""bench_vs_llamacpp.py: Tandem's engine against llama.cpp on the same GGUF files (BENCHMARKS.md).

For each model and thread count, `--reps` rounds of A B (Tandem, then llama.cpp), so drift and
neighbours hit both alike; medians per side, and the Tandem / llama.cpp ratio of the medians.

  Tandem:    tandem bench-engine --model F --threads T --reps 1 --json
             pp512 (one forward of 512 tokens), tg128 (128 steps at batch 1 from an empty
             context), b8 (128 steps of 8 sequences from an empty context: 1024 tokens / time);
             also this run's memory read bandwidth and the weight bytes read per decode step.
  llama.cpp: llama-bench -m F -t T -p 512 -n 128 -r 1 -o json          (pp512, tg128)
             llama-batched-bench -m F -t T -c 2048 -npp 1 -ntg 128 -npl 8 --output-format jsonl
             (S_TG: 128 steps of 8 sequences after a 1-token prompt each: 1024 tokens / time)
Rooflines from the Tandem runs (medians; same file, same threads), for both sides: decode
read bandwidth / weight bytes per step (x 8 for b8: one weight read serves 8 tokens),
prefill sgemm rate / (2 x parameters).

Other jobs share the machine: `uptime`'s 1-minute load is logged before each round; above
--max-load before a set's first round, the set waits --wait seconds once, then runs anyway
(the loads are reported).

With --acts f32,q8 each round runs Tandem once per activation mode (bench-engine --act; q8 is
the 8-bit activation mode of README.md), then llama.cpp, and prints a ratio per mode.

usage: tools/bench_vs_llamacpp.py --llama-bin DIR [--build build] [--models F,F] [--threads 1,2]
                                  [--reps 3] [--acts f32,q8]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="build")
ap.add_argument("--llama-bin", required=True, help="directory with llama-bench, llama-batched-bench")
ap.add_argument("--models", required=True, help="comma-separated GGUF paths")
ap.add_argument("--threads", default="1,2")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--max-load", type=float, default=1.5)
ap.add_argument("--wait", type=int, default=180)
ap.add_argument("--acts", default="f32",
                help="Tandem's CPU activation modes per round, e.g. f32,q8 (bench-engine --act)")
args = ap.parse_args()
TANDEM = os.path.join(args.build, "bin", "tandem")


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def tandem(model, t, act):
    j = json.loads(run([TANDEM, "bench-engine", "--model", model, "--threads", str(t),
                        "--reps", "1", "--act", act, "--json"]).strip().splitlines()[-1])
    return {"pp512": j["prefill_tps"], "tg128": j["decode_tps"], "b8": j["decode_b8_tps"],
            "mem": j["mem_gbps"], "gemm": j["gemm_gflops"], "wbytes": j["weight_bytes"],
            "params": j["params"]}


def llama(model, t):
    out = json.loads(run([os.path.join(args.llama_bin, "llama-bench"), "-m", model, "-t", str(t),
                          "-p", "512", "-n", "128", "-r", "1", "-o", "json"]))
    res = {}
    for e in out:
        key = "pp512" if e["n_prompt"] == 512 and e["n_gen"] == 0 else "tg128"
        res[key] = e["avg_ts"]
        res["fa"] = e.get("flash_attn")
    lines = run([os.path.join(args.llama_bin, "llama-batched-bench"), "-m", model, "-t", str(t),
                 "-tb", str(t), "-c", "2048", "-npp", "1", "-ntg", "128", "-npl", "8",
                 "--output-format", "jsonl"])
    rows = [json.loads(l) for l in lines.splitlines() if l.startswith("{")]
    res["b8"] = rows[-1]["speed_tg"]
    return res


def med(rs, k):
    return statistics.median(r[k] for r in rs)


ACTS = args.acts.split(",")
for model in args.models.split(","):
    for t in (int(x) for x in args.threads.split(",")):
        tr, lr, loads = {a: [] for a in ACTS}, [], []
        for rep in range(args.reps):
            l = load1()
            if l > args.max_load and rep == 0:
                print(f"  load {l:.2f} > {args.max_load}: waiting {args.wait} s", flush=True)
                time.sleep(args.wait)
                l = load1()
            loads.append(l)
            for a in (ACTS if rep % 2 == 0 else ACTS[::-1]):
                tr[a].append(tandem(model, t, a))
            lr.append(llama(model, t))
            line = f"{os.path.basename(model)} t{t} rep {rep + 1} load {l:.2f}:"
            for a in ACTS:
                x = tr[a][-1]
                line += (f" tandem {a} {x['pp512']:.1f} / {x['tg128']:.2f} / {x['b8']:.2f} "
                         f"(mem {x['mem']:.1f} GB/s, sgemm {x['gemm']:.0f} GFLOP/s);")
            print(line + f" llama.cpp {lr[-1]['pp512']:.1f} / {lr[-1]['tg128']:.2f} / "
                  f"{lr[-1]['b8']:.2f}", flush=True)
        every = [x for a in ACTS for x in tr[a]]
        wb, mem = every[0]["wbytes"], med(every, "mem")
        roof_tg = mem * 1e9 / wb
        roof_pp = med(every, "gemm") * 1e9 / (2 * every[0]["params"])
        print(f"== {os.path.basename(model)} threads {t}: loads {', '.join(f'{x:.2f}' for x in loads)}; "
              f"weights/step {wb / 1e6:.1f} MB, mem {mem:.1f} GB/s -> decode roofline "
              f"{roof_tg:.2f} tok/s; sgemm {med(every, 'gemm'):.0f} GFLOP/s -> prefill roofline "
              f"{roof_pp:.1f} tok/s; llama.cpp flash_attn {lr[0]['fa']}")
        for a in ACTS:
            for k, roof in (("pp512", roof_pp), ("tg128", roof_tg), ("b8", 8 * roof_tg)):
                x, y = med(tr[a], k), med(lr, k)
                print(f"   {k:6s} tandem {a:3s} {x:8.2f} ({x / roof:.2f} of roofline)  llama.cpp "
                      f"{y:8.2f} ({y / roof:.2f})  tandem/llama.cpp {x / y:.2f}   "
                      f"[tandem {', '.join(f'{r[k]:.2f}' for r in tr[a])}; "
                      f"llama.cpp {', '.join(f'{r[k]:.2f}' for r in lr)}; per-round ratios "
                      f"{', '.join(f'{u[k] / v[k]:.2f}' for u, v in zip(tr[a], lr))}]", flush=True)
