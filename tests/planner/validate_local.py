#!/usr/bin/env python3
"""validate_local.py BUILD MODEL [--prompt L ...]: the planner against this machine, measured in
the same run (BENCHMARKS.md, "Planner"): `tandem calibrate` writes a profile, then each
measured figure is taken right after with the engine's own tools and set beside the planner's
prediction from that profile:
  prefill pp 1, fixed 512-token chunks, prompt L: `tandem chunk-plan --pp 1` runs the plan
      through the whole model (sum of the chunks' times) | `tandem plan --prefill 1x1x1` TTFT
  prefill of 512 tokens in one forward: `bench-engine` pp512 | plan, prompt 512, chunk 512
  decode batch 1 and batch 8, 32 tokens: `bench-engine` tg32, b8 | the decode step model
Not a ctest (minutes on a quiet machine); exit 1 when a ratio leaves [1/BOUND, BOUND]."""
import json, re, subprocess, sys, tempfile, os

BOUND = 1.5


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit("failed: %s\n%s" % (" ".join(cmd), p.stderr[-2000:]))
    return p.stdout


def predict(tandem, model, hw, extra):
    out = run([tandem, "plan", "--model", model, "--hw", hw, "--requests", "1", "--json"] + extra)
    return json.loads(out)["configs"][0]


def main():
    build, model = sys.argv[1], sys.argv[2]
    prompts = [int(x) for x in sys.argv[3:]] or [1024, 2048]
    tandem = os.path.join(build, "bin", "tandem")
    hw = os.path.join(tempfile.mkdtemp(), "this.yaml")
    print(run([tandem, "calibrate", "--model", model, "--out", hw, "--threads", "1",
               "--chunk", "1024", "--budget-ms", "60000"]), end="")
    rows = []
    for L in prompts:
        out = run([tandem, "chunk-plan", "--model", model, "--pp", "1", "--chunk", "512",
                   "--prompt-tokens", str(L), "--threads", "1", "--budget-ms", "3000",
                   "--lengths", "6", "--profile-reps", "1", "--smooth", "0"])
        totals = re.findall(r"measured : .* total ([0-9.]+) ms", out)
        pred = predict(tandem, model, hw, ["--prefill", "1x1x1", "--decode", "1x1", "--prompt",
                                           str(L), "--output", "2", "--chunk", "512",
                                           "--chunk-max", "512", "--smooth", "0"])
        rows.append(("prefill pp1 fixed 512, %d tokens (ms)" % L, float(totals[0]),
                     pred["ttft_ms"]["p50"]))
    b = json.loads(run([tandem, "bench-engine", "--model", model, "--threads", "1", "--reps", "1",
                        "--gen", "32", "--batch", "8", "--json"]))
    p512 = predict(tandem, model, hw, ["--prefill", "1x1x1", "--decode", "1x1", "--prompt", "512",
                                       "--output", "2", "--chunk", "512", "--chunk-max", "512",
                                       "--smooth", "0"])
    rows.append(("prefill 512 tokens, one forward (ms)", 512e3 / b["prefill_tps"],
                 p512["ttft_ms"]["p50"]))
    for batch, key in ((1, "decode_tps"), (8, "decode_b8_tps")):
        # one prefill instance per request: all reach decode together, as bench-engine starts them
        d = predict(tandem, model, hw, ["--prefill", "%dx1x1" % batch, "--decode", "1x1", "--prompt", "1",
                                        "--output", "33", "--requests", str(batch), "--rate", "0"])
        rows.append(("decode batch %d step, 32 tokens (ms)" % batch, 1e3 * batch / b[key],
                     d["tpot_ms"]["p50"]))
    print("%-44s %12s %12s %8s" % ("figure", "measured", "predicted", "ratio"))
    bad = 0
    for what, meas, pred in rows:
        r = pred / meas
        bad += not (1 / BOUND <= r <= BOUND)
        print("%-44s %12.1f %12.1f %8.3f" % (what, meas, pred, r))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
