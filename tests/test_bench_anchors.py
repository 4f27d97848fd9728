"""stof_trt.bench.anchors on the host: the roofline floor's arithmetic, the SDPA backends kept, and the cuDNN band
anchor (its float64 reference is the band the benchmark's sliding mask means; without the cuDNN wheel it fails
with one clear RuntimeError, and the benchmarks leave it out).  The cuDNN kernel itself runs only on a GPU
(scripts/bench_attention.py's sliding cells)."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stof_trt.bench import anchors  # noqa: E402
from stof_trt.format import compile_mask  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402


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
    got = anchors.band_reference64(q, k, v, window, b=1, h=2)
    assert got.dtype == torch.float64
    assert torch.allclose(got, expect, rtol=1e-12, atol=1e-12)
    # a band one narrower is a different answer: the check above could fail
    narrower = anchors.band_reference64(q, k, v, window - 1, b=1, h=2)
    assert not torch.allclose(narrower, expect, rtol=1e-6, atol=1e-6)


def test_anchor_without_the_wheel_is_one_clear_error():
    try:
        import cudnn  # noqa: F401
    except Exception:  # noqa: BLE001 -- absent (CI), or present without a cuDNN library to load
        pass
    else:
        pytest.skip("nvidia-cudnn-frontend is installed here")
    q, k, v = _qkv(64, 16, seed=1)
    ref = anchors.band_reference64(q, k, v, 8)[None, None].expand(2, 3, 64, 16)
    with pytest.raises(RuntimeError, match="nvidia-cudnn-frontend is not usable here"):
        anchors.band_anchor(q, k, v, 8, ref)
    cb, why = anchors.try_band_anchor(q, k, v, 8, ref)
    assert cb is None and "not usable" in why


class _FakeBand:
    """Stands in for CudnnBand on the CPU: the band i - left < j <= i + right (or, with inclusive=True,
    i - left <= j <= i + right), in float32; autotune may break the output, as a wrong plan would."""

    inclusive = False
    break_on_tune = False
    refuse = False

    def __init__(self, q, k, v, left, right):
        if self.refuse:
            raise ValueError("graph not supported")
        self.q, self.k, self.v, self.left, self.right = q, k, v, left, right
        self.out = torch.empty_like(q)
        self.plan, self.plan_ms, self.broken = "fake", {}, False

    def autotune(self):
        self.broken = self.break_on_tune

    def __call__(self):
        S = self.q.shape[2]
        i = torch.arange(S)
        d = i[None, :] - i[:, None]  # j - i
        lo = -self.left if self.inclusive else -self.left + 1
        allowed = (d >= lo) & (d <= self.right)
        s = self.q @ self.k.transpose(-1, -2) / math.sqrt(self.q.shape[-1])
        s = s.masked_fill(~allowed, float("-inf"))
        self.out.copy_(torch.softmax(s, -1) @ self.v)
        if self.broken:
            self.out.mul_(1.01)
        return self.out


@pytest.fixture
def fake_cudnn(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    for attr in ("inclusive", "break_on_tune", "refuse"):
        monkeypatch.setattr(_FakeBand, attr, False)
    monkeypatch.setattr(anchors, "CudnnBand", _FakeBand)
    return _FakeBand


@pytest.mark.parametrize("inclusive", [False, True])
def test_anchor_settles_the_bound_convention(fake_cudnn, inclusive):
    fake_cudnn.inclusive = inclusive
    q, k, v = _qkv(96, 16, seed=3)
    window = 12
    ref = torch.stack([torch.stack([anchors.band_reference64(q, k, v, window, b, h) for h in range(3)])
                       for b in range(2)]).float()
    cb = anchors.band_anchor(q, k, v, window, ref)
    assert cb.left == (window if inclusive else window + 1) and cb.right == window
    assert cb.rel_err < 1e-5 and cb.rel_err64 < 1e-5


def test_anchor_rejects_a_plan_that_breaks_after_tuning(fake_cudnn):
    fake_cudnn.break_on_tune = True
    q, k, v = _qkv(64, 16, seed=4)
    ref = torch.stack([torch.stack([anchors.band_reference64(q, k, v, 5, b, h) for h in range(3)])
                       for b in range(2)]).float()
    with pytest.raises(RuntimeError, match="differs after tuning"):
        anchors.band_anchor(q, k, v, 5, ref)


def test_anchor_names_cudnn_errors_and_wrong_answers(fake_cudnn):
    q, k, v = _qkv(64, 16, seed=5)
    ref = torch.zeros(2, 3, 64, 16) + 1.0  # no band's answer
    with pytest.raises(RuntimeError, match=r"left=6: rel err .*; left=5: rel err"):
        anchors.band_anchor(q, k, v, 5, ref)
    fake_cudnn.refuse = True
    cb, why = anchors.try_band_anchor(q, k, v, 5, ref)
    assert cb is None and "cuDNN error ValueError: graph not supported" in why


def test_roofline_floor_is_the_larger_of_memory_and_tile_flops():
    rd = {"copy": 0.5, "matmul": 2.0}  # ms
    bw = 2 * anchors.COPY_ELEMS * 2 / 0.5e-3
    rate = 2 * anchors.MATMUL_N**3 / 2.0e-3
    assert anchors.roofline_floor_ms(rd, 3e8, 1e9) == pytest.approx(3e8 / bw * 1e3)  # memory-bound
    assert anchors.roofline_floor_ms(rd, 1e6, 1e13) == pytest.approx(1e13 / rate * 1e3)  # FLOP-bound


def test_floor_inputs_of_an_attention_problem():
    assert anchors.attention_bytes(8, 12, 4096, 64) == 4 * 8 * 12 * 4096 * 64 * 2  # q, k, v, o in fp16
    lay = compile_mask("causal", 256, 256, tile_m=64, tile_n=64)
    assert lay.nnz == 10  # the 4 + 3 + 2 + 1 tiles on and below the diagonal
    assert anchors.tile_flops(lay, 2, 3, 64) == 4.0 * 2 * 3 * 64 * 10 * 64 * 64


@pytest.mark.parametrize("case", ["match", "differs", "refuses"])
def test_sdpa_backend_methods_keep_only_backends_that_run_and_match(monkeypatch, capsys, case):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    ref = torch.randn(1, 2, 8, 16)

    def fake_sdpa(*args, **kw):
        if case == "refuses":
            raise RuntimeError("No available kernel.")
        return ref.clone() if case == "match" else ref + 1.0

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    got = anchors.sdpa_backend_methods(q, k, v, ref, where=" here")
    if case == "match":
        assert set(got) == {"sdpa_cudnn", "sdpa_flash"}
        assert torch.equal(got["sdpa_flash"](), ref)
    else:
        assert got == {}
        err = capsys.readouterr().err
        assert ("unavailable here" if case == "refuses" else "differs from the reference here") in err


# --- FA4 and FlexAttention anchors: argument mapping (the kernels themselves run only on a GPU) ----------------

def test_which_anchor_computes_which_mask():
    assert anchors.anchors_for("causal") == ("fa4", "flex_fa4", "flex", "sdpa_causal", "sdpa_cudnn", "sdpa_flash",
                                             "sdpa_mask")
    assert anchors.anchors_for("sliding") == ("fa4", "flex_fa4", "flex", "sdpa_mask", "cudnn_band")
    for m in ("dilated", "longformer", "bigbird"):  # no native kernel: FlexAttention's two backends and SDPA+mask
        assert anchors.anchors_for(m) == ("flex_fa4", "flex", "sdpa_mask")


def _fa4_keeps(kw, S):
    """The (query, key) pairs FA4 keeps under flash_attn_func's kwargs: causal keeps j <= i; window_size
    (left, right) keeps i - left <= j <= i + right (flash_attn/cute's convention, causal = (None, 0))."""
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    if kw.get("causal"):
        return j <= i
    left, right = kw["window_size"]
    return (j >= i - left) & (j <= i + right)


@pytest.mark.parametrize("name,spec", [("causal", "causal"), ("sliding", "sliding:window=128"),
                                       ("sliding", "sliding:left=64,right=0")])
def test_fa4_arguments_mean_the_mask(name, spec):
    mask = parse_mask(spec)
    kw = anchors.fa4_kwargs(name, mask)
    assert set(kw) <= {"causal", "window_size"}
    S = 300
    assert (_fa4_keeps(kw, S) == mask.dense(S, S)).all()
    if name == "sliding" and spec.endswith("128"):
        assert kw == {"window_size": (128, 128)}
    if name == "causal":
        assert kw == {"causal": True}


@pytest.mark.parametrize("name", ["dilated", "longformer", "bigbird"])
def test_fa4_has_no_native_form_of_the_other_masks(name):
    from stof_trt.bench.masks import MASKS

    with pytest.raises(anchors.AnchorUnavailable, match=f"no native form of {name}"):
        anchors.fa4_kwargs(name, parse_mask(MASKS[name]))


def test_fa4_without_the_package_is_one_clear_error():
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 -- absent here (CI)
        pass
    else:
        pytest.skip("flash-attn-4 is installed here")
    q, k, v = _qkv(64, 16, seed=2)
    with pytest.raises(anchors.AnchorUnavailable, match="flash-attn-4 is not usable here"):
        anchors.fa4_method(q, k, v, "causal", parse_mask("causal"))


def test_fa4_layout_round_trip():
    q, _, _ = _qkv(40, 8, seed=4)
    t = anchors.to_bshd(q)
    assert t.shape == (2, 40, 3, 8) and t.is_contiguous()
    assert torch.equal(t[1, 7, 2], q[1, 2, 7])
    assert torch.equal(t.transpose(1, 2), q)  # fa4_method's output view back to [B, H, S, D]


def test_flex_arguments():
    bm = object()
    assert anchors.flex_kwargs("flex", bm) == {"block_mask": bm}  # Triton: FlexAttention's default backend
    kw = anchors.flex_kwargs("flex_fa4", bm)
    assert kw == {"block_mask": bm, "kernel_options": {"BACKEND": "FLASH"}} and kw["block_mask"] is bm
    kw["kernel_options"]["BACKEND"] = "TRITON"  # each call gets its own dict
    assert anchors.FLEX_KERNEL_OPTIONS["flex_fa4"] == {"BACKEND": "FLASH"}
    with pytest.raises(KeyError, match="no FlexAttention anchor named 'flex_fa3'"):
        anchors.flex_kwargs("flex_fa3", bm)
    seen = {}

    def fake_flex(q, k, v, **kw):
        seen.update(kw, q=q)
        return q

    q, k, v = _qkv(16, 8, seed=5)
    fn = anchors.flex_method(fake_flex, q, k, v, "flex_fa4", bm)
    assert fn() is q and seen["kernel_options"] == {"BACKEND": "FLASH"} and seen["block_mask"] is bm
