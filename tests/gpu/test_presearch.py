"""Pre-search and host-side C ABI checks that need no GPU (they run in CI; the ABI part needs the built library
and is skipped without it)."""

from __future__ import annotations

import ctypes
import math

import pytest

from stof_trt import presearch as ps
from stof_trt.format import compile_mask
from stof_trt.masks import parse_mask

MASKS = ["causal", "sliding:window=128", "dilated:window=256,dilation=2", "longformer:window=128,global=16",
         "bigbird:block=64,window=1,global=1,random=0.05,seed=0"]


@pytest.mark.parametrize("spec", MASKS)
@pytest.mark.parametrize("S", [512, 2048])
@pytest.mark.parametrize("D", [64, 128])
def test_rank_covers_valid_tactics(spec, S, D):
    layout = compile_mask(parse_mask(spec), S, S)
    ranked = ps.rank(layout, batch=8, heads=12, head_dim=D, gpu=ps.H100_SXM)
    ids = [t for t, _ in ranked]
    assert sorted(ids) == sorted(ps.valid_tactics(64, 64, D, hopper=True))
    times = [p for _, p in ranked]
    assert all(math.isfinite(p) and p > 0 for p in times) and times == sorted(times)
    assert ps._BY_ID[ids[0]].family == ps.FAMILY_HOPPER  # on H100 the wgmma tactics win (docs/performance.md)
    assert ps.shortlist(layout, batch=8, heads=12, head_dim=D, gpu=ps.H100_SXM)[0] == ids[0]


def test_catalogue_consistency():
    names = [t.name for t in ps.TACTICS]
    assert len(set(names)) == len(names)
    assert [t.id for t in ps.TACTICS] == list(range(1, len(ps.TACTICS) + 1))
    for (tid, D) in ps.COEF:
        assert tid in ps.valid_tactics(64, 64, D, hopper=True) or tid in ps.valid_tactics(128, 64, D, hopper=True)
    assert ps.valid_tactics(64, 64, 96) == []
    assert all(ps._BY_ID[t].family != ps.FAMILY_HOPPER for t in ps.valid_tactics(64, 64, 64, hopper=False))


def test_abi_host_checks():
    kernels = pytest.importorskip("stof_trt.kernels")
    if not kernels.library_available():
        pytest.skip("libstof_kernels.so not built")
    lib = kernels.load_library()
    lib_tactics = {t.id: (t.family, t.block_m, t.block_n, t.num_warps, t.stages) for t in kernels.all_tactics()}
    assert lib_tactics == {t.id: (t.family, t.block_m, t.block_n, t.num_warps, t.stages) for t in ps.TACTICS}
    assert kernels.tactic_info(19).name == ps._BY_ID[19].name
    p = kernels._Params()
    lib.stof_attn_params_init(ctypes.byref(p))
    p.batch = p.num_heads = 1
    p.seq_q = p.seq_k = 100
    p.head_dim = 96
    dl = kernels.DeviceLayout(compile_mask(parse_mask("causal"), 128, 128), device="cpu")
    p.layout = dl._handle
    assert lib.stof_attn_validate(ctypes.byref(p)) == 2  # UNSUPPORTED
    assert b"head_dim 96" in lib.stof_last_error_message()
    p.head_dim = 64
    p.q = p.k = p.v = p.o = 256
    p.q_stride_s = p.k_stride_s = p.v_stride_s = p.o_stride_s = 64
    assert lib.stof_attn_validate(ctypes.byref(p)) == 0
    p.seq_q = 200
    assert lib.stof_attn_validate(ctypes.byref(p)) == 1  # INVALID_ARGUMENT: exceeds the compiled layout
    assert lib.stof_attn_tactic_name(0) == b"invalid"
    assert lib.stof_status_string(3) == b"invalid tactic"
