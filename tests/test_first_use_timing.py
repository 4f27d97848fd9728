"""First-use timing's host side without a GPU: the tactic-cache writers (the library's stof_tactic_cache_store and
TacticCache.merge_save) merging from several processes at once, and the STOF_SELECT_TIME flag's plumbing in
stof_attn_select (a missing cache file is one to create; no GPU or a captured stream: the pre-search's choice;
STOF_FIRST_USE_TIMING=0: today's behaviour)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stof_trt import tactic_cache as tc
from stof_trt.format import compile_mask

GPU = ("NVIDIA H200", "9.0")
ROOT = Path(__file__).resolve().parents[1]

_WRITER = r"""
import sys
from stof_trt import tactic_cache as tc
path, who, n, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if how == "lib":
    from stof_trt import kernels
for i in range(n):
    key = tc.CacheKey("NVIDIA H200", "9.0", f"node-{who}", f"B{i}", "mask")
    if how == "lib":
        kernels.store_tactic(path, *key.as_dict().values(), tactic=i + 1, time_ms=0.5 + i)
    else:
        c = tc.TacticCache()
        c.put(key, i + 1, source="measured", time_ms=0.5 + i)
        c.merge_save(path)
"""


def _writers(path, hows, n):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"{how}{j}", str(n), how], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for j, how in enumerate(hows)]


def _watch(path, procs):
    """Read the file while the writers run: every read is a whole, valid cache."""
    reads = 0
    while any(p.poll() is None for p in procs):
        if path.is_file():
            doc = json.loads(path.read_text())
            assert doc["format"] == tc.FORMAT and isinstance(doc["entries"], list)
            reads += 1
        time.sleep(0.002)
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err.decode()
    return reads


def _check_all(path, hows, n):
    cache = tc.TacticCache.load(path)
    assert len(cache) == len(hows) * n
    for j, how in enumerate(hows):
        for i in range(n):
            e = cache.get(tc.CacheKey(GPU[0], GPU[1], f"node-{how}{j}", f"B{i}", "mask"))
            assert e is not None and e["tactic"] == i + 1 and e["time_ms"] == pytest.approx(0.5 + i)


def test_python_writers_from_several_processes_lose_nothing(tmp_path):
    path = tmp_path / "cache.json"
    hows = ["py"] * 4
    procs = _writers(path, hows, 12)
    _watch(path, procs)
    _check_all(path, hows, 12)


def test_library_and_python_writers_together_lose_nothing(kernels, tmp_path):
    path = tmp_path / "sub dir" / "cache.json"
    path.parent.mkdir()
    tc.TacticCache(entries={tc.CacheKey("other", "8.0", "n", "b", "m"): {"tactic": 7, "candidates": {"7": 0.1}}}
                   ).save(path)
    hows = ["lib", "py", "lib", "py", "lib"]
    procs = _writers(path, hows, 10)
    _watch(path, procs)
    cache = tc.TacticCache.load(path)
    assert cache.get(tc.CacheKey("other", "8.0", "n", "b", "m")) == {"tactic": 7, "candidates": {"7": 0.1}}
    del cache.entries[tc.CacheKey("other", "8.0", "n", "b", "m")]
    cache.save(path)
    _check_all(path, hows, 10)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".stof-cache-")]  # no temp file left


def test_library_writer_replaces_the_entry_of_its_key_and_the_process_reads_it(kernels, tmp_path):
    path = tmp_path / "c.json"
    key = ("NVIDIA H200", "9.0", "node", "B8|Sq4096|Sk4096", "sig")
    kernels.store_tactic(path, *key, tactic=3, time_ms=0.25)
    kernels.store_tactic(path, *key, tactic=5)
    kernels.store_tactic(path, *key[:4], "sig2", tactic=6, time_ms=1e-3)
    doc = json.loads(path.read_text())
    assert [(e["mask"], e["tactic"]) for e in doc["entries"]] == [("sig", 5), ("sig2", 6)]
    assert "time_ms" not in doc["entries"][0] and doc["entries"][1]["time_ms"] == 1e-3
    assert doc["entries"][0]["tactic_name"] == kernels.load_library().stof_attn_tactic_name(5).decode()
    assert tc.TacticCache.load(path).lookup(tc.CacheKey(*key)) == 5      # the Python reader agrees
    with pytest.raises(kernels.StofKernelError, match="tactic ids are >= 1"):
        kernels.store_tactic(path, *key, tactic=0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "stof-tactic-cache", "version": 1, "entries": [')
    with pytest.raises(kernels.StofKernelError, match="malformed JSON"):
        kernels.store_tactic(bad, *key, tactic=3)
    assert bad.read_text().endswith("[")                                  # a malformed file is never overwritten
    with pytest.raises(kernels.StofKernelError):
        kernels.store_tactic(tmp_path / "no-such-dir" / "c.json", *key, tactic=3)


def test_library_writer_escapes_strings(kernels, tmp_path):
    path = tmp_path / "c.json"
    odd = 'quote " back \\ tab \t nl \n é'
    kernels.store_tactic(path, odd, "9.0", "n", "b", "m", tactic=2)
    assert tc.TacticCache.load(path).lookup(tc.CacheKey(odd, "9.0", "n", "b", "m")) == 2
    assert kernels.load_tactic_cache(path) == 1


def _problem(kernels):
    torch = pytest.importorskip("torch")
    layout = compile_mask("causal", 512, 512)
    dl = kernels.DeviceLayout(layout, device="cpu")
    q = torch.zeros(2, 4, 512, 64, dtype=torch.float16)   # host memory: nothing is launched without a GPU
    return layout, dl, q


def test_timing_flag_without_a_gpu_falls_back_to_the_presearch(kernels, tmp_path, monkeypatch):
    layout, dl, q = _problem(kernels)
    dev = kernels.device_desc(name=GPU[0], cc=GPU[1])
    pre = kernels.select_tactic(q, q, q, dl, device=dev)
    assert pre[1] == "presearch"
    missing = tmp_path / "new.json"
    # timing: a missing cache file is one to create later, not an error; nothing can be timed here
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=missing, timing=True, stream=0) == pre
    assert not missing.exists()
    # an entry written meanwhile is a cache hit (the fall-back was not memoised)
    key = tc.CacheKey(GPU[0], GPU[1], tc.node_signature("float16", 4, 64, layout.tile_m, layout.tile_n, 1, 512, 512,
                                                         False), tc.shape_bucket(2, 512, 512), layout.signature())
    other = next(t for t in kernels.list_tactics(q, q, q, dl) if t != pre[0])
    kernels.store_tactic(missing, *key.as_dict().values(), tactic=other)
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=missing, timing=True, stream=0) == (
        other, "cache")
    # STOF_FIRST_USE_TIMING=0: today's path, where a missing file is an error
    monkeypatch.setenv("STOF_FIRST_USE_TIMING", "0")
    with pytest.raises(kernels.StofKernelError, match="cannot be read"):
        kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=tmp_path / "none.json", timing=True, stream=0)
    monkeypatch.delenv("STOF_FIRST_USE_TIMING")
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=tmp_path / "none.json", timing=True,
                                 stream=0) == pre


def test_ort_registration_reads_the_timing_option(tmp_path, monkeypatch):
    """libstof_ort: with first-use timing (the default) a missing tactic cache file is one to create; with
    stof.first_use_timing=0 (or STOF_FIRST_USE_TIMING=0) it is an error at registration, as before."""
    ort = pytest.importorskip("onnxruntime")
    from stof_trt import ort as sort

    if not sort.library_available():
        pytest.skip("libstof_ort.so not built")
    monkeypatch.delenv("STOF_FIRST_USE_TIMING", raising=False)
    missing = str(tmp_path / "new.json")

    def register(**entries):
        so = ort.SessionOptions()
        for k, v in entries.items():
            so.add_session_config_entry(k, v)
        so.register_custom_ops_library(str(sort.library_path()))

    register(**{sort.CONFIG_TACTIC_CACHE: missing})
    register(**{sort.CONFIG_TACTIC_CACHE: missing, sort.CONFIG_FIRST_USE_TIMING: "1"})
    with pytest.raises(Exception, match="cannot be read"):
        register(**{sort.CONFIG_TACTIC_CACHE: missing, sort.CONFIG_FIRST_USE_TIMING: "0"})
    monkeypatch.setenv("STOF_FIRST_USE_TIMING", "0")
    with pytest.raises(Exception, match="cannot be read"):
        register(**{sort.CONFIG_TACTIC_CACHE: missing})
    register(**{sort.CONFIG_TACTIC_CACHE: missing, sort.CONFIG_FIRST_USE_TIMING: "1"})  # the option wins
    # the Python session helper follows the same rule
    from stof_trt.errors import StofError

    with pytest.raises(StofError, match="tactic cache not found"):
        sort.session(b"", tactic_cache=missing, providers="cpu")
    with pytest.raises(StofError, match="tactic cache not found"):
        sort.session(b"", tactic_cache=missing, providers="cpu", first_use_timing=False)
    monkeypatch.delenv("STOF_FIRST_USE_TIMING")
    with pytest.raises(StofError, match="directory does not exist"):
        sort.session(b"", tactic_cache=tmp_path / "no" / "c.json", providers="cpu")
