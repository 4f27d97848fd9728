"""The tactic cache file: kernel choices per GPU, attention node, shape bucket and mask, and the keys they are
stored under.

``stof tune`` (stof_trt.tune) times the pre-search shortlist of every StofSparseAttention node on the GPU and
records the fastest tactic here; the ONNX Runtime plugin (libstof_ort.so) reads the file from the session option
``stof.tactic_cache`` or ``$STOF_TACTIC_CACHE`` and looks each node up by the same key.  With no entry the library
times the pre-search's shortlist on first use (or, with that off, takes the pre-search's first choice) and merges
its choice into the file (:meth:`TacticCache.merge_save` is the Python side of the same locked merge).  This module
only stores: choosing lives in stof_trt.selection and the library, measuring in stof_trt.tune.

File format (JSON, version 1)::

    {"format": "stof-tactic-cache", "version": 1,
     "entries": [{"gpu": "NVIDIA H100 80GB HBM3", "cc": "9.0",
                  "node": "StofSparseAttention|float16|H12|D64|tile64x64|L1|seq4096x4096|kpm1",
                  "bucket": "B8|Sq4096|Sk4096", "mask": "<TileLayout.signature()>",
                  "tactic": 3, "tactic_name": "block_m32_n64_w2_s2", "time_ms": 0.41, "source": "measured",
                  "presearch_tactic": 1, "presearch_time_ms": 0.47, "candidates": {"1": 0.47, "3": 0.41}}]}

Key fields (all strings, compared exactly): ``gpu`` and ``cc`` (device name and compute capability),
``node`` (:func:`node_signature`), ``bucket`` (:func:`shape_bucket`), ``mask`` (the layout's SHA-1 signature,
docs/format.md).  ``tactic`` is the id the plugin runs; the rest is informational.  The plugin's C++ reader
(plugins_cu/ort/common/tacticCache.cpp) builds the same keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ._files import write_json_atomic
from .errors import StofError

__all__ = ["FORMAT", "VERSION", "shape_bucket", "node_signature", "CacheKey", "TacticCache", "gpu_identity"]

FORMAT = "stof-tactic-cache"
VERSION = 1
_KEY_FIELDS = ("gpu", "cc", "node", "bucket", "mask")


def _pow2(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p <<= 1
    return p


def shape_bucket(batch: int, seq_q: int, seq_k: int) -> str:
    """B, Sq and Sk each rounded up to a power of two (Sq, Sk at least 64): "B8|Sq4096|Sk4096"."""
    return f"B{_pow2(int(batch), 1)}|Sq{_pow2(int(seq_q), 64)}|Sk{_pow2(int(seq_k), 64)}"


def node_signature(dtype: str, heads: int, head_dim: int, tile_m: int, tile_n: int, num_layouts: int, seq_q: int,
                   seq_k: int, key_padding: bool) -> str:
    """What identifies an attention problem apart from batch/sizes and mask: dtype in ONNX names (float16, ...)."""
    return (f"StofSparseAttention|{dtype}|H{heads}|D{head_dim}|tile{tile_m}x{tile_n}|L{num_layouts}"
            f"|seq{seq_q}x{seq_k}|kpm{1 if key_padding else 0}")


@dataclass(frozen=True)
class CacheKey:
    gpu: str
    cc: str
    node: str
    bucket: str
    mask: str

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in _KEY_FIELDS}


@dataclass
class TacticCache:
    """In-memory cache; ``entries`` maps CacheKey -> entry dict (the JSON entry without the key fields)."""

    entries: dict = field(default_factory=dict)
    path: Path | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TacticCache":
        p = Path(path)
        if not p.is_file():
            raise StofError(f"tactic cache not found: {p}")
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise StofError(f"tactic cache {p} is not readable JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StofError(f"{p} is not a STOF tactic cache (\"format\" != \"{FORMAT}\")")
        if doc.get("version") != VERSION:
            raise StofError(f"tactic cache {p}: version {doc.get('version')}, this release reads {VERSION}")
        cache = cls(path=p)
        for e in doc.get("entries", []):
            if not isinstance(e, dict) or any(not isinstance(e.get(f), str) for f in _KEY_FIELDS):
                raise StofError(f"tactic cache {p}: an entry lacks one of {_KEY_FIELDS}")
            t = e.get("tactic")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise StofError(f"tactic cache {p}: entry with bad tactic {t!r}")
            key = CacheKey(*(e[f] for f in _KEY_FIELDS))
            cache.entries[key] = {k: v for k, v in e.items() if k not in _KEY_FIELDS}
        return cache

    @classmethod
    def load_or_new(cls, path: str | os.PathLike) -> "TacticCache":
        return cls.load(path) if Path(path).is_file() else cls(path=Path(path))

    def put(self, key: CacheKey, tactic: int, **info) -> None:
        if int(tactic) < 1:
            raise ValueError(f"tactic ids are >= 1, got {tactic}")
        self.entries[key] = {"tactic": int(tactic), **info}

    def get(self, key: CacheKey) -> dict | None:
        return self.entries.get(key)

    def lookup(self, key: CacheKey) -> int:
        """The cached tactic id, or 0 (no entry)."""
        e = self.entries.get(key)
        return int(e["tactic"]) if e else 0

    def to_json(self) -> dict:
        rows = [{**k.as_dict(), **v} for k, v in sorted(self.entries.items(), key=lambda kv: tuple(kv[0].as_dict().values()))]
        return {"format": FORMAT, "version": VERSION, "entries": rows}

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write atomically (temp file + rename), replacing the file; merge_save keeps other writers' entries."""
        p = Path(path or self.path or "")
        if not str(p):
            raise StofError("no path to save the tactic cache to")
        d = p.resolve().parent
        if not d.is_dir():
            raise StofError(f"directory does not exist: {d}")
        p = write_json_atomic(p, self.to_json(), prefix=".stof-cache-")
        self.path = p
        return p

    def merge_save(self, path: str | os.PathLike | None = None) -> Path:
        """Merge this cache's entries into the file (created when missing) the way the library's writer does
        (stof_tactic_cache_store): under an exclusive flock on ``<path>.lock``, re-read the file, overlay these
        entries, write atomically.  Concurrent writers, in this process or others, lose no entry; afterwards this
        cache holds the merged entries."""
        import fcntl

        p = Path(path or self.path or "")
        if not str(p):
            raise StofError("no path to save the tactic cache to")
        try:
            lock = os.open(f"{p}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise StofError(f"cannot lock {p}.lock ({e.strerror})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = TacticCache.load(p).entries if p.is_file() else {}
            merged.update(self.entries)
            self.entries = merged
            return self.save(p)
        finally:
            os.close(lock)  # releases the lock

    def __len__(self) -> int:
        return len(self.entries)


def gpu_identity(device: int | None = None) -> tuple[str, str]:
    """(name, "major.minor") of a CUDA device as the plugin reports it (cudaGetDeviceProperties)."""
    import torch

    if not torch.cuda.is_available():
        raise StofError("no CUDA device (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return p.name, f"{p.major}.{p.minor}"
