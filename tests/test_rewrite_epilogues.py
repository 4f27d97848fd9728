"""Epilogue fusions: MatMul/Gemm + bias + GELU -> StofGemmEpilogue, residual Add + LayerNorm -> StofAddLayerNorm."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite import rewrite_model
from models_util import TILE, assert_fused, assert_parity, exported, op_counts, token_feeds


def _overloads(model, op_type):
    return sorted(n.overload for n in model.graph.node if n.op_type == op_type)


def test_bert_epilogues():
    model = exported("bert")
    new, report = rewrite_model(model, max_seq_len=32, **TILE)
    # per block: packed Q/K/V, FFN1 + GELU, and the two residual chains' GEMMs with their bias (fixed rule)
    assert_fused(new, {"StofGemmEpilogue": 8, "StofAddLayerNorm": 4, "Erf": 0, "LayerNormalization": 1,
                       "MatMul": 0})
    assert _overloads(new, "StofGemmEpilogue") == ["gelu_erf"] * 2 + ["none"] * 6
    assert _overloads(new, "StofAddLayerNorm") == [""] * 4    # no bias input
    left = report.to_dict()["left_alone"]
    assert any("embeddings/LayerNorm" in s["node"] and "broadcast" in s["reason"] for s in left)
    rng = np.random.default_rng(0)
    assert_parity(model, new, token_feeds(rng, 2, 32))


def test_gpt2_epilogues_tanh_gemm_and_pre_ln_sum_output():
    model = exported("gpt2")
    new, report = rewrite_model(model, max_seq_len=32, **TILE)
    assert_fused(new, {"StofGemmEpilogue": 2, "Tanh": 0, "Gemm": 6})
    assert _overloads(new, "StofGemmEpilogue") == ["gelu_tanh"] * 2
    addln = [n for n in new.graph.node if n.op_type == "StofAddLayerNorm"]
    assert len(addln) == 4 and any(len(n.output) == 2 for n in addln)  # pre-LN: the sum is the next residual
    rng = np.random.default_rng(1)
    assert_parity(model, new, token_feeds(rng, 2, 32))


def test_no_epilogues_option():
    model = exported("bert")
    new, report = rewrite_model(model, max_seq_len=32, epilogues=False, **TILE)
    counts = op_counts(new)
    assert counts["StofSparseAttention"] == 2 and "StofGemmEpilogue" not in counts and "StofAddLayerNorm" not in counts


# -- tiny hand-built graphs ------------------------------------------------------------------------------------------
def mlp_graph(*, gelu="erf", swap=False, gemm=False, residual=True, decomposed_ln=False, leak_preact=False,
              alpha=1.0, opset=17, K=8, N=16):
    """X [B,S,K] -> MatMul+bias (or Reshape->Gemm->Reshape) -> GELU -> MatMul back to K -> + X -> LayerNorm.

    Variant flags: ``swap`` puts constants first / reorders the GELU products; ``leak_preact`` also outputs the
    pre-activation (so the epilogue must not be fused); ``decomposed_ln`` spells LayerNorm out."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def node(op, ins, out, **kw):
        nodes.append(helper.make_node(op, ins, [out], **kw))
        return out

    W1, b1 = const("W1", rng.standard_normal((K, N)) * 0.5), const("b1", rng.standard_normal(N) * 0.1)
    W2, b2 = const("W2", rng.standard_normal((N, K)) * 0.5), const("b2", rng.standard_normal(K) * 0.1)
    if gemm:
        inits.append(numpy_helper.from_array(np.array([-1, K], np.int64), "shape2d"))
        inits.append(numpy_helper.from_array(np.array([2, -1, N], np.int64), "shape3d"))
        x2 = node("Reshape", ["X", "shape2d"], "x2")
        g = node("Gemm", [x2, W1, b1], "g", alpha=alpha)
        pre = node("Reshape", [g, "shape3d"], "pre")
    else:
        mm = node("MatMul", ["X", W1], "mm")
        pre = node("Add", [b1, mm] if swap else [mm, b1], "pre")
    c = lambda name, v: const(name, np.float32(v))  # noqa: E731
    if gelu == "erf":
        d = node("Div", [pre, c("sqrt2", math.sqrt(2))], "d")
        e = node("Erf", [d], "e")
        a = node("Add", [c("one", 1.0), e] if swap else [e, c("one", 1.0)], "a")
        if swap:
            h = node("Mul", [node("Mul", [c("half", 0.5), pre], "hx"), a], "act")
        else:
            h = node("Mul", [node("Mul", [pre, a], "xa"), c("half", 0.5)], "act")
    else:
        cube = node("Mul", [node("Pow", [pre, c("three", 3.0)], "p3"), c("k", 0.044715)], "cube")
        inner = node("Mul", [node("Add", [pre, cube], "s"), c("r", math.sqrt(2 / math.pi))], "inner")
        t = node("Add", [node("Tanh", [inner], "t"), c("one", 1.0)], "t1")
        h = node("Mul", [node("Mul", [pre, c("half", 0.5)], "hx"), t], "act")
    y = node("Add", [node("MatMul", [h, W2], "mm2"), b2], "y")
    out = y
    if residual:
        r = node("Add", [y, "X"], "res")
        g, b = const("gamma", rng.standard_normal(K)), const("beta", rng.standard_normal(K))
        if decomposed_ln:
            mean = node("ReduceMean", [r], "mean", axes=[-1])
            dd = node("Sub", [r, mean], "dd")
            var = node("ReduceMean", [node("Pow", [dd, c("two", 2.0)], "sq")], "var", axes=[-1])
            std = node("Sqrt", [node("Add", [var, c("eps", 1e-5)], "ve")], "std")
            out = node("Add", [node("Mul", [node("Div", [dd, std], "nrm"), g], "sc"), b], "out")
        else:
            out = node("LayerNormalization", [r, g, b], "out", axis=-1, epsilon=1e-5)
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 5, K])]
    if leak_preact:
        outputs.append(helper.make_tensor_value_info(pre, TensorProto.FLOAT, [2, 5, N]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 5, K])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("gelu", ["erf", "tanh"])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("gemm", [False, True])
def test_gelu_variants(gelu, swap, gemm):
    model = mlp_graph(gelu=gelu, swap=swap, gemm=gemm)
    new, report = rewrite_model(model)
    # FFN1 with its GELU; FFN2's GEMM takes the bias in its epilogue (residual_ln's fixed rule, docs/schemes.md)
    assert_fused(new, {"StofGemmEpilogue": 2, "StofAddLayerNorm": 1, "Erf": 0, "Tanh": 0})
    assert _overloads(new, "StofGemmEpilogue") == [f"gelu_{gelu}", "none"]
    assert report.count("gemm_bias_gelu") == 1
    x = np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32) * 3
    assert_parity(model, new, {"X": x}, atol=1e-5)


def test_decomposed_layernorm():
    model = mlp_graph(decomposed_ln=True)
    new, report = rewrite_model(model)
    assert_fused(new, {"StofAddLayerNorm": 1, "ReduceMean": 0, "Sqrt": 0})
    assert report.count("layernorm_decomposed") == 1
    x = np.random.default_rng(3).standard_normal((2, 5, 8)).astype(np.float32)
    assert_parity(model, new, {"X": x}, atol=1e-5)


def test_decomposed_layernorm_below_opset_17_left_alone():
    model = mlp_graph(decomposed_ln=True, opset=16)
    new, report = rewrite_model(model)
    assert op_counts(new)["ReduceMean"] == 2 and op_counts(new)["StofGemmEpilogue"] == 1
    assert any("opset 16" in s["reason"] for s in report.to_dict()["left_alone"])
    x = np.random.default_rng(3).standard_normal((2, 5, 8)).astype(np.float32)
    assert_parity(model, new, {"X": x}, atol=1e-5)


def test_preactivation_used_elsewhere_is_not_fused():
    model = mlp_graph(leak_preact=True)
    new, report = rewrite_model(model)
    assert _overloads(new, "StofGemmEpilogue") == ["none"] and op_counts(new)["Erf"] == 1   # FFN2's GEMM only
    x = np.random.default_rng(4).standard_normal((2, 5, 8)).astype(np.float32)
    assert_parity(model, new, {"X": x}, atol=1e-5)


def test_gemm_with_alpha_is_left_alone_with_reason():
    model = mlp_graph(gemm=True, alpha=0.5)
    new, report = rewrite_model(model)
    assert _overloads(new, "StofGemmEpilogue") == ["none"] and op_counts(new)["Gemm"] == 1   # FFN2's GEMM only
    assert any("alpha" in s["reason"] for s in report.to_dict()["left_alone"])
    x = np.random.default_rng(5).standard_normal((2, 5, 8)).astype(np.float32)
    assert_parity(model, new, {"X": x}, atol=1e-5)


def test_nothing_to_rewrite_comes_back_equivalent():
    rng = np.random.default_rng(6)
    W1, W2 = (numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("W1", (8, 16)), ("W2", (16, 8))))
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["Y"]), helper.make_node("Softmax", ["Y"], ["P"], axis=-1)]
    graph = helper.make_graph(nodes, "plain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 5, 8])],
                              [helper.make_tensor_value_info("P", TensorProto.FLOAT, [2, 5, 8])], [W1, W2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    new, report = rewrite_model(model)
    assert report.summary_rows() == [] and not report.to_dict()["attention"]
    assert new is not model and new.SerializeToString() == model.SerializeToString()
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    assert_parity(model, new, {"X": x}, atol=0)
