#!/usr/bin/env python3
"""Paired, interleaved timing of STOF against the issue-3 anchors whose targets are close calls.

    PYTHONUNBUFFERED=1 python scripts/paired_anchor.py --rounds 15 --out $OUT          # after a build

Why: a benchmark run times each method once, and the causal S=8192 cell against SDPA is_causal has flipped between
0.98 and 1.04 over sessions 13-19 while each side's own run-to-run spread is 2-4 %.  One run cannot say whether
STOF is ahead, behind or level.  Here every round times every method of a cell once, in a shuffled order, and the
per-round ratio (anchor time / STOF time) is what is summarised: its median over rounds and a 95 % bootstrap
interval of that median.  Clock and thermal drift hit both sides of a round alike.

Cells:
* causal, S in --sizes: STOF (the pre-search's first choice and every tactic in --tactics) against
  SDPA is_causal with PyTorch's default dispatch (the issue's anchor) and, for reference, with each backend forced
  (cuDNN, flash; a backend that refuses the problem is left out);
* sliding ±128 at --sliding-size: STOF (pre-search pick) against the roofline floor of docs/performance.md
  (max of q, k, v read and o written at the copy bandwidth, the allowed 64x64 tiles' FLOPs at the fp16 matmul
  rate), both measured in every round; and, where nvidia-cudnn-frontend is installed, cuDNN's own band kernel
  (scripts/cudnn_band.py) against both.

Every STOF output is compared with SDPA's (relative error; a run whose STOF output disagrees stops with an error).
Times: triton.testing.do_bench medians (CUDA events, L2 flushed before each call).  Writes paired_anchor.json
(every round's times) and paired_anchor.md (the summary table) under --out.  Needs a CUDA GPU: a benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_ci(x, n_boot=4000, seed=0):
    """Median of x and a 95 % percentile-bootstrap interval of the median."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    boots = np.median(x[rng.integers(0, len(x), size=(n_boot, len(x)))], axis=1)
    return float(np.median(x)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def add_problem_args(ap):
    """--batch, --heads, --dim (fp16 [B, H, S, D] q/k/v) and --out, as this script and power_clock.py take them."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--out", required=True)


def rel_err(x, ref):
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def checked_runner(q, k, v, dl, tactic, ref, where):
    """A STOF Runner whose output (poisoned first) matches ref within fp16's tolerance; exits otherwise."""
    import torch

    from stof_trt.kernels import Runner

    r = Runner(q, k, v, dl, tactic=tactic)
    r.out.fill_(float("nan"))
    r()
    torch.cuda.synchronize()
    err = rel_err(r.out, ref)
    if not err < 2e-3:
        sys.exit(f"{Path(sys.argv[0]).stem}: STOF tactic {tactic} differs from SDPA at {where}: rel err {err:.2e}")
    return r


# The roofline floor's ingredients, timed in the rounds beside the methods: a 512 MiB device copy (1 GiB of traffic)
# and an 8192^3 fp16 matmul.  They run last in a round, then the GPU rests: the matmul holds the board at its 700 W
# limit for its whole do_bench, and whatever ran right after it ran 5-20 % slower at a lowered clock (session 29's
# rounds, where they were shuffled in with the methods).
FLOOR_METHODS = ("copy", "matmul")
COPY_ELEMS, MATMUL_N = 256 * 1024 * 1024, 8192
REST_AFTER_FLOOR_S = 0.5


def sdpa_backend_methods(q, k, v, ref, is_causal=False, where=""):
    """{"sdpa_cudnn": fn, "sdpa_flash": fn}: SDPA with each backend forced, for those that accept (q, k, v) and match
    ref within fp16's tolerance; a backend that refuses the problem is left out with a note on stderr."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        try:
            o = fn()
            if o.is_cuda:
                torch.cuda.synchronize()
        except RuntimeError as e:  # the backend refuses this problem: not an anchor here
            print(f"{Path(sys.argv[0]).stem}: {name} unavailable{where}: {str(e)[:120]}", file=sys.stderr)
            continue
        if rel_err(o, ref) < 2e-3:
            out[name] = fn
        else:
            print(f"{Path(sys.argv[0]).stem}: {name} differs from the reference{where}: left out", file=sys.stderr)
    return out


def floor_methods():
    """{"copy": fn, "matmul": fn} over buffers of their own, for time_round and roofline_floor_ms."""
    import torch

    x = torch.randn(COPY_ELEMS, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    return {"copy": lambda: y.copy_(x), "matmul": lambda: a @ b}


def copy_bandwidth(ms):
    """Bytes per second of floor_methods' copy (read + write) that took ms."""
    return 2 * COPY_ELEMS * 2 / (ms * 1e-3)


def matmul_rate(ms):
    """FLOP per second of floor_methods' matmul that took ms."""
    return 2 * MATMUL_N**3 / (ms * 1e-3)


def roofline_floor_ms(rd, nbytes, tile_flops):
    """The floor of docs/performance.md from the copy and matmul times in rd (ms): max(q, k, v read and o written
    at the copy's bandwidth, the allowed tiles' FLOPs at the matmul's rate), in ms."""
    return max(nbytes / copy_bandwidth(rd["copy"]), tile_flops / matmul_rate(rd["matmul"])) * 1e3


def time_round(methods, bench, seed):
    """One round: every method of `methods` ({name: callable}) timed once by bench(fn), in an order shuffled by
    seed (so that drift does not always favour the same one), the floor's ingredients (FLOOR_METHODS) last and
    followed by a rest; {name: ms}."""
    import time

    names = [n for n in methods if n not in FLOOR_METHODS]
    random.Random(seed).shuffle(names)
    last = [n for n in FLOOR_METHODS if n in methods]
    rec = {n: bench(methods[n]) for n in names + last}
    if last:
        time.sleep(REST_AFTER_FLOOR_S)
    return rec


def verdict(lo, hi):
    if lo > 1.0:
        return "STOF ahead"
    if hi < 1.0:
        return "STOF behind"
    return "tie (interval holds 1)"


def floor_verdict(lo, hi, target=1.3):
    """The sliding target's verdict on a time / floor interval."""
    return "met" if hi <= target else ("not met" if lo > target else "undecided")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,4096,8192", help="causal sequence lengths")
    ap.add_argument("--sliding-size", type=int, default=4096, help="sliding ±128 cell's S (0: none)")
    ap.add_argument("--tactics", default="29", help="STOF tactics timed besides the pre-search pick (comma list)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per measurement")
    add_problem_args(ap)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton.testing

    from stof_trt import presearch
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, list_tactics, tactic_info
    from stof_trt.masks import parse_mask

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    B, H, D = a.batch, a.heads, a.dim
    gpu = presearch.gpu_props()
    dev = torch.cuda.get_device_properties(0)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=a.rep, return_mode="median")

    # methods[cell] = {name: callable}; checks before timing
    cells = {}
    extra = [int(t) for t in a.tactics.split(",") if t.strip()]
    for S in [int(s) for s in a.sizes.split(",") if s.strip()]:
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        layout = compile_mask(parse_mask("causal"), S, S)
        dl = DeviceLayout(layout)
        pick = presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu)[0][0]
        valid = set(list_tactics(q, k, v, dl))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        m = {}
        for t in [pick] + [t for t in extra if t != pick]:
            if t not in valid:
                print(f"paired_anchor: tactic {t} not valid for causal S={S}: left out", file=sys.stderr)
                continue
            m[f"stof_{t}" + ("_pick" if t == pick else "")] = checked_runner(q, k, v, dl, t, ref, f"causal S={S}")
        m["sdpa_causal"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        m.update(sdpa_backend_methods(q, k, v, ref, is_causal=True, where=f" at S={S}"))
        cells[f"causal:{S}"] = {"S": S, "mask": "causal", "pick": pick, "methods": m, "keep": (q, k, v, dl)}

    if a.sliding_size:
        S = a.sliding_size
        g = torch.Generator(device="cuda").manual_seed(S + 1)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        mask = parse_mask("sliding:window=128")
        layout = compile_mask(mask, S, S)
        dl = DeviceLayout(layout)
        pick = presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu)[0][0]
        dense = torch.from_numpy(mask.dense(S, S)).cuda()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None])
        r = checked_runner(q, k, v, dl, pick, ref, f"sliding S={S}")
        methods = {f"stof_{pick}_pick": r, **floor_methods()}
        from cudnn_band import try_band_anchor  # cuDNN's own band kernel, where nvidia-cudnn-frontend is installed

        cb, why = try_band_anchor(q, k, v, mask.right, ref)
        if cb is not None:
            methods["cudnn_band"] = cb
        else:
            print(f"paired_anchor: no cuDNN band anchor: {why}", file=sys.stderr)
        cells[f"sliding:{S}"] = {
            "S": S, "mask": "sliding", "pick": pick, "keep": (q, k, v, dl),
            "methods": methods,
            "bytes": 4 * B * H * S * D * 2, "tile_flops": 4.0 * B * H * D * layout.nnz * layout.tile_m * layout.tile_n,
        }

    print(f"device {dev.name}; B={B} H={H} D={D} fp16; {a.rounds} rounds; cells: {', '.join(cells)}", flush=True)
    rounds = []
    t_start = time.time()
    for rd in range(a.rounds):
        rec = {}
        for cname, c in cells.items():
            rec[cname] = time_round(c["methods"], bench, 1000 * rd + len(cname))
        rounds.append(rec)
        print(f"round {rd + 1}/{a.rounds} [{time.time() - t_start:.0f}s] " + "; ".join(
            f"{cn}: " + " ".join(f"{n}={t:.4f}" for n, t in sorted(r.items())) for cn, r in rec.items()), flush=True)

    rows = []
    for cname, c in cells.items():
        per = [r[cname] for r in rounds]
        names = list(per[0])
        med = {n: float(np.median([p[n] for p in per])) for n in names}
        stof = [n for n in names if n.startswith("stof_")]
        if c["mask"] == "causal":
            for sn in stof:
                for an in [n for n in names if n.startswith("sdpa")]:
                    ratio = [p[an] / p[sn] for p in per]
                    m_, lo, hi = median_ci(ratio)
                    rows.append({"cell": cname, "stof": sn, "anchor": an, "stof_ms": med[sn], "anchor_ms": med[an],
                                 "ratio": m_, "lo": lo, "hi": hi, "verdict": verdict(lo, hi),
                                 "target": "anchor/STOF >= 1.0"})
        else:
            copy_bw = [copy_bandwidth(p["copy"]) for p in per]
            mm_rate = [matmul_rate(p["matmul"]) for p in per]
            floor = [roofline_floor_ms(p, c["bytes"], c["tile_flops"]) for p in per]
            if "cudnn_band" in names:
                ratio = [p["cudnn_band"] / f for p, f in zip(per, floor)]
                m_, lo, hi = median_ci(ratio)
                rows.append({"cell": cname, "stof": "-", "anchor": "cuDNN band / floor", "stof_ms": float("nan"),
                             "anchor_ms": med["cudnn_band"], "ratio": m_, "lo": lo, "hi": hi,
                             "verdict": floor_verdict(lo, hi), "target": "(reference) cuDNN/floor <= 1.3"})
                for sn in stof:
                    m_, lo, hi = median_ci([p["cudnn_band"] / p[sn] for p in per])
                    rows.append({"cell": cname, "stof": sn, "anchor": "cudnn_band", "stof_ms": med[sn],
                                 "anchor_ms": med["cudnn_band"], "ratio": m_, "lo": lo, "hi": hi,
                                 "verdict": verdict(lo, hi), "target": "anchor/STOF >= 1.0"})
            for sn in stof:
                ratio = [p[sn] / f for p, f in zip(per, floor)]
                m_, lo, hi = median_ci(ratio)
                rows.append({"cell": cname, "stof": sn, "anchor": "floor", "stof_ms": med[sn],
                             "anchor_ms": float(np.median(floor)), "ratio": m_, "lo": lo, "hi": hi,
                             "verdict": floor_verdict(lo, hi), "target": "STOF/floor <= 1.3",
                             "copy_tb_s": float(np.median(copy_bw)) / 1e12,
                             "matmul_tflop_s": float(np.median(mm_rate)) / 1e12})

    md = [f"Paired rounds: {a.rounds} (each round times every method of a cell once, shuffled); device {dev.name}; "
          f"B={B} H={H} D={D} fp16; do_bench rep {a.rep} ms; ratio = median over rounds of the per-round ratio, "
          f"[95 % bootstrap interval of that median].", "",
          "| cell | STOF | anchor | STOF ms | anchor ms | ratio [95 %] | target | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stof_ms = f"{r['stof_ms']:.4f}" if r["stof_ms"] == r["stof_ms"] else "-"  # NaN: a row without STOF
        md.append(f"| {r['cell']} | {r['stof']} | {r['anchor']} | {stof_ms} | {r['anchor_ms']:.4f} | "
                  f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] | {r['target']} | {r['verdict']} |")
    text = "\n".join(md)
    print(text, flush=True)
    (out / "paired_anchor.md").write_text(text + "\n")
    (out / "paired_anchor.json").write_text(json.dumps(
        {"argv": sys.argv, "device": dev.name, "rounds": rounds, "summary": rows,
         "picks": {cn: tactic_info(c["pick"]).name for cn, c in cells.items()}}, indent=1))


if __name__ == "__main__":
    main()
