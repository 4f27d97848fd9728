#!/usr/bin/env python3
"""Check the SASS of the wgmma kernels whose S = Q K^T MMA takes Q from registers: those registers must hold Q for
the whole item, so nothing may write them but the `LDSM`s that load Q (and the address set-up of those `LDSM`s).

    python scripts/sass_rs_operands.py build/plugins_cu/libstof_kernels.so      # needs cuobjdump (the GPU machine)

Why: under a register cap (the one-warpgroup kernels at head dim 64 have 128) ptxas can reuse the Q registers for
softmax temporaries inside the step loop: wrong results, with no spill and no ptxas note.  The GPU tests catch the
results; this names the cause, without a GPU.

An S MMA with Q in registers is an `HGMMA` with a register A operand and a K-major B (no `.tnspB`; the P V MMAs,
whose register A is P, rewritten every step, are transposed-B).  A write to one of its A registers is allowed when
it is an `LDSM`, when the register is the address of an `LDSM` within the next few instructions, or when the
write is a scratch value that an `LDSM` of Q replaces before any S MMA reads it, with no S MMA in flight (after a
`WARPGROUP.DEPBAR.LE gsb0, N` that N later-committed groups let retire the S group: the address set-up of a Q reload
under the previous item's last softmax).  Prints one
line per offending kernel and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_S_MMA = re.compile(r"(?:@!?U?P\w+ )?HGMMA\.64x\d+x16\.F32(?:\.BF16)? R\d+, R(\d+), gdesc\[[^\]]*\](?!\.tnspB)")
_GROUP_END = re.compile(r"(?:@!?U?P\w+ )?HGMMA\..*\bgsb0\b")  # the last MMA of a committed group
_WRITE = re.compile(r"(?:@!?U?P\w+ )?([A-Z][A-Z0-9_.]*) R(\d+)\b")
# ops whose first R operand is not the one written here: HGMMA writes its accumulators, not its A operand
_NO_DEST = ("HGMMA",)
ADDRESS_WINDOW = 64  # instructions between an address set-up and its LDSM


def _width(op: str) -> int:
    if op.startswith("LDSM") and ".4" in op or ".128" in op:
        return 4
    if ".64" in op or "WIDE" in op:
        return 2
    return 1


def functions(sass: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> {function name: instructions (without addresses)}"""
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [i for _, i in _INS.findall(part)]
    return out


def bad_writes(ins: list[str]) -> list[str]:
    """The instructions of one function that write a register-A operand of its S MMAs, other than the Q loads."""
    regs = set()
    for i in ins:
        m = _S_MMA.match(i)
        if m:
            regs.update(range(int(m.group(1)), int(m.group(1)) + 4))
    bad = []
    for k, i in enumerate(ins):
        m = _WRITE.match(i)
        if not m or m.group(1).startswith(_NO_DEST):
            continue
        op, dst = m.group(1), int(m.group(2))
        if not regs & set(range(dst, dst + _width(op))):
            continue
        if op.startswith("LDSM"):
            continue
        # the address of an LDSM shortly after (LDSM Rx, [Ry...] with y == dst)
        if any(j.startswith("LDSM") and re.search(rf"\[R{dst}\b", j) for j in ins[k + 1:k + 1 + ADDRESS_WINDOW]):
            continue
        if _dead_before_q_load(ins, k, dst, _width(op)):
            continue
        bad.append(i)
    return bad


def _s_retired(ins: list[str], k: int) -> bool:
    """No S MMA is in flight at instruction k: going back, a `WARPGROUP.DEPBAR.LE gsb0, N` comes first, and at least
    N MMA groups (an `HGMMA ... gsb0` ends one) were committed between the last S MMA and it, so the S group is not
    among the N it lets run on."""
    for d in range(k - 1, -1, -1):
        if _S_MMA.match(ins[d]):
            return False
        m = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", ins[d])
        if m:
            later = 0
            for j in reversed(ins[:d]):
                if _S_MMA.match(j):
                    return later >= int(m.group(1), 16)
                if _GROUP_END.match(j):
                    later += 1
            return True  # no S MMA before it
    return False


def _dead_before_q_load(ins: list[str], k: int, dst: int, width: int) -> bool:
    """Instruction k's write (registers dst .. dst + width) is a scratch value that no S MMA can see: no S MMA is in
    flight (_s_retired) and an LDSM loads Q over every written register before any S MMA, branch or the function's
    end (going forward, straight-line code).  ptxas puts the address set-up of a Q reload made under the previous
    item's softmax there."""
    if not _s_retired(ins, k):
        return False
    left = set(range(dst, dst + width))
    for j in ins[k + 1:]:
        if _S_MMA.match(j) or re.search(r"\b(BRA|BRX|JMP|RET|EXIT)\b", j):
            return False
        m = _WRITE.match(j)
        if m and m.group(1).startswith("LDSM"):
            d = int(m.group(2))
            left -= set(range(d, d + _width(m.group(1))))
            if not left:
                return True
    return False


def check(sass: str) -> dict[str, list[str]]:
    return {name: b for name, ins in functions(sass).items() if (b := bad_writes(ins))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="libstof_kernels.so or a cubin")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    args = ap.parse_args()
    try:
        sass = subprocess.run([args.cuobjdump, "-sass", args.binary], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"error: cuobjdump -sass {args.binary}: {e}", file=sys.stderr)
        return 2
    n_rs = sum(1 for ins in functions(sass).values() if any(_S_MMA.match(i) for i in ins))
    found = check(sass)
    for name, b in found.items():
        print(f"Q REGISTERS OVERWRITTEN in {name[:120]}: {len(b)} writes, e.g. {'; '.join(b[:3])}")
    print(f"register-A S MMAs: {n_rs} kernels checked, {len(found)} with their Q registers overwritten")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
