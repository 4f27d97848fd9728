"""ONNX Runtime's LongformerAttention, GroupQueryAttention and SparseAttention on its CUDA EP against their STOF
rewrites (libstof_ort) and a float64 reference of each operator's semantics, fp16, at sizes where an off-by-one in
a window or a wrong head-to-layout mapping stands far above fp16 noise (scripts/bench_ort_ops.py --sizes check).
Skips without the CUDA EP or the library."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ort = pytest.importorskip("onnxruntime")

from stof_trt import ort as sort  # noqa: E402

pytestmark = [
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="no CUDA EP"),
    pytest.mark.skipif(not sort.library_available(), reason="libstof_ort.so not built"),
]

TOL = 5e-3  # max |diff| / max |reference|, fp16


def _bench():
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_ort_ops.py"
    spec = importlib.util.spec_from_file_location("bench_ort_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("case", ["longformer_b8", "longformer_b1", "gqa_sliding", "sparse_phi3"])
def test_ort_op_on_cuda_matches_stof_rewrite_and_reference(case):
    bench = _bench()
    row = bench.device_run([case], iters=2, warmup=1, tile=(64, 64), sizes="check")[0]
    assert row["stof_vs_reference"] < TOL, row         # the rewritten model on the STOF kernels
    if row.get("spread"):
        # global tokens spread over the sequence: ONNX Runtime's CUDA LongformerAttention departs from its
        # documented semantics there (measured on the H200: 5e2 against the reference), STOF follows them
        return
    assert row["ort_vs_reference"] < TOL, row          # ORT's kernel has the semantics the rewrite assumes
    assert row["max_rel_diff"] < 2 * TOL, row
