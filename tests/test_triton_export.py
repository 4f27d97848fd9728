"""`stof export-triton`: the repository layout Triton documents (model directory, config.pbtxt, numeric version
directory with model.onnx), a config.pbtxt that parses into Triton's ModelConfig message (the schema shipped by
`tritonclient`), the shipped custom-op library and tactic cache, and one-line errors that write nothing."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stof_trt.triton import export as tx


def run_cli(*args, env=None):
    p = subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], capture_output=True, text=True, timeout=300,
                       env=env)
    return p.returncode, p.stdout, p.stderr


def model_config_pb2():
    """Triton's ModelConfig schema from tritonclient; loaded by file when the grpc extra is not installed."""
    try:
        from tritonclient.grpc import model_config_pb2 as mc

        return mc
    except Exception:  # noqa: BLE001 - tritonclient without its grpc extra refuses the package import
        pass
    spec = importlib.util.find_spec("tritonclient")
    if spec is None:
        pytest.skip("tritonclient is not installed (pip install tritonclient): it ships Triton's config schema")
    path = Path(list(spec.submodule_search_locations)[0]) / "grpc" / "model_config_pb2.py"
    mspec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def parse_config(path):
    from google.protobuf import text_format

    mc = model_config_pb2()
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig()), mc


def stof_like_model(path, batch="batch", external=False):
    """Y = StofScale(X) @ W: one node in domain stof with a model-local function (ONNX Runtime's CPU EP runs the
    function), a dynamic batch dimension, a fixed feature dimension."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "W")
    fn = helper.make_function("stof", "StofScale", ["x"], ["y"],
                              [helper.make_node("Constant", [], ["two"], value_float=2.0),
                               helper.make_node("Mul", ["x", "two"], ["y"])],
                              [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("StofScale", ["X"], ["S"], domain="stof"), helper.make_node("MatMul", ["S", "W"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, "seq", 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, "seq", 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)],
                          functions=[fn])
    if external:
        onnx.save_model(m, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    else:
        onnx.save(m, path)
    return str(path)


def plain_model(path):
    g = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [2, 3])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [2, 3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory):
    """A libstof_ort.so that links libstof_kernels.so by name (as the real one does, RPATH $ORIGIN), built with the
    C compiler: the export must ship both."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libstof_ort.so")
    d = tmp_path_factory.mktemp("lib")
    (d / "k.c").write_text("int stof_k(void) { return 1; }\n")
    (d / "o.c").write_text("int stof_k(void);\nint RegisterCustomOps(void) { return stof_k(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libstof_kernels.so"), str(d / "k.c")], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libstof_ort.so"), str(d / "o.c"), f"-L{d}",
                    "-lstof_kernels", "-Wl,-rpath,$ORIGIN"], check=True)
    return d / "libstof_ort.so"


def env_with(**kv):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in kv.items()})
    return env


def assert_triton_layout(repo: Path, name: str):
    """Triton's documented layout: <repo>/<model>/config.pbtxt and numeric <version>/ directories holding the
    model definition file; nothing else at the repository's top level (no temporary leftovers)."""
    assert sorted(p.name for p in repo.iterdir()) == [name]
    model_dir = repo / name
    assert (model_dir / "config.pbtxt").is_file()
    subdirs = [p for p in model_dir.iterdir() if p.is_dir()]
    assert [p.name for p in subdirs] == ["1"] and all(p.name.isdigit() for p in subdirs)
    assert (model_dir / "1" / "model.onnx").is_file()
    for p in [model_dir, *model_dir.rglob("*")]:  # readable by a container's non-root user
        assert p.stat().st_mode & 0o004, p


def test_gpu_repository_config_parses_as_model_config(tmp_path, fake_library):
    src = stof_like_model(tmp_path / "m.stof.onnx")
    from stof_trt.tactic_cache import TacticCache

    cache = TacticCache(path=tmp_path / "c.json")
    cache.save(tmp_path / "c.json")
    repo = tmp_path / "repo"
    rc, out, err = run_cli("export-triton", src, "--repo", str(repo), "--name", "enc", "--max-batch", "4",
                           "--instances", "2", "--gpus", "0,1", "--dynamic-batching", "--max-queue-delay-us", "500",
                           "--tactic-cache", str(tmp_path / "c.json"), "--cuda-option", "use_tf32=0",
                           "--server-repo", "/models", "--json", env=env_with(STOF_ORT_LIB=fake_library))
    assert rc == 0, err
    info = json.loads(out)
    assert_triton_layout(repo, "enc")
    cfg, mc = parse_config(repo / "enc" / "config.pbtxt")
    assert cfg.name == "enc" and cfg.backend == "onnxruntime" and cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == 4 and cfg.default_model_filename == "model.onnx"
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("X", mc.TYPE_FP32, [-1, 8])]
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [("Y", mc.TYPE_FP32, [-1, 4])]
    (group,) = cfg.instance_group
    assert group.count == 2 and group.kind == mc.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [0, 1]
    assert cfg.HasField("dynamic_batching") and cfg.dynamic_batching.max_queue_delay_microseconds == 500
    (acc,) = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert acc.name == "cuda" and dict(acc.parameters) == {"use_tf32": "0"}
    assert list(cfg.model_operations.op_library_filename) == ["/models/enc/1/libstof_ort.so"]
    version = repo / "enc" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["libstof_kernels.so", "libstof_ort.so", "model.onnx",
                                                         "stof_tactics.json"]
    assert (version / "libstof_ort.so").read_bytes() == fake_library.read_bytes()
    assert (version / "model.onnx").read_bytes() == Path(src).read_bytes()
    assert json.loads((version / "stof_tactics.json").read_text())["format"] == \
        json.loads((tmp_path / "c.json").read_text())["format"]
    assert info["server_env"] == {"STOF_TACTIC_CACHE": "/models/enc/1/stof_tactics.json"}
    assert "STOF_TACTIC_CACHE=/models/enc/1/stof_tactics.json" in (repo / "enc" / "config.pbtxt").read_text()
    assert info["stof_nodes"] == 1 and info["libraries"] == ["libstof_ort.so", "libstof_kernels.so"]


def test_cpu_repository_with_external_data_runs_on_ort(tmp_path):
    """--cpu: KIND_CPU, no custom-op library; model.onnx and its external data sit in the version directory and
    the copied model gives the original's outputs (the STOF node runs as its function)."""
    ort = pytest.importorskip("onnxruntime")
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = stof_like_model(src_dir / "m.stof.onnx", external=True)
    before = sorted(os.listdir(src_dir))
    repo = tmp_path / "repo"
    rc, out, err = run_cli("export-triton", src, "--repo", str(repo), "--cpu", "--dynamic-batching",
                           env=env_with(STOF_ORT_LIB=tmp_path / "none.so"))
    assert rc == 0, err
    assert "model-local ONNX functions" in out and "KIND_CPU" in out
    assert sorted(os.listdir(src_dir)) == before
    assert_triton_layout(repo, "m")
    cfg, mc = parse_config(repo / "m" / "config.pbtxt")
    assert cfg.name == "m" and cfg.max_batch_size == 8 and not cfg.HasField("model_operations")
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and not cfg.instance_group[0].gpus
    assert not cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert cfg.HasField("dynamic_batching")
    assert sorted(os.listdir(repo / "m" / "1")) == ["model.onnx", "weights.bin"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32)
    a = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    b = ort.InferenceSession(str(repo / "m" / "1" / "model.onnx"), so,
                             providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    assert np.abs(a).max() > 0.1 and np.array_equal(a, b)


def test_plain_model_fixed_batch_exports_without_batching(tmp_path):
    """A model without STOF nodes exports (with a note) and needs no library; a fixed first dimension gives
    max_batch_size 0 and full dims; FP16 maps to TYPE_FP16."""
    src = plain_model(tmp_path / "relu.onnx")
    rc, out, err = run_cli("export-triton", src, "--repo", str(tmp_path / "repo"), "--json",
                           env=env_with(STOF_ORT_LIB=tmp_path / "none.so"))
    assert rc == 0, err
    info = json.loads(out)
    assert any("no STOF nodes" in n for n in info["notes"]) and info["op_library"] is None
    cfg, mc = parse_config(tmp_path / "repo" / "relu" / "config.pbtxt")
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [2, 3] and cfg.input[0].data_type == mc.TYPE_FP16
    assert not cfg.HasField("model_operations") and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU


def test_scalar_per_request_tensor_gets_reshape(tmp_path):
    g = helper.make_graph([helper.make_node("Neg", ["X"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.INT32, ["b"])],
                          [helper.make_tensor_value_info("Y", TensorProto.INT32, ["b"])])
    src = str(tmp_path / "neg.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    tx.export_repository(src, str(tmp_path / "repo"), max_batch=2)
    cfg, mc = parse_config(tmp_path / "repo" / "neg" / "config.pbtxt")
    assert list(cfg.input[0].dims) == [1] and cfg.input[0].HasField("reshape") and not cfg.input[0].reshape.shape
    assert cfg.input[0].data_type == mc.TYPE_INT32


def test_force_replaces_and_other_models_stay(tmp_path):
    src = stof_like_model(tmp_path / "m.onnx")
    repo = tmp_path / "repo"
    (repo / "other" / "1").mkdir(parents=True)
    (repo / "other" / "config.pbtxt").write_text('name: "other"\n')
    tx.export_repository(src, str(repo), cpu=True, max_batch=2)
    rc, _, err = run_cli("export-triton", src, "--repo", str(repo), "--cpu", "--max-batch", "3")
    assert rc == 2 and "exists and is not empty" in err and "--force" in err
    assert parse_config(repo / "m" / "config.pbtxt")[0].max_batch_size == 2
    rc, _, err = run_cli("export-triton", src, "--repo", str(repo), "--cpu", "--max-batch", "3", "--force")
    assert rc == 0, err
    assert parse_config(repo / "m" / "config.pbtxt")[0].max_batch_size == 3
    assert sorted(p.name for p in repo.iterdir()) == ["m", "other"]
    assert (repo / "other" / "config.pbtxt").read_text() == 'name: "other"\n'


@pytest.mark.parametrize("case", ["missing", "not_onnx", "no_library", "bad_gpus", "repeated_gpus", "gpus_cpu",
                                  "fixed_batch", "dyn_no_batch", "delay_no_dyn", "bad_name", "bad_cache",
                                  "cache_cpu", "instances", "relative_server_repo", "no_parent"])
def test_errors_are_one_line_exit_2_and_write_nothing(tmp_path, case):
    good = stof_like_model(tmp_path / "m.onnx")
    repo = tmp_path / "repo"
    args = [good, "--repo", str(repo), "--cpu"]
    env = env_with(STOF_ORT_LIB=tmp_path / "none.so")
    if case == "missing":
        args[0] = str(tmp_path / "nope.onnx")
    elif case == "not_onnx":
        (tmp_path / "bad.onnx").write_bytes(b"\x00garbage\xff" * 10)
        args[0] = str(tmp_path / "bad.onnx")
    elif case == "no_library":
        args.remove("--cpu")
    elif case == "bad_gpus":
        args += ["--gpus", "0,x"]
        args.remove("--cpu")
    elif case == "repeated_gpus":
        args += ["--gpus", "1,1"]
        args.remove("--cpu")
    elif case == "gpus_cpu":
        args += ["--gpus", "0"]
    elif case == "fixed_batch":
        args[0] = stof_like_model(tmp_path / "fixed.onnx", batch=2)
        args += ["--max-batch", "4"]
    elif case == "dyn_no_batch":
        args += ["--dynamic-batching", "--max-batch", "0"]
    elif case == "delay_no_dyn":
        args += ["--max-queue-delay-us", "10"]
    elif case == "bad_name":
        args += ["--name", "../evil"]
    elif case == "bad_cache":
        (tmp_path / "c.json").write_text("{not json")
        args += ["--tactic-cache", str(tmp_path / "c.json")]
        args.remove("--cpu")
    elif case == "cache_cpu":
        (tmp_path / "c.json").write_text("{}")
        args += ["--tactic-cache", str(tmp_path / "c.json")]
    elif case == "instances":
        args += ["--instances", "0"]
    elif case == "relative_server_repo":
        args += ["--server-repo", "models"]
    elif case == "no_parent":
        args[2] = str(tmp_path / "a" / "b" / "repo")
    src_before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    rc, out, err = run_cli("export-triton", *args, env=env)
    assert rc == 2, (rc, out, err)
    assert err.startswith("stof: error: ") and len(err.strip().splitlines()) == 1, err
    assert not repo.exists() and not (tmp_path / "a").exists()
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == src_before
    if case == "no_library":
        assert "libstof_ort.so not found" in err and "--cpu" in err


def test_missing_external_data_is_reported(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = stof_like_model(src_dir / "m.onnx", external=True)
    os.unlink(src_dir / "weights.bin")
    rc, _, err = run_cli("export-triton", src, "--repo", str(tmp_path / "repo"), "--cpu")
    assert rc == 2 and "external data file missing" in err and not (tmp_path / "repo").exists()


def test_library_dependency_missing_is_reported(tmp_path, fake_library):
    lib_dir = tmp_path / "only"
    lib_dir.mkdir()
    shutil.copy(fake_library, lib_dir / "libstof_ort.so")  # without its libstof_kernels.so
    src = stof_like_model(tmp_path / "m.onnx")
    with pytest.raises(tx.StofError, match="links libstof_kernels.so"):
        tx.export_repository(src, str(tmp_path / "repo"), library=str(lib_dir / "libstof_ort.so"))
    assert not (tmp_path / "repo").exists()


def test_config_strings_escape_control_characters():
    from stof_trt.triton.export import _q

    assert _q('a"b\\c\nd\te') == '"a\\"b\\\\c\\012d\\011e"'


def test_config_numbers_beyond_int32_are_refused(tmp_path):
    from stof_trt.errors import StofError
    from stof_trt.triton.export import parse_gpus

    with pytest.raises(StofError):
        parse_gpus("99999999999999999999")
    with pytest.raises(StofError):
        parse_gpus("\u0663")
