"""Measure the attention kernels' tactics for a STOF-rewritten model on this GPU and write a tactic cache
(the second search stage). For each --shapes set the model runs once on the CUDA EP to learn each attention
node's problem; identical problems (same dtype, heads, head dim, layout, shape bucket) are timed once: the
pre-search shortlist (or every valid tactic with --all), CUDA events, median of repetitions. The table shows the
pre-search's first choice, the measured best and the gain. The plugin reads the cache from the session option
`stof.tactic_cache` (stof run/bench --tactic-cache) or $STOF_TACTIC_CACHE.

examples:
  stof tune bert.stof.onnx --shapes input_ids=8x4096,attention_mask=8x4096 \\
      --shapes input_ids=8x512,attention_mask=8x512 -o h100.json
  stof tune gpt2.stof.onnx --shapes input_ids=8x2048,attention_mask=8x2048 -o h100.json --all --json
  stof tune bert.stof.onnx --shapes input_ids=8x4096,attention_mask=8x4096 -o h200.json \\
      --presearch-only --gpu "NVIDIA H200"          # no GPU needed: a baseline cache for an H200
  stof rewrite bert.onnx --schemes h100.json -o bert.tuned.onnx   # apply the measured fusion schemes

Fusion schemes (docs/schemes.md): the GEMM chains after attention (output projection + residual + LayerNorm,
FFN1 + bias + GELU, FFN2 + residual + LayerNorm) are timed too: the cost model's shortlist of schemes x the first
--scheme-algos cuBLASLt algorithms, as one-block models on the CUDA EP; the fastest goes into the cache's
scheme section (with --presearch-only: the cost model's first choice). `stof rewrite --schemes CACHE` applies
them. --json lists every block's chains: the scheme and algorithm that won, its time, the cost model's first
choice and its time ratio to the winner.

With --gpu NAME (--presearch-only only) no GPU or CUDA execution provider is used: the model runs on the CPU EP to
learn each attention node's problem, the valid tactics are the pre-search's for that GPU, and the cache is keyed
by NAME and --cc as the library reads them on that GPU (NAME as cudaGetDeviceProperties reports it, e.g.
"NVIDIA H200", "NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

from ..errors import StofError
from .common import check_output_path, check_seq_limit, int_in, load_model, print_json, print_table


def add_args(p):
    p.add_argument("model", metavar="MODEL.stof.onnx")
    p.add_argument("--shapes", action="append", default=[], metavar="NAME=DxD,...",
                   help="one set of input shapes (repeat for several buckets)")
    p.add_argument("-o", "--output", required=True, metavar="CACHE.json",
                   help="tactic cache to create or update (entries for other keys are kept)")
    p.add_argument("-k", type=int, default=3,
                   help="shortlist length from the pre-search and from the fusion schemes' cost model (default 3)")
    p.add_argument("--all", action="store_true", help="time every valid tactic, not only the shortlist")
    p.add_argument("--presearch-only", action="store_true",
                   help="record the pre-search's first choice without timing (a baseline cache); on this machine's "
                        "GPU, or with --gpu for a named one without any GPU")
    p.add_argument("--gpu", metavar="NAME",
                   help="with --presearch-only: the GPU the cache is for, as the library reports its name (e.g. "
                        "'NVIDIA H200'); runs on the CPU, no GPU needed")
    p.add_argument("--cc", default="9.0", metavar="X.Y", help="with --gpu: its compute capability (default 9.0)")
    p.add_argument("--sm-count", type=int, metavar="N",
                   help="with --gpu: its SM count (default: the profile's, else 132; the H100's properties are "
                        "scaled by it)")
    p.add_argument("--profile", metavar="FILE.json",
                   help="with --gpu: a pre-search profile of that GPU (`stof calibrate`) whose constants rank the "
                        "tactics")
    p.add_argument("--no-schemes", action="store_true", help="tune the attention tactics only")
    p.add_argument("--schemes-only", action="store_true", help="tune the fusion schemes only")
    p.add_argument("--scheme-algos", type=int, default=4, metavar="N",
                   help="cuBLASLt heuristic results timed per scheme with a StofGemmEpilogue node (default 4)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per tactic (median)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from .. import ort as sort
    from ..tactic_cache import TacticCache
    from ..tune import target_gpu, tune_model

    if not args.shapes:
        raise StofError("give at least one --shapes set (e.g. --shapes input_ids=8x512,attention_mask=8x512)")
    if args.k < 1 or args.reps < 1 or args.scheme_algos < 1:
        raise StofError("-k, --reps and --scheme-algos must be >= 1")
    if args.no_schemes and args.schemes_only:
        raise StofError("--no-schemes and --schemes-only exclude each other")
    if args.presearch_only and args.all:
        raise StofError("--all times every tactic; --presearch-only times none (give one of them)")
    check_output_path(None, args.output)
    target = None
    if args.gpu is None:
        for flag, v in (("--sm-count", args.sm_count), ("--profile", args.profile)):
            if v is not None:
                raise StofError(f"{flag} describes the GPU of --gpu NAME: give --gpu too")
    else:
        if not args.presearch_only:
            raise StofError("--gpu NAME is for --presearch-only (timing runs on this machine's GPU)")
        target = target_gpu(args.gpu, cc=args.cc, sm_count=args.sm_count, profile=args.profile)
    model = load_model(args.model)
    for s in args.shapes:
        check_seq_limit(model, sort.parse_shapes([s]))
    cache = TacticCache.load_or_new(args.output)
    if target is None:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise StofError("no CUDA execution provider in this onnxruntime (a CPU-only install or no GPU): tuning "
                            "times on the GPU; for a pre-search cache without one, pass --presearch-only --gpu NAME")
    sess = sort.session(model, providers="cpu", register=False) if target else sort.session(model)
    feeds_list = [sort.random_feeds(sess, sort.parse_shapes([s]), seed=args.seed) for s in args.shapes]
    del sess
    results = [] if args.schemes_only else \
        tune_model(model, feeds_list, cache, k=args.k, all_tactics=args.all, presearch_only=args.presearch_only,
                   reps=args.reps, progress=not args.no_progress and not args.json, target=target)
    scheme_results = []
    if not args.no_schemes:
        from ..scheme_tune import tune_schemes

        scheme_results = tune_schemes(model, feeds_list, cache, gpu=(target.name, target.cc) if target else None,
                                      props=target.props if target else None, k=args.k, algos=args.scheme_algos,
                                      reps=args.reps, measure=not args.presearch_only, cpu_probe=target is not None)
    if not results and not scheme_results:
        what = "GEMM chain after attention" if args.schemes_only else "fp16/bf16 StofSparseAttention node" if \
            args.no_schemes else "fp16/bf16 StofSparseAttention node or GEMM chain"
        raise StofError(f"{args.model} has no {what} to tune")
    cache.merge_save(args.output)  # other writers (first-use timing, other tunes) keep their entries
    rows = []
    for r in results:
        rows.append({"nodes": len(r.nodes), "node": r.key.node, "bucket": r.key.bucket, "mask": r.key.mask[:12],
                     "presearch": r.presearch_tactic, "best": r.best_tactic, "default": r.default_tactic,
                     "presearch_ms": r.times_ms.get(r.presearch_tactic), "best_ms": r.times_ms.get(r.best_tactic),
                     "default_ms": r.times_ms.get(r.default_tactic) if r.default_tactic else None,
                     "gain": (r.gain if r.times_ms else None), "candidates": r.times_ms})
    total_pre = sum(x["presearch_ms"] * x["nodes"] for x in rows if x["presearch_ms"])
    total_best = sum(x["best_ms"] * x["nodes"] for x in rows if x["best_ms"])
    info = {"cache": args.output, "entries": len(cache), "problems": rows,
            "attention_ms_presearch": total_pre or None, "attention_ms_measured": total_best or None,
            "gain": (total_pre / total_best) if total_best else None}
    if scheme_results:
        info["schemes"] = _scheme_info(scheme_results)
    if args.json:
        print_json(info)
        return 0
    if rows:
        print_table([[x["bucket"], x["node"].split("|", 1)[1], x["nodes"], x["presearch"], _ms(x["presearch_ms"]),
                  x["best"], _ms(x["best_ms"]), f"{x['gain']:.3f}x" if x["gain"] else "-"] for x in rows],
                    ["bucket", "problem", "nodes", "pre-search", "ms", "measured best", "ms", "gain"])
    if info["gain"]:
        print(f"\nattention time per model run (sum over nodes): pre-search {total_pre:.3f} ms -> measured "
              f"{total_best:.3f} ms ({info['gain']:.3f}x)")
    if scheme_results:
        sch = info["schemes"]
        print_table([[r["block"], r["role"], r["chain"].split("|", 1)[1], r["bucket"], r["scheme"], r["algo"],
                      _ms(r["time_ms"]), f"{r['gain']:.3f}x" if r["gain"] else "-", r["model_first"],
                      f"{r['ratio']:.3f}x" if r["ratio"] else "-"] for r in sch["blocks"]],
                    ["block", "role", "chain", "bucket", "scheme", "algo", "ms", "vs fixed rules", "model's first",
                     "its time / best"])
        if sch["model_within_5pct"] is not None:
            print(f"\nGEMM chains per model run: fixed rules {sch['chain_ms_fixed_rules']:.3f} ms -> measured "
                  f"{sch['chain_ms_measured']:.3f} ms; the cost model's first choice within 5% of the measured best "
                  f"for {100 * sch['model_within_5pct']:.0f}% of chains")
    print(f"wrote {args.output} ({len(cache)} entries, {len(cache.schemes)} fusion schemes)")
    return 0


def _scheme_info(results) -> dict:
    """The JSON report of the fusion schemes: one row per chain (block order) and the cost model's hit rate."""
    from ..scheme_tune import block_rows

    blocks = block_rows(results)
    timed = [r for r in blocks if r["ratio"] is not None]   # bf16 chains and --presearch-only: not timed
    return {"blocks": blocks,
            "model_within_5pct": (sum(r["ratio"] <= 1.05 for r in timed) / len(timed)) if timed else None,
            "chain_ms_model_first": sum(r["model_first_ms"] for r in timed) if timed else None,
            "chain_ms_measured": sum(r["time_ms"] for r in timed) if timed else None,
            "chain_ms_fixed_rules": sum(r["fixed_rule_ms"] for r in timed) if timed else None}


def _ms(v):
    return "-" if v is None else f"{v:.4f}"
