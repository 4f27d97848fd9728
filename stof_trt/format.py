"""The unified two-level tile format (docs/format.md is the normative description; this module implements it).

Basics
------
A mask ``M[l, q, k]`` (``L`` layouts; head ``h`` uses layout ``h % L``) is cut into ``tile_m x tile_n`` tiles.
Each tile is EMPTY (not stored), FULL (stored, no bitmap) or PARTIAL (stored with a bitmap). The stored tiles form
a BSR structure over the flattened ``(layout, tile row)`` index.

Fields of ``TileLayout`` (all arrays int32, C-contiguous)
--------------------------------------------------------
``row_ptr``            ``[L*Tq + 1]``                 BSR row pointers; tile row ``i`` of layout ``l`` owns entries
                                                      ``row_ptr[l*Tq+i] : row_ptr[l*Tq+i+1]``.
``col_idx``            ``[max(nnz, 1)]``              tile column of each stored tile, ascending within a row.
``tile_bitmap_index``  ``[max(nnz, 1)]``              ``-1`` = FULL, else the row of ``bitmaps`` holding its bits.
                                                      PARTIAL tiles with identical bits share one row (format
                                                      version 2): ``compile_mask`` stores each distinct bitmap
                                                      once, numbered in order of first use.
``bitmaps``            ``[max(P, 1), tile_m*tile_n/32]`` P = distinct bitmaps (``num_bitmaps``), each referenced by
                                                      at least one tile; bit ``a*tile_n + b`` (tile row a, tile
                                                      column b) of word ``(a*tile_n + b) // 32``, LSB first; 0
                                                      outside the matrix.
Scalars: ``seq_q, seq_k`` (mask size), ``tile_m, tile_n``, ``num_layouts`` (= L), derived ``Tq, Tk, nnz,
num_partial`` (PARTIAL tiles), ``num_bitmaps`` (P). Padding entries (when nnz or P is 0) keep every tensor non-empty
and are never referenced.

Dense reconstruction: ``TileLayout.to_dense()``; compilation: ``compile_mask(spec, seq_q, seq_k)`` or
``TileLayout.from_dense(bool_array)``.

Derived arrays (computed from the fields, never stored or serialized)
--------------------------------------------------------------------
``row_order()``        ``[L*Tq]``                     per layout, its tile rows longest first: entry ``l*Tq + i`` is
                                                      the tile row (0..Tq-1) with the i-th most stored tiles, ties
                                                      to the higher row. The kernel library's layout handle
                                                      (``stof_layout_create``) derives the same: kernels start
                                                      long rows first so short rows fill the tail.
``sched_chunk()``      ``int`` (0 or 1)               1 when in every layout the longest tile row holds at most 5/4
                                                      of the mean stored tiles per row (``4*Tq*longest <= 5*total``,
                                                      integers), else 0; the layout handle derives the same (the
                                                      default of the C ABI's ``sched_chunk``): 1 = one (batch,
                                                      head) pair at a time, 0 = the library's L2-sized chunks.
``pair_order()`` and ``lane_bitmaps()`` are derived the same way (docs/format.md, "Derived").
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np

from .errors import StofError
from .masks import TILE_EMPTY, TILE_FULL, TILE_UNKNOWN, DenseMask, MaskSpec, TileGrid, parse_mask

__all__ = ["STOF_FORMAT_VERSION", "TileClass", "TileLayout", "compile_mask", "check_tile_shape"]

STOF_FORMAT_VERSION = 2
# Layouts of these versions are read: a version-1 layout (one bitmap per PARTIAL tile, in storage order) is a valid
# version-2 layout whose tiles share no bitmap.
STOF_FORMAT_VERSIONS_READ = (1, 2)

# Elements evaluated per chunk when classifying unknown tiles: bounds peak memory (~ a few x 16 MB).
_CHUNK_ELEMENTS = 1 << 24
# Tiles of the grid classified per block of tile rows in compile_mask (~ a few x 32 MB of index arrays).
_GRID_CHUNK_TILES = 1 << 22
# Most stored tiles compile_mask builds: ~17 bytes each while compiling (index, class, column, bitmap number), so
# 2^28 tiles take ~4.5 GB; more is refused before anything is allocated (a causal mask at 2^22 tokens is 2^31).
MAX_STORED_TILES = 1 << 28


class TileClass(enum.IntEnum):
    EMPTY = TILE_EMPTY
    FULL = TILE_FULL
    PARTIAL = 2


def check_tile_shape(tile_m: int, tile_n: int) -> None:
    if not (isinstance(tile_m, (int, np.integer)) and isinstance(tile_n, (int, np.integer))):
        raise StofError("tile sizes must be integers")
    if tile_m % 16 or not 16 <= tile_m <= 256:
        raise StofError(f"tile_m must be a multiple of 16 in [16, 256], got {tile_m}")
    if tile_n % 32 or not 32 <= tile_n <= 256:
        raise StofError(f"tile_n must be a multiple of 32 in [32, 256], got {tile_n}")


@dataclass(frozen=True, eq=False)
class TileLayout:
    """A compiled mask in the STOF tile format. See the module docstring for each field's shape and meaning."""

    seq_q: int
    seq_k: int
    tile_m: int
    tile_n: int
    num_layouts: int
    row_ptr: np.ndarray
    col_idx: np.ndarray
    tile_bitmap_index: np.ndarray
    bitmaps: np.ndarray
    mask_spec: str = ""

    # -- derived sizes ------------------------------------------------------------------------------------------
    @property
    def Tq(self) -> int:  # noqa: N802 - the format's own name
        return -(-self.seq_q // self.tile_m)

    @property
    def Tk(self) -> int:  # noqa: N802
        return -(-self.seq_k // self.tile_n)

    @property
    def nnz(self) -> int:
        return int(self.row_ptr[-1])

    @property
    def num_partial(self) -> int:
        """PARTIAL tiles (stored tiles with a bitmap)."""
        return int((self.tile_bitmap_index[: self.nnz] >= 0).sum())

    @property
    def num_bitmaps(self) -> int:
        """P: rows of ``bitmaps`` in use (PARTIAL tiles with identical bits share one); 0 without PARTIAL tiles."""
        return int(self.bitmaps.shape[0]) if self.num_partial else 0

    @property
    def words_per_tile(self) -> int:
        return self.tile_m * self.tile_n // 32

    def __repr__(self) -> str:
        return (f"TileLayout(layouts={self.num_layouts}, seq={self.seq_q}x{self.seq_k}, tile={self.tile_m}x"
                f"{self.tile_n}, grid={self.Tq}x{self.Tk}, nnz={self.nnz}, partial={self.num_partial})")

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_arrays(cls, *, seq_q, seq_k, tile_m, tile_n, num_layouts, row_ptr, col_idx, tile_bitmap_index,
                    bitmaps, mask_spec="") -> TileLayout:
        """Build from stored arrays (e.g. an ONNX node's initializers), checking every invariant."""
        sizes = (seq_q, seq_k, tile_m, tile_n, num_layouts)
        if not all(_is_int(v) for v in sizes):
            raise StofError(f"layout sizes must be integers, got seq {seq_q!r}x{seq_k!r}, tile {tile_m!r}x{tile_n!r}, "
                            f"{num_layouts!r} layout(s)")
        arrays = [layout_array_int32(name, a) for name, a in zip(
            ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"), (row_ptr, col_idx, tile_bitmap_index, bitmaps))]
        layout = cls(*(int(v) for v in sizes), *arrays, mask_spec)
        layout.validate()
        return layout

    @classmethod
    def from_dense(cls, mask: np.ndarray, tile_m: int = 64, tile_n: int = 64, mask_spec: str = "") -> TileLayout:
        """Compile a dense boolean mask [Sq, Sk] or [L, Sq, Sk]."""
        check_tile_shape(tile_m, tile_n)
        m = np.asarray(mask)
        if m.ndim == 2:
            m = m[None]
        if m.ndim != 3 or m.shape[1] == 0 or m.shape[2] == 0:
            raise StofError(f"a dense mask must be [Sq,Sk] or [L,Sq,Sk] with Sq, Sk > 0, got shape {np.shape(mask)}")
        if m.dtype != bool and not (m.dtype.kind in "iuf" and np.isin(m, (0, 1)).all()):
            raise StofError(f"a dense mask must be boolean or 0/1, got {m.dtype} values outside 0 and 1")
        L, sq, sk = m.shape
        tq, tk = -(-sq // tile_m), -(-sk // tile_n)
        padded = np.zeros((L, tq * tile_m, tk * tile_n), bool)
        padded[:, :sq, :sk] = m.astype(bool, copy=False)
        tiles = padded.reshape(L, tq, tile_m, tk, tile_n).swapaxes(2, 3)  # [L, Tq, Tk, tm, tn] view
        count = tiles.sum(axis=(3, 4), dtype=np.int64)
        rows, cols = _valid_extents(sq, sk, tile_m, tile_n)
        valid = rows[:, None] * cols[None, :]
        cls_grid = np.where(count == 0, TileClass.EMPTY,
                            np.where(count == valid[None], TileClass.FULL, TileClass.PARTIAL)).astype(np.int8)
        part = np.nonzero(cls_grid == TileClass.PARTIAL)
        return _assemble(cls_grid, tiles[part], part, sq, sk, tile_m, tile_n, mask_spec)

    # -- checks and views -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise StofError if any invariant of docs/format.md does not hold."""
        check_tile_shape(self.tile_m, self.tile_n)
        if self.seq_q < 1 or self.seq_k < 1 or self.num_layouts < 1:
            raise StofError("layout sizes must be positive")
        n_rows = self.num_layouts * self.Tq
        rp, ci, tb, bm = self.row_ptr, self.col_idx, self.tile_bitmap_index, self.bitmaps
        if rp.shape != (n_rows + 1,):
            raise StofError(f"row_ptr must have {n_rows + 1} entries, has {rp.shape}")
        if rp[0] != 0 or np.any(np.diff(rp) < 0):
            raise StofError("row_ptr must start at 0 and be non-decreasing")
        nnz = int(rp[-1])
        if np.any(np.diff(rp) > self.Tk):
            raise StofError("a tile row has more stored tiles than tile columns")
        if ci.shape != (max(nnz, 1),) or tb.shape != (max(nnz, 1),):
            raise StofError(f"col_idx and tile_bitmap_index must have {max(nnz, 1)} entries")
        c = ci[:nnz]
        if np.any((c < 0) | (c >= self.Tk)):
            raise StofError("col_idx out of range")
        row_of = np.repeat(np.arange(n_rows), np.diff(rp))
        if nnz > 1 and np.any((np.diff(c) <= 0) & (np.diff(row_of) == 0)):
            raise StofError("col_idx must be strictly ascending within a tile row")
        p = tb[:nnz]
        if bm.ndim != 2 or bm.shape[0] < 1 or bm.shape[1] != self.words_per_tile:
            raise StofError(f"bitmaps must be [P, {self.words_per_tile}] (one row of tile_m*tile_n/32 words per "
                            f"bitmap), got {bm.shape}")
        # the index is checked against the rows there are before the rows are counted against the index: a corrupt
        # entry is named as such, not as a bitmaps shape
        bad = np.flatnonzero((p < -1) | (p >= bm.shape[0]))
        if bad.size:
            raise StofError(f"tile_bitmap_index[{bad[0]}] = {p[bad[0]]}: must be -1 (a FULL tile) or a bitmap row "
                            f"0..{bm.shape[0] - 1}")
        used = np.unique(p[p >= 0])
        n_bm = used.size
        if bm.shape[0] != max(n_bm, 1) or not np.array_equal(used, np.arange(n_bm)):
            raise StofError(f"bitmaps must have one row per bitmap the tiles use (rows 0..{max(n_bm, 1) - 1}, each "
                            f"used): got {bm.shape[0]} rows, {n_bm} used")

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per stored tile: (layout, tile row, tile column, bitmap index or -1)."""
        nnz = self.nnz
        flat_row = np.repeat(np.arange(self.num_layouts * self.Tq), np.diff(self.row_ptr))
        return (flat_row // self.Tq, flat_row % self.Tq, self.col_idx[:nnz].astype(np.int64),
                self.tile_bitmap_index[:nnz].astype(np.int64))

    def partial_tiles(self) -> np.ndarray:
        """The bitmaps unpacked: bool [P, tile_m, tile_n] (P = ``num_bitmaps``; tile e's is row
        ``tile_bitmap_index[e]``)."""
        n = self.num_bitmaps
        words = np.ascontiguousarray(self.bitmaps[:n]).astype("<u4", copy=False)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return bits.reshape(n, self.tile_m, self.tile_n).astype(bool)

    def tile_classes(self) -> np.ndarray:
        """int8 [L, Tq, Tk] of TileClass codes."""
        grid = np.zeros((self.num_layouts, self.Tq, self.Tk), np.int8)
        lay, i, j, p = self.entries()
        grid[lay, i, j] = np.where(p < 0, TileClass.FULL, TileClass.PARTIAL)
        return grid

    def to_dense(self) -> np.ndarray:
        """The exact boolean mask [L, seq_q, seq_k] (docs/format.md, "Dense reconstruction")."""
        L, tm, tn = self.num_layouts, self.tile_m, self.tile_n
        out = np.zeros((L, self.Tq * tm, self.Tk * tn), bool)
        tiles = out.reshape(L, self.Tq, tm, self.Tk, tn).swapaxes(2, 3)  # a view: writes land in `out`
        lay, i, j, p = self.entries()
        full = p < 0
        tiles[lay[full], i[full], j[full]] = True
        tiles[lay[~full], i[~full], j[~full]] = self.partial_tiles()[p[~full]]
        return out[:, : self.seq_q, : self.seq_k]

    def class_counts(self) -> dict[str, int]:
        total = self.num_layouts * self.Tq * self.Tk
        part = self.num_partial
        return {"empty": total - self.nnz, "full": self.nnz - part, "partial": part}

    def density(self) -> float:
        """Fraction of allowed (query, key) pairs, over all layouts."""
        lay, i, j, p = self.entries()   # FULL tiles may stick out past the matrix: count in-range elements
        full = p < 0
        rows = np.minimum(self.tile_m, self.seq_q - i[full] * self.tile_m)
        cols = np.minimum(self.tile_n, self.seq_k - j[full] * self.tile_n)
        allowed = int((rows * cols).sum())
        allowed += int(self.partial_tile_bits().sum())
        return allowed / (self.num_layouts * self.seq_q * self.seq_k)

    def bitmap_bits(self) -> np.ndarray:
        """int64 [P]: allowed elements of each bitmap."""
        n = self.num_bitmaps
        if not n:
            return np.zeros(0, np.int64)
        bytes_ = np.ascontiguousarray(self.bitmaps[:n]).astype("<u4", copy=False).view(np.uint8)
        return np.unpackbits(bytes_, axis=1).sum(axis=1, dtype=np.int64)

    def partial_tile_bits(self) -> np.ndarray:
        """int64 [num_partial]: allowed elements of each PARTIAL tile, in storage order (shared bitmaps counted once
        per tile)."""
        p = self.tile_bitmap_index[: self.nnz]
        return self.bitmap_bits()[p[p >= 0]]

    def unshared(self) -> TileLayout:
        """The same layout in format version 1's form: one bitmap per PARTIAL tile, numbered in storage order (for a
        reader of version 1 only, or to measure what sharing gains; the kernels accept both forms)."""
        tbi = self.tile_bitmap_index.copy()
        part = np.flatnonzero(tbi[: self.nnz] >= 0)
        bitmaps = np.ascontiguousarray(self.bitmaps[tbi[part]]) if part.size else self.bitmaps.copy()
        tbi[part] = np.arange(part.size, dtype=np.int32)
        return TileLayout(self.seq_q, self.seq_k, self.tile_m, self.tile_n, self.num_layouts, self.row_ptr.copy(),
                          self.col_idx.copy(), tbi, bitmaps, self.mask_spec)

    def tile_density(self) -> float:
        """Fraction of tiles stored (FULL or PARTIAL): the work a block-sparse kernel does, relative to dense."""
        return self.nnz / (self.num_layouts * self.Tq * self.Tk)

    def signature(self) -> str:
        h = hashlib.sha1()
        h.update(np.array([STOF_FORMAT_VERSION, self.seq_q, self.seq_k, self.tile_m, self.tile_n, self.num_layouts],
                          np.int64).tobytes())
        for a in (self.row_ptr, self.col_idx, self.tile_bitmap_index, self.bitmaps):
            h.update(np.ascontiguousarray(a, np.int32).tobytes())
        return h.hexdigest()

    def row_order(self) -> np.ndarray:
        """int32 ``[L*Tq]``: within each layout ``l``, entry ``l*Tq + i`` is the tile row with the i-th most stored
        tiles (``row_ptr[r+1] - row_ptr[r]``); ties go to the higher row first.  A derived array (not part of the
        stored format); exactly what the kernel library's layout handle derives (``stof_layout_derived``)."""
        return rows_longest_first(self._row_counts()).ravel()

    def pair_order(self) -> np.ndarray:
        """int32 ``[L*ceil(Tq/2)]``: within each layout ``l``, entry ``l*ceil(Tq/2) + i`` is the pair of tile rows
        (pair ``p`` = rows ``2p`` and ``2p+1``; the last pair of an odd ``Tq`` has one row) whose longer row has the
        i-th most stored tiles; ties go to the higher pair first.  The schedule of kernels whose work item covers two
        tile rows; derived, not stored; exactly what the layout handle derives (``stof_layout_derived``)."""
        return pairs_longest_first(self._row_counts()).ravel()

    def lane_bitmaps(self) -> np.ndarray | None:
        """int32 ``[max(P,1) * tile_m*tile_n/16]``: the bitmaps in the tensor-core kernels' thread order, or None
        when the tile shape has none (``tile_m % 16`` or ``tile_n % 64`` not 0).  Derived, not stored; exactly what
        the layout handle derives (``stof_layout_derived``; docs/format.md, "Derived: the lane bitmaps")."""
        return lane_bitmaps(self.bitmaps, self.tile_m, self.tile_n)

    def _row_counts(self) -> np.ndarray:
        return np.diff(np.asarray(self.row_ptr, np.int64)).reshape(self.num_layouts, self.Tq)

    def sched_chunk(self) -> int:
        """0 or 1: the layout's ``sched_chunk``, the C ABI's default for it.  1 (one (batch, head) pair at a
        time) when, in every layout ``l``, ``4 * Tq * longest <= 5 * total`` (integer arithmetic), where ``longest``
        is the most stored tiles of one tile row of ``l`` and ``total`` the stored tiles of ``l``: rows of near-equal
        length (sliding, dilated; a layout with no stored tile counts too).  Else 0 (the library's L2-sized default).
        Derived from ``row_ptr`` (not stored); exactly what the layout handle derives (``stof_layout_info``)."""
        L, tq = self.num_layouts, self.Tq
        rp = np.asarray(self.row_ptr, np.int64)
        counts = np.diff(rp).reshape(L, tq)
        longest = counts.max(axis=1)
        total = rp[tq::tq] - rp[0:L * tq:tq]   # per layout: row_ptr[(l+1)*Tq] - row_ptr[l*Tq]
        return int(bool(np.all(4 * tq * longest <= 5 * total)))

    def arrays(self) -> dict[str, np.ndarray]:
        """The four stored arrays by their ONNX input names."""
        return {"row_ptr": self.row_ptr, "col_idx": self.col_idx, "tile_bitmap_index": self.tile_bitmap_index,
                "bitmaps": self.bitmaps}

    def to_string(self, layout: int = 0, max_tiles: int = 64) -> str:
        """Tile art: '#' FULL, '+' PARTIAL, '.' EMPTY (at most max_tiles per side)."""
        if not 0 <= layout < self.num_layouts:
            raise StofError(f"layout {layout} of {self.num_layouts} (0 .. {self.num_layouts - 1})")
        g = self.tile_classes()[layout][:max_tiles, :max_tiles]
        return "\n".join("".join(".#+"[c] for c in row) for row in g)


def _is_int(v) -> bool:
    """An integer, numpy's included, and not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def layout_array_int32(name: str, a) -> np.ndarray:
    """A stored layout array as int32, or a StofError: int32 values, and for ``bitmaps`` also uint32 words (their
    bit patterns); nothing wraps silently."""
    a = np.asarray(a)
    hi = 2**32 if name == "bitmaps" and a.dtype.kind == "u" else 2**31
    if a.dtype.kind not in "iub" or (a.size and (int(a.min()) < -2**31 or int(a.max()) >= hi)):
        raise StofError(f"layout array {name} must hold int32 values, got {a.dtype}"
                        + (" values outside int32" if a.dtype.kind in "iu" else ""))
    return np.ascontiguousarray(a.astype(np.uint32).view(np.int32) if hi == 2**32 else a.astype(np.int32))


def rows_longest_first(counts: np.ndarray) -> np.ndarray:
    """counts: stored tiles per tile row, ``[L, Tq]``.  int32 ``[L, Tq]``: per layout, its tile rows by decreasing
    count, ties the higher row first (``TileLayout.row_order``; the pre-search schedules with it too)."""
    counts = np.asarray(counts, np.int64)
    L, tq = counts.shape
    rows = np.broadcast_to(np.arange(tq, dtype=np.int64), (L, tq))
    lay = np.broadcast_to(np.arange(L, dtype=np.int64)[:, None], (L, tq))
    # lexsort: last key is primary -> by layout, then more tiles first, then higher row first
    order = np.lexsort((-rows.ravel(), -counts.ravel(), lay.ravel()))
    return np.ascontiguousarray(rows.ravel()[order], dtype=np.int32).reshape(L, tq)


def lane_bitmaps(bitmaps: np.ndarray, tile_m: int, tile_n: int) -> np.ndarray | None:
    """The lane bitmaps of ``bitmaps`` (``[P, tile_m*tile_n/32]`` int32), flattened int32: entry ``(p, r, j, l)``
    (bitmap ``p``, row group ``r`` of 16 rows, 64-key sub-block ``j``, lane ``l = 4g + t``) is the int32 pair
    ``(z, y)`` at ``2 * (((p*(tile_m/16) + r)*(tile_n/64) + j)*32 + l)``, where bit ``8q + 2(2h + w) + c`` of ``z``
    (``q < 4``; ``h, w, c < 2``) is the mask bit of row ``16r + g + 8h``, column ``64j + 32w + 8q + 2t + c``, and bit
    ``q`` of ``y`` repeats bit ``8q + 7`` of ``z``.  None when ``tile_m % 16`` or ``tile_n % 64`` is not 0."""
    tile_m, tile_n = int(tile_m), int(tile_n)
    if tile_m % 16 or tile_n % 64 or tile_m < 16 or tile_n < 64:
        return None
    words = np.ascontiguousarray(bitmaps, np.int32).view(np.uint32).reshape(-1, tile_m, tile_n // 32)
    P = words.shape[0]
    # [P, r, h, g, j, w]: row 16 r + 8 h + g, word 2 j + w
    w6 = words.reshape(P, tile_m // 16, 2, 8, tile_n // 64, 2).astype(np.uint64)
    t = np.arange(4, dtype=np.uint64)
    z = np.zeros((P, tile_m // 16, tile_n // 64, 8, 4), np.uint64)   # [P, r, j, g, t]
    for h in range(2):
        for w in range(2):
            part = w6[:, :, h, :, :, w].transpose(0, 1, 3, 2)       # [P, r, j, g]
            z |= ((part[..., None] >> (2 * t)) & 0x03030303) << (2 * (2 * h + w))
    y = np.zeros_like(z)
    for q in range(4):
        y |= ((z >> (8 * q + 7)) & 1) << q
    out = np.stack([z, y], axis=-1).astype(np.uint32)                # [P, r, j, g, t, 2]
    return out.view(np.int32).ravel()


def pairs_longest_first(counts: np.ndarray) -> np.ndarray:
    """counts: stored tiles per tile row, ``[L, Tq]``.  int32 ``[L, ceil(Tq/2)]``: per layout, its pairs of tile rows
    (2p, 2p+1) by decreasing count of the longer row, ties the higher pair first (``TileLayout.pair_order``)."""
    counts = np.asarray(counts, np.int64)
    L, tq = counts.shape
    padded = np.zeros((L, tq + tq % 2), np.int64)
    padded[:, :tq] = counts
    return rows_longest_first(padded.reshape(L, -1, 2).max(axis=2))


def _valid_extents(seq_q, seq_k, tile_m, tile_n) -> tuple[np.ndarray, np.ndarray]:
    """In-range rows of each tile row [Tq] and columns of each tile column [Tk] (int64): a tile (i, j) holds
    rows[i] * cols[j] in-range elements."""
    tq, tk = -(-seq_q // tile_m), -(-seq_k // tile_n)
    rows = np.minimum(tile_m, seq_q - np.arange(tq, dtype=np.int64) * tile_m)
    cols = np.minimum(tile_n, seq_k - np.arange(tk, dtype=np.int64) * tile_n)
    return rows, cols


def _assemble(cls_grid, part_bits, part_pos, seq_q, seq_k, tile_m, tile_n, mask_spec) -> TileLayout:
    """Build a TileLayout from a class grid [L,Tq,Tk] and the bits [P,tm,tn] of the PARTIAL tiles at part_pos
    (index arrays into the grid, any order)."""
    flat = np.flatnonzero(cls_grid != TileClass.EMPTY)  # storage order: layout, tile row, tile column
    # Bits arrive in part_pos order; put them in storage order.
    part_flat = np.ravel_multi_index(part_pos, cls_grid.shape) if len(part_pos[0]) else np.zeros(0, np.int64)
    order = np.argsort(part_flat, kind="stable")
    return _assemble_stored(cls_grid.shape, flat, cls_grid.reshape(-1)[flat],
                            _pack_bitmaps(np.asarray(part_bits, bool)[order], tile_m, tile_n),
                            seq_q, seq_k, tile_m, tile_n, mask_spec)


def _pack_bitmaps(bits, tile_m, tile_n) -> np.ndarray:
    """Tiles' bits [P,tm,tn] (bool) as bitmap rows [P, tm*tn/32] int32 of docs/format.md (element t -> bit t)."""
    bits = np.asarray(bits, bool).reshape(-1, tile_m * tile_n)
    packed = np.packbits(bits, axis=1, bitorder="little")   # [P, words*4] bytes
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)


def _assemble_stored(shape, flat, classes, part_words, seq_q, seq_k, tile_m, tile_n, mask_spec,
                     part_ids=None) -> TileLayout:
    """Build a TileLayout of grid shape (L, Tq, Tk) from its stored tiles: flat, their ascending indices into the
    grid (storage order); classes, their TileClass (FULL or PARTIAL); part_words [P, tm*tn/32], the PARTIAL ones'
    bitmaps (_pack_bitmaps) in the same order, or, with part_ids, candidate rows that the PARTIAL tiles index (tile
    e's bits are part_words[part_ids[e]]; rows may repeat)."""
    L, tq, tk = shape
    nnz = flat.size
    row_ptr = np.zeros(L * tq + 1, np.int64)
    np.cumsum(np.bincount(flat // tk, minlength=L * tq), out=row_ptr[1:])
    col_idx = (flat % tk).astype(np.int32)
    is_part = classes == TileClass.PARTIAL
    tile_bitmap_index = np.full(nnz, -1, np.int32)
    words = tile_m * tile_n // 32
    if part_ids is None:
        part_ids = np.arange(part_words.shape[0], dtype=np.int64)
    if part_ids.size:
        # Identical bitmaps stored once, numbered in order of first use (format version 2): a band's or a causal
        # mask's PARTIAL tiles repeat a few patterns, so the kernels read a few cached rows instead of a distinct
        # row per tile (tactic 24: Longformer 6-7 %, dilated 4.5 %, sliding 1-4 %, causal S <= 2048 1.5 % faster).
        uniq, canon = np.unique(part_words, axis=0, return_inverse=True)
        tile_canon = canon.reshape(-1)[part_ids]                 # per PARTIAL tile, its distinct bitmap
        used, first = np.unique(tile_canon, return_index=True)   # the bitmaps in use and their first users
        by_use = used[np.argsort(first, kind="stable")]          # in order of first use
        number = np.empty(uniq.shape[0], np.int64)
        number[by_use] = np.arange(by_use.size)
        tile_bitmap_index[is_part] = number[tile_canon].astype(np.int32)
        bitmaps = uniq[by_use]
    else:
        bitmaps = np.zeros((1, words), np.int32)
    if nnz == 0:
        col_idx = np.zeros(1, np.int32)
        tile_bitmap_index = np.full(1, -1, np.int32)
    return TileLayout(int(seq_q), int(seq_k), int(tile_m), int(tile_n), int(L), row_ptr.astype(np.int32),
                      col_idx, tile_bitmap_index, np.ascontiguousarray(bitmaps).reshape(-1, words), mask_spec)


def _representatives(spec: MaskSpec, grid: TileGrid, ti: np.ndarray, tj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rep, inv): the tiles rep (indices into ti/tj) stand for all, tile e having the bits of tile rep[inv[e]].
    Without keys every tile stands for itself."""
    keys = spec.tile_keys(grid, ti * grid.tile_m, tj * grid.tile_n) if ti.size else None
    if keys is None:
        idx = np.arange(ti.size)
        return idx, idx
    edge = ((ti + 1) * grid.tile_m > grid.seq_q) | ((tj + 1) * grid.tile_n > grid.seq_k)
    keys = np.where(edge, keys.max() + 1 + np.arange(ti.size, dtype=np.int64), keys)   # cut tiles: keys of their own
    _, rep, inv = np.unique(keys, return_index=True, return_inverse=True)
    return rep, inv.reshape(-1)


def _row_blocks(counts: np.ndarray, budget: int):
    """Split tile rows into consecutive blocks [start, end) of about ``budget`` candidate tiles each (at least one
    row)."""
    ends = np.searchsorted(np.cumsum(counts), np.arange(budget, int(counts.sum()) + budget, budget), side="right")
    start = 0
    for e in list(np.unique(ends)) + [counts.size]:
        e = max(int(e), start + 1) if start < counts.size else start
        e = min(e, counts.size)
        if e > start:
            yield start, e
            start = e


def compile_mask(mask: MaskSpec | str | np.ndarray, seq_q: int, seq_k: int | None = None, *, tile_m: int = 64,
                 tile_n: int = 64, num_heads: int | None = None) -> TileLayout:
    """Compile a mask spec (or spec string, or dense bool array) for a ``seq_q x seq_k`` attention.

    Work and memory grow with the stored tiles, not with the Tq x Tk grid: the spec names the tiles that may be
    stored (``MaskSpec.candidates``: a band's few per tile row; every tile for a spec that cannot say), only those
    are classified from index ranges (bands, global tokens, block layouts), and of the tiles left UNKNOWN one per
    bit pattern (``MaskSpec.tile_keys``: a band's tiles on one diagonal offset) is evaluated element-wise, in
    bounded chunks. ``sliding:window=128`` and ``longformer:window=256,global=32`` compile at 2^22 tokens in well
    under 2 s on two CPU cores. A mask that may store more than ``MAX_STORED_TILES`` tiles (causal or dense at
    millions of tokens) is refused before anything is allocated. No Python loop runs over tiles or elements (only
    over layouts when the mask differs per head, and over blocks of tile rows).
    """
    seq_k = seq_q if seq_k is None else seq_k
    check_tile_shape(tile_m, tile_n)
    if not (_is_int(seq_q) and _is_int(seq_k)) or seq_q < 1 or seq_k < 1:
        raise StofError(f"sequence lengths must be positive integers, got {seq_q}x{seq_k}")
    if seq_q > 2**31 - 1 or seq_k > 2**31 - 1:  # the format's and the kernels' positions are int32
        raise StofError(f"sequence lengths {seq_q}x{seq_k}: at most 2^31 - 1 positions")
    seq_q, seq_k = int(seq_q), int(seq_k)
    if num_heads is not None and (not _is_int(num_heads) or not 1 <= num_heads <= 65535):
        raise StofError(f"num_heads must be an integer in [1, 65535], got {num_heads!r}")
    if isinstance(mask, np.ndarray):
        mask = DenseMask(mask)
    spec = parse_mask(mask)
    spec.check_size(seq_q, seq_k)
    L = spec.num_layouts(num_heads)
    if isinstance(spec, DenseMask):
        dense = np.stack([spec.head_array(seq_q, seq_k, h) for h in range(L)])
        return TileLayout.from_dense(dense, tile_m, tile_n, mask_spec=str(spec))

    tq, tk = -(-seq_q // tile_m), -(-seq_k // tile_n)
    valid_rows, valid_cols = _valid_extents(seq_q, seq_k, tile_m, tile_n)
    # int32 indices: element-wise evaluation is memory-bound, and int32 division is several times faster.
    a = np.arange(tile_m, dtype=np.int32)[None, :, None]
    b = np.arange(tile_n, dtype=np.int32)[None, None, :]
    per_chunk = max(1, _CHUNK_ELEMENTS // (tile_m * tile_n))

    # Refuse before allocating when the stored tiles cannot be held (their bound is cheap: O(Tq) per layout).
    bounds = []
    for h in range(L):
        c = spec.candidate_counts(TileGrid(seq_q, seq_k, tile_m, tile_n, h))
        bounds.append(c if c is not None else np.full(tq, tk, np.int64))
        if not spec.per_head:
            bounds *= L
            break
    most = int(sum(int(c.sum()) for c in bounds))
    if most > MAX_STORED_TILES:
        raise StofError(f"mask '{spec}' at {seq_q}x{seq_k} in {tile_m}x{tile_n} tiles may store up to {most} tiles "
                        f"(at most {MAX_STORED_TILES} are compiled): use a sparser mask, larger tiles or a shorter "
                        "sequence")
    flats, classes, part_words, part_ids = [], [], [], []
    n_words = 0
    for h in range(L):
        kw = dict(seq_q=seq_q, seq_k=seq_k, head=h)
        grid = TileGrid(seq_q, seq_k, tile_m, tile_n, h)
        # Only the tiles the spec says may be stored are classified (a band's few per tile row, not the grid), a
        # block of tile rows at a time holding about _GRID_CHUNK_TILES of them: time and memory grow with the
        # stored tiles, not with Tq x Tk.
        counts = bounds[h]
        for rs, re in _row_blocks(counts, _GRID_CHUNK_TILES):
            pairs = spec.candidates(grid, rs, re)
            if pairs is None:
                ti = np.repeat(np.arange(rs, re, dtype=np.int64), tk)
                tj = np.tile(np.arange(tk, dtype=np.int64), re - rs)
            else:
                ti, tj = pairs
            r0 = ti * tile_m
            c0 = tj * tile_n
            cls = np.array(np.broadcast_to(spec.classify_tiles(r0, np.minimum(r0 + tile_m, seq_q), c0,
                                                               np.minimum(c0 + tile_n, seq_k), **kw), ti.shape),
                           np.int8)
            unknown = np.flatnonzero(cls == TILE_UNKNOWN)          # ascending: storage order
            # Tiles the spec gives one key (a band's tiles on one diagonal offset) hold the same bits: evaluate one
            # per key. Tiles cut by the matrix edge keep their own.
            rep, inv = _representatives(spec, grid, ti[unknown], tj[unknown])
            rep_cls = np.empty(rep.size, np.int8)
            rep_words = []
            for s in range(0, rep.size, per_chunk):
                u = unknown[rep[s:s + per_chunk]]
                q = ti[u].astype(np.int32)[:, None, None] * np.int32(tile_m) + a   # [U, tm, 1]
                k = tj[u].astype(np.int32)[:, None, None] * np.int32(tile_n) + b   # [U, 1, tn]
                inside = (q < seq_q) & (k < seq_k)
                bits = spec.evaluate(np.minimum(q, np.int32(seq_q - 1)), np.minimum(k, np.int32(seq_k - 1)),
                                     **kw) & inside
                count = bits.sum(axis=(1, 2))
                valid = valid_rows[ti[u]] * valid_cols[tj[u]]
                full, empty = count == valid, count == 0
                rep_cls[s:s + per_chunk] = np.where(full, TileClass.FULL,
                                                    np.where(empty, TileClass.EMPTY, TileClass.PARTIAL))
                rep_words.append(_pack_bitmaps(bits, tile_m, tile_n))   # 8x smaller than the bools
            if rep.size:
                cls[unknown] = rep_cls[inv]
                part_words.extend(rep_words)
                # per PARTIAL tile in ascending (storage) order, the row of its representative's bits
                part_ids.append(n_words + inv[rep_cls[inv] == TileClass.PARTIAL])
                n_words += rep.size
            stored = np.flatnonzero(cls != TileClass.EMPTY)
            flats.append((h * tq + ti[stored]) * tk + tj[stored])
            classes.append(cls[stored])
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int64)
    cls_stored = np.concatenate(classes) if classes else np.zeros(0, np.int8)
    words = np.concatenate(part_words) if part_words else np.zeros((0, tile_m * tile_n // 32), np.int32)
    ids = np.concatenate(part_ids) if part_ids else np.zeros(0, np.int64)
    return _assemble_stored((L, tq, tk), flat, cls_stored, words, seq_q, seq_k, tile_m, tile_n, str(spec),
                            part_ids=ids)
