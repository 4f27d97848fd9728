"""Rewrite an exported ONNX transformer so that masked attention cores (Q·Kᵀ, scale, mask/bias, softmax, ·V)
become StofSparseAttention nodes and epilogues (MatMul + bias + GELU, bias + residual + LayerNorm) become
StofGemmEpilogue / StofAddLayerNorm nodes. Every STOF node carries a model-local ONNX function, so the output
runs on any ONNX runtime; with the STOF plugins it runs the sparse CUDA kernels.

examples:
  stof rewrite bert.onnx -o bert.stof.onnx --mask longformer:window=256,global=32
  stof rewrite gpt2.onnx -o gpt2.stof.onnx            # the causal mask found in the graph is used
  stof rewrite model.onnx -o out.onnx --mask 'sliding:window=128&causal' --json
"""

from __future__ import annotations

import os
import time

from ..errors import StofError
from .common import check_output_path, load_model, print_json, print_table, save_model


def add_args(p):
    p.add_argument("input", metavar="IN.onnx", help="exported ONNX model (external data is read too)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the rewritten model")
    p.add_argument("--mask", metavar="SPEC",
                   help="static attention sparsity for every attention node (see `stof --help`); intersected "
                        "with causal/sliding patterns found in the graph; padding masks stay run-time inputs")
    p.add_argument("--no-epilogue", action="store_true", help="rewrite attention cores only")
    p.add_argument("--tile", type=int, nargs=2, default=(64, 64), metavar=("M", "N"),
                   help="tile shape of the compiled mask (default 64 64)")
    p.add_argument("--max-seq-len", type=int, metavar="S",
                   help="compiled length of a dynamic model (default: its own limit, else 2048; docs/rewrite.md)")
    p.add_argument("--no-packed-qkv", action="store_true",
                   help="keep separate Q/K/V projections (default: one packed QKV GEMM feeding the attention node "
                        "through strides, no transposes)")
    p.add_argument("--dense-attention", choices=("stof", "ort"), default="stof",
                   help="where attention with no static sparsity (padding-only or unmasked) goes: STOF nodes "
                        "(default) or ONNX Runtime's contrib Attention (measured slower with 2-D padding masks; "
                        "docs/performance.md). 'ort' converts only packed attention: it does nothing with "
                        "--no-packed-qkv or --no-epilogue (the report notes attention left on STOF)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")


def run(args) -> int:
    from .. import format as fmt
    from ..masks import parse_mask
    from ..rewrite import rewrite_model

    check_output_path(args.input, args.output)
    mask = parse_mask(args.mask) if args.mask else None
    fmt.check_tile_shape(*args.tile)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise StofError("--max-seq-len must be positive")
    t0 = time.perf_counter()
    model = load_model(args.input, keep_external_data=True)
    data_dir = os.path.dirname(os.path.abspath(args.input))
    new_model, report = rewrite_model(model, mask=mask, epilogues=not args.no_epilogue, tile_m=args.tile[0],
                                      tile_n=args.tile[1], max_seq_len=args.max_seq_len,
                                      external_data_dir=data_dir, packed_qkv=not args.no_packed_qkv,
                                      dense_attention=args.dense_attention)
    save_model(new_model, args.output, external_data_dir=data_dir)
    info = report.to_dict()
    info.update(input=args.input, output=args.output, seconds=round(time.perf_counter() - t0, 3))
    if args.json:
        print_json(info)
    else:
        print_report(info)
    return 0


def print_report(info: dict) -> None:
    """Tables from RewriteReport.to_dict() (stof_trt/rewrite/report.py)."""
    print(f"{info['input']} -> {info['output']}  ({info['seconds']} s)")
    patterns = info.get("patterns", {})
    removed = sum(p["nodes_removed"] for p in patterns.values())
    added = sum(p["nodes_added"] for p in patterns.values())
    print()
    if patterns:
        print_table([[k, p["fused_op_type"], p["matched"], p["nodes_removed"], p["nodes_added"],
                      ", ".join(f"{op} {n}" for op, n in sorted(p.get("removed_op_types", {}).items()))]
                     for k, p in patterns.items()],
                    ["pattern", "STOF op", "matched", "removed", "added", "ops removed"])
    else:
        print("nothing matched: the model comes back equivalent")
    print(f"\nnodes: {info.get('nodes_before', '?')} -> {info.get('nodes_after', '?')} "
          f"({removed} removed, {added} added)")
    att = info.get("attention", [])
    if att:
        print()
        rows = []
        for a in att:
            c = a.get("tile_classes", {})
            d = a.get("density")
            rows.append([a.get("name", "?"), a.get("heads", "?"), a.get("head_dim", "?"),
                         f"{d:.4f}" if isinstance(d, float) else "-", c.get("full", "-"), c.get("partial", "-"),
                         c.get("empty", "-"), a.get("mask_source", "?")])
        print_table(rows, ["attention node", "heads", "D", "density", "full", "partial", "empty", "mask"])
    left = info.get("left_alone", [])
    if left:
        print("\nleft alone:")
        for item in left:
            print(f"  {item.get('node', '?')} ({item.get('op_type', '?')}): {item.get('reason', '?')}")
    for note in info.get("notes", []):
        print(f"note: {note}")
