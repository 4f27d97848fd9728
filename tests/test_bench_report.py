"""stof_trt.bench.report: the JSON records carry exactly issue 38's keys first, and the summary's arithmetic
(ratios, geomeans per head dim, counts against each target) is right on synthetic cells with known answers."""
from __future__ import annotations

import json

import pytest

from stof_trt.bench import report
from stof_trt.bench.report import REQUIRED_KEYS


def _cell(D, S, mask, default, tuned, best, anchors, **extra):
    return {"D": D, "S": S, "mask": mask, "stof_default_ms": default, "stof_tuned_ms": tuned, "stof_best_ms": best,
            "anchors": anchors, "rel_err": 3e-4, **extra}


def test_fastest_anchor_skips_missing_times():
    assert report.fastest_anchor({"fa4": 0.5, "flex": 0.4, "sdpa_mask": float("nan"), "x": None}) == ("flex", 0.4)
    assert report.fastest_anchor({"flex": None}) == (None, None)
    assert report.fastest_anchor({}) == (None, None)


def test_ratios_are_anchor_over_stof():
    c = _cell(64, 2048, "causal", 2.0, 0.5, 0.4, {"fa4": 1.0, "flex": 3.0})
    assert report.cell_ratios(c) == {"default": 0.5, "tuned": 2.0, "best": 2.5}
    c = _cell(64, 2048, "causal", 2.0, None, 0.4, {})
    assert report.cell_ratios(c) == {"default": None, "tuned": None, "best": None}
    assert report.first_choice_hit(_cell(64, 1, "causal", 1.10, None, 1.0, {})) is True
    assert report.first_choice_hit(_cell(64, 1, "causal", 1.11, None, 1.0, {})) is False
    assert report.first_choice_hit(_cell(64, 1, "causal", None, None, 1.0, {})) is None


def _grid():
    """30 cells: at D=64 every tuned ratio is 2.0 except one at 1.0; at D=128 all 1.2; the default path is at
    1.0x in all but three cells (0.8x), and its choice is 1.2x the best in those three."""
    cells = []
    for D in (64, 128):
        for S in (2048, 4096, 8192):
            for m in ("causal", "sliding", "dilated", "longformer", "bigbird"):
                tuned_x = 1.2 if D == 128 else (1.0 if (S, m) == (4096, "causal") else 2.0)
                slow = D == 128 and m == "causal"
                best = 1.0
                cells.append(_cell(D, S, m, 1.2 if slow else 1.0, 1.0, best,
                                   {"fa4": tuned_x * 1.0, "flex": 10.0} if m in ("causal", "sliding")
                                   else {"flex_fa4": tuned_x, "sdpa_mask": float("nan")},
                                   stof_default_tactic="t1"))
                if slow:  # the default is 1.2x best and the anchor 0.96 / 1.2 = 0.8x it
                    cells[-1]["anchors"] = {"fa4": 0.96}
                    cells[-1]["stof_tuned_ms"] = 0.8
    return cells


def test_summary_counts_and_geomeans():
    cells = _grid()
    s = report.summarize(cells)
    assert s["cells"] == 30
    d64, d128 = s["per_D"][64], s["per_D"][128]
    assert d64["geomean_tuned"] == pytest.approx(2.0 ** (14 / 15))
    assert d64["min_tuned"] == pytest.approx(1.0)
    # D=128: 12 cells at 1.2, three causal at 0.96 / 0.8 = 1.2: all 1.2
    assert d128["geomean_tuned"] == pytest.approx(1.2)
    assert d128["geomean_default"] == pytest.approx((1.2 ** 12 * 0.8 ** 3) ** (1 / 15))
    assert s["tuned_cells"]["judged"] == 30 and s["tuned_cells"]["met"] == 29
    assert s["tuned_cells"]["below"] == ["D=64 S=4096 causal: 1.000"]
    assert s["tuned_cells_floor"]["met"] == 30
    assert s["default_cells"]["met"] == 27 and len(s["default_cells"]["below"]) == 3
    assert s["first_choice"] == {"within": 0.1, "judged": 30, "hits": 27, "needed": 27,
                                 "misses": [f"D=128 S={S} causal: 1.200x best" for S in (2048, 4096, 8192)]}
    t = s["targets"]
    assert t["tuned_every_cell"] is False  # one cell at 1.0x
    assert t["tuned_geomean"] is False  # D=128 at 1.2 < 1.3
    assert t["default_every_cell"] is False
    assert t["first_choice"] is True  # 27 of 30
    assert t["not_resolved_floor_met"] is True  # every cell >= 0.95, geomeans >= 1.35 / 1.15


def test_targets_met_and_not_judged():
    cells = [_cell(D, 2048, "causal", 1.0, 1.0, 1.0, {"fa4": 2.0}) for D in (64, 128)]
    t = report.summarize(cells)["targets"]
    assert t == {"tuned_every_cell": True, "tuned_geomean": True, "default_every_cell": True, "first_choice": True,
                 "not_resolved_floor_met": True}
    for c in cells:
        c["stof_tuned_ms"] = None  # a library without first-use timing: nothing to judge, not a pass
    t = report.summarize(cells)["targets"]
    assert t["tuned_every_cell"] is None and t["tuned_geomean"] is None and t["not_resolved_floor_met"] is None
    assert t["default_every_cell"] is True
    # a cell without any anchor is not judged, so "every cell" is not met
    cells.append(_cell(64, 4096, "bigbird", 1.0, 1.0, 1.0, {}))
    assert report.summarize(cells)["targets"]["default_every_cell"] is False


def test_written_json_has_the_issue_keys(tmp_path):
    cells = _grid()[:2]
    cells[0]["anchors"]["flex"] = float("nan")
    cells[0]["anchor_rel_err"] = {"fa4": 2.9e-4}
    summary = report.write_results(cells, tmp_path, meta={"gpu": "H200", "batch": 8, "heads": 12})
    recs = json.loads((tmp_path / "attention.json").read_text())
    assert isinstance(recs, list) and len(recs) == 2
    for r in recs:
        assert tuple(r)[:8] == REQUIRED_KEYS == ("D", "S", "mask", "stof_default_ms", "stof_tuned_ms",
                                                 "stof_best_ms", "anchors", "rel_err")
        assert isinstance(r["anchors"], dict)
    assert recs[0]["anchors"]["flex"] is None  # strict JSON: NaN written as null
    assert recs[0]["fastest_anchor"] == ["fa4", 2.0] and recs[0]["anchor_rel_err"] == {"fa4": 2.9e-4}
    assert recs[0]["ratios"] == {"default": 2.0, "tuned": 2.0, "best": 2.0}
    run = json.loads((tmp_path / "attention-run.json").read_text())
    assert run["meta"]["gpu"] == "H200" and run["summary"]["batch"] == 8 and len(run["cells"]) == 2
    assert run["summary"]["per_D"]["64"]["cells"] == summary["per_D"][64]["cells"] == 2
    md = (tmp_path / "attention.md").read_text()
    assert "| 64 | 2048 | causal | 1.000 (t1) | 1.000 | 1.000 | 2.000 (fa4) | 2.00 | 2.00 |" in md
    assert "First choice within 10% of STOF's best tactic: 2 of 2 cells (needed 2)" in md


def test_a_cell_without_a_required_key_is_refused(tmp_path):
    c = _grid()[0]
    del c["rel_err"]
    with pytest.raises(KeyError, match="lacks rel_err"):
        report.write_results([c], tmp_path)


def test_clean_replaces_non_finite():
    assert report.clean({"a": [1.0, float("inf"), {"b": float("nan")}], 3: 2}) == {"a": [1.0, None, {"b": None}],
                                                                                   "3": 2}


def test_bf16_against_fp16(tmp_path):
    fp16 = [_cell(64, S, "causal", 1.0, 0.5, 0.5, {"fa4": 1.0}) for S in (2048, 4096, 8192)]
    bf16 = [_cell(64, S, "causal", 1.0, t, 0.5, {"fa4": 1.0}) for S, t in ((2048, 0.51), (4096, 0.5), (8192, 0.52))]
    bf16.append(_cell(128, 2048, "causal", 1.0, 0.5, 0.5, {"fa4": 1.0}))  # not in the fp16 run: not compared
    cm = report.compare_runs(bf16, fp16)
    assert cm["cells"] == 3 and cm["max"] == pytest.approx(1.04)
    assert cm["geomean"] == pytest.approx((1.02 * 1.0 * 1.04) ** (1 / 3))
    assert cm["beyond"] == ["D=64 S=8192 causal: 1.040"] and cm["met"] is False
    (tmp_path / "fp16.json").write_text(json.dumps(fp16))
    report.write_results(bf16, tmp_path / "bf16", against=tmp_path / "fp16.json")
    md = (tmp_path / "bf16" / "attention.md").read_text()
    assert "STOF times against fp16.json" in md and "within 3%: **no**" in md
