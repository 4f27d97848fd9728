"""StofSparseAttention with qkv_format "t3hd" (packed sequences, input 9 seq_offsets) on ONNX Runtime's CUDA EP with
libstof_ort: each sequence's output rows against a float64 reference of that sequence alone, and the one-line
errors of bad shapes.  Skips without the CUDA EP (onnxruntime-gpu) or the library."""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402

from stof_trt import ort as sort  # noqa: E402
from stof_trt.format import STOF_FORMAT_VERSION, compile_mask  # noqa: E402

pytestmark = NEEDS_ORT_CUDA

NP2ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def t3hd_model(layout, *, H, D, dtype=np.float16, bias=False):
    """One node: query [T,3,H,D], key/value empty, key_padding_mask [B,S] (its shape only), seq_offsets [B+1]."""
    et = NP2ONNX[dtype]
    arrays = layout.arrays()
    inits = [numpy_helper.from_array(np.ascontiguousarray(arrays[n], np.int32), n)
             for n in ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps")]
    inputs = [helper.make_tensor_value_info("qkv", et, ["T", 3, H, D]),
              helper.make_tensor_value_info("kpm", TensorProto.INT32, ["B", "S"]),
              helper.make_tensor_value_info("offsets", TensorProto.INT32, ["B1"])]
    names = ["qkv", "", "", "row_ptr", "col_idx", "tile_bitmap_index", "bitmaps", "kpm", "", "offsets"]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", et, ["B", H, "S", "S"]))
        names[8] = "bias"
    node = helper.make_node("StofSparseAttention", names, ["o"], domain="stof", name="attn0",
                            scale=float(1.0 / math.sqrt(D)), tile_m=layout.tile_m, tile_n=layout.tile_n,
                            seq_q=layout.seq_q, seq_k=layout.seq_k, num_layouts=layout.num_layouts,
                            format_version=STOF_FORMAT_VERSION, mask_spec=layout.mask_spec or "", qkv_format="t3hd")
    g = helper.make_graph([node], "t3hd", inputs, [helper.make_tensor_value_info("o", et, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    m.ir_version = 10
    return m


def _ref(q, k, v, dense, scale):
    """float64 attention of one sequence: q/k/v [n, H, D], dense bool [L, n, n]."""
    q, k, v = (a.astype(np.float64).transpose(1, 0, 2) for a in (q, k, v))
    H = q.shape[0]
    allowed = np.stack([dense[h % dense.shape[0]] for h in range(H)])
    s = np.where(allowed, scale * q @ k.transpose(0, 2, 1), -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    d = p.sum(-1, keepdims=True)
    return ((p @ v) / np.where(d > 0, d, 1)).transpose(1, 0, 2)


def _run(m, feeds):
    sess = sort.session(m)
    b = sort.Binding(sess, feeds)
    b.run()
    for v in b._outputs:  # poison, then run again into the same buffers: an unwritten row cannot pass
        v.update_inplace(np.full(v.shape(), np.nan, dtype=v.numpy().dtype))
    b.run()
    return b.outputs()[0]


@pytest.mark.parametrize("spec,S,H,D,dtype,lengths", [
    ("causal", 200, 3, 64, np.float16, [200, 1, 77, 130]),          # tensor-core kernels
    ("sliding:window=48", 256, 2, 128, np.float16, [5, 256, 64, 65, 190]),
    ("full", 130, 2, 64, np.float32, [130, 1, 60]),                 # general kernel (fp32)
    ("causal", 96, 2, 48, np.float16, [96, 33]),                    # general kernel (D=48)
])
def test_t3hd_matches_each_sequence_alone(spec, S, H, D, dtype, lengths):
    layout = compile_mask(spec, S, S)
    m = t3hd_model(layout, H=H, D=D, dtype=dtype)
    rng = np.random.default_rng(S + D)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T, B = int(offsets[-1]), len(lengths)
    qkv = rng.standard_normal((T, 3, H, D)).astype(dtype)
    # the mask's values are not used in t3hd: only its shape [B, S]
    kpm = (np.arange(S)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    got = _run(m, {"qkv": qkv, "kpm": kpm, "offsets": offsets})
    assert got.shape == (T, H, D) and np.isfinite(got).all()
    dense = layout.to_dense()
    tol = 2e-3 if dtype == np.float16 else 2e-5
    for b in range(B):
        r = slice(int(offsets[b]), int(offsets[b + 1]))
        n = lengths[b]
        ref = _ref(qkv[r, 0], qkv[r, 1], qkv[r, 2], dense[:, :n, :n], 1.0 / math.sqrt(D))
        np.testing.assert_allclose(got[r].astype(np.float64), ref, atol=tol, rtol=tol, err_msg=f"sequence {b}")


@pytest.mark.parametrize("bad", ["tokens", "offsets_shape", "offsets_type", "bias", "too_long"])
def test_t3hd_bad_shapes_are_one_line_errors(bad):
    S, H, D = 128, 2, 64
    layout = compile_mask("causal", S, S)
    m = t3hd_model(layout, H=H, D=D, bias=bad == "bias")
    offsets = np.array([0, 100, 128], np.int32)
    feeds = {"qkv": np.zeros((128, 3, H, D), np.float16), "kpm": np.ones((2, S), np.int32), "offsets": offsets}
    if bad == "tokens":  # T above B*S
        feeds["qkv"] = np.zeros((2 * S + 1, 3, H, D), np.float16)
    elif bad == "offsets_shape":
        feeds["offsets"] = offsets[:2]
    elif bad == "offsets_type":
        m.graph.input[2].type.tensor_type.elem_type = TensorProto.INT64
        feeds["offsets"] = offsets.astype(np.int64)
    elif bad == "bias":
        feeds["bias"] = np.zeros((2, H, S, S), np.float16)
    else:  # S over the compiled length
        feeds["kpm"] = np.ones((2, S + 64), np.int32)
    with pytest.raises(Exception) as ei:  # noqa: B017 - ORT's error types differ by version
        sess = sort.session(m)
        sess.run(None, feeds)
    msg = str(ei.value)
    assert "Traceback" not in msg
    want = {"tokens": "T=", "offsets_shape": "seq_offsets", "offsets_type": "", "bias": "attn_bias",
            "too_long": "exceed"}[bad]
    assert want in msg, msg
