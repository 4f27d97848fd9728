"""Fuse ONNX Runtime's block-sparse ``SparseAttention`` (com.microsoft; Phi-3-small's attention) into
StofSparseAttention, its CSR block layout compiled into a STOF tile layout.

Matched (prompt form: the present outputs are unused, so no token is cached before the query)::

      Q [B,S,H·D]  K, V [B,S,Hkv·D]  past_key/value  block_row_indices [L, nb+1]  block_col_indices [L, nnz]
              \\        |                  |                      (constants)
           SparseAttention (num_heads, kv_num_heads, sparse_block_size bs, scale)   <- anchor
                 total_sequence_length, key_total_sequence_lengths [B]

Replaced by Q, K, V -> heads (K/V repeated to H heads) -> StofSparseAttention -> merged heads -> Y, with
key_padding_mask = (k < key_total_sequence_lengths). Layout: block (q // bs, k // bs) of pattern h % L allowed,
and causal inside (the op's semantics); per-head patterns become per-head STOF layouts.

Sequence length: the block table (nb + 1 row pointers, block bs) is the operator's own limit, nb·bs tokens; a model
with a dynamic sequence axis and no max_seq_len is compiled for it (attention_common.compiled_length,
``_op_seq_limit``) and keeps it as stof.max_seq_len. Its nodes carry no layout_spec: the vertical stride (every
stride-th block column, its phase per layout) and per-layout patterns have no closed-form spec, and past nb·bs the
operator has no layout to grow.

ONNX Runtime runs SparseAttention on CUDA only; tests/test_rewrite_ort_ops.py checks the rewritten model against a
float64 reference of these semantics. Left alone: packed QKV, rotary, block indices that are not constants, used
present outputs. With unused presents the past buffers are taken to hold no tokens (total_sequence_length = S):
a model that caches keys exposes its presents.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import StofError
from ..format import TileLayout, compile_mask

from .attention_common import AttentionPlan, choose_layout, lengths_to_padding
from .base import Fusion, Match
from .matcher import const_value
from .ort_contrib import (ORT_DOMAIN, check_heads, emit_grouped_node, csr_block_mask, layout_per_head, outputs_used,
                          present, tensor_shapes)


def block_causal_dense(blocks: np.ndarray, block: int, seq: int) -> np.ndarray:
    """bool [L, S, S]: the block mask expanded to tokens, cut to S and intersected with causal."""
    nb = blocks.shape[1]
    if nb * block < seq:
        raise StofError(f"the block layout covers {nb * block} tokens, fewer than the sequence length {seq}")
    idx = np.arange(seq) // block
    dense = blocks[:, idx][:, :, idx]
    return dense & np.tril(np.ones((seq, seq), bool))[None]


def block_causal_layout(blocks: np.ndarray, block: int, seq: int, tile_m: int, tile_n: int, heads: int) -> TileLayout:
    """``block_causal_dense`` as a tile layout of 1 or ``heads`` layouts, compiled from the block grid (a blocks ∧
    causal spec: no [L, S, S] array, so a Phi-3-small table at 8192 tokens compiles in a few ms, not seconds)."""
    from ..masks import BlockLayout, Causal, Intersection

    nb = blocks.shape[1]
    if nb * block < seq:
        raise StofError(f"the block layout covers {nb * block} tokens, fewer than the sequence length {seq}")
    grid = BlockLayout(blocks if blocks.shape[0] > 1 else blocks[0], block, source="SparseAttention")
    lay = compile_mask(Intersection((grid, Causal())), seq, seq, tile_m=tile_m, tile_n=tile_n, num_heads=heads)
    return layout_per_head(dataclasses.replace(lay, mask_spec="graph"), heads)


class FuseOrtSparseAttention(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("SparseAttention",)
    pattern = "ort_sparse_attention"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        if not (present(node, 1) and present(node, 2)):
            self.skip(node, "packed QKV (no separate key and value inputs) is not supported")
            return None
        if node.attrs.get("do_rotary", 0) or present(node, 9) or present(node, 10):
            self.skip(node, "rotary embedding inside the op is not supported")
            return None
        if outputs_used(self, node):
            self.skip(node, "present_key / present_value outputs are used (KV cache)")
            return None
        rows, cols = (const_value(node.inputs[i]) if present(node, i) else None for i in (5, 6))
        if rows is None or cols is None:
            self.skip(node, "block_row_indices / block_col_indices are not constants")
            return None
        H, kv = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
        why = check_heads(H, kv)
        if why:
            self.skip(node, why)
            return None
        try:
            blocks = csr_block_mask(rows, cols)
        except StofError as exc:
            self.skip(node, str(exc))
            return None
        if H % blocks.shape[0]:
            self.skip(node, f"{blocks.shape[0]} block layouts do not divide {H} heads")
            return None
        return Match(node, [node], lambda: [], {"heads": H, "kv_heads": kv, "blocks": blocks,
                                                "block": int(node.attrs["sparse_block_size"])})

    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        opts = self.ctx.options
        if opts.get("max_seq_len") is None and "_compiled_seq" not in opts:
            # the block table is the op's own length limit: a dynamic model is compiled for it, not for the default
            nb, bs = min(((m.info["blocks"].shape[1], m.info["block"]) for m in matches), key=lambda x: x[0] * x[1])
            opts["_op_seq_limit"] = (nb * bs, f"SparseAttention's block layout covers {nb} blocks of {bs} tokens")
        shapes = tensor_shapes(self, {t.name for m in matches for t in m.anchor.inputs[:3]})
        kept, compiled = [], {}
        for m in matches:
            node, H, kv, blocks, bs = m.anchor, m.info["heads"], m.info["kv_heads"], m.info["blocks"], m.info["block"]
            qs, ks, vs = (shapes[t.name] for t in node.inputs[:3])
            if len(qs) != 3 or len(ks) != 3 or ks != vs or qs[2] % H or ks[1] != qs[1] \
                    or ks[2] * H != qs[2] * kv:
                self.skip(node, f"Q{qs} K{ks} V{vs}: expected [B,S,H·D] and [B,S,Hkv·D] of one length")
                continue
            S, D = qs[1], qs[2] // H
            what = f"SparseAttention blocks ({blocks.shape[0]} layout(s), block {bs}) & causal"
            tm, tn = self.ctx.options["tile_m"], self.ctx.options["tile_n"]
            try:
                if self.ctx.options.get("mask") is None:   # one compile per distinct table (the layers share one)
                    key = (blocks.shape, blocks.tobytes(), bs, S, tm, tn, H)
                    if key not in compiled:
                        compiled[key] = block_causal_layout(blocks, bs, S, tm, tn, H)
                    layout, dense = compiled[key], None
                else:
                    dense = block_causal_dense(blocks, bs, S)
            except StofError as exc:
                self.skip(node, str(exc))
                continue
            if dense is None:
                source = what
            else:
                if dense.shape[0] not in (1, H):
                    dense = dense[np.arange(H) % dense.shape[0]]
                layout, source = choose_layout(self.ctx.options, None, S, S, H, dense, what)
            scale = float(node.attrs.get("scale", 0.0) or 1.0 / math.sqrt(D))
            plan = AttentionPlan(name=node.name, heads=H, head_dim=D, seq_q=S, seq_k=S, scale=scale, layout=layout,
                                 mask_source=source + " & key padding from key_total_sequence_lengths",
                                 padding_tensor=node.inputs[8])
            info = dict(plan.info(), anchor=node.name, kv_heads=kv, sparse_block_size=bs)
            m.build = self._builder(node, plan, kv, info)
            m.info = info
            kept.append(m)
        return kept

    def _builder(self, node: gs.Node, plan: AttentionPlan, kv: int, info: dict):
        q, k, v, lengths = node.inputs[0], node.inputs[1], node.inputs[2], node.inputs[8]
        y = node.outputs[0]

        def build():
            new: list[gs.Node] = []
            plan.padding_tensor = lengths_to_padding(self, lengths, k, new)
            emit_grouped_node(self, plan, q, k, v, y, kv, new)
            info["name"] = plan.name
            return new

        return build
