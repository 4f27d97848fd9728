"""Fit the pre-search's constants on the current GPU (``stof calibrate``): time a small fixed grid of problems x
tactics with the kernel library, fit the constants with :func:`stof_trt.presearch.calibrate` on the terms the
model multiplies them by (``stof_presearch_terms``), and store them as this GPU's pre-search profile
(:mod:`stof_trt.profiles`), which stof_attn_select then ranks with."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

from . import presearch as ps
from . import profiles
from .errors import StofError

__all__ = ["GRID_MASKS", "GRID_SEQS", "GRID_HEAD_DIMS", "measure_grid", "fit_profile", "gpu_key"]

# masks of the benchmark, at sizes that keep the whole grid within a couple of minutes
GRID_MASKS = ["causal", "sliding:window=128", "dilated:window=256,dilation=2", "longformer:window=128,global=16",
              "bigbird:block=64,window=1,global=1,random=0.05,seed=0"]
GRID_SEQS = [1024, 2048, 4096]
GRID_HEAD_DIMS = [64, 128]


def gpu_key(device=None) -> dict:
    """The profile's "gpu" object for a CUDA device: name, cc, SM count and clocks (MHz, 0 when unknown)."""
    import torch

    if not torch.cuda.is_available():
        raise StofError("no CUDA GPU: stof calibrate times the kernels on the GPU it calibrates")
    idx = torch.cuda.current_device() if device is None else device
    p = torch.cuda.get_device_properties(idx)
    clock, mem = _clocks(idx, p)
    return {"name": p.name, "cc": f"{p.major}.{p.minor}", "sm_count": int(p.multi_processor_count),
            "clock_mhz": clock, "memory_clock_mhz": mem}


def _clocks(idx: int, props) -> tuple[int, int]:
    """Max SM and memory clocks in MHz: cudaDevAttrClockRate / MemoryClockRate through the CUDA runtime torch
    loaded, else 0 (the library then matches a profile by name and SM count only)."""
    import ctypes

    for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return int(getattr(props, "clock_rate", 0) or 0) // 1000, 0
    out = []
    for attr in (13, 36):  # cudaDevAttrClockRate, cudaDevAttrMemoryClockRate (kHz)
        v = ctypes.c_int(0)
        out.append(v.value // 1000 if rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, idx) == 0 else 0)
    return out[0], out[1]


def measure_grid(*, masks=GRID_MASKS, seqs=GRID_SEQS, head_dims=GRID_HEAD_DIMS, batch: int = 4, heads: int = 12,
                 reps: int = 5, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time every tensor-core tactic the library lists for each (mask, S, D) on the current GPU (fp16, CUDA
    events, median of `reps` after a warm-up).  Cells in the benchmark JSON's form: {"spec", "S", "D",
    "measured_ms": {tactic name: ms}}."""
    import torch

    from . import kernels
    from .format import compile_mask
    from .masks import parse_mask

    if not torch.cuda.is_available():
        raise StofError("no CUDA GPU: stof calibrate times the kernels on the GPU it calibrates")
    cells = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for D in head_dims:
        for spec in masks:
            for S in seqs:
                layout = compile_mask(parse_mask(spec), S, S)
                dl = kernels.DeviceLayout(layout)
                q, k, v = (torch.randn(batch, heads, S, D, generator=gen, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                out = torch.empty_like(q)
                measured = {}
                for t in kernels.list_tactics(q, k, v, dl):
                    info = kernels.tactic_info(t)
                    if info.family == kernels.FAMILY_ROW:
                        continue
                    run = lambda t=t: kernels.sparse_attention(q, k, v, dl, tactic=t, out=out)  # noqa: E731
                    try:
                        run()
                    except kernels.StofKernelError as e:  # listed but not runnable here: not part of the fit
                        if progress:
                            progress(f"D={D} S={S} {spec}: {info.name} skipped ({e})")
                        continue
                    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(reps)]
                    for a, b in ev:
                        a.record()
                        run()
                        b.record()
                    torch.cuda.synchronize()
                    measured[info.name] = sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]
                cells.append({"spec": spec, "S": S, "D": D, "measured_ms": measured})
                if progress:
                    best = min(measured.items(), key=lambda kv: kv[1]) if measured else ("-", float("nan"))
                    progress(f"D={D} S={S} {spec}: {len(measured)} tactics, best {best[0]} {best[1]:.3f} ms")
    return cells


def _first_choice_gap(cells, batch, heads, gpu, coef) -> list[float]:
    """Per cell: measured time of the pre-search's first measured choice / the best measured time."""
    by_name = {t.id: t.name for t in ps.TACTICS}
    gaps = []
    for c in cells:
        m = c["measured_ms"]
        if not m:
            continue
        ranked = ps.rank(ps.cell_layout(c), batch=batch, heads=heads, head_dim=c["D"], gpu=gpu, coef=coef)
        first = next((by_name[t] for t, _ in ranked if by_name.get(t) in m), None)
        if first is not None:
            gaps.append(m[first] / min(m.values()))
    return gaps


def fit_profile(cells: list[dict], *, batch: int, heads: int, gpu: dict, props: ps.GpuProps | None = None) -> dict:
    """Fit the constants of every measured (tactic, D) on the cells with presearch.calibrate (relative least
    squares) and return the profile document; its "fit" records the grid and how often the pre-search's first
    choice is within 10 % of the best measured tactic with the catalogue's and with the fitted constants."""
    props = props or ps.gpu_props()
    fd, tmp = tempfile.mkstemp(prefix="stof-calibrate-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"summary": {"batch": batch, "heads": heads}, "cells": cells}, f)
        coef = ps.calibrate(tmp, gpu=props, relative=True)
    finally:
        os.unlink(tmp)
    if not coef:
        raise StofError("no tensor-core tactic was measured: nothing to fit")
    before = _first_choice_gap(cells, batch, heads, props, None)
    after = _first_choice_gap(cells, batch, heads, props, coef)

    def within(g):
        return sum(x <= 1.10 for x in g)

    fit = {"batch": batch, "heads": heads, "cells": len(cells),
           "masks": sorted({c["spec"] for c in cells}), "seqs": sorted({c["S"] for c in cells}),
           "head_dims": sorted({c["D"] for c in cells}),
           "first_choice_within_10pct": {"catalogue": within(before), "profile": within(after), "of": len(after)},
           "first_choice_mean_gap": {"catalogue": sum(before) / max(len(before), 1),
                                     "profile": sum(after) / max(len(after), 1)}}
    return profiles.make_profile(gpu, coef, fit)
