"""Benchmark an original ONNX model against its STOF rewrite on ONNX Runtime's CUDA EP (IO binding, warm-up,
median and p90 over many runs) and check that they compute the same function: max |difference| of the outputs on
the same random inputs.

With --mask SPEC and an original whose `attention_mask` input is 3-D ([B,S,S]: non-zero = query may attend key),
the original is fed the dense mask (ANDed with the padding), so both models compute the same masked attention.
--padding R gives each batch row a random key length in [R*S, S] (default: no padding).  --ort-optimized adds a
third model (e.g. the original after onnxruntime.transformers.optimizer).

examples:
  stof bench bert_mask3d.fp16.onnx bert.stof.fp16.onnx --mask longformer:window=256,global=32 \\
      --shapes input_ids=8x4096,attention_mask=8x4096 --tactic-cache h100.json --plot bench.png
  stof bench gpt2.fp16.onnx gpt2.stof.fp16.onnx --shapes input_ids=8x2048,attention_mask=8x2048 --json
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import StofError
from .common import (OnceMask, check_output_path, check_seq_limit, int_in, load_model, ort_error, print_json,
                     print_table)


def add_args(p):
    p.add_argument("original", metavar="ORIGINAL.onnx")
    p.add_argument("rewritten", metavar="REWRITTEN.onnx")
    p.add_argument("--ort-optimized", metavar="MODEL.onnx", help="a third model to time (same inputs as ORIGINAL)")
    p.add_argument("--mask", action=OnceMask, metavar="SPEC",
                   help="the static mask the rewrite used (fed densely to a 3-D mask input)")
    p.add_argument("--shapes", action="append", default=[], metavar="NAME=DxD,...",
                   help="input shapes of the rewritten model (symbolic dims)")
    p.add_argument("--padding", type=float, default=None, metavar="R",
                   help="random key lengths in [R*S, S] per batch row (default: none)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.add_argument("--device", type=int_in(0, 1023), default=0, help="CUDA device id")
    p.add_argument("--tactic-cache", metavar="FILE.json")
    p.add_argument("--cuda-graphs", action="store_true", help="run each model through a captured CUDA graph")
    p.add_argument("--atol", type=float, default=None,
                   help="max |diff| accepted (default: 2e-2 x max|output| for fp16 outputs, 1e-4 x for fp32)")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of the latencies")
    p.add_argument("--json", action="store_true")


def masked_feeds(feeds: dict, mask_dense: np.ndarray | None, padding: float | None, seed: int) -> tuple[dict, dict]:
    """(feeds for the rewritten model with a 2-D padding mask, feeds for an original with a 3-D mask input)."""
    rng = np.random.default_rng(seed + 1)
    out2 = dict(feeds)
    am = feeds.get("attention_mask")
    if am is None:
        return out2, dict(feeds)
    B, S = am.shape[:2]
    if padding is not None:
        lengths = rng.integers(int(np.ceil(padding * S)), S + 1, size=B)
        lengths[0] = S
        am = (np.arange(S)[None, :] < lengths[:, None]).astype(am.dtype)
        out2["attention_mask"] = am
    dense = np.ones((S, S), bool) if mask_dense is None else mask_dense[:S, :S]
    m3 = (dense[None] & (am[:, None, :] != 0)).astype(am.dtype)
    out3 = dict(out2)
    out3["attention_mask"] = m3
    return out2, out3


def feeds_for(sess, feeds2: dict, feeds3: dict) -> dict:
    """Pick the 2-D or 3-D attention mask by the session's input rank; other inputs as given."""
    out = {}
    from ..nodes import TOKEN_CAPACITY_INPUT

    for i in sess.get_inputs():
        if i.name == TOKEN_CAPACITY_INPUT:  # Binding sizes it from the padding mask
            continue
        if i.name == "attention_mask" and len(i.shape) == 3:
            out[i.name] = feeds3[i.name]
        elif i.name in feeds2:
            out[i.name] = feeds2[i.name]
        else:
            raise StofError(f"no value for input '{i.name}'")
        want = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(float16)": np.float16}.get(i.type)
        if want is not None and out[i.name].dtype != want:
            out[i.name] = out[i.name].astype(want)
    return out


def bench_models(models: list[tuple[str, str]], feeds2: dict, feeds3: dict, *, iters: int, warmup: int,
                 device: int = 0, tactic_cache=None, cuda_graphs: bool = False) -> list[dict]:
    """[(label, path)] -> rows with latency stats and the first output (host numpy)."""
    from .. import ort as sort

    rows = []
    for label, path in models:
        is_stof = _has_stof_nodes(path)
        sess = sort.session(path, device_id=device, tactic_cache=tactic_cache if is_stof else None,
                            cuda_graphs=cuda_graphs, register=is_stof)
        feeds = feeds_for(sess, feeds2, feeds3)
        b = sort.Binding(sess, feeds, device_id=device)
        try:
            times = sort.time_session(sess, feeds, warmup=warmup, iters=iters, binding=b)
        except Exception as e:  # noqa: BLE001
            raise StofError(f"{label}: {ort_error(e, path)}") from None
        outs = b.outputs()
        rows.append({"model": label, "path": path, **sort.latency_stats(times), "output": outs[0],
                     "stof_nodes": is_stof})
        del b, sess
    return rows


def _has_stof_nodes(path: str) -> bool:
    return any(n.domain == "stof" for n in load_model(path, keep_external_data=True).graph.node)


def max_diff(ref: np.ndarray, got: np.ndarray, keep: np.ndarray | None = None) -> float:
    """max |ref - got|; at the real tokens (``keep`` [B, S]) of a [B, S, ...] output when given (a rewritten model
    with its padding removed has zeros at padded positions; docs/rewrite.md)."""
    if ref.shape != got.shape:
        raise StofError(f"output shapes differ: {ref.shape} vs {got.shape}")
    if keep is not None and ref.shape[:2] == keep.shape:
        ref, got = ref[keep], got[keep]
    return float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["model"] for r in rows]
    med = [r["median_ms"] for r in rows]
    err = [[0] * len(rows), [r["p90_ms"] - r["median_ms"] for r in rows]]
    ax.barh(names, med, xerr=err, color=["#888", "#4a7", "#27c"][: len(rows)])
    ax.set_xlabel("latency (ms): median, whisker to p90")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    from .. import ort as sort
    from ..masks import parse_mask

    for p in [args.original, args.rewritten] + ([args.ort_optimized] if args.ort_optimized else []):
        if not os.path.isfile(p):
            raise StofError(f"no such file: {p}")
    if not 1 <= args.iters <= 1_000_000 or not 0 <= args.warmup <= 1_000_000:
        raise StofError("--iters must be in [1, 1000000] and --warmup in [0, 1000000]")
    if args.atol is not None and not (np.isfinite(args.atol) and args.atol >= 0):
        raise StofError(f"--atol must be a finite number >= 0, got {args.atol}")
    if args.plot is not None:  # a path that cannot take the chart must not cost the benchmark
        if os.path.splitext(args.plot)[1].lower() not in (".png", ".svg", ".pdf"):
            raise StofError(f"--plot {args.plot!r}: give a .png, .svg or .pdf file")
        check_output_path(None, args.plot)
    if args.padding is not None and not 0 < args.padding <= 1:
        raise StofError("--padding must be in (0, 1]")
    mask = parse_mask(args.mask) if args.mask else None
    # random inputs from the rewritten model's signature (every model read first: a bad file fails before any work)
    rm = load_model(args.rewritten, keep_external_data=True)
    for path in (args.original, args.ort_optimized):
        if path:
            load_model(path, keep_external_data=True)
    check_seq_limit(rm, sort.parse_shapes(args.shapes))
    feeds = _random_feeds_from_model(rm, sort.parse_shapes(args.shapes), args.seed)
    S = next((v.shape[1] for k, v in feeds.items() if k == "attention_mask"), None)
    dense = mask.dense(S, S) if (mask is not None and S) else None
    feeds2, feeds3 = masked_feeds(feeds, dense, args.padding, args.seed)
    models = [("original", args.original)]
    if args.ort_optimized:
        models.append(("ort-optimized", args.ort_optimized))
    models.append(("stof", args.rewritten))
    rows = bench_models(models, feeds2, feeds3, iters=args.iters, warmup=args.warmup, device=args.device,
                        tactic_cache=args.tactic_cache, cuda_graphs=args.cuda_graphs)
    ref = rows[0]["output"]
    scale = float(np.max(np.abs(ref.astype(np.float64)))) if ref.size else 0.0
    atol = args.atol if args.atol is not None else (2e-2 if ref.dtype == np.float16 else 1e-4) * max(1.0, scale)
    ok = True
    base = rows[0]["median_ms"]
    keep = feeds2["attention_mask"] != 0 if getattr(feeds2.get("attention_mask"), "ndim", 0) == 2 else None
    for r in rows:
        r["max_abs_diff"] = max_diff(ref, r["output"], keep)
        r["finite"] = bool(np.isfinite(r["output"].astype(np.float64)).all())
        r["match"] = r["finite"] and r["max_abs_diff"] <= atol
        r["speedup_vs_original"] = base / r["median_ms"]
        ok = ok and r["match"]
    info = {"shapes": {k: list(v.shape) for k, v in feeds2.items()}, "mask": str(mask) if mask else None,
            "padding": args.padding, "atol": atol, "max_abs_output": scale, "iters": args.iters,
            "results": [{k: v for k, v in r.items() if k != "output"} for r in rows], "match": ok}
    if args.plot is not None:
        plot(rows, args.plot, f"{os.path.basename(args.rewritten)}  {info['shapes']}")
        info["plot"] = args.plot
    if args.json:
        print_json(info)
    else:
        print_table([[r["model"], f"{r['median_ms']:.3f}", f"{r['p90_ms']:.3f}", f"{r['speedup_vs_original']:.2f}x",
                      f"{r['max_abs_diff']:.2e}", "yes" if r["match"] else "NO"] for r in rows],
                    ["model", "median ms", "p90 ms", "vs original", "max |diff|", "match"])
        print(f"\ninputs {info['shapes']}, mask {info['mask']}, tolerance {atol:.2e} (max |output| {scale:.3g})")
    return 0 if ok else 1


def _random_feeds_from_model(model, shapes: dict, seed: int) -> dict:
    from .. import ort as sort

    class _Sig:
        def __init__(self, m):
            from onnx import TensorProto

            names = {TensorProto.FLOAT: "tensor(float)", TensorProto.FLOAT16: "tensor(float16)",
                     TensorProto.INT64: "tensor(int64)", TensorProto.INT32: "tensor(int32)",
                     TensorProto.BOOL: "tensor(bool)"}
            inits = {t.name for t in m.graph.initializer}
            self._inputs = []
            for vi in m.graph.input:
                if vi.name in inits:
                    continue
                tt = vi.type.tensor_type
                dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
                self._inputs.append(type("I", (), {"name": vi.name, "shape": dims,
                                                   "type": names.get(tt.elem_type, str(tt.elem_type))}))

        def get_inputs(self):
            return self._inputs

    return sort.random_feeds(_Sig(model), shapes, seed=seed)
