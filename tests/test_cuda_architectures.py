"""The CUDA architectures of the build (cmake/StofCudaArchitectures.cmake): an explicit choice wins, else the build
machine's GPUs (Hopper as 90a), else the documented default list; and what the library says about them.

The choice itself runs in CMake's script mode (no compiler needed); one configure of the project (needs nvcc,
about 10 s) checks that the choice reaches the compile flags and that CMAKE_CUDA_ARCHITECTURES and CUDAARCHS
override it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "cmake" / "StofCudaArchitectures.cmake"
DEFAULT = "80;86;89;90a"

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")


def _choose(explicit: str, native: str) -> tuple[int, str]:
    r = subprocess.run(["cmake", f"-DEXPLICIT={explicit}", f"-DNATIVE={native}", "-P", str(MODULE)],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stderr.strip()


@needs_cmake
@pytest.mark.parametrize("explicit,native,archs", [
    ("", "", DEFAULT),                              # no GPU: the documented list
    ("", "90-real", "90a"),                         # H100/H200: the wgmma kernels need sm_90a code
    ("", "80-real", "80"),                          # A100
    ("", "86-real;86-real", "86"),                  # two A10s: once
    ("", "89-real;90-real", "89;90a"),              # mixed GPUs: each
    ("", "75-real", DEFAULT),                       # only a GPU older than sm_80: the default list
    ("", "75-real;86-real", "86"),                  # the older GPU left out
    ("", "100-real;120-real", "100;120"),           # newer GPUs: their own code
    ("90a", "80-real", "90a"),                      # explicit wins over the GPU
    ("80;90", "", "80;90"),
    ("native", "89-real", "89"),                    # explicit native: the GPU, Hopper as 90a
    ("native", "90-real", "90a"),
])
def test_choice(explicit, native, archs):
    rc, out = _choose(explicit, native)
    assert rc == 0, out
    got, reason = out.split("|", 1)
    assert got == archs
    if explicit and explicit != "native":
        assert reason.startswith("explicit")
    elif archs == DEFAULT:
        assert reason.startswith("the default list")
    else:
        assert reason.startswith("the GPUs of this machine")
    if native == "75-real;86-real":
        assert "sm_75 left out" in reason


@needs_cmake
@pytest.mark.parametrize("native,words", [("", "no CUDA GPU found"), ("70-real", "older than sm_80")])
def test_explicit_native_without_a_usable_gpu_is_an_error(native, words):
    rc, out = _choose("native", native)
    assert rc != 0 and words in " ".join(out.split()), out  # CMake wraps its messages


def test_the_package_build_leaves_the_choice_to_cmake():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    defines = cfg["tool"]["scikit-build"].get("cmake", {}).get("define", {})
    assert "CMAKE_CUDA_ARCHITECTURES" not in defines
    # CI compiles without a GPU: an explicit list keeps it from building the four-architecture default
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"CUDAARCHS=\S+", ci)


def _configure(build: Path, *args: str, env: dict | None = None) -> str:
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DSTOF_BUILD_ADAPTERS=OFF", *args],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def _arch_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "stof-trt: CUDA architectures" in ln]
    assert len(lines) == 1, log[-2000:]
    return lines[0]


def _gencode(build: Path) -> list[str]:
    flags = (build / "plugins_cu" / "CMakeFiles" / "stof_kernels.dir" / "flags.make").read_text()
    return sorted(set(re.findall(r"arch=compute_(\w+),code=", flags)))


@needs_cmake
@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDACXX"), reason="no CUDA compiler")
def test_configure_chooses_and_overrides(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDAARCHS"}
    build = tmp_path / "b"
    line = _arch_line(_configure(build, env=env))
    auto = line.split("CUDA architectures ", 1)[1].split(":", 1)[0]
    if "no CUDA GPU found" in line:
        assert auto == DEFAULT
    else:
        assert "the GPUs of this machine" in line or "the default list" in line
    assert _gencode(build) == sorted(auto.split(";"))
    assert "CMAKE_CUDA_ARCHITECTURES:" not in (build / "CMakeCache.txt").read_text()  # decided again next time

    line = _arch_line(_configure(build, "-DCMAKE_CUDA_ARCHITECTURES=90a", env=env))
    assert "CUDA architectures 90a: explicit" in line
    assert _gencode(build) == ["90a"]
    defs = (build / "plugins_cu" / "CMakeFiles" / "stof_kernels.dir" / "flags.make").read_text()
    assert "STOF_HAS_SM90A=1" in defs

    line = _arch_line(_configure(build, "-UCMAKE_CUDA_ARCHITECTURES", env=dict(env, CUDAARCHS="80;89")))
    assert "CUDA architectures 80;89: explicit" in line
    assert _gencode(build) == ["80", "89"]
    assert "STOF_HAS_SM90A" not in (build / "plugins_cu" / "CMakeFiles" / "stof_kernels.dir" / "flags.make").read_text()


def test_library_reports_its_architectures(kernels):
    archs = kernels.cuda_architectures()
    if archs is None:
        pytest.skip("a library built before stof_cuda_architectures")
    assert archs and all(re.fullmatch(r"\d+a?(-real|-virtual)?", a) for a in archs.split()), archs


# the families a host-only caller sees (no GPU needed: nothing launches), in a child process because the library
# reads STOF_KERNEL_FAMILIES once
_FAMILIES_CHILD = r"""
import json, torch
from stof_trt.format import compile_mask
from stof_trt import kernels
dl = kernels.DeviceLayout(compile_mask("longformer:window=128,global=16", 1024, 1024), device="cpu")
q = torch.zeros(2, 4, 1024, 64, dtype=torch.float16)
try:
    ids = kernels.list_tactics(q, q, q, dl)
    dev = kernels.device_desc(name="NVIDIA H100 80GB HBM3", cc="9.0")
    t, src = kernels.select_tactic(q, q, q, dl, device=dev)
    print(json.dumps({"families": sorted({kernels.tactic_info(i).family for i in ids}),
                      "selected": kernels.tactic_info(t).family}))
except kernels.StofKernelError as e:
    print(json.dumps({"status": e.status, "error": str(e)}))
"""


@pytest.mark.parametrize("value,families", [("row", [2]), ("block", [1]), ("block,row", [1, 2]),
                                            ("hopper,row", [2]), ("blocks", None), ("block,", None)])
def test_kernel_families_restrict_the_listed_tactics(kernels, value, families):
    env = dict(os.environ, STOF_KERNEL_FAMILIES=value, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _FAMILIES_CHILD], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    if families is None:  # a word that is not a family: every call says so
        assert out["status"] == 1 and f"STOF_KERNEL_FAMILIES={value}" in out["error"], out
    else:  # the others as asked; hopper only where a Hopper GPU is present
        if "hopper" in value.split(",") and _hopper_gpu():
            families = sorted(families + [3])
        assert out["families"] == families and out["selected"] in families, out


def _hopper_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
