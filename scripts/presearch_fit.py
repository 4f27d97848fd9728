#!/usr/bin/env python3
"""Replay the pre-search on recorded benchmark runs, and refit some of its constants (CPU only).

    python scripts/presearch_fit.py --runs tests/data/h100_d64_f5301ee.json
    python scripts/presearch_fit.py --runs RUN1.json,RUN2.json --fit 15:64,16:64 --fit-runs RUN1.json,RUN3.json

A run is a scripts/bench_attention.py JSON (tests/data/ holds the recorded ones): per
cell, every tactic the benchmark timed.  The replay ranks each cell's tactics with stof_trt.presearch (the H100
properties) and counts the cells where the first choice's measured time is within 10 % of the best measured one;
the first choice is taken among the tactics the run timed (a tactic added to the catalogue after the run has no
time there).  With --fit, the listed (tactic, head dim) constants are refitted by presearch.calibrate on --fit-runs (default: --runs) and every run is replayed with the
refitted entries beside the catalogue's; to keep them, paste the printed entries into the tactics' coef in
plugins_cu/tactics.toml (with a [[fit]] naming the runs) and re-run scripts/gen_tactics.py.  --json writes both
replays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stof_trt import presearch


def load_run(path: str) -> dict:
    """A benchmark run's JSON, checked for what the replay and the fit read; a one-line error otherwise."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"presearch_fit: cannot read {path}: {e}")
    ok = (isinstance(res, dict) and isinstance(res.get("summary"), dict) and
          {"batch", "heads"} <= set(res["summary"]) and isinstance(res.get("cells"), list) and
          all(isinstance(c, dict) and {"D", "S", "spec", "mask", "measured_ms"} <= set(c) and c["measured_ms"]
              for c in res["cells"]))
    if not ok:
        sys.exit(f"presearch_fit: {path} is not a benchmark run (summary.batch/heads and cells with D, S, spec, mask "
                 "and measured_ms, as scripts/bench_attention.py and scripts/ideal_band_work.py write)")
    return res


def replay(run_path: str, within: float = 1.10, coef: dict | None = None) -> list[dict]:
    """Per cell of the run: the model's first choice, its measured time over the best (None where the run did not
    time it), hit or not.  coef: constants in place of the catalogue's ({(id, head dim): (a, b, c, d)})."""
    res = load_run(run_path)
    B, H = res["summary"]["batch"], res["summary"]["heads"]
    out = []
    for cell in res["cells"]:
        ranked = presearch.rank(presearch.cell_layout(cell), batch=B, heads=H, head_dim=cell["D"],
                                gpu=presearch.H100_SXM, coef=coef)
        meas = cell["measured_ms"]
        best = min(meas, key=meas.get)
        # the first choice among the tactics the run timed: a tactic added to the catalogue after the run has no
        # time there, and says nothing about the model's order of the others
        timed = [presearch._BY_ID[t].name for t, _ in ranked if presearch._BY_ID[t].name in meas]
        pick = timed[0] if timed else (presearch._BY_ID[ranked[0][0]].name if ranked else None)
        ratio = meas[pick] / meas[best] if pick in meas else None
        out.append({"D": cell["D"], "S": cell["S"], "Sk": cell.get("Sk", cell["S"]), "mask": cell["mask"],
                    "pick": pick, "best": best, "ratio": ratio, "hit": ratio is not None and ratio <= within})
    return out


def summary(rows: list[dict]) -> str:
    miss = [f"{r['mask']} D={r['D']} S={r['S']}" + (f" Sk={r['Sk']}" if r["Sk"] != r["S"] else "") +
            f": {r['pick']} " + (f"{r['ratio']:.2f}x" if r["ratio"] is not None else "not timed")
            for r in rows if not r["hit"]]
    return f"{sum(r['hit'] for r in rows)}/{len(rows)}" + (f"  misses: {'; '.join(miss)}" if miss else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="comma-separated benchmark JSONs to replay")
    ap.add_argument("--fit", default="", help="comma-separated TACTIC:HEAD_DIM entries of COEF to refit")
    ap.add_argument("--fit-runs", default="", help="comma-separated JSONs to fit on (default: --runs)")
    ap.add_argument("--relative", action="store_true",
                    help="fit relative errors (each cell weighed by 1 / its time)")
    ap.add_argument("--json", default="", help="write the replays here")
    args = ap.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    for r in runs + [r for r in args.fit_runs.split(",") if r]:
        if not Path(r).is_file():
            sys.exit(f"presearch_fit: no such run: {r}")
        load_run(r)
    try:
        keys = {tuple(int(x) for x in k.split(":")) for k in args.fit.split(",") if k}
    except ValueError:
        sys.exit(f"presearch_fit: --fit takes TACTIC:HEAD_DIM entries, got {args.fit!r}")
    fittable = {t.id for t in presearch.TACTICS if t.family != presearch.FAMILY_ROW}
    bad = [k for k in keys if len(k) != 2 or k[0] not in fittable or k[1] not in (64, 128)]
    if bad:
        sys.exit(f"presearch_fit: cannot fit {sorted(bad)}: constants are TACTIC:HEAD_DIM with a block-wise or "
                 "wgmma tactic id of the catalogue (the row-wise ones have no constants) and head dim 64 or 128")

    report = {"current": {r: replay(r) for r in runs}}
    for r in runs:
        print(f"current  {Path(r).name}: {summary(report['current'][r])}")
    if keys:
        fit_runs = [r for r in args.fit_runs.split(",") if r] or runs
        coef = presearch.calibrate(fit_runs, keys=keys, relative=args.relative)
        missing = keys - set(coef)
        if missing:
            sys.exit(f"presearch_fit: the fit runs timed none of {sorted(missing)}")
        old = {k: presearch.COEF.get(k) for k in coef}
        report["refit"] = {r: replay(r, coef=coef) for r in runs}
        report["coef"] = {f"{k[0]}:{k[1]}": v for k, v in coef.items()}
        for k in sorted(coef):
            print(f"    tactic {k[0]}: coef.{k[1]} = {list(coef[k])}  # was {list(old[k]) if old[k] else None}")
        for r in runs:
            print(f"refit    {Path(r).name}: {summary(report['refit'][r])}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
