"""Attention-core fusion on models exported from transformers / torch: parity with the original on ORT CPU."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from stof_trt.rewrite import rewrite_model
from models_util import TILE, assert_fused, assert_parity, exported, padding_mask, token_feeds
from stof_trt.errors import StofError
from stof_trt.masks import parse_mask

S_MAX = 48


def _attention(report):
    return report.to_dict()["attention"]


def test_bert_padding_mask_becomes_key_padding():
    model = exported("bert")
    before = model.SerializeToString()
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert model.SerializeToString() == before, "the input model was mutated"
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    assert report.count("attention_core") == 2
    for a in _attention(report):
        assert "padding from input 'attention_mask'" in a["mask_source"]
        assert a["key_padding"] and not a["attn_bias"]
        assert a["heads"] == 4 and a["head_dim"] == 8 and a["density"] == 1.0
        assert a["tile_classes"]["partial"] == 0 and a["tile_classes"]["empty"] == 0
    rng = np.random.default_rng(0)
    for seq in (S_MAX, 29, 1):
        feeds = token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq))
        assert_parity(model, new, feeds)


def test_gpt2_causal_mask_is_recognised():
    model = exported("gpt2")
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    for a in _attention(report):
        assert a["mask_source"].startswith("graph causal")
        assert a["key_padding"] and not a["attn_bias"]
        assert a["tile_classes"]["empty"] > 0 and a["tile_classes"]["partial"] > 0
        assert abs(a["density"] - (S_MAX + 1) / (2 * S_MAX)) < 1e-6
    rng = np.random.default_rng(1)
    for seq in (S_MAX, 37):
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))


def test_gpt2_without_padding_input_is_static_causal():
    model = exported("gpt2", padding_mask=False)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2})
    for a in _attention(report):
        assert a["mask_source"] == "graph causal" and not a["key_padding"]
    rng = np.random.default_rng(2)
    assert_parity(model, new, {"input_ids": rng.integers(0, 100, (2, 40))})


def test_vit_no_mask_full_layout():
    model = exported("vit")
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    for a in _attention(report):
        assert a["mask_source"] == "none (full layout)" and a["seq_q"] == 17
        assert a["tile_classes"] == {"empty": 0, "full": 2, "partial": 0}
    rng = np.random.default_rng(3)
    assert_parity(model, new, {"pixel_values": rng.standard_normal((3, 3, 32, 32)).astype(np.float32)})


@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_band_recognised(causal):
    window = 3
    model = exported("local_attention", window=window, causal=causal)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0, "Where": 0})
    name = f"sliding:window={window},causal=1 (0 <= q-k <= {window})" if causal else \
        f"sliding:window={window} (|q-k| <= {window})"
    for a in _attention(report):
        assert a["mask_source"].startswith(f"graph {name}"), a["mask_source"]
        assert a["key_padding"] and not a["attn_bias"]
    rng = np.random.default_rng(4)
    for seq in (S_MAX, 31):
        # keys at multiples of 3 are always kept, so every query keeps one key in its window (the original,
        # which masks with -inf, would produce NaN for a query with none)
        pad = (rng.random((3, seq)) < 0.6).astype(np.int64)
        pad[:, ::3] = 1
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=pad))


def test_user_mask_on_2d_export_matches_3d_original():
    """Demo path: original (3-D mask input) fed dense(spec) ∧ padding == rewritten 2-D export with the spec."""
    spec = "longformer:window=8,global=2"
    m2, m3 = exported("bert"), exported("bert", mask_dims=3)
    w2 = {i.name: onnx.numpy_helper.to_array(i) for i in m2.graph.initializer}
    w3 = {i.name: onnx.numpy_helper.to_array(i) for i in m3.graph.initializer}
    assert any(v.size > 1000 for v in w2.values())
    assert all(np.array_equal(w2[k], w3[k]) for k in w2.keys() & w3.keys() if w2[k].size > 1000)
    new, report = rewrite_model(m2, mask=spec, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2})
    for a in _attention(report):
        assert a["mask_source"].startswith("user 'sliding") and "padding" in a["mask_source"]
        assert a["density"] < 0.6
    rng = np.random.default_rng(5)
    for seq in (S_MAX, 33):
        pad = padding_mask(rng, 3, seq, min_len=3)
        dense = parse_mask(spec).dense(seq, seq)
        feeds2 = token_feeds(rng, 3, seq, mask=pad)
        feeds3 = dict(feeds2, attention_mask=(dense[None] & (pad[:, None, :] != 0)).astype(np.int64))
        from models_util import max_rel_diff, run
        d = max_rel_diff(run(m3, feeds3)[0], run(new, feeds2)[0])
        assert d <= 1e-4, d


def test_user_mask_on_3d_export_keeps_bias():
    spec = parse_mask("dilated:window=6,dilation=2")
    model = exported("bert", mask_dims=3)
    new, report = rewrite_model(model, mask=spec, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2})
    for a in _attention(report):
        assert a["attn_bias"] and not a["key_padding"]
    rng = np.random.default_rng(6)
    seq = 40
    dense = spec.dense(seq, seq)
    m = (rng.random((2, seq, seq)) < 0.5) | np.eye(seq, dtype=bool)[None]
    feeds = token_feeds(rng, 2, seq)
    out_new = __import__("models_util").run(new, dict(feeds, attention_mask=m.astype(np.int64)))[0]
    out_ref = __import__("models_util").run(model, dict(feeds, attention_mask=(m & dense[None]).astype(np.int64)))[0]
    assert np.abs(out_new - out_ref).max() <= 1e-4 * max(1, np.abs(out_ref).max())


def test_fixed_axes_need_no_max_seq_len():
    model = exported("bert", dynamic_axes=False, seq_len=40)
    new, report = rewrite_model(model, **TILE)
    assert_fused(new, {"StofSparseAttention": 2})
    assert all(a["seq_q"] == 40 for a in _attention(report))
    rng = np.random.default_rng(7)
    assert_parity(model, new, token_feeds(rng, 2, 40, mask=padding_mask(rng, 2, 40)))


def test_dynamic_axes_compile_at_the_models_own_limit():
    """No max_seq_len: the layouts are compiled for the position table's 40 rows; a longer max_seq_len is a
    one-line error that names the limit."""
    model = exported("bert", max_positions=40)
    new, report = rewrite_model(model, **TILE)
    assert all(a["seq_q"] == 40 for a in _attention(report))
    assert any("model's own limit" in n for n in report.notes)
    rng = np.random.default_rng(8)
    for seq in (1, 23, 40):
        assert_parity(model, new, token_feeds(rng, 2, seq, mask=padding_mask(rng, 2, seq)))
    assert {p.key: p.value for p in new.metadata_props}["stof.max_seq_len"] == "40"
    with pytest.raises(StofError, match="at most 40 positions"):
        rewrite_model(model, max_seq_len=41, **TILE)
    with pytest.raises(StofError, match="too long to analyse the model's graph masks"):
        rewrite_model(exported("gpt2"), max_seq_len=60000, **TILE)


def test_mask_too_small_for_model_is_a_user_error(tmp_path):
    arr = np.ones((8, 8), bool)
    np.save(tmp_path / "m.npy", arr)
    with pytest.raises(StofError):
        rewrite_model(exported("bert"), mask=f"npy:{tmp_path / 'm.npy'}", max_seq_len=S_MAX, **TILE)


@pytest.mark.parametrize("spec", ["global:n=0", "causal:offset=-2147483647", "npy:ZEROS"])
def test_a_mask_that_allows_no_key_is_a_user_error(tmp_path, spec):
    """A spec under which no query attends anything would make every attention output zero: refused."""
    np.save(tmp_path / "z.npy", np.zeros((64, 64), bool))
    spec = spec.replace("ZEROS", str(tmp_path / "z.npy"))
    with pytest.raises(StofError, match="allows no key for any query"):
        rewrite_model(exported("bert"), mask=spec, max_seq_len=64, **TILE)


def test_default_tiles_and_report_is_json():
    import json

    new, report = rewrite_model(exported("gpt2"), max_seq_len=200)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["patterns"]["attention_core"]["matched"] == 2
    a = d["attention"][0]
    assert a["tile"] == [64, 64] and a["seq_q"] == 200 and a["num_layouts"] == 1
    assert a["tile_classes"] == {"empty": 6, "full": 6, "partial": 4}
    rows = report.summary_rows()
    assert rows and rows[0]["pattern"] == "attention_core"


def test_large_model_paths(monkeypatch):
    """Models over protobuf's 2 GB limit: probing and checking go through external data (threshold lowered)."""
    import stof_trt.rewrite.probe as probe

    monkeypatch.setattr(probe, "LARGE_MODEL_BYTES", 1000)
    model = exported("gpt2")
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    monkeypatch.undo()
    assert_fused(new, {"StofSparseAttention": 2, "StofGemmEpilogue": 2})
    assert all(i.data_location == onnx.TensorProto.DEFAULT for i in new.graph.initializer)
    rng = np.random.default_rng(8)
    assert_parity(model, new, token_feeds(rng, 2, 30, mask=padding_mask(rng, 2, 30)))


def test_old_opset_is_converted():
    model = exported("bert", opset=14)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert report.opset == 17 and any("opset 14" in n for n in report.notes)
    assert_fused(new, {"StofSparseAttention": 2})
    rng = np.random.default_rng(9)
    assert_parity(model, new, token_feeds(rng, 2, 30, mask=padding_mask(rng, 2, 30)))


def test_float16_bert():
    model = exported("bert", half=True)
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    # StofGemmEpilogue: 2 GELU + 2 packed Q/K/V projections
    assert_fused(new, {"StofSparseAttention": 2, "StofGemmEpilogue": 8, "StofAddLayerNorm": 4})
    rng = np.random.default_rng(10)
    feeds = token_feeds(rng, 2, 40, mask=padding_mask(rng, 2, 40))
    from models_util import run
    a, b = (run(m, feeds)[0].astype(np.float32) for m in (model, new))
    keep = feeds["attention_mask"] != 0  # the padding is removed: compare real tokens (padded ones are 0)
    assert report.remove_padding["applied"] and not np.any(b[~keep])
    a, b = a[keep], b[keep]
    assert np.isfinite(b).all() and np.abs(a - b).max() <= 2e-2 * max(1.0, np.abs(a).max())


def _layouts(model):
    """TileLayout of every StofSparseAttention node, read back from the initializers."""
    from stof_trt.format import TileLayout

    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type == "StofSparseAttention":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            out.append(TileLayout.from_arrays(seq_q=a["seq_q"], seq_k=a["seq_k"], tile_m=a["tile_m"],
                                              tile_n=a["tile_n"], num_layouts=a["num_layouts"],
                                              row_ptr=inits[n.input[3]], col_idx=inits[n.input[4]],
                                              tile_bitmap_index=inits[n.input[5]], bitmaps=inits[n.input[6]]))
    return out


def test_user_mask_intersects_graph_causal():
    spec = parse_mask("sliding:window=5")
    new, report = rewrite_model(exported("gpt2"), mask=spec, max_seq_len=S_MAX, **TILE)
    layouts = _layouts(new)
    assert len(layouts) == 2 and layouts[0].signature() == layouts[1].signature()
    expected = spec.dense(S_MAX, S_MAX) & np.tril(np.ones((S_MAX, S_MAX), bool))
    assert np.array_equal(layouts[0].to_dense()[0], expected)
    # shared initializers: one set of layout arrays for both layers
    names = [tuple(n.input[3:7]) for n in new.graph.node if n.op_type == "StofSparseAttention"]
    assert names[0] == names[1]


def test_user_errors():
    model = exported("bert")
    with pytest.raises(StofError, match="max_seq_len"):
        rewrite_model(model, max_seq_len=0)
    with pytest.raises(StofError):
        rewrite_model(model, max_seq_len=S_MAX, tile_m=20)
    with pytest.raises(StofError):
        rewrite_model(model, max_seq_len=S_MAX, mask="no-such-mask")
    with pytest.raises(StofError, match="max_seq_len=10000000000 is over"):
        rewrite_model(model, max_seq_len=10**10)
    with pytest.raises(StofError, match="max_seq_len=600 .* at most 512 positions"):
        rewrite_model(model, max_seq_len=600)  # beyond the 512 position embeddings
    new, _ = rewrite_model(model, max_seq_len=S_MAX)
    with pytest.raises(StofError, match="already contains STOF"):
        rewrite_model(new, max_seq_len=S_MAX)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_sdpa_exports(kind):
    """attn_implementation="sdpa": scale on Q and K, Where(IsNaN(P), 0, P) after the softmax."""
    model = exported(kind, attn_implementation="sdpa")
    assert "IsNaN" in {n.op_type for n in model.graph.node}
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0, "IsNaN": 0})
    src = _attention(report)[0]["mask_source"]
    assert ("causal" in src) == (kind == "gpt2") and "padding" in src
    rng = np.random.default_rng(11)
    for seq in (S_MAX, 21):
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))


@pytest.mark.parametrize("kind", ["bert", "local_attention"])
def test_dynamo_exporter(kind):
    model = exported(kind, dynamo=True)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    # per block: packed Q/K/V, FFN1 and the two residual chains' GEMMs
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0, "StofGemmEpilogue": 8})
    assert all("padding" in a["mask_source"] for a in _attention(report))
    rng = np.random.default_rng(12)
    for seq in (S_MAX, 26):
        pad = padding_mask(rng, 3, seq)
        pad[:, ::3] = 1  # the local model masks with -inf: keep a key in every window
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=pad))


def test_t5_encoder_position_bias_kept_with_padding():
    model = exported("t5_encoder")
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    for a in _attention(report):
        assert a["key_padding"] and a["attn_bias"] and "padding" in a["mask_source"]
    rng = np.random.default_rng(13)
    for seq in (S_MAX, 19):
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llama_causal_rotary_and_grouped_kv(kv_heads):
    model = exported("llama", kv_heads=kv_heads)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    for a in _attention(report):
        assert a["mask_source"].startswith("graph causal") and a["key_padding"] and not a["attn_bias"]
        assert a["heads"] == 4 and a["kv_heads"] == kv_heads
    # grouped K/V reach the node un-expanded (no repeat_kv Expand left in front of it)
    import onnx_graphsurgeon as gs
    from stof_trt.rewrite.fuse_attention import repeat_kv_source
    nodes = [n for n in gs.import_onnx(new).nodes if n.op == "StofSparseAttention"]
    assert nodes and all(repeat_kv_source(t) is None for n in nodes for t in n.inputs[1:3])
    rng = np.random.default_rng(14)
    for seq in (S_MAX, 27):
        assert_parity(model, new, token_feeds(rng, 3, seq, mask=padding_mask(rng, 3, seq)))


def test_gpt_neo_alternating_global_and_local_layers():
    model = exported("gpt_neo", window=5)
    new, report = rewrite_model(model, max_seq_len=S_MAX, **TILE)
    assert_fused(new, {"StofSparseAttention": 2, "Softmax": 0})
    sources = [a["mask_source"] for a in _attention(report)]
    assert sources[0].startswith("graph causal +") and sources[1].startswith("graph sliding:window=4,causal=1")
    assert len({a["layout_signature"] for a in _attention(report)}) == 2
    rng = np.random.default_rng(15)
    assert_parity(model, new, token_feeds(rng, 2, S_MAX))
    # with padding, compare the kept positions: a padded query whose whole window is padding has no allowed key
    # (zeros by contract; the original averages garbage there)
    pad = padding_mask(rng, 3, 40, min_len=6)
    feeds = token_feeds(rng, 3, 40, mask=pad)
    from models_util import run
    a, b = run(model, feeds)[0], run(new, feeds)[0]
    keep = pad.astype(bool)
    assert np.abs(a - b)[keep].max() <= 1e-4 * max(1.0, np.abs(a).max())
