"""Rewritten models past their compiled length on ONNX Runtime's CUDA EP with libstof_ort: nodes with a layout_spec
build their layout for the run-time length in the plugin (the host layer's mask compiler) and equal the original at
every real token; the layouts are cached per length bucket; a node without one, or one whose spec the host layer
refuses, fails in one line.  Skips without the CUDA EP or the library."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402

from stof_trt import ort as sort  # noqa: E402

pytestmark = NEEDS_ORT_CUDA

NO_TF32 = {"use_tf32": 0}  # fp32 comparisons: ORT's own fp32 MatMuls default to TF32 on the CUDA EP


def _specs(model):
    return [{a.name: a for a in n.attribute}.get("layout_spec") for n in model.graph.node
            if n.op_type == "StofSparseAttention"]


def _cpu(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(rng, batch, seq, pad=True):
    from models_util import padding_mask, token_feeds

    mask = padding_mask(rng, batch, seq, min_len=seq // 2) if pad else np.ones((batch, seq), np.int64)
    feeds = token_feeds(rng, batch, seq, mask=mask)
    feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)
    return feeds, mask.astype(bool)


def _close(got, ref, keep, tol=2e-4):
    err = np.abs(got - ref)[keep].max() / max(1.0, np.abs(ref[keep]).max())
    assert np.isfinite(got[keep]).all() and err < tol, err


@pytest.mark.parametrize("name", ["llama", "mistral", "modernbert", "t5_encoder"])
def test_family_past_2048_equals_the_original(name):
    """Rewritten with no flags (compiled at 2048, every node with a layout_spec): the plugin at 2049, 3000 and
    4096 tokens equals the original on the CPU at real tokens (padded batch rows included)."""
    from models_util import family

    from stof_trt.rewrite import rewrite_model

    model, limit = family(name)
    assert limit is None
    new, report = rewrite_model(model)
    assert all(s is not None for s in _specs(new)) and report.to_dict()["attention"][0]["seq_q"] == 2048
    orig, sess = _cpu(model), sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(0)
    for seq in (2049, 3000, 4096):
        feeds, keep = _feeds(rng, 2 if seq < 4096 else 1, seq, pad=seq < 4096)
        _close(sess.run(None, feeds)[0], orig.run(None, feeds)[0], keep)


@pytest.mark.parametrize("mask", ["longformer:window=32,global=4", "dilated:window=48,dilation=3",
                                  "bigbird:block=32,window=1,global=1"])
def test_user_spec_past_the_compiled_length(mask):
    """A user spec (∧ the graph's causal pattern) compiled at 256 runs at 700 and 1500 through layouts the plugin
    builds, equal to the same spec compiled at 2048 and run by the ONNX function fallback on the CPU."""
    from models_util import family

    from stof_trt.rewrite import rewrite_model

    model, _ = family("llama")
    short, _ = rewrite_model(model, mask=mask, max_seq_len=256)
    long, _ = rewrite_model(model, mask=mask, max_seq_len=2048)
    assert all(s is not None for s in _specs(short))
    ref_sess, sess = _cpu(long), sort.session(short, cuda_options=NO_TF32)
    rng = np.random.default_rng(1)
    for seq in (700, 1500):
        feeds, keep = _feeds(rng, 2, seq)
        _close(sess.run(None, feeds)[0], ref_sess.run(None, feeds)[0], keep)


def test_layouts_are_built_once_per_bucket(capfd, monkeypatch):
    """STOF_ORT_VERBOSE: each grown layout is reported once when built; lengths in one bucket (2049..2560 for a
    2048-compiled model) share it, a new bucket builds another."""
    from models_util import family

    from stof_trt.rewrite import rewrite_model

    monkeypatch.setenv("STOF_ORT_VERBOSE", "1")
    model, _ = family("llama")
    new, _ = rewrite_model(model)
    n_nodes = len(_specs(new))
    sess = sort.session(new, cuda_options=NO_TF32, verbose=True)
    rng = np.random.default_rng(2)
    capfd.readouterr()
    for seq in (2100, 2300, 2560, 2100):
        sess.run(None, _feeds(rng, 1, seq, pad=False)[0])
    built = [ln for ln in capfd.readouterr().err.splitlines() if "built for" in ln]
    assert len(built) == n_nodes and all("built for 2560x2560" in ln for ln in built), built
    sess.run(None, _feeds(rng, 1, 2600, pad=False)[0])
    built = [ln for ln in capfd.readouterr().err.splitlines() if "built for" in ln]
    assert len(built) == n_nodes and all("built for 3072x3072" in ln for ln in built), built


def test_without_layout_spec_the_compiled_length_is_a_limit(tmp_path):
    """A node without layout_spec (removed here) keeps today's error past its compiled length; a layout_spec the
    host layer refuses (a fixed-size npy: mask) fails when the session is created, naming it."""
    from models_util import family

    from stof_trt.rewrite import rewrite_model

    new, _ = rewrite_model(family("llama")[0], max_seq_len=128)
    plain = onnx.ModelProto()
    plain.CopyFrom(new)
    for n in plain.graph.node:
        for a in list(n.attribute):
            if a.name == "layout_spec":
                n.attribute.remove(a)
    sess = sort.session(plain, cuda_options=NO_TF32)
    rng = np.random.default_rng(3)
    sess.run(None, _feeds(rng, 1, 128)[0])
    with pytest.raises(Exception, match="exceed the compiled layout"):
        sess.run(None, _feeds(rng, 1, 129)[0])
    bad = onnx.ModelProto()
    bad.CopyFrom(new)
    for n in bad.graph.node:
        for a in n.attribute:
            if a.name == "layout_spec":
                a.s = b"npy:mask.npy"
    with pytest.raises(Exception, match="layout_spec 'npy:mask.npy'.*fixed-size"):
        sort.session(bad, cuda_options=NO_TF32).run(None, _feeds(rng, 1, 64)[0])


def test_fp16_tensor_core_path_past_the_compiled_length(tmp_path):
    """Head dim 64 in fp16: the grown layouts run on the tensor-core kernels (layout handle uploaded, tactic chosen
    by stof_attn_select) at 3000 and 4096 tokens, within the error of the fp16 original against the fp32 one."""
    from models_util import exported
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from stof_trt.rewrite import rewrite_model

    model = exported("llama", hidden=256, heads=4, intermediate=256)
    new, report = rewrite_model(model)
    assert all(s is not None for s in _specs(new)) and report.to_dict()["attention"][0]["seq_q"] == 2048
    new16 = convert_float_to_float16(new, keep_io_types=True)
    orig16 = convert_float_to_float16(model, keep_io_types=True)
    ref_sess, sess = _cpu(model), sort.session(new16)
    o16 = sort.session(orig16, register=False)
    rng = np.random.default_rng(4)
    for seq in (3000, 4096):
        feeds, keep = _feeds(rng, 2, seq)
        ref = ref_sess.run(None, feeds)[0].astype(np.float64)
        got = sess.run(None, feeds)[0].astype(np.float64)
        err16 = np.abs(o16.run(None, feeds)[0].astype(np.float64) - ref)[keep].max()
        err = np.abs(got - ref)[keep].max()
        assert np.isfinite(got[keep]).all() and err < max(3 * err16, 2e-2), (seq, err, err16)
