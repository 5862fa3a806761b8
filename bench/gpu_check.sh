#!/usr/bin/env bash
# The paper's full Astec configuration trained with --device cuda, checked against the CPU.
#
# Trains Astec on debian-related with the paper's settings (20 surrogate epochs, L_hat = 2^16
# meta-labels (clamped to L where L is smaller: every label its own cluster on debian-related),
# a shortlist of 500, D = 300) once on the GPU and once on the CPU (or takes a CPU run's
# `bench peers --json-out` file), exports the GPU model, and checks:
#   - the exported predictor gives the GPU-trained torch model's top-5 on >= 99% of test titles
#     (`astec bench predict --systems predictor,torch`);
#   - the GPU model's test P@1 and PSP@5 are within TOL points of the CPU model's.
# Prints the two runs' seconds and metrics side by side; exits 1 when a check fails.
#
#   bench/gpu_check.sh [--data DIR] [--out DIR] [--cpu-json FILE] [--tol POINTS] [--dry-run]
#
# --dry-run: the same steps on the CPU (device cpu for the "GPU" run too) on the first 2,000
# training and 500 test titles and 2 surrogate epochs, to check the script end to end on a
# machine without CUDA (its figures mean nothing).
# PYTHON (default: .venv/bin/python, else python3) must have the project's dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=""
OUT="${TMPDIR:-/tmp}/astec-gpu-check"
CPU_JSON=""
TOL=1.0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --cpu-json) CPU_JSON="$2"; shift 2 ;;
    --tol) TOL="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
astec() { "$PYTHON" -m infra.cli "$@"; }

"$PYTHON" - <<'EOF' || { echo "gpu_check: $PYTHON lacks the project's dependencies" >&2; exit 2; }
import importlib, sys
missing = [m for m in ("torch", "numpy", "scipy", "numba", "hnswlib", "onnx", "onnxruntime",
                       "click", "psutil", "safetensors", "tqdm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)}")
EOF

DEVICE=cuda
if [ "$DRY" = 1 ]; then
  DEVICE=cpu
else
  "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA device (use --dry-run on a CPU machine)" >&2; exit 2; }
fi

if [ -z "$DATA" ]; then
  for d in ../shared/data/debian-related shared/data/debian-related /work/shared/data/debian-related; do
    if [ -f "$d/train.tsv" ]; then DATA="$d"; break; fi
  done
fi
[ -n "$DATA" ] && [ -f "$DATA/train.tsv" ] || { echo "gpu_check: no debian-related data (pass --data DIR)" >&2; exit 2; }
rm -rf "$OUT" && mkdir -p "$OUT"
TRAIN="$DATA/train.tsv"; TEST="$DATA/test.tsv"
if [ "$DRY" = 1 ]; then  # a slice: the steps, not the figures
  head -n 2000 "$DATA/train.tsv" >"$OUT/train.tsv"; head -n 500 "$DATA/test.tsv" >"$OUT/test.tsv"
  TRAIN="$OUT/train.tsv"; TEST="$OUT/test.tsv"
fi
# the paper's configuration; everything else the defaults
cat >"$OUT/paper.json" <<'EOF'
{"network": {"embedding_dim": 300},
 "surrogate": {"epochs": 20, "num_clusters": 65536},
 "shortlist": {"negatives": 500},
 "search": {"candidates": 500}}
EOF
if [ "$DRY" = 1 ]; then sed -i 's/"epochs": 20/"epochs": 2/' "$OUT/paper.json"; fi
"$PYTHON" -c "from engine.astec import AstecConfig; AstecConfig.load('$OUT/paper.json')"

run_peers() {  # device, name
  local t0=$SECONDS
  astec bench peers --train "$TRAIN" --test "$TEST" --labels "$DATA/labels.txt" --methods astec \
    --config "$OUT/paper.json" --device "$1" --threads 0 --save-models "$OUT/$2" \
    --json-out "$OUT/$2.json" >"$OUT/$2.table" 2>"$OUT/$2.log"
  echo "gpu_check: $2 run ($1) took $((SECONDS - t0)) s"
}
echo "gpu_check: data $DATA, device $DEVICE, python $PYTHON, out $OUT"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
run_peers "$DEVICE" gpu
if [ -z "$CPU_JSON" ]; then
  run_peers cpu cpu
  CPU_JSON="$OUT/cpu.json"
fi
# the slice's model searches exactly (few points): so does its export, for the same answers
EXPORT_ARGS=(); [ "$DRY" = 1 ] && EXPORT_ARGS=(--exact-max 1000000)
astec export --model "$OUT/gpu/astec" --out "$OUT/gpu-predictor" "${EXPORT_ARGS[@]}" \
  >"$OUT/export.log" 2>&1
astec bench predict --predictor "$OUT/gpu-predictor" --model "$OUT/gpu/astec" --input "$TEST" \
  --systems predictor,torch --n 2048 --n-latency 200 >"$OUT/predict.json" 2>"$OUT/predict.log"

"$PYTHON" - "$OUT/gpu.json" "$CPU_JSON" "$OUT/predict.json" "$TOL" "$DEVICE" <<'EOF'
import json, sys
gpu, cpu = (json.load(open(p))[0] for p in sys.argv[1:3])
pred = json.load(open(sys.argv[3]))
tol, device = float(sys.argv[4]), sys.argv[5]
for r in (gpu, cpu):
    if "error" in r:
        sys.exit(f"gpu_check: a run failed: {r['error']}")
keys = ("P@1", "P@5", "PSP@1", "PSP@5", "train_s", "train_cpu_s", "peak_rss_mb")
print("| run | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for name, r in ((f"{device}", gpu), ("cpu", cpu)):
    print(f"| {name} | " + " | ".join(str(r.get(k, "-")) for k in keys) + " |")
par = pred["parity_vs_torch"]
checks = {
    "export parity (top-5 set, batch path) >= 0.99": par["top5_same_set"] >= 0.99,
    "export parity (top-5 set, one title) >= 0.99": par["single_text_path"]["top5_same_set"] >= 0.99,
    f"|P@1 {device} - cpu| <= {tol}": abs(gpu["P@1"] - cpu["P@1"]) <= tol,
    f"|PSP@5 {device} - cpu| <= {tol}": abs(gpu["PSP@5"] - cpu["PSP@5"]) <= tol,
}
print(f"training {device} / cpu: {gpu['train_s'] / max(cpu['train_s'], 1e-9):.2f}x wall; "
      f"export parity {par['top5_same_set']} (one title {par['single_text_path']['top5_same_set']})")
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
EOF
