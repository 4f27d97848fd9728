"""Pre-search profiles: the pre-search's constants fitted on one GPU by ``stof calibrate``, which the kernel
library ranks with on that GPU (stof_attn_select; the catalogue's constants, fitted on an H100, otherwise).

File format (JSON, version 1)::

    {"format": "stof-presearch-profile", "version": 1,
     "gpu": {"name": "NVIDIA H200", "cc": "9.0", "sm_count": 132, "clock_mhz": 1980, "memory_clock_mhz": 3201},
     "coef": [{"tactic": 19, "head_dim": 64, "a": 0.21, "b": 0.35, "c": 1.2, "d": 4.0}, ...],
     "fit": {...}}

``gpu`` is the key: the library uses a profile for a device with the same name and SM count (and SM clock within
2 % when it knows the device's clock).  ``coef``: microseconds per FULL and PARTIAL 64-key sub-block, per CTA and
per launch (``stof_presearch_coef_t``, plugins_cu/tactics.toml).  ``fit`` is informational.  Where the library
looks: ``$STOF_PRESEARCH_PROFILE``, else ``${XDG_CACHE_HOME:-~/.cache}/stof-trt/profiles/<name>-<SMs>sm.json``
(:func:`default_path`, = stof_presearch_profile_path).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ._files import is_version, read_json_doc, write_json_atomic
from .errors import StofError

__all__ = ["FORMAT", "VERSION", "default_path", "profile_path", "make_profile", "write", "load", "coef_of",
           "matches"]

FORMAT = "stof-presearch-profile"
VERSION = 1


def default_path(name: str, sm_count: int) -> Path:
    """The per-GPU default location (without $STOF_PRESEARCH_PROFILE)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg.startswith("/") else Path(os.environ.get("HOME") or Path.home()) / ".cache"
    return base / "stof-trt" / "profiles" / f"{re.sub(r'[^A-Za-z0-9.-]', '_', name)}-{int(sm_count)}sm.json"


def profile_path(name: str, sm_count: int) -> Path:
    """The file the library reads for this GPU: $STOF_PRESEARCH_PROFILE, else :func:`default_path`."""
    env = os.environ.get("STOF_PRESEARCH_PROFILE")
    return Path(env) if env else default_path(name, sm_count)


def make_profile(gpu: dict, coef: dict, fit: dict | None = None) -> dict:
    """The JSON document: gpu {"name", "sm_count", ...}, coef {(tactic, head_dim): (a, b, c, d)} in µs."""
    if not isinstance(gpu.get("name"), str) or not isinstance(gpu.get("sm_count"), int):
        raise StofError("a profile's gpu needs a name and an integer sm_count")
    rows = []
    for (tactic, head_dim), c in sorted(coef.items()):
        if len(c) != 4 or any(not (v >= 0) for v in c):
            raise StofError(f"constants of tactic {tactic} D={head_dim} must be 4 non-negative numbers: {c}")
        rows.append({"tactic": int(tactic), "head_dim": int(head_dim),
                     **{k: float(v) for k, v in zip("abcd", c)}})
    return {"format": FORMAT, "version": VERSION, "gpu": dict(gpu), "coef": rows, "fit": dict(fit or {})}


def write(path: str | os.PathLike, doc: dict) -> Path:
    """Write atomically (temp file + rename), creating the directory."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StofError(f"cannot create {p.parent} ({e.strerror or type(e).__name__})") from None
    return write_json_atomic(p, doc, prefix=".stof-profile-")


def load(path: str | os.PathLike) -> dict:
    p = Path(path)
    doc = read_json_doc(p, "pre-search profile")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StofError(f"{p} is not a pre-search profile (\"format\" != \"{FORMAT}\")")
    if not is_version(doc.get("version"), VERSION):
        raise StofError(f"pre-search profile {p}: version {doc.get('version')}, this release reads {VERSION}")
    gpu = doc.get("gpu")
    if not isinstance(gpu, dict) or not isinstance(gpu.get("name"), str) or not isinstance(gpu.get("sm_count"), int):
        raise StofError(f"pre-search profile {p}: \"gpu\" needs \"name\" and \"sm_count\"")
    coef_of(doc, str(p))
    return doc


def coef_of(doc: dict, where: str = "profile") -> dict:
    """{(tactic, head_dim): (a, b, c, d)} of a profile document."""
    out = {}
    rows = doc.get("coef")
    if not isinstance(rows, list):
        raise StofError(f"pre-search {where}: no \"coef\" list")
    for r in rows:
        try:
            key = (int(r["tactic"]), int(r["head_dim"]))
            vals = tuple(float(r[k]) for k in "abcd")
        except (KeyError, TypeError, ValueError):
            raise StofError(f"pre-search {where}: a coef entry needs tactic, head_dim, a, b, c, d: {r!r}") from None
        if key[1] not in (64, 128) or key[0] < 1 or any(not (v >= 0) for v in vals):
            raise StofError(f"pre-search {where}: bad coef entry {r!r}")
        out[key] = vals
    return out


def matches(doc: dict, name: str, sm_count: int, clock_mhz: int | None = None) -> bool:
    """Whether the library applies this profile to a GPU (the same rule as stof_presearch_profile_coef)."""
    g = doc["gpu"]
    if g["name"] != name or g["sm_count"] != sm_count:
        return False
    c = g.get("clock_mhz")
    return not (clock_mhz and isinstance(c, (int, float)) and c > 0 and abs(c - clock_mhz) > 0.02 * clock_mhz)
