#!/usr/bin/env python3
"""A/B-time kernel builds: the same tactics and cells on several libstof_kernels.so builds, interleaved.

    python scripts/ab_kernels.py --libs base=build/plugins_cu/libstof_kernels.so,emu=build_emu/plugins_cu/libstof_kernels.so \\
        --tactics 13,19 --cells 64:4096:causal,64:4096:sliding --rounds 2 --out $OUT/ab.json

Each library runs in its own process (one libstof_kernels per process), in rounds A B C A B C ... so clock and
thermal drift hit every build alike; a cell's time is the median over rounds of each round's do_bench median.
Every output is also compared with SDPA + the boolean mask (relative error printed), so a faster build that
computes something else is caught.  Needs a CUDA GPU; this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))



def worker(a):
    import torch
    import torch.nn.functional as F
    import triton

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, list_tactics
    from stof_trt.masks import parse_mask
    from bench_attention import MASKS  # the issue-3 benchmark masks

    res = []
    for cell in a.cells.split(","):
        D, S, mname = cell.split(":")
        D, S = int(D), int(S)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(a.batch, a.heads, S, D, device="cuda", dtype=torch.float16, generator=g)
                   for _ in range(3))
        mask = parse_mask(MASKS.get(mname, mname))
        layout = compile_mask(mask, S, S)
        dl = DeviceLayout(layout)
        dense = torch.from_numpy(mask.dense(S, S)).cuda()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None]).float()
        ref = torch.where(dense.any(-1)[None, None, :, None], ref, torch.zeros_like(ref))
        valid = set(list_tactics(q, k, v, dl))
        for t in [int(x) for x in a.tactics.split(",")]:
            if t not in valid:
                continue
            r = Runner(q, k, v, dl, tactic=t)
            r.out.fill_(float("nan"))
            r()
            torch.cuda.synchronize()
            err = float((r.out.float() - ref).norm() / ref.norm())
            ms = triton.testing.do_bench(r, warmup=25, rep=a.rep, return_mode="median")
            res.append({"cell": cell, "tactic": t, "ms": ms, "err": err})
    print("AB_JSON " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", required=True, help="name=path,... (libstof_kernels.so builds to compare)")
    ap.add_argument("--tactics", default="13,19")
    ap.add_argument("--cells", default="64:4096:causal,64:4096:sliding",
                    help="D:S:mask,... (mask: a name of the issue-3 benchmark, or a mask spec)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--out", default=None, help="write every round's results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    libs = dict(item.split("=", 1) for item in a.libs.split(","))
    for name, path in libs.items():
        if not Path(path).is_file():
            sys.exit(f"ab_kernels: library {name}={path} not found")
    rounds = {name: [] for name in libs}
    fwd = [f"--tactics={a.tactics}", f"--cells={a.cells}", f"--batch={a.batch}", f"--heads={a.heads}",
           f"--rep={a.rep}"]
    for rnd in range(a.rounds):
        for name, path in libs.items():
            env = dict(os.environ, STOF_KERNELS_LIB=str(Path(path).resolve()))
            p = subprocess.run([sys.executable, __file__, "--worker", "--libs=x", *fwd], env=env,
                               capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("AB_JSON ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"ab_kernels: {name} failed (exit {p.returncode}): {p.stderr.strip()[-600:]}")
            rounds[name].append(json.loads(line[len("AB_JSON "):]))
            print(f"round {rnd + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)

    names = list(libs)
    keys = [(r["cell"], r["tactic"]) for r in rounds[names[0]][0]]
    table = {}
    for name in names:
        for key in keys:
            vals = [r for rr in rounds[name] for r in rr if (r["cell"], r["tactic"]) == key]
            table[(name, key)] = (statistics.median(v["ms"] for v in vals), max(v["err"] for v in vals))
    print("cell".ljust(22) + "tactic " + "".join(f"{n:>20s}" for n in names))
    for key in keys:
        base = table[(names[0], key)][0]
        row = f"{key[0]:22s}{key[1]:6d} "
        for n in names:
            ms, err = table[(n, key)]
            row += f"{ms:8.4f} {ms / base:5.3f} {err:.0e}".rjust(20)
        print(row)
    if a.out:
        Path(a.out).write_text(json.dumps({"libs": libs, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
