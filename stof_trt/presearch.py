"""Analytical pre-search: rank the attention kernel tactics for a problem without running them.

The model (docs/kernels.md, "Pre-search") lives in C++ (plugins_cu/src/presearch.cc, C ABI
``stof_presearch_rank``): it predicts each valid tactic's time from the layout's tile statistics, the sizes, the
head dim and the GPU's properties.  This module passes it a layout and reads the ranking back through ctypes, from
libstof_kernels when one is built, else from libstof_host (the host-only library every install builds).  The
tactics, their requirements and the calibrated constants come from the catalogue plugins_cu/tactics.toml
(stof_trt._tactics); ``calibrate`` fits new constants from recorded benchmark runs on the terms the C++ model
multiplies them by (``stof_presearch_terms``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from . import _tactics

__all__ = ["FAMILY_BLOCK", "FAMILY_ROW", "FAMILY_HOPPER", "TacticSpec", "TACTICS", "valid_tactics", "GpuProps",
           "H100_SXM", "gpu_props", "TileStats", "tile_stats", "rank", "shortlist", "terms", "calibrate",
           "cell_layout", "native_library"]

FAMILY_BLOCK, FAMILY_ROW, FAMILY_HOPPER = _tactics.FAMILY_BLOCK, _tactics.FAMILY_ROW, _tactics.FAMILY_HOPPER


@dataclass(frozen=True)
class TacticSpec:
    """One catalogue row (plugins_cu/tactics.toml); num_warps counts the producer warpgroup of the
    warp-specialised tactics and both walkers of the split-walk one, as the library's stof_attn_tactic_info does."""

    id: int
    family: int
    name: str
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    min_ctas: int
    q_in_smem: bool
    pipelined: bool
    defer_pv: bool
    warp_specialized: bool
    key_step: int
    tma: bool
    persistent: bool
    kv_split: bool  # splits each work item's key walk over several CTAs where few items have long rows
    head_dims: tuple
    tile_m_multiple: int
    tile_n_multiple: int
    sm90a: bool


TACTICS = [TacticSpec(**{("num_warps" if k == "warps" else k): v for k, v in row.items()})
           for row in _tactics.TACTICS]
_BY_ID = {t.id: t for t in TACTICS}
PTXAS_REGS = dict(_tactics.PTXAS_REGS)
COEF = dict(_tactics.COEF)
UNIFORM_ITEM_SCALE = _tactics.UNIFORM_ITEM_SCALE
SCHED_L2_BYTES_ONE_ITEM_PER_SM = _tactics.SCHED_L2_BYTES_ONE_ITEM_PER_SM
SCHED_L2_BYTES_MANY_CTAS = _tactics.SCHED_L2_BYTES_MANY_CTAS


def valid_tactics(tile_m: int, tile_n: int, head_dim: int, hopper: bool | None = None) -> list[int]:
    """Ids whose catalogue requirements this tile shape and head dim meet (the library's stof_attn_list_tactics
    may drop more, e.g. without sm_90a code).  hopper: whether the wgmma tactics can run (sm_90 GPU and an sm_90a
    build); None = ask the current GPU."""
    if head_dim not in (64, 128):
        return []
    if hopper is None:
        hopper = gpu_props().sm == 90
    return [t.id for t in TACTICS
            if head_dim in t.head_dims and (hopper or not t.sm90a)
            and tile_m % t.tile_m_multiple == 0 and tile_n % t.tile_n_multiple == 0]


@dataclass(frozen=True)
class GpuProps:
    name: str
    sm_count: int
    smem_per_sm: int          # bytes usable by CTAs on one SM
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    clock_hz: float
    mma_tflops: float         # whole-chip fp16/bf16 mma.sync rate a well-fed kernel reaches
    dram_bw: float            # bytes/s, read + write
    l2_bw: float              # bytes/s
    sm: int = 90              # compute capability major*10 + minor
    wgmma_tflops: float = 0.0  # whole-chip wgmma rate (0: none)


# H100 SXM 80GB: 132 SMs, 228 KB smem/SM (227 KB per CTA), 64K regs; measured 3.0 TB/s copy, ~790 TFLOP/s
# wgmma GEMM; mma.sync reaches about half of that.  (= stof_presearch_h100_props, a test checks.)
H100_SXM = GpuProps("H100", 132, 228 * 1024, 65536, 2048, 32, 1.755e9, 400e12, 3.0e12, 6.0e12, 90, 700e12)


def gpu_props(device=None) -> GpuProps:
    """Properties of the current CUDA device (torch), H100 defaults for what torch does not report."""
    try:
        import torch

        if not torch.cuda.is_available():
            return H100_SXM
        p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - the pre-search must work without a GPU
        return H100_SXM
    sm = int(p.multi_processor_count)
    scale = sm / H100_SXM.sm_count
    return GpuProps(
        name=p.name, sm_count=sm,
        smem_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", H100_SXM.smem_per_sm)),
        regs_per_sm=int(getattr(p, "regs_per_multiprocessor", H100_SXM.regs_per_sm)),
        max_threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", H100_SXM.max_threads_per_sm)),
        max_ctas_per_sm=32, clock_hz=H100_SXM.clock_hz, mma_tflops=H100_SXM.mma_tflops * scale,
        dram_bw=H100_SXM.dram_bw, l2_bw=H100_SXM.l2_bw * scale, sm=p.major * 10 + p.minor,
        wgmma_tflops=H100_SXM.wgmma_tflops * scale if p.major == 9 else 0.0)


@dataclass
class TileStats:
    """A layout with the counts callers report about it (the model reads the layout itself)."""

    layout: object
    tile_m: int
    tile_n: int
    seq_q: int
    seq_k: int
    num_layouts: int
    nnz: int
    num_partial: int
    words: int    # 32-key words with an allowed key, over all layouts and query rows
    allowed: int  # allowed (query, key) pairs over all layouts (full tiles in tails slightly over-counted)

    @property
    def partial_fraction(self) -> float:
        return self.num_partial / max(self.nnz, 1)


def tile_stats(layout) -> TileStats:
    tbi = np.asarray(layout.tile_bitmap_index)[: int(layout.nnz)]
    words_partial = int(np.count_nonzero(layout.bitmaps[: layout.num_bitmaps], axis=1)[tbi[tbi >= 0]].sum())
    n_full = int(layout.nnz) - int(layout.num_partial)
    return TileStats(layout, layout.tile_m, layout.tile_n, int(layout.seq_q), int(layout.seq_k),
                     int(layout.num_layouts), int(layout.nnz), int(layout.num_partial),
                     words_partial + n_full * layout.tile_m * (layout.tile_n // 32),
                     int(layout.partial_tile_bits().sum()) + n_full * layout.tile_m * layout.tile_n)


# -- the C ABI (stof_attention.h, "analytical pre-search") ----------------------------------------------------------

class _GpuProps(ctypes.Structure):
    _fields_ = [("sm_count", ctypes.c_int32), ("smem_per_sm", ctypes.c_int32), ("regs_per_sm", ctypes.c_int32),
                ("max_threads_per_sm", ctypes.c_int32), ("max_ctas_per_sm", ctypes.c_int32),
                ("sm", ctypes.c_int32), ("clock_hz", ctypes.c_double), ("mma_tflops", ctypes.c_double),
                ("dram_bw", ctypes.c_double), ("l2_bw", ctypes.c_double), ("wgmma_tflops", ctypes.c_double)]


class _HostLayout(ctypes.Structure):
    _fields_ = [("row_ptr", ctypes.c_void_p), ("col_idx", ctypes.c_void_p), ("tile_bitmap_index", ctypes.c_void_p),
                ("bitmaps", ctypes.c_void_p), ("num_bitmaps", ctypes.c_int32), ("tile_m", ctypes.c_int32),
                ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32), ("layout_seq_q", ctypes.c_int32),
                ("layout_seq_k", ctypes.c_int32)]


class _Coef(ctypes.Structure):
    _fields_ = [("tactic", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("a", ctypes.c_double),
                ("b", ctypes.c_double), ("c", ctypes.c_double), ("d", ctypes.c_double)]


_NATIVE: ctypes.CDLL | None = None


def native_library() -> ctypes.CDLL:
    """The library the model runs in: libstof_kernels ($STOF_KERNELS_LIB or a build) when it has the pre-search
    entry points, else libstof_host ($STOF_HOST_LIB, the package's lib/ or a build tree)."""
    global _NATIVE
    if _NATIVE is not None:
        return _NATIVE
    from ._libs import load_native

    lib = load_native((("libstof_kernels.so", "STOF_KERNELS_LIB"), ("libstof_host.so", "STOF_HOST_LIB")),
                      "stof_presearch_terms", "the pre-search",
                      "install the package with a C++ compiler, or build with cmake and set STOF_HOST_LIB")
    P, L, i32p = ctypes.POINTER(_GpuProps), ctypes.POINTER(_HostLayout), ctypes.POINTER(ctypes.c_int32)
    dp = ctypes.POINTER(ctypes.c_double)
    lib.stof_presearch_h100_props.argtypes, lib.stof_presearch_h100_props.restype = [P], None
    lib.stof_presearch_rank_coef.argtypes = [P, L] + [ctypes.c_int32] * 5 + [
        ctypes.POINTER(_Coef), ctypes.c_int32, i32p, dp, ctypes.c_int32, i32p]
    lib.stof_presearch_rank_coef.restype = ctypes.c_int
    lib.stof_presearch_terms.argtypes = [P, L] + [ctypes.c_int32] * 5 + [dp]
    lib.stof_presearch_terms.restype = ctypes.c_int
    _NATIVE = lib
    return lib


def _gpu_struct(g: GpuProps) -> _GpuProps:
    return _GpuProps(g.sm_count, g.smem_per_sm, g.regs_per_sm, g.max_threads_per_sm, g.max_ctas_per_sm, g.sm,
                     g.clock_hz, g.mma_tflops, g.dram_bw, g.l2_bw, g.wgmma_tflops)


def _host_layout(layout) -> tuple[_HostLayout, dict]:
    """The layout as stof_host_layout_t; the returned arrays must outlive the call."""
    arrs = {k: np.ascontiguousarray(v, np.int32) for k, v in layout.arrays().items()}
    hl = _HostLayout(arrs["row_ptr"].ctypes.data, arrs["col_idx"].ctypes.data, arrs["tile_bitmap_index"].ctypes.data,
                     arrs["bitmaps"].ctypes.data, arrs["bitmaps"].shape[0], layout.tile_m, layout.tile_n,
                     layout.num_layouts, layout.seq_q, layout.seq_k)
    return hl, arrs


def rank(layout_or_stats, *, batch: int, heads: int, head_dim: int, seq_q: int | None = None,
         seq_k: int | None = None, gpu: GpuProps | None = None, coef: dict | None = None) -> list[tuple[int, float]]:
    """All valid tactics as (id, predicted seconds), fastest first.  coef: {(id, head dim): (a, b, c, d)} in place
    of the catalogue's constants (replaying a refit)."""
    layout = layout_or_stats.layout if isinstance(layout_or_stats, TileStats) else layout_or_stats
    gpu = gpu or gpu_props()
    lib = native_library()
    hl, keep = _host_layout(layout)
    over = (_Coef * max(len(coef or {}), 1))(*[_Coef(t, d, *c) for (t, d), c in (coef or {}).items()])
    cap = len(TACTICS)
    ids, secs, n = (ctypes.c_int32 * cap)(), (ctypes.c_double * cap)(), ctypes.c_int32(0)
    st = lib.stof_presearch_rank_coef(ctypes.byref(_gpu_struct(gpu)), ctypes.byref(hl), batch, heads, head_dim,
                                      seq_q or 0, seq_k or 0, over, len(coef or {}), ids, secs, cap, ctypes.byref(n))
    if st != 0:
        raise ValueError(f"stof_presearch_rank: status {st} (B={batch} H={heads} D={head_dim}, coef {coef})")
    del keep
    return [(int(ids[i]), float(secs[i])) for i in range(n.value)]


def shortlist(layout_or_stats, *, k: int = 3, within: float = 1.5, **kw) -> list[int]:
    """The first k tactics of the ranking that are predicted within `within` x of the best."""
    ranked = rank(layout_or_stats, **kw)
    if not ranked:
        return []
    best = ranked[0][1]
    return [tid for tid, tp in ranked[:k] if tp <= best * within]


def terms(layout, tactic: int, *, batch: int, heads: int, head_dim: int, seq_q: int | None = None,
          gpu: GpuProps | None = None) -> np.ndarray | None:
    """The four terms the constants (a, b, c, d) of `tactic` multiply (stof_presearch_terms): FULL and PARTIAL
    sub-blocks and CTAs over all (batch, head) pairs per occupancy slot, and 1.  None for a row-wise tactic or
    one that does not fit on an SM."""
    lib = native_library()
    hl, keep = _host_layout(layout)
    out = (ctypes.c_double * 4)()
    st = lib.stof_presearch_terms(ctypes.byref(_gpu_struct(gpu or H100_SXM)), ctypes.byref(hl), batch, heads,
                                  head_dim, seq_q or 0, tactic, out)
    del keep
    if st == 2:  # UNSUPPORTED
        return None
    if st != 0:
        raise ValueError(f"stof_presearch_terms: status {st} (tactic {tactic}, D={head_dim})")
    return np.array(out[:], dtype=np.float64)


def calibrate(bench_json, gpu: GpuProps | None = None, keys=None, relative: bool = False) -> dict:
    """Fit COEF from scripts/bench_attention.py JSONs (a path or a list of paths): per (tactic, head dim), or only
    those in `keys`, non-negative least squares of measured µs against terms() (the makespan of a large grid).  A
    cell's keys are its "Sk" (S_q != S_k) or its "S".  relative=True weighs each cell by 1 / its time (least
    squares of relative errors), so that short problems count as much as long ones."""
    import json

    from scipy.optimize import nnls

    gpu = gpu or H100_SXM
    rows: dict = {}
    for path in [bench_json] if isinstance(bench_json, (str, os.PathLike)) else bench_json:
        with open(path) as f:
            res = json.load(f)
        B, H = res["summary"]["batch"], res["summary"]["heads"]
        for cell in res["cells"]:
            layout = cell_layout(cell)
            for t in TACTICS:
                key = (t.id, cell["D"])
                if t.name not in cell["measured_ms"] or t.family == FAMILY_ROW or (keys and key not in keys):
                    continue
                x = terms(layout, t.id, batch=B, heads=H, head_dim=cell["D"], seq_q=cell["S"], gpu=gpu)
                if x is not None:
                    rows.setdefault(key, []).append((x, cell["measured_ms"][t.name] * 1e3))
    coef = {}
    for key, pts in rows.items():
        A = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        w = 1.0 / y if relative else np.ones_like(y)
        sol, _ = nnls(A * w[:, None], y * w)
        coef[key] = tuple(float(round(v, 5)) for v in sol)
    return coef


def cell_layout(cell: dict):
    """The layout of a benchmark JSON cell: compile_mask of its "spec" at S_q = "S", S_k = "Sk" (or "S"). The
    recorded runs drew BigBird's random blocks from one stream over the grid (``draw=grid``)."""
    from .format import compile_mask
    from .masks import grid_drawn, parse_mask

    return compile_mask(grid_drawn(parse_mask(cell["spec"])), cell["S"], cell.get("Sk", cell["S"]))
