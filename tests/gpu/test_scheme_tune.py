"""Fusion schemes on the GPU: every scheme × cuBLASLt algorithm computes what the ONNX functions compute, the
timing path measures the shortlist, and a model rewritten with the measured schemes matches the original.
Skips without the CUDA EP, libstof_ort or a GPU."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402

from stof_trt import ort as sort  # noqa: E402
from stof_trt import schemes as S  # noqa: E402

pytestmark = NEEDS_ORT_CUDA


def _run(model, feeds, cuda: bool):
    sess = sort.session(model) if cuda else sort.session(model, providers="cpu", register=False)
    return sess.run(None, feeds)


def _feeds(shape, seed=0):
    rng = np.random.default_rng(seed)
    f = {"X": rng.standard_normal((shape.tokens, shape.k)).astype(np.float16)}
    if shape.kind == "residual_ln":
        f["residual"] = rng.standard_normal((shape.tokens, shape.n)).astype(np.float16)
    return f


@pytest.mark.parametrize("shape", [
    S.ChainShape("residual_ln", 512, 768, 768), S.ChainShape("residual_ln", 300, 768, 3072, sum_output=True),
    S.ChainShape("bias_gelu", 512, 3072, 768, activation="gelu_erf"),
    S.ChainShape("bias_gelu", 260, 1024, 256, activation="gelu_tanh")])
def test_every_scheme_and_algo_matches_the_function_reference(shape):
    from stof_trt.scheme_tune import one_block_model

    feeds = _feeds(shape)
    ref = [o.astype(np.float64) for o in _run(one_block_model(shape, S.default_scheme(shape.kind).name, -1,
                                                              copies=2), feeds, cuda=False)]
    for tpl in S.templates_for(shape.kind, 17):
        for algo in ((-1, 0, 1, 3, 15) if tpl.tunable else (-1,)):    # 15: past most heuristic lists -> the first
            got = _run(one_block_model(shape, tpl.name, algo, copies=2), feeds, cuda=True)
            for g, r in zip(got, ref):
                err = np.abs(g.astype(np.float64) - r).max() / max(1.0, np.abs(r).max())
                assert err < 2e-2, (tpl.name, algo, err)


def test_bad_algo_attribute_is_an_error():
    from onnx import TensorProto, helper, numpy_helper

    from stof_trt.rewrite.functions import DOMAIN, gemm_epilogue_function

    w = numpy_helper.from_array(np.ones((8, 8), np.float16), "W")
    b = numpy_helper.from_array(np.zeros(8, np.float16), "b")
    node = helper.make_node("StofGemmEpilogue", ["X", "W", "b"], ["Y"], domain=DOMAIN, activation="none", algo=-2)
    node.overload = "none"
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [4, 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [4, 8])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                          ir_version=10, functions=[gemm_epilogue_function(17, "none")])
    with pytest.raises(Exception, match="algo -2"):  # at session creation (kernel construction) or run
        sort.session(m).run(None, {"X": np.ones((4, 8), np.float16)})


def test_tune_schemes_measures_and_the_rewrite_applies_them(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models_util import exported, token_feeds

    from stof_trt.rewrite import rewrite_model
    from stof_trt.scheme_tune import block_rows, tune_schemes
    from stof_trt.tactic_cache import TacticCache

    model = exported("bert", half=True, hidden=128, heads=2)
    new, _ = rewrite_model(model, max_seq_len=128)
    cache = TacticCache()
    feeds = token_feeds(np.random.default_rng(0), 8, 128)
    res = tune_schemes(new, [feeds], cache, algos=2, reps=3)
    assert len(res) == 3 and all(r.times and r.best_ms > 0 for r in res)
    for r in res:
        assert r.best_ms == min(r.times.values()) and r.ratio >= 1.0
    rows = block_rows(res)
    assert len(rows) == 6 and all(r["time_ms"] > 0 for r in rows)
    cache.save(tmp_path / "c.json")
    out, _ = rewrite_model(model, max_seq_len=128, schemes=TacticCache.load(tmp_path / "c.json").scheme_choices())
    a = sort.session(model, providers="cpu", register=False).run(None, feeds)[0].astype(np.float64)
    b = sort.session(out).run(None, feeds)[0].astype(np.float64)
    assert np.abs(a - b).max() / max(1.0, np.abs(a).max()) < 3e-2
