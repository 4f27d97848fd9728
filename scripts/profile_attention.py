#!/usr/bin/env python3
r"""Run STOF attention tactics (and SDPA, FlashAttention-4) a few times on one problem, for Nsight Compute on the
GPU machine:

    ncu --clock-control none --kernel-name regex:attn_fwd --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/profile_attention.py --tactics 19,23

    # STOF's tactic and FA4's kernel on the same cell, one profiled launch each (two ncu runs; FA4's kernel name
    # holds "FlashAttentionForwardSm90")
    ncu --clock-control none --kernel-name regex:hopper_ws --launch-skip 3 --launch-count 1 --set full -o stof \
        python scripts/profile_attention.py --S 8192 --D 64 --tactics 24
    ncu --clock-control none --kernel-name regex:FlashAttention --launch-skip 3 --launch-count 1 --set full -o fa4 \
        python scripts/profile_attention.py --S 8192 --D 64 --tactics 24 --fa4
    ncu -i stof.ncu-rep --page source --csv --print-source sass > stof.sass.csv   # stall samples per instruction

Each method runs 4 times (3 warm-up launches, then the profiled one: --launch-skip 3 with one method per kernel
name), after a correctness check against SDPA with the boolean mask. Tactics are ids or names
(stof_trt.kernels.all_tactics()). --fa4 needs the flash-attn-4 package (causal and sliding). --nvtx puts each
method's last launch in an NVTX range "prof_<method>" (Nsight tools; ncu reads a '/' in a range filter as nesting).
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
    ap.add_argument("--tactics", default="19", help="comma-separated tactic ids or names")
    ap.add_argument("--sdpa", action="store_true", help="also run SDPA is_causal (causal masks)")
    ap.add_argument("--fa4", action="store_true", help="also run FlashAttention-4 natively (causal, sliding)")
    ap.add_argument("--nvtx", action="store_true",
                    help='put each method\'s last launch in an NVTX range "prof_<method>"')
    ap.add_argument("--no-row-order", action="store_true",
                    help="run in the default row order, not the layout's longest-first one")
    ap.add_argument("--sched-chunk", type=int, default=None, metavar="N",
                    help="sched_chunk: (batch, head) pairs interleaved (0 = the library's L2-sized default, "
                         "1 = one pair at a time); default: the layout's value (TileLayout.sched_chunk())")
    a = ap.parse_args()

    import torch

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, all_tactics, sparse_attention
    from stof_trt.masks import parse_mask

    ids = {t.name: t.id for t in all_tactics()}
    try:
        tactics = [int(x) if x.strip().isdigit() else ids[x.strip()] for x in a.tactics.split(",") if x.strip()]
    except KeyError as e:
        ap.error(f"unknown tactic {e.args[0]!r}")

    def launches(name, fn, n=4):
        """n launches; with --nvtx the last one in the range prof_<name>."""
        for i in range(n):
            if a.nvtx and i == n - 1:
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"prof_{name}")
            out = fn()
            if a.nvtx and i == n - 1:
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return out

    mask = parse_mask(MASKS.get(a.mask, a.mask))
    layout = compile_mask(mask, a.S, a.S)
    dl = DeviceLayout(layout)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(a.B, a.H, a.S, a.D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    dense = torch.from_numpy(mask.dense(a.S, a.S)).cuda()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    def rel_err(out):
        return ((out.float() - ref.float()).norm() / ref.float().norm()).item()

    for t in tactics:
        out = launches(f"stof_{t}", lambda t=t: sparse_attention(q, k, v, dl, tactic=t, row_order=not a.no_row_order,
                                                                 sched_chunk=a.sched_chunk))
        print(f"tactic {t}: rel err vs SDPA {rel_err(out):.2e}")
    if a.sdpa:
        launches("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    if a.fa4:
        from stof_trt.bench.anchors import AnchorUnavailable, fa4_method

        try:
            fn, as_bhsd = fa4_method(q, k, v, a.mask, mask)
        except AnchorUnavailable as e:
            raise SystemExit(f"fa4: {e}") from None
        out = launches("fa4", fn)
        print(f"fa4: rel err vs SDPA {rel_err(as_bhsd(out)):.2e}")


if __name__ == "__main__":
    main()
