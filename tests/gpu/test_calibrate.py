"""``stof calibrate`` on the GPU: a small grid end to end, the profile it writes and the library applying it to
the current device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from stof_trt import kernels, profiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_writes_a_profile_the_library_applies_here(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, "-m", "stof_trt.cli", "calibrate", "--seqs", "512,1024", "--head-dims", "64",
                        "--batch", "2", "--heads", "4", "--reps", "3", "-o", str(out), "--json"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["profile"] == str(out) and res["constants"] > 0
    doc = profiles.load(out)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert (doc["gpu"]["name"], doc["gpu"]["sm_count"]) == (props.name, props.multi_processor_count)
    assert doc["fit"]["cells"] == 10                                        # 5 masks x 2 lengths x 1 head dim
    assert kernels.profile_coef(path=out) == profiles.coef_of(doc)          # the current device: it applies
    other = profiles.write(tmp_path / "other.json", profiles.make_profile({**doc["gpu"], "name": "other"},
                                                                          profiles.coef_of(doc)))
    assert kernels.profile_coef(path=other) == {}
