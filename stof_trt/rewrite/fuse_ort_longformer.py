"""Fuse ONNX Runtime's ``LongformerAttention`` (com.microsoft, CUDA-only) into two packed StofSparseAttention nodes.

Matched::

      X [B,S,N]  W, b (local QKV)  mask [B,S] (< 0 = masked)  Wg, bg (global QKV)  global [B,S] (1 = global token)
                          \\                  |                       |                  |
                     LongformerAttention (num_heads H, window W)   <- anchor

The op's semantics: a local query row i attends to keys |i - j| <= W and to every global key (local Q, K, V); a
global query row attends to every key with the global projections. The global positions are a run-time input, so
they cannot be part of a static layout; their rows of X are gathered into G = min(S, ``MAX_GLOBAL``) *slots*, keys
in front of the sequence, instead::

    slots [B,G]  = the kept global tokens' positions in order (a prefix count of them scatters each into its slot)
    X_ext        = Concat(X at the slots, X)                                                  [B, G+S, N]
    local node   = StofSparseAttention(bshd_kv, Q = X·Wq + bq [B, S, H, D],
                                       KV = X_ext·Wkv + bkv [B, G+S, 2, H, D])                  -> [B, S, H, D]
    global node  = StofSparseAttention(bshd_kv, Q = X_slots·Wgq + bgq [B, G, H, D],
                                       KV = X·Wgkv + bgkv [B, S, 2, H, D])                      -> [B, G, H, D]
    Y            = ScatterElements(local out [B, S, N], rows slot position <- global rows)

Both layouts keep a shorter run-time length as their top-left corner (the slots are the first keys):

* local [S, G+S]: row i attends the G slot columns and the band G+j, |i - j| <= W; key_padding_mask = [slot holds a
  kept global token ; kept and not global] (a global key in the band counts once);
* global [G, S]: every slot row attends every real position (kept keys: key_padding_mask = kept).

The projections are ``StofGemmEpilogue`` nodes (bias in the GEMM's epilogue; MatMul + Add with
``epilogues=False``): Q and K/V apart, so the global Q is projected for the G slot rows only. The merge scatters the
G global rows into the local output, which becomes Y (an unused slot writes the row and value of slot 0, or of the
local output's row 0 when no slot is used: duplicate indices with equal values).

A padded global token (mask < 0) takes no slot: it is masked as a key, and its query row is not defined by the op.
More kept global tokens than G in a sequence cannot be represented: the slot rows of X become NaN, so every local
row of that sequence is NaN (it attends every slot's NaN key and value), and so do the global rows (set to NaN
before the merge) — never silently wrong. With a dynamic sequence axis G is also at most 2W (the op needs S to be a
multiple of 2W, so the slots always fit a run-time length). Rows whose own mask is < 0 (padding) are not defined by
the op and may differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import onnx_graphsurgeon as gs

from ..format import TileLayout, compile_mask
from ..masks import TILE_EMPTY, TILE_FULL, TILE_UNKNOWN, Diagonals, Full, MaskSpec

from .attention_common import AttentionEmitter, AttentionPlan
from .base import Fusion, Match
from .matcher import const_value
from .ort_contrib import ORT_DOMAIN, present, tensor_shapes

#: Global tokens per sequence the rewritten model represents (one tile row of slots at the default tile size).
MAX_GLOBAL = 64


@dataclass(frozen=True)
class _Rect(MaskSpec):
    """Allowed iff ``rows[0] <= query < rows[1]`` and ``cols[0] <= key < cols[1]``: exact tile classes, so the
    slot layouts compile in proportion to their stored tiles (compile_mask), not to the (G+S)² grid."""

    rows: tuple[int, int]
    cols: tuple[int, int]

    def evaluate(self, q, k, *, seq_q, seq_k, head=0):
        return (q >= self.rows[0]) & (q < self.rows[1]) & (k >= self.cols[0]) & (k < self.cols[1])

    def classify_tiles(self, r0, r1, c0, c1, *, seq_q, seq_k, head=0):
        (a, b), (c, d) = self.rows, self.cols
        full = (r0 >= a) & (r1 <= b) & (c0 >= c) & (c1 <= d)
        empty = (r1 <= a) | (r0 >= b) | (c1 <= c) | (c0 >= d)
        out = np.full(np.broadcast_shapes(np.shape(full), np.shape(empty)), TILE_UNKNOWN, np.int8)
        out[np.broadcast_to(full, out.shape)] = TILE_FULL
        out[np.broadcast_to(empty, out.shape)] = TILE_EMPTY
        return out

    def tile_keys(self, g, r0, c0):
        # the bits depend on where the rectangle's edges cut the tile only
        def cut(x0, lo_hi, size):
            return np.clip(lo_hi[0] - x0, 0, size) * (size + 1) + np.clip(lo_hi[1] - x0, 0, size)
        return cut(r0, self.rows, g.tile_m) * (g.tile_n + 1) ** 2 + cut(c0, self.cols, g.tile_n)

    def candidate_counts(self, g):
        first, last = self._cols(g)
        out = np.zeros(g.tq, np.int64)
        lo, hi = self.rows[0] // g.tile_m, -(-min(self.rows[1], g.seq_q) // g.tile_m)
        out[lo:hi] = max(0, last - first + 1)
        return out

    def candidates(self, g, i0, i1):
        first, last = self._cols(g)
        rows = np.arange(i0, i1, dtype=np.int64)
        rows = rows[(rows * g.tile_m < self.rows[1]) & ((rows + 1) * g.tile_m > self.rows[0])]
        cols = np.arange(first, last + 1, dtype=np.int64)
        return np.repeat(rows, cols.size), np.tile(cols, rows.size)

    def _cols(self, g):
        return self.cols[0] // g.tile_n, (min(self.cols[1], g.seq_k) - 1) // g.tile_n

    def __str__(self):
        return f"rows[{self.rows[0]},{self.rows[1]})&cols[{self.cols[0]},{self.cols[1]})"


def local_layout(seq: int, slots: int, window: int, tile_m: int, tile_n: int) -> TileLayout:
    """[S, G+S]: row i sees the G slot columns and the band G+j, |i - j| <= W (key G+j is position j)."""
    n = slots + seq
    spec = _Rect((0, seq), (0, slots)) | (Diagonals(slots - window, slots + window) & _Rect((0, seq), (slots, n)))
    return replace(compile_mask(spec, seq, n, tile_m=tile_m, tile_n=tile_n),
                   mask_spec=f"longformer_local:window={window},slots={slots}")


def global_layout(seq: int, slots: int, tile_m: int, tile_n: int) -> TileLayout:
    """[G, S]: every slot row sees every real position."""
    return replace(compile_mask(Full(), slots, seq, tile_m=tile_m, tile_n=tile_n),
                   mask_spec=f"longformer_global:slots={slots}")


class FuseOrtLongformerAttention(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("LongformerAttention",)
    pattern = "ort_longformer_attention"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        if not all(present(node, i) for i in range(7)):
            self.skip(node, "an input of LongformerAttention is missing")
            return None
        H, window = int(node.attrs["num_heads"]), int(node.attrs["window"])
        w, wg = const_value(node.inputs[1]), const_value(node.inputs[4])
        if w is None or wg is None or w.ndim != 2 or w.shape != wg.shape or w.shape[1] != 3 * w.shape[0] \
                or w.shape[0] % H:
            self.skip(node, "weights are not constant [N, 3N] matrices with N a multiple of num_heads")
            return None
        bv, bgv = const_value(node.inputs[2]), const_value(node.inputs[5])
        if bv is None or bgv is None or bv.size != w.shape[1] or bgv.size != w.shape[1]:
            self.skip(node, "biases are not constant [3N] vectors")
            return None
        if window < 0:
            self.skip(node, f"window {window} is negative")
            return None
        return Match(node, [node], lambda: [], {"heads": H, "window": window, "hidden": int(w.shape[0])})

    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        shapes = tensor_shapes(self, {m.anchor.inputs[0].name for m in matches})
        kept = []
        tm, tn = self.ctx.options["tile_m"], self.ctx.options["tile_n"]
        for m in matches:
            node, H, W, N = m.anchor, m.info["heads"], m.info["window"], m.info["hidden"]
            xs = shapes[node.inputs[0].name]
            if len(xs) != 3 or xs[2] != N:
                self.skip(node, f"input of shape {xs}: expected [B, S, {N}]")
                continue
            if self.ctx.options.get("mask") is not None:
                self.ctx.report.notes.append(f"{node.name}: the user mask is not applied to LongformerAttention "
                                             "(its window and global tokens define the layout)")
            S, D = xs[1], N // H
            G = min(S, MAX_GLOBAL)
            declared = node.inputs[0].shape
            static = declared is not None and len(declared) == 3 and isinstance(declared[1], (int, np.integer))
            if not static:
                # the slot count is fixed in the graph; the op needs S to be a multiple of 2W, so 2W slots always fit
                G = max(1, min(G, 2 * W))
                self.ctx.report.notes.append(f"{node.name}: dynamic sequence length: {G} global token slots "
                                             "(at most 2·window)")
            scale = 1.0 / math.sqrt(D)
            local, glob = local_layout(S, G, W, tm, tn), global_layout(S, G, tm, tn)
            lplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=S, seq_k=G + S, scale=scale,
                                  layout=local, mask_source=f"LongformerAttention window {W} + {G} global token "
                                                            "slots & key padding from mask/global")
            gplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=G, seq_k=S, scale=scale,
                                  layout=glob, mask_source=f"LongformerAttention global rows ({G} slots) & key "
                                                           "padding from mask")
            info = dict(lplan.info(), anchor=node.name, window=W, global_slots=G, key_padding=True)
            m.build = self._builder(node, lplan, gplan, S, G, N, static, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node, lplan: AttentionPlan, gplan: AttentionPlan, S: int, G: int, N: int, static: bool,
                 info: dict):
        x, w, b, mask, wg, bg, glob = node.inputs[:7]
        y = node.outputs[0]
        H, D = lplan.heads, lplan.head_dim
        epilogues = self.ctx.options.get("epilogues", True)

        def build():
            new: list[gs.Node] = []
            u = self.ctx.unique
            const = self.new_const

            def op(kind, inputs, dtype=None, n_out=1, outputs=None, **attrs):
                outs = outputs or [self.new_var(f"stof_lf_{kind.lower()}", dtype=dtype) for _ in range(n_out)]
                new.append(gs.Node(kind, u(f"stof_lf_{kind.lower()}"), attrs, inputs, outs))
                return outs[0] if len(outs) == 1 else outs

            def i64(prefix, value):
                return const(f"stof_lf_{prefix}", np.array(value, np.int64))

            def scalar_like(prefix, value, t):
                """``value`` in t's element type: a constant when the graph declares it, else a CastLike."""
                try:
                    if t.dtype is not None:
                        return const(f"stof_lf_{prefix}", np.array(value, np.dtype(t.dtype)))
                except TypeError:  # an element type numpy does not have (bfloat16)
                    pass
                return op("CastLike", [const(f"stof_lf_{prefix}", np.array(value, np.float32)), t], None)

            seq_end = None if static else op("Shape", [glob], np.int64, start=1, end=2)

            def per_position(prefix, values):
                """A [1, S] constant; with a dynamic sequence axis its first run-time S columns."""
                c = const(f"stof_lf_{prefix}", values[None])
                return c if static else op("Slice", [c, i64("s0", [0]), seq_end, i64("ax1", [1])], values.dtype)

            # -- slots: the kept global tokens first, in position order. A kept global token's slot is the number of
            # kept global tokens before it (a prefix count), capped at G; the positions are scattered into G + 1
            # columns, the last taking every other token (its value is never read). An unused slot holds
            # position 0 (its row of X is gathered and masked as a key).
            keep = op("Not", [op("Less", [mask, scalar_like("zero", 0.0, mask)], np.bool_)], np.bool_)
            is_g = op("Cast", [glob], np.bool_, to=9)
            kept_g = op("And", [is_g, keep], np.bool_)
            before = op("CumSum", [op("Cast", [kept_g], np.int64, to=7), i64("axis1c", 1)], np.int64, exclusive=1)
            slot_of = op("Where", [kept_g, op("Min", [before, i64("gmax", G)], np.int64), i64("gcol", G)], np.int64)
            positions = op("Expand", [per_position("pos", np.arange(S, dtype=np.int64)),
                                      op("Shape", [slot_of], np.int64)], np.int64)
            slot_shape = op("Concat", [op("Shape", [slot_of], np.int64, start=0, end=1), i64("g1", [G + 1])],
                            np.int64, axis=0)
            zeros = op("Expand", [const("stof_lf_zero_slots", np.zeros((1, G + 1), np.int64)), slot_shape], np.int64)
            scattered = op("ScatterElements", [zeros, slot_of, positions], np.int64, axis=1)
            idx = op("Slice", [scattered, i64("s0i", [0]), i64("gi", [G]), i64("ax1i", [1])], np.int64)
            count = op("ReduceSum", [op("Cast", [kept_g], np.float32, to=1), i64("axis1", [1])], np.float32,
                       keepdims=1)                                                               # [B, 1]
            slot_used = op("Less", [const("stof_lf_slots", np.arange(G, dtype=np.float32)[None]), count],
                           np.bool_)                                                             # [B, G]
            # -- X_ext = [X at the slots ; X]; NaN slots for a sequence with more kept global tokens than slots
            slot_x = op("GatherND", [x, op("Unsqueeze", [idx, i64("axis2", [2])], np.int64)], x.dtype, batch_dims=1)
            over = op("Greater", [op("Unsqueeze", [count, i64("axis2b", [2])], np.float32),
                                  const("stof_lf_gcap", np.array(G, np.float32))], np.bool_)     # [B, 1, 1]
            nan = scalar_like("nan", np.nan, x)
            slot_x = op("Where", [over, nan, slot_x], x.dtype)
            x_ext = op("Concat", [slot_x, x], x.dtype, axis=1)

            wv, bv, wgv, bgv = (const_value(t) for t in (w, b, wg, bg))

            def project(x_in, wmat, bvec, cols, shape, prefix):
                """x_in · wmat[:, cols] + bvec[cols] reshaped to ``shape``, the bias in the GEMM's epilogue."""
                wpart = np.ascontiguousarray(wmat[:, cols])
                bpart = np.ascontiguousarray(bvec.reshape(3 * N)[cols])
                if epilogues:
                    out = self.new_var(f"stof_lf_{prefix}", dtype=x.dtype)
                    gemm = gs.Node("StofGemmEpilogue", u("StofGemmEpilogue"), {"activation": "none"},
                                   [x_in, const(f"stof_lf_{prefix}_w", wpart), const(f"stof_lf_{prefix}_b", bpart)],
                                   [out], domain="stof")
                    self.ctx.overloads[gemm.name] = "none"
                    self.ctx.functions.add(("StofGemmEpilogue", "none"))
                    new.append(gemm)
                else:
                    out = op("Add", [op("MatMul", [x_in, const(f"stof_lf_{prefix}_w", wpart)], x.dtype),
                                     const(f"stof_lf_{prefix}_b", bpart)], x.dtype)
                return op("Reshape", [out, i64(f"{prefix}_shape", shape)], x.dtype)

            q_cols, kv_cols = slice(0, N), slice(N, 3 * N)
            emitter = AttentionEmitter(self)
            # band keys: kept and not global (a kept global key is in a slot, and counts once)
            band_keep = op("Xor", [keep, kept_g], np.bool_)
            lplan.padding_tensor = op("Concat", [slot_used, band_keep], np.bool_, axis=1)
            local_out = self.new_var("stof_lf_local", dtype=y.dtype)
            emitter.node(lplan, project(x, wv, bv, q_cols, [0, 0, H, D], "q"),
                         project(x_ext, wv, bv, kv_cols, [0, 0, 2, H, D], "kv"), None, local_out, new)
            gplan.padding_tensor = keep
            global_out = self.new_var("stof_lf_global", dtype=y.dtype)
            emitter.node(gplan, project(slot_x, wgv, bgv, q_cols, [0, 0, H, D], "gq"),
                         project(x, wgv, bgv, kv_cols, [0, 0, 2, H, D], "gkv"), None, global_out, new)
            # -- merge: the global rows [B, G, N] into the local output at their positions. An unused slot writes
            # slot 0's row and value (duplicate indices with equal values), or, when no slot is used, the local
            # output's row 0 unchanged. ScatterElements over [B, G, N] indices: one thread per element (ScatterND's
            # CUDA kernel gives each row to one thread, ~0.4 ms at B=8).
            local_flat = op("Reshape", [local_out, i64("out_shape", [0, 0, N])], y.dtype)
            slot_rows = op("Reshape", [global_out, i64("out_shape2", [0, 0, N])], y.dtype)
            # NaN queries may read as an empty row to a kernel (no finite score): the NaN set here, not derived
            slot_rows = op("Where", [over, nan, slot_rows], y.dtype)
            first_row = op("Slice", [slot_rows, i64("s0f", [0]), i64("s1f", [1]), i64("ax1f", [1])], y.dtype)
            local_row0 = op("Slice", [local_flat, i64("s0l", [0]), i64("s1l", [1]), i64("ax1l", [1])], y.dtype)
            any_used = op("Greater", [op("Unsqueeze", [count, i64("axis2c", [2])], np.float32),
                                      const("stof_lf_zero_f", np.array(0, np.float32))], np.bool_)   # [B, 1, 1]
            fill = op("Where", [any_used, first_row, local_row0], y.dtype)                               # [B, 1, N]
            used3 = op("Unsqueeze", [slot_used, i64("axis2u", [2])], np.bool_)                           # [B, G, 1]
            updates = op("Where", [used3, slot_rows, fill], y.dtype)
            first_idx = op("Slice", [idx, i64("s0i2", [0]), i64("s1i2", [1]), i64("ax1i2", [1])], np.int64)
            row = op("Where", [slot_used, idx, first_idx], np.int64)                                     # [B, G]
            where = op("Expand", [op("Unsqueeze", [row, i64("axis2r", [2])], np.int64), i64("gn", [1, 1, N])],
                       np.int64)
            op("ScatterElements", [local_flat, where, updates], axis=1, outputs=[y])
            info["name"] = lplan.name
            ginfo = dict(gplan.info(), anchor=node.name, global_slots=G)
            ginfo.pop("kind", None)
            self.ctx.report.attention.append(ginfo)
            return new

        return build
