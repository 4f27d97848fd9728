"""Fit the pre-search's constants on this GPU and store them as its profile, so that the first choice of
stof_attn_select (no tactic cache yet) is good before any timing. Times a fixed grid (5 masks x S in
1024/2048/4096 x D in 64/128, every tensor-core tactic, fp16; a couple of minutes on an H100/H200), fits with
stof_trt.presearch.calibrate and writes the profile where the library looks for this GPU
($STOF_PRESEARCH_PROFILE, else ~/.cache/stof-trt/profiles/<gpu>-<SMs>sm.json) or to -o.

examples:
  stof calibrate
  stof calibrate -o h200.json --json
  STOF_PRESEARCH_PROFILE=h200.json stof run model.stof.onnx ...
"""

from __future__ import annotations

import sys

from ..errors import StofError
from .common import check_output_path, print_json


def add_args(p):
    p.add_argument("-o", "--output", metavar="PROFILE.json",
                   help="where to write the profile (default: the path the library reads for this GPU)")
    p.add_argument("--seqs", default="1024,2048,4096", help="sequence lengths of the grid (comma-separated)")
    p.add_argument("--head-dims", default="64,128", help="head dims of the grid: 64 and/or 128")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--reps", type=int, default=5, help="timed runs per tactic (median)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StofError(f"{what}: comma-separated integers expected, got {text!r}") from None
    if not vals:
        raise StofError(f"{what}: no value")
    return vals


def run(args) -> int:
    from .. import calibrate as cal
    from .. import presearch as ps
    from .. import profiles

    seqs = _ints(args.seqs, "--seqs")
    dims = _ints(args.head_dims, "--head-dims")
    if any(d not in (64, 128) for d in dims):
        raise StofError("--head-dims: the kernels have head dims 64 and 128")
    if any(s < 64 or s > 65536 for s in seqs):
        raise StofError("--seqs: sequence lengths in [64, 65536]")
    if args.batch < 1 or args.heads < 1 or args.reps < 1:
        raise StofError("--batch, --heads and --reps must be >= 1")
    try:
        import torch
    except ImportError:
        raise StofError("stof calibrate needs PyTorch with CUDA") from None
    if not torch.cuda.is_available():
        raise StofError("no CUDA GPU: stof calibrate times the kernels on the GPU it calibrates")
    from .. import kernels

    if not kernels.library_available():
        raise StofError("libstof_kernels.so not found (build it, or set STOF_KERNELS_LIB)")
    kernels.check_device()  # a build without code for this GPU: one line, not a failing grid
    gpu = cal.gpu_key()
    out = args.output or str(profiles.profile_path(gpu["name"], gpu["sm_count"]))
    if args.output:
        check_output_path(None, out)  # before minutes of measurement
    progress = None if args.no_progress or args.json else (lambda s: print(f"[calibrate] {s}", file=sys.stderr,
                                                                         flush=True))
    if progress:
        progress(f"{gpu['name']} ({gpu['sm_count']} SMs, {gpu['clock_mhz']} MHz): "
                 f"{len(cal.GRID_MASKS) * len(seqs) * len(dims)} problems")
    cells = cal.measure_grid(seqs=seqs, head_dims=dims, batch=args.batch, heads=args.heads, reps=args.reps,
                             progress=progress)
    doc = cal.fit_profile(cells, batch=args.batch, heads=args.heads, gpu=gpu, props=ps.gpu_props())
    path = profiles.write(out, doc)
    fit = doc["fit"]["first_choice_within_10pct"]
    if args.json:
        print_json({"profile": str(path), "gpu": gpu, "constants": len(doc["coef"]), "fit": doc["fit"]})
    else:
        print(f"wrote {path}: {len(doc['coef'])} (tactic, head dim) constants for {gpu['name']}; first choice "
              f"within 10 % of the best in {fit['profile']}/{fit['of']} problems (catalogue: {fit['catalogue']})")
    return 0
