"""scripts/bench_host_time.py on the CPU: its chains are valid models whose GEMM count is what the per-node
arithmetic assumes, and the built-in chains compute what they say (the STOF chain needs the GPU library)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_host_time.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_host_time_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind,per_gemm", [("stof", {"StofGemmEpilogue": 1}), ("matmul", {"MatMul": 1}),
                                           ("matmul_add", {"MatMul": 1, "Add": 1})])
def test_chains_are_valid_and_have_one_gemm_per_link(script, kind, per_gemm):
    m = script.chain_model(kind, 5, m=4, k=16)
    onnx.checker.check_model(m, full_check=kind != "stof")
    counts = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    assert counts == {op: 5 * c for op, c in per_gemm.items()}


def test_builtin_chain_computes_its_product(script):
    m = script.chain_model("matmul_add", 3, m=4, k=16)
    w = [onnx.numpy_helper.to_array(t).astype(np.float32) for t in m.graph.initializer if t.name.startswith("w")]
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float16)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = s.run(None, {"x": x})[0].astype(np.float32)
    want = x.astype(np.float32) @ w[0] @ w[1] @ w[2]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)


def test_bad_arguments_exit_2(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_host_time.py", "--nodes", "1"])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 2 and "--nodes must be >= 2" in capsys.readouterr().err
