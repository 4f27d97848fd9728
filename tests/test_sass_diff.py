"""scripts/sass_diff.py on hand-written `cuobjdump -sass` listings: identical builds pass, a changed instruction, a
changed control word or a missing function is reported, bad input is a one-line error.  Host only."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "scripts" / "sass_diff.py")
sd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sd)

KERNEL = "_ZN4stof14block_attn_fwdINS_11BlockTraitsILi64EEEEvNS_12KernelParamsE"
BODY = [("IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28]", "0x00000a00ff017624", "0x000fc600078e00ff"),
        ("S2R R0, SR_TID.X", "0x0000000000007919", "0x000e220000002100"),
        ("@P0 BRA 0x30", "0x0000000000000947", "0x000fea0003800000"),
        ("EXIT", "0x000000000000794d", "0x000fea0003800000")]


def listing(funcs_by_arch: dict[str, dict[str, list[tuple[str, str, str]]]], base: int = 0) -> str:
    """A listing in cuobjdump's layout; base shifts every address (addresses must not matter)."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90a", "identifier = /some/path/x.cu", ""]
    for arch, funcs in funcs_by_arch.items():
        out += [f"\tcode for {arch}", f"\t.target\t{arch}", ""]
        for name, body in funcs.items():
            out += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
            for k, (text, w0, w1) in enumerate(body):
                out.append(f"        /*{base + 16 * k:04x}*/                   {text} ;".ljust(102) + f"/* {w0} */")
                out.append(" " * 102 + f"/* {w1} */")
            out += ["\t\t..........", ""]
    return "\n".join(out) + "\n"


def run(tmp_path, old: str, new: str, *flags: str) -> int:
    (tmp_path / "old.sass").write_text(old)
    (tmp_path / "new.sass").write_text(new)
    return sd.main([str(tmp_path / "old.sass"), str(tmp_path / "new.sass"), *flags])


def test_identical_listings_pass_whatever_their_addresses(tmp_path, capsys):
    funcs = {"sm_80": {KERNEL: BODY}, "sm_90a": {KERNEL: BODY, "other": BODY[1:]}}
    assert run(tmp_path, listing(funcs), listing(funcs, base=0x100)) == 0
    out = capsys.readouterr().out
    assert "sm_80: 1 functions old, 1 new; 1 identical" in out
    assert "sm_90a: 2 functions old, 2 new; 2 identical" in out
    assert out.strip().endswith("SASS identical")


def test_changed_instruction_is_named(tmp_path, capsys):
    changed = BODY[:1] + [("S2R R2, SR_TID.X", BODY[1][1], BODY[1][2])] + BODY[2:]
    old = listing({"sm_80": {KERNEL: BODY}, "sm_90a": {KERNEL: BODY}})
    new = listing({"sm_80": {KERNEL: BODY}, "sm_90a": {KERNEL: changed}})
    assert run(tmp_path, old, new) == 1
    out = capsys.readouterr().out
    assert "sm_80: 1 functions old, 1 new; 1 identical, 0 changed" in out
    assert "sm_90a: 1 functions old, 1 new; 0 identical, 1 changed" in out
    assert f"changed: {KERNEL}: 4 -> 4 instructions, 2 lines differ, first at instruction 1" in out
    assert "SASS DIFFERS" in out


def test_control_bits_differ_unless_text_only(tmp_path, capsys):
    stalls = [BODY[0], (BODY[1][0], BODY[1][1], "0x000e240000002100")] + BODY[2:]
    old, new = listing({"sm_90a": {KERNEL: BODY}}), listing({"sm_90a": {KERNEL: stalls}})
    assert run(tmp_path, old, new) == 1
    assert run(tmp_path, old, new, "--text-only") == 0


def test_missing_and_added_functions(tmp_path, capsys):
    old = listing({"sm_90a": {KERNEL: BODY, "gone": BODY}})
    new = listing({"sm_90a": {KERNEL: BODY, "added": BODY}})
    assert run(tmp_path, old, new) == 1
    out = capsys.readouterr().out
    assert "1 identical, 0 changed, 1 only old, 1 only new" in out
    assert "only old: gone" in out and "only new: added" in out


def test_a_name_defined_twice_in_one_arch_is_compared_by_occurrence():
    text = listing({"sm_90a": {KERNEL: BODY}}) + listing({"sm_90a": {KERNEL: BODY[:2]}})
    funcs = sd.parse(text)
    assert len(funcs[("sm_90a", KERNEL, 0)]) == 4 and len(funcs[("sm_90a", KERNEL, 1)]) == 2
    assert funcs[("sm_90a", KERNEL, 0)][0] == f"{BODY[0][0]}  {BODY[0][1]} {BODY[0][2]}"


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    good = tmp_path / "good.sass"
    good.write_text(listing({"sm_90a": {KERNEL: BODY}}))
    assert sd.main([str(tmp_path / "missing.so"), str(good)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing.so'}: no such file"
    (tmp_path / "notes.txt").write_text("not a listing\n")
    assert sd.main([str(tmp_path / "notes.txt"), str(good)]) == 2
    assert "neither an ELF binary nor a cuobjdump -sass listing" in capsys.readouterr().err
    (tmp_path / "lib.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    assert sd.main([str(tmp_path / "lib.so"), str(good), "--cuobjdump", str(tmp_path / "no-cuobjdump")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot run") and "\n" not in err
