#!/usr/bin/env python3
"""Benchmark STOF sparse attention against PyTorch SDPA and FlexAttention (issue 3).  Needs a CUDA GPU.

    PYTHONUNBUFFERED=1 python scripts/bench_attention.py --out $OUT            # full grid (B=8, H=12, fp16)
    python scripts/bench_attention.py --dims 64 --sizes 1024,4096 --masks sliding --out /tmp/b

Per cell (head dim, S, mask): STOF with the pre-search's first choice and with the best measured tactic (every
valid tactic the model does not prune at > 20x its best prediction), SDPA dense (no mask), SDPA with the boolean
mask, SDPA is_causal (causal only; also with each backend forced, cuDNN and flash, where it accepts the problem),
FlexAttention (torch.compile(flex_attention) + create_block_mask of the same mask), and on sliding cells cuDNN's
own band kernel (stof_trt.bench.anchors; where nvidia-cudnn-frontend is installed, the fastest of its plans).
Times: triton.testing.do_bench medians (CUDA events).  Each STOF output is checked against Flex's (rel err) so all
methods compute the same masked attention.  Also measures the roofline ingredients (device copy bandwidth, dense
fp16 matmul rate).  Causal cells also time STOF's best tactic and SDPA is_causal in --causal-rounds interleaved
rounds (default 10) and report the median of the per-round ratio with a 95 % bootstrap interval (summary key
causal_x_sdpa_is_causal_paired): the two are within 1-5 % of each other, inside either's run-to-run spread.
Writes bench_attention.json, .md and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from stof_trt.bench.masks import MASKS, mask_mod_for
from stof_trt.bench.stats import geomean, paired_ratio, rel_err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--sizes", default="512,1024,2048,4096,8192")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--causal-rounds", type=int, default=10, metavar="N",
                    help="causal cells: also time STOF's best tactic and SDPA is_causal in N interleaved rounds and "
                         "report the median per-round ratio with a 95%% bootstrap interval (0: off); one "
                         "measurement per method cannot tell a 1-2%% lead from run-to-run spread")
    ap.add_argument("--no-row-order", action="store_true",
                    help="run the STOF kernels in the default row order, not the layout's longest-first one")
    ap.add_argument("--sched-chunk", type=int, default=None, metavar="N",
                    help="sched_chunk for the STOF kernels: (batch, head) pairs whose CTAs are interleaved "
                         "(0 = the library's L2-sized default, 1 = one pair at a time); default: the layout's "
                         "value (TileLayout.sched_chunk(): 1 for near-equal row lengths, else 0)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton.testing

    from stof_trt import presearch
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, tactic_info
    from stof_trt.masks import parse_mask

    from stof_trt.bench.anchors import (attention_bytes, copy_bandwidth, floor_methods, matmul_rate,
                                        roofline_floor_ms, sdpa_backend_methods, tile_flops, try_band_anchor)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    gpu = presearch.gpu_props()

    def bench(fn, rep=args.rep):
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")

    # Roofline ingredients, measured in this run.
    fm = floor_methods()
    t_floor = {n: bench(fn) for n, fn in fm.items()}
    del fm
    copy_bw, mm_rate = copy_bandwidth(t_floor["copy"]), matmul_rate(t_floor["matmul"])
    print(f"device {dev.name}: copy {copy_bw / 1e12:.2f} TB/s, fp16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)

    flex = create_block_mask = None
    if not args.no_flex:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = 1000
        torch._dynamo.config.accumulated_cache_size_limit = 4000
        flex = torch.compile(flex_attention, dynamic=False)

    B, H = args.batch, args.heads
    cells = []
    for D in [int(d) for d in args.dims.split(",")]:
        for S in [int(s) for s in args.sizes.split(",")]:
            q = torch.randn(B, H, S, D, device="cuda", dtype=torch.float16)
            k = torch.randn(B, H, S, D, device="cuda", dtype=torch.float16)
            v = torch.randn(B, H, S, D, device="cuda", dtype=torch.float16)
            t_dense = bench(lambda: F.scaled_dot_product_attention(q, k, v))
            for mname in args.masks.split(","):
                t0 = time.time()
                mask = parse_mask(MASKS[mname])
                layout = compile_mask(mask, S, S)
                dl = DeviceLayout(layout)
                dense = torch.from_numpy(mask.dense(S, S)).cuda()
                allowed = int(dense.sum())
                flops = 4.0 * B * H * D * allowed
                floor = roofline_floor_ms(t_floor, attention_bytes(B, H, S, D), tile_flops(layout, B, H, D)) / 1e3  # s
                cell = {"D": D, "S": S, "mask": mname, "spec": MASKS[mname], "density": allowed / S / S,
                        "nnz": int(layout.nnz), "partial": int(layout.num_partial), "sdpa_dense_ms": t_dense,
                        "floor_ms": floor * 1e3, "gflop": flops / 1e9, "row_order": not args.no_row_order,
                        "sched_chunk": dl.sched_chunk if args.sched_chunk is None else args.sched_chunk}
                # STOF: every valid tactic the model does not prune
                ranked = presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu)
                best_pred = ranked[0][1]
                cell["predicted_ms"] = {tactic_info(t).name: p * 1e3 for t, p in ranked}
                cell["pick"] = tactic_info(ranked[0][0]).name
                meas, outs, runners = {}, {}, {}
                for tid, pred in ranked:
                    name = tactic_info(tid).name
                    if pred > 20 * best_pred:
                        continue  # pruned by the model
                    r = Runner(q, k, v, dl, tactic=tid, row_order=not args.no_row_order,
                               sched_chunk=args.sched_chunk)
                    r()
                    torch.cuda.synchronize()
                    meas[name] = bench(r)
                    outs[name] = r.out
                    runners[name] = r
                cell["measured_ms"] = meas
                best_name = min(meas, key=meas.get)
                cell["best"] = best_name
                cell["stof_best_ms"] = meas[best_name]
                cell["stof_pick_ms"] = meas.get(cell["pick"], float("nan"))
                cell["pick_hit"] = cell["stof_pick_ms"] <= 1.10 * cell["stof_best_ms"]
                o_stof = outs[best_name]
                # SDPA with the boolean mask (dense work)
                try:
                    am = dense[None, None]
                    cell["sdpa_mask_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=am))
                    o_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=am)
                    rows = dense.any(-1)[None, None, :, None]
                    o_ref = torch.where(rows, o_ref, torch.zeros_like(o_ref))
                    cell["err_vs_sdpa_mask"] = rel_err(o_stof, o_ref)
                except Exception as e:  # noqa: BLE001
                    cell["sdpa_mask_error"] = repr(e)[:200]
                if mname == "causal":
                    def sdpa_causal():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    cell["sdpa_causal_ms"] = bench(sdpa_causal)
                    # which kernel PyTorch's dispatch runs is not said: time each backend forced as well
                    forced = sdpa_backend_methods(q, k, v, sdpa_causal(), is_causal=True, where=f" at D={D} S={S}")
                    cell["sdpa_backend_ms"] = {n: bench(fn) for n, fn in forced.items()}
                    if args.causal_rounds > 0:
                        cell["causal_paired"] = paired_ratio(runners[best_name], sdpa_causal, args.causal_rounds, bench)
                if mname == "sliding" and mask.left == mask.right:
                    # NVIDIA's own band kernel, where nvidia-cudnn-frontend is installed; checked against STOF's
                    # output and float64
                    cb, why = try_band_anchor(q, k, v, mask.right, o_stof)
                    if cb is not None:
                        cell["cudnn_band_ms"] = bench(cb)
                        cell["cudnn_band_plan"] = cb.plan
                        del cb
                    else:
                        cell["cudnn_band_error"] = why
                if flex is not None:
                    try:
                        mm = mask_mod_for(mname, mask, S)
                        bm = create_block_mask(mm, None, None, S, S, device="cuda")
                        o_flex = flex(q, k, v, block_mask=bm)
                        torch.cuda.synchronize()
                        cell["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=bm))
                        cell["err_vs_flex"] = rel_err(o_stof, o_flex)
                    except Exception as e:  # noqa: BLE001
                        cell["flex_error"] = repr(e)[:300]
                st = cell["stof_best_ms"]
                cell["tflops_best"] = flops / (st * 1e-3) / 1e12
                cell["x_flex"] = cell.get("flex_ms", float("nan")) / st
                cell["x_flex_pick"] = cell.get("flex_ms", float("nan")) / cell["stof_pick_ms"]
                cell["x_sdpa_mask"] = cell.get("sdpa_mask_ms", float("nan")) / st
                cell["x_floor"] = st / cell["floor_ms"]
                if "cudnn_band_ms" in cell:
                    cell["x_cudnn_band"] = cell["cudnn_band_ms"] / st
                cells.append(cell)
                print(f"D={D:3d} S={S:5d} {mname:10s} dens={cell['density']:.3f} stof pick {cell['pick']} "
                      f"{cell['stof_pick_ms']:.3f} best {best_name} {st:.3f} ms ({cell['tflops_best']:.0f} TF/s, "
                      f"{cell['x_floor']:.2f}x floor) | flex {cell.get('flex_ms', float('nan')):.3f} "
                      f"sdpa {t_dense:.3f} sdpa+mask {cell.get('sdpa_mask_ms', float('nan')):.3f} "
                      f"causal {cell.get('sdpa_causal_ms', float('nan')):.3f} | x_flex {cell['x_flex']:.2f} "
                      f"err_flex {cell.get('err_vs_flex', float('nan')):.1e} [{time.time() - t0:.0f}s]", flush=True)
                del outs, o_stof
                # keep what is measured so far (a killed run still leaves its cells)
                (out_dir / f"bench_attention{args.tag}.partial.json").write_text(json.dumps(cells))
            del q, k, v
            torch.cuda.empty_cache()

    summary = {"device": dev.name, "copy_bw_TBps": copy_bw / 1e12, "fp16_matmul_TFLOPs": mm_rate / 1e12,
               "batch": B, "heads": H}
    for D in sorted({c["D"] for c in cells}):
        sel = [c for c in cells if c["D"] == D and c["S"] >= 1024]
        summary[f"D{D}"] = {
            "geomean_x_flex_best": geomean([c["x_flex"] for c in sel]),
            "geomean_x_flex_pick": geomean([c["x_flex_pick"] for c in sel]),
            "min_x_flex_best": min((c["x_flex"] for c in sel if math.isfinite(c["x_flex"])), default=float("nan")),
            "causal_x_sdpa_is_causal": {c["S"]: c["sdpa_causal_ms"] / c["stof_best_ms"] for c in sel
                                        if "sdpa_causal_ms" in c},
            # median over interleaved rounds of SDPA is_causal / STOF best, [95 % interval of that median]
            "causal_x_sdpa_is_causal_paired": {c["S"]: [c["causal_paired"][k] for k in ("ratio", "lo", "hi")]
                                               for c in sel if "causal_paired" in c},
            "geomean_x_sdpa_mask": geomean([c["x_sdpa_mask"] for c in sel]),
            # cuDNN's own sliding-window kernel / STOF best (sliding cells, where nvidia-cudnn-frontend is installed)
            "sliding_x_cudnn_band": {c["S"]: c["x_cudnn_band"] for c in sel if "x_cudnn_band" in c},
        }
    summary["presearch_hit_rate"] = (sum(c["pick_hit"] for c in cells) / len(cells)) if cells else float("nan")
    summary["presearch_cells"] = len(cells)
    res = {"summary": summary, "cells": cells, "argv": sys.argv}
    name = f"bench_attention{args.tag}"
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out_dir / f"{name}.partial.json").unlink(missing_ok=True)

    # table (markdown)
    lines = ["| D | S | mask | density | STOF pick ms | STOF best ms (tactic) | Flex ms | SDPA ms | SDPA+mask ms | "
             "is_causal ms | cuDNN band ms | TFLOP/s | x Flex | x floor |", "|" + "---|" * 14]
    for c in cells:
        lines.append(f"| {c['D']} | {c['S']} | {c['mask']} | {c['density']:.3f} | {c['stof_pick_ms']:.3f} | "
                     f"{c['stof_best_ms']:.3f} ({c['best']}) | {c.get('flex_ms', float('nan')):.3f} | "
                     f"{c['sdpa_dense_ms']:.3f} | {c.get('sdpa_mask_ms', float('nan')):.3f} | "
                     f"{c.get('sdpa_causal_ms', float('nan')):.3f} | {c.get('cudnn_band_ms', float('nan')):.3f} | "
                     f"{c['tflops_best']:.0f} | {c['x_flex']:.2f} | "
                     f"{c['x_floor']:.2f} |")
    paired = [c for c in cells if "causal_paired" in c]
    if paired:
        lines += ["", "Causal, SDPA is_causal / STOF best over interleaved rounds: median [95 % interval of the "
                  "median]:", ""]
        for c in paired:
            cp = c["causal_paired"]
            lines.append(f"- D={c['D']} S={c['S']}: {cp['ratio']:.3f} [{cp['lo']:.3f}, {cp['hi']:.3f}] "
                         f"({cp['rounds']} rounds, {cp['verdict']})")
    table = "\n".join(lines)
    (out_dir / f"{name}.md").write_text(table + "\n\n" + json.dumps(summary, indent=1) + "\n")
    print(table)
    print(json.dumps(summary, indent=1))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        dims = sorted({c["D"] for c in cells})
        mnames = list(dict.fromkeys(c["mask"] for c in cells))
        fig, axes = plt.subplots(len(dims), len(mnames), figsize=(4 * len(mnames), 3.5 * len(dims)), squeeze=False)
        for i, D in enumerate(dims):
            for j, mn in enumerate(mnames):
                ax = axes[i][j]
                sel = sorted((c for c in cells if c["D"] == D and c["mask"] == mn), key=lambda c: c["S"])
                Ss = [c["S"] for c in sel]
                for key, lab in [("stof_best_ms", "STOF best"), ("stof_pick_ms", "STOF pick"), ("flex_ms", "Flex"),
                                 ("sdpa_dense_ms", "SDPA dense"), ("sdpa_mask_ms", "SDPA+mask"),
                                 ("sdpa_causal_ms", "SDPA is_causal"), ("cudnn_band_ms", "cuDNN band"),
                                 ("floor_ms", "floor")]:
                    ys = [c.get(key, float("nan")) for c in sel]
                    if any(math.isfinite(y) for y in ys):
                        ax.plot(Ss, ys, marker="o", label=lab, linestyle="--" if key == "floor_ms" else "-")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{mn}, D={D}")
                ax.set_xlabel("S")
                ax.set_ylabel("ms")
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=90)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)


if __name__ == "__main__":
    main()
