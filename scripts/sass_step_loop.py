#!/usr/bin/env python3
"""Count the SASS instructions of a warp-specialised kernel's steady step loop, on the CPU machine.

    pip download --no-deps nvidia-cuda-cuobjdump -d /tmp/w && unzip -oq /tmp/w/*.whl -d /tmp/w   # no GPU needed
    python scripts/sass_step_loop.py --cuobjdump /tmp/w/nvidia/cu13/bin/cuobjdump build/plugins_cu/libstof_kernels.so
    python scripts/sass_step_loop.py ... old/libstof_kernels.so new/libstof_kernels.so     # the two, and the diff

The step loop is issue-bound (docs/performance.md, sessions 12 and 18): every instruction a change adds to it has
cost time, so count before spending device time.  Its static size costs too, even code that never runs (session 19:
~0.5 % per KB of a never-taken block in tactic 24's loop; a coarse rule: a 0.9 KB removal measured within noise), so
the size in KB is printed as well.  And check that the
MMA descriptors stay on the uniform datapath (`UIADD3` / `ULEA` before the `HGMMA`s, not `IADD3` + `R2UR`): some loop
shapes make ptxas compute them in vector registers, +40-60 instructions per step (session 19).  The loop is the smallest one closed by an unconditional backward
branch that holds an S MMA (`HGMMA.64x<N>x16` with a shared-memory A operand); its masking regions are the blocks a
`@!P BRA P, target` jumps over (a FULL sub-block skips them).  Printed: the loop's static size, its size outside the
masking regions (the FULL path, plus the rescale and pre-scale branches), each masking region's size, and the opcode
counts outside the masking.  Static counts: a branch's both sides count.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys

# tactic 24: the persistent two-consumer, 128-key-step, 4-stage kernel at head dim 64, fp16
DEFAULT_KERNEL = r"hopper_ws_persist_fwdINS_8WsTraitsILi64ELi4ELi2E6__halfLb1ELi2EE"
ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def kernel_sass(cuobjdump: str, path: str, pattern: str) -> tuple[str, list[tuple[int, str]]]:
    out = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    for part in re.split(r"\n\s*Function : ", out)[1:]:
        name = part.split("\n", 1)[0].strip()
        if re.search(pattern, name):
            return name, [(int(a, 16), ins) for a, ins in ADDR.findall(part)]
    sys.exit(f"sass_step_loop: no kernel matching {pattern!r} in {path}")


def opcode(ins: str) -> str:
    words = ins.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def step_loop(code: list[tuple[int, str]]) -> dict:
    s_mma = [a for a, ins in code if re.match(r"HGMMA\.64x\d+x16\.F32 R\d+, gdesc", ins)]
    loops = []
    for a, ins in code:
        m = re.fullmatch(r"BRA (0x[0-9a-f]+)", ins)  # unconditional
        if m and int(m.group(1), 16) < a and any(int(m.group(1), 16) <= h <= a for h in s_mma):
            loops.append((a - int(m.group(1), 16), int(m.group(1), 16), a))
    if not loops:
        sys.exit("sass_step_loop: no loop around an S MMA found")
    _, head, tail = min(loops)
    body = [(a, ins) for a, ins in code if head <= a <= tail]
    masks = []
    for a, ins in body:
        m = re.match(r"@!U?P\d BRA U?P\d, (0x[0-9a-f]+)", ins)
        if m:
            masks.append((a, int(m.group(1), 16)))
    outside = [ins for a, ins in body if not any(lo < a < hi for lo, hi in masks)]
    return {"head": head, "tail": tail, "total": len(body), "outside": len(outside),
            "masking": [(hi - lo) // 16 for lo, hi in masks], "ops": collections.Counter(map(opcode, outside))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="+", help="libstof_kernels.so (or a .cubin); two: also print the difference")
    ap.add_argument("--kernel", default=DEFAULT_KERNEL, help="regex of the mangled kernel name (default: tactic 24)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--top", type=int, default=25, help="opcodes listed")
    args = ap.parse_args()
    if not shutil.which(args.cuobjdump):
        sys.exit("sass_step_loop: cuobjdump not found (see --help: the nvidia-cuda-cuobjdump wheel has it)")
    res = []
    for lib in args.libs:
        name, code = kernel_sass(args.cuobjdump, lib, args.kernel)
        r = step_loop(code)
        res.append(r)
        print(f"{lib}\n  {name}\n  loop {r['head']:#x}-{r['tail']:#x}: {r['total']} instructions "
              f"({r['total'] * 16 / 1024:.1f} KB), {r['outside']} outside "
              f"the masking regions {r['masking']}\n  " +
              ", ".join(f"{k} {v}" for k, v in r["ops"].most_common(args.top)))
    if len(res) == 2:
        a, b = res[0]["ops"], res[1]["ops"]
        diff = {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if b[k] != a[k]}
        print(f"difference (second - first) outside the masking: {res[1]['outside'] - res[0]['outside']:+d} {diff}")


if __name__ == "__main__":
    main()
