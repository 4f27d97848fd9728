"""Where the native libraries are: one lookup for the kernels' ctypes binding and the ONNX Runtime helpers."""

from __future__ import annotations

import ctypes
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


def load_native(order, symbol: str, what: str, hint: str) -> ctypes.CDLL:
    """The first of ``order`` ((file name, env var) pairs, found by :func:`find_library` under plugins_cu) that loads
    and exports ``symbol``; RuntimeError naming every candidate tried otherwise (``what`` needs it, ``hint``)."""
    tried = []
    for name, env in order:
        path = find_library(name, env, "plugins_cu")
        if path is None:
            tried.append(name)
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        if not hasattr(lib, symbol):
            tried.append(f"{path} (no {symbol}: a stale build)")
            continue
        return lib
    raise RuntimeError(f"{what} needs libstof_host.so or libstof_kernels.so (tried: " + "; ".join(tried) + f"): {hint}")
