"""Fuse the ONNX ``Attention`` op (opset 23) into StofSparseAttention.

Matched::

      Q [B,H,Sq,D] | [B,Sq,H·D]   K   V      attn_mask (bool: True = attend, or float: added)   (optional)
                     \\           |   /      /
                       Attention (is_causal, scale, q_num_heads, kv_num_heads)   <- anchor

Replaced by (3-D inputs are split into heads and the output merged back)::

      Q   K   V  [Reshape+Transpose for 3-D]   layout arrays   [key_padding_mask]  [attn_bias]
        \\  |  /                                    |                 |               |
        StofSparseAttention ----------------------------------------------------------'
              |   [Transpose+Reshape for 3-D]
              Y

``is_causal`` becomes a static causal layout (top-left aligned); ``attn_mask`` is classified like a graph mask
(static pattern / key padding / kept as attn_bias); opset 24's ``nonpad_kv_seqlen`` [B] becomes key padding (key k
kept iff k < length). Grouped heads (kv_num_heads < q_num_heads, or fewer K/V heads in 4-D inputs) pass K and V
with their own heads: the node reads K/V head h / (H / Hkv), as the op repeats them. Left alone: past_key/value, softcap, or when present_* /
qk_matmul_output outputs are used.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from .attention_common import (AttentionEmitter, AttentionPlan, AttentionProbe, bool_mask_bias, choose_layout,
                               from_heads, lengths_to_padding, to_heads)
from .base import Fusion, Match
from .mask_analysis import MaskTerm
from .ort_contrib import check_heads, keys_axis1


def _present(node: gs.Node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i].name != ""


class FuseOnnxAttention(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("Attention",)
    pattern = "onnx_attention"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain not in (None, "", "ai.onnx"):
            return None
        outs = self.ctx.graph_outputs
        if any(_present(node, i) for i in (4, 5)):
            self.skip(node, "past_key / past_value (KV cache) are not supported")
            return None
        if any(o.name in outs or o.outputs for o in node.outputs[1:]):
            self.skip(node, "present_key / present_value / qk_matmul_output are used")
            return None
        if node.attrs.get("softcap", 0.0):
            self.skip(node, "softcap is not supported")
            return None
        qh, kvh = node.attrs.get("q_num_heads"), node.attrs.get("kv_num_heads")
        why = check_heads(int(qh), int(kvh)) if qh is not None and kvh is not None else None
        if why:
            self.skip(node, why)
            return None
        mask = None
        if _present(node, 3):
            m = node.inputs[3]
            is_bool = m.dtype is not None and np.dtype(m.dtype) == np.dtype(bool)
            mask = MaskTerm(m.name, "allowed_bool" if is_bool else "additive")
        return Match(node, [node], lambda: [], {"node": node, "mask": mask})

    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        shapes = {t.name for m in matches for t in m.anchor.inputs[:3]}
        masks = [m.info["mask"] for m in matches if m.info["mask"] is not None]
        probe = AttentionProbe(self.ctx, self.graph, shapes, masks, set())
        kept = []
        for m in matches:
            node, term = m.anchor, m.info["mask"]
            q, k, v = node.inputs[:3]
            qs, ks, vs = probe.shape(q.name), probe.shape(k.name), probe.shape(v.name)
            if len(qs) == 4 and len(ks) == 4 and len(vs) == 4:
                _, H, sq, D = qs
                sk, split, kv = ks[2], False, ks[1]
                ok = vs[1] == kv and kv >= 1 and H % kv == 0 and ks[3] == D and vs[3] == D and vs[2] == sk
                short = (q.name, 2, k.name, 2)
            elif len(qs) == 3 and len(ks) == 3 and len(vs) == 3 and node.attrs.get("q_num_heads"):
                H = int(node.attrs["q_num_heads"])
                kv = int(node.attrs.get("kv_num_heads", H))
                _, sq, hidden = qs
                sk, D, split = ks[1], hidden // H, True
                ok = hidden % H == 0 and ks[2] == kv * D and vs[2] == kv * D and vs[1] == sk
                short = (q.name, 1, k.name, 1)
            else:
                ok = False
            if not ok:
                self.skip(node, f"Q{qs} K{ks} V{vs}: only equal head sizes and K/V heads dividing the query heads "
                                "are supported")
                continue
            scale = float(node.attrs.get("scale", 1.0 / math.sqrt(D)))
            gmask = probe.classify(term, sq, sk, H, short) if term is not None else None
            causal = np.tril(np.ones((sq, sk), bool))[None] if node.attrs.get("is_causal", 0) else None
            layout, source = choose_layout(self.ctx.options, gmask, sq, sk, H, causal, "causal (is_causal)",
                                           extra_spec="causal" if causal is not None else None, probe=probe,
                                           terms=(term,) if gmask is not None and gmask.static is not None else ())
            plan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=sq, seq_k=sk, scale=scale, layout=layout,
                                 mask_source=source,
                                 padding_input=gmask.padding_input if gmask and gmask.kind != "bias" else None)
            if gmask is not None and gmask.kind == "bias":
                plan.bias_term = term
                self.ctx.report.notes.append(f"{node.name}: attn_mask kept as attn_bias: {gmask.reason}")
            if _present(node, 6):
                if node.attrs.get("is_causal", 0):
                    # ONNX Runtime aligns the causal mask to each sequence's end there (the spec: top-left)
                    self.skip(node, "is_causal with nonpad_kv_seqlen (runtimes differ in the causal alignment)")
                    continue
                if plan.padding_input is not None:
                    self.skip(node, "both a key-padding attn_mask and nonpad_kv_seqlen: not supported")
                    continue
                plan.mask_source += " & key padding from nonpad_kv_seqlen"
                plan.padding_tensor = node.inputs[6]  # marks "has key padding" for the report
            m.info = dict(plan.info(), anchor=node.name, kv_heads=kv)
            m.build = self._builder(node, plan, split, m.info, kv)
            kept.append(m)
        return kept

    def _builder(self, node: gs.Node, plan: AttentionPlan, split: bool, info: dict, kv: int):
        q, k, v = node.inputs[:3]
        mask_t = node.inputs[3] if _present(node, 3) else None
        node_inputs = list(node.inputs)  # captured now: build() runs after the node is disconnected
        y = node.outputs[0]

        def build():
            new: list[gs.Node] = []
            emitter = AttentionEmitter(self)
            if plan.bias_term is not None:
                plan.bias = mask_t if plan.bias_term.mode == "additive" else \
                    bool_mask_bias(self, mask_t, True, -math.inf, q, new)
            if plan.padding_tensor is not None:
                seqlen = node_inputs[6]
                plan.padding_tensor = lengths_to_padding(self, seqlen, k if split else keys_axis1(self, k, new), new)
            if split:
                qq = to_heads(self, q, plan.heads, plan.head_dim, new)
                kk, vv = (to_heads(self, t, kv, plan.head_dim, new) for t in (k, v))
                out = from_heads(self, y, plan.heads * plan.head_dim, new, dtype=y.dtype)
            else:
                qq, kk, vv, out = q, k, v, y
            emitter.node(plan, qq, kk, vv, out, new)
            info["name"] = plan.name
            return new

        return build

