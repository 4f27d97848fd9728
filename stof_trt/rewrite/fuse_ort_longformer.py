"""Fuse ONNX Runtime's ``LongformerAttention`` (com.microsoft, CUDA-only) into two packed StofSparseAttention nodes.

Matched::

      X [B,S,N]  W, b (local QKV)  mask [B,S] (< 0 = masked)  Wg, bg (global QKV)  global [B,S] (1 = global token)
                          \\                  |                       |                  |
                     LongformerAttention (num_heads H, window W)   <- anchor

The op's semantics: a local query row i attends to keys |i - j| <= W and to every global key (local Q, K, V); a
global query row attends to every key with the global projections. The global positions are a run-time input, so
they cannot be part of a static layout; their rows of X are gathered into G = min(S, ``MAX_GLOBAL``) *slots*, keys
in front of the sequence, instead::

    StofGlobalSlots(X, mask, global) -> X_slots [B, G, N] (X at the kept global tokens, in position order),
                                        the two nodes' key padding masks, row_index [B, G] (each slot's position)
    M = StofGemmEpilogue(X, [Wq | Wkv | Wgkv], prefix X_slots with [Wgq | Wkv | ·])            -> [B, G+S, 5N]
        (columns: Q | K,V | global K,V for X's rows; global Q | K,V | unused for the slot rows)
    global node  = StofSparseAttention(bshd_kv, Q = M[:, :G, :N], KV = M[:, G:, 3N:])         -> [B, G, H, D]
    Y = local node = StofSparseAttention(bshd_kv, Q = M[:, G:, :N], KV = M[:, :, N:3N],
                                         row_values = the global node's rows, row_index)       -> [B, S, H·D]

Both layouts keep a shorter run-time length as their top-left corner (the slots are the first keys):

* local [S, G+S]: row i attends the G slot columns and the band G+j, |i - j| <= W; key_padding_mask = [slot holds a
  kept global token ; kept and not global] (a global key in the band counts once);
* global [G, S]: every slot row attends every real position (kept keys: key_padding_mask = kept).

The projections are one ``StofGemmEpilogue`` node (bias in the GEMM's epilogue): the slot rows are its ``prefix``
input with their own weights, so the concatenation of X is never copied, and both attention nodes read their
windows of M in place (``query_view`` / ``key_view``, docs/nodes.md). The local node writes Y itself, with the
global rows written over it at their positions (row_values / row_index): no copy of the output either. With
``epilogues=False`` the projections are MatMul + Add per Q and K/V, the slots' K/V through a Concat.

A padded global token (mask < 0) takes no slot: it is masked as a key, and its query row is not defined by the op.
More kept global tokens than G in a sequence cannot be represented: the slot rows of X become NaN, so every local
row of that sequence is NaN (it attends every slot's NaN key and value), and the global rows keep those NaN rows
(row_index -1) — never silently wrong. With a dynamic sequence axis G is also at most 2W (the op needs S to be a
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
from .functions import global_slots_overload
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
            m.build = self._builder(node, lplan, gplan, G, N, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node, lplan: AttentionPlan, gplan: AttentionPlan, G: int, N: int, info: dict):
        x, w, b, mask, wg, bg, glob = node.inputs[:7]
        y = node.outputs[0]
        H, D = lplan.heads, lplan.head_dim
        epilogues = self.ctx.options.get("epilogues", True)

        def build():
            new: list[gs.Node] = []
            u = self.ctx.unique
            const = self.new_const

            def op(kind, inputs, dtype, **attrs):
                out = self.new_var(f"stof_lf_{kind.lower()}", dtype=dtype)
                new.append(gs.Node(kind, u(f"stof_lf_{kind.lower()}"), attrs, inputs, [out]))
                return out

            def i64(prefix, value):
                return const(f"stof_lf_{prefix}", np.array(value, np.int64))

            # -- slots: X's rows of the kept global tokens, the two nodes' key padding, the global rows' positions
            slot_x = self.new_var("stof_lf_slot_x", dtype=x.dtype)
            local_kpm, global_kpm, row_index = (self.new_var(f"stof_lf_{n}", dtype=np.int32)
                                                for n in ("local_kpm", "global_kpm", "row_index"))
            slots = gs.Node("StofGlobalSlots", u("StofGlobalSlots"), {"slots": G}, [x, mask, glob],
                            [slot_x, local_kpm, global_kpm, row_index], domain="stof")
            self.ctx.overloads[slots.name] = global_slots_overload(G)
            self.ctx.functions.add(("StofGlobalSlots", global_slots_overload(G)))
            new.append(slots)

            wv, bv, wgv, bgv = (const_value(t) for t in (w, b, wg, bg))

            def project(x_in, wmat, bvec, cols, shape, name, rows_before=None):
                """MatMul + Add of [rows_before ; x_in] · wmat[:, cols] + bvec[cols] (without the epilogue
                fusions), reshaped to ``shape`` unless None."""
                if rows_before is not None:
                    x_in = op("Concat", [rows_before, x_in], x.dtype, axis=1)
                wpart = const(f"stof_lf_{name}_w", np.ascontiguousarray(wmat[:, cols]))
                bpart = const(f"stof_lf_{name}_b", np.ascontiguousarray(bvec.reshape(3 * N)[cols]))
                out = op("Add", [op("MatMul", [x_in, wpart], x.dtype), bpart], x.dtype)
                return out if shape is None else op("Reshape", [out, i64(f"{name}_shape", shape)], x.dtype)

            emitter = AttentionEmitter(self)
            if epilogues:
                self._one_projection(new, emitter, x, slot_x, wv, bv, wgv, bgv, lplan, gplan, G, N, local_kpm,
                                     global_kpm, row_index, y)
            else:
                q_cols, kv_cols = slice(0, N), slice(N, 3 * N)
                gplan.padding_tensor = global_kpm
                global_out = self.new_var("stof_lf_global", dtype=y.dtype)
                emitter.node(gplan, project(slot_x, wgv, bgv, q_cols, [0, 0, H, D], "gq"),
                             project(x, wgv, bgv, kv_cols, [0, 0, 2, H, D], "gkv"), None, global_out, new)
                # the local node writes Y ([B, S, N] rows): its own rows, then the global rows at their positions
                lplan.padding_tensor = local_kpm
                emitter.node(lplan, project(x, wv, bv, q_cols, None, "q"),
                             project(x, wv, bv, kv_cols, [0, 0, 2, H, D], "kv", rows_before=slot_x), None, y, new,
                             flat=True, rows=(global_out, row_index))
            info["name"] = lplan.name
            ginfo = dict(gplan.info(), anchor=node.name, global_slots=G)
            ginfo.pop("kind", None)
            self.ctx.report.attention.append(ginfo)
            return new

        return build

    def _one_projection(self, new, emitter, x, slot_x, wv, bv, wgv, bgv, lplan, gplan, G, N, local_kpm, global_kpm,
                        row_index, y):
        """Every projection in one StofGemmEpilogue, M = [slot rows ; X]·W [B, G+S, 5N], read in place by both
        attention nodes through their query_view / key_view: X's rows take [Q | K,V | global K,V] (W, bias), the
        slot rows [global Q | K,V | unused] (prefix_w, prefix_bias). One wide GEMM fills the GPU where five narrow
        ones (two of 64 rows) each ran a fraction of a wave."""
        H, D = lplan.heads, lplan.head_dim
        u, const = self.ctx.unique, self.new_const
        q, kv = slice(0, N), slice(N, 3 * N)
        bv, bgv = bv.reshape(3 * N), bgv.reshape(3 * N)
        w_rows = np.ascontiguousarray(np.concatenate([wv[:, q], wv[:, kv], wgv[:, kv]], axis=1))
        b_rows = np.ascontiguousarray(np.concatenate([bv[q], bv[kv], bgv[kv]]))
        w_slots = np.ascontiguousarray(np.concatenate([wgv[:, q], wv[:, kv], wgv[:, kv]], axis=1))
        b_slots = np.ascontiguousarray(np.concatenate([bgv[q], bv[kv], bgv[kv]]))
        m = self.new_var("stof_lf_projections", dtype=x.dtype)
        new.append(self.ctx.gemm_node(x, const("stof_lf_w", w_rows), const("stof_lf_b", b_rows), m, prefix=slot_x,
                                      prefix_w=const("stof_lf_slot_w", w_slots),
                                      prefix_bias=const("stof_lf_slot_b", b_slots)))
        # global node: the slot rows' Q, X's rows' global K/V; its flat rows [B, G, N] as [B, G, H, D] row values
        gplan.padding_tensor = global_kpm
        global_flat = self.new_var("stof_lf_global_rows", dtype=y.dtype)
        emitter.node(gplan, m, m, None, global_flat, new, flat=True, views=([0, G, 0, N], [G, -1, 3 * N, 2 * N]))
        global_out = self.new_var("stof_lf_global", dtype=y.dtype)
        new.append(gs.Node("Reshape", u("stof_lf_reshape"), {}, [global_flat, const(
            "stof_lf_global_shape", np.array([0, 0, H, D], np.int64))], [global_out]))
        # local node: X's rows' Q, every row's K/V (the slots first); writes Y with the global rows over it
        lplan.padding_tensor = local_kpm
        emitter.node(lplan, m, m, None, y, new, flat=True, rows=(global_out, row_index),
                     views=([G, -1, 0, N], [0, -1, N, 2 * N]))
