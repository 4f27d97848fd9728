"""scripts/bench_attention.py on the CPU: its arguments, its fp32 reference, and its whole loop over a small grid
with the kernel library and the timer faked (known tactic times, one tactic that writes a wrong answer, one the
library refuses), so that the cells it writes -- issue 38's keys, the STOF default / tuned / best choice, the
anchors kept, left out and unavailable -- are checked without a GPU."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stof_trt.bench.report import REQUIRED_KEYS  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    was = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(was)


def _load():
    spec = importlib.util.spec_from_file_location("bench_attention_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_and_subsets():
    ba = _load()
    a = ba.parse_args([])
    assert (a.dim_list, a.size_list) == ([64, 128], [2048, 4096, 8192])
    assert a.mask_list == ["causal", "sliding", "dilated", "longformer", "bigbird"]
    assert len(a.dim_list) * len(a.size_list) * len(a.mask_list) == 30 and a.dtype == "fp16"
    a = ba.parse_args(["--dims", "128", "--masks", "sliding", "--dtype", "bf16"])
    assert (a.dim_list, a.size_list, a.mask_list, a.dtype) == ([128], [2048, 4096, 8192], ["sliding"], "bf16")
    q = ba.parse_args(["--quick"])
    assert (q.dim_list, q.size_list, q.mask_list, q.causal_rounds) == ([64], [2048], ["causal", "sliding"], 0)
    assert "flex" not in ba.parse_args(["--no-flex"]).anchor_list
    assert "fa4" in a.anchor_list and "flex_fa4" in a.anchor_list


@pytest.mark.parametrize("argv", [["--masks", "band"], ["--anchors", "fa3"], ["--dims", "x"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _load().parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_reference_is_fp32_masked_attention():
    ba = _load()
    S, D = 96, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, S, D, generator=g).half() for _ in range(3))
    dense = parse_mask("dilated:window=8,dilation=2").dense(S, S)
    dense[5] = False  # a row without keys is zero, as STOF writes it
    ref = ba.reference(q, k, v, torch.from_numpy(dense))
    assert ref.dtype == torch.float32
    s = q[1, 2].double() @ k[1, 2].double().T / math.sqrt(D)
    s[~torch.from_numpy(dense)] = float("-inf")
    want = torch.nan_to_num(torch.softmax(s, -1) @ v[1, 2].double())
    assert torch.allclose(ref[1, 2].double(), want, atol=1e-5)
    assert (ref[:, :, 5] == 0).all()


TIMES = {1: 1.0, 2: 0.8, 5: 0.7, 6: 0.9, 3: 0.1}  # tactic 3 is fast but wrong; 4 is refused


def _fake_world(monkeypatch, ba, with_timing: bool):
    from stof_trt import kernels

    refs = {}
    real_reference = ba.reference

    def reference(q, k, v, dense):
        refs["last"] = real_reference(q, k, v, dense)
        return refs["last"]

    class Layout:
        def __init__(self, layout):
            self.layout = layout

    class Runner:
        def __init__(self, q, k, v, dl, *, out=None, tactic=0, **kw):
            if tactic == 4:
                raise kernels.StofKernelError(3, "tactic 4 does not take this problem")
            self.out, self.tactic, self.ms = out, tactic, TIMES[tactic]

        def __call__(self):
            r = refs["last"]
            self.out.copy_(torch.zeros_like(r) if self.tactic == 3 else r)
            return self.out

    def select(q, k, v, dl, *, key_padding_mask=None, bhsd=True, tactic_cache=None, device=None, presearch=True,
               timing=True):  # the library's first-use timing is on by default: the script must say False
        if timing:
            assert tactic_cache is not None and isinstance(dl, Layout)
            Path(tactic_cache).write_text("cache\n")
            return 2, "timed"
        return 1, "presearch"

    if not with_timing:
        def select(q, k, v, dl, *, key_padding_mask=None, bhsd=True, tactic_cache=None, device=None,  # noqa: F811
                   presearch=True):
            return 1, "presearch"

    from stof_trt.bench import anchors

    monkeypatch.setattr(anchors, "floor_methods", lambda: {"copy": lambda: None, "matmul": lambda: None})
    monkeypatch.setattr(ba, "reference", reference)
    monkeypatch.setattr(ba, "DEVICE", "cpu")
    monkeypatch.setattr(kernels, "DeviceLayout", Layout)
    monkeypatch.setattr(kernels, "Runner", Runner)
    monkeypatch.setattr(kernels, "select_tactic", select)
    monkeypatch.setattr(kernels, "list_tactics", lambda q, k, v, dl, **kw: [1, 2, 3, 4, 5, 6])
    monkeypatch.setattr(kernels, "tactic_info", lambda t: types.SimpleNamespace(name=f"t{t}"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def do_bench(fn, warmup=25, rep=100, return_mode="median"):
        fn()
        return getattr(fn, "ms", 0.5)

    triton = types.ModuleType("triton")
    triton.testing = types.SimpleNamespace(do_bench=do_bench)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", triton.testing)
    monkeypatch.setenv("STOF_PRESEARCH_PROFILE", "/nonexistent/profile.json")


@pytest.mark.parametrize("with_timing", [True, False])
def test_loop_writes_the_issue_keys(monkeypatch, tmp_path, with_timing):
    ba = _load()
    _fake_world(monkeypatch, ba, with_timing)
    argv = ["--dims", "64", "--sizes", "128", "--masks", "causal,sliding", "--batch", "1", "--heads", "2",
            "--anchors", "fa4,sdpa_causal,sdpa_mask,cudnn_band", "--causal-rounds", "2", "--out", str(tmp_path)]
    assert ba.main(argv) == 0
    assert torch.is_grad_enabled()  # the script's no-autograd mode ends with it
    import os

    assert "STOF_PRESEARCH_PROFILE" not in os.environ  # the default path runs without a calibration profile
    cells = json.loads((tmp_path / "attention.json").read_text())
    assert [(c["D"], c["S"], c["mask"]) for c in cells] == [(64, 128, "causal"), (64, 128, "sliding")]
    for c in cells:
        assert list(c)[:len(REQUIRED_KEYS)] == list(REQUIRED_KEYS)
        assert c["stof_default_ms"] == 1.0 and c["stof_default_tactic"] == "t1"
        assert c["stof_best_ms"] == 0.7 and c["stof_best_tactic"] == "t5"  # t3 is faster but wrong
        assert "t3" in c["stof_wrong"] and "t4" in c["stof_invalid"]
        assert set(c["stof_screen_ms"]) == {"t1", "t2", "t5", "t6"}
        assert 0 < c["rel_err"] < 1e-3  # the fake kernels write the reference, rounded to fp16
        assert "fa4" in c["anchors_unavailable"] and c["anchors"]["sdpa_mask"] == 0.5
        assert c["fastest_anchor"][1] == 0.5
        assert c["ratios"]["default"] == 0.5 and c["ratios"]["best"] == pytest.approx(0.5 / 0.7)
        if with_timing:
            assert c["stof_tuned_ms"] == 0.8 and c["stof_tuned_tactic"] == "t2" and c["stof_tuned_source"] == "timed"
            assert c["ratios"]["tuned"] == pytest.approx(0.5 / 0.8)
        else:
            assert c["stof_tuned_ms"] is None and "no first-use timing" in c["stof_tuned_error"]
    causal, sliding = cells
    assert "sdpa_causal" in causal["anchors"] and "cudnn_band" not in causal["anchors_unavailable"]
    assert causal["paired"]["rounds"] == 2 and causal["paired"]["stof"] == ("tuned" if with_timing else "best")
    assert "cudnn_band" in sliding["anchors_unavailable"] and "sdpa_causal" not in sliding["anchors"]
    md = (tmp_path / "attention.md").read_text()
    assert "| 64 | 128 | causal | 1.000 (t1) |" in md and "First choice within 10%" in md
    run = json.loads((tmp_path / "attention-run.json").read_text())
    assert run["meta"]["presearch_profile_env_removed"] == "/nonexistent/profile.json"
    assert run["summary"]["batch"] == 1 and run["cells"][0]["measured_ms"]["t5"] == 0.7
    assert not (tmp_path / "attention.partial.json").exists()
    assert np.isfinite(run["meta"]["wall_s"]) and run["meta"]["copy_TBps"] > 0
    assert all(c["floor_ms"] > 0 for c in cells)


def test_merge_two_runs(monkeypatch, tmp_path):
    ba = _load()
    _fake_world(monkeypatch, ba, True)
    for D, masks in ((128, "sliding"), (64, "sliding,causal")):
        argv = ["--dims", str(D), "--sizes", "128", "--masks", masks, "--batch", "1", "--heads", "2", "--anchors",
                "sdpa_mask", "--causal-rounds", "0", "--out", str(tmp_path / f"d{D}")]
        assert ba.main(argv) == 0
    runs = f"{tmp_path / 'd128' / 'attention-run.json'},{tmp_path / 'd64' / 'attention-run.json'}"
    assert ba.main(["--merge", runs, "--out", str(tmp_path / "all")]) == 0
    cells = json.loads((tmp_path / "all" / "attention.json").read_text())
    assert [(c["D"], c["mask"]) for c in cells] == [(64, "causal"), (64, "sliding"), (128, "sliding")]
    run = json.loads((tmp_path / "all" / "attention-run.json").read_text())
    assert len(run["meta"]["merged_from"]) == 2 and run["summary"]["cells"] == 3
    (tmp_path / "bad.json").write_text("[]")
    assert ba.main(["--merge", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")]) == 2


def test_time_limit_stops_between_cells(monkeypatch, tmp_path):
    ba = _load()
    _fake_world(monkeypatch, ba, False)
    argv = ["--dims", "64,128", "--sizes", "128", "--masks", "causal,sliding", "--batch", "1", "--heads", "2",
            "--anchors", "sdpa_mask", "--causal-rounds", "0", "--time-limit", "0", "--out", str(tmp_path)]
    assert ba.main(argv) == 0
    assert json.loads((tmp_path / "attention.json").read_text()) == []
    run = json.loads((tmp_path / "attention-run.json").read_text())
    assert "D=64 S=128 causal" in run["meta"]["stopped_early"]
