"""GPU: every valid tactic gives the same correct output with the layout's row order (tile rows longest first)
and pair order (pairs of tile rows longest first, for the two-row kernels), both derived by the layout handle,
with the row order alone, and without either (the kernels' default order), against the float64 reference; the
same for the (batch, head) interleaving ``sched_chunk`` (-1 = the layout's, 0 = the library's L2 rule, 1 = one
pair at a time, 3).

Same criteria as test_attention_kernels.py: fresh random q/k/v, the output poisoned with NaN before every run,
relative error <= 2e-3 (fp16) / 1e-2 (bf16), rows with no allowed key exactly 0.  Skipped without a CUDA GPU.
(Named *_kernels: tests/test_row_order.py, the CPU test, already owns the module name test_row_order.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (the CUDA code is compiled by cmake in CI; tests need a GPU)", allow_module_level=True)

from _gpu_helpers import TOL, rand_qkv, reference, rel_err  # noqa: E402

from stof_trt.format import compile_mask  # noqa: E402
from stof_trt.kernels import (OPT_NO_ROW_ORDER, DeviceLayout, Runner, list_tactics, sparse_attention,  # noqa: E402
                              tactic_info)
from stof_trt.masks import parse_mask  # noqa: E402

LONGFORMER = "longformer:window=128,global=16"
BIGBIRD = "bigbird:block=64,window=1,global=1,random=0.05,seed=0"

# (spec, compiled seq_q x seq_k, run-time Sq x Sk, heads)
CASES = [
    ("causal", (1024, 1024), (1024, 1024), 2),
    (LONGFORMER, (1024, 1024), (1024, 1024), 2),
    (BIGBIRD, (1024, 1024), (1024, 1024), 2),
    (LONGFORMER, (1024, 1024), (700, 1000), 2),           # run-time sizes below the compiled layout
    ("causal", (1024, 1024), (700, 1000), 2),             # < 3/4 of the tile rows: the library drops the order
    (LONGFORMER, (1024, 1024), (900, 1000), 2),           # >= 3/4: ordered grid over all 16 rows, row 15 exits
    (BIGBIRD, (1024, 1024), (961, 1024), 3),              # last tile row holds one query row
    (BIGBIRD + ",per_head=1", (1024, 1024), (1024, 1024), 4),  # one row order per layout (L = H = 4)
    (LONGFORMER, (960, 960), (960, 960), 2),              # odd Tq = 15: the last pair has one tile row
    (BIGBIRD, (1024, 1024), (800, 1024), 2),              # 7 of 8 pairs needed (>= 3/4): pair 7 exits at once
]
DTYPE_DIMS = [(torch.float16, 64), (torch.bfloat16, 64), (torch.float16, 128)]


def _case_id(c):
    spec, lay, run, _ = c
    return f"{spec.split(':')[0]}{'-per_head' if 'per_head' in spec else ''}-{lay[0]}-{run[0]}x{run[1]}"


@pytest.mark.parametrize("dtype,D", DTYPE_DIMS, ids=["fp16-d64", "bf16-d64", "fp16-d128"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_row_order_on_off(case, dtype, D):
    spec, (lq, lk), (Sq, Sk), H = case
    B = 2
    mask = parse_mask(spec)
    layout = compile_mask(mask, lq, lk, num_heads=H)
    dl = DeviceLayout(layout)
    assert np.array_equal(dl.derived("row_order"), layout.row_order())
    assert np.array_equal(dl.derived("pair_order"), layout.pair_order())
    dense_np = mask.dense(lq, lk, num_heads=H)
    dense_np = dense_np[None] if dense_np.ndim == 2 else dense_np
    dense = torch.from_numpy(np.ascontiguousarray(dense_np[:, :Sq, :Sk])).cuda()
    gen = torch.Generator(device="cuda").manual_seed(Sq + 7 * D + H)
    q, k, v = rand_qkv(B, H, Sq, Sk, D, dtype, gen)
    scale = 1.0 / D**0.5
    ref, has_key = reference(q, k, v, dense, scale)
    tactics = list_tactics(q, k, v, dl)
    assert tactics, "no tactic listed"
    assert list_tactics(q, k, v, dl, row_order=False) == tactics
    tol = TOL[dtype]
    for t in tactics:
        outs = {}
        for ro in (True, "rows", False):  # "rows": the row order without the pair order
            what = f"{spec} {Sq}x{Sk} (layout {lq}x{lk}) tactic {tactic_info(t).name} row_order={ro}"
            out = torch.full_like(q, float("nan"))
            sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out, row_order=bool(ro), pair_order=ro is True)
            torch.cuda.synchronize()
            assert bool(torch.isfinite(out).all()), f"{what}: non-finite output (unwritten or NaN)"
            err = rel_err(out, ref)
            assert err <= tol, f"{what}: rel err {err:.3e} > {tol}"
            assert bool((out[~has_key] == 0).all()), f"{what}: rows with no allowed key are not 0"
            outs[ro] = out
        # the order of the work changes, not each row's arithmetic
        for other in ("rows", False):
            diff = float((outs[True].float() - outs[other].float()).abs().max())
            assert diff <= 8 * tol, f"{spec} tactic {tactic_info(t).name}: orders on / {other} differ by {diff:.3e}"


def test_runner_and_default_tactic_row_order():
    """Runner and the library's default tactic (0) pass the row order too, and run without it."""
    mask = parse_mask(LONGFORMER)
    layout = compile_mask(mask, 1024, 1024)
    dl = DeviceLayout(layout)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = rand_qkv(2, 2, 1024, 1024, 64, torch.float16, gen)
    ref, _ = reference(q, k, v, torch.from_numpy(mask.dense(1024, 1024)).cuda()[None], 1 / 8)
    for ro in (True, False):
        out = torch.full_like(q, float("nan"))
        r = Runner(q, k, v, dl, out=out, row_order=ro)
        assert (r._p.options & OPT_NO_ROW_ORDER == 0) == ro
        r()
        torch.cuda.synchronize()
        assert rel_err(out, ref) <= TOL[torch.float16]
        out2 = sparse_attention(q, k, v, dl, row_order=ro)
        torch.cuda.synchronize()
        assert rel_err(out2, ref) <= TOL[torch.float16]


SCHED_CASES = ["sliding:window=128", LONGFORMER]


@pytest.mark.parametrize("dtype,D", DTYPE_DIMS, ids=["fp16-d64", "bf16-d64", "fp16-d128"])
@pytest.mark.parametrize("spec", SCHED_CASES, ids=["sliding", "longformer"])
def test_sched_chunk_values(spec, dtype, D):
    """Every valid tactic with sched_chunk 0, 1 and 3 (row order on and off), S=1024, B=2, H=3."""
    S, B, H = 1024, 2, 3
    mask = parse_mask(spec)
    layout = compile_mask(mask, S, S, num_heads=H)
    dl = DeviceLayout(layout)
    assert dl.sched_chunk == layout.sched_chunk() == (1 if spec.startswith("sliding") else 0)
    dense_np = mask.dense(S, S, num_heads=H)
    dense_np = dense_np[None] if dense_np.ndim == 2 else dense_np
    dense = torch.from_numpy(np.ascontiguousarray(dense_np)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(11 + D + len(spec))
    q, k, v = rand_qkv(B, H, S, S, D, dtype, gen)
    scale = 1.0 / D**0.5
    ref, has_key = reference(q, k, v, dense, scale)
    tactics = list_tactics(q, k, v, dl)
    assert tactics, "no tactic listed"
    tol = TOL[dtype]
    for t in tactics:
        outs = []
        for chunk in (0, 1, 3):
            assert list_tactics(q, k, v, dl, sched_chunk=chunk) == tactics
            for ro in (True, False):
                what = f"{spec} tactic {tactic_info(t).name} sched_chunk={chunk} row_order={'on' if ro else 'off'}"
                out = torch.full_like(q, float("nan"))
                sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out, row_order=ro, sched_chunk=chunk)
                torch.cuda.synchronize()
                assert bool(torch.isfinite(out).all()), f"{what}: non-finite output (unwritten or NaN)"
                err = rel_err(out, ref)
                assert err <= tol, f"{what}: rel err {err:.3e} > {tol}"
                assert bool((out[~has_key] == 0).all()), f"{what}: rows with no allowed key are not 0"
                outs.append(out)
        diff = max(float((o.float() - outs[0].float()).abs().max()) for o in outs[1:])
        assert diff <= 8 * tol, f"{spec} tactic {tactic_info(t).name}: sched_chunk values differ by {diff:.3e}"


def test_runner_sched_chunk():
    """Runner and the default tactic pass -1 (the layout's sched_chunk) or an explicit one; below -1 is rejected."""
    from stof_trt.kernels import StofKernelError

    mask = parse_mask("sliding:window=128")
    layout = compile_mask(mask, 1024, 1024)
    dl = DeviceLayout(layout)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = rand_qkv(2, 3, 1024, 1024, 64, torch.float16, gen)
    ref, _ = reference(q, k, v, torch.from_numpy(mask.dense(1024, 1024)).cuda()[None], 1 / 8)
    for chunk, want in ((None, -1), (-1, -1), (0, 0), (1, 1), (3, 3)):
        out = torch.full_like(q, float("nan"))
        r = Runner(q, k, v, dl, out=out, sched_chunk=chunk)
        assert r._p.sched_chunk == want
        r()
        torch.cuda.synchronize()
        assert rel_err(out, ref) <= TOL[torch.float16]
    with pytest.raises(StofKernelError) as ei:
        Runner(q, k, v, dl, sched_chunk=-2)
    assert ei.value.status == 1
    with pytest.raises(StofKernelError):
        sparse_attention(q, k, v, dl, sched_chunk=-2)


def _check_all_tactics(q, k, v, dl, ref, has_key, scale, what, **kw):
    tol = TOL[q.dtype]
    tactics = list_tactics(q, k, v, dl, **{a: b for a, b in kw.items() if a in ("row_order", "sched_chunk")})
    assert tactics, f"{what}: no tactic listed"
    for t in tactics:
        name = f"{what} tactic {tactic_info(t).name}"
        out = torch.full_like(q, float("nan"))
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out, **kw)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), f"{name}: non-finite output (unwritten or NaN)"
        err = rel_err(out, ref)
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol}"
        assert bool((out[~has_key] == 0).all()), f"{name}: rows with no allowed key are not 0"


@pytest.mark.parametrize("Sq", [1024, 900, 770, 700])
@pytest.mark.parametrize("tile_m", [128, 256])
def test_tall_tiles_partial_chunk(tile_m, Sq):
    """Layouts of 128/256-row tiles (several 64-row CTAs per tile row, the order kept or dropped around the 3/4
    rule) with a last partial (batch, head) chunk: B*H = 6 pairs in chunks of 4."""
    B, H, D, dtype = 2, 3, 64, torch.float16
    mask = parse_mask(LONGFORMER)
    layout = compile_mask(mask, 1024, 1024, tile_m=tile_m, tile_n=64)
    dl = DeviceLayout(layout)
    dense = torch.from_numpy(np.ascontiguousarray(mask.dense(1024, 1024)[:Sq, :1000])).cuda()[None]
    gen = torch.Generator(device="cuda").manual_seed(Sq + tile_m)
    q, k, v = rand_qkv(B, H, Sq, 1000, D, dtype, gen)
    ref, has_key = reference(q, k, v, dense, 0.125)
    for ro in (True, False):
        _check_all_tactics(q, k, v, dl, ref, has_key, 0.125, f"tile_m={tile_m} Sq={Sq} row_order={ro}",
                           row_order=ro, sched_chunk=4)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("spec", ["causal", LONGFORMER])
def test_nonfinite_rows_past_key_lengths(spec, D):
    """K/V rows at or past key_lengths[b] hold NaN / Inf (padding garbage): every tactic must ignore them (the
    cp.async kernels zero-fill those rows, the TMA kernels zero V there in shared memory)."""
    B, H, S, dtype = 3, 2, 1024, torch.float16
    mask = parse_mask(spec)
    dl = DeviceLayout(compile_mask(mask, S, S))
    gen = torch.Generator(device="cuda").manual_seed(5 + D)
    q, k, v = rand_qkv(B, H, S, S, D, dtype, gen)
    lengths = torch.tensor([700, 1000, 64], dtype=torch.int32, device="cuda")
    keep = torch.arange(S, device="cuda")[None, :] < lengths[:, None].long()
    ref, has_key = reference(q, k, v, torch.from_numpy(mask.dense(S, S)).cuda()[None], 0.1, key_keep=keep)
    k_bad, v_bad = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k_bad[b, :, n:] = float("nan")
        v_bad[b, :, n:] = float("inf") if b % 2 else float("nan")
    _check_all_tactics(q, k_bad, v_bad, dl, ref, has_key, 0.1, f"{spec} D={D} NaN/Inf past key_lengths",
                       key_lengths=lengths)


def test_broadcast_kv_and_single_head_layouts():
    """K/V broadcast over heads (stride 0: no TMA map can be encoded, tactics 25/26 fall back) and B = H = 1 in the
    [B, S, H, D] layout (extent-1 dims of the TMA maps)."""
    S, D, dtype = 512, 64, torch.float16
    mask = parse_mask(LONGFORMER)
    dl = DeviceLayout(compile_mask(mask, S, S))
    dense = torch.from_numpy(mask.dense(S, S)).cuda()[None]
    gen = torch.Generator(device="cuda").manual_seed(17)
    q, k1, v1 = rand_qkv(2, 1, S, S, D, dtype, gen)
    q = torch.randn((2, 4, S, D), generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    k, v = k1.expand(2, 4, S, D), v1.expand(2, 4, S, D)
    assert k.stride(1) == 0
    ref, has_key = reference(q, k.contiguous(), v.contiguous(), dense, 0.125)
    _check_all_tactics(q, k, v, dl, ref, has_key, 0.125, "K/V broadcast over heads")
    qs, ks, vs = rand_qkv(1, 1, S, S, D, dtype, gen, bhsd=False)
    ref1, has1 = reference(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), dense, 0.125)
    tol = TOL[dtype]
    for t in list_tactics(qs, ks, vs, dl, bhsd=False):
        out = torch.full_like(qs, float("nan"))
        sparse_attention(qs, ks, vs, dl, scale=0.125, tactic=t, out=out, bhsd=False)
        torch.cuda.synchronize()
        o = out.transpose(1, 2)
        assert bool(torch.isfinite(o).all()), f"B=H=1 [B,S,H,D] tactic {tactic_info(t).name}: non-finite output"
        assert rel_err(o, ref1) <= tol, f"B=H=1 [B,S,H,D] tactic {tactic_info(t).name}: rel err {rel_err(o, ref1):.3e}"


@pytest.mark.parametrize("spec,chunk", [("sliding:window=128", None), (LONGFORMER, 1), ("causal", 1)],
                         ids=["sliding", "longformer-chunk1", "causal-chunk1"])
def test_persistent_static_items(spec, chunk):
    """With sched_chunk 1 the persistent tactics hand out all but their last wave of items statically: a grid of
    several waves (B=4, H=12, S=2048: 768 two-row items over at most 132 CTAs), for the layout's own chunk (sliding)
    and for layouts of unequal rows forced to 1; every item written exactly once, against float64."""
    mask = parse_mask(spec)
    S, B, H, D = 2048, 4, 12, 64
    layout = compile_mask(mask, S, S)
    dl = DeviceLayout(layout)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = rand_qkv(B, H, S, S, D, torch.float16, gen)
    ref, has_key = reference(q, k, v, torch.from_numpy(mask.dense(S, S)).cuda()[None], D**-0.5)
    ws = [t for t in list_tactics(q, k, v, dl) if "_ws_" in tactic_info(t).name]
    assert ws, "no warp-specialised tactic listed"
    for t in ws:
        out = torch.full_like(q, float("nan"))
        sparse_attention(q, k, v, dl, tactic=t, out=out, sched_chunk=chunk)
        torch.cuda.synchronize()
        name = tactic_info(t).name
        assert bool(torch.isfinite(out).all()), f"{name}: an item was not written"
        assert rel_err(out, ref) <= TOL[torch.float16], name
        assert bool((out[~has_key] == 0).all()), name
