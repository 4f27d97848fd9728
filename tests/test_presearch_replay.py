"""The pre-search against recorded H100 runs (CPU only): its first choice within 10 % of the best measured tactic,
replayed by scripts/presearch_fit.py, and calibrate's fit of the catalogue's constants (plugins_cu/tactics.toml)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from stof_trt import _tactics, presearch

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "data"
_spec = importlib.util.spec_from_file_location("presearch_fit", ROOT / "scripts" / "presearch_fit.py")
presearch_fit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(presearch_fit)

# cells whose first choice is within 10 % of the best, per recorded run (tests/data/README.md says which kernels
# each one timed), with the catalogue's constants; a change of the model or of the constants must keep every one
# (scripts/presearch_fit.py prints the misses)
HITS = {
    "h100_d64_3552491.json": 25, "h100_d64_d128_c9f344e.json": 50, "h100_d64_6e263a6.json": 25, "h100_d64_cb6d33d.json": 25,
    "h100_d64_71ae7b3.json": 25, "h100_d64_8409f2d.json": 25, "h100_d64_a7eb448.json": 25, "h100_d64_e47c94c.json": 25,
    "h100_d64_f5301ee.json": 25, "h100_d128_c6991ec.json": 25, "h100_d128_d20d29b.json": 25, "h100_d128_085a85f.json": 25,
    "h100_sliding_f4d7123.json": 10, "h100_shortkeys_a.json": 4, "h100_shortkeys_b.json": 6,
    "h100_heldout_a.json": 4, "h100_heldout_b.json": 3, "h200_d128_2353f1d.json": 15,
}


@pytest.mark.parametrize("run", sorted(HITS))
def test_first_choice_hits_recorded_runs(run):
    rows = presearch_fit.replay(str(RUNS / run))
    assert sum(r["hit"] for r in rows) == HITS[run], presearch_fit.summary(rows)


def test_replay_names_a_miss(tmp_path):
    """A run where the model's first choice is slow is a miss, with its ratio."""
    res = json.loads((RUNS / "h100_heldout_b.json").read_text())
    cell = res["cells"][0]
    first = presearch_fit.replay(str(RUNS / "h100_heldout_b.json"))[0]["pick"]
    cell["measured_ms"] = {n: 1.0 for n in cell["measured_ms"]}
    cell["measured_ms"][first] = 1.5
    res["cells"] = [cell]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res))
    (row,) = presearch_fit.replay(str(path))
    assert not row["hit"] and row["ratio"] == pytest.approx(1.5)
    assert "1.50x" in presearch_fit.summary([row])


@pytest.mark.parametrize("relative", [False, True])
def test_calibrate_recovers_the_model_constants(tmp_path, relative):
    """Times made by the model's own form from known constants come back from the fit, over Sq = Sk and Sq != Sk
    cells alike."""
    true = (1.4, 1.9, 3.2, 12.0)
    B, H, D = 8, 12, 64
    name = presearch._BY_ID[15].name
    cells = []
    for spec, S, Sk in [("causal", 512, 512), ("causal", 1024, 1024), ("sliding:window=128", 1024, 1024),
                        ("full", 1024, 128), ("full", 2048, 192), ("sliding:window=64", 2048, 2048)]:
        cell = {"D": D, "S": S, "Sk": Sk, "spec": spec, "mask": spec}
        x = presearch.terms(presearch.cell_layout(cell), 15, batch=B, heads=H, head_dim=D, seq_q=S)
        cell["measured_ms"] = {name: float(x @ np.array(true)) / 1e3}
        cells.append(cell)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"summary": {"batch": B, "heads": H}, "cells": cells}))
    coef = presearch.calibrate([path], keys={(15, 64)}, relative=relative)
    assert set(coef) == {(15, 64)}
    assert coef[(15, 64)] == pytest.approx(true, rel=1e-3)


@pytest.mark.parametrize("fit", [f for f in _tactics.COEF_FITS if f[3]],
                         ids=lambda f: ",".join(f"{t}:{d}" for t, d in f[0]))
def test_constants_come_from_their_runs(fit):
    """Every [[fit]] of the catalogue marked reproduced: its calibrate call on its runs gives the constants."""
    keys, runs, call, _ = fit
    got = presearch.calibrate([RUNS / r for r in runs], keys=set(keys), relative="relative=True" in call)
    for k in keys:
        assert got[k] == pytest.approx(presearch.COEF[k], abs=2e-5), k


def test_relative_fit_keeps_a_per_cta_cost():
    """(15, 64) and (16, 64) are fitted on relative errors: the plain fit on the same runs has no per-CTA cost
    (the cause of their misses with few keys per row)."""
    keys = {(15, 64), (16, 64)}
    runs = next(f[1] for f in _tactics.COEF_FITS if set(f[0]) == keys)
    plain = presearch.calibrate([RUNS / r for r in runs], keys=keys)
    assert all(plain[k][2] < 1.0 < presearch.COEF[k][2] for k in keys)


def test_fit_script_rejects_bad_arguments(tmp_path, capsys):
    import sys

    sliding = str(RUNS / "h100_sliding_f4d7123.json")
    (tmp_path / "not.json").write_text("{")
    (tmp_path / "other.json").write_text('{"argv": [], "clock_mhz": 1980}')
    for argv, msg in [(["--runs", str(tmp_path / "none.json")], "no such run"),
                      (["--runs", str(tmp_path / "not.json")], "cannot read"),
                      (["--runs", str(tmp_path / "other.json")], "is not a benchmark run"),
                      (["--runs", sliding, "--fit-runs", str(RUNS / "README.md")], "cannot read"),
                      (["--runs", sliding, "--fit", "15"], "cannot fit"),
                      (["--runs", sliding, "--fit", "12:64"], "cannot fit"),  # row-wise: no constants
                      (["--runs", sliding, "--fit", "x:y"], "TACTIC:HEAD_DIM")]:
        old = sys.argv
        sys.argv = ["presearch_fit.py", *argv]
        try:
            with pytest.raises(SystemExit) as e:
                presearch_fit.main()
        finally:
            sys.argv = old
        assert msg in str(e.value)
