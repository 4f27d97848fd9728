"""The end-to-end benchmark's grid, inputs, model skeletons and report (scripts/bench_e2e.py runs it on the GPU).

Grid: BERT-base, BERT-large, RoBERTa-base (padding mask), GPT-2 (causal + padding), ViT-base (no mask; one export
per image size, chosen so the token count is near S); B in {1, 8, 32}, S in {128, 256, 512}; padded batches draw
key lengths uniformly in [0.25 S, S] or [0.75 S, S] with row 0 full, seeded by the case.

Skeletons: the export and every derived model (fp16 original, ORT optimizer, ORT packing mode, STOF rewrite) are
made on the CPU machine, whose torch/transformers export graphs the ORT optimizer fuses, and travel without their
weights.  The base skeleton keeps each stripped tensor's shape, mean, std and SHA-1 (the refill seed); a derived
skeleton keeps, for each stripped tensor, a recipe over the base's tensors (copy, transpose, cast to fp16,
concatenation), found by matching values.  So every derived model refilled on the GPU machine holds exactly the
weights the transformation would have produced from the refilled base, and the variants compute the same function.

Everything here runs without a GPU (the tests use it); onnxruntime is imported where a model is converted.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib

import numpy as np

__all__ = ["MODELS", "PADDINGS", "VARIANTS", "ORT_VARIANTS", "STOF_VARIANTS", "VIT_IMAGE", "model_keys", "grid",
           "draw_lengths", "case_feeds", "case_seed", "real_token_max_diff", "make_skeleton", "refill_base",
           "base_index", "derive_skeleton", "fill_derived", "fused_op_counts", "attention_fused", "stof_meta",
           "canonicalize_for_ort", "case_record", "merge_records", "targets", "report_md", "CASE_KEYS"]

# model name -> export configuration and how ORT's optimizer treats it
MODELS = {
    "bert-base": dict(family="bert", layers=12, hidden=768, heads=12, intermediate=3072, max_positions=512,
                      vocab_size=30522, mask="padding", ort_type="bert", packing=True),
    "bert-large": dict(family="bert", layers=24, hidden=1024, heads=16, intermediate=4096, max_positions=512,
                       vocab_size=30522, mask="padding", ort_type="bert", packing=True),
    "roberta-base": dict(family="roberta", layers=12, hidden=768, heads=12, intermediate=3072, max_positions=514,
                         vocab_size=50265, mask="padding", ort_type="bert", packing=True),
    "gpt2": dict(family="gpt2", layers=12, hidden=768, heads=12, max_positions=1024, vocab_size=50257,
                 mask="causal", ort_type="gpt2", packing=False),
    "vit-base": dict(family="vit", layers=12, hidden=768, heads=12, intermediate=3072, patch_size=16,
                     mask="none", ort_type="vit", packing=False),
}
# ViT: image side per S, so that (side/16)^2 + 1 tokens is the nearest square grid to S (122, 257, 530 tokens)
VIT_IMAGE = {128: 176, 256: 256, 512: 368}
PADDINGS = {"U[0.25S,S]": 0.25, "U[0.75S,S]": 0.75, "none": None}
ORT_VARIANTS = ("ortopt", "ortopt-graph", "ortpacking")
STOF_VARIANTS = ("stof", "stof-graph", "stof-padded-graph")
VARIANTS = ("original",) + ORT_VARIANTS + STOF_VARIANTS
CASE_KEYS = ("model", "mask", "B", "S", "padding", "variants", "fused_ops", "max_diff_real_tokens")
# the model file each variant runs: ortopt-graph replays ortopt through CUDA graphs; stof-graph replays the rewrite
# with a token capacity input (packed into fixed token slots; the same model as stof where nothing is packed)
VARIANT_MODEL = {"original": "original", "ortopt": "ortopt", "ortopt-graph": "ortopt", "ortpacking": "ortpacking",
                 "stof": "stof", "stof-graph": "stof-slots", "stof-padded-graph": "stof-padded"}
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "PackedAttention", "PackedMultiHeadAttention")


def vit_tokens(S: int) -> int:
    return (VIT_IMAGE[S] // MODELS["vit-base"]["patch_size"]) ** 2 + 1


def model_keys(model: str, seqs) -> list[str]:
    """The exported models behind a grid model: one for a text model, one per image size for ViT."""
    if MODELS[model]["family"] == "vit":
        return [f"{model}@{VIT_IMAGE[S]}" for S in seqs]
    return [model]


def variants_for(model: str) -> list[str]:
    """ORT's packing mode exists for BERT-like encoders (Attention with a padding mask) only; the padded rewrite
    differs from the default one only where there is a padding mask."""
    return [v for v in VARIANTS if (v != "ortpacking" or MODELS[model]["packing"])
            and (v != "stof-padded-graph" or MODELS[model]["mask"] != "none")]


def grid(models=None, batches=(1, 8, 32), seqs=(128, 256, 512), paddings=None) -> list[dict]:
    """Cases in run order (model, then S, then padding, then B): {model, key, mask, B, S, S_nominal, padding}.
    ViT runs without padding only; its S is the token count of the image size chosen for the nominal S."""
    models = list(models or MODELS)
    paddings = list(paddings or PADDINGS)
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    for p in paddings:
        if p not in PADDINGS:
            raise ValueError(f"unknown padding {p!r} (known: {', '.join(PADDINGS)})")
    for S in seqs:
        if S not in VIT_IMAGE:
            raise ValueError(f"S={S} is outside the grid (128, 256, 512)")
    out = []
    for m in models:
        cfg = MODELS[m]
        for S in seqs:
            key = f"{m}@{VIT_IMAGE[S]}" if cfg["family"] == "vit" else m
            for p in paddings:
                if cfg["family"] == "vit" and p != "none":
                    continue
                for B in batches:
                    out.append(dict(model=m, key=key, mask=cfg["mask"], B=int(B),
                                    S=vit_tokens(S) if cfg["family"] == "vit" else int(S), S_nominal=int(S),
                                    padding=p))
    return out


def case_seed(case: dict) -> int:
    return zlib.crc32(f"{case['model']}|{case['B']}|{case['S']}|{case['padding']}".encode())


def draw_lengths(B: int, S: int, low: float | None, seed: int) -> np.ndarray:
    """Key lengths uniform in [ceil(low S), S], row 0 full; all S without padding."""
    if low is None:
        return np.full(B, S, np.int64)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(int(math.ceil(low * S)), S + 1, size=B).astype(np.int64)
    lengths[0] = S
    return lengths


def case_feeds(case: dict) -> tuple[dict, np.ndarray]:
    """(feeds, lengths) of a case: token ids in [2, 1000) (no special ids: RoBERTa's position ids skip its pad id 1)
    and a right-padded attention mask; ViT: N(0, 1) fp16 pixels."""
    B, S = case["B"], case["S"]
    seed = case_seed(case)
    rng = np.random.default_rng(seed)
    if MODELS[case["model"]]["family"] == "vit":
        side = VIT_IMAGE[case["S_nominal"]]
        return {"pixel_values": rng.standard_normal((B, 3, side, side)).astype(np.float16)}, np.full(B, S, np.int64)
    lengths = draw_lengths(B, S, PADDINGS[case["padding"]], seed + 1)
    ids = rng.integers(2, 1000, size=(B, S)).astype(np.int64)
    mask = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}, lengths


def real_token_max_diff(ref: np.ndarray, got: np.ndarray, lengths) -> float:
    """max |ref - got| over the real tokens ([B, S, ...] outputs; rows past each length are padding)."""
    if ref.shape != got.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {got.shape}")
    S = ref.shape[1]
    keep = np.arange(S)[None, :] < np.asarray(lengths)[:, None]
    d = np.abs(ref.astype(np.float64) - got.astype(np.float64))[keep]
    return float(d.max()) if d.size else 0.0


# ---------------------------------------------------------------------------------------------------------------
# skeletons
# ---------------------------------------------------------------------------------------------------------------
SKELETON_KEEP = 256  # float initializers with at most this many elements (scalars, small constants) stay verbatim
BASE_META = "stof.skeleton"
DERIVED_META = "stof.derived_skeleton"


def _sha1(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def _float_initializers(model):
    import onnx

    return [t for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]


def make_skeleton(model, keep: int = SKELETON_KEEP):
    """Copy of ``model`` whose float initializers above ``keep`` elements are empty tensors of the same name and
    type, with (shape, mean, std, SHA-1 of the bytes) in the metadata; returns (skeleton, number stripped)."""
    import copy

    import onnx
    from onnx import numpy_helper

    m = copy.deepcopy(model)
    meta = {}
    for t in _float_initializers(m):
        a = numpy_helper.to_array(t)
        if a.size <= keep:
            continue
        a64 = a.astype(np.float64)
        meta[t.name] = {"shape": list(a.shape), "mean": float(a64.mean()), "std": float(a64.std()), "sha1": _sha1(a)}
        t.CopyFrom(numpy_helper.from_array(np.zeros((0,), a.dtype), t.name))
    m.metadata_props.add(key=BASE_META, value=json.dumps(meta))
    assert isinstance(m, onnx.ModelProto)
    return m, len(meta)


def _pop_meta(model, key):
    props = {p.key: p.value for p in model.metadata_props}
    if key not in props:
        return None
    keep = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    return json.loads(props[key])


def refill_base(skeleton):
    """The inverse of make_skeleton with random weights: N(mean, std) of each stripped tensor, seeded by its SHA-1
    (identical original tensors refill identically).  Returns (model with weights, {name: array} of its float
    initializers)."""
    import copy

    from onnx import numpy_helper

    m = copy.deepcopy(skeleton)
    meta = _pop_meta(m, BASE_META)
    if meta is None:
        raise ValueError("not a skeleton (no stof.skeleton metadata)")
    arrays = {}
    for t in _float_initializers(m):
        if t.name in meta:
            d = meta[t.name]
            rng = np.random.default_rng(int(d["sha1"][:15], 16))
            dt = numpy_helper.to_array(t).dtype
            a = (rng.standard_normal(d["shape"], dtype=np.float32) * np.float32(d["std"])
                 + np.float32(d["mean"])).astype(dt)
            t.CopyFrom(numpy_helper.from_array(a, t.name))
            arrays[t.name] = a
        else:
            arrays[t.name] = numpy_helper.to_array(t)
    return m, arrays


def _to_fp16(a: np.ndarray) -> np.ndarray:
    """fp32 -> fp16 as onnxruntime.transformers.float16.convert_np_to_float16 converts initializers (non-zero values
    under its smallest subnormal kept at it, finite values over 65504 clipped), vectorised: the same bits, faster."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):  # values over 65504 are clipped below
        out = a.astype(np.float16)
    tiny, top = np.float32(5.96e-08), np.float32(65504.0)
    mag = np.abs(a)
    small = (mag < tiny) & (a != 0)
    if small.any():
        out[small] = np.where(a[small] > 0, tiny, -tiny).astype(np.float16)
    big = np.isfinite(a) & (mag > top)
    if big.any():
        out[big] = np.where(a[big] > 0, top, -top).astype(np.float16)
    return out


_CASTS = {"f16ort": _to_fp16, "none": lambda a: a}


class _BaseIndex:
    """SHA-1 of every base float tensor as stored, transposed (2-D) and cast to fp16 -> (name, transposed, cast)."""

    def __init__(self, base: dict, keep: int):
        self.keys: dict = {}
        self.widths: dict = {}  # (ndim, axis, other dims, dtype) -> widths along the axis
        for name, a in base.items():
            if a.size <= 1 or a.dtype != np.float32:  # small ones too: a packed bias concatenates them
                continue
            views = [(False, a)] + ([(True, a.T)] if a.ndim == 2 else [])
            for tr, v in views:
                for cast in _CASTS:
                    c = _CASTS[cast](v)
                    self.keys.setdefault((c.dtype.str, c.shape, _sha1(c)), (name, tr, cast))
                    for ax in range(c.ndim):
                        other = c.shape[:ax] + c.shape[ax + 1:]
                        self.widths.setdefault((c.ndim, ax, other, c.dtype.str), set()).add(c.shape[ax])

    def find(self, d: np.ndarray):
        return self.keys.get((d.dtype.str, d.shape, _sha1(d)))

    def recipe(self, d: np.ndarray) -> dict | None:
        hit = self.find(d)
        if hit is not None:
            return {"parts": [[hit[0], hit[1]]], "cast": hit[2], "axis": 0}
        for ax in range(d.ndim):  # a concatenation of base tensors (packed Q/K/V), all with one cast
            other = d.shape[:ax] + d.shape[ax + 1:]
            widths = sorted(self.widths.get((d.ndim, ax, other, d.dtype.str), ()), reverse=True)
            if not widths:
                continue
            parts, cast, off = [], None, 0
            while off < d.shape[ax]:
                for w in widths:
                    if off + w > d.shape[ax]:
                        continue
                    hit = self.find(np.take(d, np.arange(off, off + w), axis=ax))
                    if hit is not None and cast in (None, hit[2]):
                        parts.append([hit[0], hit[1]])
                        cast, off = hit[2], off + w
                        break
                else:
                    break
            if off == d.shape[ax] and len(parts) > 1:
                return {"parts": parts, "cast": cast, "axis": ax}
        return None


def base_index(base: dict, keep: int = SKELETON_KEEP) -> "_BaseIndex":
    """The value index derive_skeleton matches against (build it once per base for several derived models)."""
    return _BaseIndex(base, keep)


def derive_skeleton(derived, base, keep: int = SKELETON_KEEP):
    """Skeleton of ``derived`` (a model transformed from the base whose float initializers are ``base``): each
    float initializer above ``keep`` elements becomes a recipe over base tensors.  Returns (skeleton, info) with
    info["unmatched"] naming large tensors no recipe explains (they are refilled with N(mean, std): such a variant
    no longer computes the base's function, which the benchmark reports)."""
    import copy

    from onnx import numpy_helper

    index = base if isinstance(base, _BaseIndex) else _BaseIndex(base, keep)
    m = copy.deepcopy(derived)
    recipes, unmatched = {}, []
    for t in _float_initializers(m):
        a = numpy_helper.to_array(t)
        if a.size <= keep:
            continue
        r = index.recipe(a)
        if r is None:
            a64 = a.astype(np.float64)
            r = {"random": {"shape": list(a.shape), "mean": float(a64.mean()), "std": float(a64.std()),
                            "sha1": _sha1(a)}}
            unmatched.append(t.name)
        recipes[t.name] = r
        t.CopyFrom(numpy_helper.from_array(np.zeros((0,), a.dtype), t.name))
    m.metadata_props.add(key=DERIVED_META, value=json.dumps(recipes))
    return m, {"stripped": len(recipes), "unmatched": unmatched}


def fill_derived(skeleton, base: dict):
    """The model a derived skeleton describes, its weights rebuilt from ``base`` (refill_base's arrays)."""
    import copy

    from onnx import numpy_helper

    m = copy.deepcopy(skeleton)
    recipes = _pop_meta(m, DERIVED_META)
    if recipes is None:
        raise ValueError("not a derived skeleton (no stof.derived_skeleton metadata)")
    for t in _float_initializers(m):
        r = recipes.get(t.name)
        if r is None:
            continue
        dt = numpy_helper.to_array(t).dtype
        if "random" in r:
            d = r["random"]
            rng = np.random.default_rng(int(d["sha1"][:15], 16))
            a = (rng.standard_normal(d["shape"], dtype=np.float32) * np.float32(d["std"]) + np.float32(d["mean"]))
        else:
            parts = []
            for name, tr in r["parts"]:
                if name not in base:
                    raise ValueError(f"derived skeleton needs base tensor {name!r}, which the base does not have")
                parts.append(base[name].T if tr else base[name])
            a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=r["axis"])
            a = _CASTS[r["cast"]](a)
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(a.astype(dt)), t.name))
    return m


# ---------------------------------------------------------------------------------------------------------------
# what ORT fused, what the rewrite made
# ---------------------------------------------------------------------------------------------------------------
def fused_op_counts(model) -> dict:
    """Node counts of the ONNX Runtime contrib operators (com.microsoft) and LayerNormalization in a model."""
    out: dict = {}
    for n in model.graph.node:
        if n.domain == "com.microsoft" or n.op_type == "LayerNormalization":
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items()))


def attention_fused(counts: dict | None) -> bool:
    return bool(counts) and sum(counts.get(op, 0) for op in ATTENTION_OPS) > 0


def stof_meta(model) -> dict:
    """STOF node counts and whether the rewrite packed the tokens (padding removal: qkv_format "t3hd")."""
    counts: dict = {}
    formats = set()
    for n in model.graph.node:
        if n.domain != "stof":
            continue
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
        for a in n.attribute:
            if a.name == "qkv_format":
                formats.add(a.s.decode() if isinstance(a.s, bytes) else str(a.s))
    return {"stof_nodes": dict(sorted(counts.items())), "qkv_formats": sorted(formats),
            "padding_removal": "t3hd" in formats}


def canonicalize_for_ort(model):
    """The same function in the graph form onnxruntime.transformers' attention fusion matches: Casts to the type
    their input already has are bypassed (transformers' eager attention casts the softmax to its own type) and the
    score scale ``MatMul * c`` feeding Softmax becomes ``MatMul / (1/c)`` (the fusion matches Div).  Returns
    (model, counts of each change)."""
    import copy

    import onnx
    from onnx import numpy_helper, shape_inference

    m = shape_inference.infer_shapes(copy.deepcopy(model))
    g = m.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.input) + list(g.output)}
    consts = {}
    for t in g.initializer:
        types[t.name] = t.data_type
        if math.prod(t.dims) <= 1:
            consts[t.name] = numpy_helper.to_array(t)
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and math.prod(a.t.dims) <= 1:
                    consts[n.output[0]] = numpy_helper.to_array(a.t)
    outputs = {o.name for o in g.output}
    rename, keep = {}, []
    for n in g.node:
        if n.op_type == "Cast" and n.output[0] not in outputs:
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            if to is not None and types.get(n.input[0]) == to:
                rename[n.output[0]] = rename.get(n.input[0], n.input[0])
                continue
        keep.append(n)
    for n in keep:
        for k, i in enumerate(n.input):
            if i in rename:
                n.input[k] = rename[i]
    producer = {o: n for n in keep for o in n.output}
    consumers: dict = {}
    for n in keep:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def feeds_softmax(name):
        cs = consumers.get(name, [])
        if len(cs) != 1:
            return False
        c = cs[0]
        return c.op_type == "Softmax" or (c.op_type == "Add" and any(x.op_type == "Softmax"
                                                                      for x in consumers.get(c.output[0], [])))

    divs = 0
    for n in keep:
        if n.op_type != "Mul" or not feeds_softmax(n.output[0]):
            continue
        for k in (0, 1):
            c, other = consts.get(n.input[k]), n.input[1 - k]
            if c is not None and other in producer and producer[other].op_type == "MatMul" and float(c) != 0:
                name = n.output[0] + "_inv_scale"
                inv = np.asarray(1.0 / float(c), dtype=c.dtype).reshape(c.shape)
                g.initializer.append(numpy_helper.from_array(inv, name))
                n.op_type = "Div"
                n.input[0], n.input[1] = other, name
                divs += 1
                break
    del g.node[:]
    g.node.extend(keep)
    del g.value_info[:]
    assert isinstance(m, onnx.ModelProto)
    return m, {"identity_casts_bypassed": len(rename), "scale_mul_to_div": divs}


# ---------------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------------
def case_record(case: dict, variants: dict, fused_ops: dict, max_diff: dict) -> dict:
    """One e2e.json entry: exactly CASE_KEYS."""
    return {"model": case["model"], "mask": case["mask"], "B": case["B"], "S": case["S"], "padding": case["padding"],
            "variants": {k: {"median_ms": float(v["median_ms"]), "p90_ms": float(v["p90_ms"])}
                         for k, v in variants.items()},
            "fused_ops": {k: dict(v) for k, v in fused_ops.items()},
            "max_diff_real_tokens": {k: float(v) for k, v in max_diff.items()}}


def record_key(r: dict) -> tuple:
    return (r["model"], r["B"], r["S"], r["padding"])


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """old with new's cases replacing or added (a second call, or a resumed one, completes the grid)."""
    by = {record_key(r): r for r in old}
    for r in new:
        by[record_key(r)] = r
    return list(by.values())


TARGETS = {  # padding -> (what, target, floor) of STOF's best over the baseline
    "U[0.25S,S]": [("fastest ORT", 1.3, 1.15), ("ortpacking", 1.1, 1.0)],
    "none": [("fastest ORT", 1.05, 1.0)],
}


def _best(r: dict, names) -> tuple[str, float] | None:
    got = [(n, r["variants"][n]["median_ms"]) for n in names if n in r["variants"]]
    return min(got, key=lambda x: x[1]) if got else None


def cell_ratios(r: dict) -> dict:
    """STOF's best median over the fastest fused ORT configuration and over ORT's packing mode (None where a side
    is missing or ORT's attention is not fused)."""
    stof = _best(r, [v for v in r["variants"] if v.startswith("stof")])
    fused = [v for v in r["variants"] if v.startswith("ort") and attention_fused(r["fused_ops"].get(v))]
    ort = _best(r, fused)
    pack = _best(r, [v for v in fused if v == "ortpacking"])
    out = {"stof": stof, "fastest ORT": ort, "ortpacking": pack,
           "unfused": [v for v in r["variants"] if v.startswith("ort") and v not in fused]}
    for what in ("fastest ORT", "ortpacking"):
        b = out[what]
        out[what + " ratio"] = b[1] / stof[1] if (b and stof) else None
    return out


def targets(records: list[dict]) -> list[dict]:
    """Per target line: the cells it covers, how many reach the target and the floor, geomean and worst."""
    out = []
    for padding, lines in TARGETS.items():
        for what, target, floor in lines:
            rows = []
            for r in records:
                if r["padding"] != padding:
                    continue
                c = cell_ratios(r)
                if c[what + " ratio"] is not None:
                    rows.append((r, c[what + " ratio"]))
            ratios = [x for _, x in rows]
            worst = min(rows, key=lambda x: x[1]) if rows else None
            out.append({"padding": padding, "baseline": what, "target": target, "floor": floor, "cells": len(rows),
                        "at_target": sum(x >= target for x in ratios), "at_floor": sum(x >= floor for x in ratios),
                        "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                        "worst": (f"{worst[0]['model']} B={worst[0]['B']} S={worst[0]['S']}: {worst[1]:.2f}x"
                                  if worst else None)})
    return out


def target_lines(records: list[dict]) -> list[str]:
    lines = []
    for t in targets(records):
        if not t["cells"]:
            lines.append(f"- padding {t['padding']}, STOF best / {t['baseline']} >= {t['target']}: no cells")
            continue
        verdict = ("met" if t["at_target"] == t["cells"] else
                   "below target, above floor" if t["at_floor"] == t["cells"] else "BELOW FLOOR")
        lines.append(f"- padding {t['padding']}, STOF best / {t['baseline']} >= {t['target']} (floor {t['floor']}): "
                     f"{t['at_target']}/{t['cells']} cells at target, {t['at_floor']}/{t['cells']} at floor, geomean "
                     f"{t['geomean']:.2f}x, worst {t['worst']} -> {verdict}")
    return lines


def summary(records: list[dict]) -> dict:
    """(model, padding) -> cells and, per baseline, "geomean (worst)" of ORT's time over STOF's best."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["model"], r["padding"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        row = {"cells": len(rs)}
        for what in ("fastest ORT", "ortpacking"):
            xs = [(r, cell_ratios(r)[what + " ratio"]) for r in rs]
            xs = [(r, x) for r, x in xs if x is not None]
            if xs:
                g = math.exp(sum(math.log(x) for _, x in xs) / len(xs))
                w = min(xs, key=lambda t: t[1])
                row[what] = f"{g:.2f}x ({w[1]:.2f}x at B={w[0]['B']} S={w[0]['S']})"
            else:
                row[what] = "–"
        out[key] = row
    return out


def report_md(records: list[dict], meta: dict, cmd: str) -> str:
    """e2e.md: the command, the baselines' fusion, the table of medians (p90), STOF's ratios, the target lines."""
    lines = [f"Command: `{cmd}`", ""]
    env = meta.get("environment", {})
    if env:
        lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    models = meta.get("models", {})
    if models:
        lines += ["| model file | exported | ORT variant: fused operators | attention fused | STOF: padding removal |",
                  "|---|---|---|---|---|"]
        for key, mm in models.items():
            fo = mm.get("fused_ops", {})
            ops = "; ".join(f"{v}: " + ", ".join(f"{op} {n}" for op, n in c.items()) for v, c in fo.items())
            att = ", ".join(f"{v} {'yes' if attention_fused(c) else 'NO (UNFUSED: not a target baseline)'}"
                            for v, c in fo.items())
            lines.append(f"| {key} | {mm.get('exported_with', '?')} | {ops} | {att} | "
                         f"{(mm.get('stof') or {}).get('padding_removal', '?')} |")
        lines.append("")
    names = [v for v in VARIANTS if any(v in r["variants"] for r in records)]
    lines += ["Median (p90) ms per variant; ratios are ORT's time over STOF's best (`stof`, `stof-graph`); ORT "
              "variants whose attention is not fused are marked * and left out of the ratios.", "",
              "| model | mask | padding | B | S | " + " | ".join(names) + " | /fastest ORT | /ortpacking | "
              "max diff (real tokens) |", "|---" * (8 + len(names)) + "|"]
    for r in records:
        c = cell_ratios(r)

        def cell(n):
            v = r["variants"].get(n)
            if v is None:
                return "–"
            star = "*" if n in c["unfused"] else ""
            return f"{v['median_ms']:.3f} ({v['p90_ms']:.3f}){star}"

        def ratio(k):
            x = c[k + " ratio"]
            return f"{x:.2f}x ({c[k][0]})" if x is not None else "–"

        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_diff_real_tokens"].items()) or "–"
        lines.append(f"| {r['model']} | {r['mask']} | {r['padding']} | {r['B']} | {r['S']} | "
                     + " | ".join(cell(n) for n in names) + f" | {ratio('fastest ORT')} | {ratio('ortpacking')} | "
                     f"{diffs} |")
    lines += ["", "Targets (issue 39):"] + target_lines(records)
    lines += ["", "Summary (geomean over B and S of ORT's time / STOF's best; in brackets the worst cell):", "",
              "| model | padding | cells | / fastest fused ORT | / ortpacking |", "|---|---|---|---|---|"]
    for (model, padding), rs in summary(records).items():
        lines.append(f"| {model} | {padding} | {rs['cells']} | {rs['fastest ORT']} | {rs['ortpacking']} |")
    errs = [f"{key} {v}: {msg}" for key, mm in models.items() for v, msg in (mm.get("errors") or {}).items()]
    if errs:
        lines += ["", "Variants that did not run (a -graph variant here: no CUDA graph capture):"] + \
            [f"- {e}" for e in errs]
    if meta.get("stopped"):
        lines += ["", f"Stopped early: {meta['stopped']} (run the same command again to continue)."]
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# export and derivation (CPU machine: --make-skeletons)
# ---------------------------------------------------------------------------------------------------------------
TINY = dict(layers=2, hidden=128, heads=4, intermediate=512)  # --tiny: a smoke test of the flow


def export_model(key: str, path: str, tiny: bool = False) -> dict:
    """Export grid model ``key`` ("bert-base", "vit-base@256", ...) with random weights to ``path`` (fp32)."""
    import torch

    from ..export import _export, _wrap, export_bert, export_gpt2, export_vit

    name, _, side = key.partition("@")
    cfg = dict(MODELS[name])
    if tiny:
        cfg.update(TINY, vocab_size=min(cfg.get("vocab_size", 1000), 1000))
    fam = cfg["family"]
    common = dict(layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"])
    if fam == "bert":
        export_bert(path, intermediate=cfg["intermediate"], max_positions=cfg["max_positions"],
                    vocab_size=cfg["vocab_size"], mask_dims=2, seq_len=128, **common)
    elif fam == "gpt2":
        export_gpt2(path, max_positions=cfg["max_positions"], vocab_size=cfg["vocab_size"], seq_len=128,
                    padding_mask=True, **common)
    elif fam == "vit":
        export_vit(path, intermediate=cfg["intermediate"], image_size=int(side), patch_size=cfg["patch_size"],
                   **common)
    elif fam == "roberta":
        from transformers import RobertaConfig, RobertaModel

        torch.manual_seed(0)
        rc = RobertaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                           num_attention_heads=cfg["heads"], intermediate_size=cfg["intermediate"],
                           max_position_embeddings=cfg["max_positions"], attn_implementation="eager")
        model = RobertaModel(rc, add_pooling_layer=False).eval()
        ids = torch.randint(2, cfg["vocab_size"], (2, 128))
        names = ["input_ids", "attention_mask"]
        dyn = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]}
        _export(_wrap(model, names), (ids, torch.ones((2, 128), dtype=torch.int64)), path, names,
                ["last_hidden_state"], dyn, 17)
    else:  # pragma: no cover
        raise ValueError(fam)
    return cfg


def _fp16(model):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=False)


def derive_models(base, name: str, work: str, tiny: bool = False, log=print, want=None):
    """The benchmark's models from the fp32 base, one at a time (each is large): yields ("original" | "ortopt" |
    "ortpacking" | "stof", fp16 ModelProto, what the transformation reported: ORT's fused-operator statistics,
    the rewrite's patterns).  ``want``: only these model variants (default all)."""
    import gc

    from ..rewrite import rewrite_model

    cfg = dict(MODELS[name])
    if tiny:
        cfg.update(TINY)
    want = set(want or set(VARIANT_MODEL.values()))
    if "original" in want:
        yield "original", _fp16(base), {}
        gc.collect()
    if want & {"ortopt", "ortpacking"}:
        yield from _derive_ort(base, name, cfg, work, want, log)
        gc.collect()
    if "stof" in want:
        m, rep = rewrite_model(base, max_seq_len=512 if cfg["family"] != "vit" else None)
        d = rep.to_dict()
        info = {"rewrite": {k: v.get("matched") for k, v in d.get("patterns", {}).items()}}
        m = _fp16(m)
        info["stof"] = stof_meta(m)
        log(f"{name}: rewrite {info['rewrite']}, padding removal {info['stof']['padding_removal']}")
        yield "stof", m, info
        del m
        gc.collect()
    if "stof-slots" in want:  # packed into token slots sized by an input: CUDA graphs replay it (with no padding
        # mask, the plain rewrite: its shapes are fixed already)
        m, _ = rewrite_model(base, max_seq_len=512 if cfg["family"] != "vit" else None,
                             token_capacity_input=cfg["mask"] != "none")
        yield "stof-slots", _fp16(m), {}
        del m
        gc.collect()
    if "stof-padded" in want and cfg["mask"] != "none":
        # the padded form (--no-remove-padding), whose fixed shapes CUDA graphs can replay (a model without a
        # padding mask has only that form: its `stof` model)
        m, _ = rewrite_model(base, max_seq_len=512, remove_padding=False)
        yield "stof-padded", _fp16(m), {}


def _derive_ort(base, name, cfg, work, want, log):
    import os
    import sys

    import onnx
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    canon, changes = canonicalize_for_ort(base)
    src = os.path.join(work, f"{name}.canon.onnx")
    onnx.save(canon, src)
    del canon
    opt = optimizer.optimize_model(src, model_type=cfg["ort_type"], num_heads=cfg["heads"],
                                   hidden_size=cfg["hidden"], opt_level=0,
                                   optimization_options=FusionOptions(cfg["ort_type"]))
    os.unlink(src)
    stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    opt.convert_float_to_float16(keep_io_types=False)
    log(f"{name}: ORT optimizer fused {stats}")
    if "ortopt" in want:
        yield "ortopt", opt.model, {"canonicalized": changes, "ortopt_statistics": stats}
    if cfg["packing"] and "ortpacking" in want:
        # convert_to_packing_mode imports its siblings as top-level modules
        import onnxruntime.transformers as ot

        sys.path.insert(0, os.path.dirname(ot.__file__))
        try:
            from convert_to_packing_mode import PackingMode
            from onnx_model import OnnxModel
        finally:
            sys.path.pop(0)
        pm = PackingMode(OnnxModel(opt.model))  # converts in place: the ortopt model has been handed out
        pm.convert()
        packed = pm.model.model
        log(f"{name}: ORT packing mode {fused_op_counts(packed)}")
        if any(n.op_type in ("PackedAttention", "PackedMultiHeadAttention") for n in packed.graph.node):
            yield "ortpacking", packed, {}
        else:
            yield "ortpacking", None, {"ortpacking_error": "convert_to_packing_mode made no PackedAttention"}
        del pm, packed
