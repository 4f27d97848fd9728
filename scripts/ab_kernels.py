#!/usr/bin/env python3
"""A/B-time kernel builds: the same tactics and cells on several libstof_kernels.so builds, interleaved.

    python scripts/ab_kernels.py --libs base=build/plugins_cu/libstof_kernels.so,emu=build_emu/plugins_cu/libstof_kernels.so \\
        --tactics 13,19 --cells "64:4096:causal;64:4096:sliding:window=256" --rounds 2 --out $OUT/ab.json
    python scripts/ab_kernels.py --libs ws=build/plugins_cu/libstof_kernels.so,nows=build/plugins_cu/libstof_kernels.so#noworkspace ...
    python scripts/ab_kernels.py --libs pairs=build/plugins_cu/libstof_kernels.so,nopairs=build/plugins_cu/libstof_kernels.so#nopairs ...
    python scripts/ab_kernels.py --libs m32=build/plugins_cu/libstof_kernels.so,m16=build/plugins_cu/libstof_kernels.so#l2mb16 ...
    (schedule experiments on one build: '#l2mbN' sets the schedule's L2 budget, '#chunkN' the C ABI's sched_chunk;
    '#unshared' runs each layout's format-version-1 form, one bitmap per PARTIAL tile: what sharing bitmaps gains)

Each library runs in its own process (one libstof_kernels per process), in rounds A B C A B C ... so clock and
thermal drift hit every build alike; a cell's time is the median over rounds of each round's do_bench median.
Every output is also compared with SDPA + the boolean mask (relative error printed), so a faster build that
computes something else is caught.  Needs a CUDA GPU; this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))



def worker(a):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, list_tactics
    from stof_trt.masks import parse_mask
    from bench_attention import MASKS  # the issue-3 benchmark masks

    res = []
    H = a.heads
    for cell in a.cells.split(";"):
        D, S, mname = cell.split(":", 2)
        D, S = int(D), int(S)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(a.batch, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        mask = parse_mask(MASKS.get(mname, mname))
        layout = compile_mask(mask, S, S, num_heads=H)
        if a.unshared:
            layout = layout.unshared()  # format version 1's form: one bitmap per PARTIAL tile
        dl = DeviceLayout(layout)
        if a.no_pairs:
            dl.pair_order = None  # two-row kernels in their default order (C ABI 3's schedule)
        dense = np.asarray(mask.dense(S, S, num_heads=H))
        dense = torch.from_numpy(dense[None] if dense.ndim == 2 else dense).cuda()
        allowed = dense[torch.arange(H, device="cuda") % dense.shape[0]][None]  # [1, H, S, S]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).float()
        ref = torch.where(allowed.any(-1)[..., None], ref, torch.zeros_like(ref))
        valid = set(list_tactics(q, k, v, dl))
        for t in [int(x) for x in a.tactics.split(",")]:
            if t not in valid:
                print(f"ab_kernels: tactic {t} is not valid for {cell} in this build: skipped", file=sys.stderr)
                continue
            r = Runner(q, k, v, dl, tactic=t, workspace=not a.no_workspace, sched_chunk=a.sched_chunk)
            r.out.fill_(float("nan"))
            r()
            torch.cuda.synchronize()
            err = float((r.out.float() - ref).norm() / ref.norm())
            ms = triton.testing.do_bench(r, warmup=25, rep=a.rep, return_mode="median")
            res.append({"cell": cell, "tactic": t, "ms": ms, "err": err})
    print("AB_JSON " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", required=True,
                    help="name=path,... (libstof_kernels.so builds to compare; a path ending in '#noworkspace' runs "
                         "that build without the C ABI workspace, e.g. non-persistent warp-specialised tactics; in "
                         "'#nopairs', without the pair order, so two-row kernels take their default order; in "
                         "'#chunkN', with the C ABI's sched_chunk N instead of the layout's (N (batch, head) pairs "
                         "interleaved; 0 = the library's L2 rule); in '#l2mbN', with the schedule's L2 budget N MiB "
                         "(STOF_SCHED_L2_BYTES); in '#unshared', on the layouts' format-version-1 form (one bitmap per "
                         "PARTIAL tile, none shared); flags may follow the path in any order)")
    ap.add_argument("--tactics", default="13,19")
    ap.add_argument("--cells", default="64:4096:causal;64:4096:sliding",
                    help="D:S:mask;... (mask: a name of the issue-3 benchmark, or a mask spec)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--out", default=None, help="write every round's results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-workspace", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-pairs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--unshared", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sched-chunk", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    libs = {}
    for item in a.libs.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or name in libs:
            sys.exit(f"ab_kernels: --libs wants distinct name=path entries, got {item!r}")
        libs[name] = path
    def split_flags(path):  # "lib.so#noworkspace#chunk16" -> ("lib.so", {"noworkspace", "chunk16"})
        base, *flags = path.split("#")
        unknown = {f for f in flags if f not in ("noworkspace", "nopairs", "unshared") and not
                   (f.startswith("chunk") and f[5:].isdigit()) and not (f.startswith("l2mb") and f[4:].isdigit())}
        if unknown:
            sys.exit(f"ab_kernels: unknown library flag(s) {sorted(unknown)} in {path!r}")
        return base, set(flags)

    for name, path in libs.items():
        path = split_flags(path)[0]
        if not Path(path).is_file():
            sys.exit(f"ab_kernels: library {name}={path} not found")
    rounds = {name: [] for name in libs}
    fwd = [f"--tactics={a.tactics}", f"--cells={a.cells}", f"--batch={a.batch}", f"--heads={a.heads}",
           f"--rep={a.rep}"]
    for rnd in range(a.rounds):
        for name, path in libs.items():
            lib_path, flags = split_flags(path)
            env = dict(os.environ, STOF_KERNELS_LIB=str(Path(lib_path).resolve()))
            for f in flags:  # the library's L2 budget of the schedule (read once per process: docs/kernels.md)
                if f.startswith("l2mb"):
                    env["STOF_SCHED_L2_BYTES"] = str(int(f[4:]) << 20)
            p = subprocess.run([sys.executable, __file__, "--worker", "--libs=x", *fwd,
                                *(["--no-workspace"] if "noworkspace" in flags else []),
                                *(["--no-pairs"] if "nopairs" in flags else []),
                                *(["--unshared"] if "unshared" in flags else []),
                                *[f"--sched-chunk={f[5:]}" for f in flags if f.startswith("chunk")]], env=env,
                               capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("AB_JSON ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"ab_kernels: {name} failed (exit {p.returncode}): {p.stderr.strip()[-600:]}")
            rounds[name].append(json.loads(line[len("AB_JSON "):]))
            print(f"round {rnd + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)

    if a.out:
        Path(a.out).write_text(json.dumps({"libs": libs, "rounds": rounds}, indent=1))
    names = list(libs)
    keys = list(dict.fromkeys((r["cell"], r["tactic"]) for n in names for rr in rounds[n] for r in rr))
    table = {}
    for name in names:
        for key in keys:
            vals = [r for rr in rounds[name] for r in rr if (r["cell"], r["tactic"]) == key]
            if vals:  # worst error over rounds, NaN if any round gave NaN
                errs = [v["err"] for v in vals]
                err = math.nan if any(e != e for e in errs) else max(errs)
                table[(name, key)] = (statistics.median(v["ms"] for v in vals), err)
    print("cell".ljust(26) + "tactic " + "".join(f"{n:>20s}" for n in names) + "   (ms, vs first build, rel err)")
    for key in keys:
        base = table.get((names[0], key), (math.nan,))[0]
        row = f"{key[0]:26s}{key[1]:6d} "
        for n in names:
            if (n, key) not in table:
                row += "-".rjust(20)
                continue
            ms, err = table[(n, key)]
            flag = "!" if not err <= 1e-2 else " "
            row += f"{ms:8.4f} {ms / base:5.3f} {err:.0e}{flag}".rjust(20)
        print(row)


if __name__ == "__main__":
    main()
