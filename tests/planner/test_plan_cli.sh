#!/bin/sh
# test_plan_cli.sh TANDEM SYNTH_MODEL HW_DIR PYTHON [MODE]: `tandem plan --reproduce --json`
# and `tandem calibrate` end to end (tests/planner.cmake). MODE: all (the default); paths
# (all but the measured prefill against its prediction: the sanitizer build, whose timings
# are the sanitizer's and whose load decides the ratio); predict (calibrate, then the
# measured prefill against its prediction only: the Release build).
set -eu
tandem=$1 model=$2 hw=$3 py=$4 mode=${5:-all}
case "$mode" in all | paths | predict) ;; *) echo "test_plan_cli.sh: bad mode '$mode'"; exit 2 ;; esac
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

if [ "$mode" != predict ]; then

# the reproduction: valid JSON, 8 rows, every figure positive and its ratio finite
"$tandem" plan --reproduce --hw "$hw/h20.yaml" --json > "$dir/repro.json"
"$py" - "$dir/repro.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"]
assert len(rows) == 8, rows
for r in rows:
    assert r["published"] > 0 and r["simulated"] > 0 and math.isfinite(r["ratio"]), r
print("reproduce: ok,", ", ".join("%.3f" % r["ratio"] for r in rows))
PY

# every shipped profile loads
for f in "$hw"/*.yaml; do
  "$tandem" plan --model llama3-8b --hw "$f" --prefill 1x1x1 --decode 1x1 --requests 4 \
    --prompt 512 --output 8 > /dev/null
done

# colocated, one client: valid JSON, no prefill instance; a prefill flag with it is an error
"$tandem" plan --model llama3-8b --hw "$hw/h100.yaml" --colocated 1x2 --step-tokens 256 \
  --sequential --requests 3 --prompt 1000 --output 8 --json > "$dir/coloc.json"
"$py" -c "import json,sys; c=json.load(open(sys.argv[1]))['configs'][0]; \
assert c['prefill']['instances'] == 0 and c['devices'] == 2 and c['ttft_ms']['p50'] > 0 \
and c['ttft_ms']['p50'] == c['ttft_ms']['p90'], c; print('colocated: ok')" "$dir/coloc.json"
if "$tandem" plan --model llama3-8b --hw "$hw/h100.yaml" --colocated 1x1 --smooth 0 \
     2> "$dir/err.txt"; then
  echo "--smooth with --colocated was accepted"; exit 1
fi
grep -q "a colocated decode instance takes --step-tokens" "$dir/err.txt"

# two-batch overlap: the shape's JSON carries tbo_min; at tp 1 it is refused
"$tandem" plan --model llama3-70b --hw "$hw/h100.yaml" --prefill 1x4x8 --decode 1x8 --tbo 2 \
  --requests 64 --rate 0 --prompt 1024 --output 32 --json > "$dir/tbo.json"
"$py" -c "import json,sys; c=json.load(open(sys.argv[1]))['configs'][0]; \
assert c['decode']['tbo_min'] == 2 and c['tpot_ms']['p50'] > 0, c; print('tbo: ok')" "$dir/tbo.json"
if "$tandem" plan --model llama3-8b --hw "$hw/h100.yaml" --colocated 1x1 --tbo 2 \
     2> "$dir/err.txt"; then
  echo "--tbo at tp 1 was accepted"; exit 1
fi
grep -q -- "--tbo needs a decode shape of tp >= 2" "$dir/err.txt"

# a bad profile is a clear error, exit 1
printf 'name: x\nhbm_gbps: fast\n' > "$dir/bad.yaml"
if "$tandem" plan --model llama3-8b --hw "$dir/bad.yaml" --prefill 1x1x1 --decode 1x1 \
     2> "$dir/err.txt"; then
  echo "a bad profile was accepted"; exit 1
fi
grep -q "bad.yaml:2:11: hbm_gbps: 'fast' is not a number" "$dir/err.txt" || {
  cat "$dir/err.txt"; exit 1; }

fi

# calibrate on the synthetic model writes a profile the planner loads (a second try when a
# loaded machine's profile gave no convex fit: that error is calibrate's, by design)
if ! "$tandem" calibrate --model "$model" --out "$dir/this.yaml" --chunk 512 --budget-ms 4000 \
     2> "$dir/cal.err"; then
  grep -q "no convex fit" "$dir/cal.err" || { cat "$dir/cal.err"; exit 1; }
  "$tandem" calibrate --model "$model" --out "$dir/this.yaml" --chunk 512 --budget-ms 4000
fi
grep -q "^matmul_type: f32" "$dir/this.yaml"
# the whole prefill chunk was measured at tp 2 (the synthetic llama's heads split by 2)
grep -qE "^prefill_speedup: \{tp2: [0-9.e+-]+" "$dir/this.yaml" || { head -40 "$dir/this.yaml"; exit 1; }
# the KV transfer figures were measured by kvx-bench (built beside tandem) and written
grep -q "^# KV transfer, measured (kvx-bench" "$dir/this.yaml" || { head -30 "$dir/this.yaml"; exit 1; }
grep -qE "^kv_transfer: \{gbps: [0-9.e+-]+, latency_us: [0-9.e+-]+\}" "$dir/this.yaml"
"$tandem" plan --model "$model" --hw "$dir/this.yaml" --prefill 1x1x1 --decode 1x1 \
  --requests 8 --prompt 64:128 --output 4:8 --json > "$dir/plan.json"
"$py" -c "import json,sys; c=json.load(open(sys.argv[1]))['configs'][0]; \
assert c['fits'] and c['ttft_ms']['p90'] > 0 and c['tpot_ms']['p90'] > 0, c; print('plan: ok', c)" \
  "$dir/plan.json"

[ "$mode" != paths ] || exit 0

# one measured configuration predicted within a generous bound (a loaded CI machine): pp 1
# prefill of 512 tokens in fixed 128-token chunks, run through the whole model by chunk-plan
# right after the calibration, against the plan from the calibrated profile
"$tandem" chunk-plan --model "$model" --pp 1 --chunk 128 --prompt-tokens 512 --threads 1 \
  --budget-ms 1000 --lengths 4 --profile-reps 1 --smooth 0 > "$dir/cp.txt"
"$tandem" plan --model "$model" --hw "$dir/this.yaml" --prefill 1x1x1 --decode 1x1 --requests 1 \
  --prompt 512 --output 2 --chunk 128 --chunk-max 128 --smooth 0 --json > "$dir/pred.json"
"$py" - "$dir/cp.txt" "$dir/pred.json" <<'PY'
import json, re, sys
meas = float(re.findall(r"measured : .* total ([0-9.]+) ms", open(sys.argv[1]).read())[0])
pred = json.load(open(sys.argv[2]))["configs"][0]["ttft_ms"]["p50"]
r = pred / meas
print("prefill 512 tokens: measured %.1f ms, predicted %.1f ms, ratio %.3f" % (meas, pred, r))
assert 0.5 <= r <= 2.0, r
PY
