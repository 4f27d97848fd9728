"""TileLayout.row_order() and pair_order() (derived schedule arrays of docs/format.md) equal what the library's
layout handle derives, on random layouts.  The numpy side always runs; the native comparison runs wherever
libstof_kernels.so is built (CI builds it with nvcc; no GPU needed) and skips otherwise."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from types import SimpleNamespace

from stof_trt.format import TileLayout, compile_mask

SPECS = [
    "causal",
    "sliding:window=128",
    "longformer:window=128,global=16",
    "bigbird:block=64,window=1,global=1,random=0.05,seed=0",
    "bigbird:block=32,window=1,global=1,random=0.2,seed=3,per_head=1",
    "dilated:window=256,dilation=2",
    "sliding:window=40|global:n=3",
]


def _reference(row_ptr: np.ndarray, L: int, tq: int) -> np.ndarray:
    """The definition, spelled out: rows listed Tq-1..0, stable-sorted by decreasing stored-tile count."""
    out = []
    for lay in range(L):
        rows = list(range(tq - 1, -1, -1))
        rows.sort(key=lambda r: -int(row_ptr[lay * tq + r + 1] - row_ptr[lay * tq + r]))
        out += rows
    return np.array(out, np.int32)


def _random_layouts(n: int, seed: int = 0):
    """Random masks of every kind: block-structured with empty rows (many zero-tile rows and ties), per-head
    layouts, tails, odd tile shapes, and the mask generators' specs."""
    rng = np.random.default_rng(seed)
    tiles = [(64, 64), (16, 32), (32, 64), (128, 32), (64, 128)]
    for i in range(n):
        tm, tn = tiles[i % len(tiles)]
        L = int(rng.choice([1, 1, 2, 3, 5]))
        sq, sk = int(rng.integers(1, 700)), int(rng.integers(1, 700))
        if i % 3 == 0:  # a mask generator's spec
            spec = SPECS[i // 3 % len(SPECS)]
            yield compile_mask(spec, sq, sk, tile_m=tm, tile_n=tn, num_heads=L)
            continue
        dense = rng.random((L, sq, sk)) < rng.uniform(0.0, 0.3)
        dense[:, rng.random(sq) < rng.uniform(0.0, 0.6)] = False            # empty query rows -> zero-tile rows
        if i % 2:                                                             # block-level structure: many ties
            keep = rng.random((L, -(-sq // tm), -(-sk // tn))) < rng.uniform(0.1, 0.9)
            dense &= np.repeat(np.repeat(keep, tm, 1), tn, 2)[:, :sq, :sk]
        yield TileLayout.from_dense(dense, tm, tn)


def _check_properties(layout: TileLayout, order: np.ndarray) -> None:
    L, tq = layout.num_layouts, layout.Tq
    assert order.dtype == np.int32 and order.shape == (L * tq,)
    lengths = np.diff(layout.row_ptr.astype(np.int64)).reshape(L, tq)
    per = order.reshape(L, tq)
    for lay in range(L):
        assert np.array_equal(np.sort(per[lay]), np.arange(tq)), "not a permutation of the layout's tile rows"
        ln = lengths[lay, per[lay]]
        assert np.all(np.diff(ln) <= 0), "row lengths not non-increasing"
        ties = np.diff(ln) == 0
        assert np.all(np.diff(per[lay])[ties] < 0), "ties not higher row first"


def test_row_order_definition():
    for layout in _random_layouts(60, seed=1):
        order = layout.row_order()
        _check_properties(layout, order)
        assert np.array_equal(order, _reference(layout.row_ptr, layout.num_layouts, layout.Tq))


def test_row_order_known_cases():
    causal = compile_mask("causal", 256, 256)                 # 4 tile rows of 1..4 tiles: last row first
    assert causal.row_order().tolist() == [3, 2, 1, 0]
    empty = TileLayout.from_dense(np.zeros((2, 200, 100), bool))   # all rows empty: every layout Tq-1..0
    assert empty.row_order().tolist() == [3, 2, 1, 0, 3, 2, 1, 0]
    lf = compile_mask("longformer:window=128,global=16", 1024, 1024)
    assert lf.row_order()[0] == 0                              # the global row (all tiles) starts first
    one = compile_mask("causal", 10, 10)                       # a single tile row
    assert one.row_order().tolist() == [0]


def test_row_order_not_stored():
    layout = compile_mask("longformer:window=128,global=16", 512, 512)
    assert set(layout.arrays()) == {"row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"}
    sig = layout.signature()
    layout.row_order()
    assert layout.signature() == sig


def _raw_layout(row_ptr: np.ndarray, L: int, tq: int, tile: int = 64):
    """A layout object (the attributes DeviceLayout reads) whose row r stores FULL tiles at columns 0..len-1."""
    counts = np.diff(row_ptr.astype(np.int64))
    tk = max(1, int(counts.max()))
    col = np.concatenate([np.arange(c) for c in counts]).astype(np.int32) if counts.sum() else np.zeros(1, np.int32)
    return SimpleNamespace(row_ptr=row_ptr, col_idx=col, tile_bitmap_index=np.full(col.size, -1, np.int32),
                           bitmaps=np.zeros((1, tile * tile // 32), np.int32), tile_m=tile, tile_n=tile,
                           num_layouts=L, seq_q=tq * tile, seq_k=tk * tile)


@pytest.mark.parametrize("derived,seed", [("row_order", 7), ("pair_order", 13)])
def test_native_matches_numpy(kernels, derived, seed):
    """The layout handle's row order and pair order equal TileLayout's on random layouts."""
    n = 0
    for layout in _random_layouts(150, seed=seed):
        dl = kernels.DeviceLayout(layout, device="cpu")
        assert np.array_equal(dl.derived(derived), getattr(layout, derived)()), repr(layout)
        last_first = np.tile(np.arange(len(getattr(layout, derived)()) // layout.num_layouts)[::-1],
                             layout.num_layouts)
        flag = dl.row_order_is_default if derived == "row_order" else dl.pair_order_is_default
        assert flag == np.array_equal(getattr(layout, derived)(), last_first)
        n += 1
    assert n == 150


def test_native_large_ties(kernels):
    """Many equal rows (stable-sort tie order) and a long layout stack."""
    rng = np.random.default_rng(3)
    L, tq = 12, 300
    counts = rng.integers(0, 4, L * tq)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    dl = kernels.DeviceLayout(_raw_layout(row_ptr, L, tq), device="cpu")
    assert np.array_equal(dl.derived("row_order"), _reference(row_ptr, L, tq))


def test_abi_version(kernels):
    lib = kernels.load_library()
    assert lib.stof_abi_version() == kernels.ABI_VERSION == 9
    names = [f[0] for f in kernels._Params._fields_]
    assert names[-9:] == ["layout", "key_lengths", "key_padding_mask", "workspace", "workspace_bytes", "sched_chunk",
                          "options", "kv_heads", "seq_offsets"]
    p = kernels._Params()
    p.seq_offsets = 1 << 20  # init zeroes it
    lib.stof_attn_params_init(ctypes.byref(p))
    assert p.layout is None and p.key_lengths is None and p.key_padding_mask is None and p.seq_offsets is None
    assert p.sched_chunk == -1                                           # the layout's choice
    assert p.workspace is None and p.workspace_bytes == 0 and p.options == 0 and p.kv_heads == 0
    assert lib.stof_attn_validate(ctypes.byref(p)) != 0                 # no sizes, no layout


_KEEP = []


def _valid_params(kernels):
    """A problem the library validates (host-side checks only: pointers are not dereferenced)."""
    p = kernels._Params()
    kernels.load_library().stof_attn_params_init(ctypes.byref(p))
    p.batch, p.num_heads, p.seq_q, p.seq_k, p.head_dim = 1, 1, 128, 128, 64
    fake = 1 << 20  # 16-byte aligned, never dereferenced by validate / workspace_size
    p.q = p.k = p.v = p.o = fake
    p.q_stride_s = p.k_stride_s = p.v_stride_s = p.o_stride_s = 64
    p.q_stride_h = p.k_stride_h = p.v_stride_h = p.o_stride_h = 128 * 64
    p.q_stride_b = p.k_stride_b = p.v_stride_b = p.o_stride_b = 128 * 64
    dl = kernels.DeviceLayout(compile_mask("causal", 128, 128), device="cpu")
    _KEEP.append(dl)  # the handle outlives the params
    p.layout = dl._handle
    return p


def test_workspace_size_and_checks(kernels):
    """The warp-specialised tactics ask for a 16-byte work counter, the others for nothing; tactic 0 gets
    the most any tactic uses; a misaligned workspace or a negative size is INVALID_ARGUMENT."""
    lib = kernels.load_library()
    p = _valid_params(kernels)
    assert lib.stof_attn_validate(ctypes.byref(p)) in (0, 2), kernels.load_library().stof_last_error_message()
    n = ctypes.c_size_t(123)
    for tactic, want in ((23, 16), (21, 16), (13, 0), (1, 0), (11, 0), (0, 16)):
        assert lib.stof_attn_workspace_size(ctypes.byref(p), tactic, ctypes.byref(n)) == 0, tactic
        assert n.value == want, (tactic, n.value)
    assert lib.stof_attn_workspace_size(ctypes.byref(p), 999, ctypes.byref(n)) == 3   # INVALID_TACTIC
    p.workspace, p.workspace_bytes = (1 << 20) + 4, 16
    assert lib.stof_attn_workspace_size(ctypes.byref(p), 23, ctypes.byref(n)) == 1    # misaligned
    assert b"aligned" in lib.stof_last_error_message()
    p.workspace, p.workspace_bytes = 1 << 20, -1
    assert lib.stof_attn_workspace_size(ctypes.byref(p), 23, ctypes.byref(n)) == 1    # negative size


# --- the pair order: pairs of tile rows (2p, 2p+1) for kernels whose work item covers two tile rows ---

def _pair_reference(row_ptr: np.ndarray, L: int, tq: int) -> np.ndarray:
    """The definition, spelled out: pairs listed last..0, stable-sorted by the stored tiles of their longer row."""
    tp = (tq + 1) // 2
    out = []
    for lay in range(L):
        n = [int(row_ptr[lay * tq + r + 1] - row_ptr[lay * tq + r]) for r in range(tq)]
        longer = [max(n[2 * i: 2 * i + 2]) for i in range(tp)]
        pairs = list(range(tp - 1, -1, -1))
        pairs.sort(key=lambda i: -longer[i])
        out += pairs
    return np.array(out, np.int32)


def test_pair_order_definition():
    n_odd = 0
    for layout in _random_layouts(60, seed=11):
        L, tq = layout.num_layouts, layout.Tq
        tp = (tq + 1) // 2
        order = layout.pair_order()
        assert order.dtype == np.int32 and order.shape == (L * tp,)
        for lay in range(L):
            assert np.array_equal(np.sort(order[lay * tp:(lay + 1) * tp]), np.arange(tp))
        assert np.array_equal(order, _pair_reference(layout.row_ptr, L, tq))
        n_odd += tq % 2
    assert n_odd > 5  # odd Tq (a last pair of one row) was covered


def test_pair_order_known_cases():
    causal = compile_mask("causal", 512, 512)                 # 8 tile rows, pairs of 2/4/6/8 tiles: last first
    assert causal.pair_order().tolist() == [3, 2, 1, 0]
    lf = compile_mask("longformer:window=128,global=16", 1024, 1024)
    assert lf.pair_order()[0] == 0                             # the pair holding the global row starts first
    odd = compile_mask("causal", 320, 320)                     # Tq = 5: pairs (0, 1), (2, 3), (4)
    assert odd.pair_order().tolist() == [2, 1, 0]              # the lone last row (5 tiles) leads
    assert compile_mask("causal", 10, 10).pair_order().tolist() == [0]


def test_native_pair_order_large_ties(kernels):
    rng = np.random.default_rng(5)                             # many ties, a long odd stack
    L, tq = 12, 301
    row_ptr = np.concatenate([[0], np.cumsum(rng.integers(0, 4, L * tq))]).astype(np.int32)
    dl = kernels.DeviceLayout(_raw_layout(row_ptr, L, tq), device="cpu")
    assert np.array_equal(dl.derived("pair_order"), _pair_reference(row_ptr, L, tq))
