"""The pre-search's C ABI (plugins_cu/src/presearch.cc) through stof_trt.presearch, on the CPU: the ranking covers
exactly the catalogue's valid tactics, the terms the constants multiply, constant overrides, argument errors, and
the host-only library ranking as libstof_kernels does where both are built.  Runs with libstof_host alone (every
install builds it) or with libstof_kernels."""
from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import numpy as np
import pytest

from stof_trt import _libs
from stof_trt import presearch as ps
from stof_trt.format import TileLayout, compile_mask

ROOT = Path(__file__).resolve().parent.parent

A100_LIKE = ps.GpuProps("A100-like", 108, 164 * 1024, 65536, 2048, 32, 1.41e9, 300e12, 2.0e12, 4.0e12, 80, 0.0)
SPECS = ["causal", "sliding:window=100", "longformer:window=64,global=8", "dilated:window=96,dilation=2",
         "bigbird:block=64,window=1,global=1,random=0.1,seed=2", "full", "global:n=5", "sliding:window=20,causal=1"]
TILES = [(64, 64), (32, 32), (128, 64), (64, 128), (32, 64), (128, 128)]


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


def _cases(seed, n):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        S = int(rng.choice([64, 130, 256, 500, 1024]))
        layout = _random_layout(rng, S, TILES[rng.integers(len(TILES))])
        seq = int(rng.integers(S // 2, S + 1)) if rng.random() < 0.3 else S
        yield layout, dict(batch=int(rng.integers(1, 9)), heads=int(rng.choice([1, 2, 4, 12])) * layout.num_layouts,
                           head_dim=int(rng.choice([64, 128])), seq_q=seq, seq_k=seq,
                           gpu=[ps.H100_SXM, A100_LIKE][rng.integers(2)])


def test_rank_covers_the_catalogues_valid_tactics():
    checked = 0
    for layout, kw in _cases(2024, 40):
        ranked = ps.rank(layout, **kw)
        want = ps.valid_tactics(layout.tile_m, layout.tile_n, kw["head_dim"], hopper=kw["gpu"].wgmma_tflops > 0)
        assert sorted(t for t, _ in ranked) == sorted(want), (layout.tile_m, layout.tile_n, kw)
        secs = [s for _, s in ranked]
        assert secs == sorted(secs) and all(math.isfinite(s) and s > 0 for s in secs)
        checked += len(ranked)
    assert checked > 200


def test_valid_tactics_follow_the_catalogue():
    assert ps.valid_tactics(64, 64, 96, hopper=True) == []
    assert set(ps.valid_tactics(64, 64, 64, hopper=True)) == {t.id for t in ps.TACTICS if t.tile_m_multiple <= 64}
    assert not any(ps._BY_ID[t].sm90a for t in ps.valid_tactics(128, 64, 64, hopper=False))
    d128 = set(ps.valid_tactics(128, 64, 128, hopper=True))
    assert {4, 6, 18, 24, 27, 28, 29}.isdisjoint(d128) and {5, 9, 15, 22, 23} <= d128
    assert ps.valid_tactics(32, 64, 64, hopper=True) == [3, 10, 11, 12]  # 32-row tiles: no wgmma, no 64-row CTAs


def test_split_tactic_ranked_for_few_long_rows():
    """A Longformer layer's global rows (32 queries against 4096 keys, B=1, 12 heads: 12 work items of 64 key tiles)
    leave most SMs idle: the split tactic ranks first; with many work items (B=8, 8 long rows per head) or short
    rows it splits nothing and ranks below its base tactic 1 (the same kernel without the merge)."""
    split = [t.id for t in ps.TACTICS if t.kv_split]
    assert split == [30]
    glob = compile_mask("full", 64, 4096)
    for D in (64, 128):
        ranked = [t for t, _ in ps.rank(glob, batch=1, heads=12, head_dim=D, seq_q=32, gpu=ps.H100_SXM)]
        assert ranked[0] == 30, ranked[:4]
        many = [t for t, _ in ps.rank(compile_mask("full", 512, 4096), batch=8, heads=12, head_dim=D,
                                      gpu=ps.H100_SXM)]
        assert many.index(30) > many.index(1)
        short = [t for t, _ in ps.rank(compile_mask("full", 64, 192), batch=1, heads=12, head_dim=D,
                                       gpu=ps.H100_SXM)]
        assert short.index(30) > short.index(1)  # 3 key tiles: fewer than two slices of 4 sub-blocks
    x30 = ps.terms(glob, 30, batch=1, heads=12, head_dim=64, seq_q=32, gpu=ps.H100_SXM)
    x1 = ps.terms(glob, 1, batch=1, heads=12, head_dim=64, seq_q=32, gpu=ps.H100_SXM)
    np.testing.assert_allclose(x30[:2], x1[:2])  # the same sub-blocks ...
    assert x30[2] == pytest.approx(x1[2] * 16)   # ... in 16 slices per item (64 tiles / 4; 264 CTAs / 12 items)


def test_terms_count_sub_blocks_and_ctas():
    """Causal S=256 on 64x64 tiles: tile row i holds i + 1 tiles, the diagonal one PARTIAL.  Tactic 13 (one 64-row
    CTA per tile row) has 6 FULL and 4 PARTIAL sub-blocks in 4 CTAs; tactic 15 (128 rows: the union of two tile
    rows) 2 FULL and 4 PARTIAL in 2 CTAs; per occupancy slot over B*H = 96 (batch, head) pairs."""
    layout = compile_mask("causal", 256, 256)
    x13 = ps.terms(layout, 13, batch=8, heads=12, head_dim=64, gpu=ps.H100_SXM)
    slots13 = 132 * 4  # 128 threads at 128 registers: 4 CTAs per SM
    np.testing.assert_allclose(x13, [6 * 96 / slots13, 4 * 96 / slots13, 4 * 96 / slots13, 1.0], rtol=1e-15)
    x15 = ps.terms(layout, 15, batch=8, heads=12, head_dim=64, gpu=ps.H100_SXM)
    slots15 = 2 * 96 / x15[2]  # 2 CTAs per (batch, head) pair
    assert slots15 % 132 == 0
    np.testing.assert_allclose(x15[:2] * slots15 / 96, [2, 4], rtol=1e-12)
    assert ps.terms(layout, 11, batch=1, heads=1, head_dim=64) is None  # row-wise: no constants
    with pytest.raises(ValueError, match="status 3"):  # INVALID_TACTIC
        ps.terms(layout, 99, batch=1, heads=1, head_dim=64)


def test_coef_overrides_reorder_the_ranking():
    layout = compile_mask("causal", 1024, 1024)
    kw = dict(batch=8, heads=12, head_dim=64, gpu=ps.H100_SXM)
    ranked = ps.rank(layout, **kw)
    last = ranked[-1][0]
    if ps._BY_ID[last].family == ps.FAMILY_ROW:
        last = next(t for t, _ in reversed(ranked) if ps._BY_ID[t].family != ps.FAMILY_ROW)
    fast = ps.rank(layout, **kw, coef={(last, 64): (1e-3, 1e-3, 1e-3, 0.0)})
    assert fast[0][0] == last
    assert ps.rank(layout, **kw, coef={}) == ranked
    with pytest.raises(ValueError):
        ps.rank(layout, **kw, coef={(11, 64): (1.0, 1.0, 1.0, 1.0)})  # row-wise: no constants to replace
    with pytest.raises(ValueError):
        ps.rank(layout, **kw, coef={(99, 64): (1.0, 1.0, 1.0, 1.0)})


def test_rank_errors_through_the_c_abi():
    lib = ps.native_library()
    layout = compile_mask("causal", 256, 256)
    assert ps.rank(layout, batch=1, heads=1, head_dim=96, gpu=ps.H100_SXM) == []
    g = ps._gpu_struct(ps.H100_SXM)
    n = ctypes.c_int32(0)
    assert lib.stof_presearch_rank_coef(ctypes.byref(g), None, 1, 1, 64, 0, 0, None, 0, None, None, 0,
                                        ctypes.byref(n)) == 1  # INVALID_ARGUMENT
    hl, keep = ps._host_layout(layout)
    st = lib.stof_presearch_rank_coef(ctypes.byref(g), ctypes.byref(hl), 2, 4, 64, 0, 0, None, 0, None, None, 0,
                                      ctypes.byref(n))
    assert st == 5 and n.value == len(ps.valid_tactics(64, 64, 64, hopper=True))  # INSUFFICIENT_BUFFER, count
    with pytest.raises(ValueError, match="status 1"):
        ps.rank(layout, batch=0, heads=1, head_dim=64, gpu=ps.H100_SXM)
    del keep


def test_h100_props_match_python():
    g = ps._GpuProps()
    ps.native_library().stof_presearch_h100_props(ctypes.byref(g))
    assert (g.sm_count, g.smem_per_sm, g.regs_per_sm, g.max_threads_per_sm, g.max_ctas_per_sm, g.sm) == (
        ps.H100_SXM.sm_count, ps.H100_SXM.smem_per_sm, ps.H100_SXM.regs_per_sm, ps.H100_SXM.max_threads_per_sm,
        ps.H100_SXM.max_ctas_per_sm, ps.H100_SXM.sm)
    assert (g.clock_hz, g.mma_tflops, g.dram_bw, g.l2_bw, g.wgmma_tflops) == (
        ps.H100_SXM.clock_hz, ps.H100_SXM.mma_tflops, ps.H100_SXM.dram_bw, ps.H100_SXM.l2_bw, ps.H100_SXM.wgmma_tflops)


def test_schedule_budgets_match_the_kernels():
    """The catalogue's schedule budgets are the kernels' (common.cuh kSchedL2Bytes*): a change to one without the
    other would rank tactics on a schedule the library does not run."""
    src = (ROOT / "plugins_cu" / "src" / "common.cuh").read_text()
    for name, want in (("kSchedL2BytesOneItemPerSm", ps.SCHED_L2_BYTES_ONE_ITEM_PER_SM),
                       ("kSchedL2BytesManyCtas", ps.SCHED_L2_BYTES_MANY_CTAS)):
        m = re.search(rf"constexpr int64_t {name} = static_cast<int64_t>\((\d+)\) << (\d+);", src)
        assert m, f"{name} not found in common.cuh"
        assert int(m.group(1)) << int(m.group(2)) == want, name


@pytest.mark.parametrize("spec", ["sliding:window=128", "dilated:window=256,dilation=2",
                                  "longformer:window=128,global=16", "bigbird:block=64,window=1,global=1,random=0.05"])
def test_scheduler_warp_tactics_rank_near_the_top(spec):
    """Layouts that reach the schedule's pair order (Longformer, BigBird: global rows first) and the per-item scale
    of the scheduler-warp tactics (sliding, dilated: near-equal rows) still rank a warp-specialised tactic high."""
    for S, D in ((1024, 64), (2048, 128), (900, 64)):
        ranked = ps.rank(compile_mask(spec, S, S), batch=8, heads=12, head_dim=D, gpu=ps.H100_SXM)
        assert any(t in (21, 22, 23, 24) for t, _ in ranked[:12]), (spec, S, D)


def test_host_and_kernels_libraries_rank_alike():
    """libstof_host and libstof_kernels compile the same pre-search sources (no FMA contraction in either): the
    same ranking and the same times, where both are built."""
    paths = [_libs.find_library(n, e, "plugins_cu") for n, e in (("libstof_host.so", "STOF_HOST_LIB"),
                                                                  ("libstof_kernels.so", "STOF_KERNELS_LIB"))]
    if None in paths:
        pytest.skip("needs both libstof_host.so and libstof_kernels.so")
    libs = [ctypes.CDLL(str(p)) for p in paths]
    if not all(hasattr(lib, "stof_presearch_rank_coef") for lib in libs):
        pytest.skip("a library predates stof_presearch_rank_coef")
    for layout, kw in _cases(7, 25):
        hl, keep = ps._host_layout(layout)
        g = ps._gpu_struct(kw["gpu"])
        out = []
        for lib in libs:
            ids, secs, n = (ctypes.c_int32 * 64)(), (ctypes.c_double * 64)(), ctypes.c_int32(0)
            lib.stof_presearch_rank_coef.restype = ctypes.c_int
            assert lib.stof_presearch_rank_coef(ctypes.byref(g), ctypes.byref(hl), kw["batch"], kw["heads"],
                                                kw["head_dim"], kw["seq_q"], kw["seq_k"], None, 0, ids, secs, 64,
                                                ctypes.byref(n)) == 0
            out.append([(ids[i], secs[i]) for i in range(n.value)])
        assert out[0] == out[1]
        del keep
