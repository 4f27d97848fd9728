"""Run an ONNX model (typically a STOF-rewritten one) on ONNX Runtime with the STOF plugin on the CUDA EP and print
(or save) its outputs. Inputs come from .npy files (--input NAME=FILE.npy) or are random (--shapes for symbolic
dims: ids in [0,100), masks of ones, floats N(0,1)).

examples:
  stof run bert.stof.onnx --input input_ids=ids.npy --input attention_mask=mask.npy -o outputs/
  stof run bert.stof.onnx --shapes input_ids=8x4096,attention_mask=8x4096 --tactic-cache h100.json --time 20
  stof run model.onnx --provider cpu --shapes pixel_values=1x3x224x224 --json
"""

from __future__ import annotations

import os
import re

from .._files import output_target, write_file_atomic
from ..errors import StofError
from .common import (Once, check_seq_limit, int_in, load_model, ort_error, output_dir_kept_on_success, print_json,
                     print_table)


def add_args(p):
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input from a .npy file")
    p.add_argument("--shapes", action="append", default=[], metavar="NAME=DxD,...",
                   help="shapes of random inputs (for symbolic dims)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed of random inputs")
    p.add_argument("--provider", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: CUDA EP + libstof_ort (default); cpu: STOF nodes run as their ONNX functions")
    p.add_argument("--device", type=int_in(0, 1023), help="CUDA device id (default 0)")
    p.add_argument("--tactic-cache", metavar="FILE.json", help="tactic cache from `stof tune`")
    p.add_argument("--presearch", action="store_true",
                   help="attention nodes without a tactic-cache entry use the pre-search's first choice for this "
                        "run's (batch, seq) instead of the kernel library's default")
    p.add_argument("--cuda-graphs", action="store_true", help="run through a captured CUDA graph (IO binding)")
    p.add_argument("-o", "--output-dir", action=Once, metavar="DIR",
                   help="save each output as DIR/<name>.npy (created if needed; characters other than letters, "
                        "digits, '.', '_' and '-' in a name become '_')")
    p.add_argument("--time", type=int_in(0, 1_000_000), default=0, metavar="N",
                   help="also time N runs (IO binding; median/p90)")
    p.add_argument("--verbose", action="store_true", help="print the plugin's tactic choices")
    p.add_argument("--json", action="store_true")


def output_files(output_dir: str, names: list[str]) -> list[str]:
    """The .npy path of each output in ``output_dir``: a name is a file name, never a path (a model's output named
    '../x' or '/tmp/x' stays inside the directory), with a suffix where two names meet."""
    paths, taken = [], set()
    for name in names:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        if not base or base.startswith("."):
            base = "_" + base
        stem, i = base, 1
        while stem.lower() in taken:
            stem, i = f"{base}_{i}", i + 1
        taken.add(stem.lower())
        paths.append(os.path.join(output_dir, stem + ".npy"))
    return paths


def load_inputs(specs) -> dict:
    import numpy as np

    feeds = {}
    for spec in specs:
        if "=" not in spec:
            raise StofError(f"bad --input '{spec}' (expected NAME=FILE.npy)")
        name, path = spec.split("=", 1)
        if name in feeds:
            raise StofError(f"--input {name} is given twice")
        if os.path.isdir(path):
            raise StofError(f"--input {name}: {path} is a directory, not a .npy file")
        if not os.path.isfile(path):
            raise StofError(f"no such file: {path}")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            why = "not in numpy's .npy format" if "pickle" in str(e) else str(e)  # (numpy's wording suggests pickle)
            raise StofError(f"{path} is not a readable .npy file ({why})") from None
    return feeds


def run(args) -> int:
    from .. import ort as sort

    import onnxruntime as ort

    from ..nodes import attention_nodes

    if args.provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise StofError("no CUDA execution provider in this onnxruntime (a CPU-only install or no GPU): run on the "
                        "CPU with --provider cpu (STOF nodes run as their ONNX functions), or install "
                        "onnxruntime-gpu")
    # Every STOF node's layout is checked as `stof inspect` does: a damaged layout must not run.
    model = load_model(args.model)
    try:
        attention_nodes(model)
    except StofError as e:
        raise StofError(f"{args.model}: a STOF attention node's layout is invalid ({e})") from None
    if args.provider == "cpu":  # the options of the CUDA plugin would be silently ignored
        gpu_only = [f for f, on in (("--tactic-cache", args.tactic_cache), ("--cuda-graphs", args.cuda_graphs),
                                    ("--presearch", args.presearch), ("--device", args.device is not None),
                                    ("--verbose", args.verbose)) if on]
        if gpu_only:
            raise StofError(f"{', '.join(gpu_only)} apply to the CUDA provider only, not --provider cpu")
    given = load_inputs(args.input)
    shapes = sort.parse_shapes(args.shapes)
    both = sorted(set(shapes) & set(given))
    if both:
        raise StofError(f"{', '.join(both)}: given by --input and by --shapes (give one)")
    check_seq_limit(model, {**shapes, **{n: a.shape for n, a in given.items()}})
    del model
    with output_dir_kept_on_success(args.output_dir):  # a run that fails leaves no new directory behind
        return _run(args, given)


def _run(args, given: dict) -> int:
    import numpy as np

    from .. import ort as sort

    pre = None
    if args.presearch:
        dims = [tuple(a.shape[:2]) for a in given.values() if a.ndim >= 2]
        dims += [tuple(s[:2]) for s in sort.parse_shapes(args.shapes).values() if len(s) >= 2]
        if not dims:
            raise StofError("--presearch needs an input of rank >= 2 (batch, seq) from --input or --shapes")
        pre = [dims[0]]
    try:
        sess = sort.session(args.model, providers=args.provider, device_id=args.device or 0,
                            tactic_cache=args.tactic_cache, cuda_graphs=args.cuda_graphs, verbose=args.verbose,
                            presearch_shapes=pre)
    except StofError as e:
        if args.provider == "cuda" and "CUDA" in str(e):
            raise StofError(f"{e}; or run on the CPU with --provider cpu") from None
        raise
    out_paths = output_files(args.output_dir, [o.name for o in sess.get_outputs()]) if args.output_dir else []
    # every output file checked before the run (a name taken by a directory, a device, an input file)
    inputs = {os.path.realpath(spec.split("=", 1)[1]) for spec in args.input}
    for path in out_paths:
        output_target(path)
        if os.path.realpath(path) in inputs:
            raise StofError(f"-o {args.output_dir}: the output {os.path.basename(path)} would overwrite an input "
                            "file; choose another directory")
    names = {i.name for i in sess.get_inputs()}
    unknown = set(given) - names
    if unknown:
        raise StofError(f"the model has no input(s) {', '.join(sorted(unknown))} (inputs: {', '.join(sorted(names))})")
    shapes = sort.parse_shapes(args.shapes)
    missing = {n: s for n, s in shapes.items() if n not in given}
    specs = [(n, shp, dt) for n, shp, dt in sort.input_specs(sess) if n not in given]
    feeds = dict(given)
    if specs:
        rnd = sort.random_feeds(_Subset(sess, {n for n, _, _ in specs}), missing, seed=args.seed)
        feeds.update(rnd)
    for n, shp, dt in sort.input_specs(sess):
        if n in given and str(given[n].dtype) != dt:
            raise StofError(f"input '{n}' is {given[n].dtype}, the model expects {dt}")
    try:
        binding = sort.Binding(sess, feeds, device_id=args.device or 0)
        binding.run()
        outs = binding.outputs()
    except StofError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's run errors (bad shapes, ...) are user errors here
        raise ort_error(e, args.model, {n: a.shape for n, a in feeds.items()}) from None
    info = {"model": args.model, "provider": args.provider, "outputs": []}
    for i, (o, arr) in enumerate(zip(sess.get_outputs(), outs)):
        a = arr.astype(np.float64) if arr.dtype.kind == "f" else arr
        row = {"name": o.name, "shape": list(arr.shape), "dtype": str(arr.dtype)}
        if arr.size and arr.dtype.kind in "fiu":
            row.update(min=float(a.min()), max=float(a.max()), mean=float(a.mean()),
                       finite=bool(np.isfinite(a).all()) if arr.dtype.kind == "f" else True)
        if args.output_dir:
            path = out_paths[i]
            write_file_atomic(path, lambda tmp, arr=arr: np.save(tmp, arr), suffix=".npy")
            row["saved"] = path
        info["outputs"].append(row)
    if args.time:
        times = sort.time_session(sess, feeds, iters=args.time, binding=binding, warmup=3)
        info["latency"] = sort.latency_stats(times)
    if args.json:
        print_json(info)
        return 0
    print_table([[r["name"], "x".join(map(str, r["shape"])), r["dtype"], _f(r.get("min")), _f(r.get("max")),
                  _f(r.get("mean"))] for r in info["outputs"]], ["output", "shape", "dtype", "min", "max", "mean"])
    if args.time:
        lat = info["latency"]
        print(f"\nlatency over {lat['runs']} runs: median {lat['median_ms']:.3f} ms, p90 {lat['p90_ms']:.3f} ms")
    return 0


def _f(v):
    return "-" if v is None else f"{v:.4g}"


class _Subset:
    """A session view exposing only some inputs (for random_feeds)."""

    def __init__(self, sess, names):
        self._sess, self._names = sess, names

    def get_inputs(self):
        return [i for i in self._sess.get_inputs() if i.name in self._names]
