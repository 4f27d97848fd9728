"""Bad input to the CLI: one line on stderr, exit status 2, nothing written, the input untouched; and the
smaller behaviours a new user meets (default output, created directories, quiet pipes, ORT errors in one line)."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.cli import main
from stof_trt.cli.rewrite import print_report
from stof_trt.format import STOF_FORMAT_VERSION, compile_mask


def run_cli(*args, env=None):
    p = subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], capture_output=True, text=True, timeout=600,
                       env=env)
    return p.returncode, p.stdout, p.stderr


def tiny_model(path):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "tiny",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10  # what every onnxruntime these tests meet reads (onnx writes its newest by default)
    onnx.save(m, path)
    return path


def attention_model(path, tamper=False):
    """One StofSparseAttention node (causal, 128 tokens), no function: enough for the checks made on load."""
    lay = compile_mask("causal", 128, 128)
    arrays = dict(lay.arrays())
    if tamper:
        rp = arrays["row_ptr"].copy()
        rp[1] += 1     # one more tile in row 0: a layout `stof inspect` rejects
        arrays["row_ptr"] = rp
    inits = [numpy_helper.from_array(a, k) for k, a in arrays.items()]
    node = helper.make_node("StofSparseAttention", ["Q", "K", "V", *arrays], ["O"], name="att", domain="stof",
                            scale=0.125, tile_m=64, tile_n=64, seq_q=128, seq_k=128, num_layouts=1,
                            format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec)
    vi = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 2, 128, 64]) for x in "QKV"]
    m = helper.make_model(helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("O", TensorProto.FLOAT,
                                                                                           None)], inits),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    onnx.save(m, path)
    return path


def assert_one_line_error(rc, stdout, stderr, *words):
    assert rc == 2, (rc, stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stof: error: "), stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert "internal error" not in stderr and "Traceback" not in stderr


def snapshot(d):
    return {p: (os.path.getsize(os.path.join(d, p)), os.path.getmtime(os.path.join(d, p))) for p in os.listdir(d)}


@pytest.mark.parametrize("case", ["unwritable_dir", "existing_dir", "proc", "long_name", "bad_raw_data",
                                  "bigbird_seed", "dilation_overflow", "global_huge", "nested", "max_seq_len"])
def test_rewrite_user_errors(tmp_path, case):
    good = tiny_model(str(tmp_path / "m.onnx"))
    (tmp_path / "dir.onnx").mkdir()
    bad = onnx.load(good)
    bad.graph.initializer[0].raw_data = bad.graph.initializer[0].raw_data[:-4]
    onnx.save(bad, str(tmp_path / "bad.onnx"))
    out = str(tmp_path / "out.onnx")
    args, words = {
        "unwritable_dir": ([good, "-o", "/proc/self/stof-out.onnx"], ["cannot write"]),
        "existing_dir": ([good, "-o", str(tmp_path / "dir.onnx")], ["directory"]),
        "proc": ([good, "-o", "/proc/stof.onnx"], ["cannot write"]),
        "long_name": ([good, "-o", str(tmp_path / ("x" * 260 + ".onnx"))], ["longer than"]),
        "bad_raw_data": ([str(tmp_path / "bad.onnx"), "-o", out], ["'W'", "bytes"]),
        "bigbird_seed": ([good, "-o", out, "--mask", "bigbird:random=0.1,seed=-1"], ["seed"]),
        "dilation_overflow": ([good, "-o", out, "--mask", f"dilated:window=8,dilation={10**12}"], ["out of range"]),
        "global_huge": ([good, "-o", out, "--mask", f"global:n={10**12}"], ["out of range"]),
        "nested": ([good, "-o", out, "--mask", "(" * 2000 + "causal" + ")" * 2000], ["deeper than 64"]),
        "max_seq_len": ([good, "-o", out, "--max-seq-len", str(10**10)], ["--max-seq-len"]),
    }[case]
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("rewrite", *args)
    assert_one_line_error(rc, stdout, stderr, *words)
    assert snapshot(tmp_path) == before          # nothing written, nothing touched


def test_rewrite_refuses_a_length_whose_probe_does_not_fit(tmp_path):
    """--max-seq-len 10^9 on a model with 64 [batch, seq] int64 inputs: 512 GB for one probe, more than any machine
    this runs on has, refused with the numbers."""
    xs = [helper.make_tensor_value_info(f"input_{i}", TensorProto.INT64, ["batch", "seq"]) for i in range(64)]
    ys = [helper.make_tensor_value_info(f"y_{i}", TensorProto.INT64, ["batch", "seq"]) for i in range(64)]
    nodes = [helper.make_node("Identity", [f"input_{i}"], [f"y_{i}"]) for i in range(64)]
    m = helper.make_model(helper.make_graph(nodes, "g", xs, ys), opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "ids.onnx")
    onnx.save(m, path)
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("rewrite", path, "--max-seq-len", "1000000000")
    assert_one_line_error(rc, stdout, stderr, "--max-seq-len 1000000000", "GiB")
    assert snapshot(tmp_path) == before


def test_rewrite_writes_beside_the_input_by_default(tmp_path):
    good = tiny_model(str(tmp_path / "m.onnx"))
    rc, stdout, stderr = run_cli("rewrite", good)
    assert rc == 0, stderr
    assert os.path.isfile(tmp_path / "m.stof.onnx")
    assert f"wrote {tmp_path / 'm.stof.onnx'}" in stdout


def test_inspect_out_dir_that_is_a_file(tmp_path):
    path = attention_model(str(tmp_path / "a.onnx"))
    (tmp_path / "f").write_text("x")
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("inspect", path, "--out-dir", str(tmp_path / "f"))
    assert_one_line_error(rc, stdout, stderr, "not a directory")
    assert snapshot(tmp_path) == before


def test_run_refuses_a_tampered_layout_on_the_cpu(tmp_path):
    pytest.importorskip("onnxruntime")
    path = attention_model(str(tmp_path / "a.onnx"), tamper=True)
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu")
    assert_one_line_error(rc, stdout, stderr)
    rc, _, stderr = run_cli("inspect", path)
    assert rc == 2


def test_run_creates_its_output_directory(tmp_path):
    pytest.importorskip("onnxruntime")
    path = tiny_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "new" / "outputs"
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "-o", str(out), "--json")
    assert rc == 0, stderr
    assert json.loads(stdout)["outputs"][0]["saved"] == str(out / "Y.npy")
    assert np.load(out / "Y.npy").shape == (2, 8)
    (tmp_path / "file").write_text("x")
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "-o", str(tmp_path / "file"))
    assert_one_line_error(rc, stdout, stderr, "not a directory")


def test_run_without_a_gpu_suggests_the_cpu(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    rc, stdout, stderr = run_cli("run", tiny_model(str(tmp_path / "m.onnx")))
    assert_one_line_error(rc, stdout, stderr, "--provider cpu")


def test_onnxruntime_shape_errors_are_one_line_and_quiet(tmp_path):
    pytest.importorskip("onnxruntime")
    path = tiny_model(str(tmp_path / "m.onnx"))
    np.save(tmp_path / "x.npy", np.ones((3, 5), np.float32))
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--input", f"X={tmp_path / 'x.npy'}")
    assert_one_line_error(rc, stdout, stderr, "input shapes")
    assert "[E:onnxruntime" not in stderr and "[W:onnxruntime" not in stderr


def test_onnxruntime_error_names_the_compiled_length(tmp_path):
    from stof_trt.cli.common import ort_error

    path = attention_model(str(tmp_path / "a.onnx"))
    e = ort_error(RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while "
                               "running Expand node. invalid expand shape"), path)
    assert "sequence length <= 128" in str(e) and "\n" not in str(e)
    # within the compiled length an index error is the inputs' values, not their length
    gather = RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : indices element out of data bounds, idx=9999")
    m = onnx.load(path)
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "S"
    e = ort_error(gather, m, {"Q": (1, 2, 128, 64)})
    assert "past its table" in str(e) and "--max-seq-len" not in str(e)
    assert "sequence length <= 128" in str(ort_error(gather, m, {"Q": (1, 2, 129, 64)}))
    e = ort_error(RuntimeError("CUDAExecutionProvider is not available"), path)
    assert "--provider cpu" in str(e)


def test_broken_pipe_is_quiet(tmp_path, monkeypatch, capsys):
    path = attention_model(str(tmp_path / "a.onnx"))

    class Closed:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no file")

    monkeypatch.setattr(sys, "stdout", Closed())
    rc = main(["inspect", path, "--json", "--no-png"])
    err = capsys.readouterr().err
    assert rc == 141 and err == ""


def test_broken_pipe_through_head(tmp_path):
    """`stof inspect --json | head -c 1` with more JSON than a pipe holds: quiet, status 141 (SIGPIPE's)."""
    lay = compile_mask("causal", 128, 128)
    inits = [numpy_helper.from_array(a, k) for k, a in lay.arrays().items()]
    n = 600
    nodes = [helper.make_node("StofSparseAttention", ["Q", "K", "V", *lay.arrays()], [f"O{i}"], name=f"att{i}",
                              domain="stof", scale=0.125, tile_m=64, tile_n=64, seq_q=128, seq_k=128,
                              num_layouts=1, format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec)
             for i in range(n)]
    vi = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 2, 128, 64]) for x in "QKV"]
    outs = [helper.make_tensor_value_info(f"O{i}", TensorProto.FLOAT, None) for i in range(n)]
    path = str(tmp_path / "many.onnx")
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", vi, outs, inits),
                                opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)]), path)
    p = subprocess.run(["bash", "-c", f"{sys.executable} -m stof_trt.cli inspect {path} --json --no-png | head -c 1; "
                                      "echo \" ${PIPESTATUS[0]}\""], capture_output=True, text=True, timeout=300)
    assert p.stderr == "", p.stderr
    assert p.stdout == "{ 141\n"


def test_npy_path_with_a_bar_in_quotes(tmp_path):
    d = tmp_path / "a|b"
    d.mkdir()
    np.save(d / "m.npy", np.tril(np.ones((128, 128), bool)))
    from stof_trt.masks import parse_mask

    spec = parse_mask(f"npy:'{d / 'm.npy'}'|global:n=1")
    want = np.tril(np.ones((128, 128), bool)) | parse_mask("global:n=1").dense(128, 128)
    assert np.array_equal(spec.dense(128, 128), want)
    assert str(parse_mask(str(spec))) == str(spec)
    rc, out, _ = run_cli("--help")
    assert "quotes" in out


def test_demo_flags_have_help():
    rc, out, _ = run_cli("demo", "--help")
    assert rc == 0
    for flag, word in (("--batch", "batch size"), ("--layers", "layers"), ("--seed", "seed of"), ("--json", "JSON")):
        line = out[out.index("\n  " + flag):]
        assert word in line[:300], flag


def test_summary_node_counts_add_up(capsys):
    print_report({"input": "in.onnx", "output": "out.onnx", "seconds": 1.0, "nodes_before": 286, "nodes_after": 103,
                  "patterns": {"attention_core": {"fused_op_type": "StofSparseAttention", "matched": 6,
                                                  "nodes_removed": 66, "nodes_added": 18, "removed_op_types": {}}}})
    out = capsys.readouterr().out
    assert "286 -> 103: 66 removed and 18 added by the patterns, 135 removed by cleanup" in out
    assert "wrote out.onnx" in out


def test_run_refuses_inputs_that_disagree_on_an_axis(tmp_path):
    """input_ids and attention_mask of different lengths (or batches), which the model cannot run: one line that
    names both inputs and the axis, never the sequence-limit hint."""
    pytest.importorskip("onnxruntime")
    from models_util import exported

    new = str(tmp_path / "bert.stof.onnx")
    orig = str(tmp_path / "bert.onnx")
    onnx.save(exported("bert"), orig)
    assert run_cli("rewrite", orig, "-o", new)[0] == 0
    for shapes, axis in (("input_ids=2x20,attention_mask=2x30", "seq"),
                         ("input_ids=2x20,attention_mask=3x20", "batch")):
        rc, stdout, stderr = run_cli("run", new, "--provider", "cpu", "--shapes", shapes)
        assert_one_line_error(rc, stdout, stderr, "'input_ids'", "'attention_mask'", f"axis '{axis}'")
        assert "--max-seq-len" not in stderr


def test_run_past_the_compiled_length_names_the_limit(tmp_path):
    """A BERT rewritten with no flag is compiled for its 512 position embeddings (stof.max_seq_len): `stof run` and
    `stof bench` at 513 tokens refuse in one line naming the limit, before any run; 512 runs."""
    pytest.importorskip("onnxruntime")
    from models_util import exported

    orig = str(tmp_path / "bert.onnx")
    onnx.save(exported("bert"), orig)
    new = str(tmp_path / "bert.stof.onnx")
    rc, _, stderr = run_cli("rewrite", orig, "-o", new)
    assert rc == 0, stderr
    meta = {p.key: p.value for p in onnx.load(new).metadata_props}
    limit = int(meta["stof.max_seq_len"])
    assert limit == 512
    out = tmp_path / "outs"
    before = snapshot(tmp_path)
    over = f"input_ids=1x{limit + 1},attention_mask=1x{limit + 1}"
    rc, stdout, stderr = run_cli("run", new, "--provider", "cpu", "--shapes", over, "-o", str(out))
    assert_one_line_error(rc, stdout, stderr, f"at most {limit} tokens", "stof.max_seq_len",
                          "the original model's own limit", str(limit + 1))
    rc, stdout, stderr = run_cli("bench", orig, new, "--shapes", over)
    assert_one_line_error(rc, stdout, stderr, f"at most {limit} tokens", "stof.max_seq_len")
    assert snapshot(tmp_path) == before
    rc, stdout, stderr = run_cli("run", new, "--provider", "cpu", "--shapes",
                                 f"input_ids=1x{limit},attention_mask=1x{limit}")
    assert rc == 0, stderr


def test_max_seq_len_whose_probe_does_not_fit_is_refused_with_numbers(tmp_path, monkeypatch, capsys):
    """The memory estimate of the rewrite's evaluation at --max-seq-len covers the attention scores of every head
    and the graph masks, not only the inputs: with less memory available than that estimate (but more than the
    inputs need) the rewrite refuses in one line with the numbers, before evaluating the model at that length."""
    from models_util import exported

    from stof_trt.rewrite import attention_common as ac
    from stof_trt.rewrite import probe as probe_mod

    model = exported("bert")                          # 4 heads, 512 positions, a graph-built padding mask
    path = str(tmp_path / "bert.onnx")
    onnx.save(model, path)
    S = 384
    est = ac.probe_bytes(model, S, heads=4, masks=True)
    assert est["scores"] == ac.SCORE_COPIES * 4 * 4 * S * S
    assert est["masks"] == 5 * ac.AttentionProbe.BATCH * 4 * S * S
    assert est["total"] > 50 * est["inputs"]          # an inputs-only estimate would let it through
    assert ac.probe_bytes(model, 2 * S, heads=4, masks=True)["scores"] == 4 * est["scores"]
    runs = []
    real_run = probe_mod.Probe.run

    def run(self, batch, seq, overrides=None):
        runs.append(seq)
        return real_run(self, batch, seq, overrides)

    monkeypatch.setattr(probe_mod.Probe, "run", run)
    monkeypatch.setattr(ac, "available_memory", lambda: est["total"] - 1)
    before = snapshot(tmp_path)
    rc = main(["rewrite", path, "-o", str(tmp_path / "out.onnx"), "--max-seq-len", str(S)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert_one_line_error(2, "", err, f"max_seq_len={S}", "[1, 4, S, S]", "MiB", "available")
    assert max(runs) <= 1, runs                       # refused before the model ran at that length
    assert snapshot(tmp_path) == before
    monkeypatch.setattr(ac, "available_memory", lambda: est["total"])
    assert main(["rewrite", path, "-o", str(tmp_path / "out.onnx"), "--max-seq-len", str(S)]) == 0
    assert S in runs


# -- output paths that are not plain files, and output written through symlinks ----------------------------------
def test_rewrite_refuses_a_pipe_and_writes_through_a_symlink(tmp_path):
    src = tiny_model(str(tmp_path / "m.onnx"))
    fifo = tmp_path / "p.onnx"
    os.mkfifo(fifo)
    rc, stdout, stderr = run_cli("rewrite", src, "-o", str(fifo))
    assert_one_line_error(rc, stdout, stderr, "not a regular file")
    assert os.path.exists(fifo) and not os.path.isfile(fifo)
    link = tmp_path / "link.onnx"
    link.symlink_to(tmp_path / "target.onnx")
    rc, _, stderr = run_cli("rewrite", src, "-o", str(link))
    assert rc == 0, stderr
    assert link.is_symlink() and onnx.load(str(tmp_path / "target.onnx")).graph.node
    rc, stdout, stderr = run_cli("rewrite", src, "-o", "")
    assert_one_line_error(rc, stdout, stderr, "empty")


def test_tune_output_that_is_a_directory(tmp_path):
    pytest.importorskip("onnxruntime")
    path = attention_model(str(tmp_path / "a.onnx"))
    (tmp_path / "d.json").mkdir()
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("tune", path, "--presearch-only", "--gpu", "NVIDIA H200", "--shapes",
                                 "Q=1x2x128x64,K=1x2x128x64,V=1x2x128x64", "-o", str(tmp_path / "d.json"))
    assert_one_line_error(rc, stdout, stderr, "directory")
    assert snapshot(tmp_path) == before   # no lock file left beside it


def test_run_output_file_that_is_a_directory(tmp_path):
    pytest.importorskip("onnxruntime")
    path = tiny_model(str(tmp_path / "m.onnx"))
    (tmp_path / "o" / "Y.npy").mkdir(parents=True)
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, stdout, stderr, "Y.npy", "directory")
    assert sorted(os.listdir(tmp_path / "o")) == ["Y.npy"]   # no temporary file left


# -- files the CLI reads: tactic caches, STOF nodes' attributes, truncated models ---------------------------------
@pytest.mark.parametrize("doc,words", [
    ({"format": "stof-tactic-cache", "version": 1, "entries": 5}, ["not a list"]),
    ({"format": "stof-tactic-cache", "version": True, "entries": []}, ["version"]),
    ({"format": "stof-tactic-cache", "version": 1, "entries": [], "schemes": {"version": 1, "entries": 7}},
     ["not a list"]),
    ("[" * 100000 + "]" * 100000, ["not JSON"]),
], ids=["entries_int", "version_bool", "schemes_entries_int", "deep_nesting"])
def test_rewrite_schemes_from_a_malformed_cache(tmp_path, doc, words):
    src = tiny_model(str(tmp_path / "m.onnx"))
    cache = tmp_path / "c.json"
    cache.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    rc, stdout, stderr = run_cli("rewrite", src, "-o", str(tmp_path / "o.onnx"), "--schemes", str(cache))
    assert_one_line_error(rc, stdout, stderr, *words)
    assert not (tmp_path / "o.onnx").exists()


def test_scheme_entries_with_a_bad_bucket_or_algo(tmp_path):
    from stof_trt.errors import StofError
    from stof_trt.tactic_cache import TacticCache

    entry = {"gpu": "G", "cc": "9.0", "chain": "bias_gelu|float16|N3072|K768|gelu_erf", "bucket": "T4096",
             "scheme": "gemm_bias_gelu", "algo": 2}
    for bad, word in (({"bucket": "Tx"}, "bucket"), ({"algo": 10**40}, "algo")):
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"format": "stof-tactic-cache", "version": 1, "entries": [],
                                 "schemes": {"version": 1, "entries": [{**entry, **bad}]}}))
        with pytest.raises(StofError, match=word):
            TacticCache.load(p)


@pytest.mark.parametrize("attr,value,words", [
    ("mask_spec", b"\xff", ["mask_spec", "UTF-8"]),
    ("seq_q", None, ["seq_q", "missing"]),
    ("num_heads", "4", ["num_heads", "integer"]),
    ("scale", "x", ["scale", "number"]),
])
def test_inspect_a_node_with_a_bad_attribute(tmp_path, attr, value, words):
    path = attention_model(str(tmp_path / "a.onnx"))
    m = onnx.load(path)
    node = m.graph.node[0]
    kept = [a for a in node.attribute if a.name != attr]
    del node.attribute[:]
    node.attribute.extend(kept)
    if value is not None:
        node.attribute.append(helper.make_attribute(attr, value))
    onnx.save(m, path)
    rc, stdout, stderr = run_cli("inspect", path, "--no-png")
    assert_one_line_error(rc, stdout, stderr, *words)


def test_inspect_a_layout_input_past_int32(tmp_path):
    path = attention_model(str(tmp_path / "a.onnx"))
    m = onnx.load(path)
    for i, t in enumerate(m.graph.initializer):
        if t.name == "col_idx":
            a = numpy_helper.to_array(t).astype(np.int64) + 2**40
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(a, "col_idx"))
    onnx.save(m, path)
    rc, stdout, stderr = run_cli("inspect", path, "--no-png")
    assert_one_line_error(rc, stdout, stderr, "col_idx", "int32")


def test_bench_reads_models_with_clear_errors(tmp_path):
    src = tiny_model(str(tmp_path / "m.onnx"))
    trunc = tmp_path / "t.onnx"
    trunc.write_bytes(open(src, "rb").read()[:40])
    rc, stdout, stderr = run_cli("bench", src, str(trunc), "--shapes", "X=2x8")
    assert_one_line_error(rc, stdout, stderr, "t.onnx")


# -- numeric flags ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--seed=-1"], ["--time=-1"], ["--seed", str(2**40)]])
def test_run_numeric_flags_out_of_range(tmp_path, args):
    rc, stdout, stderr = run_cli("run", tiny_model(str(tmp_path / "m.onnx")), "--provider", "cpu", *args)
    assert_one_line_error(rc, stdout, stderr, "outside", "`stof run --help`")


def test_demo_seed_out_of_range():
    rc, stdout, stderr = run_cli("demo", "--seed", "-1")
    assert_one_line_error(rc, stdout, stderr, "outside")


@pytest.mark.parametrize("args, words", [
    (["run", "m.onnx", "--seed", "abc"], ["--seed", "not an integer", "`stof run --help`"]),
    (["rewrite"], ["required", "`stof rewrite --help`"]),
    (["nosuchcommand"], ["invalid choice", "`stof --help`"]),
    (["run", "m.onnx", "--provider", "tpu"], ["--provider", "invalid choice"]),
])
def test_usage_errors_are_one_line(args, words):
    rc, stdout, stderr = run_cli(*args)
    assert_one_line_error(rc, stdout, stderr, *words)
    assert "usage:" not in stderr


def symbolic_model(path):
    """tiny_model with a symbolic first dim: random inputs take their size from --shapes."""
    m = onnx.load(tiny_model(path))
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "n"
    onnx.save(m, path)
    return path


def test_run_random_inputs_larger_than_memory_are_refused(tmp_path):
    pytest.importorskip("onnxruntime")
    path = symbolic_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "outs"
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--shapes", f"X={2**40}x8", "-o", str(out))
    assert_one_line_error(rc, stdout, stderr, "GiB of host memory", "--shapes")
    assert not out.exists()  # the directory the failed run made is gone again
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--shapes", "X=3x8", "--json")
    assert rc == 0 and json.loads(stdout)["outputs"][0]["shape"] == [3, 8], stderr


def test_a_failed_run_leaves_no_new_output_directory(tmp_path):
    pytest.importorskip("onnxruntime")
    path = tiny_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "new" / "deeper"
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--shapes", "X=3x8", "-o", str(out))
    assert_one_line_error(rc, stdout, stderr, "does not fit")
    assert not (tmp_path / "new").exists()
    (tmp_path / "real" / "x").mkdir(parents=True)  # through a symlink and "..": what makedirs made, not the text
    os.symlink(tmp_path / "real" / "x", tmp_path / "link")
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--shapes", "X=3x8", "-o",
                                 str(tmp_path / "link" / ".." / "new" / "deep"))
    assert rc == 2 and not (tmp_path / "real" / "new").exists() and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a directory that was there stays
    rc, stdout, stderr = run_cli("run", path, "--provider", "cpu", "--shapes", "X=3x8", "-o", str(tmp_path / "kept"))
    assert rc == 2 and (tmp_path / "kept").is_dir()


def test_closed_stdout(tmp_path):
    src = tiny_model(str(tmp_path / "m.onnx"))
    p = subprocess.run(["bash", "-c", f'"{sys.executable}" -m stof_trt.cli rewrite "{src}" -o "{tmp_path}/o.onnx" >&-'],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    assert (tmp_path / "o.onnx").is_file()


# -- inputs and outputs of `stof run`, validated models, options given twice --------------------------------------
def neg_model(path, out_name):
    """One Neg node whose output has the name ``out_name`` (any string a model may carry)."""
    g = helper.make_graph([helper.make_node("Neg", ["x"], [out_name])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["b", 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("out_name", ["../escaped", "/tmp/stof-abs-escape", "a/b", ".hidden", "x y"])
def test_run_output_names_stay_inside_the_directory(tmp_path, out_name):
    """An output's name is a file name inside -o DIR, never a path out of it."""
    pytest.importorskip("onnxruntime")
    model = neg_model(str(tmp_path / "m.onnx"), out_name)
    out = tmp_path / "out"
    escape = out_name + ".npy" if out_name.startswith("/") else None
    if escape and os.path.exists(escape):
        os.remove(escape)
    before = set(os.listdir(tmp_path))
    assert main(["run", model, "--provider", "cpu", "--shapes", "x=2x4", "-o", str(out)]) == 0
    assert set(os.listdir(tmp_path)) == before | {"out"}
    saved = os.listdir(out)
    assert len(saved) == 1 and saved[0].endswith(".npy") and not saved[0].startswith(".")
    assert np.load(out / saved[0]).shape == (2, 4)
    assert escape is None or not os.path.exists(escape)


def test_run_refuses_to_overwrite_an_input_file(tmp_path):
    pytest.importorskip("onnxruntime")
    model = neg_model(str(tmp_path / "m.onnx"), "x_in")
    np.save(tmp_path / "x_in.npy", np.ones((2, 4), np.float32))
    before = (tmp_path / "x_in.npy").read_bytes()
    rc, stdout, stderr = run_cli("run", model, "--provider", "cpu", "--input", f"x={tmp_path / 'x_in.npy'}",
                                 "-o", str(tmp_path))
    assert_one_line_error(rc, stdout, stderr, "overwrite an input")
    assert (tmp_path / "x_in.npy").read_bytes() == before


@pytest.mark.parametrize("extra, words", [
    (["--tactic-cache", "c.json"], ["--tactic-cache", "CUDA provider"]),
    (["--cuda-graphs"], ["--cuda-graphs", "CUDA provider"]),
    (["--presearch", "--device", "0", "--verbose"], ["--presearch", "--device", "--verbose", "CUDA provider"]),
    (["-o", "a", "-o", "b"], ["-o", "more than once"]),
    (["--shapes", "X=2x8,X=2x8"], ["given twice"]),
    (["--input", "X=x.npy", "--input", "X=x.npy"], ["given twice"]),
    (["--input", "X=x.npy", "--shapes", "X=2x8"], ["--input", "--shapes"]),
    (["--input", "X=d"], ["directory"]),
])
def test_run_conflicting_or_ignored_options(tmp_path, monkeypatch, extra, words):
    pytest.importorskip("onnxruntime")
    monkeypatch.chdir(tmp_path)
    tiny_model("m.onnx")
    np.save("x.npy", np.ones((2, 8), np.float32))
    os.mkdir("d")
    rc, stdout, stderr = run_cli("run", "m.onnx", "--provider", "cpu", *extra)
    assert_one_line_error(rc, stdout, stderr, *words)


@pytest.mark.parametrize("case", ["dangling", "cycle", "opset"])
def test_rewrite_and_export_refuse_invalid_models(tmp_path, case):
    """Not valid ONNX: one line and exit 2 from `rewrite` and `export-triton`, nothing written."""
    path = str(tmp_path / "bad.onnx")
    if case == "opset":
        m = onnx.load(tiny_model(path))
        m.opset_import[0].version = 99
    else:
        nodes = ([helper.make_node("Relu", ["nothing_makes_this"], ["Y"])] if case == "dangling" else
                 [helper.make_node("Relu", ["b"], ["Y"]), helper.make_node("Relu", ["Y"], ["b"])])
        io = [[helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])] for n in "XY"]
        m = helper.make_model(helper.make_graph(nodes, "g", *io), opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 10
    onnx.save(m, path)
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("rewrite", path, "-o", str(tmp_path / "o.onnx"))
    assert_one_line_error(rc, stdout, stderr, "opset 99" if case == "opset" else "not a valid ONNX model")
    rc, stdout, stderr = run_cli("export-triton", path, "--repo", str(tmp_path / "repo"), "--cpu")
    assert_one_line_error(rc, stdout, stderr, "opset 99" if case == "opset" else "not a valid ONNX model")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args, words", [
    (["--repo", ""], ["--repo"]),
    (["--repo", "REPO", "--cpu", "--server-repo", "/models"], ["--server-repo", "--cpu"]),
])
def test_export_triton_option_errors(tmp_path, args, words):
    path = tiny_model(str(tmp_path / "m.onnx"))
    args = [a.replace("REPO", str(tmp_path / "repo")) for a in args]
    before = snapshot(tmp_path)
    rc, stdout, stderr = run_cli("export-triton", path, *args)
    assert_one_line_error(rc, stdout, stderr, *words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("extra, words", [
    (["--plot", "NODIR/x.png"], ["does not exist"]),
    (["--plot", "x.txt"], [".png"]),
    (["--atol", "-1"], ["--atol"]),
    (["--atol", "nan"], ["--atol"]),
    (["--mask", "causal", "--mask", "full"], ["--mask", "more than once"]),
])
def test_bench_options_checked_before_any_run(tmp_path, monkeypatch, extra, words):
    monkeypatch.chdir(tmp_path)
    tiny_model("a.onnx")
    extra = [a.replace("NODIR", str(tmp_path / "nodir")) for a in extra]
    rc, stdout, stderr = run_cli("bench", "a.onnx", "a.onnx", *extra)
    assert_one_line_error(rc, stdout, stderr, *words)


def test_unknown_option_after_a_command_names_its_help():
    rc, stdout, stderr = run_cli("rewrite", "m.onnx", "--frob")
    assert_one_line_error(rc, stdout, stderr, "--frob", "`stof rewrite --help`")


def test_session_refuses_a_provider_string_it_does_not_know(tmp_path):
    pytest.importorskip("onnxruntime")
    from stof_trt import ort as sort
    from stof_trt.errors import StofError

    with pytest.raises(StofError, match="providers='tpu'"):
        sort.session(tiny_model(str(tmp_path / "m.onnx")), providers="tpu")


@pytest.mark.parametrize("extra, words", [
    (["--gpu", "NVIDIA H200", "--cc", "1.0"], ["--cc 1.0", "8.0"]),
    (["--gpu", "NVIDIA H200", "--cc", "99.9"], ["--cc 99.9"]),
    (["--all"], ["--all", "--presearch-only"]),
])
def test_tune_presearch_only_option_errors(tmp_path, extra, words):
    path = tiny_model(str(tmp_path / "m.onnx"))
    rc, stdout, stderr = run_cli("tune", path, "--shapes", "X=2x8", "-o", str(tmp_path / "c.json"),
                                 "--presearch-only", *extra)
    assert_one_line_error(rc, stdout, stderr, *words)
    assert not (tmp_path / "c.json").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["rewrite", "--help"], ["--version"]])
def test_help_into_a_full_device_is_an_error(args):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=600)
    assert_one_line_error(p.returncode, "", p.stderr, "cannot write to standard output")


def test_an_error_quoting_a_huge_spec_stays_short(tmp_path):
    rc, stdout, stderr = run_cli("rewrite", tiny_model(str(tmp_path / "m.onnx")), "-o", str(tmp_path / "o.onnx"),
                                 "--mask", "causal:" + "y" * 100_000 + "=1")
    assert_one_line_error(rc, stdout, stderr, "unknown argument", "more characters")
    assert len(stderr) < 1200
