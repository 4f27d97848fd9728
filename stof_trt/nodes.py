"""The StofSparseAttention nodes of an ONNX model: tensor names, attributes, compiled layout, problem dims.

What the tuner, the pre-search entries and the command line read from a rewritten model, in one place, so that
reading a model needs neither a session (stof_trt.ort) nor the tactic machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import StofError
from .format import STOF_FORMAT_VERSIONS_READ, TileLayout, layout_array_int32

__all__ = ["ONNX_DTYPES", "TOKEN_CAPACITY_INPUT", "AttentionNode", "attention_nodes", "attention_problem_dims"]

ONNX_DTYPES = {1: "float", 10: "float16", 16: "bfloat16"}
#: The input of a model packed into token slots (rewrite option token_capacity_input): int32 [C], its length the
#: number of slots, its values unused; stof_trt.ort.with_token_capacity fills it from the padding mask.
TOKEN_CAPACITY_INPUT = "stof_token_capacity"
_LAYOUT_INPUTS = ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps")


@dataclass
class AttentionNode:
    """A StofSparseAttention node of a model: its tensor names, attributes and compiled layout."""

    name: str
    query: str
    key: str
    key_padding_mask: str | None
    attn_bias: str | None
    scale: float
    layout: TileLayout
    packed: bool = False  # qkv_format "bs3hd": query is [B,S,3,H,D], key/value absent
    # qkv_format "bshd_kv": query is [B,Sq,H,D] (or [B,Sq,H·D] with num_heads), key [B,Sk,2,Hkv,D] holds K and
    # V, value absent
    # qkv_format "t3hd": query is [T,3,H,D] (packed sequences of seq_offsets), key/value absent; key_padding_mask
    # [B,S] gives only B and S
    tokens: bool = False
    seq_offsets: str | None = None
    layout_spec: str | None = None  # closed-form spec the plugin builds longer layouts from (docs/nodes.md)
    kv: bool = False
    num_heads: int = 0  # a bshd_kv query of rows [B, Sq, H·D]: H
    # attributes query_view / key_view ([row0, rows, col0, cols], rows -1: to the end): the flat bshd_kv query and
    # key are these windows of row tensors [B, R, C]
    query_view: tuple[int, int, int, int] | None = None
    key_view: tuple[int, int, int, int] | None = None

    def layout_at(self, seq_q: int, seq_k: int) -> TileLayout:
        """The layout the plugin runs at run-time sizes seq_q x seq_k: the compiled one up to its sizes, else (with a
        layout_spec) the spec compiled at the plugin's length bucket (grown_length), as the plugin builds it."""
        lay = self.layout
        if (seq_q <= lay.seq_q and seq_k <= lay.seq_k) or not self.layout_spec:
            return lay
        from .format import compile_mask

        return compile_mask(self.layout_spec, grown_length(max(seq_q, lay.seq_q)),
                            grown_length(max(seq_k, lay.seq_k)), tile_m=lay.tile_m, tile_n=lay.tile_n,
                            num_heads=lay.num_layouts)


def grown_length(s: int) -> int:
    """The length the plugin builds a node's layout_spec at for a run-time length ``s`` past the compiled one: ``s``
    rounded up to a multiple of the power of two ``step`` (the smallest with ``8 * step >= s``), so at most 1.25 s;
    plugins_cu/ort/sparseAttention/sparseAttentionOp.cpp lengthBucket computes the same."""
    step = 1
    while step * 8 < s:
        step *= 2
    return min(2**31 - 1, -(-s // step) * step)


def _attrs(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _qkv_format(attrs: dict) -> str:
    fmt = attrs.get("qkv_format", b"bhsd")
    return fmt.decode("utf-8", "replace") if isinstance(fmt, bytes) else str(fmt)


_MISSING = object()


def _typed(node, attrs: dict, name: str, kind: type, default=_MISSING):
    """Attribute ``name`` of a model's node as ``kind`` (int, float or str), or a one-line StofError: a model is
    input from outside."""
    v = attrs.get(name, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise StofError(f"attention node '{node.name}': attribute {name} is missing")
        return default
    if kind is str:
        if isinstance(v, bytes):
            try:
                return v.decode("utf-8")
            except UnicodeDecodeError:
                raise StofError(f"attention node '{node.name}': attribute {name} is not UTF-8 text") from None
        ok = isinstance(v, str)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, int) and not isinstance(v, bool)
    if not ok:
        what = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise StofError(f"attention node '{node.name}': attribute {name} is not {what}")
    return kind(v)


def _view(node, attrs: dict, name: str) -> tuple[int, int, int, int] | None:
    """Attribute ``name`` (query_view / key_view) as [row0, rows, col0, cols], or a one-line StofError."""
    v = attrs.get(name)
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v) and v[0] >= 0
            and v[1] >= -1 and v[2] >= 0 and v[3] >= 1):
        raise StofError(f"attention node '{node.name}': attribute {name} is not [row0 >= 0, rows >= -1, col0 >= 0, "
                        "cols >= 1]")
    return tuple(v)


def view_rows(view: tuple[int, int, int, int], rows: int) -> int:
    """The rows a view reads of a tensor with ``rows`` rows."""
    return rows - view[0] if view[1] < 0 else view[1]


def _layout_array(node, name: str, tensor) -> np.ndarray:
    """A layout input as int32, or a StofError: integer values within int32 only (no silent wrap-around)."""
    from onnx import numpy_helper

    try:
        arr = numpy_helper.to_array(tensor)
    except Exception as e:  # noqa: BLE001 - a malformed tensor proto
        raise StofError(f"attention node '{node.name}': layout input {name} cannot be read "
                        f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})") from None
    try:
        return layout_array_int32(name, arr)
    except StofError as e:
        raise StofError(f"attention node '{node.name}': {e}") from None


def attention_nodes(model) -> list[AttentionNode]:
    """Every StofSparseAttention node of the model's graph, its layout read from initializers or Constant nodes and
    validated; a layout input that is neither, a bad layout or attribute or an unknown format version raises
    StofError."""
    consts = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = a.t
    out = []
    for i, n in enumerate(model.graph.node):
        if n.op_type != "StofSparseAttention" or n.domain != "stof":
            continue
        a = _attrs(n)
        names = list(n.input) + [""] * (10 - len(n.input))
        arrays = {}
        for nm, inp in zip(_LAYOUT_INPUTS, names[3:7]):
            if inp not in consts:
                raise StofError(f"attention node '{n.name}': layout input '{inp}' is not a constant")
            arrays[nm] = _layout_array(n, nm, consts[inp])
        version = _typed(n, a, "format_version", int, -1)
        if version not in STOF_FORMAT_VERSIONS_READ:
            raise StofError(f"attention node '{n.name}': format_version {version} (this version "
                            f"reads {', '.join(map(str, STOF_FORMAT_VERSIONS_READ))})")
        # a model is input from outside: its attributes and its layout's invariants are checked before use
        sizes = {k: _typed(n, a, k, int) for k in ("seq_q", "seq_k", "tile_m", "tile_n", "num_layouts")}
        layout = TileLayout.from_arrays(**sizes, mask_spec=_typed(n, a, "mask_spec", str, ""), **arrays)
        fmt = _typed(n, a, "qkv_format", str, "bhsd")
        packed, tokens = fmt == "bs3hd", fmt == "t3hd"
        spec = _typed(n, a, "layout_spec", str, "")
        views = _view(n, a, "query_view"), _view(n, a, "key_view")
        heads = _typed(n, a, "num_heads", int, 0)
        if (views[0] is None) != (views[1] is None) or (views[0] is not None and (fmt != "bshd_kv" or heads < 1)):
            raise StofError(f"attention node '{n.name}': query_view and key_view go together, with qkv_format "
                            "bshd_kv and num_heads")
        if views[0] is not None and views[0][3] % heads:
            raise StofError(f"attention node '{n.name}': query_view's {views[0][3]} columns are not {heads} heads")
        out.append(AttentionNode(n.name or f"node{i}", names[0], names[0] if packed or tokens else names[1],
                                 names[7] or None, names[8] or None, _typed(n, a, "scale", float), layout, packed,
                                 tokens, names[9] or None, spec or None, fmt == "bshd_kv", heads, *views))
    return out


def attention_problem_dims(model) -> dict:
    """{node name: (onnx dtype name, heads, head_dim)} for the StofSparseAttention nodes whose query shape ONNX
    shape inference can fix (heads and head dim are static in exported transformers)."""
    import onnx

    try:  # data propagation resolves Reshape targets computed from Shape/Gather/Concat
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - best effort
        inferred = model
    vis = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.input)}
    producer = {o: p for p in model.graph.node for o in p.output}

    def static_dims(name):
        vi = vis.get(name)
        if vi is None:
            return None, None
        tt = vi.type.tensor_type
        return [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim], tt.elem_type

    out = {}
    for n in model.graph.node:
        if n.op_type != "StofSparseAttention" or n.domain != "stof":
            continue
        dims, et = static_dims(n.input[0])
        attrs = _attrs(n)
        if _qkv_format(attrs) in ("t3hd", "bshd_kv"):  # packed sequences [T, 3, H, D]; query [B, Sq, H, D]
            if dims and len(dims) == 4 and dims[2] and dims[3] and et in ONNX_DTYPES:
                out[n.name] = (ONNX_DTYPES[et], int(dims[2]), int(dims[3]))
            heads = int(attrs.get("num_heads", 0))  # query [B, Sq, H·D]
            view = attrs.get("query_view")
            if isinstance(view, list) and len(view) == 4 and heads > 0 and view[3] % heads == 0 and et in ONNX_DTYPES:
                out[n.name] = (ONNX_DTYPES[et], heads, int(view[3]) // heads)  # a window of a wider row tensor
                continue
            if dims and len(dims) == 3 and dims[2] and heads > 0 and dims[2] % heads == 0 and et in ONNX_DTYPES:
                out[n.name] = (ONNX_DTYPES[et], heads, int(dims[2]) // heads)
            continue
        if dims and len(dims) == 5 and dims[3] and dims[4] and et in ONNX_DTYPES:  # packed [B, S, 3, H, D]
            out[n.name] = (ONNX_DTYPES[et], int(dims[3]), int(dims[4]))
            continue
        if not dims or len(dims) != 4 or not dims[3] or et not in ONNX_DTYPES:
            continue
        heads = dims[1]
        if not heads:  # q = Transpose(Reshape(x, [B, S, H, D])): H = x's static last dim (hidden) / D
            t = producer.get(n.input[0])
            r = producer.get(t.input[0]) if t is not None and t.op_type == "Transpose" else None
            if r is not None and r.op_type == "Reshape":
                xd, _ = static_dims(r.input[0])
                if xd and xd[-1] and xd[-1] % dims[3] == 0:
                    heads = xd[-1] // dims[3]
        if heads:
            out[n.name] = (ONNX_DTYPES[et], int(heads), int(dims[3]))
    return out
