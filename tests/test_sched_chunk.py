"""TileLayout.sched_chunk() (the derived schedule integer of docs/format.md) equals the layout handle's on random
and hand-made layouts; the Python binding passes -1 (the layout's choice) or an explicit override in
stof_attn_params_t.sched_chunk, independently of row_order; stof_attn_validate rejects one below -1.  The numpy side
always runs; the native parts run wherever libstof_kernels.so is built (no GPU needed: validate, list_tactics and
layout handles that are not uploaded launch nothing) and skip otherwise."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from stof_trt.format import TileLayout, compile_mask
from test_row_order import SPECS, _random_layouts, _raw_layout


def _reference(row_ptr, L: int, tq: int) -> int:
    """The definition, spelled out with Python integers."""
    rp = [int(x) for x in row_ptr]
    for lay in range(L):
        counts = [rp[lay * tq + i + 1] - rp[lay * tq + i] for i in range(tq)]
        if not 4 * tq * max(counts) <= 5 * sum(counts):
            return 0
    return 1


def _layout_from_counts(counts, tile_m: int = 64, tile_n: int = 64, tiles_k: int | None = None) -> TileLayout:
    """A layout whose tile row r of layout l stores counts[l][r] FULL tiles (columns 0..count-1)."""
    counts = np.asarray(counts, np.int64)
    L, tq = counts.shape
    tk = int(tiles_k or max(1, counts.max()))
    dense = np.zeros((L, tq * tile_m, tk * tile_n), bool)
    for lay in range(L):
        for r in range(tq):
            dense[lay, r * tile_m:(r + 1) * tile_m, :counts[lay, r] * tile_n] = True
    layout = TileLayout.from_dense(dense, tile_m, tile_n)
    assert np.array_equal(np.diff(layout.row_ptr.astype(np.int64)).reshape(L, tq), counts)
    return layout


def test_sched_chunk_definition():
    n = 0
    for layout in _random_layouts(80, seed=11):
        got = layout.sched_chunk()
        assert type(got) is int and got in (0, 1)
        assert got == _reference(layout.row_ptr, layout.num_layouts, layout.Tq), repr(layout)
        n += got
    assert 0 < n < 80, "random layouts should give both values"


def test_sched_chunk_known_cases():
    assert _layout_from_counts([[3, 3, 3, 3]]).sched_chunk() == 1              # all rows equal
    assert _layout_from_counts([[1, 1, 1, 8]]).sched_chunk() == 0              # one long row
    assert TileLayout.from_dense(np.zeros((2, 200, 100), bool)).sched_chunk() == 1   # no stored tile: 0 <= 0
    assert _layout_from_counts([[0, 0, 0, 0], [2, 2, 2, 2]]).sched_chunk() == 1  # an empty layout beside a flat one
    # only one layout of the stack is skewed -> 0
    assert _layout_from_counts([[2, 2, 2, 2], [2, 2, 2, 2], [1, 1, 1, 6]]).sched_chunk() == 0
    assert _layout_from_counts([[1, 1, 1, 6], [2, 2, 2, 2]]).sched_chunk() == 0
    # the boundary, exactly: 4 rows, total 20 -> longest 6.25 allowed; 6 passes (96 <= 100), 7 fails (112 > 100)
    assert _layout_from_counts([[6, 5, 5, 4]]).sched_chunk() == 1
    assert _layout_from_counts([[7, 5, 4, 4]]).sched_chunk() == 0
    # 4 * Tq * longest == 5 * total: 4 rows [5,4,4,3] -> 80 == 80 (integers, no rounding) -> 1
    assert _layout_from_counts([[5, 4, 4, 3]]).sched_chunk() == 1
    assert compile_mask("sliding:window=128", 4096, 4096).sched_chunk() == 1
    assert compile_mask("dilated:window=256,dilation=2", 4096, 4096).sched_chunk() == 1
    assert compile_mask("causal", 4096, 4096).sched_chunk() == 0
    assert compile_mask("longformer:window=128,global=16", 4096, 4096).sched_chunk() == 0
    assert compile_mask("causal", 10, 10).sched_chunk() == 1                    # a single tile row is its own mean


def test_sched_chunk_not_stored():
    layout = compile_mask("sliding:window=128", 512, 512)
    sig = layout.signature()
    layout.sched_chunk()
    assert layout.signature() == sig
    assert set(layout.arrays()) == {"row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"}


def _native(kernels, layout) -> int:
    return kernels.DeviceLayout(layout, device="cpu").sched_chunk


def test_native_matches_numpy(kernels):
    n = 0
    for layout in _random_layouts(150, seed=13):
        assert _native(kernels, layout) == layout.sched_chunk(), repr(layout)
        n += 1
    for spec in SPECS:
        for S in (512, 1000, 4096):
            layout = compile_mask(spec, S, S, num_heads=4)
            assert _native(kernels, layout) == layout.sched_chunk()
    assert n == 150


def test_native_random_counts(kernels):
    """Raw row_ptr arrays near the 5/4 boundary, long layout stacks."""
    rng = np.random.default_rng(5)
    seen = set()
    for _ in range(400):
        L, tq = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        base = rng.integers(0, 20)
        counts = base + rng.integers(0, int(rng.integers(1, 8)), L * tq)
        row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        got = _native(kernels, _raw_layout(row_ptr, L, tq))
        assert got == _reference(row_ptr, L, tq)
        seen.add(got)
    assert seen == {0, 1}


def test_native_known_cases(kernels):
    for counts, want in [([[3, 3, 3, 3]], 1), ([[1, 1, 1, 8]], 0), ([[0, 0, 0, 0], [0, 0, 0, 0]], 1),
                         ([[2, 2, 2, 2], [2, 2, 2, 2], [1, 1, 1, 6]], 0), ([[5, 4, 4, 3]], 1), ([[7, 5, 4, 4]], 0)]:
        c = np.asarray(counts, np.int64)
        row_ptr = np.concatenate([[0], np.cumsum(c.ravel())]).astype(np.int32)
        assert _native(kernels, _raw_layout(row_ptr, c.shape[0], c.shape[1])) == want, counts
        assert _layout_from_counts(counts).sched_chunk() == want, counts


def test_params_struct_size(kernels):
    """ctypes' _Params has the C struct's size: stof_attn_params_init memsets sizeof(stof_attn_params_t) bytes of
    a buffer prefilled with 0xFF (and longer than _Params) and then sets its defaults: the last byte it touched
    ends the C struct."""
    lib = kernels.load_library()
    n = ctypes.sizeof(kernels._Params)
    buf = (ctypes.c_uint8 * (n + 64))(*([0xFF] * (n + 64)))
    lib.stof_attn_params_init(ctypes.cast(buf, ctypes.POINTER(kernels._Params)))
    touched = [i for i in range(n + 64) if buf[i] != 0xFF]
    assert touched[-1] + 1 == n, f"C struct {touched[-1] + 1} bytes, ctypes _Params {n}"


def _cpu_problem(kernels, spec="sliding:window=128", S=256, H=2):
    torch = pytest.importorskip("torch")
    layout = compile_mask(spec, S, S, num_heads=H)
    dl = kernels.DeviceLayout(layout, device="cpu")     # host only: validate only reads the pointers' values
    q = torch.zeros(1, H, S, 64, dtype=torch.float16)
    return layout, dl, q


def test_make_params_passes_sched_chunk(kernels):
    for spec, want in [("sliding:window=128", 1), ("longformer:window=128,global=16", 0)]:
        layout, dl, q = _cpu_problem(kernels, spec, S=1024)
        assert dl.sched_chunk == layout.sched_chunk() == want
        for ro in (True, False):                                              # independent of row_order
            p = kernels._make_params(q, q, q, q, dl, None, None, None, True, ro)
            assert p.sched_chunk == -1 and (p.options & kernels.OPT_NO_ROW_ORDER == 0) == ro
            for explicit in (0, 1, 3):
                p = kernels._make_params(q, q, q, q, dl, None, None, None, True, ro, explicit)
                assert p.sched_chunk == explicit and (p.options & kernels.OPT_NO_ROW_ORDER == 0) == ro


def test_make_params_options(kernels):
    """row_order=False drops both orders, pair_order=False the pair order only, lane_bitmaps=False the lane
    bitmaps; by default every schedule the layout has goes to the library."""
    layout, dl, q = _cpu_problem(kernels, "longformer:window=128,global=16", S=1024)
    K = kernels
    assert K._make_params(q, q, q, q, dl, None, None, None, True).options == 0
    no_orders = K.OPT_NO_ROW_ORDER | K.OPT_NO_PAIR_ORDER
    assert K._make_params(q, q, q, q, dl, None, None, None, True, False).options == no_orders
    assert K._make_params(q, q, q, q, dl, None, None, None, True, True, None, False).options == K.OPT_NO_PAIR_ORDER
    plain = K.DeviceLayout(layout, device="cpu", lane_bitmaps=False)
    assert K._make_params(q, q, q, q, plain, None, None, None, True).options == K.OPT_NO_LANE_BITMAPS


def test_validate_rejects_sched_chunk_below_minus_one(kernels):
    lib = kernels.load_library()
    _, dl, q = _cpu_problem(kernels)
    for chunk in (-1, 0, 1, 3, None):
        p = kernels._make_params(q, q, q, q, dl, None, None, None, True, True, chunk)
        assert lib.stof_attn_validate(ctypes.byref(p)) != 1, lib.stof_last_error_message()  # not INVALID_ARGUMENT
    for chunk in (-2, -1000):
        p = kernels._make_params(q, q, q, q, dl, None, None, None, True, True, chunk)
        assert lib.stof_attn_validate(ctypes.byref(p)) == 1                   # INVALID_ARGUMENT
        assert b"sched_chunk" in lib.stof_last_error_message()
        with pytest.raises(kernels.StofKernelError) as ei:
            kernels.list_tactics(q, q, q, dl, sched_chunk=chunk)
        assert ei.value.status == 1
