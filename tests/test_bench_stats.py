"""The statistics of scripts/paired_anchor.py (CPU only): the median's bootstrap interval and the verdict read from it."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "paired_anchor", Path(__file__).resolve().parent.parent / "scripts" / "paired_anchor.py")
paired_anchor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired_anchor)


def test_interval_holds_the_median_and_narrows_with_rounds():
    rng = np.random.default_rng(1)
    few = 1.02 + 0.03 * rng.standard_normal(8)
    many = 1.02 + 0.03 * rng.standard_normal(200)
    m, lo, hi = paired_anchor.median_ci(few)
    assert lo <= m <= hi and m == pytest.approx(float(np.median(few)))
    m2, lo2, hi2 = paired_anchor.median_ci(many)
    assert lo2 <= m2 <= hi2
    assert hi2 - lo2 < hi - lo  # 25x the rounds: a narrower interval
    assert lo2 < 1.02 < hi2  # and one that holds the true median here


def test_verdict_needs_the_whole_interval_on_one_side_of_one():
    assert paired_anchor.verdict(1.001, 1.03) == "STOF ahead"
    assert paired_anchor.verdict(0.95, 0.999) == "STOF behind"
    assert paired_anchor.verdict(0.98, 1.014).startswith("tie")
    # a constant ratio has a zero-width interval: decided however close to 1 it is
    m, lo, hi = paired_anchor.median_ci([1.004] * 20)
    assert (m, lo, hi) == pytest.approx((1.004, 1.004, 1.004))
    assert paired_anchor.verdict(lo, hi) == "STOF ahead"


def test_a_round_times_every_method_once_in_a_seeded_order():
    calls = []
    methods = {name: name for name in "abcdef"}
    out = paired_anchor.time_round(methods, lambda fn: calls.append(fn) or len(calls), seed=3)
    assert sorted(calls) == list("abcdef") and set(out) == set(methods)
    assert [k for k, _ in sorted(out.items(), key=lambda kv: kv[1])] == calls  # timed in the order called
    calls2 = []
    paired_anchor.time_round(methods, lambda fn: calls2.append(fn) or 0.0, seed=3)
    assert calls2 == calls  # the seed fixes the order
    orders = set()
    for seed in range(20):
        c = []
        paired_anchor.time_round(methods, lambda fn: c.append(fn) or 0.0, seed=seed)
        orders.add(tuple(c))
    assert len(orders) > 1  # and the order changes between rounds


def test_floor_verdict_needs_the_whole_interval_on_one_side_of_the_target():
    assert paired_anchor.floor_verdict(1.1, 1.29) == "met"
    assert paired_anchor.floor_verdict(1.31, 1.8) == "not met"
    assert paired_anchor.floor_verdict(1.25, 1.35) == "undecided"


def test_round_times_the_floor_last_and_then_rests(monkeypatch):
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    order = []
    methods = {n: n for n in ("matmul", "stof_24_pick", "copy", "cudnn_band", "sdpa_causal")}
    for seed in range(20):  # whatever the shuffle, the matmul never runs before a method
        order.clear()
        rec = paired_anchor.time_round(methods, lambda fn: order.append(fn) or 1.0, seed)
        assert order[-2:] == ["copy", "matmul"] and sorted(order[:-2]) == ["cudnn_band", "sdpa_causal", "stof_24_pick"]
        assert set(rec) == set(methods)
    assert slept == [paired_anchor.REST_AFTER_FLOOR_S] * 20
    slept.clear()
    paired_anchor.time_round({"a": "a", "b": "b"}, lambda fn: 1.0, 0)  # no floor in the round: no rest
    assert slept == []


def test_roofline_floor_is_the_larger_of_memory_and_tile_flops():
    rd = {"copy": 0.5, "matmul": 2.0}  # ms
    bw = 2 * paired_anchor.COPY_ELEMS * 2 / 0.5e-3
    rate = 2 * paired_anchor.MATMUL_N**3 / 2.0e-3
    assert paired_anchor.roofline_floor_ms(rd, 3e8, 1e9) == pytest.approx(3e8 / bw * 1e3)  # memory-bound
    assert paired_anchor.roofline_floor_ms(rd, 1e6, 1e13) == pytest.approx(1e13 / rate * 1e3)  # FLOP-bound


@pytest.mark.parametrize("case", ["match", "differs", "refuses"])
def test_sdpa_backend_methods_keep_only_backends_that_run_and_match(monkeypatch, capsys, case):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    ref = torch.randn(1, 2, 8, 16)

    def fake_sdpa(*args, **kw):
        if case == "refuses":
            raise RuntimeError("No available kernel.")
        return ref.clone() if case == "match" else ref + 1.0

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    got = paired_anchor.sdpa_backend_methods(q, k, v, ref, where=" here")
    if case == "match":
        assert set(got) == {"sdpa_cudnn", "sdpa_flash"}
        assert torch.equal(got["sdpa_flash"](), ref)
    else:
        assert got == {}
        err = capsys.readouterr().err
        assert ("unavailable here" if case == "refuses" else "differs from the reference here") in err
