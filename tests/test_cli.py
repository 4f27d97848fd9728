"""CLI behaviour that needs no model export: error handling, nothing written on error, external data, inspect."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.cli import common, main
from stof_trt.format import STOF_FORMAT_VERSION


def run_cli(*args):
    p = subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def tiny_model(path, big_weight=0):
    """Y = X @ W (+ a large unused-ish weight folded into an Add) — a model with nothing to rewrite."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "W")
    inits = [w]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y"])]
    if big_weight:
        inits.append(numpy_helper.from_array(np.ones(big_weight, np.float32), "Big"))
        nodes.append(helper.make_node("ReduceSum", ["Big"], ["S"], keepdims=0))
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("case", ["missing", "not_onnx", "directory", "same_path", "bad_spec", "bad_tile",
                                  "no_out_dir"])
def test_rewrite_errors_are_one_line_exit_2_and_write_nothing(tmp_path, case):
    good = tiny_model(str(tmp_path / "m.onnx"))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01this is not protobuf" * 10)
    out = str(tmp_path / "out.onnx")
    args = {
        "missing": [str(tmp_path / "nope.onnx"), "-o", out],
        "not_onnx": [str(garbage), "-o", out],
        "directory": [str(tmp_path), "-o", out],
        "same_path": [good, "-o", good],
        "bad_spec": [good, "-o", out, "--mask", "sliding:width=3"],
        "bad_tile": [good, "-o", out, "--tile", "8", "64"],
        "no_out_dir": [good, "-o", str(tmp_path / "no" / "such" / "dir.onnx")],
    }[case]
    before = {p: os.path.getmtime(p) for p in (good, str(garbage))}
    rc, stdout, stderr = run_cli("rewrite", *args)
    assert rc == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stof: error: "), stderr
    assert "Traceback" not in stderr
    assert not os.path.exists(out)
    assert {p: os.path.getmtime(p) for p in before} == before          # inputs untouched
    assert sorted(os.listdir(tmp_path)) == sorted(["m.onnx", "garbage.onnx"])  # no temp files left


def test_usage_errors_exit_2():
    assert run_cli("rewrite")[0] == 2
    assert run_cli("nosuchcommand")[0] == 2
    rc, out, _ = run_cli("--help")
    assert rc == 0 and "rewrite" in out and "inspect" in out


def test_save_model_uses_external_data_over_the_limit(tmp_path, monkeypatch):
    src = tiny_model(str(tmp_path / "src.onnx"), big_weight=4096)
    model = onnx.load(src)
    monkeypatch.setattr(common, "_PROTO_LIMIT", 1000)   # pretend the 2 GiB protobuf limit is 1 kB
    out = str(tmp_path / "out.onnx")
    common.save_model(model, out)
    assert os.path.exists(out + ".data") and os.path.getsize(out) < 4096
    back = common.load_model(out)                       # reads the external data back
    onnx.checker.check_model(out)
    big = [t for t in back.graph.initializer if t.name == "Big"][0]
    assert np.array_equal(numpy_helper.to_array(big), np.ones(4096, np.float32))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".stof-") or f.endswith(".tmp")]


def test_inspect_model_without_stof_nodes(tmp_path, capsys):
    path = tiny_model(str(tmp_path / "m.onnx"))
    assert main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stof_nodes"] == {} and info["attention"] == []


def test_inspect_draws_each_distinct_layout(tmp_path, capsys):
    from stof_trt import compile_mask

    layouts = [compile_mask("longformer:window=40,global=4", 256, 256), compile_mask("causal", 256, 256)]
    nodes, inits = [], []
    for n, lay in enumerate(layouts + layouts[:1]):      # two distinct layouts, one used twice
        names = [f"{k}_{n}" for k in lay.arrays()]
        inits += [numpy_helper.from_array(a, nm) for nm, a in zip(names, lay.arrays().values())]
        nodes.append(helper.make_node("StofSparseAttention", ["Q", "K", "V", *names], [f"O{n}"], name=f"att{n}",
                                      domain="stof", scale=0.125, tile_m=64, tile_n=64, seq_q=256, seq_k=256,
                                      num_layouts=1, format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec))
    vi = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 2, 256, 64]) for x in "QKV"]
    outs = [helper.make_tensor_value_info(f"O{n}", TensorProto.FLOAT, None) for n in range(3)]
    m = helper.make_model(helper.make_graph(nodes, "g", vi, outs, inits),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    assert main(["inspect", path, "--json", "--out-dir", str(tmp_path / "png")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stof_nodes"] == {"StofSparseAttention": 3} and info["distinct_layouts"] == 2
    assert len(info["pngs"]) == 2 and all(os.path.getsize(p) > 1000 for p in info["pngs"])
    dens = {a["node"]: a["density"] for a in info["attention"]}
    assert dens["att1"] == pytest.approx(np.tril(np.ones((256, 256))).mean())


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    pytest.importorskip("transformers")
    from stof_trt.export import export_bert

    path = str(tmp_path_factory.mktemp("bert") / "bert.onnx")
    export_bert(path, layers=1, hidden=128, heads=2, intermediate=256, seq_len=96, max_positions=128)
    return path


def test_rewrite_and_inspect_end_to_end_json(bert_path, tmp_path):
    out = str(tmp_path / "bert.stof.onnx")
    rc, stdout, stderr = run_cli("rewrite", bert_path, "-o", out, "--mask", "longformer:window=16,global=4",
                                 "--max-seq-len", "96", "--json")
    assert rc == 0, stderr
    info = json.loads(stdout)
    assert info["patterns"]["attention_core"]["matched"] == 1
    assert info["attention"][0]["density"] < 0.5
    onnx.checker.check_model(out)
    rc, stdout, stderr = run_cli("inspect", out, "--json", "--out-dir", str(tmp_path / "png"))
    assert rc == 0, stderr
    ins = json.loads(stdout)
    assert ins["stof_nodes"]["StofSparseAttention"] == 1 and len(ins["pngs"]) == 1
    assert "StofSparseAttention" in ins["functions"]
    rc, stdout, _ = run_cli("rewrite", bert_path, "-o", str(tmp_path / "t.onnx"), "--max-seq-len", "96")
    assert rc == 0 and "attention_core" in stdout and "StofSparseAttention" in stdout


def test_rewrite_mask_that_cannot_fit_the_model(bert_path, tmp_path):
    np.save(tmp_path / "small.npy", np.ones((32, 32), bool))
    out = str(tmp_path / "o.onnx")
    rc, _, stderr = run_cli("rewrite", bert_path, "-o", out, "--mask", f"npy:{tmp_path}/small.npy",
                            "--max-seq-len", "96")
    assert rc == 2 and stderr.startswith("stof: error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert not os.path.exists(out)


def test_demo_matches_original(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    rc, stdout, stderr = run_cli("demo", "--seq-len", "128", "--layers", "1", "--work-dir", str(tmp_path), "--json")
    assert rc == 0, stderr
    info = json.loads(stdout)
    assert info["match"] is True and info["max_abs_diff"] < 1e-4 and info["max_abs_ref"] > 0.1
    assert info["patterns"]["attention_core"]["matched"] == 1


def test_rewrite_model_with_external_data_into_another_directory(bert_path, tmp_path):
    """Weights in an external data file stay external while rewriting (a >2 GB single tensor cannot be held in a
    proto that is copied); the output gets its own data file; outputs equal the original's."""
    ort = pytest.importorskip("onnxruntime")
    src_dir, out_dir = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    src = str(src_dir / "bert.onnx")
    onnx.save_model(onnx.load(bert_path), src, save_as_external_data=True, location="weights.bin",
                    size_threshold=1024)
    out = str(out_dir / "bert.stof.onnx")
    rc, _, stderr = run_cli("rewrite", src, "-o", out, "--max-seq-len", "96")
    assert rc == 0, stderr
    assert sorted(os.listdir(src_dir)) == ["bert.onnx", "weights.bin"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    a = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    feeds = {"input_ids": rng.integers(0, 1000, (2, 96)).astype(np.int64),
             "attention_mask": (np.arange(96)[None] < np.array([[96], [50]])).astype(np.int64)}
    ra, rb = a.run(None, feeds)[0], b.run(None, feeds)[0]
    keep = feeds["attention_mask"] != 0  # the padding is removed: real tokens equal, padded ones are 0
    assert not np.any(rb[~keep])
    assert np.abs(ra).max() > 0.1 and np.abs(ra - rb)[keep].max() < 1e-4


def test_rewrite_reports_missing_external_data(bert_path, tmp_path):
    src = str(tmp_path / "bert.onnx")
    onnx.save_model(onnx.load(bert_path), src, save_as_external_data=True, location="weights.bin",
                    size_threshold=1024)
    os.unlink(tmp_path / "weights.bin")
    rc, _, stderr = run_cli("rewrite", src, "-o", str(tmp_path / "o.onnx"), "--max-seq-len", "96")
    assert rc == 2 and "external data file missing" in stderr


def test_rewrite_packed_qkv_flag(bert_path, tmp_path):
    """Packed Q/K/V is the default; --no-packed-qkv keeps three projections; both match the original on ORT."""
    ort = pytest.importorskip("onnxruntime")
    outs = {}
    for flag in ([], ["--no-packed-qkv"]):
        out = str(tmp_path / f"bert{len(flag)}.stof.onnx")
        rc, _, stderr = run_cli("rewrite", bert_path, "-o", out, "--max-seq-len", "96", "--no-remove-padding", *flag)
        assert rc == 0, stderr
        m = onnx.load(out)
        att = [n for n in m.graph.node if n.op_type == "StofSparseAttention"]
        fmt = {a.name: helper.get_attribute_value(a) for a in att[0].attribute}.get("qkv_format", b"")
        outs[bool(flag)] = (out, fmt)
    assert outs[False][1] == b"bs3hd" and outs[True][1] != b"bs3hd"
    rng = np.random.default_rng(7)
    sess0 = ort.InferenceSession(bert_path, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess0.get_inputs():
        shape = [2 if d in (None, "batch") or isinstance(d, str) and "batch" in d else d for d in i.shape]
        shape = [96 if isinstance(d, str) or d is None else d for d in shape]
        if "int" in i.type:
            hi = 100 if "input_ids" in i.name else 2
            feeds[i.name] = rng.integers(0 if hi == 100 else 1, hi, size=shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    ref = sess0.run(None, feeds)[0]
    for out, _ in outs.values():
        got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_dense_attention_ort_report_lists_only_nodes_in_the_output(bert_path, tmp_path):
    out = str(tmp_path / "ort.onnx")
    rc, stdout, stderr = run_cli("rewrite", bert_path, "-o", out, "--max-seq-len", "96", "--dense-attention", "ort",
                                 "--json")
    assert rc == 0, stderr
    info = json.loads(stdout)
    names = {n.name for n in onnx.load(out).graph.node}
    assert all(a["name"] in names for a in info["attention"])
    if not any(n.op_type == "StofSparseAttention" for n in onnx.load(out).graph.node):
        assert info["attention"] == [] and any("--dense-attention ort" in n for n in info["notes"])
    before, after = info["nodes_before"], info["nodes_after"]
    removed = sum(p["nodes_removed"] for p in info["patterns"].values())
    added = sum(p["nodes_added"] for p in info["patterns"].values())
    assert before - removed + added - info["nodes_removed_by_cleanup"] == after


def test_demo_sliding_spec_matches_and_cleans_up(tmp_path):
    """The README-style spec: padded query rows are not compared, and the temporary directory goes away."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "stof_trt.cli", "demo", "--seq-len", "128", "--layers", "1",
                        "--mask", "sliding:window=32"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MATCH" in p.stdout and "MISMATCH" not in p.stdout and "real tokens" in p.stdout
    assert not [f for f in os.listdir(tmp_path) if f.startswith("stof-demo-")]   # (others' files may remain)
