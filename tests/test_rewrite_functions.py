"""The model-local ONNX functions (the portable fallback) against NumPy references of docs/nodes.md."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite.functions import (add_layernorm_function, add_layernorm_overload, attention_overload,
                                     gemm_epilogue_function, sparse_attention_function)
from models_util import session
from stof_trt.format import STOF_FORMAT_VERSION, TileLayout, compile_mask


def reference_attention(q, k, v, allowed, scale, bias=None):
    s = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        s = s + bias
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    e = np.exp(s - m)
    d = e.sum(-1, keepdims=True)
    return (e / np.where(d == 0, 1, d)) @ v


def attention_node(layout: TileLayout, ins, **attrs):
    """A StofSparseAttention node over `layout` (scale 0.37) with the given inputs and extra attributes."""
    return helper.make_node("StofSparseAttention", ins, ["o"], domain="stof", scale=0.37, tile_m=layout.tile_m,
                            tile_n=layout.tile_n, seq_q=layout.seq_q, seq_k=layout.seq_k,
                            num_layouts=layout.num_layouts, format_version=STOF_FORMAT_VERSION,
                            mask_spec=layout.mask_spec, **attrs)


def attention_model(layout: TileLayout, opset: int, padding: bool, bias: bool, dtype=TensorProto.FLOAT, H=4, D=8):
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    ins = ["q", "k", "v", *layout.arrays()] + (["kpm"] if padding else [""] if bias else []) + (["b"] if bias else [])
    node = attention_node(layout, ins)
    node.overload = attention_overload(padding, bias)
    gin = [helper.make_tensor_value_info(n, dtype, ["b", H, "s", D]) for n in "qkv"]
    if padding:
        gin.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, ["b", "s"]))
    if bias:
        gin.append(helper.make_tensor_value_info("b", dtype, ["b", 1, "s", "s"]))
    graph = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info("o", dtype, ["b", H, "s", D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("stof", 1)],
                              functions=[sparse_attention_function(opset, padding, bias)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("opset", [15, 17, 18, 23])
@pytest.mark.parametrize("spec,tiles", [("causal", (16, 32)), ("sliding:window=5", (32, 32)),
                                        ("bigbird:block=16,window=1,global=1,random=0.3,seed=1", (16, 64))])
@pytest.mark.parametrize("padding,bias", [(False, False), (True, False), (False, True), (True, True)])
def test_sparse_attention_function(opset, spec, tiles, padding, bias):
    S, B, H, D = 45, 2, 4, 8
    layout = compile_mask(spec, S, S, tile_m=tiles[0], tile_n=tiles[1])
    sess = session(attention_model(layout, opset, padding, bias))
    rng = np.random.default_rng(0)
    for s in (S, 30):  # run-time length below the compiled one: the top-left corner
        q, k, v = (rng.standard_normal((B, H, s, D)).astype(np.float32) for _ in range(3))
        feeds = {"q": q, "k": k, "v": v}
        allowed = layout.to_dense()[0][:s, :s][None, None]
        if padding:
            kpm = (rng.random((B, s)) < 0.7).astype(np.int32) * rng.integers(1, 5, (B, s)).astype(np.int32)
            kpm[1] = 0  # batch row 1: every key dropped -> zeros, not NaN
            feeds["kpm"] = kpm
            allowed = allowed & (kpm[:, None, None, :] != 0)
        b = None
        if bias:
            b = feeds["b"] = rng.standard_normal((B, 1, s, s)).astype(np.float32)
        out = sess.run(None, feeds)[0]
        ref = reference_attention(q, k, v, allowed, np.float32(0.37), b)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, atol=2e-5)
        if padding:
            assert not out[1].any()


def test_per_head_layouts_and_empty_layout():
    S, B, H, D = 40, 2, 4, 8
    rng = np.random.default_rng(1)
    dense = rng.random((2, S, S)) < 0.3  # two layouts: head h uses layout h % 2
    dense[0, 5] = False  # a query row with no key at all
    layout = TileLayout.from_dense(dense, 16, 32)
    sess = session(attention_model(layout, 17, False, False, H=H))
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(3))
    out = sess.run(None, {"q": q, "k": k, "v": v})[0]
    allowed = dense[np.arange(H) % 2][None]
    np.testing.assert_allclose(out, reference_attention(q, k, v, allowed, np.float32(0.37)), atol=2e-5)
    assert not out[:, 0, 5].any() and not out[:, 2, 5].any() and out[:, 1, 5].any()
    empty = TileLayout.from_dense(np.zeros((S, S), bool), 16, 32)
    assert empty.nnz == 0
    out = session(attention_model(empty, 17, False, False)).run(None, {"q": q, "k": k, "v": v})[0]
    assert not out.any()


def test_sparse_attention_function_float16():
    S, B, H, D = 33, 1, 4, 8
    layout = compile_mask("causal", S, S, tile_m=16, tile_n=32)
    sess = session(attention_model(layout, 17, True, False, dtype=TensorProto.FLOAT16))
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(np.float16) for _ in range(3))
    kpm = np.ones((B, S), np.int32)
    out = sess.run(None, {"q": q, "k": k, "v": v, "kpm": kpm})[0]
    assert out.dtype == np.float16
    ref = reference_attention(*(t.astype(np.float32) for t in (q, k, v)), layout.to_dense()[0][None, None],
                              np.float32(0.37))
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=5e-3)


@pytest.mark.parametrize("activation", ["none", "gelu_erf", "gelu_tanh"])
def test_gemm_epilogue_function(activation):
    rng = np.random.default_rng(3)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 8), (8, 16), (16,)))
    node = helper.make_node("StofGemmEpilogue", ["x", "w", "b"], ["y"], domain="stof", activation=activation)
    node.overload = activation
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)],
                              functions=[gemm_epilogue_function(17, activation)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    y = session(model).run(None, {"x": x})[0]
    z = x @ w + b
    ref = {"none": z, "gelu_erf": 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2))),
           "gelu_tanh": 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))}[activation]
    np.testing.assert_allclose(y, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opset", [16, 17])
@pytest.mark.parametrize("has_bias,has_sum", [(False, False), (True, False), (False, True), (True, True)])
def test_add_layernorm_function(opset, has_bias, has_sum):
    rng = np.random.default_rng(4)
    x, r = (rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(2))
    g, be, bi = (rng.standard_normal(8).astype(np.float32) for _ in range(3))
    ins = ["x", "r", "g", "be"] + (["bi"] if has_bias else [])
    outs = ["y"] + (["s"] if has_sum else [])
    node = helper.make_node("StofAddLayerNorm", ins, outs, domain="stof", epsilon=1e-3)
    node.overload = add_layernorm_overload(has_bias, has_sum)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 8])
                                            for n in ("x", "r")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 8]) for n in outs],
                              [numpy_helper.from_array(a, n) for a, n in ((g, "g"), (be, "be"), (bi, "bi"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("stof", 1)],
                              functions=[add_layernorm_function(opset, has_bias, has_sum)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    res = session(model).run(None, {"x": x, "r": r})
    s = (x + bi if has_bias else x) + r
    mu, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
    np.testing.assert_allclose(res[0], (s - mu) / np.sqrt(var + 1e-3) * g + be, atol=1e-5)
    if has_sum:
        np.testing.assert_allclose(res[1], s, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seq=st.integers(1, 70), tile_m=st.sampled_from([16, 32, 48]), tile_n=st.sampled_from([32, 64]),
       layouts=st.sampled_from([1, 2]), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_sparse_attention_function_random_masks(seq, tile_m, tile_n, layouts, density, seed):
    """Property: for any mask and tile size the function decodes the layout exactly (docs/format.md)."""
    rng = np.random.default_rng(seed)
    dense = rng.random((layouts, seq, seq)) < density
    if rng.random() < 0.3:  # whole tiles on / off too
        dense[:, : seq // 2, : seq // 3] = rng.random() < 0.5
    layout = TileLayout.from_dense(dense, tile_m, tile_n)
    q, k, v = (rng.standard_normal((1, 4, seq, 8)).astype(np.float32) for _ in range(3))
    out = session(attention_model(layout, 18, False, False)).run(None, {"q": q, "k": k, "v": v})[0]
    allowed = dense[np.arange(4) % layouts][None]
    np.testing.assert_allclose(out, reference_attention(q, k, v, allowed, np.float32(0.37)), atol=2e-5)


def test_sparse_attention_function_cross_lengths():
    """Sq != Sk (cross attention): the top-left [Sq, Sk] corner of a rectangular layout."""
    rng = np.random.default_rng(5)
    dense = rng.random((30, 50)) < 0.4
    layout = TileLayout.from_dense(dense, 16, 32)
    sess = session(attention_model(layout, 17, True, False))
    q = rng.standard_normal((2, 4, 20, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 4, 45, 8)).astype(np.float32) for _ in range(2))
    kpm = np.ones((2, 45), np.int32)
    kpm[1, 30:] = 0
    out = sess.run(None, {"q": q, "k": k, "v": v, "kpm": kpm})[0]
    allowed = dense[:20, :45][None, None] & (kpm[:, None, None, :] != 0)
    np.testing.assert_allclose(out, reference_attention(q, k, v, allowed, np.float32(0.37)), atol=2e-5)


@pytest.mark.parametrize("padding", [False, True])
def test_sparse_attention_function_query_with_packed_kv(padding):
    """qkv_format "bshd_kv": query [B, Sq, H, D] apart from one [B, Sk, 2, Hkv, D] tensor of K and V (Sq != Sk,
    grouped K/V heads), output [B, Sq, H, D]."""
    rng = np.random.default_rng(6)
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 20, 45, 8
    dense = rng.random((30, 50)) < 0.4
    layout = TileLayout.from_dense(dense, 16, 32)
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    ins = ["q", "kv", "", *layout.arrays()] + (["kpm"] if padding else [])
    node = attention_node(layout, ins, qkv_format="bshd_kv")
    node.overload = attention_overload(padding, False, kv=True)
    assert node.overload == ("kv_padding" if padding else "kv")
    gin = [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", "sq", H, D]),
           helper.make_tensor_value_info("kv", TensorProto.FLOAT, ["b", "sk", 2, Hkv, D])]
    if padding:
        gin.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, ["b", "sk"]))
    graph = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                                               ["b", "sq", H, D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)],
                              functions=[sparse_attention_function(17, padding, False, kv=True)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, Sk, 2, Hkv, D)).astype(np.float32)
    feeds = {"q": q, "kv": kv}
    keep = np.ones((B, Sk), bool)
    if padding:
        keep[1, 30:] = False
        feeds["kpm"] = keep.astype(np.int32)
    out = session(model).run(None, feeds)[0]
    assert out.shape == (B, Sq, H, D)
    # K/V head h // (H / Hkv) for query head h
    k, v = (np.repeat(kv[:, :, i].transpose(0, 2, 1, 3), H // Hkv, axis=1) for i in range(2))
    allowed = dense[:Sq, :Sk][None, None] & keep[:, None, None, :]
    want = reference_attention(q.transpose(0, 2, 1, 3), k, v, allowed, np.float32(0.37)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("padding", [False, True])
def test_sparse_attention_function_windows_of_one_row_tensor(padding):
    """query_view / key_view: Q and K/V are windows of one [B, R, C] tensor (a projection GEMM's output), K/V with
    fewer heads; rows -1 reads to the end; the output is [B, Sq, H·D]."""
    rng = np.random.default_rng(3)
    B, H, Hkv, D, R = 2, 4, 2, 8, 37
    q0, Sq, q_col = 5, 20, 16          # Q: rows 5..24, columns 16..47
    k0, k_col = 7, 50                  # K/V: rows 7..36 (to the end), columns 50..81
    Sk = R - k0
    C = k_col + 2 * Hkv * D + 3
    dense = rng.random((32, 32)) < 0.5
    layout = TileLayout.from_dense(dense, 16, 32)
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    ins = ["m", "m", "", *layout.arrays()] + (["kpm"] if padding else [])
    node = attention_node(layout, ins, qkv_format="bshd_kv", num_heads=H, query_view=[q0, Sq, q_col, H * D],
                          key_view=[k0, -1, k_col, 2 * Hkv * D])
    node.overload = attention_overload(padding, False, kv=True, flat=True, view=True)
    assert node.overload == ("kv_flat_view_padding" if padding else "kv_flat_view")
    gin = [helper.make_tensor_value_info("m", TensorProto.FLOAT, ["b", "r", C])]
    if padding:
        gin.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, ["b", "sk"]))
    graph = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                                               ["b", "sq", H * D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)],
                              functions=[sparse_attention_function(17, padding, False, kv=True, flat=True,
                                                                   view=True)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    m = rng.standard_normal((B, R, C)).astype(np.float32)
    feeds = {"m": m}
    keep = np.ones((B, Sk), bool)
    if padding:
        keep[1, 20:] = False
        feeds["kpm"] = keep.astype(np.int32)
    out = session(model).run(None, feeds)[0]
    assert out.shape == (B, Sq, H * D)
    q = m[:, q0:q0 + Sq, q_col:q_col + H * D].reshape(B, Sq, H, D).transpose(0, 2, 1, 3)
    kv = m[:, k0:, k_col:k_col + 2 * Hkv * D].reshape(B, Sk, 2, Hkv, D)
    k, v = (np.repeat(kv[:, :, i].transpose(0, 2, 1, 3), H // Hkv, axis=1) for i in range(2))
    allowed = dense[:Sq, :Sk][None, None] & keep[:, None, None, :]
    want = reference_attention(q, k, v, allowed, np.float32(0.37)).transpose(0, 2, 1, 3).reshape(B, Sq, H * D)
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("activation", ["none", "gelu_tanh"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gemm_epilogue_function_prefix_rows_with_their_own_weights(activation, has_bias):
    """_prefixw: Y = Concat(act(P·prefix_w + prefix_bias), act(X·W + bias)) along the rows."""
    from stof_trt.rewrite.functions import gemm_overload

    rng = np.random.default_rng(4)
    B, G, S, K, N = 2, 3, 5, 6, 7
    feeds = {"x": rng.standard_normal((B, S, K)).astype(np.float32),
             "p": rng.standard_normal((B, G, K)).astype(np.float32)}
    w, pw = (rng.standard_normal((K, N)).astype(np.float32) for _ in range(2))
    b, pb = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(pw, "pw")]
    if has_bias:
        inits += [numpy_helper.from_array(b, "bias"), numpy_helper.from_array(pb, "pb")]
    node = helper.make_node("StofGemmEpilogue", ["x", "w", "bias" if has_bias else "", "p", "pw"]
                            + (["pb"] if has_bias else []), ["y"], domain="stof", activation=activation)
    node.overload = gemm_overload(activation, has_bias, prefix=True, prefix_weights=True)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", S, K]),
                                            helper.make_tensor_value_info("p", TensorProto.FLOAT, ["b", G, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", G + S, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)],
                              functions=[gemm_epilogue_function(17, activation, has_bias, True, True)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)

    def act(y):
        if activation == "none":
            return y
        return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))

    want = np.concatenate([act(feeds["p"] @ pw + (pb if has_bias else 0)),
                           act(feeds["x"] @ w + (b if has_bias else 0))], axis=1)
    np.testing.assert_allclose(session(model).run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)
