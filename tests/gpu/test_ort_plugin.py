"""libstof_ort on ONNX Runtime: STOF nodes in small hand-made graphs, CUDA EP (plugin kernels) against a float64
NumPy reference and against ORT CPU running the nodes' model-local functions.

Everything that needs the CUDA EP skips without one; the registration / CPU-fallback tests run wherever
libstof_ort.so is built (they need no GPU).  Inputs are fresh random values; outputs are poisoned (NaN) before
each GPU check so that an unwritten output cannot pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from stof_trt.rewrite.functions import (DOMAIN, add_layernorm_function, add_layernorm_overload,  # noqa: E402
                                        attention_overload, gemm_epilogue_function, sparse_attention_function)
from stof_trt import ort as sort  # noqa: E402
from stof_trt.format import STOF_FORMAT_VERSION, compile_mask  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402

OPSET = 17
NP2ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}

needs_lib = pytest.mark.skipif(not sort.library_available(), reason="libstof_ort.so not built")
needs_cuda = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="no CUDA execution provider (onnxruntime-gpu)")


# ---------------------------------------------------------------------------------------------------------------
# graph builders
# ---------------------------------------------------------------------------------------------------------------
def _model(nodes, inputs, outputs, inits, functions):
    g = helper.make_graph(nodes, "stof_test", inputs, outputs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                          functions=functions)
    m.ir_version = 10
    return m


def attention_model(layout, *, B, H, D, dtype=np.float16, padding=False, bias_shape=None, scale=None,
                    dynamic=True, format_version=STOF_FORMAT_VERSION, kv_heads=None):
    """One StofSparseAttention node; q/k/v (and key_padding_mask / attn_bias) are graph inputs; k/v have kv_heads
    heads (grouped-query attention) when given."""
    et = NP2ONNX[dtype]
    sq = "Sq" if dynamic else layout.seq_q
    sk = "Sk" if dynamic else layout.seq_k
    inputs = [helper.make_tensor_value_info("q", et, [B, H, sq, D]),
              helper.make_tensor_value_info("k", et, [B, kv_heads or H, sk, D]),
              helper.make_tensor_value_info("v", et, [B, kv_heads or H, sk, D])]
    arrays = layout.arrays()
    inits = [numpy_helper.from_array(np.ascontiguousarray(arrays[n], np.int32), n)
             for n in ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps")]
    names = ["q", "k", "v", "row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"]
    if padding:
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, [B, sk]))
        names.append("kpm")
    if bias_shape is not None:
        if not padding:
            names.append("")
        inputs.append(helper.make_tensor_value_info("bias", et, list(bias_shape)))
        names.append("bias")
    node = helper.make_node("StofSparseAttention", names, ["o"], domain=DOMAIN, name="attn0",
                            scale=float(scale if scale is not None else 1.0 / math.sqrt(D)),
                            tile_m=layout.tile_m, tile_n=layout.tile_n, seq_q=layout.seq_q, seq_k=layout.seq_k,
                            num_layouts=layout.num_layouts, format_version=format_version,
                            mask_spec=layout.mask_spec or "")
    ov = attention_overload(padding, bias_shape is not None)
    node.overload = ov
    out = helper.make_tensor_value_info("o", et, None)
    return _model([node], inputs, [out], inits, [sparse_attention_function(OPSET, padding, bias_shape is not None)])


def gemm_model(K, N, activation, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    et = NP2ONNX[dtype]
    w = (rng.standard_normal((K, N)) / math.sqrt(K)).astype(dtype)
    b = rng.standard_normal(N).astype(dtype)
    node = helper.make_node("StofGemmEpilogue", ["x", "W", "b"], ["y"], domain=DOMAIN, name="gemm0",
                            activation=activation)
    node.overload = activation
    m = _model([node], [helper.make_tensor_value_info("x", et, ["B", "S", K])],
               [helper.make_tensor_value_info("y", et, None)],
               [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
               [gemm_epilogue_function(OPSET, activation)])
    return m, w, b


def layernorm_model(N, dtype=np.float16, has_bias=True, has_sum=False, eps=1e-12, seed=0):
    rng = np.random.default_rng(seed)
    et = NP2ONNX[dtype]
    gamma = (1 + 0.1 * rng.standard_normal(N)).astype(dtype)
    beta = (0.1 * rng.standard_normal(N)).astype(dtype)
    bias = (0.1 * rng.standard_normal(N)).astype(dtype)
    ins = ["x", "r", "gamma", "beta"] + (["bias"] if has_bias else [])
    outs = ["y"] + (["s"] if has_sum else [])
    node = helper.make_node("StofAddLayerNorm", ins, outs, domain=DOMAIN, name="ln0", epsilon=eps)
    node.overload = add_layernorm_overload(has_bias, has_sum)
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(beta, "beta")]
    if has_bias:
        inits.append(numpy_helper.from_array(bias, "bias"))
    m = _model([node], [helper.make_tensor_value_info("x", et, ["B", "S", N]),
                        helper.make_tensor_value_info("r", et, ["B", "S", N])],
               [helper.make_tensor_value_info(o, et, None) for o in outs], inits,
               [add_layernorm_function(OPSET, has_bias, has_sum)])
    return m, gamma, beta, (bias if has_bias else None)


# ---------------------------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------------------------
def attention_ref(q, k, v, layout, scale, kpm=None, bias=None):
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    B, H, Sq, D = q.shape
    k, v = (np.repeat(a, H // a.shape[1], axis=1) for a in (k, v))  # grouped K/V: query head h reads h // group
    Sk = k.shape[2]
    dense = layout.to_dense()[:, :Sq, :Sk]  # [L, Sq, Sk]
    allowed = np.stack([dense[h % layout.num_layouts] for h in range(H)])[None].repeat(B, 0)
    if kpm is not None:
        allowed = allowed & (kpm[:, None, None, :] != 0)
    s = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    if bias is not None:
        s = s + bias.astype(np.float64)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.where(allowed, np.exp(s - m), 0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den == 0, 1, den)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def _erf(x):
    return np.vectorize(math.erf)(x)


def gemm_ref(x, w, b, activation):
    y = x.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    if activation == "gelu_erf":
        return 0.5 * y * (1 + _erf(y / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    return y


def layernorm_ref(x, r, gamma, beta, bias, eps):
    s = x.astype(np.float64) + r.astype(np.float64)
    if bias is not None:
        s = s + bias.astype(np.float64)
    mu = s.mean(-1, keepdims=True)
    var = ((s - mu) ** 2).mean(-1, keepdims=True)
    return (s - mu) / np.sqrt(var + eps) * gamma.astype(np.float64) + beta.astype(np.float64), s


def _cuda_run(model, feeds, **kw):
    """Run on the CUDA EP with the plugin, through IO binding with NaN-poisoned preallocated outputs."""
    sess = sort.session(model, **kw)
    b = sort.Binding(sess, feeds)
    b.run()
    for v in b._outputs:  # poison, then run again into the same buffers
        v.update_inplace(np.full(v.shape(), np.nan, dtype=v.numpy().dtype))
    b.run()
    return b.outputs(), sess


def _cpu_run(model, feeds):
    so = ort.SessionOptions()
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


# ---------------------------------------------------------------------------------------------------------------
# tests that need only the built library (no GPU)
# ---------------------------------------------------------------------------------------------------------------
@needs_lib
def test_library_registers_and_function_fallback_without_it():
    """The library loads and registers without a GPU.  Its kernels are CUDA-EP kernels: a CPU-only session must not
    register it (ORT then finds no kernel for the custom schema), and without it the model-local function runs."""
    layout = compile_mask("sliding:window=16", 96, 96, tile_m=32, tile_n=32)
    m = attention_model(layout, B=1, H=2, D=16, dtype=np.float32, padding=True)
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((1, 2, 96, 16)).astype(np.float32) for n in "qkv"}
    feeds["kpm"] = (rng.random((1, 96)) > 0.2).astype(np.int32)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(sort.library_path()))
    with pytest.raises(Exception, match="implementation"):
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sort.session(m, providers="cpu").run(None, feeds)[0]  # register defaults to False on the CPU EP
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 4, feeds["kpm"])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


@needs_lib
def test_bad_tactic_cache_is_an_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"format": "stof-tactic-cache", "version": 1, "entries": [ {"gpu": 1} ]}')
    so = ort.SessionOptions()
    so.add_session_config_entry(sort.CONFIG_TACTIC_CACHE, str(p))
    with pytest.raises(Exception, match="tactic cache"):
        so.register_custom_ops_library(str(sort.library_path()))


# ---------------------------------------------------------------------------------------------------------------
# CUDA EP
# ---------------------------------------------------------------------------------------------------------------
ATTN_CASES = [
    # spec, S, tile, B, H, D, dtype, padding, bias
    ("longformer:window=32,global=8", 256, (64, 64), 2, 4, 64, np.float16, True, None),
    ("causal", 200, (64, 64), 2, 3, 64, np.float16, False, None),
    ("bigbird:block=64,window=1,global=1,random=0.1,seed=3", 320, (64, 64), 1, 2, 128, np.float16, True, None),
    ("sliding:window=40", 130, (32, 32), 2, 2, 64, np.float32, True, None),
    ("causal", 96, (64, 64), 1, 2, 64, np.float32, False, None),
    ("dilated:window=64,dilation=2", 160, (64, 64), 1, 2, 48, np.float16, False, None),  # D=48: general kernel
    ("longformer:window=16,global=4", 128, (64, 64), 2, 2, 64, np.float16, False, (2, 1, 128, 128)),
    ("causal", 128, (64, 64), 2, 2, 32, np.float32, True, (1, 128)),
]


@needs_lib
@needs_cuda
@pytest.mark.parametrize("spec,S,tile,B,H,D,dtype,padding,bias", ATTN_CASES)
def test_sparse_attention_cuda(spec, S, tile, B, H, D, dtype, padding, bias):
    layout = compile_mask(spec, S, S, tile_m=tile[0], tile_n=tile[1])
    m = attention_model(layout, B=B, H=H, D=D, dtype=dtype, padding=padding, bias_shape=bias)
    rng = np.random.default_rng(S + D)
    feeds = {n: rng.standard_normal((B, H, S, D)).astype(dtype) for n in "qkv"}
    kpm = None
    if padding:
        lengths = rng.integers(S // 2, S + 1, size=B)
        kpm = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)
        feeds["kpm"] = kpm
    if bias is not None:
        feeds["bias"] = (0.5 * rng.standard_normal(bias)).astype(dtype)
    scale = 1.0 / math.sqrt(D)
    (got,), _ = _cuda_run(m, feeds)
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, scale, kpm, feeds.get("bias"))
    tol = 2e-3 if dtype == np.float16 else 2e-5
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol)
    cpu = _cpu_run(m, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float64), cpu.astype(np.float64), atol=2 * tol, rtol=2 * tol)


@needs_lib
@needs_cuda
@pytest.mark.parametrize("D,dtype,padding", [(64, np.float16, False), (128, np.float16, True),
                                             (48, np.float16, False), (64, np.float32, True)])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sparse_attention_grouped_kv(D, dtype, padding, kv_heads):
    """K/V with fewer heads than Q (H=4): the tensor-core kernels (D 64/128, fp16) and the general kernel (D=48,
    fp32) read K/V head h // (H / kv_heads), as the reference and the ONNX function on CPU do."""
    B, H, S = 2, 4, 160
    layout = compile_mask("causal", S, S)
    m = attention_model(layout, B=B, H=H, D=D, dtype=dtype, padding=padding, kv_heads=kv_heads)
    rng = np.random.default_rng(D + kv_heads)
    feeds = {"q": rng.standard_normal((B, H, S, D)).astype(dtype)}
    feeds.update({n: rng.standard_normal((B, kv_heads, S, D)).astype(dtype) for n in "kv"})
    kpm = None
    if padding:
        kpm = (np.arange(S)[None, :] < np.array([S, 97])[:, None]).astype(np.int32)
        feeds["kpm"] = kpm
    (got,), _ = _cuda_run(m, feeds)
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1.0 / math.sqrt(D), kpm)
    tol = 2e-3 if dtype == np.float16 else 2e-5
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol)
    cpu = _cpu_run(m, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float64), cpu.astype(np.float64), atol=2 * tol, rtol=2 * tol)


def packed_attention_model(layout, *, B, H, D, dtype=np.float16, padding=False):
    """One StofSparseAttention node with qkv_format "bs3hd": query [B,S,3,H,D], no key/value, output [B,S,H,D]."""
    et = NP2ONNX[dtype]
    inputs = [helper.make_tensor_value_info("qkv", et, [B, "S", 3, H, D])]
    arrays = layout.arrays()
    inits = [numpy_helper.from_array(np.ascontiguousarray(arrays[n], np.int32), n)
             for n in ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps")]
    names = ["qkv", "", "", "row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"]
    if padding:
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, [B, "S"]))
        names.append("kpm")
    node = helper.make_node("StofSparseAttention", names, ["o"], domain=DOMAIN, name="attn0",
                            scale=float(1.0 / math.sqrt(D)), tile_m=layout.tile_m, tile_n=layout.tile_n,
                            seq_q=layout.seq_q, seq_k=layout.seq_k, num_layouts=layout.num_layouts,
                            format_version=STOF_FORMAT_VERSION, mask_spec=layout.mask_spec or "", qkv_format="bs3hd")
    node.overload = attention_overload(padding, False, packed=True)
    out = helper.make_tensor_value_info("o", et, None)
    return _model([node], inputs, [out], inits, [sparse_attention_function(OPSET, padding, False, packed=True)])


@needs_lib
@needs_cuda
@pytest.mark.parametrize("spec,S,B,H,D,dtype,padding", [
    ("causal", 200, 2, 3, 64, np.float16, True),             # tensor-core kernels, strided q/k/v/o
    ("longformer:window=32,global=8", 256, 2, 2, 128, np.float16, False),
    ("sliding:window=40", 130, 2, 2, 64, np.float32, True),  # general kernel (fp32), strided
    ("full", 96, 1, 2, 48, np.float16, True),                # general kernel (D=48)
])
def test_sparse_attention_packed_qkv(spec, S, B, H, D, dtype, padding):
    layout = compile_mask(spec, S, S)
    m = packed_attention_model(layout, B=B, H=H, D=D, dtype=dtype, padding=padding)
    rng = np.random.default_rng(S + 7 * D)
    qkv = rng.standard_normal((B, S, 3, H, D)).astype(dtype)
    feeds = {"qkv": qkv}
    kpm = None
    if padding:
        lengths = rng.integers(S // 2, S + 1, size=B)
        kpm = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)
        feeds["kpm"] = kpm
    (got,), _ = _cuda_run(m, feeds)
    assert got.shape == (B, S, H, D) and np.isfinite(got).all()
    q, k, v = (np.ascontiguousarray(qkv[:, :, i].transpose(0, 2, 1, 3)) for i in range(3))
    ref = attention_ref(q, k, v, layout, 1.0 / math.sqrt(D), kpm).transpose(0, 2, 1, 3)
    tol = 2e-3 if dtype == np.float16 else 2e-5
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol)
    cpu = _cpu_run(m, feeds)[0]  # the packed overload of the model-local function
    np.testing.assert_allclose(got.astype(np.float64), cpu.astype(np.float64), atol=2 * tol, rtol=2 * tol)


@needs_lib
@needs_cuda
def test_sparse_attention_long_sequence_picks_from_every_tactic(capfd, monkeypatch):
    """S = 2^18 under one layout (a band and 2 global tokens): one bitmap per tile of the whole grid would pass 2^32
    bytes, the layout's few bitmaps do not.  The library bounds the wgmma tactics' 32-bit bitmap offsets by the
    layout's bitmaps, so on sm_90 the pre-search pick may be, and is, a wgmma tactic; sampled rows against
    float64."""
    import re

    from stof_trt import kernels

    # the pick is the pre-search's, printed by the verbose plugin: no tactic cache, no pre-search switch-off
    monkeypatch.delenv("STOF_TACTIC_CACHE", raising=False)
    monkeypatch.delenv("STOF_ORT_PRESEARCH", raising=False)
    monkeypatch.setenv("STOF_FIRST_USE_TIMING", "0")
    S, B, H, D = 1 << 18, 1, 2, 64
    spec = "sliding:window=128|global:n=2"
    layout = compile_mask(spec, S, S)
    m = attention_model(layout, B=B, H=H, D=D, dynamic=False)
    rng = np.random.default_rng(18)
    feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float16) for n in "qkv"}
    (got,), _ = _cuda_run(m, feeds, verbose=True)
    log = capfd.readouterr().err
    assert np.isfinite(got).all()
    rows = np.unique(np.concatenate([[0, 1, 2, S // 2, S - 1], rng.integers(0, S, 59)]))
    allowed = np.broadcast_to(parse_mask(spec).evaluate(rows[:, None].astype(np.int64), np.arange(S)[None, :],
                                                        seq_q=S, seq_k=S), (len(rows), S))
    for h in range(H):
        q, k, v = (feeds[n][0, h].astype(np.float64) for n in "qkv")
        sc = np.where(allowed, q[rows] @ k.T / math.sqrt(D), -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        ref = (p @ v) / p.sum(-1, keepdims=True)
        err = np.linalg.norm(got[0, h, rows].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err <= 2e-3, (h, err)
    pick = re.search(r"pre-search first choice (\d+)", log)
    assert pick, log[-2000:]
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() == (9, 0):
        assert kernels.tactic_info(int(pick.group(1))).family == kernels.FAMILY_HOPPER, log[-2000:]


@needs_lib
@needs_cuda
def test_first_use_timing_creates_the_cache_and_a_second_session_reads_it(capfd, monkeypatch, tmp_path):
    """The plugin's default: the first run of a problem without a cache entry times the shortlist (verbose says
    "first-use timing"), writes the new cache file, and gives the right output; a second session reads the entry
    back ("tactic cache"); first_use_timing=False gives the pre-search's first choice."""
    import json

    monkeypatch.delenv("STOF_FIRST_USE_TIMING", raising=False)
    monkeypatch.delenv("STOF_ORT_PRESEARCH", raising=False)
    monkeypatch.delenv("STOF_TACTIC_CACHE", raising=False)
    layout = compile_mask("causal", 1024, 1024)
    m = attention_model(layout, B=2, H=4, D=64)
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal((2, 4, 1024, 64)).astype(np.float16) for n in "qkv"}
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 8)
    path = tmp_path / "new-cache.json"
    (got,), _ = _cuda_run(m, feeds, tactic_cache=path, verbose=True)
    assert "first-use timing" in capfd.readouterr().err
    assert np.abs(got.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max()
    [entry] = json.loads(path.read_text())["entries"]
    assert entry["source"] == "timed" and entry["tactic"] in [int(t) for t in entry["candidates"]]
    (got2,), _ = _cuda_run(m, feeds, tactic_cache=path, verbose=True)
    assert f"tactic cache {entry['tactic']}" in capfd.readouterr().err
    np.testing.assert_array_equal(got2, got)
    (got3,), _ = _cuda_run(m, feeds, verbose=True, first_use_timing=False)
    assert "pre-search first choice" in capfd.readouterr().err
    assert np.abs(got3.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max()


@needs_lib
@needs_cuda
def test_sparse_attention_shorter_runtime_sequence():
    layout = compile_mask("longformer:window=32,global=8", 256, 256)
    m = attention_model(layout, B=2, H=2, D=64, padding=True)
    rng = np.random.default_rng(5)
    S = 150  # < compiled 256: the top-left corner of the pattern
    feeds = {n: rng.standard_normal((2, 2, S, 64)).astype(np.float16) for n in "qkv"}
    feeds["kpm"] = np.ones((2, S), np.int32)
    feeds["kpm"][1, 100:] = 0
    (got,), _ = _cuda_run(m, feeds)
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 8, feeds["kpm"])
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=2e-3, rtol=2e-3)


@needs_lib
@needs_cuda
def test_sparse_attention_refuses_lengths_above_the_compiled_one():
    """Compiled at 100 with 64-row tiles: 100 runs right; 101 and 128 (inside the last tile, where the layout's tile
    padding lies) and 129 are error statuses naming seq_q, never a wrong output."""
    layout = compile_mask("causal", 100, 100)
    m = attention_model(layout, B=1, H=2, D=64)
    sess = sort.session(m)
    rng = np.random.default_rng(6)
    for S in (100, 64, 1):
        feeds = {n: rng.standard_normal((1, 2, S, 64)).astype(np.float16) for n in "qkv"}
        ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 8)
        np.testing.assert_allclose(sess.run(None, feeds)[0].astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    for S in (101, 128, 129):
        feeds = {n: rng.standard_normal((1, 2, S, 64)).astype(np.float16) for n in "qkv"}
        with pytest.raises(Exception, match="seq_q=100"):
            sess.run(None, feeds)


@needs_lib
@needs_cuda
def test_sparse_attention_layout_fed_at_run_time():
    """Layout arrays as graph inputs (not constant): each call checks the fed layout (a layout handle per call on
    the input tensors), so one session runs two masks of the same sizes, and a malformed one is an error status."""
    first = compile_mask("longformer:window=32,global=8", 256, 256)
    m = attention_model(first, B=2, H=2, D=64)
    names = ("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps")
    del m.graph.initializer[:]
    for n in names:
        m.graph.input.append(helper.make_tensor_value_info(n, TensorProto.INT32, ["rows", "cols"] if n == "bitmaps"
                                                           else [n + "_len"]))
    sess = sort.session(m)
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal((2, 2, 256, 64)).astype(np.float16) for n in "qkv"}
    for spec in ("longformer:window=32,global=8", "causal", "bigbird:block=64,window=1,global=1,random=0.2,seed=1"):
        layout = compile_mask(spec, 256, 256)
        arrays = {n: np.ascontiguousarray(a, np.int32) for n, a in layout.arrays().items()}
        got = sess.run(None, {**feeds, **arrays})[0]
        ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 8)
        np.testing.assert_allclose(got.astype(np.float64), ref, atol=2e-3, rtol=2e-3, err_msg=spec)
    bad = {n: np.ascontiguousarray(a, np.int32) for n, a in first.arrays().items()}
    bad["col_idx"][0] = 99
    with pytest.raises(Exception, match="col_idx"):
        sess.run(None, {**feeds, **bad})


@needs_lib
@needs_cuda
def test_sparse_attention_reads_format_versions_1_and_2():
    """A version-1 layout (one bitmap per partial tile) runs as its shared version-2 form does; version 3 is refused."""
    layout = compile_mask("sliding:window=40", 320, 320)
    assert layout.num_bitmaps < layout.num_partial  # shared in version 2
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal((2, 3, 320, 64)).astype(np.float16) for n in "qkv"}
    ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1 / 8)
    for lay, version in ((layout, STOF_FORMAT_VERSION), (layout.unshared(), 1)):
        (got,), _ = _cuda_run(attention_model(lay, B=2, H=3, D=64, format_version=version), feeds)
        np.testing.assert_allclose(got.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(Exception, match="format_version"):  # at session creation or, at the latest, the run
        sort.session(attention_model(layout, B=2, H=3, D=64, format_version=STOF_FORMAT_VERSION + 1)).run(None, feeds)


@needs_lib
@needs_cuda
@pytest.mark.parametrize("what", ["too_long", "bad_kpm_shape", "bad_layout", "d_mismatch"])
def test_sparse_attention_errors_are_statuses(what):
    layout = compile_mask("causal", 128, 128)
    rng = np.random.default_rng(0)
    m = attention_model(layout, B=1, H=2, D=64, padding=True)
    S = 128
    feeds = {n: rng.standard_normal((1, 2, S, 64)).astype(np.float16) for n in "qkv"}
    feeds["kpm"] = np.ones((1, S), np.int32)
    if what == "too_long":
        feeds = {n: rng.standard_normal((1, 2, 192, 64)).astype(np.float16) for n in "qkv"}
        feeds["kpm"] = np.ones((1, 192), np.int32)
    elif what == "bad_kpm_shape":
        feeds["kpm"] = np.ones((1, 64), np.int32)
    elif what == "bad_layout":
        for init in m.graph.initializer:
            if init.name == "col_idx":
                arr = numpy_helper.to_array(init).copy()
                arr[0] = 999
                init.CopyFrom(numpy_helper.from_array(arr, "col_idx"))
    elif what == "d_mismatch":  # the graph declares D symbolic, so only the kernel can catch it
        for vi in m.graph.input[:3]:
            vi.type.tensor_type.shape.dim[3].dim_param = "D"
        feeds["k"] = rng.standard_normal((1, 2, S, 32)).astype(np.float16)
        feeds["v"] = feeds["k"]
    with pytest.raises(Exception) as ei:
        sess = sort.session(m)
        sess.run(None, feeds)
    msg = str(ei.value)
    assert "StofSparseAttention" in msg or "type" in msg.lower() or "shape" in msg.lower(), msg


@needs_lib
@needs_cuda
@pytest.mark.parametrize("activation", ["none", "gelu_erf", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gemm_epilogue_cuda(activation, dtype):
    K, N = 96, 200
    m, w, b = gemm_model(K, N, activation, dtype)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 37, K)).astype(dtype)
    (got,), _ = _cuda_run(m, {"x": x})
    ref = gemm_ref(x, w, b, activation)
    tol = 1e-2 if dtype == np.float16 else 1e-4
    assert got.shape == (3, 37, N)
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(got.astype(np.float64), _cpu_run(m, {"x": x})[0].astype(np.float64),
                               atol=2 * tol, rtol=2 * tol)


@needs_lib
@needs_cuda
@pytest.mark.parametrize("activation", ["none", "gelu_erf"])
def test_gemm_first_use_timing_across_a_bucket(activation):
    """A node without an `algo` times cuBLASLt's candidates at the first call of a row-count bucket and reuses the
    choice for another M of the bucket; with timing off it runs the heuristic's first: both equal the reference."""
    K, N = 768, 2304
    m, w, b = gemm_model(K, N, activation)
    rng = np.random.default_rng(3)
    for timing in (True, False):
        sess = sort.session(m, first_use_timing=timing)
        for rows in (1000, 990, 1024, 77, 1000):
            x = rng.standard_normal((1, rows, K)).astype(np.float16)
            got = sess.run(None, {"x": x})[0].astype(np.float64)
            np.testing.assert_allclose(got, gemm_ref(x, w, b, activation), atol=2e-2, rtol=2e-2)


@needs_lib
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("has_bias,has_sum", [(True, False), (False, False), (True, True)])
def test_add_layernorm_cuda(dtype, has_bias, has_sum):
    N = 768
    m, gamma, beta, bias = layernorm_model(N, dtype, has_bias, has_sum)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 33, N)).astype(dtype)
    r = rng.standard_normal((2, 33, N)).astype(dtype)
    outs, _ = _cuda_run(m, {"x": x, "r": r})
    ref, s = layernorm_ref(x, r, gamma, beta, bias, 1e-12)
    tol = 1e-2 if dtype == np.float16 else 1e-4
    np.testing.assert_allclose(outs[0].astype(np.float64), ref, atol=tol, rtol=tol)
    if has_sum:
        np.testing.assert_allclose(outs[1].astype(np.float64), s, atol=tol, rtol=tol)


@needs_lib
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("rows,N", [(66, 768), (1200, 768), (66, 770), (10, 2048), (1200, 2048)])
def test_add_layernorm_cuda_each_kernel(dtype, rows, N):
    """Each of the three kernels: one CTA per row at few rows of 16-byte vectors, one warp per row at more rows
    of at most 4 vectors per lane, the shared-memory kernel for widths that are neither (770: not whole vectors;
    2048 at 1200 rows: more than 4 vectors per lane)."""
    m, gamma, beta, bias = layernorm_model(N, dtype, True, True, seed=rows + N)
    rng = np.random.default_rng(rows * N)
    x = (rng.standard_normal((1, rows, N)) * 3 + 5).astype(dtype)  # a large mean: the variance must not cancel
    r = rng.standard_normal((1, rows, N)).astype(dtype)
    outs, _ = _cuda_run(m, {"x": x, "r": r})
    ref, s = layernorm_ref(x, r, gamma, beta, bias, 1e-12)
    tol = 1e-2 if dtype == np.float16 else 1e-4
    np.testing.assert_allclose(outs[0].astype(np.float64), ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(outs[1].astype(np.float64), s, atol=tol * 8, rtol=tol)


@needs_lib
@needs_cuda
def test_epilogue_shape_errors():
    m, _, _ = gemm_model(64, 32, "none")
    with pytest.raises(Exception):
        sort.session(m).run(None, {"x": np.ones((2, 3, 65), np.float16)})


@needs_lib
@needs_cuda
def test_cuda_graph_replay_matches():
    """ORT's CUDA graph capture/replay (enable_cuda_graph) over the STOF kernels: new inputs copied into the bound
    buffers give the new results."""
    layout = compile_mask("longformer:window=32,global=8", 256, 256)
    m = attention_model(layout, B=2, H=2, D=64, padding=True, dynamic=False)
    rng = np.random.default_rng(9)

    def feeds():
        f = {n: rng.standard_normal((2, 2, 256, 64)).astype(np.float16) for n in "qkv"}
        f["kpm"] = (rng.random((2, 256)) > 0.1).astype(np.int32)
        return f

    sess = sort.session(m, cuda_graphs=True)
    f0 = feeds()
    b = sort.Binding(sess, f0)
    for _ in range(3):
        b.run()
    for _ in range(2):
        f = feeds()
        b.update(f)
        b.run()
        ref = attention_ref(f["q"], f["k"], f["v"], layout, 1 / 8, f["kpm"])
        np.testing.assert_allclose(b.outputs()[0].astype(np.float64), ref, atol=2e-3, rtol=2e-3)
