"""Kernel families by GPU: the library runs the families of other GPUs on this one when STOF_KERNEL_FAMILIES
restricts them (block-wise and row-wise on an H100/H200 as on an A100 or RTX 4090), says in one line when the build
has no code for the GPU, and the build has code for the GPU it runs on.  The forced families run through the C ABI
(every listed tactic, tactic 0 and the selection) and through ONNX Runtime's plugin.

Each case with STOF_KERNEL_FAMILIES runs in a child process (the library reads the variable once per process) and
checks its output against a float64 reference on fresh random inputs.  Set STOF_FOREIGN_KERNELS_LIB to a
libstof_kernels built without code for this GPU (on an H100/H200: -DCMAKE_CUDA_ARCHITECTURES=80-real) to check the
message a user gets on such a GPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from stof_trt import kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# one problem, run by a child process: the listed tactics' families, tactic 0's and the selection's choice, and the
# relative error of tactic 0 and of every listed tactic against float64
CHILD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from _gpu_helpers import reference, rel_err
from stof_trt.format import compile_mask
from stof_trt.kernels import (DeviceLayout, StofKernelError, all_tactics, list_tactics, select_tactic,
                              sparse_attention, tactic_info)
from stof_trt.masks import parse_mask

D, dtype = int(sys.argv[2]), getattr(torch, sys.argv[3])
B, H, S = 2, 3, 384
mask = parse_mask("longformer:window=64,global=8")
layout = compile_mask(mask, S, S, num_heads=H)
g = torch.Generator(device="cuda").manual_seed(7 + D)
q, k, v = [torch.randn(B, H, S, D, generator=g, device="cuda").to(dtype) for _ in range(3)]
dense = torch.from_numpy(mask.dense(S, S, num_heads=H)).cuda()
if dense.dim() == 2:
    dense = dense[None]
ref, _ = reference(q, k, v, dense, 1.0 / D ** 0.5)
dl = DeviceLayout(layout)
out = {"listed": {}, "errors": {}}
try:
    ids = list_tactics(q, k, v, dl)
    for t in ids:
        o = sparse_attention(q, k, v, dl, tactic=t)
        out["listed"][t] = tactic_info(t).family
        out["errors"][t] = rel_err(o, ref)
    o = sparse_attention(q, k, v, dl)
    torch.cuda.synchronize()
except StofKernelError as e:
    print(json.dumps({"error": str(e), "status": e.status}))
    sys.exit(0)
out["default_err"] = rel_err(o, ref)
out["default_family"] = tactic_info(ids[0]).family
t, src = select_tactic(q, k, v, dl)
out["selected_family"], out["selected_source"] = tactic_info(t).family, src
refused = {}
for t in all_tactics():
    if t.id not in ids:
        try:
            sparse_attention(q, k, v, dl, tactic=t.id)
            refused[t.id] = 0
        except StofKernelError as e:
            refused[t.id] = e.status
out["refused"] = refused
print(json.dumps(out))
"""


def _child(families: str | None, D: int = 64, dtype: str = "float16", lib: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("STOF_KERNEL_FAMILIES", None)
    if families is not None:
        env["STOF_KERNEL_FAMILIES"] = families
    if lib is not None:
        env["STOF_KERNELS_LIB"] = lib
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(D), dtype], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


TOL = {"float16": 2e-3, "bfloat16": 1e-2}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("families,allowed", [("block,row", {1, 2}), ("block", {1}), ("row", {2})])
def test_forced_families_run_and_match_the_reference(families, allowed, D, dtype):
    out = _child(families, D, dtype)
    fams = set(out["listed"].values())
    assert fams and fams <= allowed, out["listed"]
    assert 1 not in allowed or 1 in fams  # the block-wise family is there whenever allowed
    assert out["default_family"] in allowed and out["selected_family"] in allowed
    assert out["default_err"] <= TOL[dtype]
    for t, err in out["errors"].items():
        assert err <= TOL[dtype], f"tactic {t}: rel err {err:.3e}"
    # every tactic of another family is refused as invalid for the problem, never run
    assert out["refused"] and all(s == 3 for s in out["refused"].values()), out["refused"]


def test_unforced_families_follow_the_compute_capability():
    out = _child(None)
    fams = set(out["listed"].values())
    assert {1, 2} <= fams  # block-wise and row-wise run on every sm_80+ GPU
    hopper_built = any(t.family == kernels.FAMILY_HOPPER for t in kernels.all_tactics())
    if torch.cuda.get_device_capability() == (9, 0) and "90a" in (kernels.cuda_architectures() or "90a"):
        assert 3 in fams and out["default_family"] == 3, out
    else:
        assert 3 not in fams, out
    assert hopper_built or 3 not in fams


def test_a_malformed_family_list_is_an_invalid_argument():
    out = _child("block,wgmma")
    assert out["status"] == 1 and "STOF_KERNEL_FAMILIES" in out["error"], out


def test_the_build_has_code_for_this_gpu():
    kernels.check_device()
    archs = kernels.cuda_architectures()
    assert archs, "the library does not report its CUDA architectures"
    major, minor = torch.cuda.get_device_capability()
    # a native build names this GPU's architecture (Hopper as 90a)
    print(f"built for {archs}; GPU sm_{major}{minor}")


@pytest.mark.skipif(not os.environ.get("STOF_FOREIGN_KERNELS_LIB"),
                    reason="set STOF_FOREIGN_KERNELS_LIB to a libstof_kernels without code for this GPU")
def test_a_build_without_code_for_this_gpu_says_so():
    lib = os.environ["STOF_FOREIGN_KERNELS_LIB"]
    code = ("import sys; from stof_trt import kernels; from stof_trt.errors import StofError\n"
            "try:\n    kernels.check_device()\nexcept StofError as e:\n    print('ERR', e); sys.exit(0)\n"
            "print('NOERR')")
    env = dict(os.environ, STOF_KERNELS_LIB=lib, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip()
    major, minor = torch.cuda.get_device_capability()
    assert line.startswith("ERR") and f"sm_{major}{minor}" in line and "no code for GPU" in line, line
    assert len(line.splitlines()) == 1
    # a run reports the same line as a CUDA status, not a launch failure
    out = _child(None, lib=lib)
    assert out.get("status") == 4 and "no code for GPU" in out["error"], out


# a STOF node on ONNX Runtime's CUDA EP with the plugin (the path of `stof run`): the tactic the plugin picks (its
# verbose line) and the output against float64
ORT_CHILD = r"""
import json, math, re, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_ort_plugin import _cuda_run, attention_model, attention_ref
from stof_trt import kernels
from stof_trt.format import compile_mask
D = int(sys.argv[2])
B, H, S = 2, 4, 512
layout = compile_mask("longformer:window=64,global=8", S, S)
m = attention_model(layout, B=B, H=H, D=D)
rng = np.random.default_rng(5 + D)
feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float16) for n in "qkv"}
(got,), _ = _cuda_run(m, feeds, verbose=True)
ref = attention_ref(feeds["q"], feeds["k"], feeds["v"], layout, 1.0 / math.sqrt(D))
err = float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))
print(json.dumps({"err": err, "finite": bool(np.isfinite(got).all())}))
"""


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("families,allowed", [("block,row", {1, 2}), ("row", {2})])
def test_forced_families_on_onnx_runtime(families, allowed, D):
    ort = pytest.importorskip("onnxruntime")
    from stof_trt import ort as sort

    if not sort.library_available():
        pytest.skip("libstof_ort.so not built")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA EP")
    env = dict(os.environ, STOF_KERNEL_FAMILIES=families, STOF_FIRST_USE_TIMING="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STOF_TACTIC_CACHE", None)
    r = subprocess.run([sys.executable, "-c", ORT_CHILD, str(Path(__file__).parent), str(D)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["finite"] and out["err"] <= 2e-3, out
    picks = [int(t) for t in re.findall(r"-> [\w -]+? (\d+) \(", r.stderr)]
    assert picks, r.stderr[-2000:]
    assert {kernels.tactic_info(t).family for t in picks} <= allowed, (picks, r.stderr[-2000:])
