"""Where the native libraries are: one lookup for the kernels' ctypes binding and the ONNX Runtime helpers."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def find_library(name: str, env_var: str, build_subdir: str) -> Path | None:
    """``$env_var`` if set (and a file); else the package's lib/ folder (a wheel install), site-packages'
    stof_trt/lib (an editable install), then CMake build trees of the repository: ``build*/<build_subdir>``
    and scikit-build-core's ``build/<wheel tag>/native/<build_subdir>``."""
    env = os.environ.get(env_var)
    if env:
        return Path(env) if Path(env).is_file() else None
    cands = [_HERE / "lib" / name]
    cands += [Path(sysconfig.get_paths()[k]) / "stof_trt" / "lib" / name for k in ("platlib", "purelib")]
    root = _HERE.parent
    cands += [Path(p) for p in sorted(glob.glob(str(root / "build*" / build_subdir / name)))]
    cands += [Path(p) for p in sorted(glob.glob(str(root / "build" / "*" / "native" / build_subdir / name)))]
    return next((c for c in cands if c.is_file()), None)
