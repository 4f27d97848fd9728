"""Optional (``rewrite_model(dense_attention="ort")``): hand attention with no sparsity back to ONNX Runtime.

A StofSparseAttention node whose layout is dense (every (query, key) pair allowed: no mask, or a key-padding mask
only) has nothing for the sparse kernels to skip; ONNX Runtime's contrib ``Attention`` op (com.microsoft) runs
exactly that case with its fused kernels (cuDNN / flash attention on the CUDA EP, with the padding as
``mask_index``). Matched (what FusePackedQkv emits)::

    X --StofGemmEpilogue(W, b, "none")--Reshape[B,S,3,H,D]--StofSparseAttention(bs3hd, dense layout)--> Y [B,S,H,D]

Replaced by ``com.microsoft.Attention(X, W, b, [key_padding_mask]) -> Reshape[B,S,H,D] -> Y`` with the node's
scale. The model then needs ONNX Runtime (CPU or CUDA) for those nodes; masked (sparse) attention stays STOF.
Off by default: the user chooses (``stof rewrite`` keeps every attention on the STOF kernels unless asked).
Only packed attention is matched (``packed_qkv=True`` and, for the GEMM, ``epilogues=True``): rewrite_model
notes in the report any attention with no sparsity that stays on STOF.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Fusion, Match
from .matcher import producer, single_consumer

ORT_DOMAIN = "com.microsoft"


def no_sparsity(info: dict) -> bool:
    """The report entry of an attention node with nothing to skip: every tile FULL and no bias. Exact tile counts:
    the entry's ``density`` is rounded, so a few disallowed pairs in a long sequence read as 1.0 there (and ORT's
    Attention would drop them)."""
    tiles = info.get("tile_classes") or {}
    return not (tiles.get("empty", 1) or tiles.get("partial", 1) or info.get("attn_bias"))


class FuseDenseOrtAttention(Fusion):
    fused_op_type = "Attention"
    search_op_types = ("StofSparseAttention",)
    pattern = "dense_attention_to_ort"

    def fuse(self, node: gs.Node) -> Match | None:
        fmt = node.attrs.get("qkv_format", "bhsd")
        if node.domain != "stof" or fmt not in ("bs3hd", b"bs3hd"):
            return None
        info = {a.get("name"): a for a in self.ctx.report.attention}.get(node.name)
        if info is None or not no_sparsity(info):
            return None  # a static sparsity pattern (or a bias): the STOF kernels' case
        if len(node.inputs) > 8 and node.inputs[8].name:
            return None
        outs = self.ctx.graph_outputs
        reshape = producer(node.inputs[0])
        if reshape is None or reshape.op != "Reshape" or single_consumer(node.inputs[0], outs) is not node:
            return None
        gemm = producer(reshape.inputs[0])
        if gemm is None or gemm.op != "StofGemmEpilogue" or gemm.attrs.get("activation") not in ("none", b"none") \
                or single_consumer(reshape.inputs[0], outs) is not reshape:
            return None
        x, w, b = gemm.inputs
        H, D = int(info["heads"]), int(info["head_dim"])
        if not isinstance(w, gs.Constant) or tuple(w.shape)[-1] != 3 * H * D:
            return None
        kpm = node.inputs[7] if len(node.inputs) > 7 and node.inputs[7].name else None
        y = node.outputs[0]
        scale = float(node.attrs["scale"])

        def build() -> list[gs.Node]:
            hidden = self.new_var("stof_ort_attention_out", dtype=x.dtype)
            ins = [x, w, b] + ([kpm] if kpm is not None else [])
            att = gs.Node("Attention", self.ctx.unique("ort_Attention"), {"num_heads": H, "scale": scale}, ins,
                          [hidden], domain=ORT_DOMAIN)
            shape = self.new_const("stof_heads_shape", np.array([0, 0, H, D], np.int64))
            r = gs.Node("Reshape", self.ctx.unique("stof_ort_attention_heads"), {}, [hidden, shape], [y])
            return [att, r]

        return Match(node, [node, reshape, gemm], build,
                     {"name": node.name, "heads": H, "head_dim": D, "padding": kpm is not None})

    def apply(self) -> int:
        n = super().apply()
        if n:  # functions only the replaced nodes used are dropped
            used = {(nd.op, self.ctx.overloads.get(nd.name, "")) for nd in self.graph.nodes if nd.domain == "stof"}
            self.ctx.functions &= used
        return n
