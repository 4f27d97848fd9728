"""TileLayout.lane_bitmaps() (the derived array of docs/format.md) against its definition, bit by bit, and against
what the library's layout handle derives (wherever libstof_kernels.so is built; CI builds it, no GPU needed)."""
from __future__ import annotations

import ctypes

from types import SimpleNamespace

import numpy as np
import pytest

from stof_trt.format import TileLayout, compile_mask, lane_bitmaps

SHAPES = [(64, 64), (16, 64), (128, 128), (64, 128), (128, 64), (32, 192), (256, 64)]


def _definition(bitmaps: np.ndarray, tile_m: int, tile_n: int) -> np.ndarray:
    """docs/format.md's definition, one bit at a time."""
    P = bitmaps.shape[0]
    words = bitmaps.view(np.uint32).reshape(P, tile_m, tile_n // 32)
    out = np.zeros((P, tile_m // 16, tile_n // 64, 32, 2), np.uint32)
    for p in range(P):
        for r in range(tile_m // 16):
            for j in range(tile_n // 64):
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    z = y = 0
                    for q in range(4):
                        for h in range(2):
                            for w in range(2):
                                for c in range(2):
                                    col = 64 * j + 32 * w + 8 * q + 2 * t + c
                                    bit = int(words[p, 16 * r + g + 8 * h, col // 32] >> (col % 32)) & 1
                                    z |= bit << (8 * q + 2 * (2 * h + w) + c)
                        y |= ((z >> (8 * q + 7)) & 1) << q
                    out[p, r, j, lane] = (z, y)
    return out.view(np.int32).ravel()


@pytest.mark.parametrize("tile_m,tile_n", SHAPES[:4])
def test_matches_definition(tile_m, tile_n):
    rng = np.random.default_rng(tile_m + tile_n)
    bm = rng.integers(-2**31, 2**31, size=(2, tile_m * tile_n // 32), dtype=np.int64).astype(np.int32)
    got = lane_bitmaps(bm, tile_m, tile_n)
    assert got.dtype == np.int32 and got.shape == (2 * tile_m * tile_n // 16,)
    assert np.array_equal(got, _definition(bm, tile_m, tile_n))


def test_layout_method_and_shapes_without():
    lay = compile_mask("sliding:window=128", 1000, 1000)
    lb = lay.lane_bitmaps()
    assert lb.shape == (lay.bitmaps.shape[0] * 64 * 64 // 16,)
    assert np.array_equal(lb, _definition(lay.bitmaps, 64, 64))
    # tile shapes the tensor-core kernels cannot run have none
    assert compile_mask("causal", 100, 100, tile_m=64, tile_n=32).lane_bitmaps() is None
    assert compile_mask("causal", 100, 100, tile_m=8 * 2, tile_n=96).lane_bitmaps() is None
    assert lane_bitmaps(np.zeros((1, 8 * 64 // 32), np.int32), 8, 64) is None


def _bitmap_layout(bm: np.ndarray, tile_m: int, tile_n: int):
    """A one-tile-row layout whose tiles use each of the P bitmaps once (the attributes DeviceLayout reads)."""
    P = bm.shape[0]
    return SimpleNamespace(row_ptr=np.array([0, P], np.int32), col_idx=np.arange(P, dtype=np.int32),
                           tile_bitmap_index=np.arange(P, dtype=np.int32), bitmaps=bm, tile_m=tile_m, tile_n=tile_n,
                           num_layouts=1, seq_q=tile_m, seq_k=P * tile_n)


@pytest.mark.parametrize("tile_m,tile_n", SHAPES)
def test_native_matches_numpy(kernels, tile_m, tile_n):
    rng = np.random.default_rng(7 * tile_m + tile_n)
    for P in (1, 3):
        bm = rng.integers(-2**31, 2**31, size=(P, tile_m * tile_n // 32), dtype=np.int64).astype(np.int32)
        dl = kernels.DeviceLayout(_bitmap_layout(bm, tile_m, tile_n), device="cpu")
        assert dl.has_lane_bitmaps and dl.num_bitmaps == P
        assert np.array_equal(dl.derived("lane_bitmaps"), lane_bitmaps(bm, tile_m, tile_n))
    dense = rng.random((2, 300, 333)) < 0.3
    lay = TileLayout.from_dense(dense, tile_m, tile_n)
    assert np.array_equal(kernels.DeviceLayout(lay, device="cpu").derived("lane_bitmaps"), lay.lane_bitmaps())


def test_native_every_bit_and_shapes_without(kernels):
    bm = np.full((1, 128), -1, np.int32)                             # every bit set
    out = kernels.DeviceLayout(_bitmap_layout(bm, 64, 64), device="cpu").derived("lane_bitmaps")
    assert out.view(np.uint32)[0::2].tolist() == [0xffffffff] * 128 and out[1::2].tolist() == [0xf] * 128
    for tm, tn in ((64, 32), (16, 96)):                              # tile_n not a multiple of 64: none
        dl = kernels.DeviceLayout(compile_mask("causal", 100, 100, tile_m=tm, tile_n=tn), device="cpu")
        assert not dl.has_lane_bitmaps and dl.derived("lane_bitmaps").size == 0
