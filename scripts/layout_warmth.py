#!/usr/bin/env python3
"""How much of a STOF call's time is its tile layout coming from DRAM: each call timed after an L2 flush (as
triton's do_bench does), with the layout's arrays either left cold or read back into L2 between the flush and the
call (untimed), against cuDNN on the same flushed L2; `control`: the same reads of other memory of the same sizes
(the extra kernels without the layout in L2); `control_ew`: elementwise kernels on that memory instead of
reductions; `after22`: one call of tactic 22 instead; `after_tiny`: the same kernel (or cuDNN) on a tiny problem (one
item per SM) instead: its code warm, not the layout.

    python scripts/layout_warmth.py --tactics 24 --cells "1:1:128:causal;1:1:1024:causal;8:12:1024:causal" --out $OUT/warmth.json

A cell is B:H:S:mask (D=64, fp16, Sq = Sk = S). The difference cold - warm is what the layout's dependent loads
(row_ptr, then col_idx / tile_bitmap_index, before the first K/V copy) cost on the call's critical path. CUDA events,
median of --reps calls (the GPU held busy by a spin kernel while the host enqueues each one). Needs a CUDA GPU; a
diagnostic, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tactics", default="24")
    ap.add_argument("--cells", default="1:1:128:causal;1:1:1024:causal;8:12:1024:causal")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_attention import MASKS
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, list_tactics
    from stof_trt.masks import parse_mask

    if not torch.cuda.is_available():
        sys.exit("layout_warmth: needs a CUDA GPU")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # do_bench's L2 flush

    def timed(fn, before=None):
        ts = []
        for i in range(a.reps + 10):
            flush.zero_()
            if before is not None:
                before()
            # the GPU spins here while the host enqueues the call, so no launch latency lands between the events
            torch.cuda._sleep(2_000_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            if i >= 10:
                ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    rows = []
    for cell in a.cells.split(";"):
        B, H, S, mname = cell.split(":", 3)
        B, H, S = int(B), int(H), int(S)
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        mask = parse_mask(MASKS.get(mname, mname))
        dl = DeviceLayout(compile_mask(mask, S, S, num_heads=H))
        arrays = [dl.row_ptr, dl.col_idx, dl.tile_bitmap_index, dl.bitmaps, dl.row_order]
        sink = torch.zeros(len(arrays), dtype=torch.int64, device="cuda")

        dummies = [torch.ones_like(t) for t in arrays]  # control: the same kernels on other memory

        def warm():  # read every layout array back into L2
            for i, t in enumerate(arrays):
                sink[i] = t.sum()

        def control():
            for i, t in enumerate(dummies):
                sink[i] = t.sum()

        def control_ew():  # elementwise kernels only (no reductions)
            for t in dummies:
                t.add_(0)

        # after_tiny: the same kernel on a tiny problem (B=1, H=132, S=128: one 128-row item per SM) between the flush
        # and the call, so its code is in L2 and every SM's instruction cache and the SMs hold its shared-memory split
        tq, tk, tv = (torch.randn(1, 132, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        tdl = DeviceLayout(compile_mask(parse_mask("causal"), 128, 128))

        rec = {"cell": cell}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if mname == "causal":
                rec["cudnn_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                rec["cudnn_control_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                control)
                rec["cudnn_after_tiny_ms"] = timed(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True))
        valid = set(list_tactics(q, k, v, dl))
        # control_22: one call of tactic 22 (about 123 KB of shared memory) before each timed call
        other = Runner(q, k, v, dl, tactic=22, out=torch.empty_like(q)) if 22 in valid else None
        for t in [int(x) for x in a.tactics.split(",")]:
            if t not in valid:
                continue
            r = Runner(q, k, v, dl, tactic=t)
            rec[f"t{t}_cold_ms"] = timed(r)
            rec[f"t{t}_warm_ms"] = timed(r, warm)
            rec[f"t{t}_control_ms"] = timed(r, control)
            rec[f"t{t}_control_ew_ms"] = timed(r, control_ew)
            rec[f"t{t}_after_tiny_ms"] = timed(r, Runner(tq, tk, tv, tdl, tactic=t))
            if other is not None:
                rec[f"t{t}_after22_ms"] = timed(r, other)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
