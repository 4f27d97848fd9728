"""Pre-search profiles without a GPU: the file format (stof_trt.profiles), where the library looks and which
profile applies to a device (stof_presearch_profile_path / _coef), the precedence in stof_attn_select (tactic
cache > profile constants > catalogue constants), the fit of ``stof calibrate`` from a synthetic run, and the
command's errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stof_trt import calibrate as cal
from stof_trt import presearch as ps
from stof_trt import profiles
from stof_trt import tactic_cache as tc
from stof_trt.errors import StofError
from stof_trt.format import compile_mask
from stof_trt.masks import parse_mask

ROOT = Path(__file__).resolve().parents[1]
NAME, CC = "NVIDIA H200", "9.0"


def _gpu(**over):
    return {"name": NAME, "cc": CC, "sm_count": ps.H100_SXM.sm_count, "clock_mhz": 1980, **over}


def test_profile_round_trip_and_bad_files(tmp_path):
    coef = {(19, 64): (0.2, 0.3, 1.5, 4.0), (3, 128): (0.5, 0.7, 2.0, 0.0)}
    path = profiles.write(tmp_path / "a" / "b.json", profiles.make_profile(_gpu(), coef, {"note": 1}))
    doc = profiles.load(path)
    assert profiles.coef_of(doc) == coef and doc["fit"] == {"note": 1}
    assert profiles.matches(doc, NAME, 132) and profiles.matches(doc, NAME, 132, clock_mhz=1990)
    assert not profiles.matches(doc, NAME, 132, clock_mhz=1500)
    assert not profiles.matches(doc, "NVIDIA H100 80GB HBM3", 132) and not profiles.matches(doc, NAME, 114)
    with pytest.raises(StofError, match="non-negative"):
        profiles.make_profile(_gpu(), {(19, 64): (-1.0, 0, 0, 0)})
    for text, words in [("{", "not JSON"), ('{"format": "x"}', "not a pre-search profile"),
                        ('{"format": "stof-presearch-profile", "version": 9}', "version 9"),
                        ('{"format": "stof-presearch-profile", "version": 1, "gpu": {}, "coef": []}', "sm_count")]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(StofError, match=words):
            profiles.load(tmp_path / "bad.json")
    with pytest.raises(StofError, match="cannot be read"):
        profiles.load(tmp_path / "missing.json")


def test_library_path_rule_matches_python(kernels, monkeypatch, tmp_path):
    for name in (NAME, "NVIDIA GeForce RTX 4090", "A/B c"):
        dev = kernels.device_desc(name=name, cc=CC)
        monkeypatch.delenv("STOF_PRESEARCH_PROFILE", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert kernels.profile_path(dev) == str(profiles.default_path(name, 132))
        assert kernels.profile_path(dev).startswith(str(tmp_path / "xdg" / "stof-trt" / "profiles"))
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert kernels.profile_path(dev) == str(tmp_path / "home" / ".cache" / "stof-trt" / "profiles" /
                                                profiles.default_path(name, 132).name)
        monkeypatch.setenv("STOF_PRESEARCH_PROFILE", str(tmp_path / "x.json"))
        assert kernels.profile_path(dev) == str(tmp_path / "x.json") == str(profiles.profile_path(name, 132))
    assert "/" not in profiles.default_path("A/B c", 7).name


def test_library_reads_the_profile_of_its_gpu_only(kernels, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STOF_PRESEARCH_PROFILE", raising=False)
    dev = kernels.device_desc(name=NAME, cc=CC)
    assert kernels.profile_coef(dev) == {}                                  # no file at the default path: none
    coef = {(19, 64): (0.25, 0.5, 1.0, 3.0)}
    profiles.write(profiles.default_path(NAME, 132), profiles.make_profile(_gpu(), coef))
    assert kernels.profile_coef(dev) == coef
    assert kernels.profile_coef(kernels.device_desc(name="NVIDIA A100-SXM4-80GB", cc="8.0")) == {}
    other = profiles.write(tmp_path / "other.json", profiles.make_profile(_gpu(sm_count=114), coef))
    assert kernels.profile_coef(dev, path=other) == {}                      # another SM count
    with pytest.raises(kernels.StofKernelError, match="cannot be read"):
        kernels.profile_coef(dev, path=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "stof-presearch-profile", "version": 1, "gpu": _gpu(),
                               "coef": [{"tactic": 19, "head_dim": 96, "a": 0, "b": 0, "c": 0, "d": 0}]}))
    with pytest.raises(kernels.StofKernelError, match="bad tactic or head_dim"):
        kernels.profile_coef(dev, path=bad)


def test_select_prefers_cache_then_profile_then_catalogue(kernels, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("STOF_PRESEARCH_PROFILE", raising=False)
    S, B, H, D = 1024, 2, 4, 64
    layout = compile_mask(parse_mask("longformer:window=128,global=16"), S, S)
    q = torch.zeros(B, H, S, D, dtype=torch.float16)
    dev = kernels.device_desc(name=NAME, cc=CC)

    def select(**kw):  # a fresh handle: no memo from an earlier call
        return kernels.select_tactic(q, q, q, kernels.DeviceLayout(layout, device="cpu"), device=dev, **kw)

    catalogue = select()
    assert catalogue[1] == "presearch"
    valid = kernels.list_tactics(q, q, q, kernels.DeviceLayout(layout, device="cpu"))
    ranked = [t for t, _ in ps.rank(layout, batch=B, heads=H, head_dim=D, gpu=ps.H100_SXM)
              if t in valid and ps._BY_ID[t].family != ps.FAMILY_ROW]
    pick = ranked[-1]                                     # the catalogue's last valid tensor-core choice
    coef = {(pick, D): (0.0, 0.0, 0.0, 0.0)}                               # ... made the fastest by a profile
    assert ps.rank(layout, batch=B, heads=H, head_dim=D, gpu=ps.H100_SXM, coef=coef)[0][0] == pick
    profiles.write(profiles.default_path(NAME, 132), profiles.make_profile(_gpu(), coef))
    assert select() == (pick, "presearch")
    # $STOF_PRESEARCH_PROFILE names another file, here one for another GPU: the catalogue again
    monkeypatch.setenv("STOF_PRESEARCH_PROFILE", str(profiles.write(
        tmp_path / "a100.json", profiles.make_profile(_gpu(name="NVIDIA A100-SXM4-80GB"), coef))))
    assert select() == catalogue
    monkeypatch.delenv("STOF_PRESEARCH_PROFILE")
    # a cache entry beats the profile
    key = tc.CacheKey(NAME, CC, tc.node_signature("float16", H, D, 64, 64, 1, S, S, False), tc.shape_bucket(B, S, S),
                      layout.signature())
    other = next(t for t in valid if t != pick)
    cache = tc.TacticCache()
    cache.put(key, other)
    path = cache.save(tmp_path / "cache.json")
    assert select(tactic_cache=path) == (other, "cache")
    # a malformed profile is ignored by the selection (stof_presearch_profile_coef reports it)
    profiles.default_path(NAME, 132).write_text("{")
    assert select() == catalogue


def test_fit_from_a_synthetic_run_recovers_the_constants():
    """Cells timed as the model predicts with known constants: the fit gives back constants that rank alike."""
    B, H = 4, 12
    gpu = ps.H100_SXM
    truth = {}
    for (tid, D), c in ps.COEF.items():                                    # the catalogue's, perturbed
        if D == 64 and ps._BY_ID[tid].family == ps.FAMILY_HOPPER:
            truth[(tid, D)] = tuple(v * (1.3 if tid % 2 else 0.8) for v in c)
    cells = []
    for spec in cal.GRID_MASKS[:4]:
        for S in (1024, 2048, 4096):
            layout = compile_mask(parse_mask(spec), S, S)
            m = {}
            for (tid, D), c in truth.items():
                x = ps.terms(layout, tid, batch=B, heads=H, head_dim=D, gpu=gpu)
                if x is not None:
                    m[ps._BY_ID[tid].name] = float(sum(a * b for a, b in zip(x, c))) / 1e3
            cells.append({"spec": spec, "S": S, "D": 64, "measured_ms": m})
    doc = cal.fit_profile(cells, batch=B, heads=H, gpu=_gpu(), props=gpu)
    fitted = profiles.coef_of(doc)
    assert set(fitted) == set(truth)
    for c in cells:
        layout = ps.cell_layout(c)
        want = ps.rank(layout, batch=B, heads=H, head_dim=64, gpu=gpu, coef=truth)[0][0]
        got = ps.rank(layout, batch=B, heads=H, head_dim=64, gpu=gpu, coef=fitted)[0][0]
        name = {t.id: t.name for t in ps.TACTICS}
        assert c["measured_ms"][name[got]] <= 1.02 * c["measured_ms"][name[want]]
    fit = doc["fit"]["first_choice_within_10pct"]
    assert fit["profile"] == fit["of"] == len(cells)


def test_calibrate_command_errors():
    def stof(*args):
        env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # PATH kept: imports run tools
        return subprocess.run([sys.executable, "-m", "stof_trt.cli", "calibrate", *args], capture_output=True,
                              text=True, env=env, timeout=300)

    for args, words in [(["--head-dims", "96"], "head dims 64 and 128"), (["--seqs", "x"], "integers"),
                        (["--batch", "0"], ">= 1"), ([], "no CUDA GPU")]:
        r = stof(*args)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
