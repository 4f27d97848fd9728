"""stof_trt.bench.stats (CPU only): the median's bootstrap interval, the verdict read from it, and the rounds."""

import math

import numpy as np
import pytest

from stof_trt.bench import stats


def test_interval_holds_the_median_and_narrows_with_rounds():
    rng = np.random.default_rng(1)
    few = 1.02 + 0.03 * rng.standard_normal(8)
    many = 1.02 + 0.03 * rng.standard_normal(200)
    m, lo, hi = stats.median_ci(few)
    assert lo <= m <= hi and m == pytest.approx(float(np.median(few)))
    m2, lo2, hi2 = stats.median_ci(many)
    assert lo2 <= m2 <= hi2
    assert hi2 - lo2 < hi - lo  # 25x the rounds: a narrower interval
    assert lo2 < 1.02 < hi2  # and one that holds the true median here


def test_verdict_needs_the_whole_interval_on_one_side_of_one():
    assert stats.verdict(1.001, 1.03) == "STOF ahead"
    assert stats.verdict(0.95, 0.999) == "STOF behind"
    assert stats.verdict(0.98, 1.014).startswith("tie")
    # a constant ratio has a zero-width interval: decided however close to 1 it is
    m, lo, hi = stats.median_ci([1.004] * 20)
    assert (m, lo, hi) == pytest.approx((1.004, 1.004, 1.004))
    assert stats.verdict(lo, hi) == "STOF ahead"


def test_a_round_times_every_method_once_in_a_seeded_order():
    calls = []
    methods = {name: name for name in "abcdef"}
    out = stats.time_round(methods, lambda fn: calls.append(fn) or len(calls), seed=3)
    assert sorted(calls) == list("abcdef") and set(out) == set(methods)
    assert [k for k, _ in sorted(out.items(), key=lambda kv: kv[1])] == calls  # timed in the order called
    calls2 = []
    stats.time_round(methods, lambda fn: calls2.append(fn) or 0.0, seed=3)
    assert calls2 == calls  # the seed fixes the order
    orders = set()
    for seed in range(20):
        c = []
        stats.time_round(methods, lambda fn: c.append(fn) or 0.0, seed=seed)
        orders.add(tuple(c))
    assert len(orders) > 1  # and the order changes between rounds


def test_round_times_the_floor_last_and_then_rests(monkeypatch):
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    order = []
    methods = {n: n for n in ("matmul", "stof_24_pick", "copy", "cudnn_band", "sdpa_causal")}
    for seed in range(20):  # whatever the shuffle, the matmul never runs before a method
        order.clear()
        rec = stats.time_round(methods, lambda fn: order.append(fn) or 1.0, seed)
        assert order[-2:] == ["copy", "matmul"] and sorted(order[:-2]) == ["cudnn_band", "sdpa_causal", "stof_24_pick"]
        assert set(rec) == set(methods)
    assert slept == [stats.REST_AFTER_FLOOR_S] * 20
    slept.clear()
    stats.time_round({"a": "a", "b": "b"}, lambda fn: 1.0, 0)  # no floor in the round: no rest
    assert slept == []


def test_paired_ratio_is_anchor_over_stof_per_round(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    # per round (STOF ms, anchor ms): the anchor 10 % slower, one round with a slow STOF outlier
    rounds = [(1.0, 1.1)] * 6 + [(3.0, 1.1)]
    calls = []

    def method(side):
        def fn():
            calls.append(side)
            return rounds[(len(calls) - 1) // 2][side]  # both methods of a round read that round's times
        return fn

    res = stats.paired_ratio(method(0), method(1), len(rounds), lambda fn: fn())
    assert sorted(calls) == [0] * 7 + [1] * 7
    assert res["stof_ms"] == [r[0] for r in rounds] and res["anchor_ms"] == [r[1] for r in rounds]
    assert res["ratio"] == pytest.approx(1.1)  # the median ignores the outlier round
    assert res["lo"] <= res["ratio"] <= res["hi"] and res["verdict"] == "STOF ahead"


def test_rel_err_and_geomean():
    torch = pytest.importorskip("torch")
    ref = torch.ones(4)
    assert stats.rel_err(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-5)
    assert math.isnan(stats.rel_err(torch.full((4,), float("nan")), ref))
    assert stats.geomean([1.0, 4.0, float("nan"), 0.0, None]) == pytest.approx(2.0)
    assert math.isnan(stats.geomean([]))


def test_check_output_catches_one_wrong_row():
    torch = pytest.importorskip("torch")
    from stof_trt.bench.stats import TOL, check_output

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 4, 1024, 64, generator=g)
    assert check_output(ref.half(), ref)["ok"] and check_output(ref.half(), ref)["rel_err"] < 1e-3
    good = ref.bfloat16()
    c = check_output(good, ref, "bf16")
    assert c["ok"] and c["rel_err"] < TOL["bf16"]
    bad = good.clone()
    bad[1, 2, 100] = 0  # one row of 16384 not written: the overall error stays under bf16's tolerance
    c = check_output(bad, ref, "bf16")
    assert c["rel_err"] < TOL["bf16"] and c["row_err"] == pytest.approx(1.0) and not c["ok"]
    nan = ref.half()
    nan[0, 0, 0, 0] = float("nan")
    assert not check_output(nan, ref)["ok"]
