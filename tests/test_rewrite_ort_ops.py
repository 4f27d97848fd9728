"""ONNX Runtime's own attention operators as rewrite inputs: GroupQueryAttention (local_window_size),
SparseAttention, LongformerAttention, MultiHeadAttention with attention_bias / key_padding_mask.

Where ONNX Runtime has a CPU kernel (GroupQueryAttention, MultiHeadAttention) the rewritten model is compared with
the original; SparseAttention and LongformerAttention are CUDA-only, so the rewritten model (function fallback on
CPU) is compared with a float64 NumPy reference of the operator's documented semantics."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite import rewrite_model
from models_util import TILE, assert_fused, op_counts, run

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def _model(nodes, inputs, outputs, inits=()):
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=OPSETS)
    model.ir_version = 9
    return model


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _softmax_attention(q, k, v, allowed, scale):
    """float64 reference: q [B,H,Sq,D], k/v [B,H,Sk,D], allowed bool broadcastable to [B,H,Sq,Sk]; rows with no
    allowed key give 0."""
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    s = np.where(allowed, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.where(allowed, np.exp(s - mx), 0.0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)
    return np.einsum("bhqk,bhkd->bhqd", p, v.astype(np.float64))


def _heads(x, h):
    b, s, n = x.shape
    return x.reshape(b, s, h, n // h).transpose(0, 2, 1, 3)


def _merge(x):
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


# -- GroupQueryAttention --------------------------------------------------------------------------------------------
def gqa_model(B, S, H, KV, D, window, scale=None):
    attrs = dict(num_heads=H, kv_num_heads=KV, local_window_size=window)
    if scale is not None:
        attrs["scale"] = scale
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], ["y"],
                            domain="com.microsoft", **attrs)
    ins = [_vi("q", TensorProto.FLOAT, [B, S, H * D]), _vi("k", TensorProto.FLOAT, [B, S, KV * D]),
           _vi("v", TensorProto.FLOAT, [B, S, KV * D]), _vi("seqlens_k", TensorProto.INT32, [B]),
           _vi("total", TensorProto.INT32, [])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, [B, S, H * D])])


def gqa_feeds(rng, B, S, H, KV, D, lengths):
    return {"q": rng.standard_normal((B, S, H * D)).astype(np.float32),
            "k": rng.standard_normal((B, S, KV * D)).astype(np.float32),
            "v": rng.standard_normal((B, S, KV * D)).astype(np.float32),
            "seqlens_k": np.asarray(lengths, np.int32) - 1, "total": np.array(S, np.int32)}


@pytest.mark.parametrize("H,KV,window", [(4, 2, 7), (4, 1, 0), (4, 4, 16), (8, 2, 33)])
def test_gqa_local_window_matches_ort(H, KV, window):
    B, S, D = 2, 40, 8
    model = gqa_model(B, S, H, KV, D, window if window else -1)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "GroupQueryAttention": 0})
    a = report.to_dict()["attention"][0]
    assert a["key_padding"] and "causal" in a["mask_source"]
    if window > 0:
        assert f"local_window_size {window}" in a["mask_source"] and a["density"] < 0.6
    rng = np.random.default_rng(H * 100 + window)
    for lengths in ([S, S], [S, 23]):
        feeds = gqa_feeds(rng, B, S, H, KV, D, lengths)
        want, got = run(model, feeds)[0], run(new, feeds)[0]
        for b, n in enumerate(lengths):  # rows past a sequence's length are padding (undefined in the op)
            np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)
        # and the original itself against the documented semantics, so both cannot be wrong together
        q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
        k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
        i, j = np.arange(S)[:, None], np.arange(S)[None]
        allowed = (j <= i) & (((i - j) < window) if window > 0 else True)
        allowed = allowed[None, None] & (j < np.asarray(lengths)[:, None, None, None])
        ref = _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D)))
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b, :n], ref[b, :n], rtol=1e-4, atol=1e-4)


def test_gqa_scale_attribute_and_kv_cache_left_alone():
    B, S, H, KV, D = 1, 24, 4, 2, 8
    model = gqa_model(B, S, H, KV, D, 5, scale=0.3)
    new, report = rewrite_model(model, **TILE)
    assert report.to_dict()["attention"][0]["scale"] == pytest.approx(0.3)
    feeds = gqa_feeds(np.random.default_rng(9), B, S, H, KV, D, [S])
    np.testing.assert_allclose(run(new, feeds)[0], run(model, feeds)[0], rtol=1e-4, atol=1e-4)
    # a KV cache: left alone with the reason
    cache = model
    node = cache.graph.node[0]
    node.input[3], node.input[4] = "pk", "pv"
    cache.graph.input.extend([_vi("pk", TensorProto.FLOAT, [B, KV, 0, D]), _vi("pv", TensorProto.FLOAT, [B, KV, 0, D])])
    new2, report2 = rewrite_model(cache, **TILE)
    assert op_counts(new2)["GroupQueryAttention"] == 1
    assert any("KV cache" in s["reason"] for s in report2.to_dict()["left_alone"])
