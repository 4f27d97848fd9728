"""Rewritten transformer models (small BERT / GPT-2 / ViT from configs, random weights) on the CUDA EP with
libstof_ort, fp32 and fp16, against the original model on ORT CPU; plus `stof tune`, `stof run`, `stof bench`.
Skips without the CUDA EP or the library."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402

from stof_trt import ort as sort  # noqa: E402

pytestmark = NEEDS_ORT_CUDA

S, B = 256, 2
SPEC = "longformer:window=32,global=8"
CFG = dict(layers=2, hidden=256, heads=4, intermediate=1024, seq_len=S, max_positions=512, seed=0)


def _fp16(src, dst):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(onnx.load(str(src)), keep_io_types=False), str(dst))
    return dst


def _rewrite(src, dst, spec, max_seq):
    from stof_trt.rewrite import rewrite_model
    from stof_trt.masks import parse_mask

    m, rep = rewrite_model(onnx.load(str(src)), mask=parse_mask(spec) if spec else None,
                           max_seq_len=max_seq)
    assert any(n.domain == "stof" for n in m.graph.node)
    onnx.save(m, str(dst))
    return dst


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from stof_trt.export import export_bert

    d = tmp_path_factory.mktemp("bert")
    export_bert(str(d / "b3.onnx"), mask_dims=3, **CFG)
    export_bert(str(d / "b2.onnx"), mask_dims=2, **CFG)
    _rewrite(d / "b2.onnx", d / "stof.onnx", SPEC, S)
    _fp16(d / "stof.onnx", d / "stof16.onnx")
    _fp16(d / "b3.onnx", d / "b3_16.onnx")
    return d


def _bert_feeds():
    from stof_trt.cli.bench import masked_feeds
    from stof_trt.masks import parse_mask

    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(0, 1000, (B, S)).astype(np.int64), "attention_mask": np.ones((B, S), np.int64)}
    return masked_feeds(feeds, parse_mask(SPEC).dense(S, S), 0.6, 0)


def _cpu(path, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


NO_TF32 = {"use_tf32": 0}  # fp32 comparisons: ORT's own fp32 MatMuls default to TF32 on the CUDA EP


def _stof_nodes_on_cuda(path):
    """Every STOF node of the model is assigned to the CUDA EP (not inlined, not on CPU)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = sort.session(str(path), session_options=so, cuda_options=NO_TF32)
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    return sess


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bert_longformer_matches_original(bert, precision):
    f2, f3 = _bert_feeds()
    ref = _cpu(bert / "b3.onnx", f3).astype(np.float64)  # fp32 original, dense 3-D mask, CPU
    path = bert / ("stof.onnx" if precision == "fp32" else "stof16.onnx")
    sess = _stof_nodes_on_cuda(path)
    b = sort.Binding(sess, f2)
    b.run()
    got = b.outputs()[0].astype(np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max()
    if precision == "fp32":
        assert err < 2e-4 * max(1, np.abs(ref).max()), err
    else:  # within the error of the fp16 original itself (against the fp32 reference), with margin
        o16 = sort.session(str(bert / "b3_16.onnx"), register=False).run(None, f3)[0].astype(np.float64)
        err16 = np.abs(o16 - ref).max()
        assert err < max(3 * err16, 2e-2), (err, err16)


def test_gpt2_causal_and_vit(tmp_path):
    from stof_trt.export import export_gpt2, export_vit

    export_gpt2(str(tmp_path / "g.onnx"), layers=2, hidden=128, heads=2, seq_len=S, max_positions=512)
    _rewrite(tmp_path / "g.onnx", tmp_path / "g.stof.onnx", None, S)
    rng = np.random.default_rng(0)
    am = np.ones((B, S), np.int64)
    am[1, 200:] = 0
    feeds = {"input_ids": rng.integers(0, 1000, (B, S)).astype(np.int64), "attention_mask": am}
    ref = _cpu(tmp_path / "g.onnx", feeds)
    got = sort.session(str(tmp_path / "g.stof.onnx"), cuda_options=NO_TF32).run(None, feeds)[0]
    keep = am != 0  # the padding is removed: real tokens equal, padded ones are 0
    assert not np.any(got[~keep])
    np.testing.assert_allclose(got[keep], ref[keep], atol=2e-4, rtol=2e-4)

    export_vit(str(tmp_path / "v.onnx"), layers=2, hidden=128, heads=2, image_size=64, patch_size=16)
    _rewrite(tmp_path / "v.onnx", tmp_path / "v.stof.onnx", None, None)
    x = {"pixel_values": rng.standard_normal((B, 3, 64, 64)).astype(np.float32)}
    np.testing.assert_allclose(sort.session(str(tmp_path / "v.stof.onnx"), cuda_options=NO_TF32).run(None, x)[0],
                               _cpu(tmp_path / "v.onnx", x), atol=2e-4, rtol=2e-4)


def test_cli_tune_run_bench(bert, tmp_path, capfd):
    from stof_trt.cli import main

    cache = tmp_path / "cache.json"
    shapes = f"input_ids={B}x{S},attention_mask={B}x{S}"
    assert main(["tune", str(bert / "stof16.onnx"), "--shapes", shapes, "-o", str(cache), "--json"]) == 0
    info = json.loads(capfd.readouterr().out)
    assert info["entries"] >= 1 and info["problems"][0]["best_ms"] > 0
    doc = json.loads(cache.read_text())
    assert doc["entries"][0]["source"] == "measured"

    assert main(["run", str(bert / "stof16.onnx"), "--shapes", shapes, "--tactic-cache", str(cache), "--json",
                 "--time", "5", "--verbose"]) == 0
    cap = capfd.readouterr()
    out = json.loads(cap.out)
    assert out["outputs"][0]["finite"] and out["latency"]["runs"] == 5
    assert "tactic cache" in cap.err  # the plugin found the tuned entry (same key as the tuner)

    plot = tmp_path / "b.png"
    rc = main(["bench", str(bert / "b3_16.onnx"), str(bert / "stof16.onnx"), "--mask", SPEC, "--shapes", shapes,
               "--padding", "0.6", "--iters", "5", "--warmup", "2", "--tactic-cache", str(cache), "--json",
               "--plot", str(plot)])
    res = json.loads(capfd.readouterr().out)
    assert rc == 0, res
    assert res["match"] and plot.exists()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "mistral", "modernbert", "clip_text"])
def test_family_with_no_flags_on_cuda_at_every_length(name):
    """Rewritten with no flags (compiled at the model's own limit, else 2048): the plugin equals the original on
    CPU at real tokens at lengths 1, 17, 64, 100 and the compiled length; one past it, a model with a limit of its
    own (stof.max_seq_len) is refused, one without runs (its layouts grow: tests/gpu/test_ort_any_length.py)."""
    from models_util import family, padding_mask, session, token_feeds
    from stof_trt.rewrite import rewrite_model

    model, _ = family(name)
    new, report = rewrite_model(model)
    compiled = report.to_dict()["attention"][0]["seq_q"]
    orig, sess = session(model), sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(0)
    for seq in sorted({s for s in (1, 17, 64, 100) if s <= compiled} | {compiled}):
        mask = padding_mask(rng, 2, seq)
        feeds = token_feeds(rng, 2, seq, mask=mask)
        feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)
        ref, got = orig.run(None, feeds)[0], sess.run(None, feeds)[0]
        keep = mask.astype(bool)
        err = np.abs(got - ref)[keep].max() / max(1.0, np.abs(ref[keep]).max())
        assert err < 2e-4, (name, seq, err)
    if "stof.max_seq_len" in {p.key for p in new.metadata_props}:
        with pytest.raises(Exception):
            sess.run(None, token_feeds(rng, 1, compiled + 1))
    else:
        feeds = token_feeds(rng, 1, compiled + 1)
        feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)
        ref, got = orig.run(None, feeds)[0], sess.run(None, feeds)[0]
        assert np.abs(got - ref).max() / max(1.0, np.abs(ref).max()) < 2e-4
