"""Fuse ONNX Runtime's ``LongformerAttention`` (com.microsoft, CUDA-only) into two StofSparseAttention nodes.

Matched::

      X [B,S,N]  W, b (local QKV)  mask [B,S] (< 0 = masked)  Wg, bg (global QKV)  global [B,S] (1 = global token)
                          \\                  |                       |                  |
                     LongformerAttention (num_heads H, window W)   <- anchor

The op's semantics: a local query row i attends to keys |i - j| <= W and to every global key (local Q, K, V); a
global query row attends to every key with the global projections. The global positions are a run-time input, so
they cannot be part of a static layout; they are gathered instead (G = min(S, ``MAX_GLOBAL``) slots, in position
order, found with TopK):

* local node: keys = [K at the G global positions ; K] (Sk = G + S), static layout = G full columns | band |i-j| <= W
  on the rest; key_padding_mask = [slot holds a global, unmasked key ; unmasked and not global] (so a global key in
  the band counts once);
* global node: queries = global Q at the G positions, keys = global K (all S), full G x S layout, key padding = mask;
* output: row i = the global node's slot for i if i is global, else the local node's row i.

More than G global tokens in a sequence cannot be represented: that sequence's output is NaN (never silently
wrong). With a dynamic sequence axis G is also at most 2W (the op needs S to be a multiple of 2W, so the slots
always fit a run-time length). Rows whose own mask is < 0 (padding) are not defined by the op and may differ.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from ..format import TileLayout

from .attention_common import AttentionEmitter, AttentionPlan, from_heads, to_heads
from .base import Fusion, Match
from .matcher import const_value
from .ort_contrib import ORT_DOMAIN, present, tensor_shapes

#: Global tokens per sequence the rewritten model represents (one tile row of slots at the default tile size).
MAX_GLOBAL = 64


def local_layout_mask(seq: int, slots: int, window: int) -> np.ndarray:
    """bool [1, S, G + S]: the G gathered global columns, then the band |i - j| <= W."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return np.concatenate([np.ones((seq, slots), bool), np.abs(i - j) <= window], axis=1)[None]


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
            if declared is None or len(declared) != 3 or not isinstance(declared[1], (int, np.integer)):
                # the slot count is fixed in the graph; the op needs S to be a multiple of 2W, so 2W slots always fit
                G = max(1, min(G, 2 * W))
                self.ctx.report.notes.append(f"{node.name}: dynamic sequence length: {G} global token slots "
                                             "(at most 2·window)")
            scale = 1.0 / math.sqrt(D)
            local = TileLayout.from_dense(local_layout_mask(S, G, W), tm, tn, mask_spec=f"longformer:window={W}")
            full = TileLayout.from_dense(np.ones((1, G, S), bool), tm, tn, mask_spec="full")
            lplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=S, seq_k=G + S, scale=scale,
                                  layout=local, mask_source=f"LongformerAttention window {W} + {G} global key slots "
                                                            "& key padding from mask/global")
            gplan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=G, seq_k=S, scale=scale, layout=full,
                                  mask_source="LongformerAttention global rows & key padding from mask")
            info = dict(lplan.info(), anchor=node.name, window=W, global_slots=G, key_padding=True)
            m.build = self._builder(node, lplan, gplan, S, G, N, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node, lplan: AttentionPlan, gplan: AttentionPlan, S: int, G: int, N: int, info: dict):
        x, w, b, mask, wg, bg, glob = node.inputs[:7]
        y = node.outputs[0]

        def build():
            new: list[gs.Node] = []
            u = self.ctx.unique
            var = self.new_var
            const = self.new_const

            def op(kind, inputs, dtype=None, n_out=1, **attrs):
                outs = [var(f"stof_lf_{kind.lower()}", dtype=dtype) for _ in range(n_out)]
                new.append(gs.Node(kind, u(f"stof_lf_{kind.lower()}"), attrs, inputs, outs))
                return outs[0] if n_out == 1 else outs

            def project(weight, bias):
                qkv = op("Add", [op("MatMul", [x, weight], x.dtype), bias], x.dtype)
                split = const("stof_lf_split", np.array([N] * 3, np.int64))
                return op("Split", [qkv, split], x.dtype, n_out=3, axis=-1)

            q, k, v = project(w, b)
            qg, kg, vg = project(wg, bg)
            keep = op("Not", [op("Less", [mask, op("CastLike", [const("stof_zero", np.zeros((), np.float32)), mask])],
                                 np.bool_)], np.bool_)
            is_g = op("Cast", [glob], np.bool_, to=9)
            g64 = op("Cast", [is_g], np.int64, to=7)
            # global positions first, in position order: score = global * 2^23 - position (exact in float32)
            seq = op("Squeeze", [op("Shape", [glob], np.int64, start=1, end=2),
                                 const("stof_lf_axis0", np.array([0], np.int64))], np.int64)
            pos = op("Cast", [op("Range", [const("stof_lf_zero0", np.array(0, np.int64)), seq,
                                           const("stof_lf_step", np.array(1, np.int64))], np.int64)], np.float32, to=1)
            score = op("Sub", [op("Mul", [op("Cast", [is_g], np.float32, to=1),
                                          const("stof_lf_big", np.array(2.0 ** 23, np.float32))], np.float32),
                               pos], np.float32)
            _, idx = op("TopK", [score, const("stof_lf_g", np.array([G], np.int64))], n_out=2, axis=1, largest=1,
                        sorted=1)
            idx.dtype = np.int64
            count = op("ReduceSum", [g64, const("stof_lf_axis1", np.array([1], np.int64))], np.int64, keepdims=1)
            slot_used = op("Less", [const("stof_lf_slots", np.arange(G, dtype=np.int64)[None]), count], np.bool_)
            slot_keep = op("And", [slot_used, op("GatherElements", [keep, idx], np.bool_, axis=1)], np.bool_)
            band_keep = op("And", [keep, op("Not", [is_g], np.bool_)], np.bool_)
            local_kpm = op("Concat", [slot_keep, band_keep], np.bool_, axis=1)
            idx3 = op("Expand", [op("Unsqueeze", [idx, const("stof_lf_axis2", np.array([2], np.int64))], np.int64),
                                 const("stof_lf_bgn", np.array([1, 1, N], np.int64))], np.int64)

            def gather(t):
                return op("GatherElements", [t, idx3], x.dtype, axis=1)

            k_loc = op("Concat", [gather(k), k], x.dtype, axis=1)
            v_loc = op("Concat", [gather(v), v], x.dtype, axis=1)
            emitter = AttentionEmitter(self)
            H, D = lplan.heads, lplan.head_dim
            local_out = var("stof_lf_local", dtype=y.dtype)
            lplan.padding_tensor = local_kpm
            emitter.node(lplan, *(to_heads(self, t, H, D, new) for t in (q, k_loc, v_loc)),
                         from_heads(self, local_out, N, new, dtype=y.dtype), new)
            global_out = var("stof_lf_global", dtype=y.dtype)
            gplan.padding_tensor = keep
            emitter.node(gplan, *(to_heads(self, t, H, D, new) for t in (gather(qg), kg, vg)),
                         from_heads(self, global_out, N, new, dtype=y.dtype), new)
            # row i of the global output: slot rank(i) = (number of global tokens up to i) - 1
            rank = op("Sub", [op("CumSum", [g64, const("stof_lf_axis1s", np.array(1, np.int64))], np.int64),
                              const("stof_lf_one", np.array(1, np.int64))], np.int64)
            rank = op("Min", [op("Max", [rank, const("stof_lf_zero", np.array(0, np.int64))], np.int64),
                              const("stof_lf_gmax", np.array(G - 1, np.int64))], np.int64)
            rank3 = op("Expand", [op("Unsqueeze", [rank, const("stof_lf_axis2b", np.array([2], np.int64))], np.int64),
                                  const("stof_lf_bsn", np.array([1, 1, N], np.int64))], np.int64)
            back = op("GatherElements", [global_out, rank3], y.dtype, axis=1)
            is_g3 = op("Unsqueeze", [is_g, const("stof_lf_axis2c", np.array([2], np.int64))], np.bool_)
            merged = op("Where", [is_g3, back, local_out], y.dtype)
            # more global tokens than slots: NaN for that sequence, never a silently wrong row
            over = op("Unsqueeze", [op("Greater", [count, const("stof_lf_gcap", np.array(G, np.int64))], np.bool_),
                                    const("stof_lf_axis2d", np.array([2], np.int64))], np.bool_)
            nan = op("CastLike", [const("stof_lf_nan", np.array(np.nan, np.float32)), merged], y.dtype)
            new.append(gs.Node("Where", u("stof_lf_overflow"), {}, [over, nan, merged], [y]))
            info["name"] = lplan.name
            ginfo = dict(gplan.info(), anchor=node.name)
            ginfo.pop("kind", None)
            self.ctx.report.attention.append(ginfo)
            return new

        return build
