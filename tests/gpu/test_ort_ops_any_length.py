"""ONNX Runtime's own attention operators rewritten with no flags (dynamic sequence axis, compiled at 2048), run on the
CUDA EP with libstof_ort past the compiled length: the plugin builds each node's layout from its layout_spec
(GroupQueryAttention's causal window, MultiHeadAttention's unidirectional with attention_bias, ONNX Attention's
is_causal with grouped heads) and equals a float64 reference of the operator at every real query row; a
SparseAttention model compiled for its block table refuses one token more. Skips without the CUDA EP or the
library; the same models on the CPU: tests/test_rewrite_ort_any_length.py."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402
from onnx import TensorProto  # noqa: E402

from stof_trt import ort as sort  # noqa: E402

pytestmark = NEEDS_ORT_CUDA

NO_TF32 = {"use_tf32": 0}
LENGTHS = (2049, 3000)


def _as_fp16(model):
    """The model with its float inputs and outputs as float16 (the operators follow their inputs' type)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in (*out.graph.input, *out.graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    return out


def _run(sess, feeds):
    names = {i.name for i in sess.get_inputs()}   # the rewrite leaves some of the operator's inputs unused
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})[0]


def _close(got, ref, rows, tol):
    for b, n in enumerate(rows):
        g, r = got[b, :n].astype(np.float64), ref[b, :n]
        err = np.abs(g - r).max() / max(1.0, np.abs(r).max())
        assert np.isfinite(g).all() and err < tol, (b, err)


@pytest.mark.parametrize("window", [0, 256, 2060])
@pytest.mark.parametrize("fp16", [False, True])
def test_gqa_past_the_compiled_length(window, fp16):
    from models_util import layout_specs
    from test_rewrite_ort_ops import gqa_feeds, gqa_model, gqa_reference

    from stof_trt.rewrite import rewrite_model
    from stof_trt.rewrite.fuse_ort_gqa import window_spec

    H, KV, D = 8, 2, 64
    model = gqa_model("batch", "seq", H, KV, D, window if window else -1)
    model = _as_fp16(model) if fp16 else model
    new, _ = rewrite_model(model)
    assert layout_specs(new) == [window_spec(window)]
    sess = sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(window)
    for seq in LENGTHS:
        lengths = [seq, seq - 301]
        feeds = gqa_feeds(rng, 2, seq, H, KV, D, lengths)
        if fp16:
            feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
        got = _run(sess, feeds)
        ref = gqa_reference(feeds, H, KV, D, window, lengths)
        _close(got, ref, lengths, 2e-2 if fp16 else 2e-4)


@pytest.mark.parametrize("unidirectional", [0, 1])
def test_multihead_attention_with_bias_past_the_compiled_length(unidirectional):
    from test_rewrite_ort_any_length import mha_model
    from test_rewrite_ort_ops import _heads, _merge

    from stof_trt.rewrite import rewrite_model

    H, D, B = 4, 64, 2
    new, _ = rewrite_model(mha_model(H, D, unidirectional))
    sess = sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(unidirectional)
    for seq in LENGTHS:
        lengths = np.array([seq, seq - 77], np.int32)
        feeds = {n: rng.standard_normal((B, seq, H * D)).astype(np.float32) for n in "qkv"}
        feeds.update(kpm=lengths, bias=rng.standard_normal((B, 1, seq, seq)).astype(np.float32))
        got = _run(sess, feeds)
        q, k, v = (_heads(feeds[n], H).astype(np.float64) for n in "qkv")
        i, j = np.arange(seq)[:, None], np.arange(seq)[None]
        allowed = ((j <= i) if unidirectional else np.ones((seq, seq), bool))[None, None] & \
            (j < lengths[:, None, None, None])
        s = np.where(allowed, np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(D) + feeds["bias"], -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = _merge(np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v))
        _close(got, ref, lengths, 2e-4)


def test_onnx_attention_causal_grouped_past_the_compiled_length():
    from test_rewrite_ort_ops import _heads, _merge, _softmax_attention, onnx_attention_model

    from stof_trt.rewrite import rewrite_model

    H, KV = 4, 2
    model = onnx_attention_model(23, three_d=True, H=H, KV=KV, causal=True, nonpad=False)
    new, _ = rewrite_model(model)
    sess = sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(3)
    D = 8
    for seq in LENGTHS:
        feeds = {"q": rng.standard_normal((2, seq, H * D)).astype(np.float32),
                 "k": rng.standard_normal((2, seq, KV * D)).astype(np.float32),
                 "v": rng.standard_normal((2, seq, KV * D)).astype(np.float32)}
        got = _run(sess, feeds)
        q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
        k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
        allowed = (np.arange(seq)[None] <= np.arange(seq)[:, None])[None, None]
        _close(got, _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D))), [seq, seq], 2e-4)


def test_sparse_attention_refuses_past_its_block_table():
    """Compiled for the 2560 tokens its block table covers (no layout_spec): 2560 runs, 2561 fails in one line
    naming the node (the operator itself refuses it too)."""
    from test_rewrite_ort_ops import local_stride_blocks, sparse_attention_model, sparse_attention_reference

    from stof_trt.rewrite import rewrite_model

    H, KV, D, nb, bs = 4, 2, 64, 40, 64
    blocks = local_stride_blocks(2, nb, 4, 3)
    new, _ = rewrite_model(sparse_attention_model("batch", "seq", H, KV, D, blocks, bs, "max_seq"))
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.max_seq_len"] == str(nb * bs)
    sess = sort.session(new, cuda_options=NO_TF32)
    rng = np.random.default_rng(4)

    def feeds(seq):
        return {"q": rng.standard_normal((1, seq, H * D)).astype(np.float32),
                "k": rng.standard_normal((1, seq, KV * D)).astype(np.float32),
                "v": rng.standard_normal((1, seq, KV * D)).astype(np.float32),
                "past_key": np.zeros((1, KV, nb * bs, D), np.float32),
                "past_value": np.zeros((1, KV, nb * bs, D), np.float32),
                "total": np.array([seq], np.int32), "key_lengths": np.array([seq], np.int32)}

    f = feeds(nb * bs)
    _close(_run(sess, f), sparse_attention_reference(f, blocks, bs, H, KV), [nb * bs], 2e-4)
    with pytest.raises(Exception, match="StofSparseAttention"):
        _run(sess, feeds(nb * bs + 1))
