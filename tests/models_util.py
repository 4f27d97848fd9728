"""Shared helpers for the rewrite tests: cached tiny exports, ORT runs, parity and fusion assertions."""
from __future__ import annotations

import collections
import functools
import tempfile
from pathlib import Path

import numpy as np
import onnx

#: Tiny model sizes: the whole rewrite suite must run in a few minutes on 2 CPU cores.
TINY = dict(layers=2, hidden=32, heads=4)
TILE = dict(tile_m=16, tile_n=32)

_CACHE_DIR = Path(tempfile.mkdtemp(prefix="stof_rewrite_tests_"))


@functools.lru_cache(maxsize=None)
def _export(kind: str, items: tuple) -> str:
    from stof_trt import export

    kwargs = dict(items)
    path = _CACHE_DIR / (kind + "_" + "_".join(f"{k}{v}" for k, v in items).replace(":", "") + ".onnx")
    getattr(export, f"export_{kind}")(str(path), **kwargs)
    return str(path)


def exported(kind: str, **kwargs) -> onnx.ModelProto:
    """Export (once per argument set) and load a tiny model: kind in bert, gpt2, vit, local_attention, t5_encoder,
    llama."""
    defaults = dict(TINY)
    if kind in ("bert", "vit", "t5_encoder", "llama"):
        defaults["intermediate"] = 64
    if kind == "vit":
        defaults.update(image_size=32, patch_size=8)
    else:
        defaults.update(seq_len=16, vocab_size=100)
    defaults.update(kwargs)
    return onnx.load(_export(kind, tuple(sorted(defaults.items()))))


def session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(model_or_session, feeds: dict) -> list[np.ndarray]:
    sess = model_or_session if hasattr(model_or_session, "run") else session(model_or_session)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def padding_mask(rng, batch: int, seq: int, min_len: int = 1) -> np.ndarray:
    """Right padding with random lengths in [min_len, seq]; row 0 is unpadded."""
    lengths = rng.integers(min_len, seq + 1, batch)
    lengths[0] = seq
    return (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)


def token_feeds(rng, batch: int, seq: int, vocab: int = 100, mask: np.ndarray | None = None) -> dict:
    feeds = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64)}
    feeds["attention_mask"] = mask if mask is not None else np.ones((batch, seq), np.int64)
    return feeds


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| relative to max(1, max |a|)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))


def assert_parity(original, rewritten, feeds: dict, atol: float = 1e-4) -> float:
    """Outputs of the two models agree within ``atol`` relative to magnitude; returns the max difference."""
    outs_a, outs_b = run(original, feeds), run(rewritten, feeds)
    assert len(outs_a) == len(outs_b)
    worst = 0.0
    for a, b in zip(outs_a, outs_b):
        d = max_rel_diff(a, b)
        assert d <= atol, f"max relative difference {d:.3g} > {atol}"
        worst = max(worst, d)
    return worst


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def assert_fused(model: onnx.ModelProto, counts: dict[str, int]) -> None:
    """The rewritten model has exactly ``counts`` nodes of each given op_type, passes the full checker, and
    carries a model-local function for each STOF (op_type, overload) it uses."""
    got = op_counts(model)
    for op, n in counts.items():
        assert got.get(op, 0) == n, f"{op}: expected {n}, found {got.get(op, 0)} ({dict(got)})"
    onnx.checker.check_model(model, full_check=True)
    funcs = {(f.domain, f.name, f.overload) for f in model.functions}
    for node in model.graph.node:
        if node.domain == "stof":
            assert ("stof", node.op_type, node.overload) in funcs, (node.op_type, node.overload)
            for a in node.attribute:
                assert a.type != onnx.AttributeProto.TENSOR
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.domain == "stof":
            for name in node.input:
                if name in inits:
                    assert inits[name].data_type in (onnx.TensorProto.INT32, onnx.TensorProto.FLOAT,
                                                     onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16), name
