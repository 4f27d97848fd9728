#!/usr/bin/env python3
"""Compare the SASS of two builds of the kernel library function by function.

    python scripts/sass_diff.py OLD.so NEW.so [--cuobjdump PATH] [--text-only]

A refactoring that should not change the generated code (moved code, removed dead branches, comments) is proven
harmless when every kernel's SASS is identical: the same set of functions per architecture, and per function the
same instructions with the same encodings (the encodings carry the scheduling control bits, which the instruction
text omits).  Addresses are dropped; branch targets are offsets inside the function, so they compare as they are.
--text-only compares the instruction text alone.  Either input may also be a saved `cuobjdump -sass` listing.

Exit status: 0 identical, 1 different (a per-architecture summary and the differing functions printed), 2 bad
input (a one-line error).
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_ARCH = re.compile(r"^\s*code for (sm_\w+)\s*$")
_FUNC = re.compile(r"^\s*Function : (\S+)\s*$")
_INS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;\s*(?:/\* (0x[0-9a-f]+) \*/)?\s*$")
_ENC = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")

Key = tuple  # (arch, function name, occurrence of that name in the arch)


def parse(sass: str, text_only: bool = False) -> dict[Key, list[str]]:
    """`cuobjdump -sass` text -> {(arch, name, k): instructions}, each instruction its text plus (unless
    text_only) its encoding words.  k counts earlier functions of the same name and arch (one per translation unit
    that defines it)."""
    out: dict[Key, list[str]] = {}
    seen: dict[tuple, int] = defaultdict(int)
    arch = None
    cur: list[str] | None = None
    for line in sass.splitlines():
        m = _ARCH.match(line)
        if m:
            arch, cur = m.group(1), None
            continue
        m = _FUNC.match(line)
        if m:
            if arch is None:
                raise ValueError(f"function {m.group(1)} before any 'code for sm_XX' line")
            k = seen[(arch, m.group(1))]
            seen[(arch, m.group(1))] += 1
            cur = out[(arch, m.group(1), k)] = []
            continue
        if cur is None:
            continue
        m = _INS.match(line)
        if m:
            cur.append(m.group(1) if text_only or not m.group(2) else f"{m.group(1)}  {m.group(2)}")
            continue
        m = _ENC.match(line)
        if m and cur and not text_only:
            cur[-1] += f" {m.group(1)}"
    return out


def compare(old: dict[Key, list[str]], new: dict[Key, list[str]]) -> tuple[list[str], bool]:
    """Report lines (per architecture: functions, identical, changed, only in one build; then each changed
    function's first differences) and whether the two are identical."""
    lines: list[str] = []
    same = True
    for arch in sorted({k[0] for k in old} | {k[0] for k in new}):
        o = {k for k in old if k[0] == arch}
        n = {k for k in new if k[0] == arch}
        common = sorted(o & n)
        changed = [k for k in common if old[k] != new[k]]
        gone, added = sorted(o - n), sorted(n - o)
        lines.append(f"{arch}: {len(o)} functions old, {len(n)} new; {len(common) - len(changed)} identical, "
                     f"{len(changed)} changed, {len(gone)} only old, {len(added)} only new")
        same = same and not changed and not gone and not added
        for k in gone:
            lines.append(f"  only old: {_name(k)}")
        for k in added:
            lines.append(f"  only new: {_name(k)}")
        for k in changed:
            a, b = old[k], new[k]
            diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in
                    ("---", "+++")]
            first = next(i for i, (x, y) in enumerate(zip(a + [""], b + [""])) if x != y)
            lines.append(f"  changed: {_name(k)}: {len(a)} -> {len(b)} instructions, {len(diff)} lines differ, "
                         f"first at instruction {first}")
            lines.extend(f"    {d}" for d in diff[:6])
    return lines, same


def _name(k: Key) -> str:
    return k[1] + (f" (#{k[2] + 1})" if k[2] else "")


def sass_of(path: str, cuobjdump: str) -> str:
    """The SASS listing of a binary (through cuobjdump), or a saved listing's text."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    with p.open("rb") as f:
        head = f.read(4)
    if head != b"\x7fELF":
        text = p.read_text(errors="replace")
        if "Function : " not in text:
            raise ValueError(f"{path}: neither an ELF binary nor a cuobjdump -sass listing")
        return text
    try:
        r = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True)
    except OSError as e:
        raise ValueError(f"cannot run {cuobjdump}: {e.strerror}") from None
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"{cuobjdump} -sass {path} failed: {msg}")
    return r.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the reference build (libstof_kernels.so, a cubin, or a saved listing)")
    ap.add_argument("new", help="the build to check")
    ap.add_argument("--cuobjdump", default="cuobjdump", help="cuobjdump binary (nvdisasm must be on PATH)")
    ap.add_argument("--text-only", action="store_true", help="compare instruction text, not encodings")
    args = ap.parse_args(argv)
    try:
        old = parse(sass_of(args.old, args.cuobjdump), args.text_only)
        new = parse(sass_of(args.new, args.cuobjdump), args.text_only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not old or not new:
        print(f"error: no SASS functions in {args.old if not old else args.new}", file=sys.stderr)
        return 2
    lines, same = compare(old, new)
    print("\n".join(lines))
    print("SASS identical" if same else "SASS DIFFERS")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
