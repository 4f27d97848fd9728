"""Statistics of paired benchmark rounds: each round times every method once in a shuffled order, and the
per-round ratio of two methods is summarised by its median and a bootstrap interval of that median.

Pairing is why: clock and thermal drift move both sides of a round alike, while one run per method cannot tell a
1-2 % lead from the 2-4 % run-to-run spread of either side.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np

__all__ = ["FLOOR_METHODS", "REST_AFTER_FLOOR_S", "median_ci", "verdict", "time_round", "paired_ratio", "rel_err",
           "geomean", "TOL", "ROW_FACTOR", "check_output"]

# The roofline floor's ingredients (stof_trt.bench.anchors.floor_methods) run last in a round, then the GPU rests:
# the matmul holds the board at its power limit, and whatever runs right after it runs 5-20 % slower.
FLOOR_METHODS = ("copy", "matmul")
REST_AFTER_FLOOR_S = 0.5


def median_ci(x, n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Median of x and a 95 % percentile-bootstrap interval of the median."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    boots = np.median(x[rng.integers(0, len(x), size=(n_boot, len(x)))], axis=1)
    return float(np.median(x)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def verdict(lo: float, hi: float) -> str:
    """What an interval of (anchor time / STOF time) says: decided only when it lies wholly on one side of 1."""
    if lo > 1.0:
        return "STOF ahead"
    if hi < 1.0:
        return "STOF behind"
    return "tie (interval holds 1)"


def time_round(methods: dict, bench, seed) -> dict[str, float]:
    """One round: every method of `methods` ({name: callable}) timed once by bench(fn), in an order shuffled by
    seed (so that drift does not always favour the same one), the floor's ingredients (FLOOR_METHODS) last and
    followed by a rest; {name: ms}."""
    names = [n for n in methods if n not in FLOOR_METHODS]
    random.Random(seed).shuffle(names)
    last = [n for n in FLOOR_METHODS if n in methods]
    rec = {n: bench(methods[n]) for n in names + last}
    if last:
        time.sleep(REST_AFTER_FLOOR_S)
    return rec


def paired_ratio(stof, anchor, rounds: int, bench) -> dict:
    """anchor time / STOF time per round, the two timed in a shuffled order each round: the median over the rounds
    with a 95 % bootstrap interval, and every round's times."""
    per = [time_round({"stof": stof, "anchor": anchor}, bench, rd) for rd in range(rounds)]
    m, lo, hi = median_ci([t["anchor"] / t["stof"] for t in per])
    return {"rounds": rounds, "ratio": m, "lo": lo, "hi": hi, "verdict": verdict(lo, hi),
            "stof_ms": [t["stof"] for t in per], "anchor_ms": [t["anchor"] for t in per]}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| of two tensors, in float32 (NaN anywhere gives NaN, which fails any `<` check)."""
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def geomean(xs) -> float:
    """Geometric mean of the finite positive values of xs (NaN when there is none)."""
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


# An output passes when its relative error against the fp32 reference is below TOL[dtype] overall and below
# ROW_FACTOR x that in its worst row: one wrongly masked row of 8192 moves the overall error by only ~1 %, its own
# row's error by ~100 %.  fp16 outputs of these problems sit at ~3e-4, bf16's at ~8x that (3 fewer mantissa bits).
TOL = {"fp16": 2e-3, "bf16": 1.6e-2}
ROW_FACTOR = 10.0


def check_output(x, ref, dtype: str = "fp16") -> dict:
    """{"rel_err", "row_err" (worst row's ||x - ref|| / ||ref|| over the last axis), "ok"} of an output against
    its reference; NaN anywhere fails."""
    xf, rf = x.float(), ref.float()
    err = rel_err(xf, rf)
    row = float(((xf - rf).norm(dim=-1) / rf.norm(dim=-1).clamp_min(1e-30)).max())
    tol = TOL[dtype]
    ok = err < tol and row < ROW_FACTOR * tol  # NaN compares False
    return {"rel_err": err, "row_err": row, "ok": bool(ok)}
