"""Padding removal (RemovePadding, qkv_format "t3hd"): packed models against the originals on ORT CPU through the
function fallbacks, the packed graph's shape, the cases that keep the padded form, and the t3hd function alone."""
from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.format import STOF_FORMAT_VERSION, compile_mask
from stof_trt.rewrite import rewrite_model
from stof_trt.rewrite.functions import sparse_attention_function
from models_util import TILE, _CACHE_DIR, exported, op_counts, run, session, token_feeds

B, S = 4, 16


def _masks(rng):
    """Right padding with a length-1 row, all rows full, left padding, and masks with holes (row 0 full)."""
    lengths = np.array([S, 1, 9, 13])
    right = (np.arange(S)[None] < lengths[:, None]).astype(np.int64)
    holes = (rng.random((B, S)) < 0.55).astype(np.int64)
    holes[:, 0] = 1
    holes[0] = 1
    return {"right": right, "full": np.ones((B, S), np.int64), "left": right[:, ::-1].copy(), "holes": holes}


def _attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == "StofSparseAttention"]


def _fmt(node) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "qkv_format"), "bhsd")


def assert_packed(model, report, restored=("last_hidden_state",)):
    """The graph runs on packed tokens: NonZero / Gather of the tokens before the first block, every attention
    node t3hd with seq_offsets, each output restored by a Gather of [packed rows ; zero row] by position."""
    rp = report.to_dict()["remove_padding"]
    assert rp["applied"], rp
    assert set(restored) <= set(rp["restored"])
    counts = op_counts(model)
    assert counts["NonZero"] == 1 and counts["ScatterND"] == 0
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    restores = [n for n in model.graph.node if n.op_type == "Gather" and producer.get(n.input[0]) == "Concat"
                and producer.get(n.input[1]) == "Where"]
    assert len(restores) == len(rp["restored"])
    # the tokens' index: NonZero -> Squeeze, read by the pack Gather (axis 0)
    nz = next(n for n in model.graph.node if n.op_type == "NonZero")
    sq = next(n for n in model.graph.node if n.op_type == "Squeeze" and n.input[0] == nz.output[0])
    packs = [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == sq.output[0]]
    assert len(packs) == 1
    atts = _attention_nodes(model)
    assert atts and all(_fmt(n) == "t3hd" and len(n.input) == 10 and n.input[9] and not n.input[1]
                        and not n.input[8] for n in atts)
    # (a closed-form layout's spec evaluated by the function: overload varlen_spec<N>)
    assert {n.overload.split("_spec")[0] for n in atts} == {"varlen"}
    assert {(f.name, f.overload) for f in model.functions if f.name == "StofSparseAttention"} == \
        {("StofSparseAttention", ov) for ov in {n.overload for n in atts}}
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["stof.padding_removed"] == "1"
    onnx.checker.check_model(model, full_check=True)


def token_rows(model, feeds, mask, rows: int | None = None) -> None:
    """Every StofGemmEpilogue / MatMul / StofAddLayerNorm output has one row per real token (or ``rows`` token
    slots) at run time."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [n.output[0] for n in m.graph.node if n.op_type in ("StofGemmEpilogue", "MatMul", "StofAddLayerNorm")]
    assert names
    m.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    outs = run(m, feeds)[-len(names):]
    want = int(mask.sum()) if rows is None else rows
    assert all(o.shape[0] == want for o in outs), [o.shape for o in outs]


def compare(original, new, feeds, atol=2e-5):
    """Real tokens equal the original's (fp32), padded positions are exactly 0; other outputs equal."""
    keep = feeds["attention_mask"] != 0
    a, b = run(original, feeds), run(new, feeds)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        if x.shape[:2] == keep.shape:
            assert not np.any(y[~keep])
            x, y = x[keep], y[keep]
        scale = max(1.0, float(np.abs(x).max()))
        assert np.abs(x - y).max() <= atol * scale, float(np.abs(x - y).max())


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_packed_model_matches_original(kind):
    model = exported(kind)
    new, report = rewrite_model(model, **TILE)
    assert_packed(new, report)
    rng = np.random.default_rng(1)
    for name, mask in _masks(rng).items():
        feeds = token_feeds(rng, B, S, mask=mask)
        compare(model, new, feeds)
    token_rows(new, feeds, mask)
    # a shorter run and one row of one token
    feeds = token_feeds(rng, 1, 1, mask=np.ones((1, 1), np.int64))
    compare(model, new, feeds)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_token_slots_match_original(kind):
    """token_capacity_input: one StofPackTokens node packs the tokens into C slots (the input's length, at most
    B·S) and the outputs equal the original's at any C >= T; every restored output is NaN when C < T."""
    from stof_trt import ort as sort

    model = exported(kind)
    new, report = rewrite_model(model, token_capacity_input=True, **TILE)
    rp = report.to_dict()["remove_padding"]
    assert rp["applied"] and rp["token_capacity_input"] == "stof_token_capacity"
    counts = op_counts(new)
    assert counts["NonZero"] == 0 and counts["StofPackTokens"] == 1 and counts["CumSum"] == 0
    assert [i.name for i in new.graph.input][-1] == "stof_token_capacity"
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.token_capacity_input"] == "stof_token_capacity"
    assert meta["stof.padding_mask_input"] == "attention_mask"
    onnx.checker.check_model(new, full_check=True)
    rng = np.random.default_rng(6)
    for mask in _masks(rng).values():
        feeds = token_feeds(rng, B, S, mask=mask)
        tokens = int(mask.sum())
        for cap in sorted({tokens, tokens + 5, B * S, B * S + 40}):
            compare(model, new, {**feeds, "stof_token_capacity": np.zeros(cap, np.int32)})
        token_rows(new, {**feeds, "stof_token_capacity": np.zeros(tokens + 3, np.int32)}, mask,
                   rows=min(tokens + 3, B * S))
    sess = session(new)
    filled = sort.with_token_capacity(sess, feeds)
    assert filled["stof_token_capacity"].shape == (sort.token_capacity(tokens, B * S),)
    assert sort.with_token_capacity(session(model), feeds) is feeds
    short = run(new, {**feeds, "stof_token_capacity": np.zeros(tokens - 1, np.int32)})
    assert all(np.isnan(o).all() for o in short if o.dtype.kind == "f")


def test_token_capacity_buckets():
    from stof_trt.ort import token_capacity

    assert token_capacity(1, 4096) == 64 and token_capacity(64, 4096) == 64 and token_capacity(65, 4096) == 128
    assert token_capacity(50, 40) == 40 and token_capacity(0, 10) == 10
    for t in range(1, 20000, 37):
        c = token_capacity(t, 1 << 20)
        assert t <= c and (c - t) <= max(63, t // 8), (t, c)
    # at most eight capacities per octave
    assert len({token_capacity(t, 1 << 20) for t in range(4097, 8193)}) <= 8


def test_token_capacity_needs_padding_removal():
    from stof_trt.errors import StofError

    with pytest.raises(StofError, match="needs remove_padding"):
        rewrite_model(exported("bert"), remove_padding=False, token_capacity_input=True, **TILE)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_fixed_shape_export(kind):
    """Reshape targets fixed at export ([2, 16, 32], GPT-2's [32, 32]) are told apart on the probed shapes."""
    model = exported(kind, dynamic_axes=False)
    new, report = rewrite_model(model, **TILE)
    assert_packed(new, report)
    rng = np.random.default_rng(5)
    mask = np.ones((2, S), np.int64)
    mask[1, 5:] = 0
    mask[0, :3] = 0
    compare(model, new, token_feeds(rng, 2, S, mask=mask))


@functools.lru_cache(maxsize=None)
def _pooled(kind: str) -> str:
    """A BERT / RoBERTa with its pooler: outputs last_hidden_state and pooler_output (Gather of token 0)."""
    import torch
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    from stof_trt.export import _export

    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  attn_implementation="eager")
    if kind == "bert":
        model = BertModel(BertConfig(max_position_embeddings=64, **common), add_pooling_layer=True).eval()
    else:
        model = RobertaModel(RobertaConfig(max_position_embeddings=66, pad_token_id=1, **common),
                             add_pooling_layer=True).eval()

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    names = ["input_ids", "attention_mask"]
    dyn = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]}
    dyn["pooler_output"] = {0: "batch"}
    ids = torch.randint(2, 100, (2, 8))
    path = _CACHE_DIR / f"{kind}_pooled.onnx"
    _export(Pooled().eval(), (ids, torch.ones_like(ids)), path, names, ["last_hidden_state", "pooler_output"], dyn, 17)
    return str(path)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_pooler_reads_restored_tokens(kind):
    model = onnx.load(_pooled(kind))
    new, report = rewrite_model(model, **TILE)
    assert_packed(new, report)
    rng = np.random.default_rng(2)
    masks = _masks(rng)
    for name in ("right", "full", "holes"):  # the pooler reads token 0: real in these
        compare(model, new, token_feeds(rng, B, S, mask=masks[name]))


@pytest.mark.parametrize("how", ["window", "longformer"])
def test_sliding_patterns_keep_padded_path(how):
    if how == "window":
        model, kwargs = exported("local_attention", window=3, seq_len=S), {}
    else:
        model, kwargs = exported("bert"), {"mask": "longformer:window=3,global=2", "max_seq_len": 64}
    new, report = rewrite_model(model, **TILE, **kwargs)
    rp = report.to_dict()["remove_padding"]
    assert not rp["applied"] and "neither full nor causal" in rp["reason"]
    assert "padding removal: not applied" in str(report)
    assert all(_fmt(n) != "t3hd" for n in _attention_nodes(new)) and op_counts(new)["NonZero"] == 0


def test_switch_off_keeps_padded_graph():
    model = exported("bert")
    off, report = rewrite_model(model, remove_padding=False, **TILE)
    assert report.to_dict()["remove_padding"] == {"applied": False, "reason": "turned off (remove_padding=False)"}
    assert all(_fmt(n) == "bs3hd" for n in _attention_nodes(off))
    assert op_counts(off)["NonZero"] == op_counts(off)["ScatterND"] == 0
    assert "stof.padding_removed" not in {p.key for p in off.metadata_props}
    on, _ = rewrite_model(model, **TILE)
    rng = np.random.default_rng(3)
    feeds = token_feeds(rng, B, S, mask=_masks(rng)["right"])
    keep = feeds["attention_mask"] != 0
    a, b = run(off, feeds)[0], run(on, feeds)[0]
    assert np.abs(a[keep] - b[keep]).max() < 1e-5 and np.abs(a[~keep]).max() > 0


def test_cli_flag(tmp_path):
    from stof_trt.cli import main

    src = tmp_path / "bert.onnx"
    onnx.save(exported("bert"), src)
    for flag, fmt in (([], "t3hd"), (["--no-remove-padding"], "bs3hd"), (["--token-capacity-input"], "t3hd")):
        out = tmp_path / f"out{flag}.onnx"
        assert main(["rewrite", str(src), "-o", str(out), "--tile", "16", "32", *flag]) in (0, None)
        new = onnx.load(out)
        assert {_fmt(n) for n in _attention_nodes(new)} == {fmt}
        assert ("stof_token_capacity" in {i.name for i in new.graph.input}) == ("--token-capacity-input" in flag)
    assert main(["rewrite", str(src), "-o", str(tmp_path / "x.onnx"), "--no-remove-padding",
                 "--token-capacity-input"]) == 2
    # `stof run` sizes the token capacity input from the padding mask: no --shapes for it
    slots = tmp_path / "out['--token-capacity-input'].onnx"
    assert main(["run", str(slots), "--provider", "cpu", "--shapes", f"input_ids={B}x{S},attention_mask={B}x{S}",
                 "--json"]) in (0, None)


def test_unpacked_attention_keeps_padded_path():
    new, report = rewrite_model(exported("bert"), packed_qkv=False, **TILE)
    rp = report.to_dict()["remove_padding"]
    assert not rp["applied"] and "qkv_format bhsd" in rp["reason"]


def test_no_padding_mask_keeps_padded_path():
    new, report = rewrite_model(exported("vit"), **TILE)
    rp = report.to_dict()["remove_padding"]
    assert not rp["applied"] and "no padding mask" in rp["reason"]
    from stof_trt.errors import StofError

    with pytest.raises(StofError, match="token_capacity_input.*no padding mask"):  # asked for: never dropped
        rewrite_model(exported("vit"), token_capacity_input=True, **TILE)


# -- the t3hd function alone -----------------------------------------------------------------------------------
def _varlen_model(layout, H, D, opset):
    inits = [numpy_helper.from_array(a, n) for n, a in layout.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["qkv", "", "", *layout.arrays(), "kpm", "", "offsets"], ["o"],
                            domain="stof", scale=0.3, tile_m=layout.tile_m, tile_n=layout.tile_n,
                            seq_q=layout.seq_q, seq_k=layout.seq_k, num_layouts=layout.num_layouts,
                            format_version=STOF_FORMAT_VERSION, mask_spec=layout.mask_spec, qkv_format="t3hd")
    node.overload = "varlen"
    gin = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["t", 3, H, D]),
           helper.make_tensor_value_info("kpm", TensorProto.INT32, ["b", "s"]),
           helper.make_tensor_value_info("offsets", TensorProto.INT32, ["b1"])]
    graph = helper.make_graph([node], "g", gin, [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["t", H, D])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("stof", 1)],
                              functions=[sparse_attention_function(opset, True, False, varlen=True)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("opset", [15, 17, 18, 23])
@pytest.mark.parametrize("spec", ["full", "causal"])
def test_t3hd_function_each_sequence_alone(spec, opset):
    H, D, seq = 2, 8, 37
    sess = session(_varlen_model(compile_mask(spec, seq, seq, tile_m=16, tile_n=32), H, D, opset))
    rng = np.random.default_rng(4)
    for s, lengths in ((seq, [seq, 1, 20, 0, 33]), (21, [1, 21]), (5, [5])):
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        qkv = rng.standard_normal((int(off[-1]), 3, H, D)).astype(np.float32)
        kpm = np.zeros((len(lengths), s), np.int32)  # values unused: the offsets say which rows are real
        o = sess.run(None, {"qkv": qkv, "kpm": kpm, "offsets": off})[0]
        assert o.shape == (off[-1], H, D)
        for b, n in enumerate(lengths):
            x = qkv[off[b]:off[b + 1]].astype(np.float64).transpose(1, 2, 0, 3)   # [3, H, n, D]
            sc = x[0] @ x[1].swapaxes(-1, -2) * 0.3
            if spec == "causal":
                sc = np.where(np.tril(np.ones((n, n), bool)), sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True)) if n else sc
            ref = (p / p.sum(-1, keepdims=True)) @ x[2] if n else np.zeros((H, 0, D))
            np.testing.assert_allclose(o[off[b]:off[b + 1]], ref.transpose(1, 0, 2), atol=2e-6, rtol=1e-5)
    with pytest.raises(Exception, match="stof_run_time_length_exceeds"):
        sess.run(None, {"qkv": np.zeros((2, 3, H, D), np.float32), "kpm": np.ones((1, seq + 1), np.int32),
                        "offsets": np.array([0, 2], np.int32)})


def test_cuda_graphs_refused_for_a_packed_model(tmp_path):
    """A packed model's token count changes with each batch: a captured graph would replay a stale one."""
    import onnx
    from onnx import TensorProto, helper

    from stof_trt import ort as sort
    from stof_trt.errors import StofError

    m = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
                          ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="stof.padding_removed", value="1")
    path = tmp_path / "packed.onnx"
    onnx.save(m, path)
    for model in (m, path):
        with pytest.raises(StofError, match="CUDA graphs cannot replay"):
            sort.session(model, cuda_graphs=True)
