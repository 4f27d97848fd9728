#!/usr/bin/env bash
# Build, test and benchmark libstof_ort on the GPU machine, writing everything under $OUT (or ./out).
#
#   bash scripts/device_ort.sh [STAGE ...]        stages: env build test bench  (default: all; the bench tunes STOF
#                                                 at first use into $OUT/e2e/tactic_cache.json)
#
# Needs onnxruntime-gpu importable (on the device: /work/shared/device/stage-wheels.sh, then PYTHONPATH=/tmp/site).
# Environment knobs: ARCH (CUDA arch, default 90a: the wgmma tactics need it), BUILD (build dir, default /tmp/stof-build),
#   SKELETONS (scripts/bench_e2e.py --make-skeletons output, default .e2e-skel), BENCH_ARGS (extra arguments for
#   scripts/bench_e2e.py, e.g. --models bert-base --time-limit 500).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
ARCH=${ARCH:-90a}
BUILD=${BUILD:-/tmp/stof-build}
export PYTHONUNBUFFERED=1
# the Python stages import stof_trt from this checkout, which the GPU machine does not pip-install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build test bench)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
rc=0
export STOF_ORT_LIB=$BUILD/plugins_cu/ort/libstof_ort.so
export STOF_KERNELS_LIB=$BUILD/plugins_cu/libstof_kernels.so
export STOF_HOST_LIB=$BUILD/plugins_cu/libstof_host.so

if has env; then
  echo "== env"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  python3 -c "import onnxruntime as o, onnx, numpy, torch; print('onnxruntime', o.__version__, o.get_available_providers()); print('onnx', onnx.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -1
fi

if has build; then
  echo "== build ($BUILD, sm_$ARCH)"
  t0=$(date +%s)
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >"$OUT/cmake.log" 2>&1 \
    && cmake --build "$BUILD" -j"$(nproc)" >>"$OUT/cmake.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/cmake.log"; exit 1; }
  grep -E "stof_epilogue|cuBLASLt" "$OUT/cmake.log" | head -3
  echo "built in $(( $(date +%s) - t0 )) s: $(ls "$BUILD"/plugins_cu/ort/*.so "$BUILD"/plugins_cu/*.so | tr '\n' ' ')"
fi

if has test; then
  echo "== test"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ort_plugin.py tests/gpu/test_ort_models.py \
    tests/gpu/test_ort_any_length.py tests/gpu/test_ort_ops_any_length.py tests/gpu/test_ort_ops_cuda.py \
    tests/gpu/test_ort_remove_padding.py tests/gpu/test_ort_index_nodes.py tests/gpu/test_ort_varlen.py \
    tests/test_tactic_cache.py tests/test_mask_native.py 2>&1 | tee "$OUT/test.log" | tail -40 || rc=1
fi

if has bench; then
  echo "== bench"
  python3 scripts/bench_e2e.py --skeletons "${SKELETONS:-.e2e-skel}" --out "$OUT/e2e" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | tail -80 || rc=1
fi
exit $rc
