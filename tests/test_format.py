"""The tile format: exact round trips, invariants, bit order (docs/format.md)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stof_trt import StofError, TileClass, TileLayout, compile_mask
from stof_trt.masks import parse_mask

TILES = st.sampled_from([(16, 32), (32, 32), (64, 64), (48, 96), (128, 64), (64, 128)])


@st.composite
def random_masks(draw):
    """Random boolean masks with structure at random scales: dense noise, block noise, empty and full rows."""
    L = draw(st.integers(1, 3))
    sq, sk = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["noise", "blocks", "mixed", "empty", "full"]))
    if kind == "empty":
        return np.zeros((L, sq, sk), bool)
    if kind == "full":
        return np.ones((L, sq, sk), bool)
    p = draw(st.floats(0.0, 1.0))
    noise = rng.random((L, sq, sk)) < p
    b = draw(st.integers(1, 80))
    blocks = rng.random((L, -(-sq // b), -(-sk // b))) < p
    blocks = blocks.repeat(b, 1).repeat(b, 2)[:, :sq, :sk]
    if kind == "noise":
        return noise
    if kind == "blocks":
        return blocks
    return blocks | (noise & (rng.random((L, sq, sk)) < 0.1))


@settings(max_examples=150, deadline=None)
@given(random_masks(), TILES)
def test_dense_round_trip_is_exact(mask, tile):
    layout = TileLayout.from_dense(mask, *tile)
    layout.validate()
    assert layout.to_dense().shape == mask.shape
    assert np.array_equal(layout.to_dense(), mask)
    assert layout.density() == pytest.approx(mask.mean(), abs=1e-12)
    # Classes are exact: FULL tiles hold only allowed in-range elements, PARTIAL tiles hold both kinds.
    classes = layout.tile_classes()
    tm, tn = tile
    for (l, i, j) in zip(*np.nonzero(classes)):
        block = mask[l, i * tm:(i + 1) * tm, j * tn:(j + 1) * tn]
        assert block.any()
        assert block.all() == (classes[l, i, j] == TileClass.FULL)


SPECS = [
    "causal", "causal:offset=5", "sliding:window=17", "sliding:window=40,causal=1", "sliding:left=3,right=70",
    "dilated:window=50,dilation=2", "dilated:window=33,dilation=3,causal=1", "global:n=5", "global:tokens=0;9;130",
    "longformer:window=20,global=3", "bigbird:block=16,window=1,global=1,random=0.2,seed=3",
    "bigbird:block=24,random=0.3,per_head=1", "causal&sliding:window=30|global:tokens=77", "(full&causal)|sliding:window=2",
]


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 260), st.integers(1, 260), TILES)
def test_compile_mask_matches_spec_bit_for_bit(spec, sq, sk, tile):
    mask = parse_mask(spec)
    layout = compile_mask(mask, sq, sk, tile_m=tile[0], tile_n=tile[1], num_heads=4)
    layout.validate()
    dense = mask.dense(sq, sk, num_heads=4)
    dense = dense[None] if dense.ndim == 2 else dense
    assert np.array_equal(layout.to_dense(), dense)
    # The analytical classification must agree with classifying the dense matrix.
    assert layout.signature() == TileLayout.from_dense(dense, *tile).signature()


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 260), st.integers(1, 260), TILES, st.sampled_from([1, 3, 40]),
       st.sampled_from([1, 5000]))
def test_compile_mask_in_blocks_of_tile_rows(spec, sq, sk, tile, grid_tiles, chunk_elements):
    """compile_mask classifies the tile grid a block of tile rows at a time (memory bounded by the stored tiles):
    blocks of one or a few tile rows, and unknown tiles evaluated one or a few at a time, give the layout that
    the dense mask gives."""
    from unittest import mock

    import stof_trt.format as fmt

    mask = parse_mask(spec)
    with mock.patch.object(fmt, "_GRID_CHUNK_TILES", grid_tiles), mock.patch.object(fmt, "_CHUNK_ELEMENTS",
                                                                                     chunk_elements):
        layout = compile_mask(mask, sq, sk, tile_m=tile[0], tile_n=tile[1], num_heads=3)
    layout.validate()
    dense = mask.dense(sq, sk, num_heads=3)
    dense = dense[None] if dense.ndim == 2 else dense
    assert layout.signature() == TileLayout.from_dense(dense, *tile).signature()


def test_compile_mask_memory_grows_with_stored_tiles():
    """A 2^20-token band with global tokens (a 16,384 x 16,384 tile grid, 268 M tiles) compiles with the grid
    never held whole: the peak of numpy's traced allocations stays far below one byte per grid tile."""
    import tracemalloc

    S = 1 << 20
    tracemalloc.start()
    layout = compile_mask("sliding:window=128|global:n=3", S, S)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert layout.Tq == layout.Tk == S // 64
    T = S // 64  # the band's 5 tiles per row (3 and 4 at the ends), then tile column 0 and tile row 0 beyond it
    assert layout.nnz == (5 * T - 6) + 2 * (T - 3)
    assert peak < 256 << 20, peak / 2**20


def test_bit_order_is_lsb_first_row_major():
    m = np.zeros((64, 64), bool)
    m[0, 0] = m[0, 33] = m[1, 0] = m[63, 63] = True
    lay = TileLayout.from_dense(m, 64, 64)
    w = lay.bitmaps[0].view(np.uint32)
    assert w.shape == (128,)
    assert w[0] == 1 and w[1] == 2          # (0,0) -> word 0 bit 0; (0,33) -> word 1 bit 1
    assert w[2] == 1                          # (1,0) -> word 2 bit 0 (a row is tile_n/32 = 2 words)
    assert w[127] == 1 << 31 and lay.bitmaps[0][127] < 0   # stored as int32: bit 31 is the sign bit
    assert np.count_nonzero(w) == 4


def test_empty_and_full_masks_keep_tensors_non_empty():
    empty = TileLayout.from_dense(np.zeros((100, 70), bool))
    assert empty.nnz == 0 and empty.col_idx.shape == (1,) and empty.bitmaps.shape == (1, 128)
    assert not empty.to_dense().any()
    full = compile_mask("full", 100, 70)
    assert full.nnz == 4 and full.num_partial == 0 and full.bitmaps.shape == (1, 128)
    assert full.to_dense().all()
    for lay in (empty, full):
        for a in lay.arrays().values():
            assert a.dtype == np.int32 and a.flags.c_contiguous


def test_tails_are_full_when_all_in_range_elements_are_allowed():
    lay = compile_mask("full", 65, 97, tile_m=64, tile_n=64)
    assert lay.class_counts() == {"empty": 0, "full": 4, "partial": 0}


def test_per_head_layouts_and_head_mapping():
    lay = compile_mask("bigbird:block=16,random=0.5,per_head=1", 64, 64, tile_m=16, tile_n=32, num_heads=3)
    assert lay.num_layouts == 3
    d = lay.to_dense()
    assert not (np.array_equal(d[0], d[1]) and np.array_equal(d[1], d[2]))


@pytest.mark.parametrize("bad", [(8, 64), (64, 48), (64, 0), (512, 64)])
def test_bad_tile_shapes(bad):
    with pytest.raises(StofError):
        compile_mask("causal", 128, 128, tile_m=bad[0], tile_n=bad[1])


def test_validate_rejects_broken_arrays():
    lay = compile_mask("sliding:window=70", 256, 256)
    fields = dict(seq_q=256, seq_k=256, tile_m=64, tile_n=64, num_layouts=1, row_ptr=lay.row_ptr,
                  col_idx=lay.col_idx, tile_bitmap_index=lay.tile_bitmap_index, bitmaps=lay.bitmaps)
    TileLayout.from_arrays(**fields)
    for name, broken in [("row_ptr", lay.row_ptr[:-1]), ("col_idx", lay.col_idx[::-1].copy()),
                         ("tile_bitmap_index", np.full_like(lay.tile_bitmap_index, 7)),
                         ("bitmaps", lay.bitmaps[:, :5])]:
        with pytest.raises(StofError):
            TileLayout.from_arrays(**{**fields, name: broken})


def _unshared(lay: TileLayout) -> TileLayout:
    """lay.unshared(), checked by hand: one bitmap per PARTIAL tile, numbered in storage order."""
    v1 = lay.unshared()
    v1.validate()
    p = v1.tile_bitmap_index[: v1.nnz]
    assert np.array_equal(p[p >= 0], np.arange(lay.num_partial))
    assert v1.bitmaps.shape == (max(lay.num_partial, 1), lay.words_per_tile)
    return v1


@pytest.mark.parametrize("spec, shared", [("causal", 1), ("sliding:window=128", 2),
                                          ("dilated:window=256,dilation=2", 3), ("longformer:window=128,global=16", 6)])
def test_identical_bitmaps_are_stored_once(spec, shared):
    lay = compile_mask(spec, 4096, 4096)
    lay.validate()
    assert lay.num_partial > 10 * shared and lay.num_bitmaps == shared
    assert len({row.tobytes() for row in lay.bitmaps}) == lay.num_bitmaps  # no two rows equal
    p = lay.tile_bitmap_index[: lay.nnz]
    first_use = p[p >= 0][np.sort(np.unique(p[p >= 0], return_index=True)[1])]
    assert np.array_equal(first_use, np.arange(lay.num_bitmaps))  # numbered in order of first use
    assert lay.partial_tile_bits().shape == (lay.num_partial,)


@settings(max_examples=60, deadline=None)
@given(random_masks(), TILES)
def test_shared_and_version1_forms_describe_the_same_mask(mask, tile):
    lay = TileLayout.from_dense(mask, *tile)
    v1 = _unshared(lay)  # validates: version-1 layouts stay readable
    assert v1.num_partial == lay.num_partial and v1.num_bitmaps == lay.num_partial >= lay.num_bitmaps
    assert np.array_equal(v1.to_dense(), lay.to_dense())
    assert v1.density() == lay.density() and v1.class_counts() == lay.class_counts()
    assert np.array_equal(np.sort(v1.partial_tile_bits()), np.sort(lay.partial_tile_bits()))
    from stof_trt import presearch as ps
    a, b = ps.tile_stats(lay), ps.tile_stats(v1)
    assert (a.words, a.allowed, a.num_partial) == (b.words, b.allowed, b.num_partial)
    # and compiling the version-1 form's dense mask gives the shared form back, array for array
    again = TileLayout.from_dense(v1.to_dense(), *tile)
    for name, arr in lay.arrays().items():
        assert np.array_equal(arr, again.arrays()[name]), name


def test_validate_rejects_unused_and_out_of_range_bitmaps():
    lay = compile_mask("sliding:window=70", 256, 256)
    fields = dict(seq_q=256, seq_k=256, tile_m=64, tile_n=64, num_layouts=1, row_ptr=lay.row_ptr,
                  col_idx=lay.col_idx, tile_bitmap_index=lay.tile_bitmap_index, bitmaps=lay.bitmaps)
    with pytest.raises(StofError, match="one row per bitmap"):  # a row nothing references
        TileLayout.from_arrays(**{**fields, "bitmaps": np.concatenate([lay.bitmaps, lay.bitmaps[:1]])})
    tbi = lay.tile_bitmap_index.copy()
    tbi[tbi >= 0] = 0  # every tile on bitmap 0: row 1 unused
    with pytest.raises(StofError):
        TileLayout.from_arrays(**{**fields, "tile_bitmap_index": tbi})
    tbi[np.flatnonzero(lay.tile_bitmap_index >= 0)[0]] = -2
    with pytest.raises(StofError):
        TileLayout.from_arrays(**{**fields, "tile_bitmap_index": tbi})


@pytest.mark.parametrize("past", [-2, -7, 4, 7, 2**31 - 1])
def test_a_corrupt_bitmap_index_is_named_as_such(past):
    """An entry of tile_bitmap_index outside [-1, P) is reported as that entry, whatever the bitmaps' shape."""
    lay = compile_mask("sliding:window=70", 256, 256)
    assert lay.num_bitmaps == 4
    tbi = lay.tile_bitmap_index.copy()
    at = int(np.flatnonzero(tbi >= 0)[1])
    value = tbi[at] = past
    fields = dict(seq_q=256, seq_k=256, tile_m=64, tile_n=64, num_layouts=1, row_ptr=lay.row_ptr,
                  col_idx=lay.col_idx, tile_bitmap_index=tbi, bitmaps=lay.bitmaps)
    with pytest.raises(StofError, match=rf"tile_bitmap_index\[{at}\] = {value}: must be -1 .* 0\.\.3$"):
        TileLayout.from_arrays(**fields)


def test_layouts_from_outside_are_checked():
    with pytest.raises(StofError, match="boolean or 0/1"):
        TileLayout.from_dense(np.full((64, 64), 0.5))
    with pytest.raises(StofError, match="boolean or 0/1"):
        TileLayout.from_dense(np.full((64, 64), np.nan))
    assert TileLayout.from_dense(np.ones((64, 64), np.int8)).density() == 1.0
    arrays = dict(compile_mask("causal", 128).arrays())
    sizes = dict(seq_q=128, seq_k=128, tile_m=64, tile_n=64, num_layouts=1)
    for bad in ({"seq_q": "128"}, {"seq_q": 128.5}, {"seq_q": True}):
        with pytest.raises(StofError, match="integers"):
            TileLayout.from_arrays(**{**sizes, **bad}, **arrays)
    with pytest.raises(StofError, match="int32"):
        TileLayout.from_arrays(**sizes, **{**arrays, "col_idx": arrays["col_idx"].astype(np.int64) + 2**40})
    with pytest.raises(StofError, match="int32"):  # would wrap to -1, the FULL-tile sentinel
        TileLayout.from_arrays(**sizes, **{**arrays, "tile_bitmap_index": np.full_like(
            arrays["tile_bitmap_index"], 2**32 - 1, dtype=np.int64)})
    words = arrays["bitmaps"].view(np.uint32)  # bitmaps as uint32 words: the same bits
    assert TileLayout.from_arrays(**sizes, **{**arrays, "bitmaps": words}).signature() == \
        compile_mask("causal", 128).signature()
    assert TileLayout.from_arrays(**sizes, **arrays).signature() == compile_mask("causal", 128).signature()
