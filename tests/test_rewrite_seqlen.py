"""Run-time sequence lengths of rewritten models: never a silently wrong answer between the compiled length and
the next tile multiple; one clear error above the model's limit."""
from __future__ import annotations

import numpy as np
import pytest

from models_util import TILE, assert_parity, exported, layout_specs, padding_mask, run, session, token_feeds
from stof_trt.errors import StofError
from stof_trt.rewrite import rewrite_model


def _drop_layout_specs(model):
    for n in model.graph.node:
        for a in [a for a in n.attribute if a.name == "layout_spec"]:
            n.attribute.remove(a)
        if n.op_type == "StofSparseAttention":
            n.overload = n.overload.rsplit("spec", 1)[0].rstrip("_")
    return model


@pytest.mark.parametrize("kind,spec", [("gpt2", None), ("bert", None),
                                       ("bert", "bigbird:block=16,window=1,global=1,random=0.3")])
def test_fallback_refuses_lengths_above_the_compiled_one(kind, spec):
    """Compiled at 20 with 16-row tiles, nodes without a layout_spec (BigBird's random blocks; the others with it
    dropped): 20 runs right; 21..32 (inside the last tile) and 33 fail with a message that names the compiled sizes,
    never a wrong output."""
    from stof_trt.rewrite.functions import build_functions

    model = exported(kind)
    new, _ = rewrite_model(model, mask=spec, max_seq_len=20, **TILE)
    if spec is None:   # the same model with the functions of nodes without layout_spec
        new = _drop_layout_specs(new)
        opset = next(i.version for i in new.opset_import if i.domain in ("", "ai.onnx"))
        needed = {(n.op_type, n.overload) for n in new.graph.node if n.domain == "stof"}
        del new.functions[:]
        new.functions.extend(build_functions(needed, opset))
    sess = session(new)
    rng = np.random.default_rng(0)
    assert_parity(model, new, token_feeds(rng, 2, 20, mask=padding_mask(rng, 2, 20)))
    for seq in (21, 25, 32, 33):
        with pytest.raises(Exception, match=r"exceeds_compiled_seq_q_seq_k.*\{1,20,20\}"):
            run(sess, token_feeds(rng, 2, seq))


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_fallback_with_layout_spec_runs_past_the_compiled_length(kind):
    """The same models as they are rewritten (causal / full with key padding: nodes with a layout_spec): the
    function evaluates the spec at the run-time length, so 21..33 (inside the compiled tail and past it) equal the
    original at every real token, up to the position table."""
    model = exported(kind)
    new, _ = rewrite_model(model, max_seq_len=20, **TILE)
    assert {n.overload for n in new.graph.node if n.op_type == "StofSparseAttention"} == {"varlen_spec0"}
    rng = np.random.default_rng(0)
    for seq in (20, 21, 25, 32, 33, 60):
        assert_parity(model, new, token_feeds(rng, 2, seq, mask=padding_mask(rng, 2, seq)))


def test_fixed_user_mask_sets_the_compiled_length(tmp_path):
    """An npy: mask cannot grow: a dynamic model with no max_seq_len is compiled at the mask's size, and says so."""
    rng = np.random.default_rng(3)
    arr = rng.random((40, 40)) < 0.5
    arr[np.arange(40), np.arange(40)] = True
    np.save(tmp_path / "m.npy", arr)
    new, report = rewrite_model(exported("gpt2"), mask=f"npy:{tmp_path / 'm.npy'}", **TILE)
    att = report.to_dict()["attention"]
    assert att and all(a["seq_q"] == 40 for a in att)
    assert any("the size of the mask" in n for n in report.notes), report.notes
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.max_seq_len"] == "40" and meta["stof.max_seq_len_source"] == "mask", meta
    from stof_trt.cli.common import check_seq_limit

    with pytest.raises(StofError, match=r"at most 40 tokens \(stof.max_seq_len: the size of its fixed mask; rewrite with a larger mask\)"):
        check_seq_limit(new, {"input_ids": (1, 41), "attention_mask": (1, 41)})
    sess = session(new)
    run(sess, token_feeds(rng, 2, 40))
    with pytest.raises(Exception, match=r"\{1,40,40\}"):
        run(sess, token_feeds(rng, 2, 41))


@pytest.mark.parametrize("name, expect", [("llama", {"causal"}), ("mistral", {"sliding:left=23,right=0"}),
                                          ("modernbert", {"full", "sliding:window=8"}), ("t5_encoder", {"full"})])
def test_closed_form_layouts_carry_their_spec(name, expect):
    """With no flags, a model with no length limit of its own is compiled at 2048, and each attention node whose
    layout is a closed-form pattern carries it (layout_spec; the plugin builds longer layouts from it): the metadata
    says compiled_seq_len, not max_seq_len, and the report says that longer inputs build their layouts."""
    from models_util import family

    from stof_trt.masks import closed_form, parse_mask

    model, limit = family(name)
    assert limit is None
    new, report = rewrite_model(model, **TILE)
    specs = layout_specs(new)
    assert specs and None not in specs and set(specs) == expect
    meta = {p.key: p.value for p in new.metadata_props}
    assert "stof.max_seq_len" not in meta and meta["stof.compiled_seq_len"] == "2048"
    assert any("build their layouts at run time" in n for n in report.notes), report.notes
    assert not any("longer inputs are an error" in n for n in report.notes), report.notes
    for s in specs:
        assert closed_form(parse_mask(s)) and str(parse_mask(s)) == s
    # the graph's causal pattern has no lower side at 2048: it is checked at 4098 (no window there), no caveat
    assert not any("would read as unbounded" in n for n in report.notes), report.notes


def test_a_window_wider_than_the_compiled_length_is_found():
    """Mistral's window (24 keys) compiled at 16 reads as causal there; the check at 34 sees the window, so the
    nodes get no layout_spec and the model keeps its compiled length as a limit, with a note that says why. (A
    window wider than about twice the compiled length is not seen: docs/rewrite.md "Sequence length".)"""
    from models_util import family

    new, report = rewrite_model(family("mistral")[0], max_seq_len=16, **TILE)
    assert set(layout_specs(new)) == {None}
    assert {p.key: p.value for p in new.metadata_props}["stof.max_seq_len"] == "16"
    assert any("reads as 'causal' at length 16 but not at 34" in n for n in report.notes), report.notes
    new, report = rewrite_model(family("mistral")[0], max_seq_len=40, **TILE)   # the window is seen at 40
    assert set(layout_specs(new)) == {"sliding:left=23,right=0"}


def test_layout_spec_compiles_to_the_node_layout():
    """Each node's layout_spec compiled at the node's size is exactly its layout inputs (the rewrite checks it; so
    does this test, through the host layer's compiler where it is built)."""
    from models_util import family

    from stof_trt.format import compile_mask
    from stof_trt.nodes import attention_nodes

    model, _ = family("modernbert")
    new, _ = rewrite_model(model, **TILE)
    specs = layout_specs(new)
    for node, spec in zip(attention_nodes(new), specs):
        lay = node.layout
        again = compile_mask(spec, lay.seq_q, lay.seq_k, tile_m=lay.tile_m, tile_n=lay.tile_n)
        assert again.signature() == lay.signature()
        try:
            from stof_trt import native_masks
            native_masks.native_library()
        except (ImportError, RuntimeError):
            continue
        assert native_masks.compile_spec(spec, lay.seq_q, lay.seq_k, tile_m=lay.tile_m,
                                         tile_n=lay.tile_n).signature() == lay.signature()


@pytest.mark.parametrize("mask, grows", [("longformer:window=8,global=2", True), ("dilated:window=20,dilation=3", True),
                                         ("bigbird:block=16,window=1,global=1", True),
                                         ("bigbird:block=16,window=1,global=1,random=0.3", False)])
def test_user_specs(mask, grows):
    """A user --mask spec on a model with no limit of its own: closed-form specs (∧ the graph's causal pattern)
    grow, BigBird's random blocks keep the compiled length and its limit."""
    from models_util import family

    new, _ = rewrite_model(family("llama")[0], mask=mask, **TILE)
    specs = layout_specs(new)
    meta = {p.key: p.value for p in new.metadata_props}
    if grows:
        assert None not in specs and all(s.endswith("&causal") for s in specs), specs
        assert "stof.max_seq_len" not in meta
    else:
        assert set(specs) == {None} and meta["stof.max_seq_len"] == "2048"


def test_models_with_a_limit_keep_it():
    """GPT-2's position table (72 here) is a limit of the model's own: the model keeps stof.max_seq_len and its
    nodes carry no layout_spec (past the limit the plugin refuses, as the model's own Gather does on the CPU and
    does not on CUDA), and max_seq_len given below a model's limit grows like the default."""
    from models_util import family

    new, _ = rewrite_model(family("gpt2")[0], **TILE)
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.max_seq_len"] == "72" and set(layout_specs(new)) == {None}
    new, _ = rewrite_model(family("llama")[0], max_seq_len=100, **TILE)
    meta = {p.key: p.value for p in new.metadata_props}
    assert "stof.max_seq_len" not in meta and meta["stof.compiled_seq_len"] == "100"


def test_given_length_below_the_models_limit_keeps_the_limit():
    """max_seq_len below GPT-2's position table (72): the layouts grow past the given length, and the table's limit
    stays the model's (stof.max_seq_len 72 beside stof.compiled_seq_len 40), so `stof run` refuses 73 in one line
    instead of ONNX Runtime's broadcast error; lengths 41 and 72 equal the original."""
    from models_util import family

    from stof_trt.cli.common import check_seq_limit

    model = family("gpt2")[0]
    new, report = rewrite_model(model, max_seq_len=40, **TILE)
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.compiled_seq_len"] == "40" and meta["stof.max_seq_len"] == "72", meta
    assert None not in layout_specs(new)
    assert any("model's own limit of 72" in n for n in report.notes), report.notes
    rng = np.random.default_rng(4)
    for seq in (41, 72):   # past the compiled length, up to the limit: the spec's layouts (ONNX functions here)
        assert_parity(model, new, token_feeds(rng, 2, seq, mask=padding_mask(rng, 2, seq)))
    check_seq_limit(new, {"input_ids": (1, 72), "attention_mask": (1, 72)})
    with pytest.raises(StofError, match="at most 72 tokens \\(stof.max_seq_len: the original model's own limit\\)"):
        check_seq_limit(new, {"input_ids": (1, 73), "attention_mask": (1, 73)})
    # given at the limit itself: as without the flag (no layout_spec, so the plugin refuses past it too)
    new, _ = rewrite_model(model, max_seq_len=72, **TILE)
    meta = {p.key: p.value for p in new.metadata_props}
    assert meta["stof.max_seq_len"] == "72" and "stof.compiled_seq_len" not in meta
    assert set(layout_specs(new)) == {None}


def test_band_spec_reads_graph_patterns():
    from stof_trt.rewrite.attention_common import band_spec

    S = 40
    q, k = np.arange(S)[:, None], np.arange(S)[None, :]
    d = k - q
    cases = [(d <= 0, "causal:offset=0"), (d <= 3, "causal:offset=3"), ((d >= -5) & (d <= 0), "sliding:left=5,right=0"),
             (np.abs(d) <= 7, "sliding:left=7,right=7"), (d >= -4, "sliding:left=4,right=2147483647"),
             ((d >= -9) & (d <= -2), "causal:offset=-2&sliding:left=9,right=0"), (np.ones((S, S), bool), "full"),
             ((d >= 2) & (d <= 5), None), (np.eye(S, dtype=bool)[::-1], None), (np.zeros((S, S), bool), None)]
    for m, want in cases:
        assert band_spec(m[None]) == want, want
    assert band_spec(np.stack([d <= 0, d <= 1])) is None                     # differs per head
    assert band_spec(np.ones((1, 4, 6), bool)) is None                        # not square


def test_cli_run_past_the_compiled_length(tmp_path, capsys):
    """A model whose layouts grow has no stof.max_seq_len: `stof run --provider cpu` (the ONNX functions) runs it
    past its compiled length, where the model itself runs."""
    pytest.importorskip("onnxruntime")
    import onnx
    from models_util import family

    from stof_trt.cli import main
    from stof_trt.cli.common import check_seq_limit

    new, _ = rewrite_model(family("llama")[0], max_seq_len=40, **TILE)
    check_seq_limit(new, {"input_ids": (1, 300), "attention_mask": (1, 300)})
    path = tmp_path / "llama.stof.onnx"
    onnx.save(new, path)
    assert main(["run", str(path), "--provider", "cpu", "--shapes", "input_ids=1x41,attention_mask=1x41"]) == 0
    assert main(["run", str(path), "--provider", "cpu", "--shapes", "input_ids=2x130,attention_mask=2x130"]) == 0


def _grown(model, seq: int):
    """``model`` with every StofSparseAttention node's layout rebuilt from its layout_spec at ``seq`` (what the
    plugin does past the compiled length), for the ONNX function fallback to run on the CPU."""
    import onnx
    from onnx import numpy_helper

    from stof_trt.format import compile_mask

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, n in enumerate(out.graph.node):
        if n.op_type != "StofSparseAttention":
            continue
        a = {x.name: x for x in n.attribute}
        spec = a["layout_spec"].s.decode()
        lay = compile_mask(spec, seq, seq, tile_m=a["tile_m"].i, tile_n=a["tile_n"].i, num_heads=a["num_layouts"].i)
        for j, (name, arr) in enumerate(lay.arrays().items()):
            t = numpy_helper.from_array(arr, f"grown{i}_{name}")
            out.graph.initializer.append(t)
            n.input[3 + j] = t.name
        a["seq_q"].i = a["seq_k"].i = seq
    return out


@pytest.mark.parametrize("name, mask", [("llama", None), ("mistral", None), ("modernbert", None),
                                        ("llama", "longformer:window=6,global=2"), ("t5_encoder", None)])
def test_layout_spec_holds_past_the_compiled_length(name, mask):
    """The semantics the plugin relies on, checked on the CPU: layouts rebuilt from the nodes' layout_spec at
    lengths past the compiled 48 (not tile multiples) give the original model's outputs at every real token (the
    window of Mistral and ModernBERT's local layers, the causal pattern, a user spec ∧ causal; a user spec changes
    the model, so there the reference is the same rewrite compiled at the longer length)."""
    from models_util import family

    model, _ = family(name)
    new, _ = rewrite_model(model, mask=mask, max_seq_len=48, **TILE)
    rng = np.random.default_rng(5)
    for seq in (49, 101):
        ref_model = model if mask is None else rewrite_model(model, mask=mask, max_seq_len=seq, **TILE)[0]
        feeds = token_feeds(rng, 2, seq, mask=padding_mask(rng, 2, seq, min_len=seq // 2))
        feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)
        keep = feeds["attention_mask"].astype(bool)
        ref, got = run(session(ref_model), feeds)[0], run(session(_grown(new, seq)), feeds)[0]
        err = np.abs(got - ref)[keep].max() / max(1.0, np.abs(ref[keep]).max())
        assert err < 1e-4, (name, seq, err)


def test_layout_at_is_what_the_plugin_builds():
    """AttentionNode.layout_at (what `stof tune` and the pre-search entries time and key past the compiled length):
    the compiled layout up to its size, else the layout_spec compiled at grown_length, the plugin's length bucket
    (s <= bucket < 1.25 s + 1; 2100 -> 2560 and 2600 -> 3072 as tests/gpu/test_ort_any_length.py sees the plugin
    build them)."""
    from models_util import family

    from stof_trt.format import compile_mask
    from stof_trt.nodes import attention_nodes, grown_length

    for s in list(range(1, 300)) + [2048, 2049, 4095, 4096, 4097, 10**6, 2**31 - 1]:
        g = grown_length(s)
        assert s <= g <= 2**31 - 1 and (g < 1.25 * s + 1 or g == s)
    assert [grown_length(s) for s in (2100, 2560, 2600, 4096, 4097)] == [2560, 2560, 3072, 4096, 5120]
    new, _ = rewrite_model(family("llama")[0], max_seq_len=40, **TILE)
    nd = attention_nodes(new)[0]
    assert nd.layout_spec == "causal" and nd.layout_at(40, 40) is nd.layout and nd.layout_at(7, 7) is nd.layout
    lay = nd.layout_at(41, 41)
    assert (lay.seq_q, lay.seq_k) == (grown_length(41), grown_length(41)) == (48, 48)
    assert lay.signature() == compile_mask("causal", 48, 48, tile_m=16, tile_n=32).signature()


def test_presearch_entries_past_the_compiled_length():
    """The pre-search's cache entries for a length past the compiled one are keyed on the grown layout (the one
    the plugin selects a tactic for); up to it, on the node's layout."""
    from onnx import TensorProto, helper, numpy_helper

    from stof_trt import presearch
    from stof_trt.format import STOF_FORMAT_VERSION, compile_mask
    from stof_trt.nodes import attention_nodes
    from stof_trt.selection import add_presearch_entries
    from stof_trt.tactic_cache import TacticCache

    try:
        presearch.native_library()
    except RuntimeError as e:
        pytest.skip(str(e))
    lay = compile_mask("sliding:window=64", 512, 512)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in lay.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["q", "k", "v", "row_ptr", "col_idx", "tile_bitmap_index",
                                                    "bitmaps"], ["o"], domain="stof", name="a0", scale=0.125,
                            tile_m=64, tile_n=64, seq_q=512, seq_k=512, num_layouts=1,
                            format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec,
                            layout_spec="sliding:window=64")
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["B", 12, "S", 64]) for n in "qkv"]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    cache = TacticCache()
    assert add_presearch_entries(cache, m, [(1, 256), (1, 3000)], "GPU", "9.0") == 2
    (nd,) = attention_nodes(m)
    grown = nd.layout_at(3000, 3000)
    assert grown.seq_q == 3072 and grown.signature() == compile_mask("sliding:window=64", 3072).signature()
    assert {k.mask for k in cache.entries} == {lay.signature(), grown.signature()}
