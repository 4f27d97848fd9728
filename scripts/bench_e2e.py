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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def ort_optimize(src: Path, dst: Path, model_type: str):
    from onnxruntime.transformers import optimizer

    if dst.exists():
        return dst
    opt = optimizer.optimize_model(str(src), model_type=model_type, num_heads=12, hidden_size=768, opt_level=1,
                                   use_gpu=True)
    opt.convert_float_to_float16(keep_io_types=False)
    opt.save_model_to_file(str(dst))
    log(f"ort optimizer {dst.name}: {opt.get_fused_operator_statistics()}")
    return dst


def rewrite(src: Path, dst: Path, mask: str | None, max_seq: int | None):
    import onnx

    import graph_rewrite
    from stof_trt.masks import parse_mask

    if dst.exists():
        return dst
    m, rep = graph_rewrite.rewrite_model(onnx.load(str(src)), mask=parse_mask(mask) if mask else None,
                                         max_seq_len=max_seq)
    d = rep.to_dict()
    log(f"rewrite {dst.name}: " + ", ".join(f"{k}={v.get('matched')}" for k, v in d.get("patterns", {}).items()))
    tmp = dst.with_suffix(".fp32.onnx")
    onnx.save(m, str(tmp))
    to_fp16(tmp, dst)
    tmp.unlink()
    return dst


def prepare(work: Path, models: list[str]) -> dict:
    """Export, convert, optimize and rewrite every model once; returns {case family: paths}."""
    from stof_trt.export import export_bert, export_gpt2, export_vit

    work.mkdir(parents=True, exist_ok=True)
    paths = {}
    if "bert" in models:
        b2, b3 = work / "bert2d.onnx", work / "bert3d.onnx"
        if not b2.exists():
            log("export BERT-base (2-D mask)")
            export_bert(str(b2), mask_dims=2, seq_len=128, **BERT)
        if not b3.exists():
            log("export BERT-base (3-D mask)")
            export_bert(str(b3), mask_dims=3, seq_len=128, **BERT)
        paths["bert2d"] = to_fp16(b2, work / "bert2d.fp16.onnx")
        paths["bert3d"] = to_fp16(b3, work / "bert3d.fp16.onnx")
        paths["bert2d_opt"] = ort_optimize(b2, work / "bert2d.ortopt.fp16.onnx", "bert")
        paths["bert3d_opt"] = ort_optimize(b3, work / "bert3d.ortopt.fp16.onnx", "bert")
        if MASK_FILTER is None or "padding" in MASK_FILTER:
            paths["bert_padding_stof"] = rewrite(b2, work / "bert.padding.stof.fp16.onnx", None, 4096)
        for name, spec in MASKS.items():
            if MASK_FILTER is None or name in MASK_FILTER:
                paths[f"bert_{name}_stof"] = rewrite(b2, work / f"bert.{name}.stof.fp16.onnx", spec, 4096)
    if "gpt2" in models:
        g = work / "gpt2.onnx"
        if not g.exists():
            log("export GPT-2 (max positions 4096)")
            export_gpt2(str(g), seq_len=128, padding_mask=True, **GPT2)
        paths["gpt2"] = to_fp16(g, work / "gpt2.fp16.onnx")
        paths["gpt2_opt"] = ort_optimize(g, work / "gpt2.ortopt.fp16.onnx", "gpt2")
        paths["gpt2_stof"] = rewrite(g, work / "gpt2.causal.stof.fp16.onnx", None, 4096)
    if "vit" in models:
        v = work / "vit.onnx"
        if not v.exists():
            log("export ViT-base")
            export_vit(str(v), **VIT)
        paths["vit"] = to_fp16(v, work / "vit.fp16.onnx")
        paths["vit_opt"] = ort_optimize(v, work / "vit.ortopt.fp16.onnx", "vit")
        paths["vit_stof"] = rewrite(v, work / "vit.stof.fp16.onnx", None, None)
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
                                stof=paths["bert_padding_stof"], spec=None))
            for name, spec in MASKS.items():
                if keep(name):
                        out.append(dict(model="bert", mask=name, S=S, original=paths["bert3d"],
                                    opt=paths["bert3d_opt"], stof=paths[f"bert_{name}_stof"], spec=spec))
        if "gpt2" in models:
            out.append(dict(model="gpt2", mask="causal", S=S, original=paths["gpt2"], opt=paths["gpt2_opt"],
                            stof=paths["gpt2_stof"], spec=None))
    if "vit" in models:
        out.append(dict(model="vit", mask="none", S=197, original=paths["vit"], opt=paths["vit_opt"],
                        stof=paths["vit_stof"], spec=None))
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
        res = tune_model(model, [feeds2], cache, k=3, progress=False)
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
        rows = []
        for label, path, tc in todo:
            try:
                r = bench_models([(label, path)], feeds2, feeds3, iters=iters, warmup=warmup, tactic_cache=tc)[0]
            except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory)
                log(f"{c['model']}/{c['mask']}/S={c['S']} {label}: FAILED {str(e).splitlines()[0][:300]}")
                rows.append({"model": label, "error": str(e).splitlines()[0][:300]})
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


def _valid_rows(case, feeds2):
    """Compare all tokens (padded query rows too: both models compute them from the same allowed keys)."""
    return (slice(None),)


def write_report(results: list[dict], tune_rows: list[dict], out: Path, cmd: str):
    (out / "e2e.json").write_text(json.dumps({"command": cmd, "results": results, "tune": tune_rows}, indent=1))
    lines = [f"Command: `{cmd}`", "",
             "| model | mask | S | original median / p90 | ORT-optimizer median / p90 | STOF median / p90 | "
             "STOF vs ORT-opt | STOF max abs diff vs original |", "|---|---|---|---|---|---|---|---|"]
    keyed = {}
    for r in results:
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
    args = ap.parse_args()
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
