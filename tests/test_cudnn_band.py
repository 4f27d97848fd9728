"""scripts/cudnn_band.py on the host: its float64 reference is the band the benchmark's sliding mask means, and
without the cuDNN wheel the anchor fails with one clear RuntimeError (the benchmarks then leave it out).  The
kernel itself runs only on the GPU machine (scripts/cudnn_band.py, docs/bench/session29.md)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stof_trt.masks import parse_mask  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("cudnn_band", ROOT / "scripts" / "cudnn_band.py")
cudnn_band = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cudnn_band)


def _qkv(S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, S, D, generator=g, dtype=torch.float32) for _ in range(3)]


@pytest.mark.parametrize("S,window", [(37, 5), (64, 1), (130, 128), (200, 64)])
def test_reference64_is_the_sliding_mask(S, window):
    q, k, v = _qkv(S, 16, seed=S + window)
    dense = parse_mask(f"sliding:window={window}").dense(S, S)
    s = q[1, 2].double() @ k[1, 2].double().T / math.sqrt(16)
    s[~torch.from_numpy(np.asarray(dense, dtype=bool))] = float("-inf")
    expect = torch.softmax(s, -1) @ v[1, 2].double()
    got = cudnn_band.band_reference64(q, k, v, window, b=1, h=2)
    assert got.dtype == torch.float64
    assert torch.allclose(got, expect, rtol=1e-12, atol=1e-12)
    # a band one narrower is a different answer: the check above could fail
    narrower = cudnn_band.band_reference64(q, k, v, window - 1, b=1, h=2)
    assert not torch.allclose(narrower, expect, rtol=1e-6, atol=1e-6)


def test_anchor_without_the_wheel_is_one_clear_error():
    try:
        import cudnn  # noqa: F401
    except Exception:  # noqa: BLE001 -- absent (CI), or present without a cuDNN library to load
        pass
    else:
        pytest.skip("nvidia-cudnn-frontend is installed here")
    q, k, v = _qkv(64, 16, seed=1)
    ref = cudnn_band.band_reference64(q, k, v, 8)[None, None].expand(2, 3, 64, 16)
    with pytest.raises(RuntimeError, match=r"no cuDNN band matches \|q-k\| <= 8: left=9: refused"):
        cudnn_band.band_anchor(q, k, v, 8, ref)
