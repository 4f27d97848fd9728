"""Fuse ONNX Runtime's ``LongformerAttention`` (com.microsoft, CUDA-only) into two packed StofSparseAttention nodes.

Matched::

      X [B,S,N]  W, b (local QKV)  mask [B,S] (< 0 = masked)  Wg, bg (global QKV)  global [B,S] (1 = global token)
                          \\                  |                       |                  |
                     LongformerAttention (num_heads H, window W)   <- anchor

The op's semantics: a local query row i attends to keys |i - j| <= W and to every global key (local Q, K, V); a
global query row attends to every key with the global projections. The global positions are a run-time input, so
they cannot be part of a static layout; their rows of X are gathered into G = min(S, ``MAX_GLOBAL``) *slots* in
front of the sequence instead, and both projections run on the extended input::

    slots [B,G]  = the kept global tokens' positions in order (a prefix count of them scatters each into its slot)
    X_ext        = Concat(X at the slots, X)                                                  [B, G+S, N]
    local node   = StofSparseAttention(bs3hd, Reshape(X_ext·W + b)  [B, G+S, 3, H, D])       -> [B, G+S, H, D]
    global node  = StofSparseAttention(bs3hd, Reshape(X_ext·Wg + bg) [B, G+S, 3, H, D])      -> [B, G+S, H, D]
    Y            = Slice rows G.. of ScatterElements(local out, rows G + slot position <- global rows 0..G-1)

Both layouts are square over the G + S rows (so a shorter run-time length is their top-left corner):

* local: slot query rows 0..G-1 empty; row G+i attends the G slot columns and the band G+j, |i - j| <= W;
  key_padding_mask = [slot holds a kept global token ; kept and not global] (a global key in the band counts once);
* global: slot query rows 0..G-1 attend every real position G..G+S-1 (kept keys: key_padding_mask [· ; kept]);
  every other row is empty. Empty rows output 0 and cost no tile work (the merge reads none of them).

The projections are ``StofGemmEpilogue`` nodes (bias in the GEMM's epilogue; MatMul + Add with
``epilogues=False``); the nodes are packed whatever ``packed_qkv`` says, the op's weights being one [N, 3N]
projection already. Only [B, G, ·] tensors are gathered or indexed: the merge scatters the G slot rows of the
global output into the local output (an unused slot writes its own empty row 0..G-1, which the Slice drops).

A padded global token (mask < 0) takes no slot: it is masked as a key, and its query row is not defined by the op.
More kept global tokens than G in a sequence cannot be represented: the slot rows of X become NaN, so every local
row of that sequence is NaN (it attends every slot's NaN key and value), and so do the global rows (the slot rows
of the global output, set to NaN before the merge) — never silently wrong. With a dynamic sequence axis G is also at most 2W (the op needs S to be a multiple of 2W, so the slots
always fit a run-time length). Rows whose own mask is < 0 (padding) are not defined by the op and may differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import onnx_graphsurgeon as gs

from ..format import TileLayout, compile_mask
from ..masks import TILE_EMPTY, TILE_FULL, TILE_UNKNOWN, MaskSpec, longformer

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
    """[G+S, G+S]: slot rows empty; row G+i sees the G slot columns and the band G+j, |i - j| <= W (the band in
    extended coordinates: |(G+i) - (G+j)| = |i - j|)."""
    n = slots + seq
    spec = longformer(window, slots) & _Rect((slots, n), (0, n))
    return replace(compile_mask(spec, n, n, tile_m=tile_m, tile_n=tile_n),
                   mask_spec=f"longformer_local:window={window},slots={slots}")


def global_layout(seq: int, slots: int, tile_m: int, tile_n: int) -> TileLayout:
    """[G+S, G+S]: slot rows see every real position G..G+S-1; every other row is empty."""
    n = slots + seq
    return replace(compile_mask(_Rect((0, slots), (slots, n)), n, n, tile_m=tile_m, tile_n=tile_n),
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
            lplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=G + S, seq_k=G + S, scale=scale,
                                  layout=local, mask_source=f"LongformerAttention window {W} + {G} global token "
                                                            "slots & key padding from mask/global")
            gplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=G + S, seq_k=G + S, scale=scale,
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

            def project(weight, bias):
                """[B, G+S, 3, H, D]: X_ext·W + b, the bias in the GEMM's epilogue."""
                wv, bv = const_value(weight), const_value(bias)
                if epilogues and bv is not None and bv.size == 3 * N:
                    qkv = self.new_var("stof_lf_qkv", dtype=x.dtype)
                    w_in = weight if isinstance(weight, gs.Constant) else const("stof_lf_weight", wv)
                    b_in = bias if isinstance(bias, gs.Constant) and bv.ndim == 1 \
                        else const("stof_lf_bias", np.ascontiguousarray(bv.reshape(3 * N)))
                    gemm = gs.Node("StofGemmEpilogue", u("StofGemmEpilogue"), {"activation": "none"},
                                   [x_ext, w_in, b_in], [qkv], domain="stof")
                    self.ctx.overloads[gemm.name] = "none"
                    self.ctx.functions.add(("StofGemmEpilogue", "none"))
                    new.append(gemm)
                else:
                    qkv = op("Add", [op("MatMul", [x_ext, weight], x.dtype), bias], x.dtype)
                return op("Reshape", [qkv, i64("qkv_shape", [0, 0, 3, H, D])], x.dtype)

            emitter = AttentionEmitter(self)
            # band keys: kept and not global (a kept global key is in a slot, and counts once)
            band_keep = op("Xor", [keep, kept_g], np.bool_)
            lplan.padding_tensor = op("Concat", [slot_used, band_keep], np.bool_, axis=1)
            local_out = self.new_var("stof_lf_local", dtype=y.dtype)
            emitter.node(lplan, project(w, b), None, None, local_out, new)
            # the slot columns are outside the global layout: any value serves there
            gplan.padding_tensor = op("Concat", [slot_used, keep], np.bool_, axis=1)
            global_out = self.new_var("stof_lf_global", dtype=y.dtype)
            emitter.node(gplan, project(wg, bg), None, None, global_out, new)
            # -- merge: global rows 0..G-1 into the local output at rows G + position (an unused slot: its own
            # row j < G, which the Slice drops). ScatterElements over [B, G, H, D] indices: one thread per element
            # (ScatterND's CUDA kernel gives each [H, D] slice to one thread, ~0.4 ms at B=8).
            slot_rows = op("Slice", [global_out, i64("s0", [0]), i64("sg", [G]), i64("ax1", [1])], y.dtype)
            # NaN queries may read as an empty row to a kernel (no finite score): the NaN set here, not derived
            slot_rows = op("Where", [op("Unsqueeze", [over, i64("axis3", [3])], np.bool_), nan, slot_rows], y.dtype)
            row = op("Where", [slot_used, op("Add", [idx, i64("gofs", G)], np.int64), i64("own", np.arange(G)[None])],
                     np.int64)
            where = op("Expand", [op("Unsqueeze", [row, i64("axes23", [2, 3])], np.int64), i64("ghd", [1, 1, H, D])],
                       np.int64)
            merged = op("ScatterElements", [local_out, where, slot_rows], y.dtype, axis=1)
            # Reshape, then Slice into Y: the Slice's kernel writes the output itself (a Reshape last would make ONNX
            # Runtime copy its result into a bound output)
            merged = op("Reshape", [merged, i64("out_shape", [0, 0, N])], y.dtype)
            op("Slice", [merged, i64("sg2", [G]), i64("end", [np.iinfo(np.int64).max]), i64("ax1b", [1])],
               outputs=[y])
            info["name"] = lplan.name
            ginfo = dict(gplan.info(), anchor=node.name, global_slots=G)
            ginfo.pop("kind", None)
            self.ctx.report.attention.append(ginfo)
            return new

        return build
