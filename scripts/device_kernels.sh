#!/usr/bin/env bash
# Build, test, sanitize and benchmark the STOF attention kernels on the GPU machine; everything under $OUT.
#
#   STAGES=build,test,sanitize,bench BENCH_ARGS="--dims 64" bash scripts/device_kernels.sh
#
# SASS_BASELINE=<a library built from another tree> adds scripts/sass_diff.py's per-kernel SASS comparison of the
# new build against it to the build stage (a refactoring that must not change the generated code).
#
# Files written (at most 8, the device tool's limit): log, build.log (ptxas resource usage per kernel),
# correctness.jsonl (every case x tactic with its error), sanitize.log, attention.{json,md} (scripts/bench_attention.py).
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=${STAGES:-build,test,sanitize,bench}
export PYTHONUNBUFFERED=1
# the Python stages import stof_trt from this checkout, which the GPU machine does not pip-install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/log") 2>&1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
status=0
echo "== $(date -u +%FT%TZ) stages=$STAGES"
# Wheels the GPU image lacks, staged in a carried folder (e.g. nvidia-cudnn-frontend for the cuDNN band anchor of
# stof_trt.bench.anchors): STOF_EXTRA_WHEELS=.device-carry/cfe
# (this script's own stages see them; a command after it needs `export PYTHONPATH=/tmp/stof-extra` too)
if [[ -n "${STOF_EXTRA_WHEELS:-}" ]]; then
  if pip install -q --no-deps --target /tmp/stof-extra "$STOF_EXTRA_WHEELS"/*.whl > /tmp/stof-extra.log 2>&1; then
    echo "extra wheels installed into /tmp/stof-extra: $(cd "$STOF_EXTRA_WHEELS" && ls *.whl | tr '\n' ' ')"
  else
    echo "WARNING: extra wheels from $STOF_EXTRA_WHEELS not installed:"; tail -3 /tmp/stof-extra.log; status=1
  fi
  export PYTHONPATH=/tmp/stof-extra${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv

if has build; then
  t0=$SECONDS
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=${STOF_ARCHS:-90a} \
        -DSTOF_RESOURCE_USAGE=ON -DSTOF_BUILD_ADAPTERS=${STOF_BUILD_ADAPTERS:-OFF} > "$OUT/build.log" 2>&1 &&
    cmake --build build -j "$(nproc)" >> "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1; }
  echo "build ok in $((SECONDS - t0)) s"
  lib=build/plugins_cu/libstof_kernels.so
  command -v cuobjdump >/dev/null && echo "SASS: $(cuobjdump -sass $lib | grep -c HGMMA) HGMMA, $(cuobjdump -sass $lib | grep -c ' HMMA') HMMA, $(cuobjdump -sass $lib | grep -c -E 'LDL|STL') LDL/STL instructions"
  grep -E "registers|spill" "$OUT/build.log" | sed "s/ptxas info *: //" | sort | uniq -c | sort -rn | head -20
  # ptxas serialises every wgmma of a kernel when it cannot prove the asynchronous MMAs safe (C7510-C7520); only
  # ptxas -v says so, and such a kernel is correct but up to twice as slow
  serial=$(grep -c "wgmma.mma_async instructions are serialized" "$OUT/build.log")
  [[ $serial -eq 0 ]] && echo "wgmma: no serialised kernels" || { echo "WARNING: $serial ptxas notes of serialised wgmma:"; grep "instructions are serialized" "$OUT/build.log" | cut -c1-220 | sort | uniq -c | head; }
  # the Q registers of the register-A S MMAs must survive the step loop (under a register cap ptxas can reuse them:
  # wrong results with no ptxas note)
  if command -v cuobjdump >/dev/null; then python scripts/sass_rs_operands.py $lib | tail -8 || status=1; fi
  if [[ -n ${SASS_BASELINE:-} ]]; then python scripts/sass_diff.py "$SASS_BASELINE" $lib | tail -20 || status=1; fi
fi

if has test; then
  t0=$SECONDS
  rm -f "$OUT/correctness.jsonl"
  # (eval: TEST_ARGS="-k 'a or b'" keeps its quoted words)
  eval "STOF_TEST_REPORT=\"\$OUT/correctness.jsonl\" python -m pytest -q -p no:cacheprovider tests/gpu/test_attention_kernels.py ${TEST_ARGS:-}" 2>&1 | tail -40
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  echo "tests done in $((SECONDS - t0)) s"
  python - "$OUT/correctness.jsonl" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(list)
for r in rows:
    by[(r["tactic"], r["dtype"], r["D"])].append(r)
print(f"{len(rows)} checks, {sum(not r['ok'] for r in rows)} failed")
print("tactic                 dtype      D  checks  fail  max err/tol")
for key in sorted(by):
    rs = by[key]
    worst = max((r["err"] / r["tol"] for r in rs if r["err"] == r["err"]), default=float("nan"))
    print(f"{key[0]:22s} {key[1]:9s} {key[2]:3d} {len(rs):7d} {sum(not r['ok'] for r in rs):5d}  {worst:.3f}")
PY
fi

if has sanitize; then
  t0=$SECONDS
  : > "$OUT/sanitize.log"
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 97 \
      python tests/gpu/sanitize_case.py >> "$OUT/sanitize.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: exit $rc ($(grep -c -E 'ERROR SUMMARY: [1-9]|Race reported|hazard' "$OUT/sanitize.log") error lines so far)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_case" "$OUT/sanitize.log" | tail -3
    [[ $rc -eq 0 ]] || status=1
  done
  echo "sanitize done in $((SECONDS - t0)) s"
fi

if has bench; then
  python scripts/bench_attention.py --out "$OUT" ${BENCH_ARGS:-} || status=1
fi
echo "== done status=$status"
exit $status
