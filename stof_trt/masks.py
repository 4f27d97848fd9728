"""Attention mask specs: what a user writes on the command line (``--mask``) or builds in Python.

A mask says which (query, key) pairs may attend: ``True`` = allowed. Positions are absolute indices, the
pattern anchored at the top-left corner (query 0 / key 0), so a model run at a shorter length sees the top-left
corner of the pattern.

Spec grammar (``parse_mask``)::

    spec   := union
    union  := inter ('|' inter)*          # logical OR
    inter  := atom ('&' atom)*            # logical AND, binds tighter than '|'
    atom   := '(' spec ')' | NAME [':' ARGS]
    ARGS   := key=value (',' key=value)*  # npy takes a path instead: npy:PATH
    PATH   := text | 'text' | "text"      # quote a path holding | & ( ) , : npy:'masks/a|b.npy'

Names and arguments:

=============  ==========================================================  =====================================
name           arguments                                                    allowed when (d = key - query)
=============  ==========================================================  =====================================
full           –                                                            always
causal         offset=0                                                     d <= offset
sliding        window=W | left=L,right=R; causal=0|1                        -L <= d <= R (window: L=R=W;
                                                                            causal=1: L=W, R=0)
dilated        window=W, dilation=2; causal=0|1                             |d| <= W (or -W<=d<=0) and d % dil == 0
global         n=G | tokens=i;j;k                                           query or key is a global token
longformer     window=W, global=G (first G tokens) | tokens=i;j;k          sliding(W) | global
bigbird        block=64, window=1, global=1, random=0.0, seed=0,            on the block grid: |qb-kb| <= window,
               per_head=0, draw=row|grid                                    qb or kb < global, or a random block
blocks         PATH.npy, block=64                                           layout[q // block, k // block]
npy            PATH (a .npy bool/0-1 array [Sq,Sk] or [H,Sq,Sk])            M[q, k] (top-left corner used)
=============  ==========================================================  =====================================

Every spec knows how to (1) evaluate itself on index arrays and (2) classify whole tiles as certainly empty,
certainly full or unknown from the tile's index ranges alone; band-like specs also (3) name the tiles that may be
stored (``candidates``) and (4) give tiles with the same bits one key (``tile_keys``). (2)-(4) are what make
compiling a band at millions of tokens fast: the work follows the stored tiles, and only one unknown tile per bit
pattern is evaluated element by element (see ``stof_trt.format.compile_mask``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .errors import MaskSpecError

__all__ = [
    "MaskSpec", "Full", "Causal", "Sliding", "Diagonals", "Dilated", "Global", "BlockLayout", "BigBird", "DenseMask",
    "Union", "Intersection", "parse_mask", "longformer", "closed_form", "TILE_EMPTY", "TILE_FULL", "TILE_UNKNOWN",
]

# Tile classification codes returned by MaskSpec.classify_tiles (int8).
TILE_EMPTY, TILE_FULL, TILE_UNKNOWN = 0, 1, -1


class MaskSpec:
    """Base class. Subclasses implement ``evaluate`` and may refine ``classify_tiles``."""

    #: True when the pattern differs between heads (then compile_mask makes one layout per head).
    per_head: bool = False

    def evaluate(self, q: np.ndarray, k: np.ndarray, *, seq_q: int, seq_k: int, head: int = 0) -> np.ndarray:
        """Boolean array, broadcast of ``q`` and ``k`` (int64 query and key indices, all in range)."""
        raise NotImplementedError(type(self).__name__)

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q: int, seq_k: int, head: int = 0) -> np.ndarray:
        """Classify tiles spanning rows ``[r0, r1)`` and columns ``[c0, c1)`` (broadcastable int64 arrays,
        clipped to the matrix, never empty). Returns int8 codes TILE_EMPTY / TILE_FULL / TILE_UNKNOWN; a code
        other than UNKNOWN must be exact. The default knows nothing."""
        shape = np.broadcast_shapes(np.shape(r0), np.shape(c0))
        return np.full(shape, TILE_UNKNOWN, np.int8)

    def check_size(self, seq_q: int, seq_k: int) -> None:
        """Raise MaskSpecError if the spec cannot describe a seq_q x seq_k mask."""

    def tile_keys(self, g: TileGrid, r0: np.ndarray, c0: np.ndarray) -> np.ndarray | None:
        """int64 keys of the tiles at rows ``r0`` and columns ``c0`` (their first element): two tiles wholly inside
        the matrix with the same key hold the same bits, so compile_mask evaluates one of them. None = no such
        knowledge (every tile is evaluated)."""
        return None

    def candidate_counts(self, g: TileGrid) -> np.ndarray | None:
        """Per tile row ``[Tq]`` (int64), an upper bound on the tiles ``candidates`` returns for it; None = every
        tile may be stored. What lets compile_mask work in proportion to the stored tiles, not the grid."""
        return None

    def candidates(self, g: TileGrid, i0: int, i1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The tiles of tile rows ``[i0, i1)`` that may be stored (a superset of the non-EMPTY ones): (row, column)
        int64 arrays in row-major order, no duplicates; None = all of them."""
        return None

    def num_layouts(self, num_heads: int | None) -> int:
        if not self.per_head:
            return 1
        if num_heads is None:
            raise MaskSpecError(f"mask '{self}' differs per head: the number of heads must be given")
        return num_heads

    def dense(self, seq_q: int, seq_k: int, num_heads: int | None = None) -> np.ndarray:
        """The dense boolean mask: [seq_q, seq_k], or [H, seq_q, seq_k] for a per-head spec."""
        self.check_size(seq_q, seq_k)
        q = np.arange(seq_q, dtype=np.int64)[:, None]
        k = np.arange(seq_k, dtype=np.int64)[None, :]
        layouts = [
            np.broadcast_to(self.evaluate(q, k, seq_q=seq_q, seq_k=seq_k, head=h), (seq_q, seq_k))
            for h in range(self.num_layouts(num_heads))
        ]
        return layouts[0].copy() if not self.per_head else np.stack(layouts)

    def __or__(self, other: MaskSpec) -> MaskSpec:
        if not isinstance(other, MaskSpec):
            return NotImplemented
        return Union((self, other))

    def __and__(self, other: MaskSpec) -> MaskSpec:
        if not isinstance(other, MaskSpec):
            return NotImplemented
        return Intersection((self, other))


@dataclass(frozen=True)
class TileGrid:
    """The tile grid a mask is compiled on (``candidates`` speaks in its tile rows and columns)."""

    seq_q: int
    seq_k: int
    tile_m: int
    tile_n: int
    head: int = 0

    @property
    def tq(self) -> int:
        return -(-self.seq_q // self.tile_m)

    @property
    def tk(self) -> int:
        return -(-self.seq_k // self.tile_n)


def _band_columns(lo: int | None, hi: int | None, g: TileGrid, i0: int, i1: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile row of [i0, i1): the first and last tile column that ``lo <= k - q <= hi`` reaches (last < first
    when none)."""
    r0 = np.arange(i0, i1, dtype=np.int64) * g.tile_m
    r1 = np.minimum(r0 + g.tile_m, g.seq_q) - 1
    k0 = np.zeros_like(r0) if lo is None else np.maximum(0, r0 + lo)
    k1 = np.full_like(r0, g.seq_k - 1) if hi is None else np.minimum(g.seq_k - 1, r1 + hi)
    first = k0 // g.tile_n
    last = np.where(k0 <= k1, k1 // g.tile_n, first - 1)
    return first, last


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique of an int array by sorting (numpy's hash-based unique is several times slower here)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a


def _ranges_to_pairs(rows: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tiles (row, column) for column ranges [first, last] per row, row-major."""
    n = np.maximum(last - first + 1, 0)
    total = int(n.sum())
    ti = np.repeat(rows, n)
    start = np.repeat(np.cumsum(n) - n, n)
    tj = np.repeat(first, n) + (np.arange(total, dtype=np.int64) - start)
    return ti, tj


class _Band:
    """Candidates and tile keys of a pattern of ``k - q`` within a band ``lo <= k - q <= hi`` (mixin; ``_band``
    gives (lo, hi), None = unbounded)."""

    def tile_keys(self, g, r0, c0):
        # The bits depend on k - q only; tiles wholly outside the band (and, below an unbounded side, wholly
        # inside it) share one key.
        lo, hi = self._band()
        d = c0 - r0
        if lo is not None:
            d = np.maximum(d, lo - g.tile_n)
        elif hi is not None:
            d = np.maximum(d, hi - g.tile_n + 1)
        if hi is not None:
            d = np.minimum(d, hi + g.tile_m)
        return d

    def _band(self) -> tuple[int | None, int | None]:
        raise NotImplementedError

    def candidate_counts(self, g):
        first, last = _band_columns(*self._band(), g, 0, g.tq)
        return np.maximum(last - first + 1, 0)

    def candidates(self, g, i0, i1):
        first, last = _band_columns(*self._band(), g, i0, i1)
        return _ranges_to_pairs(np.arange(i0, i1, dtype=np.int64), first, last)


def _band_classify(lo: int | None, hi: int | None, r0, r1, c0, c1) -> np.ndarray:
    """Exact classes for ``lo <= k - q <= hi`` (None = unbounded) over tiles."""
    dmin = c0 - (r1 - 1)
    dmax = (c1 - 1) - r0
    full = np.ones(np.broadcast_shapes(np.shape(dmin), np.shape(dmax)), bool)
    empty = np.zeros_like(full)
    if lo is not None:
        full &= dmin >= lo
        empty |= dmax < lo
    if hi is not None:
        full &= dmax <= hi
        empty |= dmin > hi
    out = np.full(full.shape, TILE_UNKNOWN, np.int8)
    out[full] = TILE_FULL
    out[empty] = TILE_EMPTY
    return out


@dataclass(frozen=True)
class Full(MaskSpec):
    """Every pair allowed (dense attention)."""

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        return np.ones(np.broadcast_shapes(np.shape(q), np.shape(k)), bool)

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        return np.full(np.broadcast_shapes(np.shape(r0), np.shape(c0)), TILE_FULL, np.int8)

    def __str__(self):
        return "full"


@dataclass(frozen=True)
class Causal(_Band, MaskSpec):
    """``key <= query + offset`` (top-left aligned)."""

    offset: int = 0

    def _band(self):
        return None, self.offset

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        return k - q <= min(self.offset, seq_k)

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        return _band_classify(None, self.offset, r0, r1, c0, c1)

    def __str__(self):
        return "causal" + (f":offset={self.offset}" if self.offset else "")


@dataclass(frozen=True)
class Sliding(_Band, MaskSpec):
    """``-left <= key - query <= right``."""

    left: int
    right: int

    def __post_init__(self):
        if self.left < 0 or self.right < 0:
            raise MaskSpecError(f"sliding window sides must be >= 0, got left={self.left}, right={self.right}")

    def _band(self):
        return -self.left, self.right

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        d = k - q   # sides clipped to the matrix: q and k may be int32
        return (d >= -min(self.left, seq_q)) & (d <= min(self.right, seq_k))

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        return _band_classify(-self.left, self.right, r0, r1, c0, c1)

    def __str__(self):
        if self.left == self.right:
            return f"sliding:window={self.left}"
        return f"sliding:left={self.left},right={self.right}"


@dataclass(frozen=True)
class Diagonals(_Band, MaskSpec):
    """``lo <= key - query <= hi``, either side of any sign: a band whose queries sit off their keys' diagonal (the
    LongformerAttention rewrite's queries against keys behind global-token slots).  Built in code, not a spec
    name."""

    lo: int
    hi: int

    def _band(self):
        return self.lo, self.hi

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        d = np.asarray(k, np.int64) - np.asarray(q, np.int64)
        return (d >= self.lo) & (d <= self.hi)

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        return _band_classify(self.lo, self.hi, r0, r1, c0, c1)

    def __str__(self):
        return f"diagonals[{self.lo},{self.hi}]"


@dataclass(frozen=True)
class Dilated(_Band, MaskSpec):
    """A sliding window keeping every ``dilation``-th diagonal: ``-left <= d <= right`` and ``d % dilation == 0``."""

    left: int
    right: int
    dilation: int

    def __post_init__(self):
        if self.dilation < 1:
            raise MaskSpecError(f"dilation must be >= 1, got {self.dilation}")
        if self.left < 0 or self.right < 0:
            raise MaskSpecError("dilated window sides must be >= 0")

    def _band(self):
        return -self.left, self.right

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        d = k - q
        # A dilation past the matrix keeps the main diagonal only; clipping keeps int32 arithmetic in range.
        dil = min(self.dilation, seq_q + seq_k)
        on_diag = (d & (dil - 1)) == 0 if dil & (dil - 1) == 0 else d % dil == 0
        return (d >= -min(self.left, seq_q)) & (d <= min(self.right, seq_k)) & on_diag

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        cls = _band_classify(-self.left, self.right, r0, r1, c0, c1)
        if self.dilation > 1:
            # Only every dilation-th diagonal is kept, so a band-full tile is full only in degenerate (1-wide
            # tail) cases: let evaluation decide rather than reason about them.
            cls[cls == TILE_FULL] = TILE_UNKNOWN
        return cls

    def __str__(self):
        if self.left == self.right:
            return f"dilated:window={self.left},dilation={self.dilation}"
        return f"dilated:left={self.left},right={self.right},dilation={self.dilation}"


@dataclass(frozen=True)
class Global(MaskSpec):
    """Global tokens: a pair is allowed when its query or its key is one of ``tokens`` (a tuple, or a ``range``
    for the first n tokens: never materialised past the sequence, so ``global:n=10**9`` costs what the sequence
    costs)."""

    tokens: tuple[int, ...] | range

    def __post_init__(self):
        if isinstance(self.tokens, range):
            if self.tokens.start < 0 or self.tokens.step != 1:
                raise MaskSpecError("global token positions must be >= 0")
        elif any(t < 0 for t in self.tokens):
            raise MaskSpecError("global token positions must be >= 0")

    def _upto(self, limit: int) -> np.ndarray:
        """The sorted global tokens below ``limit``."""
        if isinstance(self.tokens, range):
            return np.arange(self.tokens.start, min(self.tokens.stop, limit), dtype=np.int64)
        g = self._sorted
        return g[: np.searchsorted(g, limit)]

    @cached_property
    def _sorted(self) -> np.ndarray:
        return np.unique(np.asarray(self.tokens, dtype=np.int64))

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        if isinstance(self.tokens, range):
            lo, hi = self.tokens.start, min(self.tokens.stop, max(seq_q, seq_k))
            return ((q >= lo) & (q < hi)) | ((k >= lo) & (k < hi))
        g = self._upto(max(seq_q, seq_k))
        return np.isin(q, g) | np.isin(k, g)

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        g = self._upto(max(seq_q, seq_k))
        n_rows = np.searchsorted(g, r1) - np.searchsorted(g, r0)  # global queries inside the tile's rows
        n_cols = np.searchsorted(g, c1) - np.searchsorted(g, c0)
        full = (n_rows == r1 - r0) | (n_cols == c1 - c0)
        empty = (n_rows == 0) & (n_cols == 0)
        out = np.full(np.broadcast_shapes(np.shape(full), np.shape(empty)), TILE_UNKNOWN, np.int8)
        out[np.broadcast_to(full, out.shape)] = TILE_FULL
        out[np.broadcast_to(empty, out.shape)] = TILE_EMPTY
        return out

    def tile_keys(self, g, r0, c0):
        # The bits depend on which of the tile's rows and which of its columns are global: key (r0 or -1 where its
        # rows hold no global token, c0 or -1 likewise).
        t = self._upto(max(g.seq_q, g.seq_k))
        rows = np.where(np.searchsorted(t, r0 + g.tile_m) > np.searchsorted(t, r0), r0, -1)
        cols = np.where(np.searchsorted(t, c0 + g.tile_n) > np.searchsorted(t, c0), c0, -1)
        return (rows + 1) * (g.seq_k + 1) + (cols + 1)

    def _rows_cols(self, g: TileGrid) -> tuple[np.ndarray, np.ndarray]:
        """Tile rows holding a global query, tile columns holding a global key."""
        return _sorted_unique(self._upto(g.seq_q) // g.tile_m), _sorted_unique(self._upto(g.seq_k) // g.tile_n)

    def candidate_counts(self, g):
        rows, cols = self._rows_cols(g)
        out = np.full(g.tq, cols.size, np.int64)
        out[rows] = g.tk
        return out

    def candidates(self, g, i0, i1):
        rows, cols = self._rows_cols(g)
        rr = np.arange(i0, i1, dtype=np.int64)
        is_global = np.isin(rr, rows)
        n_g = int(is_global.sum())
        ti_g, tj_g = _ranges_to_pairs(rr[is_global], np.zeros(n_g, np.int64), np.full(n_g, g.tk - 1, np.int64))
        other = rr[~is_global]
        ti_o = np.repeat(other, cols.size)
        tj_o = np.tile(cols, other.size)
        flat = np.concatenate([ti_g * g.tk + tj_g, ti_o * g.tk + tj_o])
        flat.sort()
        return flat // g.tk, flat % g.tk

    def __str__(self):
        if isinstance(self.tokens, range):
            return f"global:n={len(self.tokens)}"
        g = self._sorted
        if len(g) and np.array_equal(g, np.arange(len(g))):
            return f"global:n={len(g)}"
        return "global:tokens=" + ";".join(str(int(t)) for t in g)


class BlockLayout(MaskSpec):
    """A mask constant on ``block x block`` squares: allowed iff ``layout[q // block, k // block]``.

    Subclasses generate the layout for a size (BigBird); this class takes a fixed one (``blocks:PATH``)."""

    def __init__(self, layout: np.ndarray | None, block: int, source: str = "<array>"):
        if block < 1:
            raise MaskSpecError(f"block must be >= 1, got {block}")
        self.block = int(block)
        if layout is not None:
            layout = np.asarray(layout)
            if layout.dtype != bool and (not np.issubdtype(layout.dtype, np.number) or
                                         np.iscomplexobj(layout) or not np.isin(layout, (0, 1)).all()):
                raise MaskSpecError(f"block layout {source} must be boolean or 0/1")
        self._layout = None if layout is None else layout.astype(bool)
        self.source = source
        if self._layout is not None:
            if self._layout.ndim == 3:
                self.per_head = True
            if self._layout.ndim in (2, 3) and 0 in self._layout.shape:
                raise MaskSpecError(f"block layout {source} is empty (shape {self._layout.shape})")
            elif self._layout.ndim not in (2, 3):
                raise MaskSpecError(f"block layout must be 2-D [Qb,Kb] or 3-D [H,Qb,Kb], got {self._layout.shape}")
        self._cache: dict = {}

    def block_grid(self, seq_q: int, seq_k: int) -> tuple[int, int]:
        return -(-seq_q // self.block), -(-seq_k // self.block)

    def layout(self, seq_q: int, seq_k: int, head: int = 0) -> np.ndarray:
        """Boolean [ceil(seq_q/block), ceil(seq_k/block)] grid for this head."""
        nbq, nbk = self.block_grid(seq_q, seq_k)
        lay = self._layout if self._layout.ndim == 2 else self._layout[head % self._layout.shape[0]]
        return lay[:nbq, :nbk]

    def check_size(self, seq_q, seq_k):
        if self._layout is not None:
            nbq, nbk = self.block_grid(seq_q, seq_k)
            if self._layout.shape[-2] < nbq or self._layout.shape[-1] < nbk:
                raise MaskSpecError(
                    f"block layout {self.source} is {self._layout.shape[-2]}x{self._layout.shape[-1]} blocks of "
                    f"{self.block}; a {seq_q}x{seq_k} mask needs {nbq}x{nbk}")

    def num_layouts(self, num_heads):
        if self._layout is not None and self._layout.ndim == 3:
            if num_heads is not None and num_heads % self._layout.shape[0]:
                raise MaskSpecError(f"{self._layout.shape[0]} layouts do not divide {num_heads} heads")
            return self._layout.shape[0]
        return super().num_layouts(num_heads)

    def _prefix(self, seq_q, seq_k, head):
        key = (seq_q, seq_k, head)
        if key not in self._cache:
            lay = self.layout(seq_q, seq_k, head)
            p = np.zeros((lay.shape[0] + 1, lay.shape[1] + 1), np.int64)
            p[1:, 1:] = lay.cumsum(0).cumsum(1)
            self._cache[key] = (lay, p)
        return self._cache[key]

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        lay, _ = self._prefix(seq_q, seq_k, head)
        return lay[q // self.block, k // self.block]

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        _, p = self._prefix(seq_q, seq_k, head)
        b = self.block
        bq0, bq1 = r0 // b, (r1 - 1) // b + 1
        bk0, bk1 = c0 // b, (c1 - 1) // b + 1
        count = p[bq1, bk1] - p[bq0, bk1] - p[bq1, bk0] + p[bq0, bk0]
        area = (bq1 - bq0) * (bk1 - bk0)
        out = np.full(count.shape, TILE_UNKNOWN, np.int8)
        out[count == area] = TILE_FULL
        out[count == 0] = TILE_EMPTY
        return out

    def __str__(self):
        return f"blocks:{_quote_path(self.source)},block={self.block}"


class BigBird(BlockLayout):
    """BigBird on a block grid: band of ``window`` blocks each side, the first ``global_blocks`` block rows and
    columns, and each remaining block with probability ``random``: block row i draws its key blocks in order from
    numpy ``default_rng([seed, i])`` (per head: ``[seed, head, i]``), so a shorter sequence's layout is the top-left
    corner of a longer one's."""

    def __init__(self, block=64, window=1, global_blocks=1, random=0.0, seed=0, per_head=False, draw="row"):
        super().__init__(None, block)
        if draw not in ("row", "grid"):
            raise MaskSpecError(f"bigbird draw must be 'row' or 'grid', got '{draw}'")
        # "grid": the whole block grid from one stream (default_rng(seed) / [seed, head]), as layouts were drawn
        # before the per-row streams; not prefix-stable, kept to rebuild the layouts of recorded benchmark runs.
        self.draw = draw
        if window < 0 or global_blocks < 0 or not 0.0 <= random <= 1.0 or seed < 0:
            raise MaskSpecError("bigbird needs window >= 0, global >= 0, 0 <= random <= 1 and seed >= 0")
        self.window, self.global_blocks = int(window), int(global_blocks)
        self.random, self.seed = float(random), int(seed)
        self.per_head = bool(per_head)

    def check_size(self, seq_q, seq_k):
        nbq, nbk = self.block_grid(seq_q, seq_k)
        if nbq * nbk > self.MAX_GRID_BLOCKS:
            raise MaskSpecError(
                f"bigbird:block={self.block} at {seq_q}x{seq_k} tokens is a {nbq}x{nbk} block grid "
                f"({nbq * nbk} blocks; its layout is held whole, at most {self.MAX_GRID_BLOCKS}): use a larger "
                f"block or a shorter sequence")

    #: The layout is a dense boolean grid plus int64 prefix sums (9 bytes per block): 2^27 blocks ~ 1.2 GB.
    MAX_GRID_BLOCKS = 1 << 27

    def layout(self, seq_q, seq_k, head=0):
        self.check_size(seq_q, seq_k)
        nbq, nbk = self.block_grid(seq_q, seq_k)
        qb = np.arange(nbq)[:, None]
        kb = np.arange(nbk)[None, :]
        lay = (np.abs(kb - qb) <= self.window) | (qb < self.global_blocks) | (kb < self.global_blocks)
        if self.random > 0:
            # Each block row draws from its own stream (seed, [head,] row), key blocks in order: the layout for a
            # shorter sequence is the top-left corner of a longer one's, so one spec means one mask.
            base = [self.seed, head] if self.per_head else [self.seed]
            if self.draw == "grid":
                rand = np.random.default_rng(base if self.per_head else self.seed).random((nbq, nbk)) < self.random
            else:
                rand = np.empty((nbq, nbk), bool)
                for i in range(nbq):
                    rand[i] = np.random.default_rng(base + [i]).random(nbk) < self.random
            lay = lay | rand
        return lay

    def num_layouts(self, num_heads):
        return MaskSpec.num_layouts(self, num_heads)

    def __str__(self):
        s = f"bigbird:block={self.block},window={self.window},global={self.global_blocks}"
        if self.random:
            s += f",random={self.random:g},seed={self.seed}"
        return s + (",per_head=1" if self.per_head else "") + (",draw=grid" if self.draw == "grid" else "")


class DenseMask(MaskSpec):
    """An explicit boolean matrix [Sq, Sk] or [H, Sq, Sk]; a model of size (s_q, s_k) uses its top-left corner."""

    def __init__(self, array: np.ndarray, source: str = "<array>"):
        a = np.asarray(array)
        if a.ndim not in (2, 3):
            raise MaskSpecError(f"mask array {source} must be 2-D or 3-D, got shape {a.shape}")
        if a.dtype != bool:
            if not np.issubdtype(a.dtype, np.number) or not np.isin(a, (0, 1)).all():
                raise MaskSpecError(f"mask array {source} must be boolean or 0/1")
            a = a.astype(bool)
        self.array, self.source = a, source
        self.per_head = a.ndim == 3

    def check_size(self, seq_q, seq_k):
        if self.array.shape[-2] < seq_q or self.array.shape[-1] < seq_k:
            raise MaskSpecError(
                f"mask {self.source} is {self.array.shape[-2]}x{self.array.shape[-1]}, "
                f"smaller than the model's {seq_q}x{seq_k} attention")

    def num_layouts(self, num_heads):
        if self.array.ndim == 3:
            if num_heads is not None and num_heads % self.array.shape[0]:
                raise MaskSpecError(f"{self.array.shape[0]} mask layouts do not divide {num_heads} heads")
            return self.array.shape[0]
        return 1

    def head_array(self, seq_q, seq_k, head=0) -> np.ndarray:
        a = self.array if self.array.ndim == 2 else self.array[head % self.array.shape[0]]
        return a[:seq_q, :seq_k]

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        return self.head_array(seq_q, seq_k, head)[q, k]

    def __str__(self):
        return f"npy:{_quote_path(self.source)}"


@dataclass(frozen=True)
class _Combine(MaskSpec):
    parts: tuple[MaskSpec, ...] = field(default=())

    @property
    def per_head(self):  # type: ignore[override]
        return any(p.per_head for p in self.parts)

    def check_size(self, seq_q, seq_k):
        for p in self.parts:
            p.check_size(seq_q, seq_k)

    def tile_keys(self, g, r0, c0):
        keys = [p.tile_keys(g, r0, c0) for p in self.parts]
        if any(k is None for k in keys):
            return None
        if len(keys) == 1:
            return keys[0]
        out = np.zeros(np.shape(keys[0]), np.int64)
        for k in keys:   # one key per combination of the parts' keys (mixed radix over their distinct values)
            _, inv = np.unique(k, return_inverse=True)
            n = int(inv.max()) + 1 if inv.size else 1
            out = np.unique(out * n + inv.reshape(out.shape), return_inverse=True)[1].reshape(out.shape)
        return out

    def num_layouts(self, num_heads):
        ns = {p.num_layouts(num_heads) for p in self.parts} - {1}
        if not ns:
            return 1
        if len(ns) > 1:
            if num_heads is None:
                raise MaskSpecError(f"parts of '{self}' have different numbers of layouts {sorted(ns)}")
            return num_heads
        return ns.pop()


class Union(_Combine):
    """Allowed where any part allows."""

    def candidate_counts(self, g):
        counts = [p.candidate_counts(g) for p in self.parts]
        if any(c is None for c in counts):
            return None
        return np.minimum(np.sum(counts, axis=0), g.tk)

    def candidates(self, g, i0, i1):
        pairs = [p.candidates(g, i0, i1) for p in self.parts]
        if any(c is None for c in pairs):
            return None
        flat = _sorted_unique(np.concatenate([ti * g.tk + tj for ti, tj in pairs]))
        return flat // g.tk, flat % g.tk

    def evaluate(self, q, k, **kw):
        out = self.parts[0].evaluate(q, k, **kw)
        for p in self.parts[1:]:
            out = out | p.evaluate(q, k, **kw)
        return out

    def classify_tiles(self, r0, r1, c0, c1, **kw):
        cls = [p.classify_tiles(r0, r1, c0, c1, **kw) for p in self.parts]
        out = np.full(np.broadcast_shapes(*(c.shape for c in cls)), TILE_UNKNOWN, np.int8)
        out[np.logical_and.reduce([c == TILE_EMPTY for c in cls])] = TILE_EMPTY
        out[np.logical_or.reduce([c == TILE_FULL for c in cls])] = TILE_FULL
        return out

    def __str__(self):
        return "|".join(f"({p})" if isinstance(p, Intersection) else str(p) for p in self.parts)


class Intersection(_Combine):
    """Allowed where every part allows."""

    def _driver(self, g):
        """The part with the fewest candidate tiles: its candidates cover the intersection's (a superset is all
        ``candidates`` promises; classification drops the rest)."""
        best, best_n = None, None
        for p in self.parts:
            c = p.candidate_counts(g)
            if c is not None and (best_n is None or int(c.sum()) < best_n):
                best, best_n = (p, c), int(c.sum())
        return best

    def candidate_counts(self, g):
        d = self._driver(g)
        return None if d is None else d[1]

    def candidates(self, g, i0, i1):
        d = self._driver(g)
        return None if d is None else d[0].candidates(g, i0, i1)

    def evaluate(self, q, k, **kw):
        out = self.parts[0].evaluate(q, k, **kw)
        for p in self.parts[1:]:
            out = out & p.evaluate(q, k, **kw)
        return out

    def classify_tiles(self, r0, r1, c0, c1, **kw):
        cls = [p.classify_tiles(r0, r1, c0, c1, **kw) for p in self.parts]
        out = np.full(np.broadcast_shapes(*(c.shape for c in cls)), TILE_UNKNOWN, np.int8)
        out[np.logical_and.reduce([c == TILE_FULL for c in cls])] = TILE_FULL
        out[np.logical_or.reduce([c == TILE_EMPTY for c in cls])] = TILE_EMPTY
        return out

    def __str__(self):
        return "&".join(f"({p})" if isinstance(p, Union) else str(p) for p in self.parts)


def grid_drawn(spec: MaskSpec) -> MaskSpec:
    """``spec`` with every BigBird drawing its random blocks from one stream over the grid (``draw=grid``): the
    layouts of benchmark runs recorded before the per-row streams."""
    if isinstance(spec, BigBird):
        return BigBird(spec.block, spec.window, spec.global_blocks, spec.random, spec.seed, spec.per_head, "grid")
    if isinstance(spec, _Combine):
        return type(spec)(tuple(grid_drawn(p) for p in spec.parts))
    return spec


def closed_form(spec: MaskSpec) -> bool:
    """Whether ``spec`` is a pattern of (query, key) alone that the host layer's compiler (``stof_mask_compile``)
    builds for any length: full, causal, sliding, dilated, global, longformer, bigbird without random blocks, and
    their unions and intersections; not a fixed-size array (npy:, blocks:) nor BigBird's random blocks."""
    if isinstance(spec, BigBird):
        return spec.random == 0
    if isinstance(spec, _Combine):
        return all(closed_form(p) for p in spec.parts)
    return isinstance(spec, (Full, Causal, Sliding, Dilated, Global))


def longformer(window: int, global_tokens: int | tuple[int, ...]) -> MaskSpec:
    """Longformer: a symmetric sliding window plus global tokens (an int = the first n tokens)."""
    tokens = range(global_tokens) if isinstance(global_tokens, int) else tuple(global_tokens)
    return Union((Sliding(window, window), Global(tokens)))


# ---------------------------------------------------------------------------------------------------------------
# Parsing

_INT_RE = re.compile(r"-?[0-9]+")  # ASCII digits only (int() also takes other scripts' digits)
_TOKEN_RE = re.compile(r"\s*[-+]?[0-9]+\s*", re.ASCII)  # a global token position, as the C++ parser reads it
_INT_MAX = 2**31 - 1
# Parentheses nested deeper than this are refused (the parser recurses once per level).
MAX_NESTING = 64


def _args(name: str, text: str, allowed: dict[str, type]) -> dict:
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        if "=" not in item:
            raise MaskSpecError(f"mask '{name}': expected key=value, got '{item}'")
        key, val = (s.strip() for s in item.split("=", 1))
        if key not in allowed:
            raise MaskSpecError(f"mask '{name}': unknown argument '{key}' "
                                f"({'it takes none' if not allowed else 'expected one of ' + ', '.join(allowed)})")
        if key in out:
            raise MaskSpecError(f"mask '{name}': '{key}' given twice")
        typ = allowed[key]
        try:
            if typ is int:
                if not _INT_RE.fullmatch(val):
                    raise ValueError
                out[key] = int(val)
                if abs(out[key]) > _INT_MAX:   # the tile format and the kernels index with int32
                    raise MaskSpecError(f"mask '{name}': {key}={val} is out of range (at most {_INT_MAX})")
            elif typ is float:
                out[key] = float(val)
            elif typ is bool:
                if val not in ("0", "1", "true", "false"):
                    raise ValueError
                out[key] = val in ("1", "true")
            elif typ is tuple:
                tokens = [t for t in val.split(";") if t != ""]
                if not all(_TOKEN_RE.fullmatch(t) for t in tokens):
                    raise ValueError
                out[key] = tuple(int(t) for t in tokens)
                if any(abs(t) > _INT_MAX for t in out[key]):
                    raise MaskSpecError(f"mask '{name}': a token of {key}= is out of range (at most {_INT_MAX})")
            else:
                out[key] = val
        except MaskSpecError:
            raise  # (a ValueError too: the out-of-range messages above stay as they are)
        except ValueError:
            raise MaskSpecError(f"mask '{name}': bad value '{val}' for '{key}' (expected {typ.__name__})") from None
    return out


def _need(name, args, *keys):
    for k in keys:
        if k not in args:
            raise MaskSpecError(f"mask '{name}' needs '{k}=...'")


def _window_sides(name, a) -> tuple[int, int]:
    if "window" in a:
        if "left" in a or "right" in a:
            raise MaskSpecError(f"mask '{name}': give window= or left=/right=, not both")
        w = a["window"]
        return (w, 0) if a.get("causal") else (w, w)
    if "left" in a or "right" in a:
        return a.get("left", 0), a.get("right", 0)
    raise MaskSpecError(f"mask '{name}' needs 'window=...' (or left=/right=)")


def _load_npy(name: str, path: str) -> np.ndarray:
    if not path:
        raise MaskSpecError(f"mask '{name}' needs a path: {name}:PATH.npy")
    if os.path.isdir(path):
        raise MaskSpecError(f"mask file {path} is a directory (give a .npy file)")
    if not os.path.isfile(path):
        hint = f" ('{name}:' takes a path only; quote a path with ',' in it)" if name == "npy" and "," in path else ""
        raise MaskSpecError(f"mask file not found: {path}{hint}")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises several types for a bad file
        if "pickle" in str(e):  # numpy's wording for a file that is not in its .npy format
            raise MaskSpecError(f"mask file {path} is not a numpy .npy array file") from None
        raise MaskSpecError(f"cannot read mask file {path}: {e}") from None


def _atom(name: str, text: str) -> MaskSpec:
    if name == "full":
        _args(name, text, {})
        return Full()
    if name == "causal":
        return Causal(**_args(name, text, {"offset": int}))
    if name == "sliding":
        a = _args(name, text, {"window": int, "left": int, "right": int, "causal": bool})
        return Sliding(*_window_sides(name, a))
    if name == "dilated":
        a = _args(name, text, {"window": int, "left": int, "right": int, "causal": bool, "dilation": int})
        left, right = _window_sides(name, a)
        return Dilated(left, right, a.get("dilation", 2))
    if name == "global":
        a = _args(name, text, {"n": int, "tokens": tuple})
        if ("n" in a) == ("tokens" in a):
            raise MaskSpecError("mask 'global' needs exactly one of n= or tokens=")
        if a.get("n", 0) < 0:
            raise MaskSpecError(f"mask 'global': n={a['n']} is negative (the number of leading global tokens)")
        return Global(range(a["n"]) if "n" in a else a["tokens"])
    if name == "longformer":
        a = _args(name, text, {"window": int, "global": int, "tokens": tuple})
        _need(name, a, "window")
        if "global" in a and "tokens" in a:
            raise MaskSpecError("mask 'longformer': give global= or tokens=, not both")
        if a.get("global", 0) < 0:
            raise MaskSpecError(f"mask 'longformer': global={a['global']} is negative (the number of leading global "
                                "tokens)")
        return longformer(a["window"], a["tokens"] if "tokens" in a else a.get("global", 0))
    if name == "bigbird":
        a = _args(name, text, {"block": int, "window": int, "global": int, "random": float, "seed": int,
                               "per_head": bool, "draw": str})
        return BigBird(a.get("block", 64), a.get("window", 1), a.get("global", 1), a.get("random", 0.0),
                       a.get("seed", 0), a.get("per_head", False), a.get("draw", "row"))
    if name == "blocks":
        path, rest = _take_path(name, text)
        a = _args(name, rest, {"block": int})
        return BlockLayout(_load_npy(name, path), a.get("block", 64), source=path)
    if name == "npy":
        path, rest = _take_path(name, text) if text[:1] in ("'", '"') else (text, "")
        if rest:
            raise MaskSpecError(f"mask 'npy' takes a path only, got ',{rest}'")
        return DenseMask(_load_npy(name, path), source=path)
    raise MaskSpecError(
        f"unknown mask '{name}' (expected one of full, causal, sliding, dilated, global, longformer, bigbird, "
        "blocks, npy)")


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, start, quote = [], 0, 0, None
    for i, ch in enumerate(text):
        if quote:   # a quoted path: '|', '&', parentheses and commas inside are part of it
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise MaskSpecError(f"unbalanced ')' in mask spec '{text}'")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if quote:
        raise MaskSpecError(f"unclosed quote {quote} in mask spec '{text}'")
    if depth:
        raise MaskSpecError(f"unbalanced '(' in mask spec '{text}'")
    parts.append(text[start:])
    return parts


def _quote_path(path: str) -> str:
    """A path as a spec writes it: quoted when it holds a character the grammar reads."""
    if not any(c in path for c in "|&(),'\""):
        return path
    return f"'{path}'" if "'" not in path else f'"{path}"'


def _take_path(name: str, text: str) -> tuple[str, str]:
    """Split ``PATH[,rest]``; a PATH in single or double quotes may hold '|', '&', ',' and parentheses."""
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        if end < 0:
            raise MaskSpecError(f"mask '{name}': unclosed quote in {text}")
        rest = text[end + 1:].strip()
        if rest and not rest.startswith(","):
            raise MaskSpecError(f"mask '{name}': expected ',' after the quoted path, got '{rest}'")
        return text[1:end], rest[1:]
    path, _, rest = text.partition(",")
    return path, rest


def _parse(text: str, depth: int = 0) -> MaskSpec:
    text = text.strip()
    if not text:
        raise MaskSpecError("empty mask spec")
    if depth > MAX_NESTING:
        raise MaskSpecError(f"mask spec nests parentheses deeper than {MAX_NESTING} levels")
    union = _split_top(text, "|")
    if len(union) > 1:
        return Union(tuple(_parse(p, depth + 1) for p in union))
    inter = _split_top(text, "&")
    if len(inter) > 1:
        return Intersection(tuple(_parse(p, depth + 1) for p in inter))
    if text.startswith("(") and text.endswith(")"):
        return _parse(text[1:-1], depth + 1)
    name, _, rest = text.partition(":")
    return _atom(name.strip().lower(), rest.strip())


def parse_mask(spec: str | MaskSpec) -> MaskSpec:
    """Parse a mask spec string (see the module docstring); a MaskSpec passes through."""
    if isinstance(spec, MaskSpec):
        return spec
    if not isinstance(spec, str):
        raise MaskSpecError(f"mask spec must be a string, got {type(spec).__name__}")
    return _parse(spec)
