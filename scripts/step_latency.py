#!/usr/bin/env python3
"""Per-step time of one work item, STOF against cuDNN: Sq = 128 query rows, Sk = 128 n keys, no mask, so every
STOF wgmma tactic with 128-row items runs exactly one item of n 128-key steps per (batch, head).

    python scripts/step_latency.py --tactics 24,22 --steps 1,2,4,8,16,32 --heads 1,132 --out $OUT/step_latency.json

--heads 1: one item on one SM (the GPU otherwise idle, at its highest clock); --heads 132: one item on every SM.
The slope of time against n is the time of one step on a busy SM; the intercept, the cost of a call and an item.
cuDNN (SDPA with the cuDNN backend; flash where cuDNN is unavailable) runs the same shapes. CUDA events
(triton.testing.do_bench, which flushes L2 between runs), medians. Needs a CUDA GPU; a diagnostic, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tactics", default="24")
    ap.add_argument("--steps", default="1,2,4,8,16,32", help="n: keys = 128 n")
    ap.add_argument("--heads", default="1,132", help="(batch 1) heads = items = SMs busy")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--out", default=None, help="JSON of every measurement")
    a = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, Runner, list_tactics
    from stof_trt.masks import parse_mask

    if not torch.cuda.is_available():
        sys.exit("step_latency: needs a CUDA GPU")
    tactics = [int(t) for t in a.tactics.split(",")]
    rows = []
    for H in [int(h) for h in a.heads.split(",")]:
        for n in [int(s) for s in a.steps.split(",")]:
            Sq, Sk, D = 128, 128 * n, a.dim
            g = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(1, H, Sq, D, device="cuda", dtype=torch.float16, generator=g)
            k, v = (torch.randn(1, H, Sk, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
            ref = F.scaled_dot_product_attention(q, k, v).float()
            dl = DeviceLayout(compile_mask(parse_mask("full"), Sq, Sk))
            rec = {"heads": H, "steps": n, "Sq": Sq, "Sk": Sk, "D": D}
            backend = SDPBackend.CUDNN_ATTENTION
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v)
            except RuntimeError:
                backend = SDPBackend.FLASH_ATTENTION
            with sdpa_kernel(backend):
                rec["sdpa_ms"] = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v),
                                                         warmup=25, rep=a.rep, return_mode="median")
            rec["sdpa_backend"] = backend.name
            valid = set(list_tactics(q, k, v, dl))
            for t in tactics:
                if t not in valid:
                    continue
                r = Runner(q, k, v, dl, tactic=t)
                r.out.fill_(float("nan"))
                r()
                torch.cuda.synchronize()
                err = float((r.out.float() - ref).norm() / ref.norm())
                if not err < 2e-3:
                    sys.exit(f"step_latency: tactic {t} heads={H} n={n}: relative error {err:.2e}")
                rec[f"t{t}_ms"] = triton.testing.do_bench(r, warmup=25, rep=a.rep, return_mode="median")
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    # least-squares slope and intercept per (heads, method)
    print(f"{'heads':>5} {'method':>8} {'us/step':>8} {'us at n=0':>10}")
    fits = []
    for H in sorted({r["heads"] for r in rows}):
        rs = [r for r in rows if r["heads"] == H]
        for key in ["sdpa_ms"] + [f"t{t}_ms" for t in tactics]:
            pts = [(r["steps"], r[key] * 1e3) for r in rs if key in r]
            if len(pts) < 2:
                continue
            slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            fits.append({"heads": H, "method": key[:-3], "us_per_step": slope, "us_intercept": icpt})
            print(f"{H:5d} {key[:-3]:>8} {slope:8.3f} {icpt:10.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "fits": fits}, indent=1))


if __name__ == "__main__":
    main()
