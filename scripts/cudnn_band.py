#!/usr/bin/env python3
"""cuDNN's own banded attention (a sliding window, |q - k| <= window) as an anchor for the sliding cells.

    PYTHONUNBUFFERED=1 python scripts/cudnn_band.py --sizes 1024,2048,4096,8192 --dims 64,128 --out $OUT

Why: the issue's sliding target (STOF within 1.3x of the roofline floor at S=4096) has stood unmet for many sessions
at a step cost equal to cuDNN's dense kernel (docs/performance.md).  SDPA cannot pass cuDNN a band (only a boolean
mask, or is_causal), so none of the issue's anchors is a kernel made for the band.  cuDNN's graph API takes one: its
SDPA node's diagonal band bounds (nvidia-cudnn-frontend, a PyPI wheel; the GPU machine lacks it, so it travels as a
staged wheel: STOF_EXTRA_WHEELS in scripts/device_kernels.sh).  This is NVIDIA's own sliding-window kernel on the same
GPU: the reference made for this mask.

`CudnnBand(q, k, v, left, right)` builds the graph once (fp16/bf16 [B, H, S, D] q/k/v, S_q = S_k) and runs it on the
current stream; `band_anchor(q, k, v, window, ref)` returns one whose output matches ref and a float64 reference (the
bound's convention, inclusive or not, is settled that way rather than assumed), run by the fastest of cuDNN's plans;
`try_band_anchor` returns (None, why) instead of raising, for the benchmarks that leave the anchor out where it
cannot be had.  Standalone, the script times STOF (the pre-search pick), the cuDNN band and the roofline floor in
paired rounds per cell (paired_anchor.time_round: the floor's copy and matmul last) and writes cudnn_band.json /
cudnn_band.md under --out; a cell without the anchor makes it exit non-zero.  Needs a CUDA GPU and the wheel: a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_anchor import (checked_runner, floor_methods, median_ci, rel_err, roofline_floor_ms,  # noqa: E402
                           time_round)


class CudnnBand:
    """cuDNN SDPA with keys j allowed for query i when i - left < j <= i + right (left = right + 1 for
    |i - j| <= right under the "exclusive left bound" convention; band_anchor finds which one holds)."""

    _UIDS = [1, 2, 3, 4]  # q, k, v, o

    def __init__(self, q, k, v, left: int, right: int, scale: float | None = None):
        import cudnn
        import torch

        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[q.dtype]
        self.q, self.k, self.v = q, k, v
        self.out = torch.empty_like(q)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        g = cudnn.pygraph(handle=self.handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
        ts = [g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=io, uid=u)
              for n, t, u in zip("qkv", (q, k, v), self._UIDS)]
        o, _ = g.sdpa(name="band", q=ts[0], k=ts[1], v=ts[2], generate_stats=False,
                      attn_scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                      diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                      diagonal_band_left_bound=left, diagonal_band_right_bound=right)
        o.set_uid(self._UIDS[3]).set_output(True).set_dim(list(self.out.shape)).set_stride(
            list(self.out.stride())).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.left, self.right = left, right
        self.index = None  # None: the graph's selected plan (execute); else the plan run by execute_plan_at_index
        self.plan = "heuristics' first"
        self.plan_ms: dict[str, float] = {}
        self._size_workspace()

    def _size_workspace(self):
        import torch

        n = (self.graph.get_workspace_size() if self.index is None
             else self.graph.get_workspace_size_plan_at_index(self.index))
        self.workspace = torch.empty(max(n, 1), device=self.q.device, dtype=torch.uint8)

    def __call__(self):
        pack = [self.q, self.k, self.v, self.out]
        if self.index is None:
            self.graph.execute(pack, self.workspace, handle=self.handle, tensor_uids=self._UIDS)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, index=self.index, handle=self.handle,
                                             tensor_uids=self._UIDS)
        return self.out

    def __del__(self):
        try:
            import cudnn

            cudnn.destroy_handle(self.handle)
        except Exception:  # noqa: BLE001 -- at interpreter exit the module may be gone
            pass

    def autotune(self, iters: int = 20) -> None:
        """Time every plan cuDNN offers for the graph (heuristics A + fallback, all built) and run the fastest from
        then on, by its index, so the anchor is cuDNN at its best rather than its heuristics' first guess.  Plans
        that fail to build or run are skipped.  If the list cannot be walked, the graph's selected plan stays (which
        building all plans may have changed: the workspace is sized again and self.plan says so).  The caller checks
        the output again (band_anchor)."""
        import cudnn
        import torch

        g = self.graph
        try:
            g.build_plans(cudnn.build_plan_policy.ALL)
            n = g.get_execution_plan_count()
        except Exception as e:  # noqa: BLE001 -- cudnn's own exception types
            self.plan = f"the graph's selected plan (plan list unavailable: {str(e).splitlines()[0][:120]})"
            self._size_workspace()
            return
        best = None
        for i in range(n):
            try:
                name = g.get_plan_name_at_index(i)
                ws = torch.empty(max(g.get_workspace_size_plan_at_index(i), 1), device=self.q.device,
                                 dtype=torch.uint8)

                def run(i=i, ws=ws):
                    g.execute_plan_at_index([self.q, self.k, self.v, self.out], ws, index=i, handle=self.handle,
                                            tensor_uids=self._UIDS)

                for _ in range(3):
                    run()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    run()
                end.record()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 -- a plan that cannot build or run here is not a candidate
                continue
            ms = start.elapsed_time(end) / iters
            self.plan_ms[f"{i}:{name}"] = ms
            if best is None or ms < best[0]:
                best = (ms, i, name)
        if best is None:
            self.plan = "the graph's selected plan (no plan of the list ran)"
        else:
            self.index, self.plan = best[1], f"{best[1]}:{best[2]}"
        self._size_workspace()


def band_reference64(q, k, v, window: int, b: int = 0, h: int = 0):
    """float64 attention of one (batch, head) under |i - j| <= window, scale 1/sqrt(D)."""
    import torch

    q64, k64, v64 = (t[b, h].double() for t in (q, k, v))
    s = q64 @ k64.T / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)
    s.masked_fill_((i[:, None] - i[None, :]).abs() > window, float("-inf"))
    return torch.softmax(s, -1) @ v64


def band_anchor(q, k, v, window: int, ref, tol: float = 2e-3, autotune: bool = True):
    """A CudnnBand for |i - j| <= window whose output (poisoned first) is within tol of ref and, on the first and
    the last (batch, head), of a float64 reference; the left bound's convention (window or window + 1) is the one
    that matches.  With autotune, every cuDNN plan of the matching graph is timed, the fastest kept and the output
    checked again.  Raises RuntimeError: the wheel is not installed, cuDNN fails to build the graph for both
    conventions (its error is named), or no output matches."""
    import torch

    try:
        import cudnn  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- absent, or present without a cuDNN library it can load
        raise RuntimeError(f"nvidia-cudnn-frontend is not usable here ({type(e).__name__}: {e})") from None
    B, H = q.shape[0], q.shape[1]
    refs64 = {(b, h): band_reference64(q, k, v, window, b, h) for b, h in {(0, 0), (B - 1, H - 1)}}

    def check(bd):
        bd.out.fill_(float("nan"))
        bd()
        torch.cuda.synchronize()
        errs = [rel_err(bd.out, ref)] + [rel_err(bd.out[b, h], r64) for (b, h), r64 in refs64.items()]
        return max(errs) < tol, errs  # NaN fails

    notes = {}
    for left in (window + 1, window):
        try:
            bd = CudnnBand(q, k, v, left=left, right=window)
        except Exception as e:  # noqa: BLE001 -- cudnn raises its own exception types
            notes[left] = f"cuDNN error {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        ok, errs = check(bd)
        if not ok:
            notes[left] = "rel err " + ", ".join(f"{e:.2e}" for e in errs) + " (vs ref, then float64 heads)"
            continue
        if autotune:
            bd.autotune()
            ok, errs = check(bd)
            if not ok:
                raise RuntimeError(f"cuDNN band plan {bd.plan} differs after tuning: rel err {errs}")
        bd.rel_err, bd.rel_err64 = errs[0], max(errs[1:])
        return bd
    raise RuntimeError(f"no cuDNN band matches |q-k| <= {window}: " + "; ".join(f"left={l}: {m}" for l, m in notes.items()))


def try_band_anchor(q, k, v, window: int, ref):
    """band_anchor or (None, why): the benchmarks leave the anchor out where it cannot be had, and say why."""
    try:
        return band_anchor(q, k, v, window, ref), ""
    except RuntimeError as e:
        return None, str(e)[:300]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--dims", default="64")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per measurement")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton.testing

    from stof_trt import presearch
    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, tactic_info
    from stof_trt.masks import parse_mask

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    B, H = a.batch, a.heads
    gpu = presearch.gpu_props()
    dev = torch.cuda.get_device_properties(0)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=a.rep, return_mode="median")

    def write(rows, raw, missing):
        (out / "cudnn_band.json").write_text(json.dumps(
            {"argv": sys.argv, "device": dev.name, "summary": rows, "missing": missing, "rounds": raw}, indent=1))

    floor_fns = floor_methods()
    rows, raw, missing = [], {}, {}
    t0 = time.time()
    for D in [int(d) for d in a.dims.split(",")]:
        for S in [int(s) for s in a.sizes.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(S + D)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
            mask = parse_mask(f"sliding:window={a.window}")
            layout = compile_mask(mask, S, S)
            dl = DeviceLayout(layout)
            pick = presearch.rank(layout, batch=B, heads=H, head_dim=D, gpu=gpu)[0][0]
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask.dense(S, S)).cuda()[None, None])
            r = checked_runner(q, k, v, dl, pick, ref, f"D={D} S={S}")  # poisoned, checked; exits otherwise
            cb, why = try_band_anchor(q, k, v, a.window, ref)
            if cb is None:
                print(f"cudnn_band: D={D} S={S}: {why}", file=sys.stderr, flush=True)
                missing[f"{D}:{S}"] = why
                write(rows, raw, missing)
                continue
            methods = {"stof": r, "cudnn_band": cb, **floor_fns}
            per = [time_round(methods, bench, 1000 * rd + S + D) for rd in range(a.rounds)]
            nbytes = 4 * B * H * S * D * 2
            tile_flops = 4.0 * B * H * D * layout.nnz * layout.tile_m * layout.tile_n
            floor = [roofline_floor_ms(p, nbytes, tile_flops) for p in per]
            st = median_ci([p["stof"] / f for p, f in zip(per, floor)])
            cu = median_ci([p["cudnn_band"] / f for p, f in zip(per, floor)])
            sp = median_ci([p["cudnn_band"] / p["stof"] for p in per])
            row = {"D": D, "S": S, "pick": tactic_info(pick).name, "cudnn_left_bound": cb.left,
                   "cudnn_plan": cb.plan, "cudnn_plan_ms": cb.plan_ms,
                   "stof_ms": float(np.median([p["stof"] for p in per])),
                   "cudnn_band_ms": float(np.median([p["cudnn_band"] for p in per])),
                   "floor_ms": float(np.median(floor)),
                   "stof_over_floor": st, "cudnn_over_floor": cu, "cudnn_over_stof": sp,
                   "rel_err_stof": rel_err(r.out, ref), "rel_err_cudnn": cb.rel_err, "rel_err64_cudnn": cb.rel_err64}
            rows.append(row)
            raw[f"{D}:{S}"] = per
            write(rows, raw, missing)  # a later failure keeps the cells measured so far
            print(f"[{time.time() - t0:.0f}s] D={D} S={S}: cuDNN plans {cb.plan_ms}, kept {cb.plan}", flush=True)
            print(f"[{time.time() - t0:.0f}s] D={D} S={S}: STOF {row['stof_ms']:.4f} ms ({st[0]:.3f}x floor), "
                  f"cuDNN band {row['cudnn_band_ms']:.4f} ms ({cu[0]:.3f}x floor), cuDNN / STOF {sp[0]:.3f} "
                  f"[{sp[1]:.3f}, {sp[2]:.3f}]", flush=True)
            del methods, cb, r

    md = [f"Sliding |q-k| <= {a.window}: STOF (pre-search pick) against cuDNN's own band kernel (cudnn frontend SDPA, "
          f"diagonal band bounds, the fastest of its plans) and the roofline floor; {a.rounds} paired rounds; device "
          f"{dev.name}; B={B} H={H} fp16; ratio = median of per-round ratios [95 % bootstrap interval].", "",
          "| D | S | STOF tactic | STOF ms | cuDNN band ms | floor ms | STOF / floor | cuDNN / floor | cuDNN / STOF |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['D']} | {r['S']} | {r['pick']} | {r['stof_ms']:.4f} | {r['cudnn_band_ms']:.4f} | "
                  f"{r['floor_ms']:.4f} | {r['stof_over_floor'][0]:.3f} | {r['cudnn_over_floor'][0]:.3f} "
                  f"[{r['cudnn_over_floor'][1]:.3f}, {r['cudnn_over_floor'][2]:.3f}] | {r['cudnn_over_stof'][0]:.3f} "
                  f"[{r['cudnn_over_stof'][1]:.3f}, {r['cudnn_over_stof'][2]:.3f}] |")
    md += [f"- D={c.split(':')[0]} S={c.split(':')[1]}: no cuDNN band anchor: {why}" for c, why in missing.items()]
    text = "\n".join(md)
    print(text, flush=True)
    (out / "cudnn_band.md").write_text(text + "\n")
    if missing:  # the anchor is this script's purpose: a cell without it is a failed run
        sys.exit(f"cudnn_band: no cuDNN band anchor in {len(missing)} of {len(missing) + len(rows)} cells")


if __name__ == "__main__":
    main()
