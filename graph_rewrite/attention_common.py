"""Pieces shared by the attention fusions: layout choice, layout initializers, key padding, node creation."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from stof_trt.errors import StofError
from stof_trt.format import TileLayout, compile_mask

from .base import Fusion
from .functions import attention_overload
from .mask_analysis import GraphMask

FORMAT_VERSION = 1


@dataclasses.dataclass
class AttentionPlan:
    """Everything needed to emit one StofSparseAttention node."""

    name: str
    heads: int
    head_dim: int
    seq_q: int
    seq_k: int
    scale: float
    layout: TileLayout
    mask_source: str
    padding_input: str | None = None      # graph input to derive key_padding_mask from (Cast to int32)
    padding_tensor: gs.Tensor | None = None  # an existing [B, Sk] tensor to use as key_padding_mask (Cast to int32)
    bias: gs.Tensor | None = None
    bias_term: object | None = None       # the graph mask to turn into ``bias`` when the node is built

    def info(self) -> dict:
        lay = self.layout
        return {"kind": "attention", "name": self.name, "heads": self.heads, "head_dim": self.head_dim,
                "seq_q": self.seq_q, "seq_k": self.seq_k, "scale": self.scale, "mask_source": self.mask_source,
                "num_layouts": lay.num_layouts, "tile": [lay.tile_m, lay.tile_n],
                "density": round(float(lay.density()), 6), "tile_density": round(float(lay.tile_density()), 6),
                "tile_classes": lay.class_counts(), "layout_signature": lay.signature(),
                "key_padding": bool(self.padding_input or self.padding_tensor is not None),
                "attn_bias": self.bias is not None or self.bias_term is not None}


def choose_layout(options: dict, graph_mask: GraphMask | None, sq: int, sk: int, heads: int,
                  extra_static: np.ndarray | None = None, extra_name: str = "") -> tuple[TileLayout, str]:
    """The static layout: the user's mask spec ∧ the graph's static pattern ∧ ``extra_static`` (e.g. an op's
    is_causal), or all FULL tiles without any. Returns the layout and a description of the mask source."""
    tm, tn, user = options["tile_m"], options["tile_n"], options.get("mask")
    statics, names = [], []
    if graph_mask is not None and graph_mask.static is not None:
        statics.append(graph_mask.static)
    if extra_static is not None:
        statics.append(extra_static)
        names.append(extra_name)
    if graph_mask is not None and graph_mask.kind not in ("none",):
        names.append(graph_mask.source)
    if user is not None:
        layout = compile_mask(user, sq, sk, tile_m=tm, tile_n=tn, num_heads=heads)
        names.insert(0, f"user '{layout.mask_spec}'")
        if statics:
            dense = layout.to_dense()
            for s in statics:
                dense = _and_heads(dense, s)
            layout = TileLayout.from_dense(dense, tm, tn, mask_spec=f"{layout.mask_spec} & graph")
    elif statics:
        dense = statics[0]
        for s in statics[1:]:
            dense = _and_heads(dense, s)
        layout = TileLayout.from_dense(dense, tm, tn, mask_spec="graph")
    else:
        layout = TileLayout.from_dense(np.ones((1, sq, sk), bool), tm, tn, mask_spec="full")
    return layout, " & ".join(names) if names else "none (full layout)"


def _and_heads(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0]):
        raise StofError(f"cannot combine masks with {a.shape[0]} and {b.shape[0]} layouts")
    return np.logical_and(a, b)


class AttentionEmitter:
    """Creates STOF attention nodes, sharing layout initializers and key-padding casts across nodes."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        self.ctx = fusion.ctx
        cache = self.ctx.options.setdefault("_attention_cache", {})
        self.layouts: dict = cache.setdefault("layouts", {})
        self.paddings: dict = cache.setdefault("paddings", {})

    def layout_inputs(self, layout: TileLayout) -> list[gs.Constant]:
        sig = layout.signature()
        if sig not in self.layouts:
            k = len(self.layouts)
            self.layouts[sig] = [gs.Constant(self.ctx.unique(f"stof_layout{k}_{name}"),
                                             np.ascontiguousarray(arr, np.int32))
                                 for name, arr in layout.arrays().items()]
        return self.layouts[sig]

    def key_padding(self, source: gs.Tensor, new_nodes: list[gs.Node]) -> gs.Tensor:
        """int32 [B, Sk] key_padding_mask (non-zero = kept) from any-typed ``source``: Cast to bool, then int32."""
        key = source.name
        if key not in self.paddings:
            as_bool = self.fusion.new_var("stof_key_padding_bool", dtype=np.bool_)
            as_i32 = self.fusion.new_var("stof_key_padding_mask", dtype=np.int32)
            new_nodes.append(gs.Node("Cast", self.ctx.unique("stof_key_padding_cast"), {"to": 9},
                                     [source], [as_bool]))
            new_nodes.append(gs.Node("Cast", self.ctx.unique("stof_key_padding_cast"), {"to": 6},
                                     [as_bool], [as_i32]))
            self.paddings[key] = as_i32
        return self.paddings[key]

    def node(self, plan: AttentionPlan, query: gs.Tensor, key: gs.Tensor, value: gs.Tensor, output: gs.Tensor,
             new_nodes: list[gs.Node]) -> gs.Node:
        inputs = [query, key, value, *self.layout_inputs(plan.layout)]
        kpm = None
        if plan.padding_input is not None:
            kpm = self.key_padding(self.ctx.graph.tensors()[plan.padding_input], new_nodes)
        elif plan.padding_tensor is not None:
            kpm = self.key_padding(plan.padding_tensor, new_nodes)
        if kpm is not None or plan.bias is not None:
            inputs.append(kpm if kpm is not None else gs.Variable.empty())
        if plan.bias is not None:
            inputs.append(plan.bias)
        lay = plan.layout
        attrs = {"scale": float(plan.scale), "tile_m": lay.tile_m, "tile_n": lay.tile_n, "seq_q": lay.seq_q,
                 "seq_k": lay.seq_k, "num_layouts": lay.num_layouts, "format_version": FORMAT_VERSION,
                 "mask_spec": lay.mask_spec or ""}
        node = gs.Node("StofSparseAttention", self.ctx.unique("StofSparseAttention"), attrs, inputs, [output],
                       domain="stof")
        overload = attention_overload(kpm is not None, plan.bias is not None)
        self.ctx.overloads[node.name] = overload
        self.ctx.functions.add(("StofSparseAttention", overload))
        plan.name = node.name
        new_nodes.append(node)
        return node
