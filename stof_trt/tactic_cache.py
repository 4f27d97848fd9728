"""The tactic cache: measured kernel choices per GPU, attention node, shape bucket and mask (second search stage).

``stof tune`` times the pre-search shortlist (stof_trt.presearch) of every StofSparseAttention node on the GPU and
records the fastest tactic here; the ONNX Runtime plugin (libstof_ort.so) reads the file from the session option
``stof.tactic_cache`` or ``$STOF_TACTIC_CACHE`` and looks each node up by the same key.  With no entry the plugin
uses the kernel library's default; :func:`choose` gives the pre-search's first choice instead (Python callers).

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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import StofError

__all__ = ["FORMAT", "VERSION", "shape_bucket", "node_signature", "CacheKey", "TacticCache", "gpu_identity",
           "choose"]

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
        """Write atomically (temp file + rename)."""
        p = Path(path or self.path or "")
        if not str(p):
            raise StofError("no path to save the tactic cache to")
        d = p.resolve().parent
        if not d.is_dir():
            raise StofError(f"directory does not exist: {d}")
        fd, tmp = tempfile.mkstemp(prefix=".stof-cache-", suffix=".json", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.write("\n")
            os.replace(tmp, p)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.path = p
        return p

    def __len__(self) -> int:
        return len(self.entries)


def gpu_identity(device: int | None = None) -> tuple[str, str]:
    """(name, "major.minor") of a CUDA device as the plugin reports it (cudaGetDeviceProperties)."""
    import torch

    if not torch.cuda.is_available():
        raise StofError("no CUDA device (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return p.name, f"{p.major}.{p.minor}"


def choose(cache: TacticCache | None, key: CacheKey, layout, *, batch: int, heads: int, head_dim: int,
           seq_q: int, seq_k: int) -> tuple[int, str]:
    """The tactic for a problem: the cache's entry, else the pre-search's first choice.  Returns (id, source)."""
    if cache is not None:
        t = cache.lookup(key)
        if t:
            return t, "cache"
    from . import presearch

    ranked = presearch.rank(layout, batch=batch, heads=heads, head_dim=head_dim, seq_q=seq_q, seq_k=seq_k)
    if not ranked:
        raise StofError(f"no tactic supports head_dim {head_dim} with tile {layout.tile_m}x{layout.tile_n}")
    return int(ranked[0][0]), "presearch"


def attention_problem_dims(model) -> dict:
    """{node name: (onnx dtype name, heads, head_dim)} for the StofSparseAttention nodes whose query shape ONNX
    shape inference can fix (heads and head dim are static in exported transformers)."""
    import onnx

    names = {1: "float", 10: "float16", 16: "bfloat16"}
    try:  # data propagation resolves Reshape targets computed from Shape/Gather/Concat
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - best effort
        inferred = model
    vis = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.input)}
    producer = {o: p for p in model.graph.node for o in p.output}

    def static_dims(name):
        vi = vis.get(name)
        if vi is None:
            return None, None
        tt = vi.type.tensor_type
        return [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim], tt.elem_type

    out = {}
    for n in model.graph.node:
        if n.op_type != "StofSparseAttention" or n.domain != "stof":
            continue
        dims, et = static_dims(n.input[0])
        if dims and len(dims) == 5 and dims[3] and dims[4] and et in names:  # packed [B, S, 3, H, D]
            out[n.name] = (names[et], int(dims[3]), int(dims[4]))
            continue
        if not dims or len(dims) != 4 or not dims[3] or et not in names:
            continue
        heads = dims[1]
        if not heads:  # q = Transpose(Reshape(x, [B, S, H, D])): H = x's static last dim (hidden) / D
            t = producer.get(n.input[0])
            r = producer.get(t.input[0]) if t is not None and t.op_type == "Transpose" else None
            if r is not None and r.op_type == "Reshape":
                xd, _ = static_dims(r.input[0])
                if xd and xd[-1] and xd[-1] % dims[3] == 0:
                    heads = xd[-1] // dims[3]
        if heads:
            out[n.name] = (names[et], int(heads), int(dims[3]))
    return out


def add_presearch_entries(cache: TacticCache, model, shapes, gpu: str, cc: str) -> int:
    """Add the pre-search's first choice for every attention node of `model` and every (batch, seq) in `shapes`
    whose key the cache lacks (measured entries are kept).  Returns the number of entries added; nodes whose
    heads / head dim are not static are skipped."""
    from . import presearch
    from .tune import attention_nodes

    dims = attention_problem_dims(model)
    added = 0
    for nd in attention_nodes(model):
        if nd.name not in dims:
            continue
        dtype, heads, head_dim = dims[nd.name]
        lay = nd.layout
        stats = presearch.tile_stats(lay)
        for batch, seq in shapes:
            sq, sk = min(int(seq), lay.seq_q), min(int(seq), lay.seq_k)
            key = CacheKey(gpu, cc, node_signature(dtype, heads, head_dim, lay.tile_m, lay.tile_n, lay.num_layouts,
                                                   lay.seq_q, lay.seq_k, nd.key_padding_mask is not None),
                           shape_bucket(batch, sq, sk), lay.signature())
            if cache.get(key) is not None:
                continue
            ranked = presearch.rank(stats, batch=int(batch), heads=heads, head_dim=head_dim, seq_q=sq, seq_k=sk)
            if ranked:
                cache.put(key, int(ranked[0][0]), source="presearch", nodes=[nd.name])
                added += 1
    return added
