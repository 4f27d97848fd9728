"""The index nodes and node forms of the rewrites, each in a one-node graph against a NumPy reference: StofPackTokens
(padding removal into a token capacity) and, of the LongformerAttention rewrite, StofGlobalSlots, StofGemmEpilogue
with its prefix rows (and their own weights), StofSparseAttention with a [B, Sq, H·D] query (num_heads), with
windows of one row tensor (query_view / key_view) and rows written over its output (row_values / row_index).  On ORT CPU they run as their model-local functions (no GPU needed); on
the CUDA EP with libstof_ort as the plugin kernels, outputs poisoned first (a fresh session per run)."""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from stof_trt import ort as sort  # noqa: E402
from stof_trt.format import STOF_FORMAT_VERSION, TileLayout  # noqa: E402
from stof_trt.rewrite.functions import (DOMAIN, attention_overload, gemm_epilogue_function,  # noqa: E402
                                        gemm_overload, global_slots_function, global_slots_overload,
                                        pack_tokens_function, sparse_attention_function)

OPSET = 17
ET = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and sort.library_available()
PROVIDERS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA EP or plugin"))]


def _model(node, inputs, outputs, inits, function):
    g = helper.make_graph([node], "g", inputs, outputs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                          functions=[function])
    m.ir_version = 10
    return m


def _run(model, feeds, provider):
    """ORT CPU (the functions; the library not registered) or the CUDA EP with the plugin, through IO binding with
    NaN-poisoned preallocated outputs."""
    if provider == "cpu":
        return sort.session(model, providers="cpu").run(None, feeds)
    b = sort.Binding(sort.session(model), feeds)
    b.run()
    for v in b._outputs:  # poison, then run again into the same buffers
        v.update_inplace(np.full(v.shape(), np.nan if v.numpy().dtype.kind == "f" else -7, dtype=v.numpy().dtype))
    b.run()
    return b.outputs()


# -- StofPackTokens ----------------------------------------------------------------------------------------------
def pack_reference(mask, C):
    keep = mask.reshape(-1) != 0
    T = int(keep.sum())
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)])  # real tokens first, in position order
    rank = np.cumsum(keep) - 1
    rows = np.where(keep, rank, C) if T <= C else np.full(keep.size, C + 1)
    offsets = np.minimum(np.concatenate([[0], np.cumsum((mask != 0).sum(1))]), C)
    return order[:C].astype(np.int32), offsets.astype(np.int32), rows.astype(np.int32)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("B,S,caps", [(5, 300, ("T", "T+7", "BS", "T-1")), (3, 5000, ("T", "BS")), (1, 1, ("BS",))])
def test_pack_tokens_equal_their_definition(provider, B, S, caps):
    """Real tokens first in position order, then the padded positions; offsets clamped to the capacity; restore rows
    (the zero row C for padding, the NaN row C + 1 everywhere when T > C); holes, empty rows and full rows, and a
    length above one pass of the kernel's scan."""
    rng = np.random.default_rng(7)
    mask = (rng.random((B, S)) < 0.6).astype(np.int32) * rng.integers(1, 5, (B, S)).astype(np.int32)
    mask[0] = 1
    if B > 2:
        mask[2] = 0
    T = int((mask != 0).sum())
    node = helper.make_node("StofPackTokens", ["mask", "cap"], ["idx", "off", "rows"], domain=DOMAIN)
    model = _model(node, [helper.make_tensor_value_info("mask", TensorProto.INT32, ["B", "S"]),
                          helper.make_tensor_value_info("cap", TensorProto.INT32, ["C"])],
                   [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("idx", "off", "rows")], [],
                   pack_tokens_function(OPSET))
    for cap in caps:
        C = {"T": T, "T+7": T + 7, "BS": B * S, "T-1": T - 1}[cap]
        got = _run(model, {"mask": mask, "cap": np.zeros(C + (3 if cap == "BS" else 0), np.int32)}, provider)
        for name, g, w in zip(("idx", "seq_offsets", "source_row"), got, pack_reference(mask, min(C, B * S))):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} C={cap}")


# -- StofGlobalSlots --------------------------------------------------------------------------------------------
def slots_reference(x, mask, glob, G):
    B, S, N = x.shape
    slot_x = np.zeros((B, G, N), x.dtype)
    local = np.zeros((B, G + S), np.int32)
    keep = ~(mask < 0)
    row_index = np.full((B, G), -1, np.int32)
    for b in range(B):
        kept = np.flatnonzero(keep[b] & (glob[b] != 0))
        local[b, G:] = keep[b] & ~np.isin(np.arange(S), kept)
        local[b, :min(len(kept), G)] = 1
        if len(kept) > G:
            slot_x[b] = np.nan
            continue
        slot_x[b, :len(kept)] = x[b, kept]
        row_index[b, :len(kept)] = kept
    return slot_x, local, keep.astype(np.int32), row_index


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("N,G", [(40, 8), (36, 8), (40, 21)])
def test_global_slots_equal_their_definition(provider, dtype, N, G):
    """Kept global tokens in position order (padded ones take no slot), zeros in unused slots, NaN rows and no row
    index for a sequence with more kept global tokens than slots, and the key padding words of both nodes; a length
    above one pass of the kernel's scan (4096 positions); rows of 16-byte vectors and not (fp16 N=36); more slots
    than the plugin's CTAs per sequence (G=21: each CTA gathers every 8th slot)."""
    rng = np.random.default_rng(3)
    B, S = 4, 4500
    x = rng.standard_normal((B, S, N)).astype(dtype)
    mask = np.where(rng.random((B, S)) < 0.1, -10000.0, 0.0).astype(dtype)
    glob = np.zeros((B, S), np.int32)
    glob[0, [3, 17, 4096, 4499]] = 1
    mask[0, 17] = -10000.0                                  # a padded global token: no slot
    glob[2, rng.choice(S, 12, replace=False)] = 7           # overflow (non-zero = global)
    mask[2] = 0
    glob[3, [0, 1, 2, 3, 4, 5, 6, 4100]] = 1                 # exactly G
    mask[3] = 0
    node = helper.make_node("StofGlobalSlots", ["x", "mask", "global"], ["slot_x", "lk", "gk", "ri"],
                            domain=DOMAIN, slots=G)
    node.overload = global_slots_overload(G)
    et = ET[dtype]
    model = _model(node, [helper.make_tensor_value_info("x", et, ["B", "S", N]),
                          helper.make_tensor_value_info("mask", et, ["B", "S"]),
                          helper.make_tensor_value_info("global", TensorProto.INT32, ["B", "S"])],
                   [helper.make_tensor_value_info("slot_x", et, None)] +
                   [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("lk", "gk", "ri")],
                   [], global_slots_function(OPSET, G))
    got = _run(model, {"x": x, "mask": mask, "global": glob}, provider)
    want = slots_reference(x, mask, glob, G)
    for name, g, w in zip(("slot_x", "local_kpm", "global_kpm", "row_index"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)


# -- StofGemmEpilogue with prefix rows --------------------------------------------------------------------------
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("activation,has_bias", [("none", True), ("gelu_erf", True), ("none", False)])
def test_gemm_prefix_rows_come_first(provider, activation, has_bias):
    """Y [B, G+S, N] = act(Concat(P, X, axis=1)·W + bias): the prefix rows first in every sequence, no bias
    passed as an empty input."""
    rng = np.random.default_rng(4)
    B, G, S, K, N = 3, 5, 37, 64, 96
    dtype = np.float16
    w = (rng.standard_normal((K, N)) / math.sqrt(K)).astype(dtype)
    bias = rng.standard_normal(N).astype(dtype)
    node = helper.make_node("StofGemmEpilogue", ["x", "W", "b" if has_bias else "", "p"], ["y"], domain=DOMAIN,
                            activation=activation)
    node.overload = gemm_overload(activation, has_bias, prefix=True)
    inits = [numpy_helper.from_array(w, "W")] + ([numpy_helper.from_array(bias, "b")] if has_bias else [])
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", "S", K]),
                          helper.make_tensor_value_info("p", TensorProto.FLOAT16, ["B", "G", K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], inits,
                   gemm_epilogue_function(OPSET, activation, has_bias, prefix=True))
    x = rng.standard_normal((B, S, K)).astype(dtype)
    p = rng.standard_normal((B, G, K)).astype(dtype)
    y = _run(model, {"x": x, "p": p}, provider)[0]
    want = np.concatenate([p, x], axis=1).astype(np.float64) @ w.astype(np.float64)
    if has_bias:
        want = want + bias
    if activation == "gelu_erf":
        want = 0.5 * want * (1 + np.vectorize(math.erf)(want / math.sqrt(2)))
    assert y.shape == (B, G + S, N)
    np.testing.assert_allclose(y.astype(np.float64), want, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("has_bias", [True, False])
def test_gemm_prefix_rows_with_their_own_weights(provider, has_bias):
    """prefix_w / prefix_bias: Y = Concat(P·W_p + bias_p, X·W + bias) along the rows (the LongformerAttention
    rewrite's one projection: global Q at the slot rows where X's rows take the local Q)."""
    rng = np.random.default_rng(6)
    B, G, S, K, N = 3, 5, 37, 64, 96
    dtype = np.float16
    w, pw = ((rng.standard_normal((K, N)) / math.sqrt(K)).astype(dtype) for _ in range(2))
    bias, pb = (rng.standard_normal(N).astype(dtype) for _ in range(2))
    node = helper.make_node("StofGemmEpilogue", ["x", "W", "b" if has_bias else "", "p", "PW"]
                            + (["pb"] if has_bias else []), ["y"], domain=DOMAIN, activation="none")
    node.overload = gemm_overload("none", has_bias, prefix=True, prefix_weights=True)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(pw, "PW")]
    if has_bias:
        inits += [numpy_helper.from_array(bias, "b"), numpy_helper.from_array(pb, "pb")]
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", "S", K]),
                          helper.make_tensor_value_info("p", TensorProto.FLOAT16, ["B", "G", K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], inits,
                   gemm_epilogue_function(OPSET, "none", has_bias, prefix=True, prefix_weights=True))
    x = rng.standard_normal((B, S, K)).astype(dtype)
    p = rng.standard_normal((B, G, K)).astype(dtype)
    y = _run(model, {"x": x, "p": p}, provider)[0]
    f64 = np.float64
    want = np.concatenate([p.astype(f64) @ pw.astype(f64) + (pb if has_bias else 0),
                           x.astype(f64) @ w.astype(f64) + (bias if has_bias else 0)], axis=1)
    assert y.shape == (B, G + S, N)
    np.testing.assert_allclose(y.astype(f64), want, atol=3e-2, rtol=1e-2)


# -- StofSparseAttention: windows of one row tensor (query_view / key_view) ---------------------------------------
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype,D,q_col,k_col", [(np.float16, 64, 0, 192), (np.float16, 64, 4, 197),
                                                 (np.float32, 16, 3, 40)])
def test_attention_windows_of_one_projection(provider, dtype, D, q_col, k_col):
    """Q and K/V read in place from one [B, R, C] tensor: Q at rows 64.. (to the end), K/V at rows 0.. (to the end)
    with fewer heads, key padding; windows at multiples of 8 elements run the tensor-core kernels (fp16, D=64),
    the others and float32 the general kernel."""
    rng = np.random.default_rng(7)
    B, H, Hkv, G, S = 2, 4, 2, 64, 150
    R, Sq, Sk = G + S, S, G + S
    C = max(q_col + H * D, k_col + 2 * Hkv * D) + 8
    dense = rng.random((Sq, Sk)) < 0.3
    layout = TileLayout.from_dense(dense, 64, 64)
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    ins = ["m", "m", "", *layout.arrays(), "kpm"]
    node = helper.make_node("StofSparseAttention", ins, ["o"], domain=DOMAIN, scale=0.2, tile_m=layout.tile_m,
                            tile_n=layout.tile_n, seq_q=layout.seq_q, seq_k=layout.seq_k,
                            num_layouts=layout.num_layouts, format_version=STOF_FORMAT_VERSION,
                            mask_spec=layout.mask_spec, qkv_format="bshd_kv", num_heads=H,
                            query_view=[G, -1, q_col, H * D], key_view=[0, -1, k_col, 2 * Hkv * D])
    node.overload = attention_overload(True, False, kv=True, flat=True, view=True)
    et = ET[dtype]
    model = _model(node, [helper.make_tensor_value_info("m", et, ["B", "R", C]),
                          helper.make_tensor_value_info("kpm", TensorProto.INT32, ["B", "Sk"])],
                   [helper.make_tensor_value_info("o", et, None)], inits,
                   sparse_attention_function(OPSET, True, False, kv=True, flat=True, view=True))
    m = rng.standard_normal((B, R, C)).astype(dtype)
    keep = rng.random((B, Sk)) < 0.9
    out = _run(model, {"m": m, "kpm": keep.astype(np.int32)}, provider)[0]
    f64 = np.float64
    q4 = m[:, G:, q_col:q_col + H * D].reshape(B, Sq, H, D).astype(f64)
    kv = m[:, :, k_col:k_col + 2 * Hkv * D].reshape(B, Sk, 2, Hkv, D).astype(f64)
    k, v = (np.repeat(kv[:, :, i], H // Hkv, axis=2) for i in range(2))
    s = 0.2 * np.einsum("bqhd,bkhd->bhqk", q4, k)
    allowed = dense[None, None] & keep[:, None, None, :]
    s = np.where(allowed, s, -np.inf)
    mx = np.max(s, -1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
    den = e.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", e / np.where(den == 0, 1, den), v)
    assert out.shape == (B, Sq, H * D)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.astype(f64), want.reshape(B, Sq, H * D), atol=tol, rtol=tol)


# -- StofSparseAttention: [B, Sq, H·D] query, rows written over the output ----------------------------------------
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype,D", [(np.float16, 64), (np.float32, 16)])
def test_attention_flat_query_and_rows(provider, dtype, D):
    """qkv_format bshd_kv with query and output [B, Sq, H·D] (num_heads), key padding, and row_values written at
    row_index (-1 and indices past Sq write nothing); fp16 at head dim 64 runs the tensor-core kernels, float32
    the general kernel."""
    rng = np.random.default_rng(5)
    B, H, Sq, Sk, R = 2, 3, 150, 200, 6
    dense = rng.random((Sq, Sk)) < 0.3
    layout = TileLayout.from_dense(dense, 64, 64)
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    ins = ["q", "kv", "", *layout.arrays(), "kpm", "", "", "rv", "ri"]
    node = helper.make_node("StofSparseAttention", ins, ["o"], domain=DOMAIN, scale=0.2, tile_m=layout.tile_m,
                            tile_n=layout.tile_n, seq_q=layout.seq_q, seq_k=layout.seq_k,
                            num_layouts=layout.num_layouts, format_version=STOF_FORMAT_VERSION,
                            mask_spec=layout.mask_spec, qkv_format="bshd_kv", num_heads=H)
    node.overload = attention_overload(True, False, kv=True, flat=True, rows=True)
    assert node.overload == "kv_flat_padding_rows"
    et = ET[dtype]
    model = _model(node, [helper.make_tensor_value_info("q", et, ["B", "Sq", H * D]),
                          helper.make_tensor_value_info("kv", et, ["B", "Sk", 2, H, D]),
                          helper.make_tensor_value_info("kpm", TensorProto.INT32, ["B", "Sk"]),
                          helper.make_tensor_value_info("rv", et, ["B", R, H, D]),
                          helper.make_tensor_value_info("ri", TensorProto.INT32, ["B", R])],
                   [helper.make_tensor_value_info("o", et, None)], inits,
                   sparse_attention_function(OPSET, True, False, kv=True, flat=True, rows=True))
    q = rng.standard_normal((B, Sq, H * D)).astype(dtype)
    kv = rng.standard_normal((B, Sk, 2, H, D)).astype(dtype)
    keep = rng.random((B, Sk)) < 0.9
    rv = rng.standard_normal((B, R, H, D)).astype(dtype)
    ri = np.array([[0, 149, -1, 7, 400, 150], [5, -1, -1, 60, 61, 62]], np.int32)
    out = _run(model, {"q": q, "kv": kv, "kpm": keep.astype(np.int32), "rv": rv, "ri": ri}, provider)[0]
    # reference: masked softmax per head, then the rows
    q4 = q.reshape(B, Sq, H, D).astype(np.float64)
    s = 0.2 * np.einsum("bqhd,bkhd->bhqk", q4, kv[:, :, 0].astype(np.float64))
    allowed = dense[None, None] & keep[:, None, None, :]
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    den = e.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", e / np.where(den == 0, 1, den), kv[:, :, 1].astype(np.float64))
    for b in range(B):
        for r in range(R):
            if 0 <= ri[b, r] < Sq:
                want[b, ri[b, r]] = rv[b, r]
    assert out.shape == (B, Sq, H * D)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), want.reshape(B, Sq, H * D), atol=tol, rtol=tol)
