"""Fuse ONNX Runtime's contrib ``Attention`` and ``MultiHeadAttention`` (com.microsoft, as written by
onnxruntime.transformers.optimizer) into StofSparseAttention.

Attention (packed QKV projection inside the op)::

      X [B,S,Hin]   W [Hin, 3·H·D]   bias [3·H·D]   mask_index ([B] lengths | [B,S] 0/1)   attention_bias
              \\          |             |                |                                  |
                 Attention (num_heads, unidirectional, scale)   <- anchor

  becomes  MatMul(X, W) + bias -> Split -> 3 x (Reshape + Transpose) -> StofSparseAttention ->
           Transpose + Reshape -> Y

MultiHeadAttention (separate Q, K, V [B,S,H·D], optional packed bias)::

      Q   K   V   bias [3·H·D]   key_padding_mask ([B] lengths | [B,L] 0/1)   attention_bias
        \\ | /      |                  |                                           |
        MultiHeadAttention (num_heads, unidirectional, scale)   <- anchor

  becomes  (Q, K, V) + bias slices -> Reshape + Transpose -> StofSparseAttention -> Transpose + Reshape -> Y

Key lengths become a [B, Sk] key padding mask (key k kept iff k < length), a 2-D mask is used directly,
``unidirectional`` becomes a static causal layout (top-left aligned: no past), ``attention_bias`` becomes
attn_bias. The node's layout_spec is ``causal`` or ``full``, so a model with a dynamic sequence axis runs at any
length. Left alone: past / present (KV cache), rotary, packed K/V formats, other mask_index formats, unequal
qkv_hidden_sizes.
Legend: B batch, S/L query/key length, H heads, D head dim.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from .attention_common import (AttentionEmitter, AttentionPlan, AttentionProbe, choose_layout, from_heads,
                               lengths_to_padding, to_heads)
from .base import Fusion, Match
from .matcher import const_value

ORT_DOMAIN = "com.microsoft"


def _present(node: gs.Node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i].name != ""


class _OrtAttentionBase(Fusion):
    fused_op_type = "StofSparseAttention"
    #: input indices: (mask, attention_bias, unsupported optional inputs)
    MASK_INPUT: int
    BIAS_INPUT: int
    UNSUPPORTED_INPUTS: tuple[int, ...]

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        outs = self.ctx.graph_outputs
        if any(_present(node, i) for i in self.UNSUPPORTED_INPUTS):
            self.skip(node, "past / present state (KV cache) inputs are not supported")
            return None
        if any(o.name in outs or o.outputs for o in node.outputs[1:]):
            self.skip(node, "present / qk outputs are used")
            return None
        if node.attrs.get("do_rotary", 0):
            self.skip(node, "rotary embedding inside the op is not supported")
            return None
        return self.match(node)

    def match(self, node: gs.Node) -> Match | None:
        raise NotImplementedError

    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        shapes = {n for m in matches for n in m.info["shape_names"]}
        probe = AttentionProbe(self.ctx, self.graph, shapes, [], set())
        kept = []
        for m in matches:
            node, H, hidden = m.anchor, m.info["heads"], m.info["hidden"]
            qs, ks = probe.shape(m.info["q_shape"]), probe.shape(m.info["k_shape"])
            vs = probe.shape(m.info["v_shape"]) if m.info.get("v_shape") else qs
            if len(qs) != 3 or len(ks) != 3 or len(vs) != 3:
                self.skip(node, f"inputs of rank {len(qs)} / {len(ks)}: only [B, S, hidden] is supported")
                continue
            if hidden is None:  # MultiHeadAttention: from the run-time shapes
                hidden = qs[2]
                if ks[2] != hidden or vs[2] != hidden or hidden % H:
                    self.skip(node, f"Q{qs} K{ks} V{vs}: only equal hidden sizes divisible by num_heads are "
                                    "supported")
                    continue
                m.info["hidden"] = hidden
            B, sq, sk, D = qs[0], qs[1], ks[1], hidden // H
            padding = None
            if _present(node, self.MASK_INPUT):
                mshape = probe.shape(node.inputs[self.MASK_INPUT].name)
                if mshape == (B,):
                    padding = "lengths"
                elif mshape == (B, sk):
                    padding = "mask2d"
                else:
                    self.skip(node, f"mask of shape {mshape}: only [B] key lengths or a [B, Sk] mask are supported")
                    continue
            scale = float(node.attrs.get("scale", 0.0) or 1.0 / math.sqrt(D))
            causal = np.tril(np.ones((sq, sk), bool))[None] if node.attrs.get("unidirectional", 0) else None
            layout, source = choose_layout(self.ctx.options, None, sq, sk, H, causal, "causal (unidirectional)",
                                           extra_spec="causal" if causal is not None else None)
            if padding:
                what = "key padding from " + ("[B] key lengths" if padding == "lengths" else "a 2-D [B, Sk] mask")
                source = what if source.startswith("none") else f"{source} & {what}"
            has_bias = _present(node, self.BIAS_INPUT)
            plan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=sq, seq_k=sk, scale=scale,
                                 layout=layout, mask_source=source,
                                 bias=node.inputs[self.BIAS_INPUT] if has_bias else None)
            if padding:
                plan.padding_tensor = node.inputs[self.MASK_INPUT]  # marks "has key padding" for the report
            info = dict(plan.info(), anchor=node.name)
            m.build = self._builder(node, plan, padding, m.info, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node, plan, padding, match_info, info):
        mask_t = node.inputs[self.MASK_INPUT] if padding else None
        y = node.outputs[0]
        ins = list(node.inputs)  # captured now: build() runs after the node is disconnected

        def build():
            new: list[gs.Node] = []
            q, k, v = self.project(ins, match_info, new)
            if padding == "lengths":  # one conversion per lengths tensor, shared by the layers
                cache = self.ctx.options.setdefault("_attention_cache", {}).setdefault("lengths", {})
                if mask_t.name not in cache:
                    cache[mask_t.name] = lengths_to_padding(self, mask_t, k, new)
                plan.padding_tensor = cache[mask_t.name]
            elif padding == "mask2d":
                plan.padding_tensor = mask_t
            qq, kk, vv = (to_heads(self, t, plan.heads, plan.head_dim, new) for t in (q, k, v))
            out = from_heads(self, y, plan.heads * plan.head_dim, new, dtype=y.dtype)
            AttentionEmitter(self).node(plan, qq, kk, vv, out, new)
            info["name"] = plan.name
            return new

        return build

    def project(self, ins: list[gs.Tensor], info, new) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor]:
        """Q, K, V [B, S, H·D] from the op's inputs ``ins`` (new nodes appended to ``new``)."""
        raise NotImplementedError


class FuseOrtAttention(_OrtAttentionBase):
    search_op_types = ("Attention",)
    pattern = "ort_attention"
    MASK_INPUT, BIAS_INPUT, UNSUPPORTED_INPUTS = 3, 5, (4, 6)

    def match(self, node):
        W = const_value(node.inputs[1])
        sizes = list(node.attrs.get("qkv_hidden_sizes", []))
        if W is None or W.ndim != 2 or W.shape[1] % 3:
            self.skip(node, "packed QKV weights are not a constant [Hin, 3·hidden] matrix")
            return None
        hidden = W.shape[1] // 3
        if sizes and len(set(sizes)) != 1:
            self.skip(node, f"unequal qkv_hidden_sizes {sizes} are not supported")
            return None
        H = int(node.attrs["num_heads"])
        if hidden % H:
            self.skip(node, f"hidden {hidden} is not a multiple of num_heads {H}")
            return None
        x = node.inputs[0]
        return Match(node, [node], lambda: [], {"heads": H, "hidden": hidden, "q_shape": x.name, "k_shape": x.name,
                                                "shape_names": [x.name] + ([node.inputs[3].name]
                                                                           if _present(node, 3) else [])})

    def project(self, ins, info, new):
        x, w = ins[0], ins[1]
        hidden = info["hidden"]
        qkv = self.new_var("stof_qkv", dtype=x.dtype)
        new.append(gs.Node("MatMul", self.ctx.unique("stof_qkv_matmul"), {}, [x, w], [qkv]))
        if len(ins) > 2 and ins[2].name:
            qkvb = self.new_var("stof_qkv_bias", dtype=x.dtype)
            new.append(gs.Node("Add", self.ctx.unique("stof_qkv_add"), {}, [qkv, ins[2]], [qkvb]))
            qkv = qkvb
        parts = [self.new_var(f"stof_{p}", dtype=x.dtype) for p in "qkv"]
        split = self.new_const("stof_qkv_split", np.array([hidden] * 3, np.int64))
        new.append(gs.Node("Split", self.ctx.unique("stof_qkv_split"), {"axis": -1}, [qkv, split], parts))
        return tuple(parts)


class FuseOrtMultiHeadAttention(_OrtAttentionBase):
    search_op_types = ("MultiHeadAttention",)
    pattern = "ort_multihead_attention"
    MASK_INPUT, BIAS_INPUT, UNSUPPORTED_INPUTS = 4, 5, (6, 7, 8, 9)

    def match(self, node):
        if not (_present(node, 1) and _present(node, 2)):
            self.skip(node, "packed QKV / KV formats (no separate key and value) are not supported")
            return None
        H = int(node.attrs["num_heads"])
        bias = const_value(node.inputs[3]) if _present(node, 3) else None
        if _present(node, 3) and (bias is None or bias.ndim != 1 or bias.size % 3):
            self.skip(node, "the packed bias is not a constant [3·hidden] vector")
            return None
        q, k, v = node.inputs[:3]
        names = [q.name, k.name, v.name] + ([node.inputs[4].name] if _present(node, 4) else [])
        info = {"heads": H, "hidden": None, "bias": bias, "q_shape": q.name, "k_shape": k.name,
                "v_shape": v.name, "shape_names": names}
        return Match(node, [node], lambda: [], info)

    def project(self, ins, info, new):
        q, k, v = ins[:3]
        if info["bias"] is None:
            return q, k, v
        hidden = info["hidden"]
        out = []
        for i, t in enumerate((q, k, v)):
            b = self.new_const(f"stof_mha_bias_{'qkv'[i]}", np.ascontiguousarray(info["bias"][i * hidden:(i + 1) * hidden]))
            r = self.new_var(f"stof_{'qkv'[i]}_biased", dtype=t.dtype)
            new.append(gs.Node("Add", self.ctx.unique("stof_mha_bias"), {}, [t, b], [r]))
            out.append(r)
        return tuple(out)
