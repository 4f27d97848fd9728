"""ONNX Runtime's LongformerAttention, GroupQueryAttention and SparseAttention on its CUDA EP against their STOF
rewrites (libstof_ort) and a float64 reference of each operator's semantics, fp16, at sizes where an off-by-one in
a window or a wrong head-to-layout mapping stands far above fp16 noise (scripts/bench_ort_ops.py --sizes check).
Skips without the CUDA EP or the library."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ort = pytest.importorskip("onnxruntime")

from _ort_cuda import NEEDS_ORT_CUDA  # noqa: E402

from stof_trt import ort as sort  # noqa: E402

pytestmark = NEEDS_ORT_CUDA

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


def test_longformer_rewrite_on_cuda_padded_globals_holes_and_overflow():
    """The rewritten LongformerAttention on the STOF kernels (libstof_ort) against the float64 reference: padded
    global tokens and key holes (sequence 0), global tokens spread up to the last position (sequence 1), and more
    unmasked global tokens than slots (sequence 2: every output NaN, the slot rows' NaN reaching every row)."""
    import numpy as np

    bench = _bench()
    case = dict(bench.CHECK["longformer_b8"], B=3)
    model = bench.build(case, fp16=True)
    new, _ = bench.rewrite(model, (64, 64))
    f = bench.feeds_for(case, fp16=True)
    B, S = case["B"], case["S"]
    rng = np.random.default_rng(5)
    glob = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S), np.float16)
    glob[0, [0, 3, 100, 101, 300, 511]] = 1
    mask[0, [3, 200, 300, 450]] = -10000.0   # two padded global tokens, two padded band keys
    mask[0, 480:] = -10000.0                 # a padded tail holding a global token
    glob[1, rng.choice(S, 40, replace=False)] = 1
    glob[1, S - 1] = 1
    glob[2, rng.choice(S, 65, replace=False)] = 1   # 65 > 64 slots
    f.update({"mask": mask, "global": glob})
    got = sort.session(new, providers="cuda", register=True).run(None, f)[0].astype(np.float64)
    ref = bench.reference(case, model, f)
    valid = mask[:2] >= 0
    assert np.isfinite(got[:2][valid]).all()
    assert bench.rel_diff(got[:2][valid], ref[:2][valid]) < TOL
    assert np.isnan(got[2]).all()
