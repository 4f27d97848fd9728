#!/usr/bin/env python3
"""SM clock and board power while STOF and SDPA run the same problem back to back.

    python scripts/power_clock.py --sizes 4096,8192 --seconds 3 --rounds 2 --out $OUT
    python scripts/power_clock.py --mask sliding --sizes 4096 --tactics 24 --out $OUT   # STOF alone

Why: under sustained load an H100 lowers its SM clock to stay within its power limit (700 W on the SXM board), and
the benchmark's 8192^3 matmul ran 1.64-1.85 ms from one round to the next in session 20's paired run.  If one
kernel draws more power per unit of work, it runs at a lower clock than another doing the same work.  This runs
each method in a loop for --seconds (no L2 flush) while `nvidia-smi -lms 20` samples the SM clock, power and
temperature, then reports per method: calls per second (the time per call), the median clock and power over the
phase's samples after its first 0.5 s, the energy per call (power x time per call) and the SM cycles per call (clock x
time per call).  Causal runs SDPA is_causal's cuDNN kernel beside STOF; a symmetric sliding window runs cuDNN's own
band kernel beside it (scripts/cudnn_band.py, where nvidia-cudnn-frontend is installed); other masks (--mask, a
benchmark mask name or a mask spec) run STOF's tactics alone, checked against SDPA with the boolean mask.
Writes power_clock.json under --out.  Needs a CUDA GPU and nvidia-smi: a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_attention import MASKS  # noqa: E402
from paired_anchor import add_problem_args, checked_runner  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--tactics", default="24,29")
    ap.add_argument("--seconds", type=float, default=3.0, help="time each method runs per phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mask", default="causal",
                    help="a benchmark mask name (scripts/bench_attention.py: causal, sliding, dilated, longformer, "
                         "bigbird) or a mask spec")
    add_problem_args(ap)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout
    from stof_trt.masks import MaskSpecError, Sliding, parse_mask

    try:
        mask = parse_mask(MASKS.get(a.mask, a.mask))
    except MaskSpecError as e:
        sys.exit(f"power_clock: --mask: {e}")
    causal = a.mask == "causal"

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    B, H, D = a.batch, a.heads, a.dim
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
         "-lms", "20"], stdout=subprocess.PIPE, text=True)
    samples = []  # (host time, clock MHz, power W, temp C)

    def drain():
        # nvidia-smi's own timestamp has 1 ms resolution but another clock; stamp lines as they arrive instead
        import select
        while select.select([smi.stdout], [], [], 0)[0]:
            line = smi.stdout.readline()
            if not line:
                break
            f = [x.strip() for x in line.split(",")]
            try:
                samples.append((time.time(), float(f[1]), float(f[2]), float(f[3])))
            except (ValueError, IndexError):
                pass

    phases = []
    try:
        for S in [int(s) for s in a.sizes.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(S)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
            dl = DeviceLayout(compile_mask(mask, S, S))
            if causal:
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                dense = torch.from_numpy(mask.dense(S, S)).cuda()
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
                del dense
            methods = {f"stof_{t}": checked_runner(q, k, v, dl, int(t), ref, f"{a.mask} S={S}")
                       for t in a.tactics.split(",")}

            def cudnn(q=q, k=k, v=v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if causal:
                methods["sdpa_cudnn"] = cudnn
            elif isinstance(mask, Sliding) and mask.left == mask.right:
                from cudnn_band import try_band_anchor  # cuDNN's own band kernel, where the wheel is installed

                cb, why = try_band_anchor(q, k, v, mask.right, ref)
                if cb is not None:
                    methods["cudnn_band"] = cb
                else:
                    print(f"power_clock: no cuDNN band anchor: {why}", file=sys.stderr)
            for rd in range(a.rounds):
                for name, fn in methods.items():
                    fn()
                    torch.cuda.synchronize()
                    t0 = time.time()
                    n = 0
                    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    ev0.record()
                    while time.time() - t0 < a.seconds:
                        for _ in range(10):
                            fn()
                        n += 10
                        if n % 50 == 0:
                            torch.cuda.synchronize()  # keep the host within a few calls of the GPU
                            drain()
                    ev1.record()
                    torch.cuda.synchronize()
                    t1 = time.time()
                    drain()
                    ms = ev0.elapsed_time(ev1) / n
                    ph = [s for s in samples if t0 + 0.5 <= s[0] <= t1]
                    clock = float(np.median([s[1] for s in ph])) if ph else float("nan")
                    power = float(np.median([s[2] for s in ph])) if ph else float("nan")
                    temp = float(np.median([s[3] for s in ph])) if ph else float("nan")
                    phases.append({"mask": a.mask, "S": S, "round": rd, "method": name, "calls": n, "ms_per_call": ms,
                                   "clock_mhz": clock, "power_w": power, "temp_c": temp,
                                   "energy_mj_per_call": power * ms, "mcycles_per_call": clock * ms / 1e3,
                                   "samples": len(ph)})
                    print(f"{a.mask} S={S} round {rd} {name:11s} {ms:.4f} ms/call  clock {clock:.0f} MHz  power "
                          f"{power:.0f} W  temp {temp:.0f} C  energy {power * ms:.1f} mJ/call  "
                          f"{clock * ms / 1e3:.3f} Mcycles/call  ({len(ph)} samples)", flush=True)
                    time.sleep(1.0)  # let the clock recover a little between phases
            del q, k, v, ref, methods
    finally:
        smi.terminate()
    (out / "power_clock.json").write_text(json.dumps({"argv": sys.argv, "phases": phases}, indent=1))


if __name__ == "__main__":
    main()
