"""Fusion schemes: enumeration, cost model, the cache's scheme section, the tune report from fake timings and the
rewrite honouring measured schemes (CPU; the ONNX functions run the STOF nodes)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from models_util import TILE, assert_parity, exported, op_counts, session, token_feeds
from stof_trt import schemes as S
from stof_trt.errors import StofError
from stof_trt.presearch import H100_SXM
from stof_trt.rewrite import rewrite_model
from stof_trt.rewrite.schemes import find_chains
from stof_trt.scheme_tune import block_rows, one_block_model, tune_schemes
from stof_trt.tactic_cache import SchemeKey, TacticCache

T = 8 * 512  # BERT-base at B = 8, S = 512
BERT_BASE = {
    "attn_out": S.ChainShape("residual_ln", T, 768, 768),
    "ffn1": S.ChainShape("bias_gelu", T, 3072, 768, activation="gelu_erf"),
    "ffn2": S.ChainShape("residual_ln", T, 768, 3072),
}


# -- enumeration --------------------------------------------------------------------------------------------------
def test_templates_per_chain_kind_and_opset():
    assert [t.name for t in S.templates_for("residual_ln", 17)] == \
        ["gemm_bias+add_ln", "matmul+bias_add_ln", "gemm+bias_add_ln", "unfused"]
    assert "unfused" not in [t.name for t in S.templates_for("residual_ln", 15)]  # no LayerNormalization op
    assert [t.name for t in S.templates_for("bias_gelu", 15)] == ["gemm_bias_gelu", "gemm_bias+gelu", "unfused"]
    for kind in S.CHAIN_KINDS:
        assert sum(t.fixed_rule for t in S.TEMPLATES[kind]) == 1
        assert S.default_scheme(kind).name == S.TEMPLATES[kind][0].name
        for t in S.TEMPLATES[kind]:
            assert t.tunable == (t.name.startswith("gemm")), t.name     # a StofGemmEpilogue node takes `algo`
    with pytest.raises(ValueError, match="chain kind"):
        S.ChainShape("softmax", 1, 1, 1)
    with pytest.raises(ValueError, match="activation"):
        S.ChainShape("bias_gelu", 8, 8, 8)
    with pytest.raises(ValueError, match="positive"):
        S.ChainShape("residual_ln", 0, 8, 8)


def test_kernels_bytes_and_launches():
    s = BERT_BASE["attn_out"]
    costs = {c.name: c for c in S.rank(s)}
    assert {n: c.launches for n, c in costs.items()} == \
        {"matmul+bias_add_ln": 2, "gemm+bias_add_ln": 2, "gemm_bias+add_ln": 2, "unfused": 4}
    mn = T * 768 * 2
    # the unfused chain writes and re-reads the GEMM output and the biased sum once more each
    assert costs["unfused"].bytes - costs["matmul+bias_add_ln"].bytes == pytest.approx(4 * mn, rel=1e-3)
    g = {c.name: c for c in S.rank(dataclasses.replace(BERT_BASE["ffn1"], activation="gelu_tanh"))}
    assert g["gemm_bias_gelu"].launches == 1 and g["gemm_bias+gelu"].launches == 2


# -- ranking --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", sorted(BERT_BASE))
@pytest.mark.parametrize("tokens", [128, 8 * 128, T, 32 * 512])
def test_fixed_rule_is_the_model_first_choice_for_bert_base(role, tokens):
    s = BERT_BASE[role].with_tokens(tokens)
    ranked = S.rank(s)
    assert ranked[0].template.fixed_rule
    assert ranked[-1].name == "unfused"
    assert ranked[0].time_s < ranked[-1].time_s


def test_tanh_gelu_in_the_epilogue_beats_a_separate_pass():
    s = dataclasses.replace(BERT_BASE["ffn1"], activation="gelu_tanh")
    c = {x.name: x.time_s for x in S.rank(s)}
    assert c["gemm_bias_gelu"] < c["gemm_bias+gelu"] < c["unfused"]


def test_cost_monotone_in_tokens_k_and_bandwidth():
    m = S.CostModel()
    for s in BERT_BASE.values():
        for tpl in S.templates_for(s.kind):
            times = [m.cost(tpl, s.with_tokens(t)).time_s for t in (64, 512, 4096, 32768)]
            assert times == sorted(times) and times[0] < times[-1]
            wider = dataclasses.replace(s, k=s.k * 2)
            assert m.cost(tpl, wider).time_s > m.cost(tpl, s).time_s
            slow = S.CostModel(dataclasses.replace(H100_SXM, dram_bw=H100_SXM.dram_bw / 4))
            assert slow.cost(tpl, s).time_s > m.cost(tpl, s).time_s
            assert S.CostModel(launch_s=10e-6).cost(tpl, s).time_s > m.cost(tpl, s).time_s


def test_gemm_rate_wave_quantisation():
    m = S.CostModel()
    sm = H100_SXM.sm_count
    full = m.gemm_rate(m.tile_m * sm, m.tile_n, 4096)
    one_more = m.gemm_rate(m.tile_m * (sm + 1), m.tile_n, 4096)   # a second wave with one tile
    assert one_more < 0.6 * full
    assert m.gemm_rate(128, 128, 64) < m.gemm_rate(128, 128, 4096)


def test_shortlist_keeps_the_fixed_rule():
    s = BERT_BASE["ffn2"]
    short = S.shortlist(s, k=1)
    assert [c.name for c in short] == ["gemm_bias+add_ln"]
    # a model under which the separate bias pass is best still times the fixed rule
    odd = S.shortlist(s, S.CostModel(launch_s=0.0), k=1)
    assert any(c.template.fixed_rule for c in odd)


# -- the cache's scheme section -----------------------------------------------------------------------------------
def _skey(chain="residual_ln|float16|N768|K768|sum0", bucket="T4096", gpu="NVIDIA H200"):
    return SchemeKey(gpu, "9.0", chain, bucket)


def test_scheme_cache_round_trip_and_old_caches(tmp_path):
    old = {"format": "stof-tactic-cache", "version": 1, "entries": [
        {"gpu": "G", "cc": "9.0", "node": "n", "bucket": "b", "mask": "m", "tactic": 3}]}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    c = TacticCache.load(p)                       # a cache without the section: no schemes
    assert len(c) == 1 and c.schemes == {}
    c.save(tmp_path / "same.json")
    assert json.loads((tmp_path / "same.json").read_text()) == old   # written back unchanged

    c.put_scheme(_skey(), "gemm_bias+add_ln", 2, time_ms=0.01, source="measured")
    c.put_scheme(_skey(bucket="T1024"), "gemm+bias_add_ln", -1)
    c.save(p)
    doc = json.loads(p.read_text())
    assert doc["version"] == 1 and doc["schemes"]["version"] == 1 and len(doc["schemes"]["entries"]) == 2
    back = TacticCache.load(p)
    assert back.get_scheme(_skey()) == {"scheme": "gemm_bias+add_ln", "algo": 2, "time_ms": 0.01,
                                        "source": "measured"}
    assert back.entries == c.entries
    # merge_save keeps both writers' schemes
    other = TacticCache()
    other.put_scheme(_skey("bias_gelu|float16|N3072|K768|gelu_erf"), "gemm_bias_gelu", 1)
    other.merge_save(p)
    assert len(TacticCache.load(p).schemes) == 3 and len(TacticCache.load(p)) == 1
    # choices: the largest bucket by default, the requested bucket with tokens
    assert back.scheme_choices() == {"residual_ln|float16|N768|K768|sum0": ("gemm_bias+add_ln", 2)}
    assert back.scheme_choices(tokens=1000) == {"residual_ln|float16|N768|K768|sum0": ("gemm+bias_add_ln", -1)}
    back.put_scheme(_skey(gpu="NVIDIA H100"), "unfused")
    with pytest.raises(StofError, match="several GPUs"):
        back.scheme_choices()
    assert back.scheme_choices("NVIDIA H100") == {"residual_ln|float16|N768|K768|sum0": ("unfused", -1)}
    with pytest.raises(StofError, match="no fusion-scheme entries for GPU 'A100'"):
        back.scheme_choices("A100")


@pytest.mark.parametrize("section,match", [
    ({"version": 2, "entries": []}, "version 2"),
    ({"version": 1, "entries": [{"gpu": "g", "cc": "9.0", "chain": "residual_ln|x", "scheme": "unfused"}]},
     "lacks one of"),
    ({"version": 1, "entries": [{"gpu": "g", "cc": "9.0", "chain": "residual_ln|x", "bucket": "T64",
                                 "scheme": "gemm_bias_gelu"}]}, "unknown scheme"),
    ({"version": 1, "entries": [{"gpu": "g", "cc": "9.0", "chain": "residual_ln|x", "bucket": "T64",
                                 "scheme": "unfused", "algo": -2}]}, "bad algo"),
])
def test_bad_scheme_sections_are_user_errors(tmp_path, section, match):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"format": "stof-tactic-cache", "version": 1, "entries": [], "schemes": section}))
    with pytest.raises(StofError, match=match):
        TacticCache.load(p)


# -- graph side ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert():
    model = exported("bert")
    new, _ = rewrite_model(model, max_seq_len=32, **TILE)
    return model, new


def test_find_chains_roles_and_blocks(bert):
    _, new = bert
    sites = find_chains(gs.import_onnx(new))
    assert [(s.block, s.role, s.kind, s.scheme) for s in sites] == [
        (b, r, k, sc) for b in (0, 1) for r, k, sc in (("attn_out", "residual_ln", "gemm_bias+add_ln"),
                                                       ("ffn1", "bias_gelu", "gemm_bias_gelu"),
                                                       ("ffn2", "residual_ln", "gemm_bias+add_ln"))]
    assert sites[2].k == sites[1].n and sites[0].signature() == "residual_ln|float|N32|K32|sum0"


def test_default_rewrite_is_the_fixed_rules(bert):
    model, new = bert
    again, report = rewrite_model(model, max_seq_len=32, scheme_tokens=4096, **TILE)
    assert again.SerializeToString() == new.SerializeToString()
    # the epilogue fusions leave MatMul -> StofAddLayerNorm(bias); the fixed rule moves the bias into the GEMM,
    # without a note (notes name schemes other than the fixed rules')
    assert not any("fusion schemes" in n for n in report.notes)
    assert all(a.i == -1 for n in new.graph.node for a in n.attribute if a.name == "algo")
    ops = [n.op_type for n in new.graph.node]
    assert "MatMul" not in ops and ops.count("StofGemmEpilogue") == 8   # QKV, attn_out, FFN1, FFN2 per block


@pytest.mark.parametrize("ln_scheme", ["gemm+bias_add_ln", "gemm_bias+add_ln", "unfused"])
@pytest.mark.parametrize("gelu_scheme", ["gemm_bias+gelu", "unfused"])
def test_rewrite_honours_cached_schemes_and_matches_the_original(bert, tmp_path, ln_scheme, gelu_scheme):
    model, new = bert
    cache = TacticCache()
    for s in find_chains(gs.import_onnx(new)):
        cache.put_scheme(SchemeKey("G", "9.0", s.signature(), "T64"),
                         ln_scheme if s.kind == "residual_ln" else gelu_scheme, 3)
    cache.save(tmp_path / "c.json")
    choices = TacticCache.load(tmp_path / "c.json").scheme_choices()
    out, report = rewrite_model(model, max_seq_len=32, schemes=choices, **TILE)
    onnx.checker.check_model(out)
    after = find_chains(gs.import_onnx(out))
    assert [s.scheme for s in after if s.kind == "residual_ln"] == \
        ([ln_scheme] * 4 if ln_scheme != "unfused" else [])         # an unfused chain is plain ONNX again
    gemms = [n for n in out.graph.node if n.op_type == "StofGemmEpilogue"]
    tuned = [n for n in gemms if any(a.name == "algo" and a.i == 3 for a in n.attribute)]
    assert len(tuned) == (4 if ln_scheme != "unfused" else 0) + (2 if gelu_scheme == "gemm_bias+gelu" else 0)
    assert op_counts(out)["LayerNormalization"] == 1 + (4 if ln_scheme == "unfused" else 0)
    assert any("fusion schemes, measured" in n for n in report.notes)
    rng = np.random.default_rng(3)
    assert_parity(model, out, token_feeds(rng, 2, 32))


def test_a_cache_without_the_models_chains_is_not_called_measured(bert):
    """Schemes measured for other chains (another width or dtype): the model's chains take the cost model's choice
    and the notes say so, never 'measured'."""
    model, _ = bert
    out, report = rewrite_model(model, max_seq_len=32, schemes={"residual_ln:float16:n4096:k4096": ("unfused", -1)},
                                **TILE)
    assert not any("measured" in n for n in report.notes), report.notes
    assert any("has none of this model's" in n for n in report.notes), report.notes


@pytest.mark.parametrize("shape", [
    S.ChainShape("residual_ln", 24, 16, 8, "float"), S.ChainShape("residual_ln", 24, 16, 8, "float", sum_output=True),
    S.ChainShape("bias_gelu", 24, 16, 8, "float", "gelu_erf"),
    S.ChainShape("bias_gelu", 24, 16, 8, "float", "gelu_tanh")])
def test_one_block_models_compute_the_same_for_every_scheme(shape):
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal((24, 8)).astype(np.float32)}
    if shape.kind == "residual_ln":
        feeds["residual"] = rng.standard_normal((24, 16)).astype(np.float32)
    outs = {}
    for t in S.templates_for(shape.kind, 17):
        m = one_block_model(shape, t.name, 1, copies=2)
        onnx.checker.check_model(m)
        outs[t.name] = session(m).run(None, feeds)
        assert len(outs[t.name]) == 2 * (2 if shape.sum_output else 1)
    ref = outs[S.default_scheme(shape.kind).name]
    assert np.abs(ref[0]).max() > 0.1 and not np.allclose(ref[0], ref[1])   # copies have their own weights
    for name, o in outs.items():
        for a, b in zip(o, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


# -- tune report from fake timings --------------------------------------------------------------------------------
def test_tune_report_from_fake_timings(bert):
    _, new = bert
    cache = TacticCache()
    seen = []

    def fake(shape, cands):
        seen.append((shape, list(cands)))
        # the last candidate is fastest: never the model's first (listed first)
        return {c: 2.0 - 0.1 * i for i, c in enumerate(cands)}

    feeds = [token_feeds(np.random.default_rng(0), 2, 32), token_feeds(np.random.default_rng(1), 4, 32)]
    res = tune_schemes(new, feeds, cache, gpu=("Fake GPU", "9.0"), cpu_probe=True, timer=fake, algos=2)
    # three signatures (attn_out, ffn1, ffn2 differ) x two token buckets
    assert len(res) == 6 and len(cache.schemes) == 6
    assert {s.tokens for s, _ in seen} == {64, 128}
    for shape, cands in seen:
        assert cands[0][0] == S.rank(shape)[0].name
        assert all(a in (0, 1) for n, a in cands if S.template(shape.kind, n).tunable)
    rows = block_rows(res)
    assert len(rows) == 12                                  # 2 blocks x 3 chains x 2 buckets
    again = tune_schemes(new, feeds + [token_feeds(np.random.default_rng(2), 2, 32)], TacticCache(),
                         gpu=("Fake GPU", "9.0"), cpu_probe=True, timer=fake, algos=2)
    assert len(block_rows(again)) == 12                     # a third shape set in the T64 bucket adds no rows
    assert [(r["block"], r["role"]) for r in rows if r["bucket"] == "T64"] == \
        [(b, r) for b in (0, 1) for r in ("attn_out", "ffn1", "ffn2")]
    for r in rows:
        assert set(r) >= {"block", "role", "chain", "bucket", "nodes", "scheme", "algo", "time_ms", "model_first",
                          "model_first_ms", "ratio", "fixed_rule", "fixed_rule_ms", "gain"}
        assert r["ratio"] == pytest.approx(r["model_first_ms"] / r["time_ms"]) and r["ratio"] > 1
        assert r["fixed_rule"] == r["model_first"] and r["gain"] == pytest.approx(r["ratio"])
        assert r["algo"] in (-1, 0, 1) and r["model_first_algo"] in (-1, 0)   # as the node's attribute
    from stof_trt.cli.tune import _scheme_info

    info = json.loads(json.dumps(_scheme_info(res)))
    assert info["model_within_5pct"] == 0.0 and len(info["blocks"]) == 12
    assert info["chain_ms_fixed_rules"] > info["chain_ms_measured"] > 0
    e = next(iter(cache.schemes.values()))
    assert e["source"] == "measured" and e["ratio"] > 1 and len(e["candidates"]) >= 2
    # the measured choices drive the next rewrite
    model = exported("bert")
    out, _ = rewrite_model(model, max_seq_len=32, schemes=cache.scheme_choices(tokens=64), **TILE)
    assert_parity(model, out, token_feeds(np.random.default_rng(2), 2, 32))


def test_model_only_tune_records_the_first_choice(bert):
    _, new = bert
    cache = TacticCache()
    res = tune_schemes(new, [token_feeds(np.random.default_rng(0), 2, 32)], cache, gpu=("G", "8.0"),
                       props=H100_SXM, measure=False, cpu_probe=True)
    assert all(r.times == {} and r.best == r.model_first for r in res)
    assert {e["source"] for e in cache.schemes.values()} == {"model"}
    assert {e["scheme"] for e in cache.schemes.values()} == {"gemm_bias+add_ln", "gemm_bias_gelu"}
    assert all(r["ratio"] is None and r["time_ms"] is None for r in block_rows(res))


def test_cli_rewrite_with_schemes(bert, tmp_path):
    from stof_trt.cli import main

    model, new = bert
    src = tmp_path / "bert.onnx"
    onnx.save(model, src)
    cache = TacticCache()
    for s in find_chains(gs.import_onnx(new)):
        if s.kind == "residual_ln":
            cache.put_scheme(SchemeKey("G", "9.0", s.signature(), "T4096"), "gemm_bias+add_ln", 1)
    cache.save(tmp_path / "c.json")
    assert main(["rewrite", str(src), "-o", str(tmp_path / "o.onnx"), "--max-seq-len", "32", "--tile", "16", "32",
                 "--schemes", str(tmp_path / "c.json")]) == 0
    out = onnx.load(tmp_path / "o.onnx")
    assert [s.scheme for s in find_chains(gs.import_onnx(out)) if s.kind == "residual_ln"] == \
        ["gemm_bias+add_ln"] * 4
    assert main(["rewrite", str(src), "-o", str(tmp_path / "p.onnx"), "--schemes-gpu", "G"]) == 2
    assert main(["rewrite", str(src), "-o", str(tmp_path / "p.onnx"), "--schemes", str(tmp_path / "c.json"),
                 "--schemes-gpu", "H"]) == 2


def test_library_reader_and_writer_keep_the_scheme_section(kernels, tmp_path):
    """The plugin's C++ cache reader ignores the section and its writer (first-use timing) keeps it."""
    p = tmp_path / "c.json"
    c = TacticCache()
    c.put_scheme(_skey(), "gemm_bias+add_ln", 2, source="measured")
    c.save(p)
    assert kernels.load_tactic_cache(p) == 0
    kernels.store_tactic(p, "NVIDIA H200", "9.0", "StofSparseAttention|float16|H12|D64|tile64x64|L1|seq512x512|kpm1",
                         "B8|Sq512|Sk512", "0" * 40, 1, 0.5)
    back = TacticCache.load(p)
    assert len(back) == 1 and back.schemes == c.schemes
    assert kernels.load_tactic_cache(p) == 1


def test_cli_tune_presearch_only_for_a_named_gpu_reports_schemes(bert, tmp_path, capsys):
    """No GPU: the chains' token counts come from a CPU run and the cost model's first choices are recorded."""
    from stof_trt import presearch
    from stof_trt.cli import main

    try:
        presearch.native_library()
    except RuntimeError:
        pytest.skip("no libstof_host / libstof_kernels")
    _, new = bert
    onnx.save(new, tmp_path / "m.stof.onnx")
    out = tmp_path / "c.json"
    assert main(["tune", str(tmp_path / "m.stof.onnx"), "--shapes", "input_ids=4x32,attention_mask=4x32",
                 "--presearch-only", "--gpu", "NVIDIA H200", "--schemes-only", "-o", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rows = info["schemes"]["blocks"]
    assert [(r["block"], r["role"], r["scheme"], r["tokens"]) for r in rows] == [
        (b, role, sch, 128) for b in (0, 1) for role, sch in (("attn_out", "gemm_bias+add_ln"),
                                                              ("ffn1", "gemm_bias_gelu"),
                                                              ("ffn2", "gemm_bias+add_ln"))]
    assert info["problems"] == [] and info["schemes"]["model_within_5pct"] is None
    doc = json.loads(out.read_text())
    assert doc["entries"] == [] and {e["gpu"] for e in doc["schemes"]["entries"]} == {"NVIDIA H200"}
    assert main(["tune", str(tmp_path / "m.stof.onnx"), "--shapes", "input_ids=4x32,attention_mask=4x32",
                 "--no-schemes", "--schemes-only", "-o", str(out)]) == 2


def test_report_with_untimed_chains():
    """Rows without times (a bf16 chain next to timed ones) leave the sums to the timed chains."""
    from stof_trt.cli.tune import _scheme_info
    from stof_trt.scheme_tune import SchemeResult

    shape = BERT_BASE["ffn1"]
    first = ("gemm_bias_gelu", 0)
    timed = SchemeResult(SchemeKey("G", "9.0", shape.signature(), "T4096"), shape, [(0, "ffn1", ["a"])], {}, first,
                         {first: 0.05, ("gemm_bias_gelu", 1): 0.04}, ("gemm_bias_gelu", 1))
    bf16 = dataclasses.replace(shape, dtype="bfloat16")
    untimed = SchemeResult(SchemeKey("G", "9.0", bf16.signature(), "T4096"), bf16, [(1, "ffn1", ["b"])], {}, first,
                           best=first)
    info = _scheme_info([timed, untimed])
    assert info["chain_ms_measured"] == pytest.approx(0.04) and info["chain_ms_fixed_rules"] == pytest.approx(0.05)
    assert info["model_within_5pct"] == 0.0
    assert [r["gain"] for r in info["blocks"]] == [pytest.approx(1.25), None]


@pytest.mark.parametrize("ln_scheme,gelu_scheme", [("gemm+bias_add_ln", "gemm_bias+gelu"), ("unfused", "unfused")])
def test_cached_schemes_keep_an_fp16_model_fp16(ln_scheme, gelu_scheme):
    """A rebuilt chain's new tensors take the weights' element type (the rewritten graph's often carry none)."""
    model = exported("bert", half=True)
    new, _ = rewrite_model(model, max_seq_len=32, **TILE)
    cache = TacticCache()
    for s in find_chains(gs.import_onnx(new)):
        assert s.dtype == "float16"
        cache.put_scheme(SchemeKey("G", "9.0", s.signature(), "T64"),
                         ln_scheme if s.kind == "residual_ln" else gelu_scheme, 1)
    out, _ = rewrite_model(model, max_seq_len=32, schemes=cache.scheme_choices(), **TILE)
    onnx.checker.check_model(out, full_check=True)
