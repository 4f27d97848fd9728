#!/usr/bin/env python3
"""Per-phase SM clock cycles of the warp-specialised consumers (tactics 21-24, 28, 29; persistent form).

Needs a diagnostic build of the kernels library (wrong to ship: every phase boundary reads the SM clock):

    cmake -S . -B /tmp/b_prof -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DSTOF_BUILD_ADAPTERS=OFF \\
          "-DCMAKE_CUDA_FLAGS=-DSTOF_WS_PROFILE" && cmake --build /tmp/b_prof -j 16 --target stof_kernels
    STOF_KERNELS_LIB=/tmp/b_prof/plugins_cu/libstof_kernels.so python scripts/profile_ws_phases.py \\
          --cells "64:4096:causal:24;64:4096:sliding:24"

Add -DSTOF_WS_PROFILE_NO_SOFTMAX to time the step loop without its softmax (wrong results; the MMAs, loads and
barriers alone).  For each cell the kernel runs twice (the second run is reported); the counters of warps 0 and 2
of each consumer of CTA 0 are printed per steady-state step: full (waiting for the K/V stage), issue (the S and P V
MMAs, and each apart), waitS, softmax+waitPV (mask, online softmax, then the wait for P V), rest (rescale, pack, release); plus
the first steps' and epilogues' totals, and CTA 0's clock total (the kernel's duration on that SM; the event
time printed with it also holds the call's host work).  The instrumented build is slower than the real one:
compare phases, not times.  Needs a CUDA GPU; a diagnostic, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SPAN_CTAS = 1000  # hopper_ws.cuh kWsSpanCtas: g_ws_span holds CTAs 0..999's spans, then CTA 0's marks (STOF_MARK)
MARKS = ["entry", "row_ptr_in", "barrier", "q_issued", "windows_in", "first_kv_issued", "c0_q_landed",
         "c0_kv_landed", "c0_s0_done", "c0_end", "c0_no_more_items", "sched_stores_issued", "sched_stores_done",
         "c0_regs", "sched_regs"]
NUM_COUNTERS = 20  # hopper_ws.cuh g_ws_prof: [cta 0..1][slot: consumer 0..2, producer][warp 0..3][counter]
NAMES = ["full", "issue_and_wait_s", "softmax_and_wait_pv", "rest", "steps", "epilogue", "first_steps", "issue",
         "total", "items", "handoff", "last_pv", "first_full_wait",
         "first_issue", "first_wait_s", "first_softmax", "first_wait_pv", "issue_s", "q_full_late", "q_full_wait"]
PRODUCER_NAMES = {0: "empty_waits", 1: "q_empty_waits", 2: "claims", 3: "item_start", 4: "items", 5: "step_walks",
                  6: "step_descriptors", 7: "step_tma_issue", 8: "total", 9: "steps"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="64:4096:causal:24;64:4096:sliding:24",
                    help="D:S:mask:tactic[:Sk];... (mask: a name of the issue-3 benchmark, or a mask spec; Sk: the "
                         "keys, default S)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--json", default=None, help="also write the raw counters here")
    ap.add_argument("--flush", action="store_true", help="zero 256 MB before each call (L2 cold, as do_bench)")
    a = ap.parse_args()

    lib_path = os.environ.get("STOF_KERNELS_LIB")
    if not lib_path:
        sys.exit("profile_ws_phases: set STOF_KERNELS_LIB to a library built with -DSTOF_WS_PROFILE")
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        sys.exit(f"profile_ws_phases: cannot load {lib_path}: {e}")
    if not hasattr(lib, "stof_ws_prof_read") or not hasattr(lib, "stof_ws_span_read"):
        sys.exit(f"profile_ws_phases: {lib_path} was not built with -DSTOF_WS_PROFILE")

    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_ws_phases: needs a CUDA GPU (torch.cuda.is_available() is False)")
    cells = []
    for cell in a.cells.split(";"):
        parts = cell.split(":")
        if len(parts) not in (4, 5) or not all(parts[i].isdigit() for i in (0, 1, 3, 4) if i < len(parts)):
            sys.exit(f"profile_ws_phases: --cells wants D:S:mask:tactic[:Sk] entries, got {cell!r}")
        cells.append((int(parts[0]), int(parts[1]), parts[2], int(parts[3]), int(parts[4] if len(parts) == 5
                                                                                  else parts[1])))
    from bench_attention import MASKS
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, sparse_attention
    from stof_trt.masks import parse_mask

    n = 2 * 4 * 4 * NUM_COUNTERS
    buf = (ctypes.c_uint32 * n)()
    out = []
    lib.stof_ws_prof_read(buf, n)  # zeroes the counters
    span = (ctypes.c_ulonglong * 2048)()
    lib.stof_ws_span_read(span, 2048)
    for D, S, mname, tactic, Sk in cells:
        cell = f"{D}:{S}:{mname}:{tactic}" + (f":{Sk}" if Sk != S else "")
        mask = parse_mask(MASKS.get(mname, mname))
        dl = DeviceLayout(compile_mask(mask, S, Sk, num_heads=a.heads))
        q = torch.randn(a.batch, a.heads, S, D, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(a.batch, a.heads, Sk, D, device="cuda", dtype=torch.float16) for _ in range(2))
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if a.flush else None
        for _ in range(2):
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sparse_attention(q, k, v, dl, tactic=tactic)  # with a workspace: the persistent form
            end.record()
            torch.cuda.synchronize()
        if lib.stof_ws_prof_read(buf, n) != 0 or lib.stof_ws_span_read(span, 2048) != 0:
            sys.exit("profile_ws_phases: reading the counters failed")
        print(f"== D={D} S={S}{f' Sk={Sk}' if Sk != S else ''} {mname} tactic {tactic}: "
              f"{start.elapsed_time(end):.3f} ms per call (instrumented)")
        starts = [span[2 * i] for i in range(SPAN_CTAS) if span[2 * i + 1]]
        ends = [span[2 * i + 1] for i in range(SPAN_CTAS) if span[2 * i + 1]]
        marks = [span[2 * SPAN_CTAS + i] for i in range(len(MARKS))]
        if marks[0]:  # CTA 0's timeline (SM cycles after its first instruction; -: not reached)
            print("  CTA 0 timeline, cycles after the kernel's first instruction: " + ", ".join(
                f"{name} {m - marks[0] if m else '-'}" for name, m in zip(MARKS, marks)))
        if ends:
            t0 = min(starts)
            e = sorted(x - t0 for x in ends)
            s_ = sorted(x - t0 for x in starts)
            print(f"  {len(ends)} CTAs: starts {s_[0] / 1e3:.1f}-{s_[-1] / 1e3:.1f} us, consumers done at min "
                  f"{e[0] / 1e3:.1f}, median {e[len(e) // 2] / 1e3:.1f}, max {e[-1] / 1e3:.1f} us after the first "
                  f"start; idle tail {sum(e[-1] - x for x in e) / len(e) / max(e[-1], 1):.1%} of the span (mean)")
        rec = {"cell": cell, "ms": start.elapsed_time(end), "warps": []}
        for cons in range(3):
            for warp in (0, 2):
                x = list(buf[((0 * 4 + cons) * 4 + warp) * NUM_COUNTERS:][:NUM_COUNTERS])
                if x[8] == 0:
                    continue  # no such consumer, or not the persistent warp-specialised kernel
                rec["warps"].append({"consumer": cons, "warp": warp, **dict(zip(NAMES, x))})
                steps = max(x[4], 1)
                print(f"  consumer {cons} warp {warp}: {x[4]} steps; per step: full {x[0] / steps:.0f}, "
                      f"issue {x[7] / steps:.0f} (S {x[17] / steps:.0f}, P V {(x[7] - x[17]) / steps:.0f}), waitS {(x[1] - x[7]) / steps:.0f}, softmax+waitPV "
                      f"{x[2] / steps:.0f}, rest {x[3] / steps:.0f}; first steps {x[6]}, epilogues {x[5]}, "
                      f"total {x[8]} cycles")
                items = max(x[9] - 1, 1)  # the last hand-off says "no more items"
                loop = x[0] + x[1] + x[2] + x[3]
                # chained items (head dim 64): an item's first step also holds the previous item's last P V and
                # epilogue, which the epilogue counter counts as well; [11] is then the CTA's last P V only
                print(f"    {items} items; per item: first step {x[6] / items:.0f}, epilogue {x[5] / items:.0f}, "
                      f"hand-off {x[10] / items:.0f} (q_full wait {x[19] / items:.0f}, q_full late in {x[18]} of "
                      f"{x[9]} items), first K/V wait {x[12] / items:.0f} (chained first steps: issue "
                      f"{x[13] / items:.0f}, waitS {x[14] / items:.0f}, softmax {x[15] / items:.0f}, waitPV "
                      f"{x[16] / items:.0f}); last P V outside first steps {x[11]} in all; "
                      f"steady steps {loop / x[8]:.0%} of the total, first steps + hand-offs + that P V "
                      f"{(x[6] + x[10] + x[11]) / x[8]:.0%}")
        x = list(buf[((0 * 4 + 3) * 4) * NUM_COUNTERS:][:NUM_COUNTERS])
        if x[8]:
            rec["producer"] = {name: x[i] for i, name in PRODUCER_NAMES.items()}
            items = max(x[4], 1)
            print(f"  producer: {x[4]} items; per item: q_empty wait {x[1] / items:.0f}, claim {x[2] / items:.0f}, "
                  f"walk start + Q {x[3] / items:.0f}, empty waits {x[0] / items:.0f}; total {x[8]} cycles")
            steps = max(x[9], 1)
            print(f"  producer: {x[9]} steps; per step: next step's walk {x[5] / steps:.0f}, descriptor (bitmap-index "
                  f"loads) {x[6] / steps:.0f}, TMA issue {x[7] / steps:.0f} cycles")
        if not rec["warps"]:
            print("  no counters: this tactic did not run the persistent warp-specialised kernel")
        out.append(rec)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
