"""ONNX Runtime's own attention operators at any sequence length: a model with a dynamic sequence axis whose
operator's pattern is closed-form (GroupQueryAttention's causal window, MultiHeadAttention / Attention with or
without ``unidirectional``, ONNX Attention's ``is_causal``), rewritten with no flags, carries the pattern as
layout_spec and runs through the ONNX function fallback past the compiled length (2048), equal there to the
original on ONNX Runtime's CPU kernel and to a float64 reference of the operator's documented semantics. A model
with a limit of its own keeps it; SparseAttention's block table is such a limit."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from models_util import TILE, assert_fused, layout_specs, run, session
from stof_trt.rewrite import rewrite_model
from stof_trt.rewrite.fuse_ort_gqa import window_spec
from test_rewrite_ort_ops import (_heads, _merge, _model, _softmax_attention, _vi, gqa_feeds, gqa_model,
                                  onnx_attention_model)

#: Past the default compiled length (2048) and not a tile multiple.
LONG = 2100


def _meta(model) -> dict:
    return {p.key: p.value for p in model.metadata_props}


def _grows(model, spec):
    assert layout_specs(model) == [spec]
    meta = _meta(model)
    assert "stof.max_seq_len" not in meta and meta["stof.compiled_seq_len"] == "2048", meta


def _close(got, want, rows):
    """Equal at every real query row (rows[b] of sequence b); padded rows are undefined in the operators."""
    for b, n in enumerate(rows):
        np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)


# -- GroupQueryAttention ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, 1, 7, 2060])
def test_gqa_grows_past_the_compiled_length(window):
    """No window (causal), a short one, and one wider than the compiled length (read from the attribute, not from
    the pattern at 2048, where it is causal): each node carries the window's own spec; at 2100 the rewritten model
    equals ORT's kernel and the float64 reference, the window cutting in past 2060 keys."""
    H, KV, D = 2, 1, 8
    model = gqa_model("batch", "seq", H, KV, D, window if window else -1)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "GroupQueryAttention": 0})
    _grows(new, window_spec(window))
    assert any("build their layouts at run time" in n for n in report.notes), report.notes
    rng = np.random.default_rng(window)
    lengths = [LONG, LONG - 61]
    feeds = gqa_feeds(rng, 2, LONG, H, KV, D, lengths)
    got = run(new, feeds)[0]
    _close(got, run(model, feeds)[0], lengths)
    q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
    k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
    i, j = np.arange(LONG)[:, None], np.arange(LONG)[None]
    allowed = (j <= i) & (((i - j) < window) if window > 0 else True)
    allowed = allowed[None, None] & (j < np.asarray(lengths)[:, None, None, None])
    _close(got, _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D))), lengths)


def test_gqa_below_a_position_table_keeps_its_limit():
    """A learned position table (100 rows, gathered by position) in front of GroupQueryAttention is the model's own
    limit: the node gets no layout_spec and the model keeps stof.max_seq_len 100."""
    H, KV, D, P = 2, 1, 8, 100
    model = gqa_model("batch", "seq", H, KV, D, 5)
    g = model.graph
    g.node[0].input[0] = "q_pos"
    table = np.random.default_rng(1).standard_normal((P, H * D)).astype(np.float32)
    g.initializer.extend([numpy_helper.from_array(table, "pos_table"),
                          numpy_helper.from_array(np.array([1], np.int64), "one"),
                          numpy_helper.from_array(np.array([2], np.int64), "two"),
                          numpy_helper.from_array(np.array(0, np.int64), "zero_s"),
                          numpy_helper.from_array(np.array(1, np.int64), "one_s")])
    pre = [helper.make_node("Shape", ["q"], ["q_shape"]),
           helper.make_node("Slice", ["q_shape", "one", "two"], ["seq_1"]),
           helper.make_node("Squeeze", ["seq_1"], ["seq_s"]),
           helper.make_node("Range", ["zero_s", "seq_s", "one_s"], ["positions"]),
           helper.make_node("Gather", ["pos_table", "positions"], ["pos"]),
           helper.make_node("Add", ["q", "pos"], ["q_pos"])]
    nodes = pre + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "GroupQueryAttention": 0})
    assert layout_specs(new) == [None] and _meta(new)["stof.max_seq_len"] == str(P)
    feeds = gqa_feeds(np.random.default_rng(2), 2, P, H, KV, D, [P, 60])
    _close(run(new, feeds)[0], run(model, feeds)[0], [P, 60])


# -- MultiHeadAttention / Attention (com.microsoft) -------------------------------------------------------------------
def mha_model(H, D, unidirectional):
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "kpm", "bias"], ["y"], domain="com.microsoft",
                            num_heads=H, unidirectional=unidirectional)
    ins = [_vi(n, TensorProto.FLOAT, ["B", "S", H * D]) for n in "qkv"]
    ins += [_vi("kpm", TensorProto.INT32, ["B"]), _vi("bias", TensorProto.FLOAT, ["B", 1, "S", "S"])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, ["B", "S", H * D])])


def attention_model(H, D, unidirectional, rng):
    N = H * D
    inits = [numpy_helper.from_array((rng.standard_normal((N, 3 * N)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(3 * N) * 0.1).astype(np.float32), "b")]
    node = helper.make_node("Attention", ["x", "w", "b", "kpm"], ["y"], domain="com.microsoft", num_heads=H,
                            unidirectional=unidirectional)
    ins = [_vi("x", TensorProto.FLOAT, ["B", "S", N]), _vi("kpm", TensorProto.INT32, ["B"])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, ["B", "S", N])], inits)


@pytest.mark.parametrize("op", ["MultiHeadAttention", "Attention"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_ort_attention_grows_past_the_compiled_length(op, unidirectional):
    """``unidirectional`` is causal (top-left: no past), else the layout is full; key lengths and attention_bias are
    run-time inputs. At 2100 the rewritten model equals ORT's kernel and the float64 reference."""
    H, D, B = 2, 8, 2
    rng = np.random.default_rng(10 + unidirectional)
    model = mha_model(H, D, unidirectional) if op == "MultiHeadAttention" else attention_model(H, D, unidirectional,
                                                                                              rng)
    new, _ = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, op: 0})
    _grows(new, "causal" if unidirectional else "full")
    lengths = np.array([LONG, LONG - 77], np.int32)
    feeds = {"kpm": lengths}
    if op == "MultiHeadAttention":
        feeds.update({n: rng.standard_normal((B, LONG, H * D)).astype(np.float32) for n in "qkv"})
        feeds["bias"] = rng.standard_normal((B, 1, LONG, LONG)).astype(np.float32)
        q, k, v = (_heads(feeds[n], H).astype(np.float64) for n in "qkv")
        bias = feeds["bias"].astype(np.float64)
    else:
        feeds["x"] = rng.standard_normal((B, LONG, H * D)).astype(np.float32)
        init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
        q, k, v = (_heads(t, H) for t in np.split(feeds["x"].astype(np.float64) @ init["w"] + init["b"], 3, -1))
        bias = 0.0
    got = run(new, feeds)[0]
    _close(got, run(model, feeds)[0], lengths)
    i, j = np.arange(LONG)[:, None], np.arange(LONG)[None]
    allowed = ((j <= i) if unidirectional else np.ones((LONG, LONG), bool))[None, None] & \
        (j < lengths[:, None, None, None])
    # the bias enters as an additive term: the reference adds it to the scores through q·kᵀ's scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(D) + bias
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = _merge(np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v))
    _close(got, ref, lengths)


# -- ONNX Attention (opset 23) --------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_onnx_attention_grows_past_the_compiled_length(causal):
    """``is_causal`` is the spec ``causal`` (top-left, as the ONNX spec aligns it), else full; grouped heads."""
    H, KV, D, B = 4, 2, 8, 2
    model = onnx_attention_model(23, three_d=True, H=H, KV=KV, causal=causal, nonpad=False)
    new, _ = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Attention": 0})
    _grows(new, "causal" if causal else "full")
    rng = np.random.default_rng(int(causal))
    feeds = {"q": rng.standard_normal((B, LONG, H * D)).astype(np.float32),
             "k": rng.standard_normal((B, LONG, KV * D)).astype(np.float32),
             "v": rng.standard_normal((B, LONG, KV * D)).astype(np.float32)}
    got = run(new, feeds)[0]
    q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
    k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
    i, j = np.arange(LONG)[:, None], np.arange(LONG)[None]
    allowed = ((j <= i) if causal else np.ones((LONG, LONG), bool))[None, None]
    np.testing.assert_allclose(got, _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D))), rtol=1e-4,
                               atol=1e-4)
    try:
        want = run(session(model), feeds)[0]
    except Exception as exc:  # noqa: BLE001 - an ONNX Runtime without this Attention version
        pytest.skip(f"ONNX Runtime cannot run the original: {str(exc)[:100]}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# -- SparseAttention: the block table is the operator's own limit ---------------------------------------------------
@pytest.mark.parametrize("nb,block", [(8, 8), (40, 64)])
def test_sparse_attention_compiles_for_its_block_table(nb, block):
    """A dynamic model with no max_seq_len is compiled for the nb·bs tokens the block table covers (below the default
    2048, where it used to be left alone, and above it, where it used to stop at 2048), with no layout_spec (not
    closed-form) and stof.max_seq_len nb·bs; at that length and a shorter one it equals the float64 reference, and
    one token more is an error."""
    from test_rewrite_ort_ops import local_stride_blocks, sparse_attention_model, sparse_attention_reference

    H, KV, D, L = 2, 1, 8, 2
    cover = nb * block
    blocks = local_stride_blocks(L, nb, 2, 3)
    model = sparse_attention_model("batch", "seq", H, KV, D, blocks, block, "max_seq")
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "SparseAttention": 0})
    assert report.to_dict()["attention"][0]["seq_q"] == cover
    assert layout_specs(new) == [None] and _meta(new)["stof.max_seq_len"] == str(cover)
    assert any(f"covers {nb} blocks of {block} tokens" in n for n in report.notes), report.notes
    sess = session(new)
    rng = np.random.default_rng(nb)

    def feeds(seq, lengths):
        return {"q": rng.standard_normal((2, seq, H * D)).astype(np.float32),
                "k": rng.standard_normal((2, seq, KV * D)).astype(np.float32),
                "v": rng.standard_normal((2, seq, KV * D)).astype(np.float32),
                "past_key": np.zeros((2, KV, cover, D), np.float32),
                "past_value": np.zeros((2, KV, cover, D), np.float32),
                "total": np.array([seq], np.int32), "key_lengths": np.array(lengths, np.int32)}

    for seq in sorted({cover, min(cover, LONG) - 13}):
        f = feeds(seq, [seq, seq // 2 + 1])
        _close(run(sess, f)[0], sparse_attention_reference(f, blocks, block, H, KV), [seq, seq // 2 + 1])
    with pytest.raises(Exception, match="exceeds_compiled_seq_q_seq_k"):
        run(sess, feeds(cover + 1, [cover + 1] * 2))


@pytest.mark.parametrize("L,H,nb,block,seq,tm,tn", [(1, 2, 10, 8, 77, 16, 32), (2, 4, 8, 8, 56, 16, 32),
                                                    (4, 8, 12, 16, 190, 64, 64), (4, 4, 9, 32, 260, 64, 32)])
def test_sparse_attention_layout_compiles_from_the_block_grid(L, H, nb, block, seq, tm, tn):
    """The layout compiled from the block grid (blocks ∧ causal, per-layout grids through a 3-D block layout) is
    exactly the dense definition's, random block tables included."""
    from stof_trt.format import TileLayout
    from stof_trt.rewrite.fuse_ort_sparse_attention import block_causal_dense, block_causal_layout
    from stof_trt.rewrite.ort_contrib import layout_per_head

    rng = np.random.default_rng(nb * L)
    blocks = rng.random((L, nb, nb)) < 0.4
    want = layout_per_head(TileLayout.from_dense(block_causal_dense(blocks, block, seq), tm, tn, mask_spec="graph"),
                           H)
    got = block_causal_layout(blocks, block, seq, tm, tn, H)
    assert got.signature() == want.signature() and got.num_layouts == want.num_layouts
    assert got.mask_spec == "graph"


# -- several layers of CPU-less operators with a dynamic sequence axis -----------------------------------------------
def _second_layer(model, node_op, inputs):
    """``model`` with a second ``node_op`` node after the first, reading the first's output (same attributes and
    weights), its output the graph's."""
    g = model.graph
    first = g.node[0]
    second = helper.make_node(node_op, inputs, ["y2"] + [f"{o}_2" for o in first.output[1:]], domain="com.microsoft")
    second.attribute.extend(first.attribute)
    for i in range(1, len(first.output)):
        first.output[i] = first.output[i] + "_1"
    g.node.append(second)
    g.output[0].name = "y2"
    return model


def test_two_sparse_attention_layers_with_a_dynamic_axis():
    """The shape probe runs past the first SparseAttention (ONNX Runtime's CPU cannot run it as a plain node: it
    stands in as an Identity of its query there), so both layers are rewritten with no flags, compiled for the
    block table; the model equals the chained float64 reference."""
    from test_rewrite_ort_ops import local_stride_blocks, sparse_attention_model, sparse_attention_reference

    H, D, nb, block = 2, 8, 8, 8
    blocks = local_stride_blocks(2, nb, 2, 3)
    model = sparse_attention_model("batch", "seq", H, H, D, blocks, block, "max_seq")
    model = _second_layer(model, "SparseAttention", ["y", "y", "y", "past_key", "past_value", "block_row_indices",
                                                     "block_col_indices", "total", "key_lengths"])
    model.graph.input[3].type.tensor_type.shape.dim[1].dim_value = H   # past buffers: H K/V heads
    model.graph.input[4].type.tensor_type.shape.dim[1].dim_value = H
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "SparseAttention": 0})
    assert _meta(new)["stof.max_seq_len"] == str(nb * block)
    rng = np.random.default_rng(21)
    for seq in (nb * block, 41):
        lengths = [seq, seq - 9]
        f = {n: rng.standard_normal((2, seq, H * D)).astype(np.float32) for n in "qkv"}
        f.update(total=np.array([seq], np.int32), key_lengths=np.array(lengths, np.int32),
                 past_key=np.zeros((2, H, nb * block, D), np.float32),
                 past_value=np.zeros((2, H, nb * block, D), np.float32))
        y1 = sparse_attention_reference(f, blocks, block, H, H)
        want = sparse_attention_reference(dict(f, q=y1, k=y1, v=y1), blocks, block, H, H)
        got = run(new, f)[0]
        # padded rows of the first layer are keys the second layer masks: only real rows are compared
        _close(got, want, lengths)


def test_two_longformer_layers_with_a_dynamic_axis():
    """Two LongformerAttention layers (CUDA-only) with a dynamic sequence axis rewrite with no flags: the shape
    probe runs past the first; the model equals the chained float64 reference."""
    from test_rewrite_ort_ops import longformer_model, longformer_reference

    B, S, H, D, W = 2, 48, 2, 8, 4
    rng = np.random.default_rng(22)
    model = longformer_model(B, S, H, D, W, rng)
    for t in (*model.graph.input, *model.graph.output):
        t.type.tensor_type.shape.dim[1].dim_param = "seq"
    model = _second_layer(model, "LongformerAttention", ["y", "w", "b", "mask", "wg", "bg", "global"])
    new, _ = rewrite_model(model, max_seq_len=S, **TILE)
    assert_fused(new, {"StofSparseAttention": 4, "LongformerAttention": 0})
    for seq in (S, 24):
        glob = np.zeros((B, seq), np.int32)
        glob[0, [0, seq - 1]] = 1
        glob[1, :3] = 1
        f = {"x": rng.standard_normal((B, seq, H * D)).astype(np.float32), "mask": np.zeros((B, seq), np.float32),
             "global": glob}
        y1 = longformer_reference(model, f, H, W)
        want = longformer_reference(model, dict(f, x=y1), H, W)
        np.testing.assert_allclose(run(new, f)[0], want, rtol=1e-4, atol=1e-4)
