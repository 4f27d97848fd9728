#!/usr/bin/env python3
"""ONNX Runtime's own sparse attention operators against the same computation rewritten to STOF.

One-layer models, each holding one com.microsoft operator at the sizes an ORT user runs it:

* ``longformer_b8`` / ``longformer_b1``: LongformerAttention, Longformer-base-like (hidden 768, 12 heads, window 256
  each side), 32 global tokens at the start (a question), S=4096, B=8 / B=1;
* ``gqa_sliding``: GroupQueryAttention, Mistral-like (32 query heads, 8 K/V heads = GQA 4, head 128),
  local_window_size 4096, S=8192, B=1;
* ``sparse_phi3``: SparseAttention, Phi-3-small-like (32 heads, 8 K/V heads, head 128), block 64, 16 local blocks +
  vertical stride 8 (8 layouts, phase shifted per layout), S=8192, B=1.

Each model is rewritten with ``stof_trt.rewrite.rewrite_model`` and both run on ONNX Runtime's CUDA EP (the
rewritten one with libstof_ort) with IO binding, fp16; latency median / p90 over ``--iters`` runs, outputs compared
(max |diff| relative to max |original|). With ``--cuda-graphs`` each model is also timed replayed as a CUDA graph
where ORT can capture it (LongformerAttention cannot: it reads its global-token count back to the host), and
``speedup_best`` compares the fastest configuration of each. Writes OUT/ort_ops.json and OUT/ort_ops.md.

    python3 scripts/bench_ort_ops.py --out OUT [--cases longformer_b8,gqa_sliding] [--iters 50] [--presearch]
    python3 scripts/bench_ort_ops.py --out OUT --cases longformer_b1 --profile   # + where the GPU time goes
    python3 scripts/bench_ort_ops.py --out OUT --cuda-graphs     # + each model replayed as a CUDA graph
    python3 scripts/bench_ort_ops.py --sizes check --out OUT      # device: small sizes, + float64 reference
    python3 scripts/bench_ort_ops.py --dry-run [--sizes small]   # CPU: build + rewrite (+ check, small sizes)

``--sizes check`` on the device runs the same operators at sizes where an off-by-one in a window or a wrong
head-to-layout mapping stands far above fp16 noise, and compares ORT's output and STOF's with a float64 reference
of the operator's documented semantics (``ort_vs_reference``, ``stof_vs_reference``).

``--dry-run`` needs no GPU: it builds and rewrites every case; with ``--sizes small`` or ``check`` (fp32) it also
checks the rewritten model on CPU against the original where ONNX Runtime
has a CPU kernel (GroupQueryAttention) and against a float64 NumPy reference of the operator's semantics where it
does not (LongformerAttention, SparseAttention: CUDA-only).
"""
from __future__ import annotations

import argparse
import tempfile
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ISSUE = {
    "longformer_b8": dict(op="longformer", B=8, S=4096, H=12, D=64, window=256, globals=32),
    "longformer_b1": dict(op="longformer", B=1, S=4096, H=12, D=64, window=256, globals=32),
    "gqa_sliding": dict(op="gqa", B=1, S=8192, H=32, KV=8, D=128, window=4096),
    "sparse_phi3": dict(op="sparse", B=1, S=8192, H=32, KV=8, D=128, block=64, local=16, stride=8, layouts=8),
}
SMALL = {
    "longformer_b8": dict(op="longformer", B=3, S=96, H=2, D=16, window=8, globals=5),
    "longformer_b1": dict(op="longformer", B=1, S=64, H=2, D=16, window=4, globals=2),
    "gqa_sliding": dict(op="gqa", B=2, S=96, H=8, KV=2, D=16, window=24),
    "sparse_phi3": dict(op="sparse", B=2, S=96, H=8, KV=2, D=16, block=8, local=3, stride=4, layouts=4),
}
#: On the device: sizes at which an off-by-one in a window or a wrong head-to-layout mapping is far above fp16
#: noise (ORT CUDA, STOF CUDA and a float64 reference compared), still within the CUDA kernels' constraints.
CHECK = {
    "longformer_b8": dict(op="longformer", B=2, S=512, H=12, D=64, window=32, globals=5, spread=True),
    "longformer_b1": dict(op="longformer", B=1, S=512, H=12, D=64, window=64, globals=1),
    "gqa_sliding": dict(op="gqa", B=2, S=256, H=8, KV=2, D=64, window=17),
    "sparse_phi3": dict(op="sparse", B=2, S=512, H=8, KV=2, D=128, block=64, local=2, stride=3, layouts=4),
}
SIZES = {"issue": ISSUE, "small": SMALL, "check": CHECK}
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# -- models --------------------------------------------------------------------------------------------------------
def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits=()):
    model = helper.make_model(helper.make_graph(nodes, "ort_op", inputs, outputs, list(inits)), opset_imports=OPSETS)
    model.ir_version = 9
    return model


def local_stride_blocks(num_layout: int, nb: int, local: int, stride: int) -> np.ndarray:
    """bool [L, nb, nb]: causal blocks, the last ``local`` block columns of a row plus every ``stride``-th column,
    the stride phase shifted per layout (Phi-3-small's block-sparse pattern)."""
    qb, kb = np.arange(nb)[:, None], np.arange(nb)[None]
    step = max(1, stride // num_layout)
    vert = [((np.arange(nb) + lay * step + 1) % stride == 0)[None] for lay in range(num_layout)]
    return np.stack([(qb >= kb) & ((qb - kb < local) | v) for v in vert])


def blocks_to_csr(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    L, nb, _ = blocks.shape
    rows = np.zeros((L, nb + 1), np.int32)
    rows[:, 1:] = np.cumsum(blocks.sum(-1), axis=-1)
    cols = np.full((L, int(rows[:, -1].max())), -1, np.int32)
    for lay in range(L):
        c = np.nonzero(blocks[lay])[1]
        cols[lay, :c.size] = c
    return rows, cols


def build(case: dict, fp16: bool, seed: int = 0, presents: bool = False) -> onnx.ModelProto:
    """The one-layer model of ``case``. ``presents``: the present_key / present_value of SparseAttention and
    GroupQueryAttention become graph outputs (ORT's CUDA kernels need them; SparseAttention's writes K/V into the
    past buffers in place, so the timed original binds them to the same device buffers); the rewrite is made from
    the model without them, a prompt whose cache is discarded."""
    T = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    npt = np.float16 if fp16 else np.float32
    rng = np.random.default_rng(seed)
    B, S, H, D = case["B"], case["S"], case["H"], case["D"]
    if case["op"] == "longformer":
        N = H * D
        w = lambda n: numpy_helper.from_array((rng.standard_normal((N, 3 * N)) / np.sqrt(N)).astype(npt), n)  # noqa
        b = lambda n: numpy_helper.from_array((rng.standard_normal(3 * N) * 0.02).astype(npt), n)  # noqa
        node = helper.make_node("LongformerAttention", ["x", "w", "b", "mask", "wg", "bg", "global"], ["y"],
                                domain="com.microsoft", num_heads=H, window=case["window"])
        ins = [_vi("x", T, [B, S, N]), _vi("mask", T, [B, S]), _vi("global", TensorProto.INT32, [B, S])]
        return _model([node], ins, [_vi("y", T, [B, S, N])], [w("w"), b("b"), w("wg"), b("bg")])
    KV = case["KV"]
    qkv = [_vi("q", T, [B, S, H * D]), _vi("k", T, [B, S, KV * D]), _vi("v", T, [B, S, KV * D])]
    if case["op"] == "gqa":
        # ORT's CUDA kernel requires the present outputs (the original on the GPU gets them; the rewrite is made
        # from the model without them, a prompt whose cache is discarded)
        outs = ["y", "present_key", "present_value"] if presents else ["y"]
        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], outs,
                                domain="com.microsoft", num_heads=H, kv_num_heads=KV,
                                local_window_size=case["window"])
        vis = [_vi("y", T, [B, S, H * D])]
        if presents:
            vis += [_vi("present_key", T, [B, KV, S, D]), _vi("present_value", T, [B, KV, S, D])]
        return _model([node], qkv + [_vi("seqlens_k", TensorProto.INT32, [B]), _vi("total", TensorProto.INT32, [])],
                      vis)
    bs = case["block"]
    nb = -(-S // bs)
    rows, cols = blocks_to_csr(local_stride_blocks(case["layouts"], nb, case["local"], case["stride"]))
    node = helper.make_node("SparseAttention", ["q", "k", "v", "past_key", "past_value", "block_row_indices",
                                                "block_col_indices", "total", "key_lengths"],
                            ["y", "present_key", "present_value"], domain="com.microsoft", num_heads=H,
                            kv_num_heads=KV, sparse_block_size=bs)
    past = [_vi("past_key", T, [B, KV, nb * bs, D]), _vi("past_value", T, [B, KV, nb * bs, D])]
    lens = [_vi("total", TensorProto.INT32, [1]), _vi("key_lengths", TensorProto.INT32, [B])]
    layout = [numpy_helper.from_array(rows, "block_row_indices"), numpy_helper.from_array(cols, "block_col_indices")]
    outs = [_vi("y", T, [B, S, H * D])]
    if presents:
        outs += [_vi("present_key", T, [B, KV, nb * bs, D]), _vi("present_value", T, [B, KV, nb * bs, D])]
    return _model([node], qkv + past + lens, outs, layout)


def feeds_for(case: dict, fp16: bool, seed: int = 1) -> dict:
    npt = np.float16 if fp16 else np.float32
    rng = np.random.default_rng(seed)
    B, S, H, D = case["B"], case["S"], case["H"], case["D"]
    if case["op"] == "longformer":
        glob = np.zeros((B, S), np.int32)
        for b in range(B):  # a question at the start, or tokens spread over the sequence
            pos = rng.choice(S, case["globals"], replace=False) if case.get("spread") else np.arange(case["globals"])
            glob[b, pos] = 1
        return {"x": rng.standard_normal((B, S, H * D)).astype(npt), "mask": np.zeros((B, S), npt), "global": glob}
    KV = case["KV"]
    f = {"q": rng.standard_normal((B, S, H * D)).astype(npt), "k": rng.standard_normal((B, S, KV * D)).astype(npt),
         "v": rng.standard_normal((B, S, KV * D)).astype(npt)}
    if case["op"] == "gqa":
        f.update(seqlens_k=np.full(B, S - 1, np.int32), total=np.array(S, np.int32))
    else:
        cache = -(-S // case["block"]) * case["block"]
        f.update(past_key=np.zeros((B, KV, cache, D), npt), past_value=np.zeros((B, KV, cache, D), npt),
                 total=np.array([S], np.int32), key_lengths=np.full(B, S, np.int32))
    return f


# -- float64 references (the operators' documented semantics) -------------------------------------------------------
def _attend(q, k, v, allowed, scale):
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = np.where(allowed, s, -np.inf)
    mx = np.max(s, -1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
    return np.einsum("bhqk,bhkd->bhqd", p / np.maximum(p.sum(-1, keepdims=True), 1e-300), v)


def _heads(x, h):
    b, s, n = x.shape
    return x.astype(np.float64).reshape(b, s, h, n // h).transpose(0, 2, 1, 3)


def _merge(x):
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def reference(case: dict, model: onnx.ModelProto, f: dict) -> np.ndarray:
    H, D, S = case["H"], case["D"], case["S"]
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    if case["op"] == "longformer":
        init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
        x = f["x"].astype(np.float64)
        q, k, v = np.split(x @ init["w"] + init["b"], 3, -1)
        qg, kg, vg = np.split(x @ init["wg"] + init["bg"], 3, -1)
        keep, glob = f["mask"] >= 0, f["global"] == 1
        local = ((np.abs(i - j) <= case["window"])[None] | glob[:, None]) & keep[:, None]
        lo = _attend(_heads(q, H), _heads(k, H), _heads(v, H), local[:, None], D ** -0.5)
        gl = _attend(_heads(qg, H), _heads(kg, H), _heads(vg, H), keep[:, None, None], D ** -0.5)
        return np.where(glob[..., None], _merge(gl), _merge(lo))
    KV = case["KV"]
    q = _heads(f["q"], H)
    k, v = (np.repeat(_heads(f[n], KV), H // KV, 1) for n in "kv")
    if case["op"] == "gqa":
        allowed = ((j <= i) & (i - j < case["window"]))[None, None]
        return _merge(_attend(q, k, v, allowed, D ** -0.5))
    bs = case["block"]
    blocks = local_stride_blocks(case["layouts"], -(-S // bs), case["local"], case["stride"])
    dense = blocks[:, j[0] // bs][:, :, j[0] // bs] & (j <= i)
    return _merge(_attend(q, k, v, dense[np.arange(H) % case["layouts"]][None], D ** -0.5))


# -- running -------------------------------------------------------------------------------------------------------
def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def rewrite(model, tile):
    from stof_trt.rewrite import rewrite_model

    t0 = time.perf_counter()
    new, report = rewrite_model(model, tile_m=tile[0], tile_n=tile[1])
    att = report.to_dict()["attention"]
    if not att or any(n.domain == "com.microsoft" for n in new.graph.node):
        raise SystemExit(f"the rewrite left the operator in place: {report.to_dict()['left_alone']}")
    ops: dict[str, int] = {}
    for n in new.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return new, {"rewrite_s": round(time.perf_counter() - t0, 2), "ops": dict(sorted(ops.items())),
                 "layouts": [{k: a[k] for k in ("seq_q", "seq_k", "density", "tile_density", "num_layouts",
                                                "mask_source")} for a in att]}


def dry_run(names, sizes, tile) -> list[dict]:
    from stof_trt.ort import session

    rows = []
    for name in names:
        case = SIZES[sizes][name]
        model = build(case, fp16=False)
        new, info = rewrite(model, tile)
        row = {"case": name, **case, **info}
        if sizes != "issue":
            f = feeds_for(case, fp16=False)
            got = session(new, providers="cpu").run(None, f)[0]
            row["vs_reference"] = rel_diff(got, reference(case, model, f))
            if case["op"] == "gqa":  # ONNX Runtime has a CPU kernel for this one
                row["vs_original_cpu"] = rel_diff(got, session(model, providers="cpu").run(None, f)[0])
            if max(v for k, v in row.items() if k.startswith("vs_")) > 1e-4:
                raise SystemExit(f"{name}: the rewritten model differs: {row}")
        log(name, json.dumps({k: v for k, v in row.items() if k not in ("layouts", "ops")}),
            [(a["seq_q"], a["seq_k"], a["density"]) for a in info["layouts"]])
        log(name, "rewritten nodes:", " ".join(f"{k} {v}" for k, v in info["ops"].items()))
        rows.append(row)
    return rows


def device_run(names, iters, warmup, tile, sizes="issue", presearch=False, profile=False,
               cuda_graphs=False) -> list[dict]:
    import onnxruntime as ort

    from stof_trt.bench.gpu_profile import cuda_kernel_profile, ort_node_profile
    from stof_trt.errors import StofError
    from stof_trt.ort import Binding, latency_stats, session, time_session

    rows = []
    for name in names:
        case = SIZES[sizes][name]
        log(name, "building", case)
        model = build(case, fp16=True)
        new, info = rewrite(model, tile)
        f = feeds_for(case, fp16=True)
        row = {"case": name, **case, **info}
        outs = {}
        shared = case["op"] == "sparse"
        original = build(case, fp16=True, presents=True) if case["op"] in ("sparse", "gqa") else model
        variants = [("ort", original, False), ("stof", new, True)]
        if cuda_graphs:  # ORT's operators last: a failed capture may leave the CUDA context unusable
            variants[1:1] = [("stof-graph", new, True)]
            variants.append(("ort-graph", original, False))
        for variant, m, register in variants:
            graphs = variant.endswith("-graph")
            extra = {"presearch_shapes": [(case["B"], case["S"])]} if presearch and register else {}
            so = ort.SessionOptions()
            if profile:
                so.enable_profiling = True
                so.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="stof-prof-")) / "ort")
            try:
                sess = session(m, providers="cuda", register=register, session_options=so, cuda_graphs=graphs,
                               **extra)
                b = Binding(sess, f)
                if shared and variant.startswith("ort"):
                    _share_past_present(b)
                row[variant] = latency_stats(time_session(sess, f, warmup=warmup, iters=iters, binding=b))
            except Exception as exc:  # noqa: BLE001 -- a graph ORT cannot capture is a result, not a failure
                if not graphs or isinstance(exc, StofError):  # (no CUDA EP, no libstof_ort: the caller's one line)
                    raise
                msg = str(exc)
                cuda = msg.find("CUDA failure")  # ORT's first line is a template signature; the cause comes later
                row[variant] = {"error": (msg[cuda:].split(";")[0] if cuda >= 0 else msg.splitlines()[0])[:300]}
                log(name, variant, "not captured:", row[variant]["error"])
                continue
            outs[variant] = b.outputs()[0]
            log(name, variant, f"median {row[variant]['median_ms']:.3f} ms  p90 {row[variant]['p90_ms']:.3f} ms")
            if profile:  # after the timed runs, so the profile's overhead does not enter the times
                prof = cuda_kernel_profile(b.run)
                prof.update(ort_node_profile(sess.end_profiling()))
                row.setdefault("profile", {})[variant] = prof
                if "classes_ms" in prof:
                    log(name, variant, f"{prof['gpu_kernel_ms_per_run']:.3f} ms of kernels per run: " + ", ".join(
                        f"{k} {v['ms']:.3f} ({v['launches']:.0f})" for k, v in prof["classes_ms"].items()))
                log(name, variant, "ops by provider:", prof.get("ort_ops_by_provider"))
                log(name, variant, "CUDA API host time per run:", prof.get("cuda_api_host_ms"))
            del sess, b
        row["max_rel_diff"] = rel_diff(outs["stof"], outs["ort"])
        if sizes != "issue":  # both against the operator's documented semantics
            ref = reference(case, model, f)
            row["ort_vs_reference"], row["stof_vs_reference"] = rel_diff(outs["ort"], ref), rel_diff(outs["stof"], ref)
            log(name, f"vs float64 reference: ort {row['ort_vs_reference']:.2e}  stof {row['stof_vs_reference']:.2e}")
        row["speedup"] = row["ort"]["median_ms"] / row["stof"]["median_ms"]
        if "stof-graph" in outs:
            row["max_rel_diff_graph"] = rel_diff(outs["stof-graph"], outs["ort"])
        row["speedup_best"] = speedup_best(row)
        log(name, f"speedup {row['speedup']:.2f}x (fastest of each: {row['speedup_best']:.2f}x)  "
                  f"max rel diff {row['max_rel_diff']:.2e}")
        rows.append(row)
    return rows


def speedup_best(row: dict) -> float:
    """ORT's fastest configuration over STOF's: the median of each side's variants that ran (``ort``,
    ``ort-graph``; ``stof``, ``stof-graph``), a graph that was not captured left out."""
    best = {side: min(x["median_ms"] for v, x in row.items() if v in (side, f"{side}-graph") and isinstance(x, dict)
                      and "median_ms" in x) for side in ("ort", "stof")}
    return best["ort"] / best["stof"]


def _share_past_present(b) -> None:
    """Bind present_key / present_value to the past_key / past_value device buffers (ORT's SparseAttention
    requires the shared-buffer KV cache) and keep every output bound for the timed runs."""
    share = {"present_key": "past_key", "present_value": "past_value"}
    for name in b._output_names:
        if name in share:
            b.binding.bind_ortvalue_output(name, b._inputs[share[name]])
        else:
            b.binding.bind_output(name, b.device, b.device_id)
    b.sess.run_with_iobinding(b.binding)
    b._outputs = b.binding.get_outputs()
    for name, v in zip(b._output_names, b._outputs):
        b.binding.bind_ortvalue_output(name, v)


def markdown(rows) -> str:
    def cell(r, v):
        x = r.get(v)
        if x is None:
            return "-"
        return f"{x['median_ms']:.3f} / {x['p90_ms']:.3f}" if "median_ms" in x else "not captured"

    out = ["| case | B | S | ORT op median / p90 (ms) | STOF median / p90 (ms) | STOF, CUDA graph | speedup | "
           "fastest / fastest | max rel diff | STOF density |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dens = ", ".join(f"{a['density']:.3f}" for a in r["layouts"])
        out.append(f"| {r['case']} | {r['B']} | {r['S']} | {cell(r, 'ort')} | {cell(r, 'stof')} | "
                   f"{cell(r, 'stof-graph')} | {r['speedup']:.2f}x | {r['speedup_best']:.2f}x | "
                   f"{r['max_rel_diff']:.1e} | {dens} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output directory (device runs)")
    ap.add_argument("--cases", default=",".join(ISSUE), help=f"comma-separated subset of {','.join(ISSUE)}")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tile", default="64,64", help="STOF tile_m,tile_n of the rewrite")
    ap.add_argument("--presearch", action="store_true",
                    help="STOF nodes without a tactic-cache entry use the pre-search's first choice")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs: per-kernel GPU time (CUPTI via torch.profiler) and ONNX Runtime's "
                         "node profile of both models (key `profile` of each row)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also time each model captured in a CUDA graph (ORT's enable_cuda_graph): variants "
                         "stof-graph and ort-graph (recorded as not captured where ORT's operator cannot be)")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: build and rewrite (and check, small sizes)")
    ap.add_argument("--sizes", choices=tuple(SIZES), default="issue",
                    help="issue: the issue's sizes; check: small device sizes compared with a float64 reference; "
                         "small: CPU-sized (--dry-run)")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in ISSUE]
    if bad or not names:
        print(f"error: unknown case(s) {bad or names}; choose from {', '.join(ISSUE)}", file=sys.stderr)
        return 2
    try:
        tile = tuple(int(t) for t in args.tile.split(","))
        assert len(tile) == 2
    except (ValueError, AssertionError):
        print(f"error: --tile must be two integers, got {args.tile!r}", file=sys.stderr)
        return 2
    if args.dry_run:
        rows = dry_run(names, args.sizes, tile)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "ort_ops_dry_run.json").write_text(json.dumps(rows, indent=1, default=str))
        return 0
    if args.out is None:
        print("error: --out is required (or --dry-run)", file=sys.stderr)
        return 2
    if args.iters < 1 or args.warmup < 0:
        print("error: --iters must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    from stof_trt.errors import StofError

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        rows = device_run(names, args.iters, args.warmup, tile, args.sizes, args.presearch, args.profile,
                          args.cuda_graphs)
    except StofError as exc:  # no CUDA EP, no libstof_ort: one line, not a traceback
        print(f"error: {exc} (on a machine without a GPU use --dry-run)", file=sys.stderr)
        return 2
    (args.out / "ort_ops.json").write_text(json.dumps(rows, indent=1, default=str))
    (args.out / "ort_ops.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
