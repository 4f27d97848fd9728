"""Model-local ONNX functions (domain ``stof``) giving every STOF node its exact semantics in standard ops.

A rewritten model carries one FunctionProto per (op_type, overload) it uses, so ONNX Runtime CPU (or any runtime)
runs it without our plugins; a registered kernel of the same domain and op_type takes precedence. Optional inputs
are handled with ONNX function *overloads* (IR >= 10): a node's ``overload`` field names which optional inputs it
passes, e.g. StofSparseAttention overload ``padding_bias``. Kernels ignore the overload field.

The functions use only ops of the model's default-domain opset (>= 15), picking the attribute or input form of
``axes`` for the Reduce ops by opset.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DOMAIN = "stof"
DOMAIN_VERSION = 1
MIN_OPSET = 15

ATTENTION_INPUTS = ["query", "key", "value", "row_ptr", "col_idx", "tile_bitmap_index", "bitmaps",
                    "key_padding_mask", "attn_bias", "seq_offsets", "row_values", "row_index"]
ATTENTION_ATTRS = ["scale", "tile_m", "tile_n", "seq_q", "seq_k", "num_layouts", "format_version", "mask_spec",
                   "layout_spec",
                   "qkv_format", "num_heads", "query_view", "key_view"]
#: StofSparseAttention ``qkv_format`` values: "bhsd" (default: query/key/value [B,H,S,D], output [B,H,Sq,D]) and
#: "bs3hd" (packed: query is [B,S,3,H,D] = Q,K,V of one projection, key/value absent, output [B,S,H,D]).
#: "t3hd" (packed tokens: query is [T,3,H,D], the real tokens of B sequences back to back, seq_offsets [B+1] int32
#: where each starts, key_padding_mask [B,S] only for its shape; output [T,H,D]).
#: "bshd_kv" (query [B,Sq,H,D]; key [B,Sk,2,Hkv,D] = K,V of one projection, value absent; output [B,Sq,H,D]; or
#: query and output [B,Sq,H·D] with the attribute num_heads = H; with the attributes query_view / key_view
#: [row0, rows, col0, cols] (rows -1: to the end) query and key are [B,R,C] row tensors and the node reads the
#: window rows row0.., columns col0..col0+cols of each: Q [B,Sq,H·D], K,V [B,Sk,2·Hkv·D]; output [B,Sq,H·D]).
QKV_FORMATS = ("bhsd", "bs3hd", "t3hd", "bshd_kv")
GEMM_INPUTS = ["X", "W", "bias"]
ADDLN_INPUTS = ["X", "residual", "gamma", "beta", "bias"]


def attention_overload(has_padding: bool, has_bias: bool, packed: bool = False, varlen: bool = False,
                       kv: bool = False, flat: bool = False, rows: bool = False, view: bool = False) -> str:
    """flat: a bshd_kv query and output of rows [B, Sq, H·D]; view: query and key are windows (query_view,
    key_view) of row tensors; rows: row_values / row_index written over the output."""
    if varlen:  # t3hd: always the padding mask (for B, S) and seq_offsets, never a bias
        return "varlen"
    return "_".join(p for p, on in (("packed", packed), ("kv", kv), ("flat", flat), ("view", view),
                                    ("padding", has_padding), ("bias", has_bias), ("rows", rows)) if on)


class _Body:
    """Accumulates the nodes of a function body with fresh value names."""

    def __init__(self, opset: int):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, n_out: int = 1, out: str | list[str] | None = None, **attrs):
        if out is None:
            outs = [f"_{op_type.lower()}_{self._n + i}" for i in range(n_out)]
            self._n += n_out
        else:
            outs = [out] if isinstance(out, str) else list(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, value, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=numpy_helper.from_array(arr, name=""))

    def _ref(self, attr: str, field: str, kind) -> str:
        """A Constant whose ``field`` is the calling node's attribute ``attr`` (one per attribute)."""
        out = f"_attr_{attr}"
        if not any(out in n.output for n in self.nodes):
            node = helper.make_node("Constant", [], [out])
            node.attribute.append(helper.make_attribute_ref(field, kind, ref_attr_name=attr))
            self.nodes.append(node)
        return out

    def ref_int(self, attr: str) -> str:
        """An int64 scalar holding the calling node's INT attribute ``attr``."""
        return self._ref(attr, "value_int", onnx.AttributeProto.INT)

    def ref_ints(self, attr: str) -> str:
        """An int64 vector holding the calling node's INTS attribute ``attr``."""
        return self._ref(attr, "value_ints", onnx.AttributeProto.INTS)

    def ref_float_like(self, attr: str, like: str) -> str:
        """The calling node's FLOAT attribute ``attr`` as a scalar of the same type as tensor ``like``."""
        node = helper.make_node("Constant", [], [f"_attr_{attr}"])
        node.attribute.append(helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT, ref_attr_name=attr))
        self.nodes.append(node)
        return self.op("CastLike", f"_attr_{attr}", like)

    def like(self, value: float, like: str) -> str:
        return self.op("CastLike", self.const(np.float32(value)), like)

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int = 1) -> str:
        input_axes = op_type == "ReduceSum" or self.opset >= 18
        if input_axes:
            return self.op(op_type, x, self.const(np.array(axes, np.int64)), keepdims=keepdims)
        return self.op(op_type, x, axes=axes, keepdims=keepdims)


def _function(name, inputs, outputs, body: _Body, attrs, overload: str, opset: int, doc: str) -> onnx.FunctionProto:
    return helper.make_function(DOMAIN, name, inputs, outputs, body.nodes, [helper.make_opsetid("", opset)],
                                attributes=attrs, overload=overload or None, doc_string=doc)


# -- StofSparseAttention --------------------------------------------------------------------------------------------
def _repeat_kv_heads(b: _Body, x: str, q_heads: str) -> str:
    """Grouped-query attention: K or V [B, Hkv, Sk, D] -> [B, H, Sk, D], K/V head j serving query heads
    j·H/Hkv .. (j+1)·H/Hkv - 1 (the kernels' h / group); the identity when Hkv = H.  q_heads: [1] int64 H."""
    xs = b.op("Shape", x)
    lo, mid, hi = (b.const(np.array([i], np.int64)) for i in (0, 2, 4))
    one = b.const(np.array([1], np.int64))
    bh, sd = b.op("Slice", xs, lo, mid), b.op("Slice", xs, mid, hi)        # [B, Hkv], [Sk, D]
    group = b.op("Div", q_heads, b.op("Slice", xs, one, mid))            # [H / Hkv]
    wide = b.op("Expand", b.op("Unsqueeze", x, mid), b.op("Concat", bh, group, sd, axis=0))  # [B, Hkv, g, Sk, D]
    return b.op("Reshape", wide, b.op("Concat", b.op("Slice", xs, lo, one), q_heads, sd, axis=0))


def _unpack_tokens(b: _Body):
    """t3hd: query [T,3,H,D] -> [B,S,3,H,D] with token t of sequence b at row r = t - seq_offsets[b] (zeros
    elsewhere); returns (padded query, flat padded row of each token [T], allowed keys [B,S] = k < n_b). Rows
    past seq_offsets[B] (unused token slots) get flat row B·S: no sequence reads them and their output is 0."""
    i64 = TensorProto.INT64
    ax0, ax1 = b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))
    big = b.const(np.array([np.iinfo(np.int64).max], np.int64))
    zero, one = b.const(np.int64(0)), b.const(np.int64(1))
    ks = b.op("Shape", "key_padding_mask")                                    # [B, S]
    S = b.op("Slice", ks, ax1, b.const(np.array([2], np.int64)))
    so = b.op("Cast", "seq_offsets", to=i64)                                  # [B+1]
    starts = b.op("Slice", so, ax0, b.const(np.array([-1], np.int64)))       # [B]
    ends = b.op("Slice", so, ax1, big)                                        # [B]
    qs = b.op("Shape", "query")                                               # [T, 3, H, D]
    t = b.op("Range", zero, b.op("Squeeze", b.op("Slice", qs, ax0, ax1), ax0), one)   # [T]
    seq = b.reduce("ReduceSum", b.op("Cast", b.op("LessOrEqual", b.op("Unsqueeze", ends, ax0),
                                                     b.op("Unsqueeze", t, ax1)), to=i64), [1], keepdims=0)
    nb = b.op("Squeeze", b.op("Slice", ks, ax0, ax1), ax0)                   # B
    seq = b.op("Min", seq, b.op("Sub", nb, one))
    row = b.op("Sub", t, b.op("Gather", starts, seq, axis=0))
    bs = b.reduce("ReduceProd", ks, [0])                                      # [B·S]
    flat = b.op("Add", b.op("Mul", seq, b.op("Squeeze", S, ax0)), row)
    flat = b.op("Where", b.op("Less", t, b.op("Gather", so, b.const(np.int64(-1)), axis=0)), flat,
                b.op("Squeeze", bs, ax0))                                     # [T]
    rest = b.op("Slice", qs, ax1, big)                                        # [3, H, D]
    zeros = b.op("ConstantOfShape", b.op("Concat", b.op("Add", bs, one), rest, axis=0),
                 value=numpy_helper.from_array(np.zeros(1, np.float32), name=""))
    padded = b.op("ScatterND", b.op("CastLike", zeros, "query"), b.op("Unsqueeze", flat, ax1), "query")
    padded = b.op("Slice", padded, b.const(np.array([0], np.int64)), bs)      # the unused slots' row dropped
    padded = b.op("Reshape", padded, b.op("Concat", ks, rest, axis=0))       # [B, S, 3, H, D]
    keys = b.op("Range", zero, b.op("Squeeze", S, ax0), one)                 # [S]
    allowed = b.op("Less", b.op("Unsqueeze", keys, ax0), b.op("Unsqueeze", b.op("Sub", ends, starts), ax1))
    return padded, flat, allowed


def _spec_allowed(b: _Body, spec, q: str, k: str) -> str:
    """The closed-form mask ``spec`` (a masks.MaskSpec, masks.closed_form) evaluated with ONNX ops: bool, broadcast
    of ``q`` (int64 [Sq, 1] query positions) and ``k`` (int64 [1, Sk] key positions)."""
    from ..masks import BigBird, Causal, Dilated, Full, Global, Intersection, Sliding, Union

    i64 = lambda v: b.const(np.int64(v))  # noqa: E731
    d = lambda: b.op("Sub", k, q)         # noqa: E731

    def band(lo, hi, x):
        parts = []
        if lo is not None:
            parts.append(b.op("GreaterOrEqual", x, i64(lo)))
        parts.append(b.op("LessOrEqual", x, i64(hi)))
        return parts[0] if len(parts) == 1 else b.op("And", *parts)

    def member(x, tokens, axis):   # x [n, 1] or [1, n] in the sorted tokens (a [T] constant)
        if not len(tokens):
            return b.const(np.array(False))
        t = b.const(np.asarray(tokens, np.int64).reshape((1, 1, -1)))
        hits = b.op("Cast", b.op("Equal", b.op("Unsqueeze", x, b.const(np.array([-1], np.int64))), t),
                    to=TensorProto.INT64)
        return b.op("Greater", b.reduce("ReduceSum", hits, [-1], keepdims=0), i64(0))

    if isinstance(spec, Full):
        return b.const(np.array(True))
    if isinstance(spec, Causal):
        return b.op("LessOrEqual", d(), i64(spec.offset))
    if isinstance(spec, Dilated):
        x = d()
        return b.op("And", band(-spec.left, spec.right, x),
                    b.op("Equal", b.op("Mod", x, i64(spec.dilation)), i64(0)))
    if isinstance(spec, Sliding):
        return band(-spec.left, spec.right, d())
    if isinstance(spec, Global):
        if isinstance(spec.tokens, range):
            n = i64(max(len(spec.tokens), 0))
            return b.op("Or", b.op("Less", q, n), b.op("Less", k, n))
        return b.op("Or", member(q, spec._sorted, 0), member(k, spec._sorted, 1))
    if isinstance(spec, BigBird):   # random == 0 (closed_form)
        blk = i64(spec.block)
        bd = b.op("Sub", b.op("Div", k, blk), b.op("Div", q, blk))
        g = i64(spec.global_blocks * spec.block)
        return b.op("Or", b.op("Or", band(-spec.window, spec.window, bd), b.op("Less", q, g)), b.op("Less", k, g))
    if isinstance(spec, (Union, Intersection)):
        out = _spec_allowed(b, spec.parts[0], q, k)
        for p in spec.parts[1:]:
            out = b.op("Or" if isinstance(spec, Union) else "And", out, _spec_allowed(b, p, q, k))
        return out
    raise ValueError(f"not a closed-form spec: {spec}")


def spec_overload(base: str, index: int) -> str:
    """The overload of a StofSparseAttention node whose function evaluates the layout_spec numbered ``index``."""
    return f"{base}_spec{index}" if base else f"spec{index}"


def _view(b: _Body, x: str, view: str) -> str:
    """x[:, row0:row0+rows, col0:col0+cols] for view = [row0, rows, col0, cols] (rows -1: to the end)."""
    at = lambda i: b.op("Slice", view, b.const(np.array([i], np.int64)), b.const(np.array([i + 1], np.int64)))  # noqa: E731
    row0, rows, col0, cols = (at(i) for i in range(4))
    row_end = b.op("Where", b.op("Less", rows, b.const(np.array([0], np.int64))),
                   b.const(np.array([np.iinfo(np.int64).max], np.int64)), b.op("Add", row0, rows))
    return b.op("Slice", x, b.op("Concat", row0, col0, axis=0),
                b.op("Concat", row_end, b.op("Add", col0, cols), axis=0), b.const(np.array([1, 2], np.int64)))


def sparse_attention_function(opset: int, has_padding: bool, has_bias: bool,
                              packed: bool = False, varlen: bool = False, spec: str | None = None,
                              overload: str | None = None, kv: bool = False, flat: bool = False,
                              rows: bool = False, view: bool = False) -> onnx.FunctionProto:
    """O = softmax(scale·Q·Kᵀ + bias, masked by the tile layout ∧ key padding)·V; rows with no allowed key -> 0.

    The layout arrays are decoded into a dense [L, Sq, Sk] mask exactly as docs/format.md "Dense reconstruction":
    the tile row of each entry from row_ptr (count of row_ptr[1:] <= e), the bitmap words widened to unsigned
    int64 and split into bits (LSB first) by Div/Mod, FULL tiles all ones, a ScatterND into a
    [L, Tq, Tk, tm·tn] grid, then a transpose/reshape to [L, Tq·tm, Tk·tn] and the top-left run-time corner.
    With ``spec`` (the nodes' closed-form layout_spec, docs/rewrite.md "Sequence length"), the mask is the spec
    evaluated at the run-time positions instead: the same bits up to the compiled length, and any length past it."""
    b = _Body(opset)
    query, key_rows, token_rows = "query", None, None
    if varlen:  # the packed tokens as a right-padded batch; keys past each sequence's length are masked
        query, token_rows, key_rows = _unpack_tokens(b)
        packed, has_padding, has_bias = True, True, False
    if packed:  # query [B, S, 3, H, D] -> Q, K, V [B, H, S, D]
        q_in, k_in, v_in = (b.op("Transpose", b.op("Gather", query, b.const(np.int64(i)), axis=2), perm=[0, 2, 1, 3])
                            for i in range(3))
    elif kv:  # query [B, Sq, H, D], key [B, Sk, 2, Hkv, D] -> Q [B, H, Sq, D], K, V [B, Hkv, Sk, D]
        key = "key"
        if view:  # windows of row tensors: query [B, Sq, H·D], key [B, Sk, 2·Hkv·D] -> [B, Sk, 2, Hkv, D]
            if not flat:
                raise ValueError("query_view / key_view read flat rows: view needs flat")
            qview = b.ref_ints("query_view")
            query, key = _view(b, "query", qview), _view(b, "key", b.ref_ints("key_view"))
            head_dim = b.op("Div", b.op("Slice", qview, b.const(np.array([3], np.int64)),
                                        b.const(np.array([4], np.int64))),
                            b.op("Unsqueeze", b.ref_int("num_heads"), b.const(np.array([0], np.int64))))
            key = b.op("Reshape", key, b.op("Concat", b.const(np.array([0, 0, 2, -1], np.int64)), head_dim, axis=0))
        if flat:  # query [B, Sq, H·D]
            heads = b.op("Unsqueeze", b.ref_int("num_heads"), b.const(np.array([0], np.int64)))
            query = b.op("Reshape", query, b.op("Concat", b.const(np.array([0, 0], np.int64)), heads,
                                                b.const(np.array([-1], np.int64)), axis=0))
        q_in = b.op("Transpose", query, perm=[0, 2, 1, 3])
        k_in, v_in = (b.op("Transpose", b.op("Gather", key, b.const(np.int64(i)), axis=2), perm=[0, 2, 1, 3])
                      for i in range(2))
    else:
        q_in, k_in, v_in = "query", "key", "value"
    if spec is not None:
        allowed = _spec_mask(b, spec, q_in, k_in)
    else:
        allowed = _layout_mask(b, q_in, k_in)
    return _attention_body(b, allowed, q_in, k_in, v_in, has_padding, has_bias, packed, varlen, key_rows,
                           token_rows,
                           overload or ("varlen" if varlen else attention_overload(has_padding, has_bias, packed,
                                                                                   kv=kv, flat=flat, rows=rows,
                                                                                   view=view)),
                           opset, bshd_out=packed or kv, flat=kv and flat, rows=rows and not varlen)


def _spec_mask(b: _Body, spec: str, q_in: str, k_in: str) -> str:
    """[1, 1, Sq, Sk] (or a broadcastable bool) from the closed-form ``spec`` at the run-time sizes."""
    from ..masks import parse_mask

    zero, one = b.const(np.int64(0)), b.const(np.int64(1))
    ax0, ax1 = b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))
    sizes = lambda t: b.op("Squeeze", b.op("Slice", b.op("Shape", t), b.const(np.array([2], np.int64)),  # noqa: E731
                                           b.const(np.array([3], np.int64))), ax0)
    q = b.op("Unsqueeze", b.op("Range", zero, sizes(q_in), one), ax1)          # [Sq, 1]
    k = b.op("Unsqueeze", b.op("Range", zero, sizes(k_in), one), ax0)          # [1, Sk]
    allowed = _spec_allowed(b, parse_mask(spec), q, k)
    return b.op("Unsqueeze", allowed, b.const(np.array([0, 1], np.int64)))   # [1, 1, Sq, Sk]


def _layout_mask(b: _Body, q_in: str, k_in: str) -> str:
    """[1, H, Sq, Sk] bool from the node's layout inputs (docs/format.md "Dense reconstruction")."""
    i64 = TensorProto.INT64
    zero, one = b.const(np.int64(0)), b.const(np.int64(1))
    tm, tn, sq, sk, L = (b.ref_int(a) for a in ("tile_m", "tile_n", "seq_q", "seq_k", "num_layouts"))
    Tq = b.op("Div", b.op("Sub", b.op("Add", sq, tm), one), tm)
    Tk = b.op("Div", b.op("Sub", b.op("Add", sk, tn), one), tn)
    R = b.op("Mul", L, Tq)
    # Tile row r of each stored entry e: r = #{r' >= 1 : row_ptr[r'] <= e}.
    rp = b.op("Cast", "row_ptr", to=i64)                                       # [R+1]
    big = b.const(np.array([np.iinfo(np.int64).max], np.int64))
    rp_hi = b.op("Slice", rp, b.const(np.array([1], np.int64)), big)          # [R]
    nnz = b.op("Slice", rp, b.const(np.array([-1], np.int64)), big)           # [1]
    ci = b.op("Cast", "col_idx", to=i64)                                      # [E]
    E = b.op("Squeeze", b.op("Shape", "col_idx"), b.const(np.array([0], np.int64)))
    e = b.op("Range", zero, E, one)                                           # [E]
    ax0, ax1, ax2 = (b.const(np.array([a], np.int64)) for a in (0, 1, 2))
    le = b.op("LessOrEqual", b.op("Unsqueeze", rp_hi, ax0), b.op("Unsqueeze", e, ax1))   # [E, R]
    r = b.reduce("ReduceSum", b.op("Cast", le, to=i64), [1], keepdims=0)      # [E]
    valid = b.op("Less", e, nnz)                                              # [E] (False for the padding entry)
    r = b.op("Min", r, b.op("Sub", R, one))
    lay, row = b.op("Div", r, Tq), b.op("Mod", r, Tq)
    idx = b.op("Concat", b.op("Unsqueeze", lay, ax1), b.op("Unsqueeze", row, ax1), b.op("Unsqueeze", ci, ax1),
               axis=1)                                                        # [E, 3]
    # Bits of each entry's tile: bitmap words as unsigned, LSB first; FULL tiles (index -1) all ones.
    tbi = b.op("Cast", "tile_bitmap_index", to=i64)
    words = b.op("Gather", "bitmaps", b.op("Max", tbi, zero), axis=0)         # [E, W] int32
    w = b.op("Mod", b.op("Cast", words, to=i64), b.const(np.int64(1 << 32)))  # [E, W] in [0, 2^32)
    pow2 = b.const(np.array([1 << k for k in range(32)], np.int64))
    bits = b.op("Mod", b.op("Div", b.op("Unsqueeze", w, ax2), pow2), b.const(np.int64(2)))   # [E, W, 32]
    bits = b.op("Reshape", bits, b.const(np.array([0, -1], np.int64)))       # [E, tm·tn]
    full = b.op("Unsqueeze", b.op("Less", tbi, zero), ax1)                    # [E, 1]
    bits = b.op("Where", full, one, bits)
    bits = b.op("Mul", bits, b.op("Unsqueeze", b.op("Cast", valid, to=i64), ax1))
    tiles = b.op("Cast", bits, to=TensorProto.FLOAT)
    unsq = lambda s: b.op("Unsqueeze", s, ax0)  # noqa: E731
    grid_shape = b.op("Concat", unsq(L), unsq(Tq), unsq(Tk), unsq(b.op("Mul", tm, tn)), axis=0)
    grid = b.op("ConstantOfShape", grid_shape, value=numpy_helper.from_array(np.zeros(1, np.float32), name=""))
    grid = b.op("ScatterND", grid, idx, tiles)                                # [L, Tq, Tk, tm·tn]
    grid = b.op("Reshape", grid, b.op("Concat", unsq(L), unsq(Tq), unsq(Tk), unsq(tm), unsq(tn), axis=0))
    grid = b.op("Transpose", grid, perm=[0, 1, 3, 2, 4])                      # [L, Tq, tm, Tk, tn]
    dense = b.op("Reshape", grid, b.op("Concat", unsq(L), unsq(b.op("Mul", Tq, tm)), unsq(b.op("Mul", Tk, tn)),
                                       axis=0))                              # [L, Tq·tm, Tk·tn]
    # Top-left corner at the run-time sizes; head h uses layout h % L.
    qshape, kshape = b.op("Shape", q_in), b.op("Shape", k_in)
    Sq = b.op("Slice", qshape, ax2, b.const(np.array([3], np.int64)))
    Sk = b.op("Slice", kshape, ax2, b.const(np.array([3], np.int64)))
    H = b.op("Squeeze", b.op("Slice", qshape, ax1, ax2), ax0)
    # The compiled seq_q x seq_k mask, then its run-time corner; the Reshape to [L, Sq, Sk] fails (naming the
    # compiled sizes in its input shape) when a run-time size exceeds them, instead of reading the tile padding.
    s0 = b.const(np.array([0, 0], np.int64))
    ax12 = b.const(np.array([1, 2], np.int64))
    dense = b.op("Slice", dense, s0, b.op("Concat", unsq(sq), unsq(sk), axis=0), ax12)   # [L, seq_q, seq_k]
    dense = b.op("Slice", dense, s0, b.op("Concat", Sq, Sk, axis=0), ax12)
    node_name = "stof_run_time_length_exceeds_compiled_seq_q_seq_k"
    dense = b.op("Reshape", dense, b.op("Concat", unsq(L), Sq, Sk, axis=0), out="_dense_run_time")
    b.nodes[-1].name = node_name                                              # [L, Sq, Sk]
    heads = b.op("Mod", b.op("Range", zero, H, one), L)
    allowed = b.op("Cast", b.op("Gather", dense, heads, axis=0), to=TensorProto.BOOL)   # [H, Sq, Sk]
    return b.op("Unsqueeze", allowed, ax0)                                    # [1, H, Sq, Sk]


def _write_rows(b: _Body, o: str, axis: int) -> str:
    """``o`` with row row_index[b, r] (along ``axis``, the query axis) replaced by row_values[b, r] ([B, R, H, D]);
    an index outside [0, Sq) (-1: none) writes nothing: it goes to a scratch row past the end, dropped after."""
    i64 = TensorProto.INT64
    ax = b.const(np.array([axis], np.int64))
    shape = b.op("Shape", o)
    sq = b.op("Slice", shape, ax, b.const(np.array([axis + 1], np.int64)))              # [1]
    idx = b.op("Cast", "row_index", to=i64)                                               # [B, R]
    outside = b.op("Or", b.op("Less", idx, b.const(np.int64(0))), b.op("GreaterOrEqual", idx, sq))
    idx = b.op("Where", outside, sq, idx)
    values = "row_values" if axis == 1 else b.op("Transpose", "row_values", perm=[0, 2, 1, 3])
    one_row = b.op("ScatterElements", shape, ax, b.const(np.array([1], np.int64)))      # o's shape, 1 on axis
    scratch = b.op("CastLike", b.op("ConstantOfShape", one_row,
                                    value=numpy_helper.from_array(np.zeros(1, np.float32), name="")), o)
    grown = b.op("Concat", o, scratch, axis=axis)
    idx = b.op("Unsqueeze", idx, b.const(np.array([2, 3], np.int64)))                     # [B, R, 1, 1]
    if axis == 2:
        idx = b.op("Transpose", idx, perm=[0, 2, 1, 3])                                   # [B, 1, R, 1]
    written = b.op("ScatterElements", grown, b.op("Expand", idx, b.op("Shape", values)), values, axis=axis)
    return b.op("Slice", written, b.const(np.array([0], np.int64)), sq, ax)


def _attention_body(b: _Body, allowed: str, q_in: str, k_in: str, v_in: str, has_padding: bool, has_bias: bool,
                    packed: bool, varlen: bool, key_rows, token_rows, overload: str, opset: int,
                    bshd_out: bool = False, flat: bool = False, rows: bool = False) -> onnx.FunctionProto:
    ax0, ax1, ax2 = (b.const(np.array([a], np.int64)) for a in (0, 1, 2))
    qshape = b.op("Shape", q_in)
    if has_padding:
        kp = key_rows if varlen else b.op("Not", b.op("Equal", "key_padding_mask", b.const(np.int32(0))))  # [B, Sk]
        kp = b.op("Unsqueeze", kp, b.const(np.array([1, 2], np.int64)))       # [B, 1, 1, Sk]
        allowed = b.op("And", allowed, kp)
    if not packed:  # key / value may have fewer heads than query (grouped-query attention)
        Hq = b.op("Slice", qshape, ax1, ax2)
        k_in, v_in = _repeat_kv_heads(b, k_in, Hq), _repeat_kv_heads(b, v_in, Hq)
    # Masked softmax: masked pairs exactly 0; a row with no allowed key gives 0, not NaN.
    s = b.op("MatMul", q_in, b.op("Transpose", k_in, perm=[0, 1, 3, 2]))    # [B, H, Sq, Sk]
    s = b.op("Mul", s, b.ref_float_like("scale", s))
    if has_bias:
        s = b.op("Add", s, "attn_bias")
    s = b.op("Where", allowed, s, b.like(-math.inf, s))
    zero_t, one_t = b.like(0.0, s), b.like(1.0, s)
    m = b.reduce("ReduceMax", s, [-1])
    m = b.op("Where", b.op("Equal", m, b.like(-math.inf, s)), zero_t, m)
    ex = b.op("Exp", b.op("Sub", s, m))
    den = b.reduce("ReduceSum", ex, [-1])
    den = b.op("Where", b.op("Equal", den, zero_t), one_t, den)
    if varlen:  # [B, H, S, D] -> [B·S, H, D] -> the tokens' rows [T, H, D]
        o = b.op("Transpose", b.op("MatMul", b.op("Div", ex, den), v_in), perm=[0, 2, 1, 3])
        hd = b.op("Slice", b.op("Shape", o), ax2, b.const(np.array([4], np.int64)))          # [H, D]
        o = b.op("Reshape", o, b.op("Concat", b.const(np.array([-1], np.int64)), hd, axis=0))
        zero_row = b.op("CastLike", b.op("ConstantOfShape", b.op("Concat", ax1, hd, axis=0),
                                         value=numpy_helper.from_array(np.zeros(1, np.float32), name="")), o)
        b.op("Gather", b.op("Concat", o, zero_row, axis=0), token_rows, axis=0, out="output")
    elif bshd_out:  # [B, H, Sq, D] -> [B, Sq, H, D] (flat: [B, Sq, H·D])
        o = b.op("Transpose", b.op("MatMul", b.op("Div", ex, den), v_in), perm=[0, 2, 1, 3])
        if rows:
            o = _write_rows(b, o, 1)
        if flat:
            o = b.op("Reshape", o, b.const(np.array([0, 0, -1], np.int64)))
        b.op("Identity", o, out="output")
    else:
        o = b.op("MatMul", b.op("Div", ex, den), v_in)
        b.op("Identity", _write_rows(b, o, 2) if rows else o, out="output")
    return _function("StofSparseAttention", ATTENTION_INPUTS, ["output"], b, ATTENTION_ATTRS, overload, opset,
                     "Masked sparse attention (docs/nodes.md). Portable fallback of the STOF kernels.")


# -- StofGemmEpilogue -----------------------------------------------------------------------------------------------
GEMM_ACTIVATIONS = ("none", "gelu_erf", "gelu_tanh")


def gemm_overload(activation: str, has_bias: bool = True, prefix: bool = False,
                  prefix_weights: bool = False) -> str:
    """The function overload of a StofGemmEpilogue node: its activation, "_nobias" appended without a bias,
    "_prefix" with the prefix rows input, "_prefixw" with the prefix rows and their own weights (and bias)."""
    if activation not in GEMM_ACTIVATIONS:
        raise ValueError(activation)
    return (activation + ("" if has_bias else "_nobias")
            + ("_prefixw" if prefix_weights else "_prefix" if prefix else ""))


def gemm_epilogue_function(opset: int, activation: str, has_bias: bool = True,
                           prefix: bool = False, prefix_weights: bool = False) -> onnx.FunctionProto:
    """Y = act(X·W + bias); gelu_erf: 0.5·y·(1 + erf(y/√2)); gelu_tanh: 0.5·y·(1 + tanh(√(2/π)·(y + 0.044715·y³))).
    With ``prefix`` (P [B, G, K], X [B, S, K]) the GEMM's rows are Concat(P, X) along axis 1: Y is [B, G+S, N];
    with ``prefix_weights`` the prefix rows are act(P·prefix_w + prefix_bias) instead.

    The attribute ``algo`` (the cuBLASLt algorithm the kernel runs) does not change the result: the body ignores it."""
    b = _Body(opset)

    def project(x, w, bias, out):
        y = b.op("Add", b.op("MatMul", x, w), bias, out=out if activation == "none" else None) if has_bias \
            else b.op("MatMul", x, w, out=out if activation == "none" else None)
        if activation == "gelu_erf":
            t = b.op("Add", b.op("Erf", b.op("Div", y, b.like(math.sqrt(2.0), y))), b.like(1.0, y))
            return b.op("Mul", b.op("Mul", y, t), b.like(0.5, y), out=out)
        if activation == "gelu_tanh":
            cube = b.op("Mul", b.op("Pow", y, b.like(3.0, y)), b.like(0.044715, y))
            t = b.op("Tanh", b.op("Mul", b.op("Add", y, cube), b.like(math.sqrt(2.0 / math.pi), y)))
            return b.op("Mul", b.op("Mul", y, b.like(0.5, y)), b.op("Add", t, b.like(1.0, y)), out=out)
        if activation != "none":
            raise ValueError(activation)
        return y

    if prefix_weights:
        b.op("Concat", project("prefix", "prefix_w", "prefix_bias", None), project("X", "W", "bias", None),
             axis=1, out="Y")
    else:
        project(b.op("Concat", "prefix", "X", axis=1) if prefix else "X", "W", "bias", "Y")
    # the prefix is input 3, after the optional bias (a call without a bias passes "" for it)
    if prefix_weights:
        inputs = GEMM_INPUTS + ["prefix", "prefix_w"] + (["prefix_bias"] if has_bias else [])
    else:
        inputs = GEMM_INPUTS + ["prefix"] if prefix else GEMM_INPUTS if has_bias else GEMM_INPUTS[:2]
    return _function("StofGemmEpilogue", inputs, ["Y"], b, ["activation", "algo"],
                     gemm_overload(activation, has_bias, prefix, prefix_weights), opset,
                     "MatMul + bias + activation (docs/nodes.md).")


# -- StofGlobalSlots -----------------------------------------------------------------------------------------------
GLOBAL_SLOTS_INPUTS = ["X", "mask", "global"]
GLOBAL_SLOTS_OUTPUTS = ["slot_x", "local_key_padding_mask", "global_key_padding_mask", "row_index"]


def global_slots_overload(slots: int) -> str:
    """The function overload of a StofGlobalSlots node: its slot count (a constant of the body)."""
    return f"g{int(slots)}"


def global_slots_function(opset: int, slots: int) -> onnx.FunctionProto:
    """X [B, S, N], mask [B, S] (< 0 = masked), global [B, S] int32 (non-zero = global) -> slot j = the j-th kept
    global token in position order (docs/nodes.md): slot_x [B, G, N] (X's rows, zeros when unused, NaN throughout
    when the sequence has more than G), local_key_padding_mask [B, G+S] int32 (slot used; then kept and not a kept
    global token), global_key_padding_mask [B, S] int32 (kept), row_index [B, G] int32 (the slot's position, -1
    when unused or overflowing).  A prefix count places each kept global token in its slot (ScatterElements into
    G + 1 columns, the last taking every other token)."""
    G = int(slots)
    b = _Body(opset)
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    ax0, ax1, ax2 = (b.const(np.array([a], np.int64)) for a in (0, 1, 2))
    keep = b.op("Not", b.op("Less", "mask", b.like(0.0, "mask")))                           # [B, S]
    kept_g = b.op("And", b.op("Cast", "global", to=TensorProto.BOOL), keep)
    kept_i = b.op("Cast", kept_g, to=i64)
    before = b.op("CumSum", kept_i, b.const(np.int64(1)), exclusive=1)
    count = b.reduce("ReduceSum", kept_i, [1])                                               # [B, 1]
    g = b.const(np.int64(G))
    slot_of = b.op("Where", kept_g, b.op("Min", before, g), g)                               # [B, S]
    shape = b.op("Shape", "mask")
    seq = b.op("Squeeze", b.op("Slice", shape, ax1, ax2), ax0)
    positions = b.op("Expand", b.op("Unsqueeze", b.op("Range", b.const(np.int64(0)), seq, b.const(np.int64(1))),
                                    ax0), shape)
    zeros = b.op("ConstantOfShape", b.op("Concat", b.op("Slice", shape, ax0, ax1),
                                         b.const(np.array([G + 1], np.int64)), axis=0),
                 value=numpy_helper.from_array(np.zeros(1, np.int64), name=""))
    idx = b.op("Slice", b.op("ScatterElements", zeros, slot_of, positions, axis=1), b.const(np.array([0], np.int64)),
               b.const(np.array([G], np.int64)), ax1)                                         # [B, G]
    used = b.op("Less", b.const(np.arange(G, dtype=np.int64)[None]), count)                  # [B, G]
    over = b.op("Greater", count, g)                                                         # [B, 1]
    rows = b.op("GatherND", "X", b.op("Unsqueeze", idx, ax2), batch_dims=1)                  # [B, G, N]
    rows = b.op("Where", b.op("Unsqueeze", used, ax2), rows, b.like(0.0, "X"))
    b.op("Where", b.op("Unsqueeze", over, ax2), b.like(math.nan, "X"), rows, out="slot_x")
    b.op("Cast", b.op("Concat", used, b.op("Xor", keep, kept_g), axis=1), to=i32, out="local_key_padding_mask")
    b.op("Cast", keep, to=i32, out="global_key_padding_mask")
    b.op("Cast", b.op("Where", b.op("And", used, b.op("Not", over)), idx, b.const(np.int64(-1))), to=i32,
         out="row_index")
    return _function("StofGlobalSlots", GLOBAL_SLOTS_INPUTS, GLOBAL_SLOTS_OUTPUTS, b, ["slots"],
                     global_slots_overload(G), opset, "Global tokens gathered into slots (docs/nodes.md).")


# -- StofPackTokens ------------------------------------------------------------------------------------------------
PACK_TOKENS_INPUTS = ["mask", "capacity"]
PACK_TOKENS_OUTPUTS = ["idx", "seq_offsets", "source_row"]


def pack_tokens_function(opset: int) -> onnx.FunctionProto:
    """mask [B, S] int32 (non-zero = real token), capacity [C] (its length only) -> the index arrays of padding
    removal into C' = min(C, B·S) token slots (docs/nodes.md): the real tokens in slots 0 .. T-1 in position order,
    then the padded positions; idx [C'] (each slot's flat position), seq_offsets [B+1] (clamped to C'),
    source_row [B·S] (a real token's slot, C' for a padded position, C' + 1 everywhere when T > C'); int32."""
    b = _Body(opset)
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    ax0 = b.const(np.array([0], np.int64))
    keep = b.op("Cast", "mask", to=TensorProto.BOOL)                                        # [B, S]
    lengths = b.reduce("ReduceSum", b.op("Cast", keep, to=i32), [1], keepdims=0)            # [B]
    offsets = b.op("Concat", b.const(np.zeros(1, np.int32)), b.op("CumSum", lengths, b.const(np.int64(0))),
                   axis=0)                                                                  # [B+1]
    flat = b.reduce("ReduceProd", b.op("Shape", "mask"), [0])                               # [1] B·S
    keep_flat = b.op("Reshape", keep, b.const(np.array([-1], np.int64)))
    keep_i64 = b.op("Cast", keep_flat, to=i64)
    one = b.const(np.int64(1))
    rank = b.op("Sub", b.op("CumSum", keep_i64, b.const(np.int64(0))), one)                 # of each real token
    cap = b.op("Min", b.op("Shape", "capacity"), flat)                                       # [1]
    cap_s = b.op("Squeeze", cap, ax0)
    tokens = b.reduce("ReduceSum", keep_i64, [0], keepdims=0)                                # T
    arange = b.op("Range", b.const(np.int64(0)), b.op("Squeeze", flat, ax0), one)          # [B·S]
    # padded position p goes after the real tokens: T + p - (real tokens up to p)
    pad_order = b.op("Sub", b.op("Add", tokens, arange), b.op("Add", rank, one))
    order = b.op("Where", keep_flat, rank, pad_order)                                        # a permutation
    perm = b.op("ScatterElements", arange, order, arange, axis=0)
    b.op("Cast", b.op("Slice", perm, ax0, cap, ax0), to=i32, out="idx")
    cap32 = b.op("Cast", cap_s, to=i32)
    b.op("Where", b.op("Greater", offsets, cap32), cap32, offsets, out="seq_offsets")
    row = b.op("Where", keep_flat, rank, cap_s)
    row = b.op("Where", b.op("Greater", tokens, cap_s), b.op("Add", cap_s, one), row)
    b.op("Cast", row, to=i32, out="source_row")
    return _function("StofPackTokens", PACK_TOKENS_INPUTS, PACK_TOKENS_OUTPUTS, b, [], "", opset,
                     "Padding removal's index arrays for a fixed token capacity (docs/nodes.md).")


# -- StofAddLayerNorm -----------------------------------------------------------------------------------------------
def add_layernorm_overload(has_bias: bool, has_sum: bool) -> str:
    return "_".join(p for p, on in (("bias", has_bias), ("sum", has_sum)) if on)


def add_layernorm_function(opset: int, has_bias: bool, has_sum: bool = False) -> onnx.FunctionProto:
    """S = (X + bias) + residual; Y = LayerNorm(S)·gamma + beta over the last axis; optional output 1 is S.

    The optional output is an overload too (ONNX shape inference rejects a function output the call omits)."""
    b = _Body(opset)
    x = b.op("Add", "X", "bias") if has_bias else "X"
    s = b.op("Add", x, "residual", out="sum" if has_sum else None)
    if opset >= 17:
        node = helper.make_node("LayerNormalization", [s, "gamma", "beta"], ["Y"], axis=-1)
        node.attribute.append(helper.make_attribute_ref("epsilon", onnx.AttributeProto.FLOAT, ref_attr_name="epsilon"))
        b.nodes.append(node)
    else:
        d = b.op("Sub", s, b.reduce("ReduceMean", s, [-1]))
        var = b.reduce("ReduceMean", b.op("Mul", d, d), [-1])
        std = b.op("Sqrt", b.op("Add", var, b.ref_float_like("epsilon", s)))
        b.op("Add", b.op("Mul", b.op("Div", d, std), "gamma"), "beta", out="Y")
    return _function("StofAddLayerNorm", ADDLN_INPUTS, ["Y", "sum"] if has_sum else ["Y"], b, ["epsilon"],
                     add_layernorm_overload(has_bias, has_sum), opset,
                     "Residual add + LayerNormalization (docs/nodes.md).")


def build_functions(needed: set[tuple[str, str]], opset: int,
                    specs: dict[str, str] | None = None) -> list[onnx.FunctionProto]:
    """The FunctionProtos for the (op_type, overload) pairs a rewritten model uses; ``specs`` maps the
    StofSparseAttention overloads that evaluate a layout_spec (spec_overload) to their spec."""
    out = []
    for op_type, overload in sorted(needed):
        if op_type == "StofSparseAttention":
            spec = (specs or {}).get(overload)
            base = overload.rsplit("spec", 1)[0].rstrip("_") if spec is not None else overload
            parts = base.split("_")
            out.append(sparse_attention_function(opset, "padding" in parts, "bias" in parts, "packed" in parts,
                                                 base == "varlen", spec=spec, overload=overload, kv="kv" in parts,
                                                 flat="flat" in parts, rows="rows" in parts,
                                                 view="view" in parts))
        elif op_type == "StofGemmEpilogue":
            suffix = next((x for x in ("_prefixw", "_prefix") if overload.endswith(x)), "")
            base = overload[:len(overload) - len(suffix)]
            act = base[:-len("_nobias")] if base.endswith("_nobias") else base
            out.append(gemm_epilogue_function(opset, act, not base.endswith("_nobias"), bool(suffix),
                                              suffix == "_prefixw"))
        elif op_type == "StofAddLayerNorm":
            out.append(add_layernorm_function(opset, "bias" in overload, "sum" in overload))
        elif op_type == "StofGlobalSlots":
            out.append(global_slots_function(opset, int(overload[1:])))
        elif op_type == "StofPackTokens":
            out.append(pack_tokens_function(opset))
        else:
            raise ValueError(op_type)
    return out
