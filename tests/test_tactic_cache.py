"""Tactic cache: keys, JSON round trip, validation; the pre-search fallback; reading a model's STOF nodes
(no GPU needed)."""

import json

import pytest

from stof_trt.errors import StofError
from stof_trt.format import STOF_FORMAT_VERSION, compile_mask
from stof_trt.selection import add_presearch_entries, choose
from stof_trt.tactic_cache import FORMAT, CacheKey, TacticCache, node_signature, shape_bucket


def test_shape_bucket_rounds_up_to_powers_of_two():
    assert shape_bucket(8, 4096, 4096) == "B8|Sq4096|Sk4096"
    assert shape_bucket(3, 500, 33) == "B4|Sq512|Sk64"
    assert shape_bucket(1, 1, 1) == "B1|Sq64|Sk64"


def test_node_signature_matches_the_plugin_format():
    # plugins_cu/ort/sparseAttention/sparseAttentionOp.cpp builds the same string
    assert (node_signature("float16", 12, 64, 64, 64, 1, 4096, 4096, True)
            == "StofSparseAttention|float16|H12|D64|tile64x64|L1|seq4096x4096|kpm1")
    # packed sequences (seq_offsets, no padding mask passed): a key of their own
    assert (node_signature("float16", 12, 64, 64, 64, 1, 512, 512, False, packed=True)
            == "StofSparseAttention|float16|H12|D64|tile64x64|L1|seq512x512|kpm0|packed")


def _key(**kw):
    base = dict(gpu="NVIDIA H100 80GB HBM3", cc="9.0", node=node_signature("float16", 12, 64, 64, 64, 1, 512, 512,
                                                                           False),
                bucket=shape_bucket(8, 512, 512), mask="ab" * 20)
    base.update(kw)
    return CacheKey(**base)


def test_round_trip(tmp_path):
    c = TacticCache()
    c.put(_key(), 3, time_ms=0.25, source="measured", candidates={"1": 0.3, "3": 0.25})
    c.put(_key(bucket="B8|Sq2048|Sk2048"), 1, time_ms=1.0)
    p = c.save(tmp_path / "cache.json")
    doc = json.loads(p.read_text())
    assert doc["format"] == FORMAT and doc["version"] == 1 and len(doc["entries"]) == 2
    for e in doc["entries"]:
        assert {"gpu", "cc", "node", "bucket", "mask", "tactic"} <= set(e)
    d = TacticCache.load(p)
    assert d.lookup(_key()) == 3 and d.lookup(_key(bucket="B8|Sq2048|Sk2048")) == 1
    assert d.lookup(_key(gpu="other")) == 0
    assert d.get(_key())["candidates"] == {"1": 0.3, "3": 0.25}


@pytest.mark.parametrize("text,match", [
    ("not json", "JSON"),
    ('{"format": "x", "version": 1, "entries": []}', "not a STOF tactic cache"),
    ('{"format": "stof-tactic-cache", "version": 2, "entries": []}', "version"),
    ('{"format": "stof-tactic-cache", "version": 1, "entries": [{"gpu": "g"}]}', "lacks"),
    ('{"format": "stof-tactic-cache", "version": 1, "entries": [{"gpu": "g", "cc": "9.0", "node": "n", '
     '"bucket": "b", "mask": "m", "tactic": 0}]}', "bad tactic"),
])
def test_bad_files_are_user_errors(tmp_path, text, match):
    p = tmp_path / "c.json"
    p.write_text(text)
    with pytest.raises(StofError, match=match):
        TacticCache.load(p)


def test_missing_file(tmp_path):
    with pytest.raises(StofError, match="not found"):
        TacticCache.load(tmp_path / "nope.json")
    assert len(TacticCache.load_or_new(tmp_path / "nope.json")) == 0


def test_choose_cache_then_presearch():
    layout = compile_mask("longformer:window=256,global=32", 1024, 1024)
    key = _key(mask=layout.signature())
    kw = dict(batch=8, heads=12, head_dim=64, seq_q=1024, seq_k=1024)
    t, src = choose(None, key, layout, **kw)
    assert src == "presearch" and t >= 1
    c = TacticCache()
    c.put(key, 2)
    assert choose(c, key, layout, **kw) == (2, "cache")


def test_presearch_entries_for_a_model():
    """Pre-search first choices for a model's attention nodes (no GPU: GPU name given), measured entries kept."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from stof_trt.nodes import attention_problem_dims

    lay = compile_mask("longformer:window=64,global=8", 512, 512)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in lay.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["q", "k", "v", "row_ptr", "col_idx", "tile_bitmap_index",
                                                    "bitmaps", "kpm"], ["o"], domain="stof", name="a0", scale=0.125,
                            tile_m=64, tile_n=64, seq_q=512, seq_k=512, num_layouts=1,
                            format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["B", 12, "S", 64]) for n in "qkv"]
    ins.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, ["B", "S"]))
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    assert attention_problem_dims(m) == {"a0": ("float16", 12, 64)}
    c = TacticCache()
    key = CacheKey("GPU", "9.0", node_signature("float16", 12, 64, 64, 64, 1, 512, 512, True),
                   shape_bucket(8, 512, 512), lay.signature())
    c.put(key, 2, source="measured")
    assert add_presearch_entries(c, m, [(8, 512), (1, 256)], "GPU", "9.0") == 1
    assert c.lookup(key) == 2  # the measured entry stays
    key2 = CacheKey("GPU", "9.0", key.node, shape_bucket(1, 256, 256), lay.signature())
    assert c.get(key2)["source"] == "presearch" and c.lookup(key2) >= 1


def test_packed_attention_nodes():
    """qkv_format "bs3hd" nodes (query [B,S,3,H,D], no key/value): heads and head dim for the pre-search, and
    attention_nodes reads the packed query as key too."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from stof_trt.nodes import attention_nodes, attention_problem_dims

    lay = compile_mask("causal", 256, 256)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in lay.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["qkv", "", "", "row_ptr", "col_idx", "tile_bitmap_index",
                                                    "bitmaps"], ["o"], domain="stof", name="p0", scale=0.125,
                            tile_m=64, tile_n=64, seq_q=256, seq_k=256, num_layouts=1,
                            format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec, qkv_format="bs3hd")
    ins = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT16, ["B", "S", 3, 12, 64])]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    assert attention_problem_dims(m) == {"p0": ("float16", 12, 64)}
    (nd,) = attention_nodes(m)
    assert nd.packed and nd.query == nd.key == "qkv"


def _one_node_model(lay, inits, inputs=("q", "k", "v", "row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"),
                    **attrs):
    from onnx import TensorProto, helper

    base = dict(scale=0.125, tile_m=lay.tile_m, tile_n=lay.tile_n, seq_q=lay.seq_q, seq_k=lay.seq_k,
                num_layouts=lay.num_layouts, format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec)
    base.update(attrs)
    node = helper.make_node("StofSparseAttention", list(inputs), ["o"], domain="stof", name="a0", **base)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["B", 4, "S", 64]) for n in "qkv"]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])


def test_attention_nodes_refuse_what_they_cannot_trust():
    """A layout input that is not a constant, a layout whose arrays break an invariant, or an unknown format
    version: one StofError each, before anything (the tuner, `stof inspect`) reads the layout."""
    import numpy as np
    from onnx import numpy_helper

    from stof_trt.nodes import attention_nodes

    lay = compile_mask("causal", 256, 256)
    arrays = lay.arrays()
    good = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in arrays.items()]
    (nd,) = attention_nodes(_one_node_model(lay, good))
    assert nd.layout.signature() == lay.signature() and nd.scale == 0.125 and not nd.packed

    with pytest.raises(StofError, match="layout input 'bitmaps' is not a constant"):
        attention_nodes(_one_node_model(lay, good[:3]))
    bad_cols = dict(arrays, col_idx=np.full_like(arrays["col_idx"], lay.Tk + 3))  # a key tile past the grid
    bad = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in bad_cols.items()]
    with pytest.raises(StofError, match="col_idx out of range"):
        attention_nodes(_one_node_model(lay, bad))
    with pytest.raises(StofError, match="format_version 99"):
        attention_nodes(_one_node_model(lay, good, format_version=99))


def test_presearch_only_tune_for_a_named_gpu_without_one(kernels, tmp_path):
    """`stof tune --presearch-only --gpu NAME` on a machine with no GPU and no CUDA EP: the problems come from a
    CPU run, the tactics from the pre-search for that GPU, and every entry is keyed as the library's reader on that
    GPU looks it up."""
    import subprocess
    import sys

    import onnx
    import torch
    from models_util import exported

    from stof_trt import presearch as ps
    from stof_trt.nodes import attention_nodes

    src, model = str(tmp_path / "bert16.onnx"), str(tmp_path / "bert16.stof.onnx")
    onnx.save(exported("bert", half=True, hidden=128, heads=2), src)   # head dim 64: tensor-core tactics

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], capture_output=True, text=True,
                              timeout=600)

    assert cli("rewrite", src, "-o", model).returncode == 0
    node = attention_nodes(onnx.load(model))[0]
    dl = kernels.DeviceLayout(node.layout, device="cpu")
    shapes = [(2, 128), (1, 512)]
    shape_args = [a for B, S in shapes for a in ("--shapes", f"input_ids={B}x{S},attention_mask={B}x{S}")]

    def problem(B, S):
        # the rewritten BERT packs its real tokens (t3hd): the plugin selects for packed sequences, full rows here
        q = torch.zeros(B * S, 2, 64, dtype=torch.float16)     # host memory: select launches nothing
        return q, dict(seq_offsets=torch.arange(0, B * S + 1, S, dtype=torch.int32), max_seqlen=S)

    def tune(cache, *gpu_args):
        p = cli("tune", model, *shape_args, "--presearch-only", *gpu_args, "-o", str(cache), "--json")
        assert p.returncode == 0, p.stderr
        entries = json.loads(cache.read_text())["entries"]
        assert len(entries) == len(shapes)
        assert kernels.load_tactic_cache(cache) == len(shapes)
        return {e["bucket"]: e for e in entries}

    # an H200: the pre-search may choose a wgmma tactic, which this GPU-less host's library cannot run and so skips;
    # the same entries with a tactic valid here are hits, so the keys are the reader's
    h200 = kernels.device_desc(name="NVIDIA H200", cc="9.0")
    cache = tmp_path / "h200.json"
    entries = tune(cache, "--gpu", "NVIDIA H200")
    assert {(e["gpu"], e["cc"]) for e in entries.values()} == {("NVIDIA H200", "9.0")}
    hopper = ps.valid_tactics(64, 64, 64, hopper=True)
    assert all(e["tactic"] in hopper and e["source"] == "presearch" for e in entries.values())
    doc = json.loads(cache.read_text())
    for B, S in shapes:
        q, packed = problem(B, S)
        valid = kernels.list_tactics(q, q, q, dl, **packed)
        pre = kernels.select_tactic(q, q, q, dl, **packed, device=h200)[0]
        pick = next(t for t in reversed(valid) if t != pre)
        for e in doc["entries"]:
            if e["bucket"] == shape_bucket(B, S, S):
                e["tactic"] = pick
        (tmp_path / "h200_here.json").write_text(json.dumps(doc))
        kernels.load_tactic_cache(tmp_path / "h200_here.json")
        assert kernels.select_tactic(q, q, q, dl, **packed, device=h200,
                                     tactic_cache=tmp_path / "h200_here.json") == (pick, "cache")
    # an Ampere GPU: its pre-search chooses among tactics this host's library runs too, so the entries hit as written
    a100 = kernels.device_desc(name="NVIDIA A100-SXM4-80GB", cc="8.0")
    entries = tune(tmp_path / "a100.json", "--gpu", "NVIDIA A100-SXM4-80GB", "--cc", "8.0", "--sm-count", "108")
    for B, S in shapes:
        q, packed = problem(B, S)
        want = entries[shape_bucket(B, S, S)]["tactic"]
        assert kernels.select_tactic(q, q, q, dl, **packed, device=a100,
                                     tactic_cache=tmp_path / "a100.json") == (want, "cache")
        assert kernels.select_tactic(q, q, q, dl, **packed, device=h200,
                                     tactic_cache=tmp_path / "a100.json")[1] != "cache"   # keyed by the named GPU
    # timing needs the GPU itself: --gpu without --presearch-only is a one-line error, nothing written
    before = cache.read_text()
    p = cli("tune", model, "--shapes", "input_ids=1x64,attention_mask=1x64", "--gpu", "NVIDIA H200", "-o", str(cache))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--presearch-only" in p.stderr, p.stderr
    # a length over the model's compiled one is refused as `stof run` refuses it
    p = cli("tune", model, "--shapes", "input_ids=1x513,attention_mask=1x513", "--presearch-only", "--gpu",
            "NVIDIA H200", "-o", str(cache))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "at most 512 tokens" in p.stderr, p.stderr
    assert cache.read_text() == before


def test_tune_candidates_take_a_small_problem_as_first_use_timing_does():
    """`stof tune` times its shortlist (the first 3 within 1.5x of the first) or, below the small-problem bound,
    every tactic within 4x of the first, as the library's first-use timing does."""
    from stof_trt.tune import tune_candidates

    big = [(24, 1e-3), (22, 1.2e-3), (23, 1.4e-3), (21, 1.45e-3), (13, 2e-3)]
    assert tune_candidates(big) == [24, 22, 23]
    assert tune_candidates(big, k=5) == [24, 22, 23, 21]
    small = [(22, 8e-6), (24, 10e-6), (28, 13e-6), (29, 14e-6), (31, 16e-6), (13, 20e-6), (11, 40e-6)]
    assert tune_candidates(small) == [22, 24, 28, 29, 31, 13]
    assert tune_candidates(small, all_tactics=True) == [t for t, _ in small]
    assert tune_candidates([]) == []
