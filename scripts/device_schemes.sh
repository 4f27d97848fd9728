#!/usr/bin/env bash
# Fusion schemes on the GPU machine (docs/schemes.md), everything written under $OUT (or ./out):
#   1. build libstof_ort (skipped when $BUILD has one and the first argument is not "build"),
#   2. the scheme tests (tests/gpu/test_scheme_tune.py and the CPU ones),
#   3. BERT-base fp16 at B=8, S=512: rewrite with the fixed rules, `stof tune --json` (attention tactics and the
#      chains' schemes: tune_schemes.json), rewrite with the measured schemes, `stof bench` of both models.
#
#   OUT=out bash scripts/device_schemes.sh [build]
#
# Needs onnxruntime-gpu importable (on the device: PYTHONPATH=/tmp/site). Knobs: ARCH (default 90a), BUILD (build
# dir, default /tmp/stof-build), WORK (models, default /tmp/stof-schemes), B, S (default 8, 512).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/stof-schemes}
BUILD=${BUILD:-/tmp/stof-build}
ARCH=${ARCH:-90a}
B=${B:-8}
S=${S:-512}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export STOF_ORT_LIB=$BUILD/plugins_cu/ort/libstof_ort.so
export STOF_KERNELS_LIB=$BUILD/plugins_cu/libstof_kernels.so
export STOF_HOST_LIB=$BUILD/plugins_cu/libstof_host.so
stof() { python3 -m stof_trt.cli "$@"; }
rc=0

if [ "${1:-}" = build ] || [ ! -f "$STOF_ORT_LIB" ]; then
  echo "== build ($BUILD, sm_$ARCH)"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >"$OUT/cmake.log" 2>&1 \
    && cmake --build "$BUILD" -j"$(nproc)" >>"$OUT/cmake.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/cmake.log"; exit 1; }
fi
grep -E "cuBLASLt GEMM epilogue" "$OUT/cmake.log" 2>/dev/null | head -1

echo "== tests"
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_scheme_tune.py tests/test_schemes.py 2>&1 \
  | tee "$OUT/schemes_test.log" | tail -15 || rc=1

echo "== BERT-base fp16, B=$B S=$S"
SHAPES="input_ids=${B}x${S},attention_mask=${B}x${S}"
if [ ! -f "$WORK/bert.onnx" ]; then
  python3 -c "
from stof_trt.export import export_bert
export_bert('$WORK/bert.onnx', layers=12, hidden=768, heads=12, intermediate=3072, seq_len=128, max_positions=512,
            vocab_size=30522, half=True)" || exit 1
fi
stof rewrite "$WORK/bert.onnx" -o "$WORK/bert.stof.onnx" --max-seq-len "$S" --json >"$OUT/rewrite_fixed.json" || exit 1
stof tune "$WORK/bert.stof.onnx" --shapes "$SHAPES" -o "$OUT/schemes_cache.json" --json --no-progress \
  >"$OUT/tune_schemes.json" || { rc=1; cat "$OUT/tune_schemes.json"; }
stof rewrite "$WORK/bert.onnx" -o "$WORK/bert.tuned.onnx" --max-seq-len "$S" --schemes "$OUT/schemes_cache.json" \
  --json >"$OUT/rewrite_tuned.json" || rc=1
for v in stof tuned; do
  stof bench "$WORK/bert.onnx" "$WORK/bert.$v.onnx" --shapes "$SHAPES" --tactic-cache "$OUT/schemes_cache.json" \
    --iters 100 --json >"$OUT/bench_$v.json" || rc=1
done
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
t = json.load(open(f"{out}/tune_schemes.json"))["schemes"]
print(f"{'block':>5} {'role':8} {'scheme':20} {'algo':>4} {'ms':>8} {'fixed ms':>8} {'gain':>6} {'model first':20} {'ratio':>6}")
for r in t["blocks"]:
    print(f"{r['block']:>5} {r['role']:8} {r['scheme']:20} {r['algo']:>4} {r['time_ms']:8.4f} {r['fixed_rule_ms']:8.4f} "
          f"{r['gain']:6.3f} {r['model_first']:20} {r['ratio']:6.3f}")
print(f"chains per run: fixed rules {t['chain_ms_fixed_rules']:.3f} ms, measured {t['chain_ms_measured']:.3f} ms; "
      f"model's first choice within 5%: {100 * t['model_within_5pct']:.0f}% of chains")
print("rewrite notes (tuned):", json.load(open(f"{out}/rewrite_tuned.json")).get("notes"))
for v in ("stof", "tuned"):
    print(v, json.dumps(json.load(open(f"{out}/bench_{v}.json")))[:600])
EOF
exit $rc
