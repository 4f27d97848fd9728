#!/usr/bin/env python3
"""Run STOF attention tactics (and SDPA) a few times on one problem, for Nsight Compute on the GPU machine:

    ncu --clock-control none --kernel-name regex:attn_fwd --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/profile_attention.py --tactics 19,23

Each tactic runs 4 times (3 warm-up launches, then the profiled one with --launch-skip 3 and one tactic per
ncu invocation), after a correctness check against SDPA with the boolean mask.
"""

from __future__ import annotations

import argparse

from stof_trt.bench.masks import MASKS


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", default="causal",
                    help="a mask spec (stof_trt.masks.parse_mask) or a benchmark mask name: "
                         f"{', '.join(MASKS)} (stof_trt.bench.masks)")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--tactics", default="19")
    ap.add_argument("--sdpa", action="store_true", help="also run SDPA is_causal (causal masks)")
    ap.add_argument("--no-row-order", action="store_true",
                    help="run in the default row order, not the layout's longest-first one")
    ap.add_argument("--sched-chunk", type=int, default=None, metavar="N",
                    help="sched_chunk: (batch, head) pairs interleaved (0 = the library's L2-sized default, "
                         "1 = one pair at a time); default: the layout's value (TileLayout.sched_chunk())")
    a = ap.parse_args()

    import torch

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, sparse_attention
    from stof_trt.masks import parse_mask

    mask = parse_mask(MASKS.get(a.mask, a.mask))
    layout = compile_mask(mask, a.S, a.S)
    dl = DeviceLayout(layout)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(a.B, a.H, a.S, a.D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    dense = torch.from_numpy(mask.dense(a.S, a.S)).cuda()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    for t in [int(x) for x in a.tactics.split(",")]:
        for _ in range(4):
            out = sparse_attention(q, k, v, dl, tactic=t, row_order=not a.no_row_order, sched_chunk=a.sched_chunk)
        torch.cuda.synchronize()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"tactic {t}: rel err vs SDPA {err:.2e}")
    if a.sdpa:
        for _ in range(4):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
