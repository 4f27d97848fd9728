"""GPU correctness of packed variable-length attention (stof_attn_params_t.seq_offsets) against a float64 reference.

Each case packs B sequences of random lengths (1, the full S, lengths off the tile grid) into [T, H, D] tensors,
runs every tactic the library lists for the packed problem, and compares each sequence's output rows with the
float64 reference of that sequence alone (the layout's first n_b rows and columns).  The output buffer carries
poisoned guard rows before and after the T real rows; the inputs carry NaN guard rows, so a kernel that reads
(and uses) a row outside the packed tensor, or writes one, fails.  Skipped without a CUDA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (the CUDA code is compiled by cmake in CI; tests need a GPU)", allow_module_level=True)

from _gpu_helpers import TOL, reference, rel_err  # noqa: E402

from stof_trt.format import compile_mask  # noqa: E402
from stof_trt.kernels import DeviceLayout, StofKernelError, list_tactics, sparse_attention, tactic_info  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128]
MASKS = ["full", "causal", "sliding:window=96", "bigbird:block=64,window=1,global=1,random=0.1,seed=2"]
GUARD = 5       # guard rows around the packed tensors
POISON = -768.0  # the output's guard rows; exactly representable in fp16 and bf16


def _lengths(rng: np.random.Generator, B: int, S: int, tile: int) -> list[int]:
    """B lengths in [1, S] with 1, S and a non-multiple of the tile among them (B >= 3)."""
    picks = [1, S, max(1, min(S, tile + 1 + int(rng.integers(0, tile - 1))))]
    picks += [int(x) for x in rng.integers(1, S + 1, size=max(0, B - 3))]
    rng.shuffle(picks)
    return picks[:B]


def _guarded(T: int, heads: int, D: int, dtype, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A [GUARD + T + GUARD, heads, D] buffer filled with `fill` and its [T, heads, D] middle."""
    buf = torch.full((GUARD + T + GUARD, heads, D), fill, dtype=dtype, device="cuda")
    return buf, buf[GUARD:GUARD + T]


def check_packed(case: str, spec: str, S: int, lengths: list[int], *, H: int, D: int, dtype, seed: int,
                 tile=(64, 64), kv_heads: int | None = None, qkv3: bool = False, workspace=True,
                 max_seqlen: int | None = None) -> list[int]:
    """Every listed tactic on one packed problem against the per-sequence float64 reference; returns the tactics."""
    mask = parse_mask(spec)
    layout = compile_mask(mask, S, S, tile_m=tile[0], tile_n=tile[1], num_heads=H)
    dense = torch.from_numpy(np.ascontiguousarray(mask.dense(S, S, num_heads=H))).cuda()
    if dense.dim() == 2:
        dense = dense[None]
    dl = DeviceLayout(layout)
    Hkv = kv_heads or H
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(offsets[-1])
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(heads):  # real rows random, guard rows NaN
        buf, mid = _guarded(T, heads, D, dtype, float("nan"))
        mid.copy_(torch.randn((T, heads, D), generator=gen, device="cuda").to(dtype))
        return buf, mid

    if qkv3:  # one [T, 3, H, D] projection read through strides
        buf = torch.full((GUARD + T + GUARD, 3, H, D), float("nan"), dtype=dtype, device="cuda")
        buf[GUARD:GUARD + T] = torch.randn((T, 3, H, D), generator=gen, device="cuda").to(dtype)
        q, k, v = (buf[GUARD:GUARD + T, i] for i in range(3))
    else:
        (_, q), (_, k), (_, v) = rand(H), rand(Hkv), rand(Hkv)
    offs = torch.from_numpy(offsets).cuda()
    scale = 1.0 / D**0.5
    refs = []
    for b, n in enumerate(lengths):
        r = slice(int(offsets[b]), int(offsets[b + 1]))
        qb, kb, vb = (t[r].permute(1, 0, 2)[None] for t in (q, k, v))  # [1, heads, n, D]
        kb, vb = (x.repeat_interleave(H // Hkv, dim=1) for x in (kb, vb))
        refs.append(reference(qb, kb, vb, dense[:, :n, :n], scale))
    tactics = list_tactics(q, k, v, dl, seq_offsets=offs, max_seqlen=max_seqlen)
    assert tactics, f"{case}: no tactic listed"
    tol = TOL[dtype]
    for t in tactics:
        obuf, o = _guarded(T, H, D, dtype, POISON)
        o.fill_(float("nan"))  # an unwritten real row stays NaN
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=o, seq_offsets=offs, max_seqlen=max_seqlen,
                         workspace=workspace)
        torch.cuda.synchronize()
        name = f"{case} tactic {tactic_info(t).name}"
        assert bool((obuf[:GUARD] == POISON).all()) and bool((obuf[GUARD + T:] == POISON).all()), \
            f"{name}: rows outside the packed output were written"
        for b, n in enumerate(lengths):
            ob = o[int(offsets[b]):int(offsets[b + 1])].permute(1, 0, 2)[None]
            ref, has_key = refs[b]
            assert bool(torch.isfinite(ob).all()), f"{name}: sequence {b} (n={n}) has unwritten or NaN rows"
            err = rel_err(ob, ref)
            assert err <= tol, f"{name}: sequence {b} (n={n}) rel err {err:.3e} > {tol}"
            assert bool((ob[~has_key] == 0).all()), f"{name}: sequence {b}: rows with no allowed key are not 0"
    return tactics


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("spec", MASKS)
def test_packed_mask_kinds(spec, dtype, D):
    S = 320
    rng = np.random.default_rng(S + D + MASKS.index(spec))
    for B in (1, 3, 5):
        lengths = [S] if B == 1 else _lengths(rng, B, S, 64)
        check_packed(f"{spec} B={B} lengths={lengths}", spec, S, lengths, H=3, D=D, dtype=dtype,
                     seed=B + D, max_seqlen=S)


@pytest.mark.parametrize("tile", [(64, 64), (128, 64), (32, 32), (64, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_packed_tile_shapes(tile, D):
    """Other tile shapes list other families (block-wise 32-row tactics, 128-row warp-specialised items)."""
    S = 512
    rng = np.random.default_rng(tile[0] * 7 + tile[1] + D)
    lengths = _lengths(rng, 5, S, tile[0])
    check_packed(f"tile {tile} lengths={lengths}", "causal", S, lengths, H=2, D=D,
                 dtype=torch.float16 if D == 64 else torch.bfloat16, seed=D, tile=tile)


@pytest.mark.parametrize("workspace", [True, False], ids=["workspace", "no_workspace"])
def test_packed_persistent_tactics_without_counter_use(workspace):
    """The persistent tactics run one CTA per work item with packed sequences (as with key_lengths): the same
    result with or without a workspace; the qkv view of one [T, 3, H, D] projection (the ORT op's layout)."""
    S = 448
    lengths = [448, 1, 200, 65, 130]
    check_packed("qkv3 causal", "causal", S, lengths, H=4, D=64, dtype=torch.float16, seed=3, qkv3=True,
                 workspace=workspace)
    check_packed("qkv3 sliding D=128", "sliding:window=64", S, lengths[::-1], H=2, D=128, dtype=torch.bfloat16,
                 seed=4, qkv3=True, workspace=workspace)


def test_packed_grouped_query_attention():
    check_packed("gqa causal", "causal", 256, [256, 17, 1, 100], H=4, D=64, dtype=torch.float16, seed=5,
                 kv_heads=2)


def test_packed_run_time_bound_below_the_layout():
    """max_seqlen below the compiled length: it bounds every sequence (the layout's top-left corner)."""
    check_packed("bound 200", "sliding:window=40|global:n=3", 512, [200, 3, 129, 64], H=2, D=64,
                 dtype=torch.float16, seed=6, max_seqlen=200)


def test_packed_errors():
    layout = compile_mask("causal", 128, 128)
    dl = DeviceLayout(layout)
    q = torch.randn((100, 2, 64), device="cuda", dtype=torch.float16)
    offs = torch.tensor([0, 60, 100], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([60, 40], dtype=torch.int32, device="cuda")
    with pytest.raises(StofKernelError) as ei:  # seq_offsets with key_lengths
        sparse_attention(q, q, q, dl, seq_offsets=offs, key_lengths=lengths)
    assert ei.value.status == 1 and "seq_offsets" in str(ei.value)
    with pytest.raises(StofKernelError) as ei:  # a bound above the compiled length
        sparse_attention(q, q, q, dl, seq_offsets=offs, max_seqlen=129)
    assert ei.value.status == 1
    with pytest.raises(ValueError):  # 4-D tensors with seq_offsets
        sparse_attention(q[None], q[None], q[None], dl, seq_offsets=offs)
    with pytest.raises(ValueError):  # int64 offsets
        sparse_attention(q, q, q, dl, seq_offsets=offs.long())
