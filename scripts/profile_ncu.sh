#!/usr/bin/env bash
# Nsight Compute profiles of STOF tactics (and SDPA is_causal's cuDNN kernel) on the GPU machine, one kernel
# launch each, for comparing per-step instruction mixes and stall reasons.  Run from the repository root after a
# build (scripts/device_kernels.sh STAGES=build):
#
#   MASK=causal S=4096 TACTICS="13 24" SDPA=1 bash scripts/profile_ncu.sh
#
# Per profiled kernel NAME (t13, t24, ..., cudnn) it writes under $OUT:
#   ncu_NAME.txt   the details page of `--set full` (speed of light, occupancy, warp states, instruction stats)
#   src_NAME.csv   the source page as SASS with per-instruction counters (instructions executed, stall samples)
# Clocks are not locked (--clock-control none), so durations are comparable with the benchmarks.
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
MASK=${MASK:-causal}
S=${S:-4096}
D=${D:-64}
TACTICS=${TACTICS:-13}
NCU=(ncu --clock-control none --set full --import-source no --launch-skip 3 --launch-count 1)
tmp=$(mktemp -d)

profile() {  # name, kernel regex, profile_attention.py arguments...
    local name=$1 regex=$2
    shift 2
    "${NCU[@]}" --kernel-name "regex:$regex" -o "$tmp/$name" -f \
        python scripts/profile_attention.py --mask "$MASK" --S "$S" --D "$D" "$@" > "$tmp/$name.log" 2>&1 ||
        { echo "ncu failed for $name"; tail -20 "$tmp/$name.log"; return 1; }
    ncu --import "$tmp/$name.ncu-rep" --page details > "$OUT/ncu_$name.txt"
    ncu --import "$tmp/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$name.csv"
    grep -E "^  [a-z_]+.*attn_fwd|flash|Duration|Registers Per|Achieved Occupancy|Executed Ipc A|Warp Cycles Per Issued" \
        "$OUT/ncu_$name.txt" | head -12
}

status=0
for t in $TACTICS; do
    echo "== tactic $t ($MASK, S=$S, D=$D)"
    profile "t$t" "attn_fwd|persist_fwd" --tactics "$t" || status=1
done
if [[ -n ${SDPA:-} ]]; then
    echo "== SDPA is_causal (cuDNN)"
    profile cudnn "flash_fprop" --tactics 13 --sdpa || status=1
fi
rm -rf "$tmp"
exit $status
