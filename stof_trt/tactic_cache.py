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

An optional ``"schemes"`` section (its own ``version``, 1) holds the measured fusion scheme of each GEMM chain after
attention (stof_trt.schemes, stof_trt.scheme_tune); the plugin's reader ignores it and its writer keeps it::

    "schemes": {"version": 1,
                "entries": [{"gpu": "NVIDIA H200", "cc": "9.0", "chain": "bias_gelu|float16|N3072|K768|gelu_erf",
                             "bucket": "T4096", "scheme": "gemm_bias_gelu", "algo": 2, "time_ms": 0.061,
                             "source": "measured", "model_first": "gemm_bias_gelu", "model_first_ms": 0.064,
                             "candidates": {"gemm_bias_gelu/0": 0.064, "gemm_bias_gelu/2": 0.061}}]}

``chain`` is :meth:`stof_trt.schemes.ChainShape.signature`, ``bucket`` :func:`stof_trt.schemes.token_bucket`;
``scheme`` names a template, ``algo`` the cuBLASLt heuristic index its GEMM node runs (-1: the first).  A file
without the section is a cache with no scheme entries.

Key fields (all strings, compared exactly): ``gpu`` and ``cc`` (device name and compute capability),
``node`` (:func:`node_signature`), ``bucket`` (:func:`shape_bucket`), ``mask`` (the layout's SHA-1 signature,
docs/format.md).  ``tactic`` is the id the plugin runs; the rest is informational.  The plugin's C++ reader
(plugins_cu/ort/common/tacticCache.cpp) builds the same keys.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ._files import is_version, output_target, read_json_doc, write_json_atomic
from .errors import StofError

__all__ = ["FORMAT", "VERSION", "SCHEMES_VERSION", "SchemeKey", "shape_bucket", "node_signature", "CacheKey",
           "TacticCache", "gpu_identity"]

FORMAT = "stof-tactic-cache"
VERSION = 1
_KEY_FIELDS = ("gpu", "cc", "node", "bucket", "mask")
SCHEMES_VERSION = 1
_SCHEME_KEY_FIELDS = ("gpu", "cc", "chain", "bucket")
_BUCKET = re.compile(r"T[0-9]{1,12}")


def _pow2(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p <<= 1
    return p


def shape_bucket(batch: int, seq_q: int, seq_k: int) -> str:
    """B, Sq and Sk each rounded up to a power of two (Sq, Sk at least 64): "B8|Sq4096|Sk4096"."""
    return f"B{_pow2(int(batch), 1)}|Sq{_pow2(int(seq_q), 64)}|Sk{_pow2(int(seq_k), 64)}"


def node_signature(dtype: str, heads: int, head_dim: int, tile_m: int, tile_n: int, num_layouts: int, seq_q: int,
                   seq_k: int, key_padding: bool, packed: bool = False) -> str:
    """What identifies an attention problem apart from batch/sizes and mask: dtype in ONNX names (float16, ...);
    packed: packed sequences (seq_offsets; the plugin passes no key padding mask then), which run other kernel
    forms than an unpadded batch of the same sizes."""
    return (f"StofSparseAttention|{dtype}|H{heads}|D{head_dim}|tile{tile_m}x{tile_n}|L{num_layouts}"
            f"|seq{seq_q}x{seq_k}|kpm{1 if key_padding else 0}" + ("|packed" if packed else ""))


@dataclass(frozen=True)
class CacheKey:
    gpu: str
    cc: str
    node: str
    bucket: str
    mask: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SchemeKey:
    """Key of a fusion-scheme entry: GPU name, compute capability, chain signature, token bucket."""

    gpu: str
    cc: str
    chain: str
    bucket: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TacticCache:
    """In-memory cache; ``entries`` maps CacheKey -> entry dict (the JSON entry without the key fields);
    ``schemes`` maps SchemeKey -> fusion-scheme entry dict."""

    entries: dict = field(default_factory=dict)
    path: Path | None = None
    schemes: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TacticCache":
        p = Path(path)
        if not p.is_file():
            raise StofError(f"tactic cache not found: {p}")
        doc = read_json_doc(p, "tactic cache")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StofError(f"{p} is not a STOF tactic cache (\"format\" != \"{FORMAT}\")")
        if not is_version(doc.get("version"), VERSION):
            raise StofError(f"tactic cache {p}: version {doc.get('version')!r}, this release reads {VERSION}")
        cache = cls(path=p)
        entries = doc.get("entries", [])
        if not isinstance(entries, list):
            raise StofError(f"tactic cache {p}: \"entries\" is not a list")
        for e in entries:
            if not isinstance(e, dict) or any(not isinstance(e.get(f), str) for f in _KEY_FIELDS):
                raise StofError(f"tactic cache {p}: an entry lacks one of {_KEY_FIELDS}")
            t = e.get("tactic")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise StofError(f"tactic cache {p}: entry with bad tactic {t!r}")
            key = CacheKey(*(e[f] for f in _KEY_FIELDS))
            cache.entries[key] = {k: v for k, v in e.items() if k not in _KEY_FIELDS}
        cache.schemes = _load_schemes(doc.get("schemes"), p)
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

    def put_scheme(self, key: SchemeKey, scheme: str, algo: int = -1, **info) -> None:
        _check_scheme(key.chain, scheme, algo, "")
        self.schemes[key] = {"scheme": scheme, "algo": int(algo), **info}

    def get_scheme(self, key: SchemeKey) -> dict | None:
        return self.schemes.get(key)

    def scheme_choices(self, gpu: str | None = None, cc: str | None = None, tokens: int | None = None) -> dict:
        """{chain signature: (scheme, algo)} for one GPU, the input of ``rewrite_model(schemes=...)``.

        gpu / cc: the GPU's name and compute capability (None: the only GPU with scheme entries).  tokens: take
        each chain's entry of this token count's bucket (None: each chain's largest bucket)."""
        from .schemes import token_bucket

        gpus = sorted({(k.gpu, k.cc) for k in self.schemes if (gpu is None or k.gpu == gpu) and
                       (cc is None or k.cc == cc)})
        if not gpus:
            have = sorted({k.gpu for k in self.schemes})
            raise StofError(f"no fusion-scheme entries for GPU {gpu!r} in the tactic cache (it has: "
                            f"{', '.join(have) or 'none'})" if gpu else "the tactic cache has no fusion-scheme entries")
        if len(gpus) > 1:
            raise StofError("the tactic cache has fusion schemes for several GPUs (" +
                            ", ".join(f"{g} ({c})" for g, c in gpus) + "): name one")
        (g, c), = gpus
        want = token_bucket(tokens) if tokens is not None else None
        best: dict = {}
        for k, e in self.schemes.items():
            if (k.gpu, k.cc) != (g, c) or (want is not None and k.bucket != want):
                continue
            size = int(k.bucket[1:])
            if k.chain not in best or size > best[k.chain][0]:
                best[k.chain] = (size, (e["scheme"], int(e.get("algo", -1))))
        return {chain: v for chain, (_, v) in best.items()}

    def to_json(self) -> dict:
        rows = [{**k.as_dict(), **v} for k, v in sorted(self.entries.items(), key=lambda kv: tuple(kv[0].as_dict().values()))]
        doc = {"format": FORMAT, "version": VERSION, "entries": rows}
        if self.schemes:
            doc["schemes"] = {"version": SCHEMES_VERSION, "entries": [
                {**k.as_dict(), **v} for k, v in sorted(self.schemes.items(),
                                                       key=lambda kv: tuple(kv[0].as_dict().values()))]}
        return doc

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
        p = output_target(p)  # (a symlink: its target, whose lock every writer takes)
        try:
            lock = os.open(f"{p}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise StofError(f"cannot lock {p}.lock ({e.strerror})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = TacticCache.load(p) if p.is_file() else TacticCache()
            old.entries.update(self.entries)
            old.schemes.update(self.schemes)
            self.entries, self.schemes = old.entries, old.schemes
            return self.save(p)
        finally:
            os.close(lock)  # releases the lock

    def __len__(self) -> int:
        return len(self.entries)


def _check_scheme(chain: str, scheme, algo, where: str) -> None:
    from .schemes import TEMPLATES

    kind = chain.split("|", 1)[0]
    if kind not in TEMPLATES:
        raise StofError(f"{where}fusion-scheme entry for an unknown chain {chain!r}")
    if not isinstance(scheme, str) or scheme not in {t.name for t in TEMPLATES[kind]}:
        raise StofError(f"{where}fusion-scheme entry with unknown scheme {scheme!r} for {kind}")
    if not isinstance(algo, int) or isinstance(algo, bool) or not -1 <= algo < 2**31:
        raise StofError(f"{where}fusion-scheme entry with bad algo {algo!r} (an index >= 0, or -1)")


def _load_schemes(section, p: Path) -> dict:
    """The "schemes" section of a cache file: {SchemeKey: entry}."""
    if section is None:
        return {}
    where = f"tactic cache {p}: "
    if not isinstance(section, dict) or not is_version(section.get("version"), SCHEMES_VERSION):
        v = section.get("version") if isinstance(section, dict) else None
        raise StofError(f"{where}\"schemes\" version {v!r}, this release reads {SCHEMES_VERSION}")
    entries = section.get("entries", [])
    if not isinstance(entries, list):
        raise StofError(f"{where}\"schemes\" \"entries\" is not a list")
    out = {}
    for e in entries:
        if not isinstance(e, dict) or any(not isinstance(e.get(f), str) for f in _SCHEME_KEY_FIELDS):
            raise StofError(f"{where}a fusion-scheme entry lacks one of {_SCHEME_KEY_FIELDS}")
        if not _BUCKET.fullmatch(e["bucket"]):
            raise StofError(f"{where}fusion-scheme entry with bad bucket {e['bucket']!r} (T and a token count)")
        _check_scheme(e["chain"], e.get("scheme"), e.get("algo", -1), where)
        out[SchemeKey(*(e[f] for f in _SCHEME_KEY_FIELDS))] = {k: v for k, v in e.items()
                                                                if k not in _SCHEME_KEY_FIELDS}
    return out


def gpu_identity(device: int | None = None) -> tuple[str, str]:
    """(name, "major.minor") of a CUDA device as the plugin reports it (cudaGetDeviceProperties)."""
    import torch

    if not torch.cuda.is_available():
        raise StofError("no CUDA device (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return p.name, f"{p.major}.{p.minor}"
