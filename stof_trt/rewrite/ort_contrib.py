"""Helpers shared by the fusions of ONNX Runtime's own attention operators (com.microsoft GroupQueryAttention,
SparseAttention, LongformerAttention): input presence, Q/K/V shapes, grouped K/V heads, block layouts."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import StofError
from ..format import TileLayout

from .attention_common import AttentionEmitter, AttentionPlan, from_heads, to_heads
from .base import Fusion

ORT_DOMAIN = "com.microsoft"


def present(node: gs.Node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i].name != ""


def outputs_used(fusion: Fusion, node: gs.Node, first: int = 1) -> bool:
    """Whether any output from index ``first`` on (KV-cache presents, QK dumps) is read or is a graph output."""
    outs = fusion.ctx.graph_outputs
    return any(o.name in outs or o.outputs for o in node.outputs[first:])


def tensor_shapes(fusion: Fusion, names: set[str]) -> dict[str, tuple]:
    """Shapes of ``names``: declared static shapes where the graph has them (no probe, so a graph whose other
    layers are CUDA-only operators still rewrites), the shape probe at the compiled length for the rest."""
    tensors = fusion.graph.tensors()
    shapes, rest = {}, set()
    for n in names:
        shp = tensors[n].shape
        if shp is not None and all(isinstance(d, (int, np.integer)) and d >= 0 for d in shp):
            shapes[n] = tuple(int(d) for d in shp)
        else:
            rest.add(n)
    if rest:
        from .attention_common import AttentionProbe

        opts = fusion.ctx.options
        original = opts["_original_model"]
        opts["_original_model"] = shape_stand_in(original)
        try:
            probe = AttentionProbe(fusion.ctx, fusion.graph, rest, [], set())
        finally:
            opts["_original_model"] = original
        shapes.update({n: tuple(probe.shape(n)) for n in rest})
    return shapes


#: Operators whose output 0 has the shape of input 0 and that ONNX Runtime's CPU cannot run as plain nodes
#: (SparseAttention's CPU kernel needs its past and present buffers bound to one memory; LongformerAttention has
#: none), with the inputs that must be present for that shape to hold (packed QKV changes it).
_SHAPE_LIKE_INPUT0 = {"SparseAttention": (1, 2), "LongformerAttention": ()}


def shape_stand_in(model):
    """``model``, or a copy in which every _SHAPE_LIKE_INPUT0 operator is an Identity of its input 0: the shape
    probe then runs past earlier layers of such operators (a multi-layer model with a dynamic sequence axis), and
    output 0 keeps its shape, all the probe reads there. Values past them differ: only shapes are probed so."""
    import onnx

    def stand_in(n) -> bool:
        need = _SHAPE_LIKE_INPUT0.get(n.op_type)
        return n.domain == ORT_DOMAIN and need is not None and all(i < len(n.input) and n.input[i] for i in need)

    if not any(stand_in(n) for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = [onnx.helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name) if stand_in(n) else n
             for n in out.graph.node]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def keys_axis1(fusion: Fusion, k: gs.Tensor, new: list[gs.Node]) -> gs.Tensor:
    """A float [1, Sk] zeros tensor from K [B, H, Sk, D], for helpers that read the key length from dim 1 (no
    copy of K: only its shape is used)."""
    ctx = fusion.ctx
    shape, zeros = fusion.new_var("stof_sk_shape", dtype=np.int64), fusion.new_var("stof_sk_zeros", dtype=np.float32)
    one = fusion.new_const("stof_one_i64", np.array([1], np.int64))
    cat = fusion.new_var("stof_sk_dims", dtype=np.int64)
    new += [gs.Node("Shape", ctx.unique("stof_sk"), {"start": 2, "end": 3}, [k], [shape]),
            gs.Node("Concat", ctx.unique("stof_sk"), {"axis": 0}, [one, shape], [cat]),
            gs.Node("ConstantOfShape", ctx.unique("stof_sk"), {}, [cat], [zeros])]
    return zeros



def emit_grouped_node(fusion: Fusion, plan: AttentionPlan, q: gs.Tensor, k: gs.Tensor, v: gs.Tensor, y: gs.Tensor,
                      kv_heads: int, new: list[gs.Node]) -> None:
    """The STOF node for [B, S, heads*D] Q and [B, S, kv_heads*D] K/V into [B, S, heads*D] Y: grouped heads stay
    grouped (the node reads K/V head h / (heads / kv_heads))."""
    qq = to_heads(fusion, q, plan.heads, plan.head_dim, new)
    kk, vv = (to_heads(fusion, t, kv_heads, plan.head_dim, new) for t in (k, v))
    out = from_heads(fusion, y, plan.heads * plan.head_dim, new, dtype=y.dtype)
    AttentionEmitter(fusion).node(plan, qq, kk, vv, out, new)


def check_heads(num_heads: int, kv_heads: int) -> str | None:
    """A reason the head counts cannot be grouped, or None."""
    if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
        return f"num_heads {num_heads} is not a multiple of kv_num_heads {kv_heads}"
    return None


def csr_block_mask(row_ptr: np.ndarray, col_idx: np.ndarray) -> np.ndarray:
    """bool [L, nb, nb] block mask from CSR block indices (row_ptr [L, nb + 1], col_idx [L, max_nnz] padded with
    any value past each row's end)."""
    row_ptr, col_idx = np.asarray(row_ptr, np.int64), np.asarray(col_idx, np.int64)
    if row_ptr.ndim != 2 or col_idx.ndim != 2 or row_ptr.shape[0] != col_idx.shape[0] or row_ptr.shape[1] < 2:
        raise StofError(f"block indices of shapes {row_ptr.shape} / {col_idx.shape}: expected [L, nb+1] / [L, nnz]")
    L, nb = row_ptr.shape[0], row_ptr.shape[1] - 1
    if np.any(row_ptr[:, 0] != 0) or np.any(np.diff(row_ptr, axis=1) < 0) or np.any(row_ptr[:, -1] > col_idx.shape[1]):
        raise StofError("block_row_indices is not a CSR row pointer over block_col_indices")
    mask = np.zeros((L, nb, nb), bool)
    for lay in range(L):
        counts = np.diff(row_ptr[lay])
        rows = np.repeat(np.arange(nb), counts)
        cols = col_idx[lay, :row_ptr[lay, -1]]
        if np.any((cols < 0) | (cols >= nb)):
            raise StofError("block_col_indices has a column outside the block grid")
        mask[lay, rows, cols] = True
    return mask


def layout_per_head(layout: TileLayout, heads: int) -> TileLayout:
    """A layout of L patterns as the STOF node's 1 or ``heads`` layouts, head h using pattern h % L."""
    L = layout.num_layouts
    if L in (1, heads):
        return layout
    if heads % L:
        raise StofError(f"{L} block layouts do not divide {heads} heads")
    tq = layout.Tq
    rp = layout.row_ptr.astype(np.int64)
    counts = np.diff(rp).reshape(L, tq)
    order = np.arange(heads) % L
    new_counts = counts[order].reshape(-1)
    pieces_c, pieces_b = [], []
    for lay in order:
        a, b = int(rp[lay * tq]), int(rp[(lay + 1) * tq])
        pieces_c.append(layout.col_idx[a:b])
        pieces_b.append(layout.tile_bitmap_index[a:b])
    nnz = int(new_counts.sum())
    col = np.concatenate(pieces_c) if nnz else np.zeros(1, np.int32)
    tbi = np.concatenate(pieces_b) if nnz else np.full(1, -1, np.int32)
    return TileLayout.from_arrays(seq_q=layout.seq_q, seq_k=layout.seq_k, tile_m=layout.tile_m, tile_n=layout.tile_n,
                                  num_layouts=heads, row_ptr=np.concatenate([[0], np.cumsum(new_counts)]),
                                  col_idx=col, tile_bitmap_index=tbi, bitmaps=layout.bitmaps,
                                  mask_spec=layout.mask_spec)
