"""The C++ pre-search (plugins_cu/src/presearch.cc, C ABI stof_presearch_rank) ranks exactly like
stof_trt.presearch.rank() on random layouts, sizes, tile shapes and GPUs.  Host only: runs wherever
libstof_kernels.so is built (CI builds it with nvcc; no GPU needed)."""
from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stof_trt import presearch as ps
from stof_trt.format import TileLayout, compile_mask

ROOT = Path(__file__).resolve().parent.parent


class GpuProps(ctypes.Structure):
    _fields_ = [("sm_count", ctypes.c_int32), ("smem_per_sm", ctypes.c_int32), ("regs_per_sm", ctypes.c_int32),
                ("max_threads_per_sm", ctypes.c_int32), ("max_ctas_per_sm", ctypes.c_int32),
                ("sm", ctypes.c_int32), ("clock_hz", ctypes.c_double), ("mma_tflops", ctypes.c_double),
                ("dram_bw", ctypes.c_double), ("l2_bw", ctypes.c_double), ("wgmma_tflops", ctypes.c_double)]


class HostLayout(ctypes.Structure):
    _fields_ = [("row_ptr", ctypes.c_void_p), ("col_idx", ctypes.c_void_p), ("tile_bitmap_index", ctypes.c_void_p),
                ("bitmaps", ctypes.c_void_p), ("num_bitmaps", ctypes.c_int32), ("tile_m", ctypes.c_int32),
                ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32), ("layout_seq_q", ctypes.c_int32),
                ("layout_seq_k", ctypes.c_int32)]


@pytest.fixture(scope="module")
def lib(kernels):
    lib = kernels.load_library()
    if not hasattr(lib, "stof_presearch_rank"):
        pytest.skip("libstof_kernels.so predates stof_presearch_rank")
    lib.stof_presearch_rank.restype = ctypes.c_int
    lib.stof_presearch_rank.argtypes = [ctypes.POINTER(GpuProps), ctypes.POINTER(HostLayout)] + [ctypes.c_int32] * 5 + [
        ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_double), ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]
    return lib


def _props(g: ps.GpuProps) -> GpuProps:
    return GpuProps(g.sm_count, g.smem_per_sm, g.regs_per_sm, g.max_threads_per_sm, g.max_ctas_per_sm, g.sm,
                    g.clock_hz, g.mma_tflops, g.dram_bw, g.l2_bw, g.wgmma_tflops)


def native_rank(lib, layout: TileLayout, *, batch, heads, head_dim, seq_q, seq_k, gpu: ps.GpuProps):
    arrs = {k: np.ascontiguousarray(v, np.int32) for k, v in layout.arrays().items()}
    hl = HostLayout(arrs["row_ptr"].ctypes.data, arrs["col_idx"].ctypes.data, arrs["tile_bitmap_index"].ctypes.data,
                    arrs["bitmaps"].ctypes.data, arrs["bitmaps"].shape[0], layout.tile_m, layout.tile_n,
                    layout.num_layouts, layout.seq_q, layout.seq_k)
    cap = 64
    ids = (ctypes.c_int32 * cap)()
    secs = (ctypes.c_double * cap)()
    n = ctypes.c_int32(0)
    g = _props(gpu)
    st = lib.stof_presearch_rank(ctypes.byref(g), ctypes.byref(hl), batch, heads, head_dim, seq_q, seq_k, ids, secs,
                                 cap, ctypes.byref(n))
    assert st == 0, f"stof_presearch_rank status {st}"
    return [(ids[i], secs[i]) for i in range(n.value)]


A100_LIKE = ps.GpuProps("A100-like", 108, 164 * 1024, 65536, 2048, 32, 1.41e9, 300e12, 2.0e12, 4.0e12, 80, 0.0)
SPECS = ["causal", "sliding:window=100", "longformer:window=64,global=8", "dilated:window=96,dilation=2",
         "bigbird:block=64,window=1,global=1,random=0.1,seed=2", "full", "global:n=5", "sliding:window=20,causal=1"]


def _random_layout(rng, S, tile):
    kind = rng.integers(0, 3)
    if kind == 0:
        return compile_mask(SPECS[rng.integers(len(SPECS))], S, S, tile_m=tile[0], tile_n=tile[1])
    L = int(rng.choice([1, 2, 4]))
    dense = rng.random((L, S, S)) < rng.choice([0.02, 0.2, 0.7])
    if kind == 2:  # block structure with full, empty and partial tiles
        blocks = rng.random((L, -(-S // tile[0]), -(-S // tile[1]))) < 0.4
        dense |= np.repeat(np.repeat(blocks, tile[0], 1), tile[1], 2)[:, :S, :S]
    return TileLayout.from_dense(dense, tile[0], tile[1])


def test_native_rank_equals_python(lib):
    rng = np.random.default_rng(2024)
    checked = 0
    for case in range(60):
        S = int(rng.choice([64, 130, 256, 500, 1024, 2048]))
        tile = [(64, 64), (32, 32), (128, 64), (64, 128), (32, 64), (128, 128)][rng.integers(6)]
        layout = _random_layout(rng, S, tile)
        heads = int(rng.choice([1, 2, 4, 12])) * layout.num_layouts
        batch = int(rng.integers(1, 9))
        D = int(rng.choice([64, 128]))
        seq = int(rng.integers(S // 2, S + 1)) if rng.random() < 0.3 else S
        gpu = [ps.H100_SXM, A100_LIKE][rng.integers(2)]
        want = ps.rank(layout, batch=batch, heads=heads, head_dim=D, seq_q=seq, seq_k=seq, gpu=gpu)
        got = native_rank(lib, layout, batch=batch, heads=heads, head_dim=D, seq_q=seq, seq_k=seq, gpu=gpu)
        ctx = (f"case {case}: S={S} tile={tile} L={layout.num_layouts} B={batch} H={heads} D={D} seq={seq} "
               f"{gpu.name}: plugins_cu/src/presearch.cc no longer computes what stof_trt/presearch.py does -- "
               "mirror the model change there (tables: python3 scripts/gen_presearch_table.py)")
        assert [t for t, _ in got] == [t for t, _ in want], ctx
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-12, err_msg=ctx)
        checked += len(want)
    assert checked > 200


def test_native_rank_head_dim_and_errors(lib):
    layout = compile_mask("causal", 256, 256)
    assert native_rank(lib, layout, batch=1, heads=1, head_dim=96, seq_q=256, seq_k=256, gpu=ps.H100_SXM) == []
    g = _props(ps.H100_SXM)
    n = ctypes.c_int32(0)
    assert lib.stof_presearch_rank(ctypes.byref(g), None, 1, 1, 64, 0, 0, None, None, 0, ctypes.byref(n)) == 1
    arrs = {k: np.ascontiguousarray(v, np.int32) for k, v in layout.arrays().items()}
    hl = HostLayout(arrs["row_ptr"].ctypes.data, arrs["col_idx"].ctypes.data, arrs["tile_bitmap_index"].ctypes.data,
                    arrs["bitmaps"].ctypes.data, arrs["bitmaps"].shape[0], 64, 64, 1, 256, 256)
    st = lib.stof_presearch_rank(ctypes.byref(g), ctypes.byref(hl), 2, 4, 64, 0, 0, None, None, 0, ctypes.byref(n))
    assert st == 5 and n.value == len(ps.valid_tactics(64, 64, 64, hopper=True))  # INSUFFICIENT_BUFFER, count


def test_h100_props_match_python(lib):
    g = GpuProps()
    lib.stof_presearch_h100_props(ctypes.byref(g))
    assert (g.sm_count, g.smem_per_sm, g.regs_per_sm, g.max_threads_per_sm, g.max_ctas_per_sm, g.sm) == (
        ps.H100_SXM.sm_count, ps.H100_SXM.smem_per_sm, ps.H100_SXM.regs_per_sm, ps.H100_SXM.max_threads_per_sm,
        ps.H100_SXM.max_ctas_per_sm, ps.H100_SXM.sm)
    assert (g.clock_hz, g.mma_tflops, g.dram_bw, g.l2_bw, g.wgmma_tflops) == (
        ps.H100_SXM.clock_hz, ps.H100_SXM.mma_tflops, ps.H100_SXM.dram_bw, ps.H100_SXM.l2_bw, ps.H100_SXM.wgmma_tflops)


def test_generated_table_is_current():
    """plugins_cu/src/presearch_table.inc must be regenerated after a change to stof_trt/presearch.py's tables."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_presearch_table.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr.strip()


def test_schedule_budgets_match_the_kernels():
    """The pre-search's schedule budgets (SCHED_L2_BYTES_*) are the kernels' (common.cuh kSchedL2Bytes*): a change to
    one without the other would rank tactics on a schedule the library does not run.  Host only (reads the source)."""
    src = (ROOT / "plugins_cu" / "src" / "common.cuh").read_text()
    for name, want in (("kSchedL2BytesOneItemPerSm", ps.SCHED_L2_BYTES_ONE_ITEM_PER_SM),
                       ("kSchedL2BytesManyCtas", ps.SCHED_L2_BYTES_MANY_CTAS)):
        m = re.search(rf"constexpr int64_t {name} = static_cast<int64_t>\((\d+)\) << (\d+);", src)
        assert m, f"{name} not found in common.cuh"
        assert int(m.group(1)) << int(m.group(2)) == want, name


@pytest.mark.parametrize("spec", ["sliding:window=128", "dilated:window=256,dilation=2",
                                  "longformer:window=128,global=16", "bigbird:block=64,window=1,global=1,random=0.05"])
def test_native_rank_schedules(lib, spec):
    """The session-15 parts of the model on the layouts that reach them (64x64 tiles, an H100): the pair order of the
    128-row tactics (Longformer, BigBird: global rows first) and the per-item scale of 21-24 on near-equal rows
    (sliding, dilated: sched_chunk 1) -- the same ranking and times in C++ as in Python."""
    for S, D in ((1024, 64), (2048, 128), (900, 64)):
        layout = compile_mask(spec, S, S)
        want = ps.rank(layout, batch=8, heads=12, head_dim=D, gpu=ps.H100_SXM)
        got = native_rank(lib, layout, batch=8, heads=12, head_dim=D, seq_q=S, seq_k=S, gpu=ps.H100_SXM)
        assert [t for t, _ in got] == [t for t, _ in want], (spec, S, D)
        assert np.allclose([s for _, s in got], [s for _, s in want], rtol=1e-9), (spec, S, D)
        # (top 12: since session 16 the one-warpgroup tactics schedule 32 MiB of heads and rank higher at S=900)
        assert any(t in (21, 22, 23, 24) for t, _ in want[:12]), "no scheduler-warp tactic ranked near the top"
