#!/usr/bin/env python3
"""validate_live.py BUILD MODEL [--quick|--moe] [--bound B] [--port P] [--only NAME,...]: the planner
against live clusters on this machine, measured in the same run (issue 18 item 3;
BENCHMARKS.md "Planner"; docs/planner.md "Validation against live clusters").

1. `tandem calibrate` once (one thread a device, as every process below runs).
2. For each configuration: a YAML (router, prefill instance pp x 1 thread a stage, decode
   instance tp x 1 thread a rank; no prefill instance = colocated), `tandem up -d` on it
   (real processes over loopback), one warm-up request, then N requests one after the other
   (a single client: no queueing) through the router's streaming /v1/completions with token-id
   prompts of a fixed length (distinct per request, prefix caches off) and ignore_eos, so
   every request makes exactly OUT tokens; TTFT = first content chunk - send, TPOT = (last -
   first chunk) / (OUT - 1), both as the client sees them. `tandem down`.
3. `tandem plan --json` with the same shape, chunking, workload (`--sequential`: each request
   arrives when the last one finished) and the profile of step 1; the table prints measured /
   predicted / ratio for TTFT p50 and TPOT p50.
Fixed 512-token chunks everywhere (prefill chunk_size with smoothing 0, colocated step_tokens)
so that both sides chunk alike. Exit 1 when a ratio leaves [1/B, B] (default B 1.15).
--quick: three configurations (colocated tp 1, pp 2 + tp 1, pp 1 + tp 3), short prompts, few
requests (the ctest planner_live, with a generous bound). --hw F: use that profile instead of
calibrating; --only: a comma-separated subset of the configurations' names. --moe: for a
mixture-of-experts model, colocated tp 1, tp 2 with the experts split across the ranks,
tp 2 with ep (whole experts a rank: `tandem plan --ep`) and a data-parallel attention group of
2 members (`tandem plan --dp 2`), and the ep/split TPOT ratio measured and predicted.
The decode tp must divide the model's attention heads: the configurations use tp 1 and 3
(SmolLM2-135M has 9 heads; tp 2 needs another model)."""
import argparse, http.client, json, os, random, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tdtest.ports import free_port  # noqa: E402

FULL = [  # name, pp (0: colocated), decode tp, prompt, output, requests
    ("colocated tp1, 256", 0, 1, 256, 32, 4),
    ("disagg pp1+tp1, 256", 1, 1, 256, 32, 4),
    ("disagg pp1+tp3, 256", 1, 3, 256, 32, 4),
    ("disagg pp2+tp3, 256", 2, 3, 256, 32, 4),
    ("disagg pp2+tp1, 4096", 2, 1, 4096, 48, 2),
    ("colocated tp1, 4096", 0, 1, 4096, 48, 2),
]
QUICK = [
    ("colocated tp1, 128", 0, 1, 128, 12, 2),
    ("disagg pp2+tp1, 128", 2, 1, 128, 12, 2),
    ("disagg pp1+tp3, 128", 1, 3, 128, 12, 2),
]
# --moe: a mixture-of-experts model's experts split across the tp ranks against whole on them
# (decode[].ep; the 7th field); at batch 1 a token's k experts fall unevenly on 2 ranks
MOE = [
    ("colocated tp1, 256", 0, 1, 256, 32, 4),
    ("colocated tp2, 256", 0, 2, 256, 32, 4),
    ("colocated tp2 ep2, 256", 0, 2, 256, 32, 4, True),
    ("colocated dp2, 256", 0, 2, 256, 32, 4, "dp"),  # 2 member instances of tp 1
]
CHUNK = 512


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode:
        sys.exit("failed: %s\n%s%s" % (" ".join(cmd), p.stdout[-2000:], p.stderr[-3000:]))
    return p.stdout


def write_yaml(path, model, run_dir, pp, tp, max_prompt, ep=False, dp=False):
    y = ["model: %s" % model, "backend: cpu", "run_dir: %s" % run_dir, "router:",
         "  listen: 127.0.0.1:8000", "  max_prompt_tokens: %d" % (max_prompt + 64)]
    if pp:
        y += ["prefill:", "  - name: p0", "    pp: %d" % pp, "    chunk_size: %d" % CHUNK,
              "    dynamic_chunking: false", "    smooth_factor: 0", "    threads: 1",
              "    profile_budget_ms: 0", "    prefix_cache: false",
              "    kv_tokens: %d" % max(4096, 2 * (max_prompt + 64))]
    y += ["decode:", "  - name: d0", "    tp: %d" % (1 if dp else tp), "    threads: 1",
          "    kv_memory: 256MiB", "    max_batch: 64", "    step_tokens: %d" % CHUNK,
          "    prefix_cache: false"] + (["    ep: %d" % tp] if ep else []) + \
        (["    dp: %d" % tp] if dp else [])
    if pp:
        y += ["kvxfer:", "  ucx_tls: posix,cma,self", "  timeout_ms: 600000"]
    open(path, "w").write("\n".join(y) + "\n")


def one_request(port, prompt, out):
    """Streams one completion; returns (ttft_ms, tpot_ms)."""
    body = json.dumps({"prompt": prompt, "max_tokens": out, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit("request failed: HTTP %d %s" % (r.status, r.read()[:500]))
    times, buf, used = [], b"", None
    while True:
        data = r.read1(65536)
        if not data:
            break
        now = time.monotonic()
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            d = json.loads(line[5:])
            if d.get("usage"):
                used = d["usage"]["completion_tokens"]
            ch = d.get("choices") or []
            if ch and ch[0].get("text"):
                times.append(now)
    c.close()
    # a chunk may carry several tokens (text held back until it is whole UTF-8): TPOT over
    # the tokens the usage reports, as `tandem bench` computes it
    if used != out or len(times) < 2:
        sys.exit("request made %s tokens in %d chunks, expected %d" % (used, len(times), out))
    return 1e3 * (times[0] - t0), 1e3 * (times[-1] - times[0]) / (used - 1)


def ep_of(cfg):
    return len(cfg) > 6 and cfg[6] is True


def dp_of(cfg):
    """A data-parallel attention group of `tp` members (each an instance of tp 1)."""
    return len(cfg) > 6 and cfg[6] == "dp"


def measure(tandem, model, tmp, cfg, port):
    name, pp, tp, prompt, out, n = cfg[:6]
    yml = os.path.join(tmp, "c%d-%d%s.yaml" % (pp, tp, "-ep" if ep_of(cfg) else
                                                "-dp" if dp_of(cfg) else ""))
    write_yaml(yml, model, os.path.join(tmp, "run"), pp, tp, prompt, ep_of(cfg), dp_of(cfg))
    run([tandem, "up", "-d", yml, "--port", str(port), "--no-restart", "--timeout", "600"])
    try:
        rnd = random.Random(1)
        one_request(port, [rnd.randrange(100, 500) for _ in range(16)], 4)  # warm-up
        ttft, tpot = [], []
        for i in range(n):
            p = [rnd.randrange(100, 500) for _ in range(prompt)]
            a, b = one_request(port, p, out)
            ttft.append(a)
            tpot.append(b)
    finally:
        subprocess.run([tandem, "down", yml, "--port", str(port)], capture_output=True)
    return ttft, tpot


def median(v):
    v = sorted(v)
    k = len(v) // 2
    return v[k] if len(v) % 2 else 0.5 * (v[k - 1] + v[k])


def predict(tandem, model, hw, cfg):
    name, pp, tp, prompt, out, n = cfg[:6]
    dtp = 1 if dp_of(cfg) else tp
    shape = ["--colocated", "1x%d" % dtp, "--step-tokens", str(CHUNK)] if not pp else \
        ["--prefill", "1x%dx1" % pp, "--decode", "1x%d" % dtp, "--chunk", str(CHUNK),
         "--chunk-max", str(CHUNK), "--smooth", "0"]
    if dp_of(cfg):
        shape += ["--dp", str(tp)]
    o = run([tandem, "plan", "--model", model, "--hw", hw, "--requests", str(n), "--sequential",
             "--prompt", str(prompt), "--output", str(out), "--json"] + shape +
            (["--ep"] if ep_of(cfg) else []))
    c = json.loads(o)["configs"][0]
    return c["ttft_ms"]["p50"], c["tpot_ms"]["p50"]


def loadavg():
    return "%.2f %.2f %.2f" % os.getloadavg()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("model")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--moe", action="store_true",
                    help="MOE's configurations (a mixture-of-experts model: tp 2 with and "
                         "without ep)")
    ap.add_argument("--bound", type=float, default=1.15)
    ap.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--hw", default="", help="a profile to use instead of calibrating")
    a = ap.parse_args()
    tandem = os.path.join(a.build, "bin", "tandem")
    cfgs = MOE if a.moe else QUICK if a.quick else FULL
    if a.only:
        cfgs = [c for c in cfgs if c[0] in a.only.split(",")]
    tmp = tempfile.mkdtemp(prefix="tandem-live-")
    hw = a.hw or os.path.join(tmp, "this.yaml")
    t0 = time.time()
    print("# validate_live.py %s, %s, load average %s" % (
        " ".join(sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M"), loadavg()))
    if not a.hw:
        cal = ["--chunk", "512", "--budget-ms", "6000", "--long-ctx", "1024"] if a.quick else \
              ["--chunk", "1024", "--budget-ms", "30000"]
        cmd = [tandem, "calibrate", "--model", a.model, "--out", hw, "--threads", "1"] + cal
        for attempt in range(3):  # a loaded machine's profile may give no convex fit
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0 or "no convex fit" not in p.stderr:
                break
            print("# calibrate: no convex fit (a busy moment), again")
        if p.returncode:
            sys.exit("failed: %s\n%s" % (" ".join(cmd), p.stderr[-3000:]))
        out = p.stdout
        print("".join("# " + l.lstrip("# ") + "\n" for l in out.splitlines()
                      if "profile written" not in l), end="")
    rows = []
    for cfg in cfgs:
        ttft, tpot = measure(tandem, a.model, tmp, cfg, a.port or free_port(6))
        pt, pp = predict(tandem, a.model, hw, cfg)
        rows.append((cfg, median(ttft), pt, median(tpot), pp))
        print("# %s: TTFT %s ms, TPOT %s ms (load %s)" % (
            cfg[0], " ".join("%.0f" % x for x in ttft), " ".join("%.1f" % x for x in tpot),
            loadavg()), flush=True)
    print("| configuration | prompt/out x N | TTFT p50 measured | predicted | ratio "
          "| TPOT p50 measured | predicted | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    if a.moe:  # what ep does, measured and predicted
        tp2 = {ep_of(c): (mp, pp) for c, mt, pt, mp, pp in rows if c[2] == 2}
        if len(tp2) == 2:
            print("# ep 2 against experts split, TPOT: measured %.3fx, predicted %.3fx" % (
                tp2[True][0] / tp2[False][0], tp2[True][1] / tp2[False][1]))
    for cfg, mt, pt, mp, pp in rows:
        rt, rp = pt / mt, pp / mp
        bad += sum(not (1 / a.bound <= r <= a.bound) for r in (rt, rp))
        print("| %s | %d/%d x %d | %.0f ms | %.0f ms | %.3f | %.2f ms | %.2f ms | %.3f |" % (
            cfg[0], cfg[3], cfg[4], cfg[5], mt, pt, rt, mp, pp, rp))
    print("# %d of %d ratios outside [%.3f, %.3f]; %.0f s, load average %s at the end" % (
        bad, 2 * len(rows), 1 / a.bound, a.bound, time.time() - t0, loadavg()))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
