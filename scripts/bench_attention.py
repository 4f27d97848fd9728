#!/usr/bin/env python3
"""Benchmark STOF's sparse attention against the 2026 frontier (issue 38).  Needs a CUDA GPU.

    PYTHONUNBUFFERED=1 python scripts/bench_attention.py --out $OUT                 # issue 38's grid, fp16
    python scripts/bench_attention.py --dtype bf16 --out $OUT                       # the same grid in bf16
    python scripts/bench_attention.py --dims 128 --sizes 8192 --masks causal,sliding --out /tmp/b
    python scripts/bench_attention.py --quick --out /tmp/b                          # smoke run (two cells)

In one process, on the same q/k/v ([B, H, S, D], B=8, H=12 by default), per cell (head dim D, length S, mask of
stof_trt.bench.masks):

* STOF default: the library's first choice with no tactic cache, no first-use timing and no calibration profile
  (select_tactic on a fresh layout handle; STOF_PRESEARCH_PROFILE is removed from the environment);
* STOF tuned: select_tactic(timing=True) with a fresh temporary cache file (first-use timing), then that tactic;
  null, with the reason in the run file, where the library has no first-use timing;
* STOF best: every valid tactic (list_tactics) run once against the reference and timed with a short do_bench,
  the --top fastest timed again properly: the fastest of those;
* the anchors that compute the mask (stof_trt.bench.anchors.anchors_for): FlashAttention-4 natively (causal;
  window (128, 128) for sliding; [B, S, H, D] copies made outside the timed region), FlexAttention with the FLASH
  backend (FA4's CuTe DSL kernel) and with its Triton default on the same BlockMask, SDPA is_causal and with its
  cuDNN and flash backends forced (causal), SDPA with the boolean mask, cuDNN's band kernel (sliding, where
  nvidia-cudnn-frontend is installed).

Every output (each STOF tactic, each anchor) is checked against an fp32 reference of the cell
(stof_trt.bench.stats.check_output); an anchor whose output is wrong is reported and left out of "fastest
anchor", one that cannot run here is recorded with its reason.  Times: triton do_bench medians (CUDA events) with
warm-up; causal cells also time STOF (tuned, else best) against the fastest anchor in --causal-rounds interleaved
rounds (median per-round ratio with a 95 % bootstrap interval).

Writes DIR/attention.json (a list of cells in issue 38's keys: D, S, mask, stof_default_ms, stof_tuned_ms,
stof_best_ms, anchors, rel_err, and extra keys), DIR/attention.md (table and targets) and DIR/attention-run.json
(run metadata, summary, and the cells with every tactic's time, which stof_trt.presearch.calibrate reads); a
killed run leaves DIR/attention.partial.json.  docs/results/README.md describes the files.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stof_trt.bench.anchors import ANCHOR_NAMES, anchors_for
from stof_trt.bench.masks import MASKS, mask_mod_for
from stof_trt.bench.report import clean, write_results
from stof_trt.bench.stats import TOL, check_output, paired_ratio

GRIDS = {"issue38": {"dims": "64,128", "sizes": "2048,4096,8192", "masks": ",".join(MASKS)}}
QUICK = {"dims": "64", "sizes": "2048", "masks": "causal,sliding"}
DEVICE = "cuda"  # the tests run the loop on the CPU with the library and timer faked


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default="issue38", choices=sorted(GRIDS), help="the cells (default: issue38)")
    ap.add_argument("--dims", help="head dims, comma-separated (overrides the grid's)")
    ap.add_argument("--sizes", help="sequence lengths, comma-separated (overrides the grid's)")
    ap.add_argument("--masks", help=f"masks, comma-separated, of {', '.join(MASKS)} (overrides the grid's)")
    ap.add_argument("--quick", action="store_true", help="smoke run: D=64, S=2048, causal and sliding, short "
                    "timings, no paired rounds")
    ap.add_argument("--dtype", default="fp16", choices=sorted(TOL))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) of every reported time")
    ap.add_argument("--screen-rep", type=int, default=10, help="do_bench rep (ms) of the one-pass tactic screen")
    ap.add_argument("--top", type=int, default=3, help="tactics of the screen timed again with --rep")
    ap.add_argument("--anchors", default=",".join(ANCHOR_NAMES),
                    help=f"anchors to run, comma-separated, of {', '.join(ANCHOR_NAMES)}")
    ap.add_argument("--no-flex", action="store_true", help="leave out both FlexAttention anchors")
    ap.add_argument("--causal-rounds", type=int, default=5, metavar="N",
                    help="causal cells: also time STOF (tuned, else best) and the fastest anchor in N interleaved "
                         "rounds and report the median per-round ratio with a 95%% bootstrap interval (0: off)")
    ap.add_argument("--no-row-order", action="store_true",
                    help="run the STOF kernels in the default row order, not the layout's longest-first one")
    ap.add_argument("--sched-chunk", type=int, default=None, metavar="N",
                    help="sched_chunk for the STOF kernels (default: the layout's value)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--name", default="attention", help="file stem of the outputs")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="start no new cell after this long; write the cells measured (meta: stopped_early)")
    ap.add_argument("--merge", metavar="RUN,RUN", help="no timing: merge the cells of runs' attention-run.json files "
                    "(e.g. a --dims 64 and a --dims 128 run, each under the 10-minute limit of one call) into --out")
    ap.add_argument("--against", metavar="JSON", help="another run's attention.json (e.g. fp16's, for a bf16 run): "
                    "the summary adds this run's STOF times over that one's per cell (target: within 3 %%)")
    args = ap.parse_args(argv)
    grid = dict(GRIDS[args.grid])
    if args.quick:
        grid = dict(QUICK)
        args.rep, args.screen_rep, args.top, args.causal_rounds = 20, 5, 2, 0
    for key in ("dims", "sizes", "masks"):
        if getattr(args, key) is None:
            setattr(args, key, grid[key])
    try:
        args.dim_list = [int(d) for d in args.dims.split(",")]
        args.size_list = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error("--dims and --sizes take comma-separated integers")
    if args.against and not Path(args.against).is_file():
        ap.error(f"--against: no file {args.against}")
    args.merge_list = [m for m in (args.merge or "").split(",") if m]
    for m in args.merge_list:
        if not Path(m).is_file():
            ap.error(f"--merge: no file {m}")
    args.mask_list = args.masks.split(",")
    bad = [m for m in args.mask_list if m not in MASKS]
    if bad:
        ap.error(f"unknown mask {bad[0]!r}: one of {', '.join(MASKS)}")
    args.anchor_list = [a for a in args.anchors.split(",") if a]
    bad = [a for a in args.anchor_list if a not in ANCHOR_NAMES]
    if bad:
        ap.error(f"unknown anchor {bad[0]!r}: one of {', '.join(ANCHOR_NAMES)}")
    if args.no_flex:
        args.anchor_list = [a for a in args.anchor_list if a not in ("flex", "flex_fa4")]
    return args


def _why(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:240] if lines else ''}"


def _version(dist: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def reference(q, k, v, dense):
    """fp32 masked attention ([B, H, S, D]) by SDPA's math backend (fp32 matmuls, no TF32 unless the caller
    allows it), one batch element at a time (a few GiB at S=8192); rows without an allowed key are zero, as STOF
    writes them."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    am = dense[None, None]
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    with sdpa_kernel([SDPBackend.MATH]):
        for b in range(q.shape[0]):
            out[b:b + 1] = F.scaled_dot_product_attention(q[b:b + 1].float(), k[b:b + 1].float(),
                                                          v[b:b + 1].float(), attn_mask=am)
    return torch.where(dense.any(-1)[None, None, :, None], out, torch.zeros_like(out))


def merge(args) -> int:
    """Write the cells of several runs (their attention-run.json) as one run, in grid order."""
    runs = []
    for m in args.merge_list:
        try:
            run = json.loads(Path(m).read_text())
            runs.append((run["meta"], run["cells"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"bench_attention: --merge: {m} is not an attention-run.json ({_why(e)})", file=sys.stderr)
            return 2
    order = {m: i for i, m in enumerate(MASKS)}
    cells = sorted((c for _, cs in runs for c in cs), key=lambda c: (c["D"], c["S"], order.get(c["mask"], 99)))
    meta = dict(runs[0][0], merged_from=args.merge_list, argv=sys.argv,
                wall_s=sum(m.get("wall_s") or 0 for m, _ in runs))
    if len({(m.get("gpu"), m.get("dtype")) for m, _ in runs}) > 1:
        print("bench_attention: --merge: the runs differ in GPU or dtype", file=sys.stderr)
        return 2
    write_results(cells, args.out, args.name, meta=meta, title=f"Attention, {meta.get('gpu')}, {meta.get('dtype')}",
                  against=args.against)
    print((Path(args.out) / f"{args.name}.md").read_text())
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.merge_list:
        return merge(args)
    # the default path is the uncalibrated one: no per-GPU profile, whatever the caller's environment holds
    profile_env = os.environ.pop("STOF_PRESEARCH_PROFILE", None)

    import torch
    import torch.nn.functional as F
    import triton.testing

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, list_tactics, select_tactic, tactic_info
    from stof_trt.masks import parse_mask

    from stof_trt.bench.anchors import (AnchorUnavailable, attention_bytes, copy_bandwidth, fa4_method,
                                        flex_method, floor_methods, matmul_rate, roofline_floor_ms, tile_flops,
                                        try_band_anchor)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tol = TOL[args.dtype]
    torch.manual_seed(0)
    grad_was = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # forward only: no autograd context in FA4's or Flex's calls
    gpu = torch.cuda.get_device_name(0)
    has_timing = "timing" in inspect.signature(select_tactic).parameters
    no_timing = {"timing": False} if has_timing else {}
    tuned_why = None if has_timing else ("stof_trt.kernels.select_tactic has no timing= parameter: this library "
                                         "has no first-use timing (stof_tuned_ms is null)")
    if tuned_why:
        print(f"bench_attention: {tuned_why}", file=sys.stderr)

    def bench(fn, rep=args.rep, warmup=25):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    # the roofline floor's ingredients, measured in this run (extra key floor_ms: STOF best / floor says how far
    # from the hardware a cell is)
    fm = floor_methods()
    t_floor = {n: bench(fn) for n, fn in fm.items()}
    del fm

    flex = create_block_mask = None
    flex_why = None
    if {"flex", "flex_fa4"} & set(args.anchor_list):
        try:
            import torch._dynamo
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            torch._dynamo.config.cache_size_limit = 1000
            torch._dynamo.config.accumulated_cache_size_limit = 4000
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # noqa: BLE001 -- a torch without FlexAttention
            flex_why = f"FlexAttention is not usable here ({_why(e)})"

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 -- no git on the machine
        commit = None
    meta = {"gpu": gpu, "dtype": args.dtype, "batch": args.batch, "heads": args.heads, "argv": sys.argv,
            "torch": torch.__version__, "flash_attn_4": _version("flash-attn-4"),
            "cudnn_frontend": _version("nvidia-cudnn-frontend"), "python": platform.python_version(),
            "stof_kernels_lib": os.environ.get("STOF_KERNELS_LIB"), "commit": commit,
            "first_use_timing": has_timing, "presearch_profile_env_removed": profile_env,
            "copy_TBps": copy_bandwidth(t_floor["copy"]) / 1e12,
            "fp16_matmul_TFLOPs": matmul_rate(t_floor["matmul"]) / 1e12,
            "tolerance": {"rel_err": tol}, "rep_ms": args.rep, "screen_rep_ms": args.screen_rep, "top": args.top}
    print(f"bench_attention: {gpu}, {args.dtype}, B={args.batch} H={args.heads}, dims {args.dim_list}, sizes "
          f"{args.size_list}, masks {args.mask_list}, anchors {args.anchor_list}; first-use timing: "
          f"{'yes' if has_timing else 'no'}", flush=True)

    B, H = args.batch, args.heads
    runner_kw = {"row_order": not args.no_row_order, "sched_chunk": args.sched_chunk}
    cells = []
    t_start = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="stof-bench-")
    for D in args.dim_list:
        for S in args.size_list:
            if "stopped_early" in meta:
                break
            q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) for _ in range(3))
            t_dense = bench(lambda: F.scaled_dot_product_attention(q, k, v))
            for mname in args.mask_list:
                if args.time_limit is not None and time.time() - t_start > args.time_limit:
                    meta.setdefault("stopped_early", f"--time-limit {args.time_limit:g} s reached before D={D} "
                                                     f"S={S} {mname}")
                    break
                t0 = time.time()
                mask = parse_mask(MASKS[mname])
                layout = compile_mask(mask, S, S)
                dense = torch.from_numpy(mask.dense(S, S)).to(DEVICE)
                ref = reference(q, k, v, dense)
                cell = {"D": D, "S": S, "mask": mname, "stof_default_ms": None, "stof_tuned_ms": None,
                        "stof_best_ms": None, "anchors": {}, "rel_err": None, "spec": MASKS[mname], "gpu": gpu,
                        "dtype": args.dtype, "B": B, "H": H, "density": float(dense.float().mean()),
                        "sdpa_dense_ms": t_dense,
                        "floor_ms": roofline_floor_ms(t_floor, attention_bytes(B, H, S, D, q.element_size()),
                                                      tile_flops(layout, B, H, D))}

                # --- STOF: the default choice, the choice after first-use timing, every valid tactic ---------
                dl = DeviceLayout(layout)
                t_def, src = select_tactic(q, k, v, dl, **no_timing)
                cell["stof_default_tactic"], cell["stof_default_source"] = tactic_info(t_def).name, src
                t_tuned = None
                if has_timing:
                    try:
                        dl_t = DeviceLayout(layout)  # its own handle: select_tactic memoises per handle
                        path = Path(tmp.name) / f"D{D}-S{S}-{mname}.cache"
                        ts = time.time()
                        t_tuned, src_t = select_tactic(q, k, v, dl_t, tactic_cache=path, timing=True)
                        torch.cuda.synchronize()
                        cell["stof_tuning_s"] = time.time() - ts
                        cell["stof_tuned_tactic"], cell["stof_tuned_source"] = tactic_info(t_tuned).name, src_t
                        del dl_t
                    except Exception as e:  # noqa: BLE001 -- the library's error, recorded with the cell
                        cell["stof_tuned_error"] = _why(e)
                        t_tuned = None
                else:
                    cell["stof_tuned_error"] = tuned_why
                out = torch.empty_like(q)
                runners, screen, wrong, invalid, errs = {}, {}, {}, {}, {}
                valid = list_tactics(q, k, v, dl, **runner_kw)
                for tid in dict.fromkeys([*valid, t_def] + ([t_tuned] if t_tuned is not None else [])):
                    name = tactic_info(tid).name
                    try:
                        r = Runner(q, k, v, dl, out=out, tactic=tid, **runner_kw)
                        out.fill_(float("nan"))  # a tactic that writes nothing fails the check
                        r()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 -- a tactic the library refuses here
                        invalid[name] = _why(e)
                        continue
                    chk = check_output(out, ref, args.dtype)
                    errs[tid] = chk
                    if not chk["ok"]:
                        wrong[name] = chk
                        continue
                    runners[tid] = r
                    screen[tid] = bench(r, rep=args.screen_rep, warmup=2)
                top = sorted(screen, key=screen.get)[:args.top]
                precise = {tid: bench(runners[tid]) for tid in
                           dict.fromkeys(top + [t for t in (t_def, t_tuned) if t in runners])}
                cell["stof_screen_ms"] = {tactic_info(t).name: ms for t, ms in screen.items()}
                cell["stof_precise_ms"] = {tactic_info(t).name: ms for t, ms in precise.items()}
                if wrong:
                    cell["stof_wrong"] = wrong
                if invalid:
                    cell["stof_invalid"] = invalid
                best = min(precise, key=precise.get) if precise else None
                stof_err = {}
                for key, tid in (("default", t_def), ("tuned", t_tuned), ("best", best)):
                    if tid is None:
                        continue
                    cell[f"stof_{key}_tactic"] = tactic_info(tid).name
                    if tid in precise:
                        cell[f"stof_{key}_ms"] = precise[tid]
                    if tid in errs:
                        stof_err[key] = errs[tid]["rel_err"]
                cell["stof_rel_err"] = stof_err
                cell["rel_err"] = max(stof_err.values()) if stof_err else None
                # every tactic's time, the screen's where no precise one exists (presearch.calibrate reads it)
                cell["measured_ms"] = {**cell["stof_screen_ms"], **cell["stof_precise_ms"]}

                # --- anchors -----------------------------------------------------------------------------
                anchor_fns, a_err, a_wrong, a_unavail, a_setup = {}, {}, {}, {}, {}
                block_mask = None
                for name in [a for a in anchors_for(mname) if a in args.anchor_list]:
                    ts = time.time()
                    try:
                        view = None
                        if name == "fa4":
                            fn, view = fa4_method(q, k, v, mname, mask)
                        elif name in ("flex", "flex_fa4"):
                            if flex is None:
                                raise AnchorUnavailable(flex_why)
                            if block_mask is None:
                                mod = mask_mod_for(mname, mask, S, device=DEVICE)
                                block_mask = create_block_mask(mod, None, None, S, S, device=DEVICE)
                            fn = flex_method(flex, q, k, v, name, block_mask)
                        elif name == "sdpa_causal":
                            def fn():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        elif name in ("sdpa_cudnn", "sdpa_flash"):
                            from torch.nn.attention import SDPBackend, sdpa_kernel

                            be = SDPBackend.CUDNN_ATTENTION if name == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

                            def fn(be=be):
                                with sdpa_kernel([be]):
                                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        elif name == "sdpa_mask":
                            am = dense[None, None]

                            def fn(am=am):
                                return F.scaled_dot_product_attention(q, k, v, attn_mask=am)
                        elif name == "cudnn_band":
                            if mask.left != mask.right:
                                raise AnchorUnavailable("cuDNN's band anchor takes a symmetric window")
                            fn, why = try_band_anchor(q, k, v, mask.right, ref, tol=tol)
                            if fn is None:
                                raise AnchorUnavailable(why)
                            cell["cudnn_band_plan"] = fn.plan
                        else:
                            raise AnchorUnavailable(f"no anchor named {name}")
                        o = fn()
                        torch.cuda.synchronize()  # the first call compiles (FA4, Flex): its setup time
                        a_setup[name] = time.time() - ts
                        chk = check_output(view(o) if view else o, ref, args.dtype)
                        del o
                    except Exception as e:  # noqa: BLE001 -- not runnable here: recorded with its reason
                        a_unavail[name] = _why(e)
                        print(f"  {name}: unavailable at D={D} S={S} {mname}: {a_unavail[name]}", file=sys.stderr)
                        continue
                    a_err[name] = chk["rel_err"]
                    if not chk["ok"]:
                        a_wrong[name] = chk
                        print(f"  {name}: WRONG at D={D} S={S} {mname}: rel err {chk['rel_err']:.2e}, worst row "
                              f"{chk['row_err']:.2e}: left out of the fastest anchor", file=sys.stderr)
                        continue
                    cell["anchors"][name] = bench(fn)
                    anchor_fns[name] = fn
                cell["anchor_rel_err"] = a_err
                cell["anchor_setup_s"] = a_setup
                if a_wrong:
                    cell["anchors_wrong"] = a_wrong
                if a_unavail:
                    cell["anchors_unavailable"] = a_unavail
                timed = {n: t for n, t in cell["anchors"].items() if t is not None}
                fastest = min(timed, key=timed.get) if timed else None
                stof_pair = t_tuned if t_tuned in runners else best
                if mname == "causal" and args.causal_rounds > 0 and fastest and stof_pair is not None:
                    pr = paired_ratio(runners[stof_pair], anchor_fns[fastest], args.causal_rounds, bench)
                    pr.update({"stof": "tuned" if stof_pair == t_tuned else "best", "anchor": fastest})
                    cell["paired"] = pr
                cell["cell_s"] = time.time() - t0
                cells.append(cell)

                def f(x):
                    return "  -  " if x is None else f"{x:.3f}"

                print(f"D={D:3d} S={S:5d} {mname:10s} STOF default {f(cell['stof_default_ms'])} "
                      f"({cell.get('stof_default_tactic')}) tuned {f(cell['stof_tuned_ms'])} "
                      f"({cell.get('stof_tuned_tactic', '-')}) best {f(cell['stof_best_ms'])} "
                      f"({cell.get('stof_best_tactic')}) | fastest anchor "
                      f"{f(timed.get(fastest))} ({fastest}) | rel err {cell['rel_err'] or float('nan'):.1e} "
                      f"| {' '.join(f'{n} {t:.3f}' for n, t in timed.items())} [{cell['cell_s']:.0f}s, "
                      f"{time.time() - t_start:.0f}s total]", flush=True)
                del runners, anchor_fns, out, ref, dl, dense, block_mask
                # a killed run keeps what it measured
                (out_dir / f"{args.name}.partial.json").write_text(json.dumps(clean(cells)))
            del q, k, v
            torch.cuda.empty_cache()
    tmp.cleanup()
    meta["wall_s"] = time.time() - t_start
    notes = [f"{gpu}, {args.dtype}, B={B}, H={H}; triton do_bench medians; outputs checked against an fp32 "
             f"reference (rel err < {tol:g}); STOF default = no cache, no first-use timing, no calibration profile; "
             f"tuned = after first-use timing{'' if has_timing else ' (not in this library: null)'}; "
             f"best = fastest valid tactic.  Ratios: fastest anchor ms / STOF ms."]
    summary = write_results(cells, out_dir, args.name, meta=meta, title=f"Attention, {gpu}, {args.dtype}",
                            notes=notes, against=args.against)
    (out_dir / f"{args.name}.partial.json").unlink(missing_ok=True)
    print((out_dir / f"{args.name}.md").read_text())
    print(f"bench_attention: {len(cells)} cells in {meta['wall_s']:.0f} s; targets {json.dumps(summary['targets'])}")
    torch.set_grad_enabled(grad_was)
    return 0


if __name__ == "__main__":
    sys.exit(main())
