#!/usr/bin/env python3
"""Time compile_mask on large masks (issue 2: a 32k x 32k mask compiles in under 1 s on a 2-core CPU).

    python scripts/bench_compile_mask.py [--seq 32768] [--repeat 3] [--json]

Prints the median wall time per mask kind and the tile statistics; --json prints one JSON document."""

import argparse
import json
import statistics
import sys
import time

from stof_trt import compile_mask
from stof_trt.errors import StofError

SPECS = {
    "causal": "causal",
    "sliding": "sliding:window=128",
    "dilated": "dilated:window=256,dilation=2",
    "longformer": "longformer:window=128,global=16",
    "longformer-base": "longformer:window=256,global=32",
    "bigbird": "bigbird:block=64,window=1,global=1,random=0.05,seed=0",
    "longformer&causal": "longformer:window=512,global=32&causal",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768, help="sequence length (square mask)")
    ap.add_argument("--tile", type=int, nargs=2, default=(64, 64), metavar=("M", "N"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for name, spec in SPECS.items():
        times = []
        try:
            for _ in range(a.repeat):
                t = time.perf_counter()
                lay = compile_mask(spec, a.seq, a.seq, tile_m=a.tile[0], tile_n=a.tile[1])
                times.append(time.perf_counter() - t)
        except StofError as e:   # too many stored tiles (causal, BigBird at millions of tokens): refused up front
            rows.append({"mask": name, "spec": spec, "seq": a.seq, "refused": str(e)})
            continue
        rows.append({"mask": name, "spec": spec, "seq": a.seq, "median_s": statistics.median(times),
                     "max_s": max(times), "nnz": lay.nnz, **lay.class_counts(), "density": lay.density()})
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return
    print(f"{'mask':<20}{'median s':>10}{'max s':>8}{'stored':>9}{'partial':>9}{'density':>9}")
    for r in rows:
        if "refused" in r:
            print(f"{r['mask']:<20}refused: {r['refused']}")
            continue
        print(f"{r['mask']:<20}{r['median_s']:>10.3f}{r['max_s']:>8.3f}{r['nnz']:>9}{r['partial']:>9}{r['density']:>9.4f}")


if __name__ == "__main__":
    main()
