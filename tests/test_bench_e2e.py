"""The end-to-end benchmark's CPU parts: grid and filters, padding draws, skeleton refill of derived models, the
results' keys and the target lines; and the whole flow on tiny models on the CPU EP."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.bench import e2e

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_covers_the_issue_and_filters():
    cases = e2e.grid()
    text = [c for c in cases if c["model"] != "vit-base"]
    vit = [c for c in cases if c["model"] == "vit-base"]
    assert len(text) == 4 * 3 * 3 * 3 and len(vit) == 9
    assert {c["padding"] for c in vit} == {"none"}
    assert sorted({c["S"] for c in vit}) == [122, 257, 530]
    assert {c["key"] for c in vit} == {"vit-base@176", "vit-base@256", "vit-base@368"}
    assert {(c["model"], c["mask"]) for c in text} >= {("gpt2", "causal"), ("bert-large", "padding")}
    few = e2e.grid(["bert-base", "vit-base"], [8], [512], ["U[0.25S,S]"])
    assert [(c["model"], c["B"], c["S"], c["padding"]) for c in few] == [("bert-base", 8, 512, "U[0.25S,S]")]
    for bad in (dict(models=["t5"]), dict(paddings=["U[0.5S,S]"]), dict(seqs=[1024])):
        with pytest.raises(ValueError):
            e2e.grid(**bad)


def test_script_filters_parse():
    mod = _script()
    a = mod.parse_args(["--models", "bert-base,gpt2", "--batches", "1,32", "--seqs", "256",
                        "--paddings", "U[0.75S,S],none", "--variants", "original,stof"])
    assert a.paddings == ["U[0.75S,S]", "none"] and a.batches == [1, 32] and a.seqs == [256]
    assert {(c["model"], c["B"], c["padding"]) for c in a.cases} == {
        (m, b, p) for m in ("bert-base", "gpt2") for b in (1, 32) for p in ("U[0.75S,S]", "none")}
    assert len(mod.parse_args([]).cases) == len(e2e.grid())
    for bad in (["--variants", "ortfast"], ["--models", "t5"], ["--paddings", "U[0.5S,S]"]):
        with pytest.raises(SystemExit) as ex:
            mod.parse_args(bad)
        assert ex.value.code == 2


@pytest.mark.parametrize("low", [0.25, 0.75])
def test_padding_draws(low):
    S, B = 512, 32
    a = e2e.draw_lengths(B, S, low, seed=7)
    assert a[0] == S and a.min() >= int(np.ceil(low * S)) and a.max() <= S
    assert len(set(a.tolist())) > 5  # drawn, not constant
    assert np.array_equal(a, e2e.draw_lengths(B, S, low, seed=7))
    assert not np.array_equal(a, e2e.draw_lengths(B, S, low, seed=8))
    assert np.array_equal(e2e.draw_lengths(B, S, None, seed=7), np.full(B, S))


def test_case_feeds_mask_matches_lengths_and_is_seeded():
    c = e2e.grid(["bert-base"], [8], [256], ["U[0.25S,S]"])[0]
    f, lengths = e2e.case_feeds(c)
    assert f["attention_mask"].shape == (8, 256) and lengths[0] == 256
    assert np.array_equal(f["attention_mask"].sum(1), lengths)
    assert f["input_ids"].min() >= 2
    f2, _ = e2e.case_feeds(c)
    assert all(np.array_equal(f[k], f2[k]) for k in f)
    v = e2e.grid(["vit-base"], [2], [256], ["none"])[0]
    fv, lv = e2e.case_feeds(v)
    assert fv["pixel_values"].shape == (2, 3, 256, 256) and (lv == 257).all()


def test_real_token_diff_ignores_padding():
    ref = np.zeros((2, 4, 3), np.float16)
    got = ref.copy()
    got[1, 3] = 5  # a padded row of sequence 1 (length 3)
    assert e2e.real_token_max_diff(ref, got, [4, 3]) == 0
    got[1, 2, 0] = 0.5
    assert e2e.real_token_max_diff(ref, got, [4, 3]) == 0.5


def test_fp16_cast_matches_onnxruntime():
    from onnxruntime.transformers.float16 import convert_np_to_float16

    rng = np.random.default_rng(0)
    a = (rng.standard_normal(20000) * 1e-3).astype(np.float32)
    a[:6] = [1e-9, -3e-8, 7e4, -1e6, 0, np.float32(5.96e-8)]
    assert np.array_equal(e2e._to_fp16(a).view(np.uint16), convert_np_to_float16(a).view(np.uint16))


def _base_model(rng):
    w = {n: rng.standard_normal((16, 16)).astype(np.float32) for n in ("wq", "wk", "wv")}
    w["small"] = rng.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", n], [n + "_o"]) for n in ("wq", "wk", "wv")]
    nodes.append(helper.make_node("Sum", ["wq_o", "wk_o", "wv_o"], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(g)


def test_skeleton_refill_rebuilds_derived_weights():
    base = _base_model(np.random.default_rng(0))
    skel, n = e2e.make_skeleton(base, keep=8)
    assert n == 3 and len(skel.SerializeToString()) < 2000
    refilled, arrays = e2e.refill_base(skel)
    _, again = e2e.refill_base(skel)
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays)  # seeded
    # a derived model: packed Q/K/V (concatenation), a transposed copy in fp16, a small tensor, one foreign tensor
    packed = np.concatenate([arrays["wq"], arrays["wk"], arrays["wv"]], axis=1)
    derived_inits = {"qkv": e2e._to_fp16(packed), "wkT": e2e._to_fp16(arrays["wk"].T), "small2": arrays["small"] * 2,
                     "foreign": np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)}
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "d",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          [numpy_helper.from_array(v, k) for k, v in derived_inits.items()])
    derived = helper.make_model(g)
    dskel, info = e2e.derive_skeleton(derived, arrays, keep=8)
    assert info["unmatched"] == ["foreign"] and info["stripped"] == 3
    recipes = json.loads({p.key: p.value for p in dskel.metadata_props}[e2e.DERIVED_META])
    assert recipes["qkv"]["parts"] == [["wq", False], ["wk", False], ["wv", False]] and recipes["qkv"]["axis"] == 1
    assert recipes["wkT"]["parts"] == [["wk", True]] and recipes["wkT"]["cast"] == "f16ort"
    filled = {t.name: numpy_helper.to_array(t) for t in e2e.fill_derived(dskel, arrays).graph.initializer}
    for k in ("qkv", "wkT", "small2"):
        assert filled[k].dtype == derived_inits[k].dtype and np.array_equal(filled[k], derived_inits[k]), k
    f = filled["foreign"]
    assert f.shape == (8, 8) and not np.array_equal(f, derived_inits["foreign"])
    with pytest.raises(ValueError):
        e2e.fill_derived(skel, arrays)  # a base skeleton is not a derived one


def test_canonicalize_keeps_the_function():
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(0.125, np.float32))),
             helper.make_node("Mul", ["s", "c"], ["sc"]),
             helper.make_node("Softmax", ["sc"], ["p"], axis=-1),
             helper.make_node("Cast", ["p"], ["p1"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["p1"], ["p2"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["p2", "v"], ["o"])]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in "qkv"]
    m = helper.make_model(helper.make_graph(nodes, "a", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                                                            [4, 4])]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # ORT 1.31 reads IR <= 13
    c, changes = e2e.canonicalize_for_ort(m)
    assert changes == {"identity_casts_bypassed": 2, "scale_mul_to_div": 1}
    assert [n.op_type for n in c.graph.node if n.op_type != "Constant"] == ["MatMul", "Div", "Softmax", "MatMul"]
    feeds = {n: rng.standard_normal((4, 4)).astype(np.float32) for n in "qkv"}
    def run(mm):
        return ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    np.testing.assert_allclose(run(c), run(m), rtol=1e-6, atol=1e-6)


def _rec(model, padding, B, variants, fused=True, S=512):
    fo = {"Attention": 12} if fused else {"FastGelu": 12}
    return e2e.case_record(
        dict(model=model, mask="padding", B=B, S=S, padding=padding),
        {k: {"median_ms": v, "p90_ms": v * 1.1} for k, v in variants.items()},
        {k: fo if k != "ortpacking" else {"PackedAttention": 12} for k in variants if k.startswith("ort")},
        {k: 0.01 for k in variants if k.startswith("stof")})


def test_record_keys_and_target_lines():
    recs = [
        _rec("bert-base", "U[0.25S,S]", 8, {"original": 5, "ortopt": 2.6, "ortopt-graph": 2.4, "ortpacking": 2.2,
                                            "stof": 1.8, "stof-graph": 1.6}),  # 2.2/1.6 = 1.375, packing 1.375
        _rec("bert-base", "U[0.25S,S]", 32, {"ortopt": 6.0, "ortpacking": 5.0, "stof": 4.5}),  # 1.11, 1.11
        _rec("gpt2", "U[0.25S,S]", 8, {"ortopt": 9.0, "stof": 1.0}, fused=False),  # unfused: out of targets
        _rec("vit-base", "none", 8, {"ortopt": 2.0, "stof": 2.0}, S=257),  # 1.0
    ]
    assert all(tuple(r) == e2e.CASE_KEYS for r in recs)
    assert json.loads(json.dumps(recs)) == recs
    t = {(x["padding"], x["baseline"]): x for x in e2e.targets(recs)}
    fast = t[("U[0.25S,S]", "fastest ORT")]
    assert (fast["cells"], fast["at_target"], fast["at_floor"]) == (2, 1, 1)
    assert fast["worst"].startswith("bert-base B=32") and abs(fast["geomean"] - (1.375 * 5.0 / 4.5) ** 0.5) < 1e-9
    pack = t[("U[0.25S,S]", "ortpacking")]
    assert (pack["cells"], pack["at_target"], pack["at_floor"]) == (2, 2, 2)
    none = t[("none", "fastest ORT")]
    assert (none["cells"], none["at_target"], none["at_floor"]) == (1, 0, 1)
    lines = e2e.target_lines(recs)
    assert "BELOW FLOOR" in lines[0] and "-> met" in lines[1] and "below target, above floor" in lines[2]
    md = e2e.report_md(recs, {"models": {}}, "cmd")
    assert "9.000 (9.900)*" in md and "1.38x (ortpacking)" in md
    # a run without the `stof` variant (--variants ortopt-graph,stof-graph) records no stof meta for the model
    sub = e2e.report_md(recs, {"models": {"bert-base": {"stof": None, "fused_ops": {}}}}, "cmd")
    assert "| bert-base | ? |  |  | ? |" in sub
    summ = e2e.summary(recs)
    assert summ[("bert-base", "U[0.25S,S]")]["cells"] == 2
    assert summ[("bert-base", "U[0.25S,S]")]["ortpacking"].startswith("1.24x (1.11x at B=32")
    assert summ[("gpt2", "U[0.25S,S]")]["fastest ORT"] == "–"
    assert "| vit-base | none | 1 | 1.00x (1.00x at B=8 S=257) | – |" in md
    merged = e2e.merge_records(recs[:2], [_rec("bert-base", "U[0.25S,S]", 8, {"stof": 1.0}), recs[3]])
    assert len(merged) == 3 and merged[0]["variants"] == {"stof": {"median_ms": 1.0, "p90_ms": 1.1}}


def test_stof_meta_sees_padding_removal():
    n = helper.make_node("StofSparseAttention", ["a"], ["b"], domain="stof", qkv_format="t3hd")
    m = helper.make_model(helper.make_graph([n], "g", [], []))
    assert e2e.stof_meta(m) == {"stof_nodes": {"StofSparseAttention": 1}, "qkv_formats": ["t3hd"],
                                "padding_removal": True}


def test_flow_on_tiny_models_cpu(tmp_path, monkeypatch):
    """--make-skeletons then a CPU run: e2e.json with the issue's keys, STOF equal to the original at real tokens."""
    mod = _script()
    skel, out = tmp_path / "skel", tmp_path / "out"
    assert mod.main(["--make-skeletons", str(skel), "--tiny", "--models", "bert-base", "--work",
                     str(tmp_path / "work")]) == 0
    assert sum(p.stat().st_size for p in skel.glob("*.skel.onnx")) < 1_000_000
    before = {p.name: p.stat().st_mtime_ns for p in skel.glob("*.skel.onnx")}
    assert mod.main(["--make-skeletons", str(skel), "--tiny", "--models", "bert-base", "--variants", "stof",
                     "--work", str(tmp_path / "work")]) == 0  # remakes the rewrite's model only
    after = {p.name: p.stat().st_mtime_ns for p in skel.glob("*.skel.onnx")}
    remade = sorted(n for n in after if after[n] != before[n])
    assert remade == ["bert-base.base.skel.onnx", "bert-base.stof.skel.onnx"]
    manifest = json.loads((skel / "manifest.json").read_text())
    assert set(manifest["bert-base"]["variants"]) == {"original", "ortopt", "ortpacking", "stof", "stof-slots",
                                                      "stof-padded"}
    assert mod.main(["--skeletons", str(skel), "--out", str(out), "--cpu", "--models", "bert-base", "--batches", "2",
                     "--seqs", "128", "--paddings", "U[0.25S,S]", "--iters", "2", "--min-iters", "1",
                     "--warmup", "1"]) == 0
    recs = json.loads((out / "e2e.json").read_text())
    assert len(recs) == 1 and tuple(recs[0]) == e2e.CASE_KEYS
    r = recs[0]
    assert r["padding"] == "U[0.25S,S]" and {"original", "ortopt", "stof"} <= set(r["variants"])
    assert e2e.attention_fused(r["fused_ops"]["ortopt"])
    assert r["max_diff_real_tokens"]["stof"] < 2e-2
    meta = json.loads((out / "e2e.meta.json").read_text())
    assert "ortpacking" in meta["models"]["bert-base"]["errors"]  # PackedAttention has no CPU kernel
    assert "Targets (issue 39)" in (out / "e2e.md").read_text()
    # a second call keeps the case and adds the new one
    assert mod.main(["--skeletons", str(skel), "--out", str(out), "--cpu", "--models", "bert-base", "--batches",
                     "1,2", "--seqs", "128", "--paddings", "U[0.25S,S]", "--iters", "1", "--min-iters", "1",
                     "--warmup", "1", "--variants", "original,stof", "--profile"]) == 0
    recs2 = json.loads((out / "e2e.json").read_text())
    assert [(x["B"], sorted(x["variants"])) for x in recs2] == [(1, ["original", "stof"]), (2, sorted(r["variants"]))]
    assert all(set(v) == {"median_ms", "p90_ms"} for x in recs2 for v in x["variants"].values())
    # --profile: per variant in the meta (here, without a GPU, the reason there is none)
    profiles = json.loads((out / "e2e.meta.json").read_text())["profiles"]
    assert set(profiles) == {"bert-base|1|128|U[0.25S,S]"}
    got = profiles["bert-base|1|128|U[0.25S,S]"]
    assert set(got) == {"original", "stof"}
    assert all("gpu_kernel_ms_per_run" in p or "cupti_error" in p for p in got.values()), got
    assert mod.main(["--out", str(out)]) == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "e2e.json").write_text(json.dumps([dict(recs2[0], B=4)]))
    assert mod.main(["--merge", str(out), str(other), "--out", str(tmp_path / "merged")]) == 0
    assert [x["B"] for x in json.loads((tmp_path / "merged" / "e2e.json").read_text())] == [1, 2, 4]
    assert mod.main(["--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "m2")]) == 2
