"""Padding removal on the CUDA EP with libstof_ort: rewritten BERT / GPT-2 (StofSparseAttention qkv_format "t3hd"
on packed tokens) against the original model on ORT CPU at real tokens, fp32 and fp16, for right, left and holed
masks, a row of one token and a full batch; padded positions are 0. Skips without the CUDA EP or the library."""

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

B, S = 4, 200
NO_TF32 = {"use_tf32": 0}  # fp32 comparisons: ORT's own fp32 MatMuls default to TF32 on the CUDA EP


def _masks():
    rng = np.random.default_rng(7)
    lengths = np.array([S, 1, 77, 130])
    right = (np.arange(S)[None] < lengths[:, None]).astype(np.int64)
    holes = (rng.random((B, S)) < 0.5).astype(np.int64)
    holes[:, 0] = 1
    return {"right": right, "left": right[:, ::-1].copy(), "holes": holes, "full": np.ones((B, S), np.int64)}


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def models(request, tmp_path_factory):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from stof_trt import export
    from stof_trt.rewrite import rewrite_model

    d = tmp_path_factory.mktemp(request.param)
    kw = dict(layers=2, hidden=256, heads=4, seq_len=S, max_positions=512)
    if request.param == "bert":
        kw["intermediate"] = 1024
    getattr(export, f"export_{request.param}")(str(d / "orig.onnx"), **kw)
    orig = onnx.load(str(d / "orig.onnx"))
    new, report = rewrite_model(orig, max_seq_len=256)
    assert report.remove_padding["applied"], report.remove_padding
    atts = [n for n in new.graph.node if n.op_type == "StofSparseAttention"]
    assert atts and all(any(a.name == "qkv_format" and a.s == b"t3hd" for a in n.attribute) for n in atts)
    padded, _ = rewrite_model(orig, max_seq_len=256, remove_padding=False)
    slots, _ = rewrite_model(orig, max_seq_len=256, token_capacity_input=True)
    return {"orig": orig, "t3hd": new, "bs3hd": padded, "slots": slots,
            "slots16": convert_float_to_float16(slots, keep_io_types=False),
            "t3hd16": convert_float_to_float16(new, keep_io_types=False),
            "orig16": convert_float_to_float16(orig, keep_io_types=False)}


def _cpu(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _cuda(model, feeds):
    sess = sort.session(model, cuda_options=NO_TF32)
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("mask", ["right", "left", "holes", "full"])
def test_packed_on_cuda_matches_original(models, mask):
    m = _masks()[mask]
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(3, 1000, (B, S)).astype(np.int64), "attention_mask": m}
    keep = m != 0
    ref = _cpu(models["orig"], feeds).astype(np.float64)
    got = _cuda(models["t3hd"], feeds).astype(np.float64)
    assert np.isfinite(got).all() and not np.any(got[~keep])
    scale = max(1.0, np.abs(ref[keep]).max())
    err = np.abs(got - ref)[keep].max() / scale
    assert err < 2e-4, err
    # the padded path on the same device agrees at real tokens
    other = _cuda(models["bs3hd"], feeds).astype(np.float64)
    assert np.abs(other - got)[keep].max() / scale < 2e-4
    # fp16: within the error of the fp16 original itself, with margin
    got16 = _cuda(models["t3hd16"], feeds).astype(np.float64)
    err16 = np.abs(_cpu(models["orig16"], feeds).astype(np.float64) - ref)[keep].max() / scale
    assert np.abs(got16 - ref)[keep].max() / scale < max(3 * err16, 2e-2)


def test_short_batches_on_cuda(models):
    """Lengths below the compiled length and one sequence of one token."""
    rng = np.random.default_rng(2)
    for b, s in ((1, 1), (3, 17), (2, 64)):
        m = np.ones((b, s), np.int64)
        m[-1, s // 2 + 1:] = 0
        feeds = {"input_ids": rng.integers(3, 1000, (b, s)).astype(np.int64), "attention_mask": m}
        keep = m != 0
        ref, got = _cpu(models["orig"], feeds), _cuda(models["t3hd"], feeds)
        assert not np.any(got[~keep])
        assert np.abs(got - ref)[keep].max() < 2e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("mask", ["right", "holes", "full"])
def test_token_slots_on_cuda_match_original(models, mask):
    """The packed model with a fixed number of token slots (token_capacity_input) at the capacity Binding picks
    and at B·S: real tokens equal the original's, padded positions 0; fp16 too."""
    m = _masks()[mask]
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(3, 1000, (B, S)).astype(np.int64), "attention_mask": m}
    keep = m != 0
    ref = _cpu(models["orig"], feeds).astype(np.float64)
    scale = max(1.0, np.abs(ref[keep]).max())
    sess = sort.session(models["slots"], cuda_options=NO_TF32)
    for cap in (None, B * S):
        got = sess.run(None, sort.with_token_capacity(sess, feeds, cap))[0].astype(np.float64)
        assert np.isfinite(got).all() and not np.any(got[~keep])
        assert np.abs(got - ref)[keep].max() / scale < 2e-4
    s16 = sort.session(models["slots16"])
    got16 = s16.run(None, sort.with_token_capacity(s16, feeds))[0].astype(np.float64)
    err16 = np.abs(_cpu(models["orig16"], feeds).astype(np.float64) - ref)[keep].max() / scale
    assert np.abs(got16 - ref)[keep].max() / scale < max(3 * err16, 2e-2)
    # too few slots: NaN everywhere, never a silently wrong answer
    short = sess.run(None, sort.with_token_capacity(sess, feeds, int(keep.sum()) - 1))[0]
    assert np.isnan(short).all()


def test_token_slots_replay_through_cuda_graphs(models):
    """A packed model replayed by ORT's CUDA graphs: batches with other masks (no more real tokens than the
    binding's slots) copied into the bound buffers give their own results."""
    rng = np.random.default_rng(4)
    masks = _masks()
    sess = sort.session(models["slots16"], cuda_graphs=True)
    first = {"input_ids": rng.integers(3, 1000, (B, S)).astype(np.int64), "attention_mask": masks["full"]}
    b = sort.Binding(sess, first)
    assert b._inputs["stof_token_capacity"].shape() == [B * S]
    for _ in range(3):
        b.run()
    for name in ("right", "holes", "left", "full"):
        feeds = {"input_ids": rng.integers(3, 1000, (B, S)).astype(np.int64), "attention_mask": masks[name]}
        b.update(feeds)
        b.run()
        got = b.outputs()[0].astype(np.float64)
        keep = masks[name] != 0
        ref = _cpu(models["orig"], feeds).astype(np.float64)
        scale = max(1.0, np.abs(ref[keep]).max())
        assert not np.any(got[~keep])
        assert np.abs(got - ref)[keep].max() / scale < 2e-2, name
    small = sort.Binding(sess, {"input_ids": first["input_ids"], "attention_mask": masks["right"]})
    with pytest.raises(sort.StofError, match="token slots"):
        small.update({"attention_mask": masks["full"]})
