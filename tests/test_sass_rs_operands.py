"""scripts/sass_rs_operands.py on hand-written SASS: the register-A (Q) operands of an S MMA may be written only by
the LDSMs that load Q and their address set-up.  Host only."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_rs_operands", ROOT / "scripts" / "sass_rs_operands.py")
sro = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sro)

HEAD = "\n\tFunction : {name}\n\t.headerflags\n"


def sass(name, lines):
    body = "".join(f"        /*{16 * k:04x}*/                   {line} ;   /* 0x0 */\n" for k, line in enumerate(lines))
    return HEAD.format(name=name) + body


GOOD = [
    "IMAD R124, R15, 0x10, R17.reuse",  # the LDSM's address
    "LDSM.16.M88.4 R124, [R124]",
    "LDSM.16.M88.4 R128, [R9]",
    "HGMMA.64x128x16.F32 R24, R124, gdesc[UR16], RZ, !UPT",
    "HGMMA.64x128x16.F32 R24, R128, gdesc[UR16], R24, gsb0",
    "F2FP.F16.F32.PACK_AB R140, R25, R24",  # P: read by the transposed-B P V MMA, rewritten every step
    "HGMMA.64x72x16.F32 R88, R140, gdesc[UR20].tnspB, R88, gsb0",
    "FMNMX R30, R24, R25, !PT",
    "@!P0 BRA 0x0030",
]
BAD = GOOD[:7] + ["FMNMX R129, R24, R25, !PT", "@!P0 BRA 0x0030"]
BF16_BAD = [line.replace(".F32 R", ".F32.BF16 R") for line in BAD]


def test_kept_pattern_passes_and_clobber_is_found():
    text = sass("good", GOOD) + sass("bad", BAD) + sass("bad_bf16", BF16_BAD) + sass("no_rs", ["FMNMX R129, R1, R2"])
    found = sro.check(text)
    assert set(found) == {"bad", "bad_bf16"}
    assert found["bad"] == ["FMNMX R129, R24, R25, !PT"]


def test_wide_writes_overlap():
    lines = GOOD[:5] + ["IMAD.WIDE R126, R3, 0x4, R12", "@!P0 BRA 0x0030"]  # writes R126 and R127
    assert sro.bad_writes([f"{line}" for line in lines]) == ["IMAD.WIDE R126, R3, 0x4, R12"]


def test_scratch_value_replaced_by_q_load_after_the_wait():
    # the next item's Q loaded under the last step's softmax: its address set-up in Q's registers, after the S wait
    # (S, then P V committed, then a wait that lets the one group after S run on)
    pv = "HGMMA.64x72x16.F32 R88, R140, gdesc[UR20].tnspB, R88, gsb0"
    head = GOOD[:5] + [pv, "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    ok = head + ["VIADD R125, R15, 0x2", "LOP3.LUT R125, R125, 0x7, R0, 0x78, !PT", "IMAD R132, R125, 0x10, R12",
                 "LDSM.16.M88.4 R124, [R13]", "LDSM.16.M88.4 R132, [R132]", "@!P0 BRA 0x0030"]
    assert sro.bad_writes(ok) == []
    # before the wait, the S MMA may still read the register
    early = GOOD[:5] + ["VIADD R125, R15, 0x2", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "LDSM.16.M88.4 R124, [R13]"]
    assert sro.bad_writes(early) == ["VIADD R125, R15, 0x2"]
    # an S MMA (or a branch) before the reload would see the scratch value
    read = head + ["VIADD R125, R15, 0x2", "HGMMA.64x128x16.F32 R24, R124, gdesc[UR16], RZ, !UPT",
                   "LDSM.16.M88.4 R124, [R13]"]
    assert sro.bad_writes(read) == ["VIADD R125, R15, 0x2"]
    branch = head + ["VIADD R125, R15, 0x2", "@P1 BRA 0x0040", "LDSM.16.M88.4 R124, [R13]"]
    assert sro.bad_writes(branch) == ["VIADD R125, R15, 0x2"]
    # a wait that lets one group run on retires S only if a later group (here P V) was committed after it
    set_up = ["VIADD R125, R15, 0x2", "LDSM.16.M88.4 R124, [R13]", "@!P0 BRA 0x0030"]
    assert sro.bad_writes(GOOD[:5] + ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] + set_up) == ["VIADD R125, R15, 0x2"]
    assert sro.bad_writes(GOOD[:5] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + set_up) == []
    assert sro.bad_writes(GOOD[:5] + ["@P0 " + pv, "WARPGROUP.DEPBAR.LE gsb0, 0x1"] + set_up) == []  # predicated
    pv_first = GOOD[:2] + [pv] + GOOD[3:5] + ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] + set_up
    assert sro.bad_writes(pv_first) == ["VIADD R125, R15, 0x2"]
    # a reload that covers only part of the written pair leaves a register clobbered
    wide = head + ["IMAD.WIDE R126, R3, 0x4, R12", "LDSM.16.M88.4 R120, [R13]", "@!P0 BRA 0x0030"]
    assert sro.bad_writes(wide) == ["IMAD.WIDE R126, R3, 0x4, R12"]
