"""FusePackedQkv: attention fed from one packed Q/K/V projection (qkv_format "bs3hd"), compared with the original
model (and the unpacked rewrite) on ONNX Runtime CPU on fresh random inputs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from stof_trt.rewrite import rewrite_model
from models_util import (TILE, assert_fused, assert_parity, exported, op_counts, padding_mask, run,
                         token_feeds)


def _attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == "StofSparseAttention"]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _packed(model):
    return [n for n in _attention_nodes(model) if _attrs(n).get("qkv_format") == b"bs3hd"]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_packed_matches_original(kind):
    model = exported(kind)
    new, report = rewrite_model(model, max_seq_len=32, remove_padding=False, **TILE)  # the bs3hd form itself
    assert report.count("packed_qkv") == 2
    assert len(_packed(new)) == 2
    for n in _packed(new):
        assert n.input[1] == "" and n.input[2] == "" and n.overload.startswith("packed")
    # no transposes are left around the attention: q/k/v/output ones are all gone
    assert op_counts(new).get("Transpose", 0) == 0
    if kind == "bert":  # three MatMul + bias -> one GEMM with the bias in its epilogue
        gemms = [n for n in new.graph.node if n.op_type == "StofGemmEpilogue" and n.input[1].startswith("stof_qkv")]
        assert len(gemms) == 2 and all(n.overload == "none" for n in gemms)
    else:  # GPT-2's c_attn already is one projection: only the Split goes
        assert op_counts(new).get("Split", 0) == 0
    rng = np.random.default_rng(31)
    for seq in (32, 19):
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))


def test_packed_equals_unpacked_rewrite():
    model = exported("bert")
    packed, _ = rewrite_model(model, max_seq_len=32, **TILE)
    plain, rep = rewrite_model(model, max_seq_len=32, packed_qkv=False, **TILE)
    assert rep.count("packed_qkv") == 0 and not _packed(plain)
    assert all("qkv_format" not in _attrs(n) for n in _attention_nodes(plain))
    rng = np.random.default_rng(32)
    feeds = token_feeds(rng, 2, 27, mask=padding_mask(rng, 2, 27))
    keep = feeds["attention_mask"] != 0  # the packed rewrite also removes the padding: real tokens
    a, b = run(packed, feeds)[0][keep], run(plain, feeds)[0][keep]
    assert np.abs(a).max() > 0.1
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(a).max()))


def test_packed_with_static_mask_against_3d_original():
    """BERT with a user Longformer mask: the 2-D export rewritten (packed) vs the 3-D-mask export fed the dense
    mask AND the padding."""
    from stof_trt.format import compile_mask
    from stof_trt.masks import parse_mask

    spec = "longformer:window=8,global=2"
    m2, m3 = exported("bert", mask_dims=2), exported("bert", mask_dims=3)
    new, report = rewrite_model(m2, mask=spec, max_seq_len=32, **TILE)
    assert report.count("packed_qkv") == 2
    rng = np.random.default_rng(33)
    S = 32
    pad = padding_mask(rng, 2, S, min_len=4)
    feeds = token_feeds(rng, 2, S, mask=pad)
    dense = compile_mask(parse_mask(spec), S, S).to_dense()[0]
    feeds3 = dict(feeds)
    feeds3["attention_mask"] = (dense[None] & (pad[:, None, :] != 0)).astype(np.int64)
    ref, got = run(m3, feeds3)[0], run(new, feeds)[0]
    assert np.abs(ref).max() > 0.1
    assert np.abs(ref - got).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_no_epilogues_keeps_matmuls():
    """epilogues=False emits no StofGemmEpilogue, so the three MatMul + bias projections are not packed."""
    new, report = rewrite_model(exported("bert"), max_seq_len=32, epilogues=False, **TILE)
    assert "StofGemmEpilogue" not in op_counts(new) and report.count("packed_qkv") == 0


def test_shared_projection_left_alone():
    """A K projection that is also a graph output cannot be removed: that attention stays unpacked."""
    model = exported("bert")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    key_mm = next(n for n in m.graph.node if n.op_type == "MatMul" and "key" in n.name)
    m.graph.output.append(onnx.helper.make_tensor_value_info(key_mm.output[0], onnx.TensorProto.FLOAT,
                                                          ["b", "s", 32]))
    new, report = rewrite_model(m, max_seq_len=32, **TILE)
    assert report.count("packed_qkv") == 1
    assert_fused(new, {"StofSparseAttention": 2})
    rng = np.random.default_rng(34)
    assert_parity(m, new, token_feeds(rng, 2, 32, mask=padding_mask(rng, 2, 32)))


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_dense_attention_to_ort(kind):
    """dense_attention="ort": padding-only / maskless attention becomes com.microsoft Attention (same function)."""
    model = exported(kind)
    new, report = rewrite_model(model, max_seq_len=32 if kind == "bert" else None, dense_attention="ort", **TILE)
    assert report.count("dense_attention_to_ort") == 2
    counts = op_counts(new)
    assert counts["Attention"] == 2 and "StofSparseAttention" not in counts
    assert any(i.domain == "com.microsoft" for i in new.opset_import)
    rng = np.random.default_rng(35)
    if kind == "bert":
        for seq in (32, 23):
            assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))
    else:
        inp = model.graph.input[0]
        shape = [2 if not d.dim_value else d.dim_value for d in inp.type.tensor_type.shape.dim]
        assert_parity(model, new, {inp.name: rng.standard_normal(shape).astype(np.float32)})


def test_dense_attention_keeps_sparse_masks():
    """A static (Longformer) mask is sparse: it stays on the STOF kernels with dense_attention="ort"."""
    new, report = rewrite_model(exported("bert"), mask="longformer:window=8,global=2", max_seq_len=32,
                                dense_attention="ort", **TILE)
    assert report.count("dense_attention_to_ort") == 0 and op_counts(new)["StofSparseAttention"] == 2


@pytest.mark.parametrize("flag", ["packed_qkv", "epilogues"])
def test_dense_attention_needs_packing_noted(flag):
    """dense_attention="ort" converts only packed attention: with packed_qkv=False or epilogues=False the dense
    attention stays on STOF (still matching the original) and the report says so in a note."""
    model = exported("bert")
    new, report = rewrite_model(model, max_seq_len=32, dense_attention="ort", **{flag: False}, **TILE)
    assert report.count("dense_attention_to_ort") == 0 and op_counts(new)["StofSparseAttention"] == 2
    notes = [n for n in report.notes if "dense_attention='ort'" in n]
    assert len(notes) == 1 and f"{flag}=False" in notes[0] and "2 attention node(s)" in notes[0], report.notes
    rng = np.random.default_rng(37)
    assert_parity(model, new, token_feeds(rng, 3, 29, mask=padding_mask(rng, 3, 29)))
    # converted (the default flags) or sparse attention: no note
    _, converted = rewrite_model(model, max_seq_len=32, dense_attention="ort", **TILE)
    _, sparse = rewrite_model(model, mask="longformer:window=8,global=2", max_seq_len=32, dense_attention="ort",
                              **{flag: False}, **TILE)
    assert not [n for n in converted.notes + sparse.notes if "dense_attention" in n]


def test_dense_attention_keeps_nearly_full_mask(tmp_path):
    """An npy mask that forbids one (query, key) pair of 1536² has a rounded density of 1.0 in the report: it is
    still sparse (one PARTIAL tile) and stays on the STOF kernels, the pair masked as in the 3-D-mask original."""
    S = 1536
    dense = np.ones((S, S), bool)
    dense[0, S - 1] = False
    np.save(tmp_path / "near_full.npy", dense)
    m2, m3 = exported("bert", max_positions=S), exported("bert", max_positions=S, mask_dims=3)
    new, report = rewrite_model(m2, mask=f"npy:{tmp_path / 'near_full.npy'}", max_seq_len=S, dense_attention="ort",
                                **TILE)
    assert report.attention[0]["density"] == 1.0  # rounded: not what the dense decision may read
    assert report.count("dense_attention_to_ort") == 0 and op_counts(new)["StofSparseAttention"] == 2
    rng = np.random.default_rng(36)
    feeds = token_feeds(rng, 1, S)
    feeds3 = dict(feeds, attention_mask=dense[None].astype(np.int64))
    ref, got, unmasked = run(m3, feeds3)[0], run(new, feeds)[0], run(m2, feeds)[0]
    tol = 1e-6 * max(1.0, float(np.abs(ref).max()))
    assert np.abs(ref - unmasked)[:, 0].max() > 5 * tol  # the one pair is visible in query row 0
    assert np.abs(ref - got).max() <= tol


def _qkv_model(kind: str, dynamic: bool = False):
    """x [B,S,32] -> Q/K/V projections -> Reshape [B,S,4,8] -> Transpose(0,2,1,3) -> attention with a padding mask
    -> Transpose -> Reshape [B,S,32]. kind: "plain" (three MatMul + bias of x), "flat" (the three on x viewed
    [B·S, 32]), "neox" (one [B,S,96] projection viewed [B,S,4,24], Split on the last axis: per head [q|k|v]),
    "tied" (K is Q)."""
    from onnx import TensorProto, helper, numpy_helper

    H, D, hid, Bs, Ss = 4, 8, 32, 2, 32
    rng = np.random.default_rng(40)
    nodes, inits = [], []

    def const(arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), f"c{len(inits)}"))
        return inits[-1].name

    def node(op, ins, **kw):
        nodes.append(helper.make_node(op, ins, [f"t{len(nodes)}"], **kw))
        return nodes[-1].output[0]

    def target(*tail):  # [B, S, *tail]
        if not dynamic:
            return const(np.array([Bs, Ss, *tail], np.int64))
        bs = node("Slice", [node("Shape", ["x"]), const(np.array([0], np.int64)), const(np.array([2], np.int64))])
        return node("Concat", [bs, const(np.array(tail, np.int64))], axis=0)

    def linear(src, n):
        w = const((rng.standard_normal((hid, n)) * 0.3).astype(np.float32))
        return node("Add", [node("MatMul", [src, w]), const((rng.standard_normal(n) * 0.1).astype(np.float32))])

    def heads(t):
        return node("Transpose", [node("Reshape", [t, target(H, D)])], perm=[0, 2, 1, 3])

    if kind == "neox":
        parts = [f"split{i}" for i in range(3)]
        nodes.append(helper.make_node("Split", [node("Reshape", [linear("x", 3 * hid), target(H, 3 * D)])], parts,
                                      axis=-1, num_outputs=3))
        q, k, v = (heads(p) for p in parts)
    else:
        src = node("Reshape", ["x", const(np.array([-1, hid], np.int64))]) if kind == "flat" else "x"
        q, k, v = (heads(linear(src, hid)) for _ in range(3))
        if kind == "tied":
            k = q
    scores = node("Mul", [node("MatMul", [q, node("Transpose", [k], perm=[0, 1, 3, 2])]),
                          const(np.float32(1 / np.sqrt(D)))])
    pad = node("Cast", [node("Unsqueeze", ["mask", const(np.array([1, 2], np.int64))])], to=TensorProto.FLOAT)
    bias = node("Mul", [node("Sub", [const(np.float32(1)), pad]), const(np.float32(-10000))])
    ctx = node("MatMul", [node("Softmax", [node("Add", [scores, bias])], axis=-1), v])
    nodes[-1].output[0] = "pre_y"
    nodes.append(helper.make_node("Reshape", [node("Transpose", ["pre_y"], perm=[0, 2, 1, 3]), target(hid)], ["y"]))
    b, s = ("b", "s") if dynamic else (Bs, Ss)
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, hid]),
                                            helper.make_tensor_value_info("mask", TensorProto.INT64, [b, s])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, hid])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _qkv_feeds(seed, batch=2, seq=32):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, seq, 32)).astype(np.float32), "mask": padding_mask(rng, batch, seq)}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kind,packs", [("plain", 1), ("flat", 0), ("neox", 0), ("tied", 0)])
def test_projection_sources(kind, packs, dynamic):
    """Only [B,S,hidden] projections of three distinct tensors are packed: flattened [B·S, hidden] projections (the
    packed Reshape [0,0,3,H,D] would not fit), a per-head [B,S,H,3·D] Split (GPT-NeoX: read as [q|k|v] thirds it
    would be wrong) and a tied K = Q (its nodes taken twice) stay unpacked; every rewrite matches the original."""
    model = _qkv_model(kind, dynamic)
    new, report = rewrite_model(model, max_seq_len=32 if dynamic else None, **TILE)
    assert op_counts(new)["StofSparseAttention"] == 1
    assert report.count("packed_qkv") == packs and len(_packed(new)) == packs
    for seed, seq in ((41, 32), (42, 21)) if dynamic else ((41, 32),):
        assert_parity(model, new, _qkv_feeds(seed, 3, seq) if dynamic else _qkv_feeds(seed))
