"""Rewrite an exported ONNX transformer so that masked attention cores (Q·Kᵀ, scale, mask/bias, softmax, ·V)
become StofSparseAttention nodes and epilogues (MatMul + bias + GELU, bias + residual + LayerNorm) become
StofGemmEpilogue / StofAddLayerNorm nodes. Every STOF node carries a model-local ONNX function, so the output
runs on any ONNX runtime; with the STOF plugins it runs the sparse CUDA kernels.

examples:
  stof rewrite bert.onnx -o bert.stof.onnx --mask longformer:window=256,global=32
  stof rewrite gpt2.onnx                              # writes gpt2.stof.onnx; the graph's causal mask is used
  stof rewrite model.onnx -o out.onnx --mask 'sliding:window=128&causal' --json
"""

from __future__ import annotations

import os
import time

from ..errors import StofError
from .common import Once, OnceMask, check_output_path, default_output, load_model, print_json, print_table, save_model

# Sequence lengths the tile format can index (int32 element offsets within one row of tiles).
MAX_SEQ_LEN = 2**31 - 1


def add_args(p):
    p.add_argument("input", metavar="IN.onnx", help="exported ONNX model (external data is read too)")
    p.add_argument("-o", "--output", action=Once, metavar="OUT.onnx",
                   help="where to write the rewritten model (default: IN.stof.onnx beside the input; never the "
                        "input itself)")
    p.add_argument("--mask", action=OnceMask, metavar="SPEC",
                   help="static attention sparsity for every attention node (see `stof --help`); intersected "
                        "with causal/sliding patterns found in the graph; padding masks stay run-time inputs")
    p.add_argument("--no-epilogue", action="store_true", help="rewrite attention cores only")
    p.add_argument("--tile", action=Once, type=int, nargs=2, default=(64, 64), metavar=("M", "N"),
                   help="tile shape of the compiled mask (default 64 64)")
    p.add_argument("--max-seq-len", action=Once, type=int, metavar="S",
                   help="compiled length of a dynamic model (default: its own limit, else 2048; closed-form "
                        "masks grow past it at run time; docs/rewrite.md)")
    p.add_argument("--no-packed-qkv", action="store_true",
                   help="keep separate Q/K/V projections (default: one packed QKV GEMM feeding the attention node "
                        "through strides, no transposes)")
    p.add_argument("--no-remove-padding", action="store_true",
                   help="keep the padded [B, S] layout through the model (default: a model with one padding mask "
                        "and full or causal attention runs its GEMMs, LayerNorms and attention on the real tokens "
                        "only, with zeros at padded positions of the outputs; docs/rewrite.md)")
    p.add_argument("--token-capacity-input", action="store_true",
                   help="pack the real tokens into a fixed number of slots, the length of a new int32 input "
                        "stof_token_capacity (at least the batch's real tokens; stof_trt.ort.Binding fills it), so "
                        "ONNX Runtime can replay the packed model through CUDA graphs, one per capacity")
    p.add_argument("--dense-attention", choices=("stof", "ort"), default="stof",
                   help="where attention with no static sparsity (padding-only or unmasked) goes: STOF nodes "
                        "(default) or ONNX Runtime's contrib Attention (measured slower with 2-D padding masks; "
                        "docs/performance.md). 'ort' converts only packed attention: it does nothing with "
                        "--no-packed-qkv or --no-epilogue (the report notes attention left on STOF)")
    p.add_argument("--schemes", metavar="CACHE.json",
                   help="a tactic cache with measured fusion schemes (`stof tune`): each GEMM chain after attention "
                        "gets its measured scheme and cuBLASLt algorithm (docs/schemes.md); chains without one get "
                        "the cost model's first choice")
    p.add_argument("--schemes-gpu", metavar="NAME",
                   help="with --schemes: the GPU whose schemes to use (default: the only one in the cache)")
    p.add_argument("--scheme-tokens", type=int, metavar="T",
                   help="token count (batch x sequence) the schemes are chosen for: the cache's bucket of T and the "
                        "cost model's ranking (default: each chain's largest measured bucket; the model at 4096)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")


def run(args) -> int:
    from .. import format as fmt
    from ..masks import parse_mask
    from ..rewrite import rewrite_model

    if args.output is None:
        args.output = default_output(args.input)
    # Everything the user gave is checked before the rewrite runs: nothing is computed for a path that cannot
    # be written or a spec that cannot be built.
    check_output_path(args.input, args.output)
    mask = parse_mask(args.mask) if args.mask else None
    fmt.check_tile_shape(*args.tile)
    if args.max_seq_len is not None and not 1 <= args.max_seq_len <= MAX_SEQ_LEN:
        raise StofError(f"--max-seq-len must be in [1, {MAX_SEQ_LEN}] (the tile format indexes with int32), "
                        f"got {args.max_seq_len}")
    if mask is not None and args.max_seq_len is not None:
        try:
            mask.check_size(args.max_seq_len, args.max_seq_len)
        except StofError as e:
            raise StofError(f"--mask at --max-seq-len {args.max_seq_len}: {e}") from None
    choices = None
    if args.scheme_tokens is not None and not 1 <= args.scheme_tokens < 2**31:
        raise StofError(f"--scheme-tokens must be in [1, 2^31 - 1], got {args.scheme_tokens}")
    if args.schemes_gpu is not None and args.schemes is None:
        raise StofError("--schemes-gpu names the GPU of --schemes CACHE.json: give --schemes too")
    if args.schemes is not None:
        from ..tactic_cache import TacticCache

        choices = TacticCache.load(args.schemes).scheme_choices(args.schemes_gpu, tokens=args.scheme_tokens)
    t0 = time.perf_counter()
    model = load_model(args.input, keep_external_data=True)
    if args.max_seq_len is not None:
        check_probe_memory(model, args.max_seq_len)
    data_dir = os.path.dirname(os.path.abspath(args.input))
    try:
        new_model, report = rewrite_model(model, mask=mask, epilogues=not args.no_epilogue, tile_m=args.tile[0],
                                          tile_n=args.tile[1], max_seq_len=args.max_seq_len,
                                          external_data_dir=data_dir, packed_qkv=not args.no_packed_qkv,
                                          dense_attention=args.dense_attention, schemes=choices,
                                          scheme_tokens=args.scheme_tokens,
                                          remove_padding=not args.no_remove_padding,
                                          token_capacity_input=args.token_capacity_input)
    except MemoryError:
        size = f" --max-seq-len {args.max_seq_len}" if args.max_seq_len else " this model"
        raise StofError(f"not enough memory to rewrite for{size}: the probe's and the masks' arrays do not fit "
                        "(give a smaller --max-seq-len)") from None
    moved = report.keep_attention_in(new_model)
    if moved:
        report.notes.append(f"{moved} attention node(s) with no sparsity run as ONNX Runtime's Attention "
                            "(--dense-attention ort); they are not listed above")
    save_model(new_model, args.output, external_data_dir=data_dir)
    info = report.to_dict()
    info.update(input=args.input, output=args.output, seconds=round(time.perf_counter() - t0, 3))
    if args.json:
        print_json(info)
    else:
        print_report(info)
    return 0


def check_probe_memory(model, seq: int) -> None:
    """Refuse, before the model is analysed, a --max-seq-len whose evaluation cannot fit even at its least (one
    head, no graph masks); the rewrite checks again with the model's head count and masks."""
    from ..rewrite.attention_common import check_probe_memory as check

    check(model, seq, heads=1, masks=False, what=f"--max-seq-len {seq}")


def print_report(info: dict, wrote: bool = True) -> None:
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
    before, after = info.get("nodes_before"), info.get("nodes_after")
    if isinstance(before, int) and isinstance(after, int):
        # the rest is the cleanup after the patterns: constant folding of the shape arithmetic that fed removed
        # subgraphs, nodes left without consumers
        cleanup = before - removed + added - after
        line = f"\nnodes: {before} -> {after}: {removed} removed and {added} added by the patterns"
        if cleanup > 0:
            line += f", {cleanup} removed by cleanup (folded shape arithmetic, unused nodes)"
        elif cleanup < 0:
            line += f", {-cleanup} added by cleanup"
        print(line)
    else:
        print(f"\nnodes: {removed} removed, {added} added")
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
    rp = info.get("remove_padding") or {}
    if rp:
        slots = (f"; token slots: input {rp['token_capacity_input']}" if rp.get("token_capacity_input") else "")
        print("\npadding removal: " + (f"applied ({rp.get('attention_nodes')} attention node(s) on packed tokens, "
                                       f"restored: {', '.join(rp.get('restored', []))}{slots})" if rp.get("applied")
                                       else f"not applied: {rp.get('reason')}"))
    left = info.get("left_alone", [])
    if left:
        print("\nleft alone:")
        for item in left:
            print(f"  {item.get('node', '?')} ({item.get('op_type', '?')}): {item.get('reason', '?')}")
    for note in info.get("notes", []):
        print(f"note: {note}")
    if wrote and info.get("output"):
        print(f"\nwrote {info['output']}")
