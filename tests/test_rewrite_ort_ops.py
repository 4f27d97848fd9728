"""ONNX Runtime's own attention operators as rewrite inputs: GroupQueryAttention (local_window_size),
SparseAttention, LongformerAttention, MultiHeadAttention with attention_bias / key_padding_mask.

Where ONNX Runtime has a CPU kernel (GroupQueryAttention, MultiHeadAttention) the rewritten model is compared with
the original; SparseAttention and LongformerAttention are CUDA-only, so the rewritten model (function fallback on
CPU) is compared with a float64 NumPy reference of the operator's documented semantics."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.rewrite import fuse_ort_longformer, rewrite_model
from models_util import TILE, assert_fused, op_counts, run

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def _model(nodes, inputs, outputs, inits=()):
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=OPSETS)
    model.ir_version = 9
    return model


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _softmax_attention(q, k, v, allowed, scale):
    """float64 reference: q [B,H,Sq,D], k/v [B,H,Sk,D], allowed bool broadcastable to [B,H,Sq,Sk]; rows with no
    allowed key give 0."""
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    s = np.where(allowed, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.where(allowed, np.exp(s - mx), 0.0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)
    return np.einsum("bhqk,bhkd->bhqd", p, v.astype(np.float64))


def _heads(x, h):
    b, s, n = x.shape
    return x.reshape(b, s, h, n // h).transpose(0, 2, 1, 3)


def _merge(x):
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


# -- GroupQueryAttention --------------------------------------------------------------------------------------------
def gqa_model(B, S, H, KV, D, window, scale=None):
    attrs = dict(num_heads=H, kv_num_heads=KV, local_window_size=window)
    if scale is not None:
        attrs["scale"] = scale
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], ["y"],
                            domain="com.microsoft", **attrs)
    ins = [_vi("q", TensorProto.FLOAT, [B, S, H * D]), _vi("k", TensorProto.FLOAT, [B, S, KV * D]),
           _vi("v", TensorProto.FLOAT, [B, S, KV * D]), _vi("seqlens_k", TensorProto.INT32, [B]),
           _vi("total", TensorProto.INT32, [])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, [B, S, H * D])])


def gqa_feeds(rng, B, S, H, KV, D, lengths):
    return {"q": rng.standard_normal((B, S, H * D)).astype(np.float32),
            "k": rng.standard_normal((B, S, KV * D)).astype(np.float32),
            "v": rng.standard_normal((B, S, KV * D)).astype(np.float32),
            "seqlens_k": np.asarray(lengths, np.int32) - 1, "total": np.array(S, np.int32)}


def gqa_reference(feeds, H, KV, D, window, lengths):
    """GroupQueryAttention's documented semantics in float64: causal, a query sees its last `window` keys (window
    0: all of them), keys past each sequence's length masked; [B, S, H * D]."""
    S = feeds["q"].shape[1]
    q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
    k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    allowed = (j <= i) & (((i - j) < window) if window > 0 else True)
    allowed = allowed[None, None] & (j < np.asarray(lengths)[:, None, None, None])
    return _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D)))


@pytest.mark.parametrize("H,KV,window", [(4, 2, 7), (4, 1, 0), (4, 4, 16), (8, 2, 33)])
def test_gqa_local_window_matches_ort(H, KV, window):
    B, S, D = 2, 40, 8
    model = gqa_model(B, S, H, KV, D, window if window else -1)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "GroupQueryAttention": 0})
    a = report.to_dict()["attention"][0]
    assert a["key_padding"] and "causal" in a["mask_source"]
    if window > 0:
        assert f"local_window_size {window}" in a["mask_source"] and a["density"] < 0.6
    rng = np.random.default_rng(H * 100 + window)
    for lengths in ([S, S], [S, 23]):
        feeds = gqa_feeds(rng, B, S, H, KV, D, lengths)
        want, got = run(model, feeds)[0], run(new, feeds)[0]
        for b, n in enumerate(lengths):  # rows past a sequence's length are padding (undefined in the op)
            np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)
        # and the original itself against the documented semantics, so both cannot be wrong together
        ref = gqa_reference(feeds, H, KV, D, window, lengths)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b, :n], ref[b, :n], rtol=1e-4, atol=1e-4)


def test_gqa_scale_attribute_and_kv_cache_left_alone():
    B, S, H, KV, D = 1, 24, 4, 2, 8
    model = gqa_model(B, S, H, KV, D, 5, scale=0.3)
    new, report = rewrite_model(model, **TILE)
    assert report.to_dict()["attention"][0]["scale"] == pytest.approx(0.3)
    feeds = gqa_feeds(np.random.default_rng(9), B, S, H, KV, D, [S])
    np.testing.assert_allclose(run(new, feeds)[0], run(model, feeds)[0], rtol=1e-4, atol=1e-4)
    # a KV cache: left alone with the reason
    cache = model
    node = cache.graph.node[0]
    node.input[3], node.input[4] = "pk", "pv"
    cache.graph.input.extend([_vi("pk", TensorProto.FLOAT, [B, KV, 0, D]), _vi("pv", TensorProto.FLOAT, [B, KV, 0, D])])
    new2, report2 = rewrite_model(cache, **TILE)
    assert op_counts(new2)["GroupQueryAttention"] == 1
    assert any("KV cache" in s["reason"] for s in report2.to_dict()["left_alone"])


# -- SparseAttention (CUDA-only in ONNX Runtime) ---------------------------------------------------------------------
def local_stride_blocks(num_layout, nb, local, stride):
    """Phi-3-small's block pattern: causal blocks, the last ``local`` block columns of each row plus every
    ``stride``-th column, the stride phase shifted per layout."""
    qb, kb = np.arange(nb)[:, None], np.arange(nb)[None]
    step = max(1, stride // num_layout)
    out = []
    for lay in range(num_layout):
        vert = (np.arange(nb) + lay * step + 1) % stride == 0
        out.append((qb >= kb) & ((qb - kb < local) | vert[None]))
    return np.stack(out)


def blocks_to_csr(blocks):
    L, nb, _ = blocks.shape
    rows = np.zeros((L, nb + 1), np.int32)
    rows[:, 1:] = np.cumsum(blocks.sum(-1), axis=-1)
    nnz = int(rows[:, -1].max())
    cols = np.full((L, nnz), -1, np.int32)
    for lay in range(L):
        c = np.nonzero(blocks[lay])[1]
        cols[lay, :c.size] = c
    return rows, cols


def sparse_attention_model(B, S, H, KV, D, blocks, block, max_seq):
    rows, cols = blocks_to_csr(blocks)
    inits = [numpy_helper.from_array(rows, "block_row_indices"), numpy_helper.from_array(cols, "block_col_indices")]
    node = helper.make_node("SparseAttention", ["q", "k", "v", "past_key", "past_value", "block_row_indices",
                                                "block_col_indices", "total", "key_lengths"],
                            ["y", "present_key", "present_value"], domain="com.microsoft", num_heads=H,
                            kv_num_heads=KV, sparse_block_size=block)
    ins = [_vi("q", TensorProto.FLOAT, [B, S, H * D]), _vi("k", TensorProto.FLOAT, [B, S, KV * D]),
           _vi("v", TensorProto.FLOAT, [B, S, KV * D]), _vi("past_key", TensorProto.FLOAT, [B, KV, max_seq, D]),
           _vi("past_value", TensorProto.FLOAT, [B, KV, max_seq, D]), _vi("total", TensorProto.INT32, [1]),
           _vi("key_lengths", TensorProto.INT32, [B])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, [B, S, H * D])], inits)


def sparse_attention_reference(feeds, blocks, block, H, KV):
    q, k, v = _heads(feeds["q"], H), _heads(feeds["k"], KV), _heads(feeds["v"], KV)
    k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
    S, D = q.shape[2], q.shape[3]
    idx = np.arange(S) // block
    dense = blocks[:, idx][:, :, idx] & np.tril(np.ones((S, S), bool))
    per_head = dense[np.arange(H) % blocks.shape[0]]  # head h uses layout h % L
    allowed = per_head[None] & (np.arange(S)[None, None, None] < feeds["key_lengths"][:, None, None, None])
    return _merge(_softmax_attention(q, k, v, allowed, 1 / np.sqrt(D)))


@pytest.mark.parametrize("L,H,KV", [(1, 4, 2), (2, 4, 1), (4, 4, 4)])
def test_sparse_attention_block_layout(L, H, KV):
    B, S, D, block, max_seq = 2, 56, 8, 8, 64
    blocks = local_stride_blocks(L, max_seq // block, 2, 3)
    model = sparse_attention_model(B, S, H, KV, D, blocks, block, max_seq)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "SparseAttention": 0})
    a = report.to_dict()["attention"][0]
    assert a["num_layouts"] == (1 if L == 1 else H) and a["key_padding"] and a["density"] < 0.5
    rng = np.random.default_rng(L * 10 + H)
    for lengths in ([S, S], [S, 37]):
        feeds = {"q": rng.standard_normal((B, S, H * D)).astype(np.float32),
                 "k": rng.standard_normal((B, S, KV * D)).astype(np.float32),
                 "v": rng.standard_normal((B, S, KV * D)).astype(np.float32),
                 "past_key": np.zeros((B, KV, max_seq, D), np.float32),
                 "past_value": np.zeros((B, KV, max_seq, D), np.float32),
                 "total": np.array([S], np.int32), "key_lengths": np.array(lengths, np.int32)}
        got = run(new, feeds)[0]
        want = sparse_attention_reference(feeds, blocks, block, H, KV)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)


def test_sparse_attention_used_presents_left_alone():
    blocks = local_stride_blocks(1, 4, 1, 2)
    model = sparse_attention_model(1, 16, 2, 2, 8, blocks, 4, 16)
    model.graph.output.append(_vi("present_key", TensorProto.FLOAT, None))
    new, report = rewrite_model(model, **TILE)
    assert op_counts(new)["SparseAttention"] == 1
    assert any("KV cache" in s["reason"] for s in report.to_dict()["left_alone"])


# -- MultiHeadAttention with attention_bias / key_padding_mask --------------------------------------------------------
@pytest.mark.parametrize("padding,bias_shape", [("2d", (1, 4, 24, 24)), ("lengths", (2, 1, 24, 24)),
                                                (None, (2, 4, 24, 24)), ("2d", None)])
def test_multihead_attention_bias_and_key_padding(padding, bias_shape):
    B, S, H, D = 2, 24, 4, 8
    names = ["q", "k", "v", ""]
    ins = [_vi(n, TensorProto.FLOAT, [B, S, H * D]) for n in "qkv"]
    if padding == "2d":
        ins.append(_vi("kpm", TensorProto.INT32, [B, S]))
    elif padding == "lengths":
        ins.append(_vi("kpm", TensorProto.INT32, [B]))
    names.append("kpm" if padding else "")
    if bias_shape:
        ins.append(_vi("bias", TensorProto.FLOAT, list(bias_shape)))
        names.append("bias")
    node = helper.make_node("MultiHeadAttention", names, ["y"], domain="com.microsoft", num_heads=H)
    model = _model([node], ins, [_vi("y", TensorProto.FLOAT, [B, S, H * D])])
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "MultiHeadAttention": 0})
    a = report.to_dict()["attention"][0]
    assert a["key_padding"] == bool(padding) and a["attn_bias"] == bool(bias_shape)
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal((B, S, H * D)).astype(np.float32) for n in "qkv"}
    lengths = np.array([S, 15], np.int32)
    if padding == "2d":
        feeds["kpm"] = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    elif padding == "lengths":
        feeds["kpm"] = lengths
    if bias_shape:
        feeds["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
    got, want = run(new, feeds)[0], run(model, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    q, k, v = (_heads(feeds[n], H) for n in "qkv")
    allowed = (np.arange(S)[None, None, None] < lengths[:, None, None, None]) if padding else np.ones((1,), bool)
    bias = feeds.get("bias", 0.0)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / np.sqrt(D) + bias
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = _merge(np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


# -- LongformerAttention (CUDA-only in ONNX Runtime) -----------------------------------------------------------------
def longformer_model(B, S, H, D, window, rng):
    N = H * D
    inits = [numpy_helper.from_array((rng.standard_normal((N, 3 * N)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(3 * N) * 0.1).astype(np.float32), "b"),
             numpy_helper.from_array((rng.standard_normal((N, 3 * N)) * 0.3).astype(np.float32), "wg"),
             numpy_helper.from_array((rng.standard_normal(3 * N) * 0.1).astype(np.float32), "bg")]
    node = helper.make_node("LongformerAttention", ["x", "w", "b", "mask", "wg", "bg", "global"], ["y"],
                            domain="com.microsoft", num_heads=H, window=window)
    ins = [_vi("x", TensorProto.FLOAT, ["batch", S, N]), _vi("mask", TensorProto.FLOAT, ["batch", S]),
           _vi("global", TensorProto.INT32, ["batch", S])]
    return _model([node], ins, [_vi("y", TensorProto.FLOAT, ["batch", S, N])], inits)


def longformer_reference(model, feeds, H, window):
    """float64: local rows see |i-j| <= W and the global keys (local projections); global rows see every key
    (global projections); keys with mask < 0 are dropped."""
    init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    x = feeds["x"].astype(np.float64)
    q, k, v = np.split(x @ init["w"] + init["b"], 3, axis=-1)
    qg, kg, vg = np.split(x @ init["wg"] + init["bg"], 3, axis=-1)
    S, D = x.shape[1], x.shape[2] // H
    keep = feeds["mask"] >= 0
    glob = feeds["global"] == 1
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    local_allowed = ((np.abs(i - j) <= window)[None] | glob[:, None, :]) & keep[:, None, :]
    loc = _softmax_attention(_heads(q, H), _heads(k, H), _heads(v, H), local_allowed[:, None], 1 / np.sqrt(D))
    gl = _softmax_attention(_heads(qg, H), _heads(kg, H), _heads(vg, H), keep[:, None, None, :], 1 / np.sqrt(D))
    return np.where(glob[:, :, None], _merge(gl), _merge(loc))


def test_longformer_window_and_runtime_global_tokens():
    B, S, H, D, W = 3, 48, 2, 8, 5
    rng = np.random.default_rng(11)
    model = longformer_model(B, S, H, D, W, rng)
    new, report = rewrite_model(model, **TILE)
    # every projection in one GEMM (the global Q at the slot rows only)
    assert_fused(new, {"StofSparseAttention": 2, "StofGemmEpilogue": 1, "LongformerAttention": 0})
    att = report.to_dict()["attention"]
    G = min(S, 64)
    assert sorted((a["seq_q"], a["seq_k"]) for a in att) == sorted([(S, G + S), (G, S)])
    N = H * D
    mask = np.zeros((B, S), np.float32)
    mask[1, 40:] = -10000.0  # padding at the end of sequence 1
    glob = np.zeros((B, S), np.int32)
    glob[0, 0] = 1                   # a CLS token
    glob[1, [0, 3, 4, 17, 39]] = 1   # question tokens, one inside another's band
    glob[2, 30] = 1
    feeds = {"x": rng.standard_normal((B, S, N)).astype(np.float32), "mask": mask, "global": glob}
    got = run(new, feeds)[0]
    want = longformer_reference(model, feeds, H, W)
    valid = mask >= 0
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)
    # no global token at all
    feeds["global"] = np.zeros((B, S), np.int32)
    np.testing.assert_allclose(run(new, feeds)[0][valid], longformer_reference(model, feeds, H, W)[valid],
                               rtol=1e-4, atol=1e-4)


def test_longformer_without_epilogue_fusions_projects_with_matmuls():
    """epilogues=False: the projections stay MatMul + Add (Q and K/V apart, the slots' K/V through a Concat) and
    the two nodes read whole tensors; the same outputs."""
    B, S, H, D, W = 2, 40, 2, 8, 3
    rng = np.random.default_rng(19)
    model = longformer_model(B, S, H, D, W, rng)
    new, _ = rewrite_model(model, epilogues=False, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "StofGemmEpilogue": 0, "MatMul": 4, "Concat": 1})
    assert not any(a.name.endswith("_view") for n in new.graph.node for a in n.attribute)
    glob = np.zeros((B, S), np.int32)
    glob[0, [0, 17]] = 1
    glob[1, 39] = 1
    mask = np.zeros((B, S), np.float32)
    mask[1, 30:35] = -10000.0
    feeds = {"x": rng.standard_normal((B, S, H * D)).astype(np.float32), "mask": mask, "global": glob}
    valid = mask >= 0
    np.testing.assert_allclose(run(new, feeds)[0][valid], longformer_reference(model, feeds, H, W)[valid],
                               rtol=1e-4, atol=1e-4)


@pytest.fixture
def four_slots(monkeypatch):
    """Four global-token slots, so a short sequence can overflow them."""
    monkeypatch.setattr(fuse_ort_longformer, "MAX_GLOBAL", 4)


def rewritten_longformer(B, S, H, D, W, seed):
    rng = np.random.default_rng(seed)
    model = longformer_model(B, S, H, D, W, rng)
    return model, rewrite_model(model, **TILE)[0], rng


def test_longformer_padded_global_tokens_and_spread_slots(four_slots):
    """Padded global tokens take no slot (so five fit in four slots when one is padded); fewer global tokens than
    slots at spread positions, one inside another's band, one at the last position."""
    B, S, H, D, W = 4, 40, 2, 8, 3
    model, new, rng = rewritten_longformer(B, S, H, D, W, 14)
    mask = np.zeros((B, S), np.float32)
    mask[0, 30:] = -10000.0
    mask[1, [5, 21]] = -10000.0       # holes: two of sequence 1's global tokens are padding
    glob = np.zeros((B, S), np.int32)
    glob[0, [2, 31, 35]] = 1          # two global tokens in the padded tail: one slot used
    glob[1, [3, 5, 12, 21, 39]] = 1   # five global tokens, two padded: three slots
    glob[2, [7, 9, 26]] = 1           # spread, 9 inside 7's band
    glob[3, [0, 1, 2, 39]] = 1        # every slot, the last position included
    feeds = {"x": rng.standard_normal((B, S, H * D)).astype(np.float32), "mask": mask, "global": glob}
    got = run(new, feeds)[0]
    want = longformer_reference(model, feeds, H, W)
    valid = mask >= 0
    assert np.isfinite(got[valid]).all()
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_longformer_graph_is_stof_nodes_and_reshapes():
    """The rewritten layer copies nothing of [B, S, ·] size: one StofGlobalSlots node (slots, key padding, row
    index), one GEMM for every projection (the slot rows as its prefix, with their own weights), the global node and
    the local node reading their windows of it, the local node writing Y with the global rows over it; one Reshape
    (a view) of the global rows. No intermediate tensor is larger than the projections [B, G+S, 5N], and the int32
    ones are [B, G+S] at most."""
    import onnx

    B, S, H, D, W = 2, 256, 2, 16, 4
    model = longformer_model(B, S, H, D, W, np.random.default_rng(15))
    for t in (*model.graph.input, *model.graph.output):
        t.type.tensor_type.shape.dim[0].dim_value = B
    new, _ = rewrite_model(model, **TILE)
    counts = op_counts(new)
    assert dict(counts) == {"StofGlobalSlots": 1, "StofGemmEpilogue": 1, "StofSparseAttention": 2,
                            "Reshape": 1}, dict(counts)
    local = [n for n in new.graph.node if n.op_type == "StofSparseAttention" and n.output[0] == "y"]
    assert len(local) == 1 and list(local[0].input[10:]) and local[0].input[10] and local[0].input[11]
    # every intermediate tensor as an output, its run-time size read at B=2
    types = {vi.name: vi.type.tensor_type.elem_type for vi in onnx.shape_inference.infer_shapes(new).graph.value_info}
    names = [o for n in new.graph.node for o in n.output if o in types and o != "y"]
    probe = onnx.ModelProto()
    probe.CopyFrom(new)
    probe.graph.output.extend(helper.make_tensor_value_info(o, types[o], None) for o in names)
    rng = np.random.default_rng(16)
    glob = np.zeros((B, S), np.int32)
    glob[:, [1, 30]] = 1
    feeds = {"x": rng.standard_normal((B, S, H * D)).astype(np.float32), "mask": np.zeros((B, S), np.float32),
             "global": glob}
    values = dict(zip(["y"] + names, run(probe, feeds)))
    ints = {o: v.size for o, v in values.items() if v.dtype == np.int32}
    N, G = H * D, min(S, fuse_ort_longformer.MAX_GLOBAL)
    assert len(ints) == 3 and max(ints.values()) == B * (G + S), ints
    assert max(v.size for v in values.values()) == B * (G + S) * 5 * N


@pytest.mark.parametrize("S,G,W,tm,tn", [(48, 48, 5, 16, 32), (40, 4, 3, 16, 32), (100, 7, 9, 16, 32),
                                         (130, 13, 1, 32, 32), (70, 5, 100, 128, 64), (1000, 30, 17, 16, 64)])
def test_longformer_slot_layouts_equal_their_dense_definition(S, G, W, tm, tn):
    """The slot layouts, compiled from tile-exact specs, equal the dense definitions: local [S, G+S] (slots not a
    multiple of the tile, windows past the sequence, windows narrower than the slots), global [G, S]."""
    from stof_trt.format import TileLayout
    from stof_trt.rewrite.fuse_ort_longformer import global_layout, local_layout

    n, i, j = G + S, np.arange(S)[:, None], np.arange(S)[None]
    local = np.zeros((S, n), bool)
    local[:, :G] = True
    local[:, G:] = np.abs(i - j) <= W
    glob = np.ones((G, S), bool)
    for got, dense in ((local_layout(S, G, W, tm, tn), local), (global_layout(S, G, tm, tn), glob)):
        want = TileLayout.from_dense(dense, tm, tn)
        assert (got.seq_q, got.seq_k) == dense.shape
        for name, arr in want.arrays().items():
            np.testing.assert_array_equal(got.arrays()[name], arr, err_msg=name)


def test_longformer_more_global_tokens_than_slots_gives_nan(four_slots):
    B, S, H, D, W = 2, 32, 2, 8, 3
    model, new, rng = rewritten_longformer(B, S, H, D, W, 12)
    glob = np.zeros((B, S), np.int32)
    glob[0, [1, 2, 9, 20]] = 1        # 4: fits
    glob[1, [1, 2, 9, 20, 25]] = 1    # 5: does not
    feeds = {"x": rng.standard_normal((B, S, H * D)).astype(np.float32), "mask": np.zeros((B, S), np.float32),
             "global": glob}
    got = run(new, feeds)[0]
    np.testing.assert_allclose(got[0], longformer_reference(model, feeds, H, W)[0], rtol=1e-4, atol=1e-4)
    assert np.isnan(got[1]).all()
    # A kernel may find no finite score in a row of NaN queries (the global node's slot rows) and write it as an
    # empty row (0): with those rows zeroed so, every row of the overflowing sequence is still NaN.
    zeroed = type(new)()
    zeroed.CopyFrom(new)
    nodes = []
    for n in zeroed.graph.node:
        nodes.append(n)
        spec = next((a.s for a in n.attribute if a.name == "mask_spec"), b"")
        if n.op_type == "StofSparseAttention" and spec.startswith(b"longformer_global"):
            out = n.output[0]
            n.output[0] = out + "_raw"
            nodes += [helper.make_node("IsNaN", [out + "_raw"], [out + "_isnan"]),
                      helper.make_node("Where", [out + "_isnan", "zero_f32", out + "_raw"], [out])]
    del zeroed.graph.node[:]
    zeroed.graph.node.extend(nodes)
    zeroed.graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "zero_f32"))
    got = run(zeroed, feeds)[0]
    np.testing.assert_allclose(got[0], longformer_reference(model, feeds, H, W)[0], rtol=1e-4, atol=1e-4)
    assert np.isnan(got[1]).all()


# -- ONNX Attention (opset 23 / 24): grouped heads, nonpad_kv_seqlen ---------------------------------------------------
def onnx_attention_model(opset, *, three_d, H, KV, causal, nonpad):
    D = 8
    if three_d:
        shapes = (["batch", "seq", H * D], ["batch", "seq", KV * D])
    else:
        shapes = (["batch", H, "seq", D], ["batch", KV, "seq", D])
    ins = [_vi("q", TensorProto.FLOAT, shapes[0]), _vi("k", TensorProto.FLOAT, shapes[1]),
           _vi("v", TensorProto.FLOAT, shapes[1])]
    names = ["q", "k", "v"]
    if nonpad:
        ins.append(_vi("nonpad", TensorProto.INT64, ["batch"]))
        names += ["", "", "", "nonpad"]
    attrs = {"is_causal": int(causal)}
    if three_d:
        attrs.update(q_num_heads=H, kv_num_heads=KV)
    node = helper.make_node("Attention", names, ["y"], **attrs)
    model = helper.make_model(helper.make_graph([node], "g", ins, [_vi("y", TensorProto.FLOAT, shapes[0])]),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("opset,three_d,H,KV,causal,nonpad", [
    (23, True, 4, 2, True, False), (23, False, 4, 1, False, False), (24, True, 4, 2, False, True),
    (24, False, 4, 4, False, True), (24, False, 6, 2, True, False)])
def test_onnx_attention_grouped_heads_and_nonpad_kv_seqlen(opset, three_d, H, KV, causal, nonpad):
    B, S, D = 2, 40, 8
    model = onnx_attention_model(opset, three_d=three_d, H=H, KV=KV, causal=causal, nonpad=nonpad)
    new, report = rewrite_model(model, max_seq_len=S, **TILE)
    assert_fused(new, {"StofSparseAttention": 1, "Attention": 0})
    a = report.to_dict()["attention"][0]
    assert a["key_padding"] == nonpad and a["kv_heads"] == KV
    rng = np.random.default_rng(opset + H + KV)
    qs = (B, S, H * D) if three_d else (B, H, S, D)
    ks = (B, S, KV * D) if three_d else (B, KV, S, D)
    feeds = {"q": rng.standard_normal(qs).astype(np.float32), "k": rng.standard_normal(ks).astype(np.float32),
             "v": rng.standard_normal(ks).astype(np.float32)}
    lengths = np.array([S, 26])
    if nonpad:
        feeds["nonpad"] = lengths
    got = run(new, feeds)[0]
    q, k, v = ((_heads(feeds[n], h) for n, h in zip("qkv", (H, KV, KV))) if three_d else (feeds[n] for n in "qkv"))
    k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    allowed = np.broadcast_to((j <= i) if causal else np.ones((S, S), bool), (B, 1, S, S))
    if nonpad:
        allowed = allowed & (j < lengths[:, None, None, None])
    ref = _softmax_attention(q, k, v, allowed, 1 / np.sqrt(D))
    ref = _merge(ref) if three_d else ref
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    try:
        want = run(model, feeds)[0]
    except Exception as exc:  # noqa: BLE001 - an ONNX Runtime without this Attention version / feature
        pytest.skip(f"ONNX Runtime cannot run the original: {str(exc)[:100]}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_onnx_attention_causal_with_nonpad_kv_seqlen_left_alone():
    model = onnx_attention_model(24, three_d=False, H=4, KV=4, causal=True, nonpad=True)
    new, report = rewrite_model(model, max_seq_len=40, **TILE)
    assert op_counts(new)["Attention"] == 1
    assert any("causal alignment" in s["reason"] for s in report.to_dict()["left_alone"])


# -- the benchmark script's CPU mode ---------------------------------------------------------------------------------
def test_bench_ort_ops_dry_run(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(root / "scripts" / "bench_ort_ops.py")]
    r = subprocess.run(cmd + ["--dry-run", "--sizes", "small", "--out", str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "ort_ops_dry_run.json").read_text())
    assert [row["case"] for row in rows] == ["longformer_b8", "longformer_b1", "gqa_sliding", "sparse_phi3"]
    assert all(row["vs_reference"] < 1e-4 for row in rows)
    assert rows[2]["vs_original_cpu"] < 1e-4
    assert [len(row["layouts"]) for row in rows] == [2, 2, 1, 1]
    import onnxruntime

    bad_args = [["--cases", "nope"], ["--tile", "x"], []]
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        bad_args.append(["--out", str(tmp_path / "device"), "--cases", "gqa_sliding", "--sizes", "small"])
    for bad in bad_args:
        r = subprocess.run(cmd + bad, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr


def test_bench_ort_ops_graph_variants_in_the_table():
    """A graph ORT could not capture is reported as such and left out of the fastest-of-each ratio."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_ort_ops.py"
    spec = importlib.util.spec_from_file_location("bench_ort_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stat = lambda ms: {"median_ms": ms, "p90_ms": ms * 1.1}  # noqa: E731
    row = {"case": "longformer_b8", "B": 8, "S": 4096, "layouts": [{"density": 0.1}], "ort": stat(3.4),
           "stof": stat(1.4), "stof-graph": stat(0.9), "ort-graph": {"error": "CUDA failure 907"},
           "max_rel_diff": 1e-3, "speedup": 3.4 / 1.4}
    row["speedup_best"] = mod.speedup_best(row)
    assert abs(row["speedup_best"] - 3.4 / 0.9) < 1e-12
    md = mod.markdown([row])
    assert "| 0.900 / 0.990 |" in md and "3.78x" in md and "2.43x" in md
    row["ort-graph"] = stat(3.0)
    assert abs(mod.speedup_best(row) - 3.0 / 0.9) < 1e-12


def test_longformer_dynamic_sequence_axis():
    B, S, H, D, W = 2, 48, 2, 8, 4
    rng = np.random.default_rng(13)
    model = longformer_model(B, S, H, D, W, rng)
    for t in (*model.graph.input, *model.graph.output):
        t.type.tensor_type.shape.dim[1].dim_param = "seq"
    new, report = rewrite_model(model, max_seq_len=S, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "LongformerAttention": 0})
    notes = report.to_dict()["notes"]
    assert any("8 global token slots" in n for n in notes) and not any("not used" in n for n in notes), notes
    for seq in (S, 24, 8):  # multiples of 2W
        glob = np.zeros((B, seq), np.int32)
        glob[0, [0, seq - 1]] = 1
        glob[1, :3] = 1
        feeds = {"x": rng.standard_normal((B, seq, H * D)).astype(np.float32), "mask": np.zeros((B, seq), np.float32),
                 "global": glob}
        np.testing.assert_allclose(run(new, feeds)[0], longformer_reference(model, feeds, H, W), rtol=1e-4, atol=1e-4)
    # longer than compiled (G + S' rows past the layouts' G + S): an error, never a silently cut mask
    seq = S + 2 * W
    feeds = {"x": rng.standard_normal((B, seq, H * D)).astype(np.float32), "mask": np.zeros((B, seq), np.float32),
             "global": np.zeros((B, seq), np.int32)}
    with pytest.raises(Exception):
        run(new, feeds)


def test_longformer_nodes_read_as_problems_with_their_heads():
    """Both nodes read windows of the one projection (query_view / key_view, num_heads) as H heads of D: the node
    reader, the shape-inferred dims and the problems `stof tune` times (probed on the CPU) all give (H, D), with
    G + S keys for the local node and G queries for the global one."""
    from stof_trt.nodes import attention_nodes, attention_problem_dims
    from stof_trt.tune import probe_problems

    B, S, H, D, W = 2, 256, 2, 16, 4
    new, _ = rewrite_model(longformer_model(B, S, H, D, W, np.random.default_rng(17)), **TILE)
    nodes = {n.name: n for n in attention_nodes(new)}
    G = min(S, fuse_ort_longformer.MAX_GLOBAL)
    local = next(n for n in nodes.values() if n.layout.seq_q == S)
    assert all(n.kv and n.num_heads == H and n.query_view and n.key_view for n in nodes.values())
    assert local.query_view == (G, -1, 0, H * D) and local.key_view == (0, -1, H * D, 2 * H * D)
    dims = attention_problem_dims(new)
    assert all(d[1:] == (H, D) for d in dims.values()) and len(dims) == 2, dims
    glob = np.zeros((B, S), np.int32)
    glob[:, 3] = 1
    feeds = {"x": np.zeros((B, S, H * D), np.float32), "mask": np.zeros((B, S), np.float32), "global": glob}
    probs = {p.node.name: p for p in probe_problems(new, feeds, cpu=True)}
    lp = probs[local.name]
    assert (lp.batch, lp.heads, lp.seq_q, lp.seq_k, lp.head_dim, lp.kv_heads) == (B, H, S, G + S, D, H)
    gp = next(p for n, p in probs.items() if n != local.name)
    assert (gp.batch, gp.heads, gp.seq_q, gp.seq_k, gp.head_dim) == (B, H, G, S, D)


def test_gqa_problem_keeps_its_kv_heads():
    """`stof tune` times a grouped-query node with its K/V head count, as the plugin runs it (probed on the CPU)."""
    from stof_trt.tune import probe_problems

    B, S, H, KV, D = 2, 64, 8, 2, 16
    new, _ = rewrite_model(gqa_model(B, S, H, KV, D, 5), **TILE)
    feeds = gqa_feeds(np.random.default_rng(18), B, S, H, KV, D, [S, S - 9])
    (p,) = probe_problems(new, feeds, cpu=True)
    assert (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim) == (B, H, KV, S, S, D)
