"""Attention-core pattern variants on tiny hand-built graphs (one builder, variant flags)."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite import rewrite_model
from models_util import TILE, assert_fused, assert_parity, op_counts

B, H, S, D = 2, 4, 24, 8


def core_graph(*, key_layout="bshd", scale="mul_scores", mask="add_input", probs_output=False, rank3=False,
               softmax_axis=-1):
    """Q [B,H,S,D], K, V graph inputs -> decomposed attention core -> output [B,H,S,D].

    key_layout: "bhsd" (Transpose perm 0,1,3,2), "bshd" (Transpose perm 0,2,3,1), "kt" (Kᵀ [B,H,D,S] is the input).
    scale: "mul_scores", "div_scores", "qk_sqrt" (Q and K each times sqrt(scale)), "computed" (Div by
    Sqrt(Cast(Shape(Q)[-1]))), "none". mask: "add_input" (additive [B,1,S,S] input), "where_causal" (Where with a
    causal constant), "none". ``probs_output`` also outputs the probabilities; ``rank3`` uses [B·H, S, D]."""
    nodes, inits = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op, ins, out, **kw):
        nodes.append(helper.make_node(op, ins, [out], **kw))
        return out

    shp = {"bhsd": [B, H, S, D], "bshd": [B, S, H, D], "kt": [B, H, D, S]}[key_layout]
    qshape = [B * H, S, D] if rank3 else [B, H, S, D]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, qshape),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [B * H, D, S] if rank3 else shp),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, qshape)]
    q, k = "q", "k"
    s = 1 / math.sqrt(D)
    if scale == "qk_sqrt":
        q = node("Mul", [q, const("sq", np.float32(math.sqrt(s)))], "q_s")
        k = node("Mul", [k, const("sk", np.float32(math.sqrt(s)))], "k_s")
    if not rank3:
        if key_layout == "bhsd":
            k = node("Transpose", [k], "kt", perm=[0, 1, 3, 2])
        elif key_layout == "bshd":
            k = node("Transpose", [k], "kt", perm=[0, 2, 3, 1])
    x = node("MatMul", [q, k], "qk")
    if scale == "mul_scores":
        x = node("Mul", [x, const("scale", np.float32(s))], "scaled")
    elif scale == "div_scores":
        x = node("Div", [x, const("scale", np.float32(math.sqrt(D)))], "scaled")
    elif scale == "computed":
        d = node("Gather", [node("Shape", ["q"], "qshape"), const("last", np.int64(-1))], "d")
        r = node("Sqrt", [node("Cast", [d], "df", to=TensorProto.FLOAT)], "sqrt_d")
        x = node("Div", [x, r], "scaled")
    if mask == "add_input":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [B, 1, S, S]))
        x = node("Add", [x, "bias"], "masked")
    elif mask == "where_causal":
        c = const("causal", np.tril(np.ones((S, S), bool)))
        x = node("Where", [c, x, const("fill", np.float32(-1e9))], "masked")
    elif mask == "where_input":  # a general boolean mask input, masked_fill style with a finite fill
        inputs.append(helper.make_tensor_value_info("banned", TensorProto.BOOL, [B, 1, S, S]))
        x = node("Where", ["banned", const("fill", np.float32(-1e9)), x], "masked")
    elif mask == "where_per_head":  # masked_fill style: True = masked, a different band per head
        rel = np.arange(S)[:, None] - np.arange(S)[None, :]
        banned = np.stack([np.abs(rel) > h + 1 for h in range(H)])[None]
        x = node("Where", [const("banned", banned), const("fill", np.float32(-np.inf)), x], "masked")
    p = node("Softmax", [x], "probs", axis=softmax_axis)
    node("MatMul", [p, "v"], "out")
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, qshape)]
    if probs_output:
        outputs.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, [B, H, S, S]))
    model = helper.make_model(helper.make_graph(nodes, "core", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    if "banned" in feeds:
        feeds["banned"] = (rng.random((B, 1, S, S)) < 0.5) & ~np.eye(S, dtype=bool)
    if "bias" in feeds:
        feeds["bias"] = np.where(rng.random(feeds["bias"].shape) < 0.3, -1e9, feeds["bias"]).astype(np.float32)
    return feeds


@pytest.mark.parametrize("key_layout", ["bhsd", "bshd", "kt"])
@pytest.mark.parametrize("scale", ["mul_scores", "div_scores", "qk_sqrt", "computed", "none"])
def test_core_variants(key_layout, scale):
    model = core_graph(key_layout=key_layout, scale=scale)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Softmax": 0, "MatMul": 0})
    a = report.to_dict()["attention"][0]
    assert a["scale"] == pytest.approx(1.0 if scale == "none" else 1 / math.sqrt(D), rel=1e-6)
    assert a["attn_bias"]  # a general additive bias input stays exact
    assert_parity(model, new, _feeds(model))


def test_where_causal_constant_becomes_static_layout():
    model = core_graph(mask="where_causal")
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Where": 0})
    a = report.to_dict()["attention"][0]
    assert a["mask_source"] == "graph causal" and not a["attn_bias"]
    assert_parity(model, new, _feeds(model))


def test_general_boolean_where_mask_kept_as_bias():
    model = core_graph(mask="where_input")
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1})
    a = report.to_dict()["attention"][0]
    assert a["attn_bias"] and not a["key_padding"] and a["density"] == 1.0
    assert_parity(model, new, _feeds(model))


def test_per_head_static_pattern_gives_one_layout_per_head():
    model = core_graph(mask="where_per_head")
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Where": 0})
    a = report.to_dict()["attention"][0]
    assert a["num_layouts"] == H and "per-head" in a["mask_source"] and not a["attn_bias"]
    assert_parity(model, new, _feeds(model))


@pytest.mark.parametrize("flags,reason", [
    (dict(probs_output=True), "used elsewhere"),
    (dict(rank3=True, scale="none", mask="none"), "4-D"),
])
def test_unsupported_core_left_alone(flags, reason):
    model = core_graph(**flags)
    new, report = rewrite_model(model, **TILE)
    assert op_counts(new) == op_counts(model) and "StofSparseAttention" not in op_counts(new)
    left = report.to_dict()["left_alone"]
    assert any(reason in s["reason"] for s in left), left
    assert_parity(model, new, _feeds(model), atol=0)


def test_softmax_not_on_last_axis_not_matched():
    model = core_graph(softmax_axis=2, mask="none")
    new, report = rewrite_model(model, **TILE)
    assert "StofSparseAttention" not in op_counts(new) and report.count("attention_core") == 0
