#!/usr/bin/env python3
"""End-to-end benchmark on the GPU: original (ORT CUDA EP, fp16) vs onnxruntime.transformers.optimizer (fp16) vs
the STOF rewrite with libstof_ort, on the same inputs, with the outputs compared.

Models (random weights from transformers configs): BERT-base with max positions 4096, GPT-2 (max positions 4096),
ViT-base (224/16 -> 197 tokens).  Masks: padding (BERT), Longformer ±256 + 32 global and BigBird 64-blocks (BERT),
causal (GPT-2), none (ViT).  B=8, S in {512, 2048, 4096}.

How the three compute the same function:
* BERT with a static mask: the original is exported with a 3-D attention_mask input ([B,S,S], non-zero = attend)
  and fed the dense mask AND the key padding; the rewrite is made from the 2-D export (same weights) with the
  static mask compiled for S=4096 (smaller S use its top-left corner) and gets the 2-D padding mask.
* BERT padding / GPT-2 causal / ViT: one export; the rewrite keeps the padding mask as a run-time input and finds
  the causal pattern in the graph.
Every model is fp32-exported then converted to fp16 (onnxruntime.transformers.float16, I/O types fp16 where
float); the rewrite is done on the fp32 export and then converted, like the original.

    python3 scripts/bench_e2e.py --out OUT [--models bert,gpt2,vit] [--seqs 512,2048,4096] [--iters 30]
    python3 scripts/bench_e2e.py --tune-only --out OUT      # writes OUT/tactic_cache.json (measured + pre-search)
    python3 scripts/bench_e2e.py --make-skeletons DIR       # CPU machine: export, write DIR/<key>.skel.onnx
    python3 scripts/bench_e2e.py --skeletons DIR --out OUT  # GPU machine: refill those graphs, no export there
    variants: original,ortopt,stof,stof-presearch and CUDA-graph replays ortopt-graph,stof-graph; --profile adds
    per-kernel GPU time (CUPTI through torch.profiler) of original/ortopt/stof.

The ORT-optimizer baseline is checked: its fused-operator counts are printed and recorded, and a padding-mask
or maskless model whose attention the optimizer did not fuse (Attention: 0) stops the run (it would be an unfair
baseline) unless --allow-unfused-baseline.  Why skeletons: the GPU machine's torch/transformers export a BERT
graph the optimizer does not fuse; the CPU machine's does.  A skeleton is that graph with its large weights
stripped (well under 1 MB instead of ~440 MB); the GPU machine refills them with random values of each tensor's
mean and standard deviation, seeded by the original tensor's SHA-1 (shared weights refill identically).

Writes OUT/e2e.json and OUT/e2e.md.  Model files go to --work (default /tmp/stof-e2e) and are reused.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


BERT = dict(layers=12, hidden=768, heads=12, intermediate=3072, max_positions=4096, vocab_size=30522)
GPT2 = dict(layers=12, hidden=768, heads=12, max_positions=4096, vocab_size=50257)
VIT = dict(layers=12, hidden=768, heads=12, intermediate=3072, image_size=224, patch_size=16)
MASKS = {
    "longformer": "longformer:window=256,global=32",
    "bigbird": "bigbird:block=64,window=1,global=1,random=0.05,seed=1",
}
B = 8
PADDING = 0.75  # key lengths uniform in [0.75 S, S] (row 0 full)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# model preparation
# ---------------------------------------------------------------------------------------------------------------
def to_fp16(src: Path, dst: Path):
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    if dst.exists():
        return dst
    m = convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)
    onnx.save(m, str(dst))
    return dst


# ---------------------------------------------------------------------------------------------------------------
# skeletons: the export's graph without its large weights, so a model exported on one machine (a CPU machine whose
# torch/transformers give a graph the ORT optimizer fuses) can travel to the GPU machine in well under a MB.
# ---------------------------------------------------------------------------------------------------------------
SKELETON_KEEP = 16384  # initializers with at most this many elements (LayerNorm gammas, ids, shapes) stay verbatim


def make_skeleton(src: Path, dst: Path) -> dict:
    """Copy of ``src`` whose float initializers above SKELETON_KEEP elements are replaced by an empty tensor of
    the same name and type plus metadata (shape, mean, std, SHA-1 of the original bytes).  The SHA-1 seeds the
    refill, so weights shared by two exports (BERT 2-D and 3-D mask) are refilled identically."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(src))
    meta, stripped = {}, 0
    for t in m.graph.initializer:
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        a = numpy_helper.to_array(t)
        if a.size <= SKELETON_KEEP:
            continue
        meta[t.name] = {"shape": list(a.shape), "mean": float(a.astype(np.float64).mean()),
                        "std": float(a.astype(np.float64).std()),
                        "sha1": hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()}
        t.CopyFrom(numpy_helper.from_array(np.zeros((0,), a.dtype), t.name))
        stripped += 1
    m.metadata_props.add(key="stof.skeleton", value=json.dumps(meta))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst))
    return {"stripped": stripped, "bytes": dst.stat().st_size}


def fill_skeleton(src: Path, dst: Path) -> Path:
    """The inverse of make_skeleton with fresh random weights: N(mean, std) of each stripped tensor, seeded by
    its SHA-1 (same original weights -> same refill)."""
    import onnx
    from onnx import numpy_helper

    if dst.exists():
        return dst
    m = onnx.load(str(src))
    props = {p.key: p.value for p in m.metadata_props}
    if "stof.skeleton" not in props:
        raise SystemExit(f"{src}: not a skeleton (no stof.skeleton metadata)")
    meta = json.loads(props["stof.skeleton"])
    for t in m.graph.initializer:
        if t.name in meta:
            d = meta[t.name]
            rng = np.random.default_rng(int(d["sha1"][:15], 16))
            dt = numpy_helper.to_array(t).dtype
            a = (rng.standard_normal(d["shape"], dtype=np.float32) * d["std"] + d["mean"]).astype(dt)
            t.CopyFrom(numpy_helper.from_array(a, t.name))
    keep = [p for p in m.metadata_props if p.key != "stof.skeleton"]
    del m.metadata_props[:]
    m.metadata_props.extend(keep)
    onnx.save(m, str(dst))
    return dst


# What the ORT optimizer should fuse for the baseline to be the fair one: "required" (the run stops without it):
# BERT with a 2-D padding mask (the S=512 target case; fused from the CPU machine's export, torch 2.13 /
# transformers 5.23); "flag": GPT-2 (causal + padding) and ViT (no mask) have attention ORT can fuse, but on the
# CPU machine's exports its optimizer fused none (checked: Attention 0 for both), so they are reported UNFUSED,
# not refused; "no": the 3-D-mask BERT export (an arbitrary dense mask, the case STOF exists for).
EXPECT_FUSED_ATTENTION = {"bert2d": "required", "bert3d": "no", "gpt2": "flag", "vit": "flag"}
OPT_STATS: dict = {}  # model key -> fused operator counts (recorded in e2e.json)
ALLOW_UNFUSED = False  # --allow-unfused-baseline


def ort_optimize(src: Path, dst: Path, model_type: str, key: str):
    from onnxruntime.transformers import optimizer

    stats_file = dst.with_suffix(".stats.json")
    if dst.exists() and stats_file.exists():
        stats = json.loads(stats_file.read_text())
    else:
        opt = optimizer.optimize_model(str(src), model_type=model_type, num_heads=12, hidden_size=768, opt_level=1,
                                       use_gpu=True)
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.convert_float_to_float16(keep_io_types=False)
        opt.save_model_to_file(str(dst))
        stats_file.write_text(json.dumps(stats))
    attn = stats.get("Attention", 0) + stats.get("MultiHeadAttention", 0)
    expect = EXPECT_FUSED_ATTENTION.get(key, "no")
    status = "ok" if attn > 0 or expect == "no" else "UNFUSED"
    OPT_STATS[key] = {"fused": stats, "attention_fused": attn, "expected_fused": expect != "no", "status": status}
    log(f"ort optimizer {dst.name}: fused {stats}  -> attention fused: {attn} (expected: {expect}) [{status}]")
    if status != "ok" and expect == "required" and not ALLOW_UNFUSED:
        raise SystemExit(f"ORT optimizer fused no Attention in {src.name} where it should (stats {stats}): the "
                         "baseline would be unfair; export on a machine whose torch/transformers give a fusable "
                         "graph (--skeletons) or pass --allow-unfused-baseline")
    return dst


def rewrite(src: Path, dst: Path, mask: str | None, max_seq: int | None, dense: str = "stof"):
    import onnx

    from stof_trt.rewrite import rewrite_model
    from stof_trt.masks import parse_mask

    if dst.exists():
        return dst
    m, rep = rewrite_model(onnx.load(str(src)), mask=parse_mask(mask) if mask else None,
                           max_seq_len=max_seq, dense_attention=dense)
    d = rep.to_dict()
    log(f"rewrite {dst.name}: " + ", ".join(f"{k}={v.get('matched')}" for k, v in d.get("patterns", {}).items()))
    tmp = dst.with_suffix(".fp32.onnx")
    onnx.save(m, str(tmp))
    to_fp16(tmp, dst)
    tmp.unlink()
    return dst


SKELETONS: Path | None = None  # --skeletons DIR: <key>.skel.onnx files (make_skeleton) used instead of exporting
EXPORTED_FROM: dict = {}       # model key -> "skeleton DIR/…" or "export here (torch x, transformers y)"


def exported(key: str, path: Path, export) -> Path:
    """The fp32 model ``key`` at ``path``: refilled from SKELETONS/<key>.skel.onnx when given, else exported."""
    skel = SKELETONS / f"{key}.skel.onnx" if SKELETONS else None
    if skel is not None and skel.exists():  # a model without a skeleton there is exported here
        import onnx

        props = {p.key: p.value for p in onnx.load(str(skel), load_external_data=False).metadata_props}
        EXPORTED_FROM[key] = f"skeleton {skel.name} ({props.get('stof.exported_with', '?')})"
        if not path.exists():
            log(f"refill {skel.name} -> {path.name}")
            fill_skeleton(skel, path)
        return path
    import torch
    import transformers

    EXPORTED_FROM[key] = f"exported here (torch {torch.__version__}, transformers {transformers.__version__})"
    if not path.exists():
        log(f"export {key}")
        export(path)
    return path


def make_skeletons(work: Path, models: list[str], dst: Path) -> None:
    """Export every model here and write DIR/<key>.skel.onnx for the GPU machine (--skeletons DIR)."""
    import onnx
    import torch
    import transformers

    global SKELETONS
    SKELETONS = None
    keys = {"bert": ["bert2d", "bert3d"], "gpt2": ["gpt2"], "vit": ["vit"]}
    from stof_trt.export import export_bert, export_gpt2, export_vit

    fns = {"bert2d": lambda p: export_bert(str(p), mask_dims=2, seq_len=128, **BERT),
           "bert3d": lambda p: export_bert(str(p), mask_dims=3, seq_len=128, **BERT),
           "gpt2": lambda p: export_gpt2(str(p), seq_len=128, padding_mask=True, **GPT2),
           "vit": lambda p: export_vit(str(p), **VIT)}
    work.mkdir(parents=True, exist_ok=True)
    for m in models:
        for key in keys[m]:
            src = exported(key, work / f"{key}.onnx", fns[key])
            out = dst / f"{key}.skel.onnx"
            info = make_skeleton(src, out)
            sk = onnx.load(str(out))
            sk.metadata_props.add(key="stof.exported_with",
                                  value=f"torch {torch.__version__}, transformers {transformers.__version__}")
            onnx.save(sk, str(out))
            log(f"skeleton {out}: {info['stripped']} tensors stripped, {out.stat().st_size / 1e6:.2f} MB")


def prepare(work: Path, models: list[str]) -> dict:
    """Export (or refill from skeletons), convert, optimize and rewrite every model once; returns paths."""
    from stof_trt.export import export_bert, export_gpt2, export_vit

    work.mkdir(parents=True, exist_ok=True)
    paths = {}
    if "bert" in models:
        b2, b3 = work / "bert2d.onnx", work / "bert3d.onnx"
        exported("bert2d", b2, lambda p: export_bert(str(p), mask_dims=2, seq_len=128, **BERT))
        exported("bert3d", b3, lambda p: export_bert(str(p), mask_dims=3, seq_len=128, **BERT))
        paths["bert2d"] = to_fp16(b2, work / "bert2d.fp16.onnx")
        paths["bert3d"] = to_fp16(b3, work / "bert3d.fp16.onnx")
        paths["bert2d_opt"] = ort_optimize(b2, work / "bert2d.ortopt.fp16.onnx", "bert", "bert2d")
        paths["bert3d_opt"] = ort_optimize(b3, work / "bert3d.ortopt.fp16.onnx", "bert", "bert3d")
        if MASK_FILTER is None or "padding" in MASK_FILTER:
            paths["bert_padding_stof"] = rewrite(b2, work / "bert.padding.stof.fp16.onnx", None, 4096)
            paths["bert_padding_stof_ortdense"] = rewrite(b2, work / "bert.padding.stof-ortdense.fp16.onnx", None,
                                                          4096, dense="ort")
        for name, spec in MASKS.items():
            if MASK_FILTER is None or name in MASK_FILTER:
                paths[f"bert_{name}_stof"] = rewrite(b2, work / f"bert.{name}.stof.fp16.onnx", spec, 4096)
    if "gpt2" in models:
        g = work / "gpt2.onnx"
        exported("gpt2", g, lambda p: export_gpt2(str(p), seq_len=128, padding_mask=True, **GPT2))
        paths["gpt2"] = to_fp16(g, work / "gpt2.fp16.onnx")
        paths["gpt2_opt"] = ort_optimize(g, work / "gpt2.ortopt.fp16.onnx", "gpt2", "gpt2")
        paths["gpt2_stof"] = rewrite(g, work / "gpt2.causal.stof.fp16.onnx", None, 4096)
    if "vit" in models:
        v = work / "vit.onnx"
        exported("vit", v, lambda p: export_vit(str(p), **VIT))
        paths["vit"] = to_fp16(v, work / "vit.fp16.onnx")
        paths["vit_opt"] = ort_optimize(v, work / "vit.ortopt.fp16.onnx", "vit", "vit")
        paths["vit_stof"] = rewrite(v, work / "vit.stof.fp16.onnx", None, None)
        paths["vit_stof_ortdense"] = rewrite(v, work / "vit.stof-ortdense.fp16.onnx", None, None, dense="ort")
    return paths


MASK_FILTER: set | None = None  # --masks
CASE_FILTER: set | None = None  # --cases model:mask:S,...


def cases(paths: dict, models: list[str], seqs: list[int]) -> list[dict]:
    out = []
    keep = (lambda m: MASK_FILTER is None or m in MASK_FILTER)
    for S in seqs:
        if "bert" in models:
            if keep("padding"):
                out.append(dict(model="bert", mask="padding", S=S, original=paths["bert2d"], opt=paths["bert2d_opt"],
                                stof=paths["bert_padding_stof"], stof_ortdense=paths["bert_padding_stof_ortdense"],
                                spec=None))
            for name, spec in MASKS.items():
                if keep(name):
                        out.append(dict(model="bert", mask=name, S=S, original=paths["bert3d"],
                                    opt=paths["bert3d_opt"], stof=paths[f"bert_{name}_stof"], spec=spec))
        if "gpt2" in models:
            out.append(dict(model="gpt2", mask="causal", S=S, original=paths["gpt2"], opt=paths["gpt2_opt"],
                            stof=paths["gpt2_stof"], spec=None))
    if "vit" in models:
        out.append(dict(model="vit", mask="none", S=197, original=paths["vit"], opt=paths["vit_opt"],
                        stof=paths["vit_stof"], stof_ortdense=paths["vit_stof_ortdense"], spec=None))
    if CASE_FILTER is not None:
        out = [c for c in out if f"{c['model']}:{c['mask']}:{c['S']}" in CASE_FILTER]
    return out


def case_feeds(case: dict, seed: int = 0):
    from stof_trt.cli.bench import masked_feeds
    from stof_trt.masks import parse_mask

    rng = np.random.default_rng(seed)
    S = case["S"]
    if case["model"] == "vit":
        x = rng.standard_normal((B, 3, 224, 224)).astype(np.float16)
        f = {"pixel_values": x}
        return f, f
    feeds = {"input_ids": rng.integers(0, 1000, size=(B, S)).astype(np.int64),
             "attention_mask": np.ones((B, S), np.int64)}
    dense = None
    if case["spec"]:
        # the dense mask of the layout the rewrite compiled (S=4096), top-left corner
        from stof_trt.format import compile_mask

        dense = compile_mask(parse_mask(case["spec"]), 4096, 4096).to_dense()[0]
    return masked_feeds(feeds, dense, PADDING, seed)


# ---------------------------------------------------------------------------------------------------------------
# tuning and benchmark
# ---------------------------------------------------------------------------------------------------------------
def tune(paths: dict, models: list[str], seqs: list[int], out: Path) -> dict:
    import onnx

    from stof_trt.tactic_cache import TacticCache
    from stof_trt.tune import tune_model

    cache = TacticCache(path=out / "tactic_cache.json")
    pre = TacticCache(path=out / "tactic_cache_presearch.json")
    rows = []
    done = set()
    for c in cases(paths, models, seqs):
        if str(c["stof"]) in done and c["model"] == "vit":
            continue
        feeds2, _ = case_feeds(c)
        model = onnx.load(str(c["stof"]))
        t0 = time.perf_counter()
        res = tune_model(model, [feeds2], cache, k=3, all_tactics=TUNE_ALL, progress=False)
        for r in res:
            pre.put(r.key, r.presearch_tactic, source="presearch", nodes=r.nodes)
            rows.append(dict(model=c["model"], mask=c["mask"], S=c["S"], bucket=r.key.bucket, nodes=len(r.nodes),
                             presearch=r.presearch_tactic, presearch_ms=r.presearch_ms, best=r.best_tactic,
                             best_ms=r.best_ms, default=r.default_tactic,
                             default_ms=r.times_ms.get(r.default_tactic), gain=r.gain,
                             candidates={str(k): v for k, v in r.times_ms.items()}))
            log(f"tune {c['model']}/{c['mask']}/S={c['S']}: pre-search {r.presearch_tactic} {r.presearch_ms:.4f} ms,"
                f" best {r.best_tactic} {r.best_ms:.4f} ms, gain {r.gain:.3f}x  ({time.perf_counter() - t0:.1f} s)")
        del model
        gc.collect()
    cache.save()
    pre.save()
    (out / "tune.json").write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


def bench(paths: dict, models: list[str], seqs: list[int], out: Path, iters: int, warmup: int,
          variants: list[str]) -> list[dict]:
    from stof_trt.cli.bench import bench_models, max_diff

    results = []
    cache = out / "tactic_cache.json"
    pre = out / "tactic_cache_presearch.json"
    for c in cases(paths, models, seqs):
        feeds2, feeds3 = case_feeds(c)
        todo = []
        if "original" in variants:
            todo.append(("original", str(c["original"]), None))
        if "ortopt" in variants:
            todo.append(("ort-optimized", str(c["opt"]), None))
        if "stof" in variants:
            todo.append(("stof", str(c["stof"]), cache if cache.exists() else None))
        if "stof-presearch" in variants and pre.exists():
            todo.append(("stof-presearch", str(c["stof"]), pre))
        if "stof-nocache" in variants:  # no tactic cache: the plugin's own pre-search fallback (C++)
            todo.append(("stof-nocache", str(c["stof"]), None))
        if "stof-ortdense" in variants and c.get("stof_ortdense"):  # dense attention left to ORT's Attention
            todo.append(("stof-ortdense", str(c["stof_ortdense"]), cache if cache.exists() else None))
        for extra in (v for v in variants if v.endswith("-graph")):  # CUDA-graph replay: ortopt-graph, stof-graph
            base = {"original": ("original", None), "ortopt": ("opt", None),
                    "stof": ("stof", cache if cache.exists() else None)}.get(extra[: -len("-graph")])
            if base is not None:
                todo.append((extra.replace("ortopt", "ort-optimized"), str(c[base[0]]), base[1]))
        rows = []
        for label, path, tc in todo:
            try:
                r = bench_models([(label, path)], feeds2, feeds3, iters=iters, warmup=warmup, tactic_cache=tc,
                                 cuda_graphs=label.endswith("-graph"))[0]
                if PROFILE and not label.endswith("-graph") and label not in ("stof-presearch", "stof-nocache"):
                    PROFILES[f"{c['model']}:{c['mask']}:{c['S']}:{label}"] = profile_model(path, feeds2, feeds3, tc)
            except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory)
                log(f"{c['model']}/{c['mask']}/S={c['S']} {label}: FAILED {str(e).splitlines()[0][:300]}")
                rows.append({"model": label, "error": str(e).splitlines()[0][:300]})
                results.append({"model": c["model"], "mask": c["mask"], "S": c["S"], "variant": label,
                                "error": str(e).splitlines()[0][:300]})
                continue
            rows.append(r)
            gc.collect()
        ref = next((r for r in rows if r.get("model") == "original" and "output" in r), None)
        for r in rows:
            if "output" not in r:
                continue
            rec = {k: c[k] for k in ("model", "mask", "S")}
            rec.update(variant=r["model"], median_ms=r["median_ms"], p90_ms=r["p90_ms"], min_ms=r["min_ms"],
                       runs=r["runs"])
            o = r["output"].astype(np.float64)
            rec["finite"] = bool(np.isfinite(o).all())
            if ref is not None:
                refo = ref["output"].astype(np.float64)
                valid = _valid_rows(c, feeds2)
                rec["max_abs_diff"] = max_diff(refo[valid], o[valid])
                rec["max_abs_ref"] = float(np.abs(refo[valid]).max())
            results.append(rec)
            log(f"{c['model']:5s} {c['mask']:10s} S={c['S']:5d} {r['model']:15s} median {r['median_ms']:8.3f} ms"
                f"  p90 {r['p90_ms']:8.3f}  max|diff| {rec.get('max_abs_diff', float('nan')):.3e}")
        for r in rows:
            r.pop("output", None)
        gc.collect()
    return results


PROFILE = False   # --profile
TUNE_ALL = False  # --tune-all: time every valid tactic, not the pre-search shortlist
PROFILES: dict = {}

# kernel name -> category (first match wins)
KERNEL_CLASSES = [
    ("LayerNorm", ("addLayerNorm",)),
    ("GELU/bias/elementwise", ("geluErf",)),
    ("attention (STOF)", ("stof", "sparse_attention", "SparseAttention", "hopper_attn", "rowwise", "blockwise")),
    ("attention (ORT)", ("fmha", "flash", "Fmha", "cutlass::fmha", "attention", "Attention", "softmax", "Softmax")),
    ("GEMM", ("gemm", "Gemm", "cutlass", "xmma", "cublas", "sm90_", "nvjet", "Kernel2")),
    ("LayerNorm", ("LayerNorm", "layer_norm", "layerNorm", "addLayerNorm", "SkipLayerNorm", "LayerNormalization")),
    ("transpose/copy", ("Transpose", "transpose", "Copy", "copy", "Split", "Concat", "Gather", "Slice")),
    ("GELU/bias/elementwise", ("Gelu", "gelu", "Elementwise", "elementwise", "BinaryElementWise", "Unary",
                               "_Add", "Add", "Mul", "Cast", "Where", "bias", "Bias")),
]


def _kernel_class(name: str) -> str:
    for cls, keys in KERNEL_CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def profile_model(path: str, feeds2: dict, feeds3: dict, tactic_cache, runs: int = 10) -> dict:
    """Where one run's GPU time goes: CUPTI kernel records (torch.profiler, which sees every kernel of the
    process, ORT's and libstof's) over ``runs`` IO-bound runs, per kernel and per class; plus ORT's own profile
    (SessionOptions.enable_profiling: per-node host-side times, which for the CUDA EP are launch times)."""
    import tempfile

    import onnxruntime as ort

    from stof_trt import ort as sort
    from stof_trt.cli.bench import _has_stof_nodes, feeds_for

    res: dict = {"runs": runs}
    is_stof = _has_stof_nodes(path)
    so = ort.SessionOptions()
    tmp = tempfile.mkdtemp(prefix="stof-prof-")
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tmp, "ort")
    sess = sort.session(path, tactic_cache=tactic_cache if is_stof else None, register=is_stof, session_options=so)
    feeds = feeds_for(sess, feeds2, feeds3)
    b = sort.Binding(sess, feeds)
    for _ in range(3):
        b.run()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                b.run()
            torch.cuda.synchronize()
        kernels: dict = {}
        for e in prof.events():
            if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        total = sum(v[1] for _, v in top) / runs / 1e3
        classes: dict = {}
        for name, (n, us) in top:
            c = classes.setdefault(_kernel_class(name), [0, 0.0])
            c[0] += n / runs
            c[1] += us / runs / 1e3
        res["gpu_kernel_ms_per_run"] = round(total, 4)
        res["classes_ms"] = {k: {"launches": round(v[0], 1), "ms": round(v[1], 4)}
                             for k, v in sorted(classes.items(), key=lambda kv: -kv[1][1])}
        res["top_kernels"] = [{"name": name[:160], "class": _kernel_class(name), "launches": n / runs,
                               "ms": round(us / runs / 1e3, 4)} for name, (n, us) in top[:30]]
    except Exception as e:  # noqa: BLE001 - the ORT profile below still says something
        res["cupti_error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    prof_file = sess.end_profiling()
    try:
        ev = json.loads(Path(prof_file).read_text())
        per_op: dict = {}
        n_runs = sum(1 for e in ev if e.get("name") == "model_run")
        for e in ev:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                op = e.get("args", {}).get("op_name", "?")
                per_op.setdefault(op, [0, 0.0])
                per_op[op][0] += 1
                per_op[op][1] += e.get("dur", 0)
        res["ort_nodes_host_ms"] = {op: {"nodes": round(n / max(n_runs, 1), 1), "ms": round(us / max(n_runs, 1) / 1e3, 4)}
                                    for op, (n, us) in sorted(per_op.items(), key=lambda kv: -kv[1][1])}
        # which EP each node ran on: CPU nodes inside a CUDA model cost copies and synchronisation
        eps: dict = {}
        for e in ev:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                a = e.get("args", {})
                eps.setdefault(a.get("provider", "?"), set()).add(a.get("op_name", "?"))
        res["ort_ops_by_provider"] = {k: sorted(v) for k, v in eps.items()}
    except Exception as e:  # noqa: BLE001
        res["ort_profile_error"] = str(e)[:200]
    del b, sess
    gc.collect()
    if "classes_ms" in res:
        log(f"profile {Path(path).name}: {res['gpu_kernel_ms_per_run']:.3f} ms of kernels per run: "
            + ", ".join(f"{k} {v['ms']:.3f} ({v['launches']:.0f})" for k, v in res["classes_ms"].items()))
    return res


def _valid_rows(case, feeds2):
    """Compare all tokens (padded query rows too: both models compute them from the same allowed keys)."""
    return (slice(None),)


def write_report(results: list[dict], tune_rows: list[dict], out: Path, cmd: str):
    (out / "e2e.json").write_text(json.dumps({"command": cmd, "results": results, "tune": tune_rows,
                                              "ort_optimizer": OPT_STATS, "exported_from": EXPORTED_FROM,
                                              "profiles": PROFILES}, indent=1))
    lines = [f"Command: `{cmd}`", ""]
    if OPT_STATS:
        lines += ["| ORT-optimizer input | exported | fused operators | attention fused | baseline |", "|---|---|---|---|---|"]
        for k, v in OPT_STATS.items():
            lines.append(f"| {k} | {EXPORTED_FROM.get(k, '?')} | "
                         + ", ".join(f"{op} {n}" for op, n in v["fused"].items())
                         + f" | {v['attention_fused']} (expected {'yes' if v['expected_fused'] else 'no'}) | "
                         f"{v['status']} |")
        lines.append("")
    lines += ["| model | mask | S | original median / p90 | ORT-optimizer median / p90 | STOF median / p90 | "
              "STOF vs ORT-opt | STOF max abs diff vs original |", "|---|---|---|---|---|---|---|---|"]
    keyed = {}
    for r in results:
        if "error" not in r:
            keyed.setdefault((r["model"], r["mask"], r["S"]), {})[r["variant"]] = r
    for (m, mask, S), v in keyed.items():
        def cell(name):
            r = v.get(name)
            return f"{r['median_ms']:.2f} / {r['p90_ms']:.2f}" if r else "n/a"

        sp = (f"{v['ort-optimized']['median_ms'] / v['stof']['median_ms']:.2f}x"
              if "stof" in v and "ort-optimized" in v else "n/a")
        d = v.get("stof", {}).get("max_abs_diff")
        ref = v.get("stof", {}).get("max_abs_ref")
        lines.append(f"| {m} | {mask} | {S} | {cell('original')} | {cell('ort-optimized')} | {cell('stof')} | {sp} | "
                     + (f"{d:.2e} (max abs {ref:.2f})" if d is not None else "n/a") + " |")
    lines += ["", "| model | mask | S | variant | median / p90 (ms) | vs ORT-optimizer | max abs diff vs original |",
              "|---|---|---|---|---|---|---|"]
    for (m, mask, S), v in keyed.items():
        opt = v.get("ort-optimized")
        for name, r in v.items():
            d = r.get("max_abs_diff")
            lines.append(f"| {m} | {mask} | {S} | {name} | {r['median_ms']:.3f} / {r['p90_ms']:.3f} | "
                         + (f"{opt['median_ms'] / r['median_ms']:.2f}x" if opt else "n/a") + " | "
                         + (f"{d:.2e}" if d is not None else "n/a") + " |")
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "| model | mask | S | variant | failed |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['mask']} | {r['S']} | {r['variant']} | {r['error'][:160]} |" for r in errors]
    if any(k.endswith("-graph") for v in keyed.values() for k in v):
        lines += ["", "| model | mask | S | variant | CUDA graph median / p90 | without graph | max abs diff |",
                  "|---|---|---|---|---|---|---|"]
        for (m, mask, S), v in keyed.items():
            for name, r in v.items():
                if name.endswith("-graph"):
                    plain = v.get(name[: -len("-graph")])
                    d = r.get("max_abs_diff")
                    lines.append(f"| {m} | {mask} | {S} | {name} | {r['median_ms']:.2f} / {r['p90_ms']:.2f} | "
                                 + (f"{plain['median_ms']:.2f}" if plain else "n/a") + " | "
                                 + (f"{d:.2e}" if d is not None else "n/a") + " |")
    if PROFILES:
        lines += ["", "| case | variant | GPU kernels ms/run | by class (ms, launches) |", "|---|---|---|---|"]
        for key, p in PROFILES.items():
            m, mask, S, label = key.split(":")
            cls = ", ".join(f"{k} {c['ms']:.3f} ({c['launches']:.0f})" for k, c in p.get("classes_ms", {}).items())
            lines.append(f"| {m} {mask} {S} | {label} | {p.get('gpu_kernel_ms_per_run', 'n/a')} | "
                         f"{cls or p.get('cupti_error', '')} |")
    if any("stof-presearch" in v for v in keyed.values()):
        lines += ["", "| model | mask | S | STOF pre-search tactics | STOF measured tactics | gain |", "|---|---|---|---|---|---|"]
        for (m, mask, S), v in keyed.items():
            if "stof-presearch" in v and "stof" in v:
                a, b = v["stof-presearch"]["median_ms"], v["stof"]["median_ms"]
                lines.append(f"| {m} | {mask} | {S} | {a:.3f} | {b:.3f} | {a / b:.3f}x |")
    if tune_rows:
        lines += ["", "| model | mask | S | nodes | pre-search tactic (ms) | measured best (ms) | library default (ms) | "
                  "attention gain |", "|---|---|---|---|---|---|---|---|"]
        for t in tune_rows:
            dms = f"{t['default']} ({t['default_ms']:.4f})" if t.get("default_ms") else str(t.get("default"))
            lines.append(f"| {t['model']} | {t['mask']} | {t['S']} | {t['nodes']} | {t['presearch']} "
                         f"({t['presearch_ms']:.4f}) | {t['best']} ({t['best_ms']:.4f}) | {dms} | {t['gain']:.3f}x |")
    (out / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/stof-e2e")
    ap.add_argument("--models", default="bert,gpt2,vit")
    ap.add_argument("--seqs", default="512,2048,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default="original,ortopt,stof,stof-presearch")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--tune-only", action="store_true")
    ap.add_argument("--no-tune", action="store_true", help="bench with the existing OUT/tactic_cache*.json")
    ap.add_argument("--cases", help="only these cases, e.g. bert:padding:512,bert:longformer:4096")
    ap.add_argument("--masks", help="BERT masks to run (padding,longformer,bigbird; default all)")
    ap.add_argument("--tiny", action="store_true", help="2-layer, 128-wide models (a smoke test of the flow)")
    ap.add_argument("--skeletons", help="refill the fp32 models from DIR/<key>.skel.onnx where present (keys bert2d, "
                    "bert3d, gpt2, vit) instead of exporting them")
    ap.add_argument("--make-skeletons", metavar="DIR", help="export here and write DIR/<key>.skel.onnx, then stop")
    ap.add_argument("--allow-unfused-baseline", action="store_true",
                    help="time an ORT-optimizer model that fused no Attention where it should (flagged UNFUSED)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel GPU time (CUPTI via torch.profiler) and ORT's node profile of each variant")
    ap.add_argument("--tune-all", action="store_true", help="tune over every valid tactic (not the shortlist)")
    args = ap.parse_args()
    global SKELETONS, ALLOW_UNFUSED, PROFILE, TUNE_ALL
    TUNE_ALL = args.tune_all
    SKELETONS = Path(args.skeletons) if args.skeletons else None
    ALLOW_UNFUSED = args.allow_unfused_baseline
    PROFILE = args.profile
    if args.tiny:
        for cfg in (BERT, GPT2, VIT):
            cfg.update(layers=2)
        BERT.update(vocab_size=1000)
        GPT2.update(vocab_size=1000)
    global MASK_FILTER, CASE_FILTER
    MASK_FILTER = set(args.masks.split(",")) if args.masks else None
    CASE_FILTER = set(args.cases.split(",")) if args.cases else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    seqs = [int(s) for s in args.seqs.split(",") if s]
    cmd = "python3 scripts/bench_e2e.py " + " ".join(sys.argv[1:])
    t0 = time.time()
    if args.make_skeletons:
        make_skeletons(Path(args.work), models, Path(args.make_skeletons))
        return
    paths = prepare(Path(args.work), models)
    log(f"prepared in {time.time() - t0:.0f} s")
    if args.prepare_only:
        return
    tune_rows = []
    tj = out / "tune.json"
    if not args.no_tune:
        tune_rows = tune(paths, models, seqs, out)["rows"]
    elif tj.exists():
        tune_rows = json.loads(tj.read_text())
    if args.tune_only:
        write_report([], tune_rows, out, cmd)
        return
    results = bench(paths, models, seqs, out, args.iters, args.warmup, args.variants.split(","))
    write_report(results, tune_rows, out, cmd)
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
