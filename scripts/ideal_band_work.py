#!/usr/bin/env python3
"""How fast can the sliding target's tile work run at all?  Dense attention with the band's keys per row, no mask.

    PYTHONUNBUFFERED=1 python scripts/ideal_band_work.py --rounds 5 --out $OUT

Why: issue 3's last open target asks sliding ±128 at S=4096 (B=8, H=12, D=64, fp16) to run within 1.3x of its
roofline floor, i.e. ~88 us.  A 64-row tile row of that band holds 5 non-empty 64x64 tiles (320 keys), the work
the floor counts.  Here each query row attends to Sk in {256, 320, 384} keys of one shared K/V per (batch, head),
with no mask at all: the band's tile work (Sk=320) with none of its masking, none of its 128-row items' extra keys
(Sk=384 is what a 128-row item computes), and half its memory traffic (K/V are Sk rows, read once).  So each
kernel's time here is a lower bound on what the same kernel class needs for the band.  Timed in the same rounds:
STOF (every listed tactic once, then the fastest in the rounds), SDPA with the cuDNN and flash backends and
PyTorch's default dispatch, FlexAttention without a block mask (torch.compile'd), STOF on the band itself, and the
floor's copy and matmul (last in each round).  Every STOF and Flex output is checked against SDPA's (rel err <
2e-3).  Writes ideal_band_work.json and ideal_band_work.md under --out.  Needs a CUDA GPU: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_anchor import (checked_runner, copy_bandwidth, floor_methods, matmul_rate, median_ci,  # noqa: E402
                           rel_err, roofline_floor_ms, sdpa_backend_methods, time_round)


def stof_cells(info, Sq, D):
    """Every STOF problem's tactics timed once, as scripts/bench_attention.py's "cells" (stof_trt.presearch.calibrate
    and scripts/presearch_fit.py read them)."""
    return [{"D": D, "S": Sq, "Sk": v["sk"], "spec": v["spec"], "mask": name, "measured_ms": v["once_ms"],
             "pick": v["pick_name"]} for name, v in info.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sq", type=int, default=4096, help="query rows (and the band's S)")
    ap.add_argument("--sk", default="256,320,384", help="keys per row of the dense problems")
    ap.add_argument("--window", type=int, default=128, help="the band's half width (sliding:window=W)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        sks = [int(s) for s in args.sk.split(",")]
    except ValueError:
        sys.exit(f"ideal_band_work: --sk takes comma-separated key counts, got {args.sk!r}")
    if not sks or min(sks) < 1:
        sys.exit(f"ideal_band_work: --sk takes positive key counts, got {args.sk!r}")

    import torch
    import torch.nn.functional as F
    import triton.testing

    from stof_trt import presearch
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, tactic_info
    from stof_trt.masks import parse_mask

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    B, H, D, Sq = args.batch, args.heads, args.dim, args.sq
    gpu = presearch.gpu_props()
    flex = None
    if not args.no_flex:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 1000
        flex = torch.compile(flex_attention, dynamic=False)

    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.float16)
    methods, info = {}, {}

    def add_stof(tag, k, v, spec, ref):
        layout = compile_mask(parse_mask(spec), Sq, k.shape[2])
        dl = DeviceLayout(layout)
        ranked = presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu)
        once = {}
        for tid, _ in ranked:
            r = checked_runner(q, k, v, dl, tid, ref, f"{tag} tactic {tid}")
            once[tid] = bench(r)
        best = min(once, key=once.get)
        methods[f"stof_{tag}"] = checked_runner(q, k, v, dl, best, ref, tag)
        info[f"stof_{tag}"] = {"tactic": best, "name": tactic_info(best).name, "pick": ranked[0][0],
                               "pick_name": tactic_info(ranked[0][0]).name,
                               "spec": spec, "sk": k.shape[2],
                               "once_ms": {tactic_info(t).name: ms for t, ms in once.items()},
                               "tile_flops": 4.0 * B * H * D * layout.nnz * layout.tile_m * layout.tile_n}
        print(f"  stof_{tag}: best {tactic_info(best).name} {once[best]:.4f} ms (pick {ranked[0][0]})", flush=True)

    for sk in sks:
        t0 = time.time()
        k = torch.randn(B, H, sk, D, device="cuda", dtype=torch.float16)
        v = torch.randn(B, H, sk, D, device="cuda", dtype=torch.float16)
        ref = F.scaled_dot_product_attention(q, k, v)
        add_stof(f"dense{sk}", k, v, "full", ref)
        methods[f"sdpa_default_dense{sk}"] = lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v)
        for name, fn in sdpa_backend_methods(q, k, v, ref, where=f" at Sk={sk}").items():
            methods[f"{name}_dense{sk}"] = fn
        if flex is not None:
            def fx(k=k, v=v):
                return flex(q, k, v)
            err = rel_err(fx(), ref)
            if not err < 2e-3:
                sys.exit(f"ideal_band_work: Flex differs from SDPA at Sk={sk}: {err:.2e}")
            methods[f"flex_dense{sk}"] = fx
        print(f"Sk={sk}: set up in {time.time() - t0:.1f} s", flush=True)

    # the band itself, for the same rounds
    kb = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.float16)
    vb = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.float16)
    idx = torch.arange(Sq, device="cuda")
    band = (idx[:, None] - idx[None, :]).abs() <= args.window
    ref_b = F.scaled_dot_product_attention(q, kb, vb, attn_mask=band)
    add_stof("band", kb, vb, f"sliding:window={args.window}", ref_b)
    band_bytes = 4 * B * H * Sq * D * 2

    methods.update(floor_methods())
    per = []
    for rd in range(args.rounds):
        per.append(time_round(methods, bench, rd))
        print(f"round {rd}: " + ", ".join(f"{n} {t:.4f}" for n, t in sorted(per[-1].items())), flush=True)

    med = {n: median_ci([r[n] for r in per]) for n in methods}
    floor = median_ci([roofline_floor_ms(r, band_bytes, info["stof_band"]["tile_flops"]) for r in per])
    res = {"batch": B, "heads": H, "dim": D, "sq": Sq, "window": args.window, "rounds": per, "median_ms": med,
           "band_floor_ms": floor, "stof": info, "summary": {"batch": B, "heads": H}, "cells": stof_cells(info, Sq, D),
           "copy_TBps": copy_bandwidth(med["copy"][0]) / 1e12, "matmul_TFLOPs": matmul_rate(med["matmul"][0]) / 1e12}
    (out_dir / "ideal_band_work.json").write_text(json.dumps(res, indent=1))
    lines = [f"# The band's tile work without its mask (B={B}, H={H}, D={D}, Sq={Sq}, fp16; {args.rounds} rounds)",
             "", f"Band floor (sliding ±{args.window}, S={Sq}): {floor[0]:.4f} ms; 1.3x floor: {1.3 * floor[0]:.4f} ms.",
             f"Copy {res['copy_TBps']:.2f} TB/s, matmul {res['matmul_TFLOPs']:.0f} TFLOP/s.", "",
             "| method | median ms [95 % CI] | x band floor | TFLOP/s over the problem's pairs |", "|---|---|---|---|"]
    for n in sorted(methods):
        if n in ("copy", "matmul"):
            continue
        m, lo, hi = med[n]
        sk = Sq if n == "stof_band" else int(n.rsplit("dense", 1)[1])
        pairs = (2 * args.window + 1) * Sq if n == "stof_band" else Sq * sk  # the band's pairs: ignoring its edges
        tf = 4.0 * B * H * D * pairs / (m * 1e-3) / 1e12
        extra = f" ({info[n]['name']})" if n in info else ""
        lines.append(f"| {n}{extra} | {m:.4f} [{lo:.4f}, {hi:.4f}] | {m / floor[0]:.2f} | {tf:.0f} |")
    (out_dir / "ideal_band_work.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
