#!/usr/bin/env python3
"""Long sequences: STOF's tactics against FlexAttention at S up to 2^18, one layout or one per head.  Needs a GPU.

    PYTHONUNBUFFERED=1 python scripts/bench_long_seq.py --out $OUT

At these sizes a bitmap per 64x64 tile of the whole grid would pass 2^32 bytes (from S of about 185k under one
layout, 54k under 12 per-head layouts); the layout stores only its distinct PARTIAL bitmaps, so every tactic,
the wgmma ones too, stays available.  Per cell, every tactic the library lists is timed once, and the best is
reported beside the pre-search's first choice (stof_trt.presearch; within 10 % of the best?) and FlexAttention
(torch.compile'd flex_attention with create_block_mask of the same mask, 128x128 blocks).  Every STOF output is
compared with Flex's (with --no-flex, with the first tactic's).  Times: triton.testing.do_bench medians (CUDA
events).  Writes bench_long_seq.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stof_trt.bench.masks import LONG_SEQ_MASKS as MASKS
from stof_trt.bench.masks import mask_mod_for


def parse_cells(text):
    """'sliding:262144;bigbird_per_head:65536' -> [(mask name, S)]"""
    cells = []
    for part in filter(None, text.split(";")):
        name, s = part.split(":")
        if name not in MASKS:
            raise SystemExit(f"unknown mask {name!r}: one of {', '.join(MASKS)}")
        cells.append((name, int(s)))
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="sliding:65536;sliding:131072;sliding:262144;bigbird_per_head:65536",
                    help="mask:S list; masks: " + ", ".join(MASKS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64, choices=(64, 128))
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (its compile takes minutes)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    cells = parse_cells(args.cells)

    import torch
    import triton
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from stof_trt import presearch
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, list_tactics, sparse_attention, tactic_info
    from stof_trt.masks import parse_mask

    torch._dynamo.config.cache_size_limit = 1000
    flex = torch.compile(flex_attention, dynamic=False)
    B, H, D = args.batch, args.heads, args.dim
    gpu = presearch.gpu_props()

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    rows = []
    for name, S in cells:
        spec, per_head = MASKS[name]
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S, num_heads=H if per_head else None)
        dl = DeviceLayout(layout)
        gen = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
        ref = bm = None
        t_flex = float("nan")
        if not args.no_flex:
            bm = create_block_mask(mask_mod_for(name, mask, S, heads=H), None, H if per_head else None, S, S,
                                   device="cuda", _compile=True)  # (uncompiled, it would evaluate all S^2 pairs)
            ref = flex(q, k, v, block_mask=bm)
            t_flex = bench(lambda: flex(q, k, v, block_mask=bm))
        ids = list_tactics(q, k, v, dl)
        ranked = [t for t, _ in presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu) if t in ids]
        times, errs = {}, {}
        out = torch.empty_like(q)
        for t in ids:
            out.fill_(float("nan"))
            sparse_attention(q, k, v, dl, tactic=t, out=out)
            torch.cuda.synchronize()
            if ref is None:  # --no-flex: the first tactic's output is the reference for the others
                ref = out.clone()
            errs[t] = float((out.double() - ref.double()).norm() / ref.double().norm())
            times[t] = bench(lambda t=t: sparse_attention(q, k, v, dl, tactic=t, out=out))
        best = min(ids, key=times.get)
        grid_bytes = layout.num_layouts * layout.Tq * -(-S // 64) * 512  # a bitmap per tile of the whole grid
        row = {"mask": name, "spec": spec, "S": S, "B": B, "H": H, "D": D, "layouts": int(layout.num_layouts),
               "num_bitmaps": int(dl.num_bitmaps), "grid_bitmap_bytes": int(grid_bytes),
               "flex_ms": t_flex, "tactics": ids, "best": tactic_info(best).name, "best_ms": times[best],
               "pick": tactic_info(ranked[0]).name if ranked else None,
               "pick_ms": times[ranked[0]] if ranked else float("nan"),
               "pick_hit": bool(ranked) and times[ranked[0]] <= 1.10 * times[best],
               "flex_over_best": t_flex / times[best], "max_rel_err_vs_flex": max(errs.values()),
               "reference": "flex" if not args.no_flex else tactic_info(ids[0]).name,
               "ms": {tactic_info(t).name: times[t] for t in ids}}
        rows.append(row)
        print(f"{name:17s} S={S:7d} L={row['layouts']:2d} grid bitmaps {grid_bytes / 2**30:5.1f} GiB, "
              f"{row['num_bitmaps']} stored; {len(ids)} tactics: best {row['best']} {row['best_ms']:.3f} ms, pick "
              f"{row['pick']} {row['pick_ms']:.3f} ms, Flex {t_flex:.3f} ms ({row['flex_over_best']:.2f}x), "
              f"max rel err vs Flex {row['max_rel_err_vs_flex']:.1e}", flush=True)
        q = k = v = out = ref = bm = None  # (freed before the next cell)
        torch.cuda.empty_cache()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_long_seq.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                             indent=1))
    md = ["| mask | S | layouts | grid bitmaps (GiB) | stored bitmaps | STOF best (ms) | pre-search pick (ms) | "
          "Flex (ms) | Flex / STOF | max rel err vs Flex |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['mask']} | {r['S']} | {r['layouts']} | {r['grid_bitmap_bytes'] / 2**30:.1f} | "
                  f"{r['num_bitmaps']} | {r['best_ms']:.3f} ({r['best']}) | "
                  f"{r['pick_ms']:.3f} ({r['pick']}{'' if r['pick_hit'] else ', > 1.1x'}) | "
                  f"{r['flex_ms']:.3f} | {r['flex_over_best']:.2f} | {r['max_rel_err_vs_flex']:.1e} |")
    (args.out / "bench_long_seq.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
