"""scripts/gen_tactics.py: the generated tactic tables are current, a stale one is named, a bad catalogue row is a
one-line error, and the generated tables agree with each other."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "plugins_cu" / "tactics.toml"
_spec = importlib.util.spec_from_file_location("gen_tactics", ROOT / "scripts" / "gen_tactics.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_generated_files_are_current():
    """After a catalogue change, run python3 scripts/gen_tactics.py and commit what it writes."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_tactics.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr.strip()


def _check(tmp_path, capsys, text):
    path = tmp_path / "tactics.toml"
    path.write_text(text)
    rc = gen.main(["--check", "--catalogue", str(path)])
    return rc, capsys.readouterr().err


def test_check_names_every_stale_file(tmp_path, capsys):
    text = CATALOGUE.read_text()
    # new constants: the pre-search table and the Python catalogue change, the kernels' tables do not
    changed = text.replace("coef.64 = [1.51628, 1.53314, 5.02282, 8.87148]", "coef.64 = [1.5, 1.5, 5.0, 9.0]")
    assert changed != text
    rc, err = _check(tmp_path, capsys, changed)
    assert rc == 1
    assert "presearch_table.inc is stale" in err and "_tactics.py is stale" in err and "tactics.h" not in err
    # a new tactic's traits: every output changes
    rc, err = _check(tmp_path, capsys, text.replace('stages = 3\nvariant = "tma"', 'stages = 4\nvariant = "tma"'))
    assert rc == 1 and err.count("is stale") == 3


@pytest.mark.parametrize("edit, msg", [
    (("id = 2\n", "id = 1\n"), "duplicate tactic ids"),
    (("id = 12\n", "id = 0\n"), "id must be an integer >= 1"),
    (('q_frags = "reg"', 'q_frags = "regs"'), "q_frags"),
    (("min_ctas = 1\n", "min_ctax = 1\n"), "unknown fields ['min_ctax'], missing ['min_ctas']"),
    (('keys = ["22:64"]', 'keys = []'), "unfitted ['22:64']"),
    (("head_dims = [64, 128]", "head_dims = [96]"), "head_dims"),
    (('variant = "pipelined"', 'variant = "fast"'), "variant"),
    (("sched_l2_bytes_many_ctas", "sched_bytes"), "lacks sched_l2_bytes_many_ctas"),
])
def test_bad_catalogue_is_a_one_line_error(tmp_path, capsys, edit, msg):
    text = CATALOGUE.read_text()
    assert edit[0] in text
    rc, err = _check(tmp_path, capsys, text.replace(edit[0], edit[1], 1))
    assert rc == 2 and msg in err and err.count("\n") == 1, err


def test_tables_agree():
    """tactics.h's kernel tables, its name table and the Python catalogue describe the same tactics."""
    from stof_trt import _tactics

    cat = gen.load()
    h = (ROOT / "plugins_cu" / "src" / "tactics.h").read_text()
    table = re.findall(r'X\((\d+), (\d), (\d+), (\d+), (\d+), (\d+), (\d+), "(\w+)", (true|false), (true|false)\)',
                       h)
    assert [int(r[0]) for r in table] == list(_tactics.LIBRARY_ORDER)
    want = {t["id"]: (t["family"], t["block_m"], t["block_n"], t["warps"], t["stages"], t["name"], t["persistent"],
                      t["kv_split"]) for t in _tactics.TACTICS}
    assert {int(r[0]): (int(r[1]), int(r[3]), int(r[4]), int(r[5]), int(r[6]), r[7], r[8] == "true", r[9] == "true")
            for r in table} == want
    for fam, macro in (("block", "STOF_BLOCK_TACTICS"), ("row", "STOF_ROW_TACTICS"), ("hopper", "STOF_HOPPER_TACTICS")):
        body = h[h.index(f"#define {macro}(X)"):].split("\n\n")[0]
        ids = [int(i) for i in re.findall(r"X\((\d+),", body)]
        assert ids == cat["families"][fam]
        # a tactic's index in the name table is its position in the family's macro (its launcher table slot)
        assert {int(r[0]): int(r[2]) for r in table if int(r[0]) in ids} == {t: i for i, t in enumerate(ids)}
    assert len({t["name"] for t in _tactics.TACTICS}) == len(_tactics.TACTICS)
    # every constant of the pre-search table is the Python catalogue's
    inc = (ROOT / "plugins_cu" / "src" / "presearch_table.inc").read_text()
    rows = [r.split(", ") for r in re.findall(r"^STOF_PRESEARCH_ROW\((.*)\)$", inc, re.M)]
    assert [int(r[0]) for r in rows] == [t["id"] for t in _tactics.TACTICS]
    for r in rows:
        tid = int(r[0])
        for i, d in ((18, 64), (23, 128)):
            assert (tuple(float(x) for x in r[i + 1:i + 5]) if r[i] == "1" else None) == _tactics.COEF.get((tid, d))
