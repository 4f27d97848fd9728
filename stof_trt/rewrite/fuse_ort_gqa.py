"""Fuse ONNX Runtime's ``GroupQueryAttention`` (com.microsoft, from its model builder / transformers optimizer) into
StofSparseAttention, its causal sliding window (``local_window_size``) as a static tile layout.

Matched (prompt form: no KV cache)::

      Q [B,S,H·D]   K [B,S,Hkv·D]   V [B,S,Hkv·D]   seqlens_k [B] (key length - 1)   total_sequence_length
              \\          |              |                |
           GroupQueryAttention (num_heads H, kv_num_heads Hkv, local_window_size W, scale)   <- anchor

Replaced by::

      Q, K, V -> Reshape + Transpose -> [K, V: repeat the Hkv heads to H] -> StofSparseAttention -> Transpose +
      Reshape -> Y          key_padding_mask = (k < seqlens_k + 1)

Layout: causal, and with W > 0 query i sees keys i-W+1 .. i (W keys, itself included — ONNX Runtime's CPU kernel,
checked by tests/test_rewrite_ort_ops.py); the node's layout_spec is that window (``window_spec``), so a model
with a dynamic sequence axis runs at any length. Query rows past a sequence's length are padding; their output is
not defined by the op and may differ. Left alone: past_key / past_value (KV cache), packed QKV (no key input), rotary
inside the op, softcap, smooth_softmax, position_ids / attention_bias / head_sink inputs, used present outputs.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from .attention_common import AttentionPlan, choose_layout, lengths_to_padding
from .base import Fusion, Match
from .ort_contrib import ORT_DOMAIN, check_heads, emit_grouped_node, outputs_used, present, tensor_shapes


def window_spec(window: int) -> str:
    """The closed-form spec of ``sliding_causal`` at every length (the node's layout_spec): causal, or the W keys
    i-W+1 .. i (canonical spelling, as the node carries it)."""
    from ..masks import parse_mask

    return str(parse_mask("causal" if window <= 0 else f"sliding:left={window - 1},right=0"))


def sliding_causal(seq: int, window: int) -> np.ndarray:
    """bool [1, S, S]: key j allowed for query i iff j <= i and (window <= 0 or i - j < window)."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = j <= i
    if window > 0:
        allowed &= (i - j) < window
    return allowed[None]


class FuseOrtGroupQueryAttention(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("GroupQueryAttention",)
    pattern = "ort_group_query_attention"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        if not (present(node, 1) and present(node, 2)):
            self.skip(node, "packed QKV (no separate key and value inputs) is not supported")
            return None
        if present(node, 3) or present(node, 4):
            self.skip(node, "past_key / past_value (KV cache) are not supported")
            return None
        if any(present(node, i) for i in range(7, len(node.inputs))):
            self.skip(node, "cos/sin cache, position_ids, attention_bias or head_sink inputs are not supported")
            return None
        for attr in ("do_rotary", "softcap", "smooth_softmax", "qk_output"):
            if node.attrs.get(attr, 0):
                self.skip(node, f"{attr} is not supported")
                return None
        if outputs_used(self, node):
            self.skip(node, "present_key / present_value outputs are used")
            return None
        if not present(node, 5):
            self.skip(node, "seqlens_k is missing")
            return None
        H, kv = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
        why = check_heads(H, kv)
        if why:
            self.skip(node, why)
            return None
        return Match(node, [node], lambda: [], {"heads": H, "kv_heads": kv})

    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        shapes = tensor_shapes(self, {t.name for m in matches for t in m.anchor.inputs[:3]})
        kept = []
        for m in matches:
            node, H, kv = m.anchor, m.info["heads"], m.info["kv_heads"]
            qs, ks, vs = (shapes[t.name] for t in node.inputs[:3])
            if len(qs) != 3 or len(ks) != 3 or ks != vs or qs[2] % H or ks[1] != qs[1] \
                    or ks[2] * H != qs[2] * kv:
                self.skip(node, f"Q{qs} K{ks} V{vs}: expected [B,S,H·D] and [B,S,Hkv·D] of one length")
                continue
            S, D = qs[1], qs[2] // H
            window = int(node.attrs.get("local_window_size", -1))
            scale = float(node.attrs.get("scale", 0.0) or 1.0 / math.sqrt(D))
            what = f"causal, local_window_size {window}" if window > 0 else "causal"
            layout, source = choose_layout(self.ctx.options, None, S, S, H, sliding_causal(S, window), what,
                                           extra_spec=window_spec(window))
            source += " & key padding from seqlens_k"
            plan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=S, seq_k=S, scale=scale, layout=layout,
                                 mask_source=source, padding_tensor=node.inputs[5])
            info = dict(plan.info(), anchor=node.name, kv_heads=kv, local_window_size=window)
            m.build = self._builder(node, plan, kv, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node: gs.Node, plan: AttentionPlan, kv: int, info: dict):
        q, k, v, seqlens = node.inputs[0], node.inputs[1], node.inputs[2], node.inputs[5]
        y = node.outputs[0]

        def build():
            new: list[gs.Node] = []
            lengths = self.new_var("stof_gqa_lengths", dtype=np.int32)
            one = self.new_const("stof_one_i32", np.array(1, np.int32))
            new.append(gs.Node("Add", self.ctx.unique("stof_gqa_lengths"), {}, [seqlens, one], [lengths]))
            plan.padding_tensor = lengths_to_padding(self, lengths, k, new)
            emit_grouped_node(self, plan, q, k, v, y, kv, new)
            info["name"] = plan.name
            return new

        return build
