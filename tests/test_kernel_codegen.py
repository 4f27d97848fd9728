"""What ptxas makes of the wgmma (sm_90a) kernels: no serialised wgmma, no spills.  Needs nvcc, no GPU.

Two ways a kernel change can lose half its speed while every correctness test still passes, and only `ptxas -v`
tells (the library's own build prints neither):

* ptxas serialises every `wgmma.mma_async` of a kernel (waits for each MMA right after issuing it) when it cannot
  prove the asynchronous form safe: a register of an MMA in flight touched by other code, paths that join with
  different MMAs in flight, too few registers for the accumulators (notes C7510-C7520, "wgmma.mma_async instructions
  are serialized due to ..."; C7517 / C7519: a wait or arrive the compiler injected), none visible without
  `-Xptxas -v`;
* registers spill to local memory.  Every wgmma kernel is spill-free except the three-consumer ones (tactics 28, 29:
  160 registers per consumer thread), whose ~200 bytes are in set-up code, the producer and the epilogue, not in
  the step loop.

The check compiles the library's own fp16 translation units of the wgmma tactics (plugins_cu/src/hopper_f16_d64.cu,
hopper_f16_d128.cu: every tactic of the catalogue at both head dims) with `-Xptxas -v`; the bf16 files instantiate
the same code.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "plugins_cu" / "src"
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")

# the three-consumer kernels' known spills (set-up and producer code, not the step loop)
THREE_CONSUMER_SPILL_LIMIT = 256
# tactic 23 at head dim 128 (S, P and O in 160 registers): its one-CTA-per-item forms, which run without a workspace
# or with key_lengths, spill 3-7 words, stored before the first wgmma and loaded after the last (the SASS); the
# persistent form spills none
WIDE_ONE_ITEM_SPILL_LIMIT = 32


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per kernel (mangled name): its performance notes and spill bytes, from `ptxas -v` output."""
    kernels: dict[str, dict] = {}
    current_name = None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current_name = m.group(1)
            kernels.setdefault(current_name, {"notes": [], "spill_stores": None})
            continue
        m = re.search(r"Function properties for (\w+)", line)
        if m and i + 1 < len(lines):
            s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", lines[i + 1])
            if s:
                entry = kernels.setdefault(m.group(1), {"notes": [], "spill_stores": None})
                entry["spill_stores"] = int(s.group(1))
            continue
        if re.search(r"\(C75\d\d\)", line):
            # ptxas prints these before the functions' reports, naming the function (else: the current one)
            named = re.search(r"function '(\w+)'", line)
            name = named.group(1) if named else current_name or "<unnamed>"
            entry = kernels.setdefault(name, {"notes": [], "spill_stores": None})
            entry["notes"].append(line.split("ptxas info    :")[-1].strip())
    return kernels


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    """Both head dims compiled in parallel (about 30 s each on one core)."""
    tmp = tmp_path_factory.mktemp("codegen")
    procs = {}
    for d in (64, 128):
        cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90a", "-DSTOF_HAS_SM90A=1", "--expt-relaxed-constexpr",
               f"-I{SRC}", f"-I{ROOT / 'plugins_cu' / 'include'}", "-Xptxas", "-v", "-cubin",
               "-o", str(tmp / f"hopper_f16_d{d}.cubin"), str(SRC / f"hopper_f16_d{d}.cu")]
        procs[d] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reports = {}
    for d, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"nvcc failed at head dim {d}:\n{out[-3000:]}"
        reports[d] = parse_ptxas(out)
    return reports


@pytest.mark.parametrize("d", [64, 128])
def test_catalogue_compiles_every_kernel(ptxas_reports, d):
    kernels = ptxas_reports[d]
    ws = [k for k in kernels if "hopper_ws_persist_fwd" in k]
    # 21-24 and 28/29 at 64, 21-23 at 128 (24, 28/29 have no head-dim-128 form), each with a one-CTA-per-item twin
    assert len(ws) == (6 if d == 64 else 3), sorted(kernels)
    assert all(k["spill_stores"] is not None for k in kernels.values()), "a kernel without a resource report"


@pytest.mark.parametrize("d", [64, 128])
def test_no_serialised_wgmma(ptxas_reports, d):
    noted = {k: v["notes"] for k, v in ptxas_reports[d].items() if v["notes"]}
    assert not noted, "ptxas serialised wgmma or injected waits in:\n" + "\n".join(
        f"{k}: {notes[0]}" for k, notes in noted.items())


@pytest.mark.parametrize("d", [64, 128])
def test_no_spills(ptxas_reports, d):
    bad = {}
    for name, info in ptxas_reports[d].items():
        three_consumers = re.search(r"WsTraits.*Lb1ELi3E", name) is not None
        wide_one_item = re.search(r"hopper_ws_attn_fwd.*WsTraitsILi128ELi2ELi2E", name) is not None
        limit = THREE_CONSUMER_SPILL_LIMIT if three_consumers else WIDE_ONE_ITEM_SPILL_LIMIT if wide_one_item else 0
        if (info["spill_stores"] or 0) > limit:
            bad[name] = info["spill_stores"]
    assert not bad, f"spill stores over the limit (bytes): {bad}"


def test_parse_ptxas_reads_notes_and_spills():
    log = """ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
insufficient register resources for the function '_ZN4stof1jE'
ptxas info    : Compiling entry function '_ZN4stof1kE' for 'sm_90a'
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to x
ptxas info    : Function properties for _ZN4stof1kE
    32 bytes stack frame, 60 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN4stof1jE' for 'sm_90a'
ptxas info    : Function properties for _ZN4stof1jE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    k = parse_ptxas(log)
    assert k["_ZN4stof1kE"]["spill_stores"] == 60 and "serialized" in k["_ZN4stof1kE"]["notes"][0]
    assert k["_ZN4stof1jE"]["spill_stores"] == 0 and "insufficient register" in k["_ZN4stof1jE"]["notes"][0]
    assert set(k) == {"_ZN4stof1kE", "_ZN4stof1jE"}


def test_wgmma_wrappers_are_generated():
    """plugins_cu/src/wgmma_ops.cuh is plugins_cu/tools/gen_wgmma.py's output (a new shape or form goes into the
    generator, then the file is regenerated).  Host only."""
    r = subprocess.run([sys.executable, str(ROOT / "plugins_cu" / "tools" / "gen_wgmma.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr.strip()

