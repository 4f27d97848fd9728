"""ONNX ``Attention`` (opset 23) and ORT-optimizer-produced com.microsoft Attention / MultiHeadAttention."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite import rewrite_model
from models_util import TILE, assert_fused, assert_parity, exported, op_counts, padding_mask, token_feeds

B, H, D = 2, 4, 8


def onnx_attention_model(*, three_d=False, mask=None, causal=False, kv_heads=None, past=False, scale=None):
    """A graph around one ONNX Attention node with dynamic batch / sequence axes.

    ``mask``: None; "bool_input" / "float_input" (a [B,1,S,S] graph input); "padding" (bool [B,1,1,S] computed
    in the graph from a [B,S] int64 input)."""
    shp = ["batch", "seq", H * D] if three_d else ["batch", H, "seq", D]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shp) for n in "qkv"]
    if kv_heads:
        inputs[1] = helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", "seq", kv_heads * D])
        inputs[2] = helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", "seq", kv_heads * D])
    names, nodes, inits = ["q", "k", "v"], [], []
    attrs = {}
    if three_d:
        attrs.update(q_num_heads=H, kv_num_heads=kv_heads or H)
    if causal:
        attrs["is_causal"] = 1
    if scale is not None:
        attrs["scale"] = scale
    if mask in ("bool_input", "float_input"):
        dt = TensorProto.BOOL if mask == "bool_input" else TensorProto.FLOAT
        inputs.append(helper.make_tensor_value_info("m", dt, ["batch", 1, "seq", "seq"]))
        names.append("m")
    elif mask == "padding":
        inputs.append(helper.make_tensor_value_info("pad", TensorProto.INT64, ["batch", "seq"]))
        inits.append(numpy_helper.from_array(np.array([1, 2], np.int64), "axes12"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
        nodes += [helper.make_node("Cast", ["pad"], ["padb"], to=TensorProto.BOOL),
                  helper.make_node("Unsqueeze", ["padb", "axes12"], ["m1"]),
                  helper.make_node("Shape", ["pad"], ["bsz"], end=1),
                  helper.make_node("Shape", ["pad"], ["sz"], start=1),
                  helper.make_node("Concat", ["bsz", "one", "sz", "sz"], ["full"], axis=0),
                  helper.make_node("Expand", ["m1", "full"], ["m"])]  # ORT wants [B, 1, Sq, Sk]
        names.append("m")
    outputs = ["y"]
    if past:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", H, "past", D]) for n in ("pk", "pv")]
        names += [""] * (4 - len(names)) + ["pk", "pv"]
        outputs += ["present_k", "present_v"]
    nodes.append(helper.make_node("Attention", names, outputs, **attrs))
    out_shape = shp
    graph = helper.make_graph(nodes, "attn", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None if o != "y" else out_shape)
                               for o in outputs][:1] + ([helper.make_tensor_value_info(o, TensorProto.FLOAT,
                                                                                      ["batch", H, "tot", D])
                                                         for o in outputs[1:]]), inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(rng, seq, three_d, mask, kv_heads=H):
    feeds = {n: rng.standard_normal((B, seq, h * D) if three_d else (B, h, seq, D)).astype(np.float32)
             for n, h in (("q", H), ("k", kv_heads), ("v", kv_heads))}
    if mask == "bool_input":
        feeds["m"] = (rng.random((B, 1, seq, seq)) < 0.4) | np.eye(seq, dtype=bool)
    elif mask == "float_input":
        feeds["m"] = rng.standard_normal((B, 1, seq, seq)).astype(np.float32)
    elif mask == "padding":
        feeds["pad"] = padding_mask(rng, B, seq)
    return feeds


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize("mask,causal", [(None, False), (None, True), ("bool_input", False), ("float_input", True),
                                         ("padding", False), ("padding", True)])
def test_onnx_attention_op(three_d, mask, causal):
    model = onnx_attention_model(three_d=three_d, mask=mask, causal=causal)
    new, report = rewrite_model(model, max_seq_len=40, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Attention": 0})
    a = report.to_dict()["attention"][0]
    assert a["key_padding"] == (mask == "padding")
    assert a["attn_bias"] == (mask in ("bool_input", "float_input"))
    assert ("causal" in a["mask_source"]) == causal
    assert a["scale"] == pytest.approx(1 / np.sqrt(D))
    rng = np.random.default_rng(0)
    for seq in (40, 23):
        assert_parity(model, new, _feeds(rng, seq, three_d, mask))


def test_onnx_attention_scale_attribute_and_user_mask():
    model = onnx_attention_model(scale=0.5)
    new, report = rewrite_model(model, max_seq_len=40, mask="causal", **TILE)
    assert report.to_dict()["attention"][0]["scale"] == 0.5
    causal = onnx_attention_model(causal=True, scale=0.5)
    rng = np.random.default_rng(1)
    assert_parity(causal, new, _feeds(rng, 40, False, None))


@pytest.mark.parametrize("causal", [False, True])
def test_onnx_attention_grouped_query_fused_without_expansion(causal):
    """q_num_heads = 4, kv_num_heads = 2 (3-D inputs): one STOF node reading K/V with their 2 heads, no Expand or
    Tile anywhere, and the outputs of the original on ORT CPU."""
    model = onnx_attention_model(three_d=True, kv_heads=2, causal=causal)
    new, report = rewrite_model(model, max_seq_len=40, **TILE)
    assert op_counts(new).get("StofSparseAttention") == 1 and "Attention" not in op_counts(new)
    assert not {"Expand", "Tile"} & set(op_counts(new))
    (fused,) = report.to_dict()["attention"]
    assert fused["kv_heads"] == 2 and fused["heads"] == H
    rng = np.random.default_rng(3)
    assert_parity(model, new, _feeds(rng, 40, True, None, kv_heads=2))
    assert_parity(model, new, _feeds(rng, 23, True, None, kv_heads=2))


def test_onnx_attention_past_left_alone():  # more grouped heads: tests/test_rewrite_ort_ops.py
    for model, why in ((onnx_attention_model(past=True), "past_key"),):
        new, report = rewrite_model(model, max_seq_len=40, **TILE)
        assert op_counts(new) == op_counts(model)
        assert any(why in s["reason"] for s in report.to_dict()["left_alone"]), report.to_dict()["left_alone"]


# -- ORT transformers optimizer output ----------------------------------------------------------------------------
def _ort_optimized(tmp_path, kind, mha):
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    src = tmp_path / f"{kind}.onnx"
    kwargs = dict(dynamic_axes=False) if kind == "vit" else dict(dynamic_axes=False, seq_len=24)
    onnx.save(exported(kind, **kwargs), src)
    model_type = "gpt2" if kind == "gpt2" else "bert"
    opts = FusionOptions(model_type)
    opts.use_multi_head_attention = mha
    return optimize_model(str(src), model_type=model_type, num_heads=H, hidden_size=H * D, optimization_options=opts,
                          opt_level=0).model


@pytest.mark.parametrize("mha", [False, True])
def test_ort_optimizer_bert(tmp_path, mha):
    model = _ort_optimized(tmp_path, "bert", mha)
    op = "MultiHeadAttention" if mha else "Attention"
    assert op_counts(model)[op] == 2
    assert op_counts(model)["SkipLayerNormalization"] == 4 and op_counts(model)["BiasGelu"] == 2
    new, report = rewrite_model(model, packed_qkv=False, **TILE)  # packing: tests/test_rewrite_packed_qkv.py
    assert_fused(new, {"StofSparseAttention": 2, op: 0, "StofGemmEpilogue": 6, "BiasGelu": 0,
                       "StofAddLayerNorm": 4, "SkipLayerNormalization": 0})
    assert report.count("ort_multihead_attention" if mha else "ort_attention") == 2
    assert report.count("ort_bias_gelu") == 2 and report.count("ort_skip_layernorm") == 4
    assert all(a["key_padding"] for a in report.to_dict()["attention"])
    rng = np.random.default_rng(2)
    for _ in range(2):
        assert_parity(model, new, token_feeds(rng, B, 24, mask=padding_mask(rng, B, 24)))


def test_ort_optimizer_gpt2_decomposed_attention_still_fused(tmp_path):
    model = _ort_optimized(tmp_path, "gpt2", False)
    assert op_counts(model)["FastGelu"] == 2
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0, "FastGelu": 0, "SkipLayerNormalization": 0})
    assert [n.overload for n in new.graph.node if n.op_type == "StofGemmEpilogue" and n.overload != "none"] == \
        ["gelu_tanh"] * 2
    assert any(len(n.output) == 2 for n in new.graph.node if n.op_type == "StofAddLayerNorm")  # the sum output
    rng = np.random.default_rng(3)
    assert_parity(model, new, token_feeds(rng, B, 24, mask=padding_mask(rng, B, 24)))


def test_ort_attention_unidirectional_and_past_left_alone():
    rng = np.random.default_rng(4)
    hidden, S = H * D, 20
    w = numpy_helper.from_array(rng.standard_normal((hidden, 3 * hidden)).astype(np.float32) * 0.3, "w")
    b = numpy_helper.from_array(rng.standard_normal(3 * hidden).astype(np.float32) * 0.1, "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, hidden])
    node = helper.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=H,
                            unidirectional=1)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [w, b]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1})
    assert "causal" in report.to_dict()["attention"][0]["mask_source"]
    assert_parity(model, new, {"x": rng.standard_normal((B, S, hidden)).astype(np.float32)})
    # with a KV-cache input the op is left alone
    past = helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, B, H, 4, D])
    node2 = helper.make_node("Attention", ["x", "w", "b", "", "past"], ["y", "present"], domain="com.microsoft",
                             num_heads=H, unidirectional=1)
    present = helper.make_tensor_value_info("present", TensorProto.FLOAT, [2, B, H, S + 4, D])
    y2 = helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, hidden])
    model2 = helper.make_model(helper.make_graph([node2], "g", [x, past], [y2, present], [w, b]),
                               opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model2.ir_version = 9
    new2, report2 = rewrite_model(model2, **TILE)
    assert op_counts(new2) == op_counts(model2)
    assert any("KV cache" in s["reason"] for s in report2.to_dict()["left_alone"])


def test_ort_attention_2d_mask_index():
    rng = np.random.default_rng(5)
    hidden, S = H * D, 20
    w = numpy_helper.from_array(rng.standard_normal((hidden, 3 * hidden)).astype(np.float32) * 0.3, "w")
    b = numpy_helper.from_array(rng.standard_normal(3 * hidden).astype(np.float32) * 0.1, "b")
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", S, hidden]),
           helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch", S])]
    node = helper.make_node("Attention", ["x", "w", "b", "mask"], ["y"], domain="com.microsoft", num_heads=H)
    model = helper.make_model(helper.make_graph([node], "g", ins, [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, ["batch", S, hidden])], [w, b]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1})
    assert "2-D [B, Sk] mask" in report.to_dict()["attention"][0]["mask_source"]
    mask = (rng.random((3, S)) < 0.6).astype(np.int32)
    mask[:, 0] = 1
    assert_parity(model, new, {"x": rng.standard_normal((3, S, hidden)).astype(np.float32), "mask": mask})
