"""GPU correctness of the STOF attention kernels (plugins_cu/) against a float64 reference.

Every case: fresh random q/k/v (never zeros), the output poisoned with NaN before every run, every tactic the
library lists for the problem, relative error <= 2e-3 (fp16) / 1e-2 (bf16), rows with no allowed key exactly 0.
Skipped without a CUDA GPU; set STOF_TEST_REPORT=path.jsonl to log every (case, tactic, error).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (the CUDA code is compiled by cmake in CI; tests need a GPU)", allow_module_level=True)

from _gpu_helpers import TOL, rand_qkv, random_block_mask, reference, rel_err  # noqa: E402

from stof_trt.format import TileLayout, compile_mask  # noqa: E402
from stof_trt.kernels import (  # noqa: E402
    FAMILY_HOPPER, DeviceLayout, StofKernelError, all_tactics, list_tactics, sparse_attention, tactic_info,
    workspace_size,
)
from stof_trt.masks import parse_mask  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128]
MASKS = [
    "causal",
    "sliding:window=128",
    "dilated:window=256,dilation=2",
    "longformer:window=128,global=16",
    "bigbird:block=64,window=1,global=1,random=0.05,seed=0",
    "sliding:window=40|global:n=3",
    "causal&dilated:window=64,dilation=3",
    "bigbird:block=32,window=1,global=1,random=0.2,seed=3,per_head=1",
]


# the tactics that read the layout's lane bitmaps: each is also run without them
LANE_BITMAP_TACTICS = (21, 22, 23, 24)


def _log(record: dict) -> None:
    path = os.environ.get("STOF_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _to_bhsd(t, bhsd):
    return t if bhsd else t.transpose(1, 2)


def check_all_tactics(case: str, dense_np: np.ndarray, layout: TileLayout, *, B, H, Sq, Sk, D, dtype, seed,
                      bhsd=True, lengths=None, kpm=None, scale=None, workspace=True, only=None, key_gain=None):
    """Run every listed tactic (or those of `only`) on one problem and compare with the float64 reference.
    workspace=False runs without the C ABI workspace (the warp-specialised tactics then one CTA per work item);
    key_gain: a factor per key (length Sk) that K's rows are multiplied by (scores that grow along a row)."""
    if dense_np.ndim == 2:
        dense_np = dense_np[None]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = rand_qkv(B, H, Sq, Sk, D, dtype, gen, bhsd)
    if key_gain is not None:
        g = torch.as_tensor(np.asarray(key_gain, np.float32), device="cuda")
        k = (k.float() * (g[None, None, :, None] if bhsd else g[None, :, None, None])).to(dtype)
    scale = 1.0 / D**0.5 if scale is None else scale
    dl = DeviceLayout(layout)
    dense = torch.from_numpy(np.ascontiguousarray(dense_np[:, :Sq, :Sk])).cuda()
    keep = None
    lengths_t = kpm_t = None
    if lengths is not None:
        lengths_t = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        keep = torch.arange(Sk, device="cuda")[None, :] < lengths_t[:, None].long()
    if kpm is not None:
        kpm_t = torch.from_numpy(kpm.astype(np.int32)).cuda()
        keep = (kpm_t != 0) if keep is None else keep & (kpm_t != 0)
    ref, has_key = reference(_to_bhsd(q, bhsd), _to_bhsd(k, bhsd), _to_bhsd(v, bhsd), dense, scale, keep)

    tactics = list_tactics(q, k, v, dl, bhsd=bhsd)
    assert tactics, "no tactic listed"
    invalid = [t.id for t in all_tactics() if t.id not in tactics]
    if only is not None:
        tactics = [t for t in tactics if t in only]
        assert tactics, f"none of {only} listed"
    tol = TOL[dtype]
    dl_plain = None
    for t in tactics:
        out = torch.full_like(q, float("nan"))
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, key_lengths=lengths_t, key_padding_mask=kpm_t,
                         out=out, bhsd=bhsd, workspace=workspace)
        torch.cuda.synchronize()
        o = _to_bhsd(out, bhsd)
        finite = bool(torch.isfinite(o).all())
        err = rel_err(o, ref) if finite else float("nan")
        zero_rows_ok = bool((o[~has_key] == 0).all())
        _log({"case": case + (" (no workspace)" if workspace is False else ""), "tactic": tactic_info(t).name, "dtype": str(dtype).split(".")[-1], "D": D,
              "Sq": Sq, "Sk": Sk, "err": err, "tol": tol, "zero_rows_ok": zero_rows_ok,
              "ok": finite and err <= tol and zero_rows_ok})
        assert finite, f"{case} tactic {tactic_info(t).name}: non-finite output (unwritten or NaN)"
        assert err <= tol, f"{case} tactic {tactic_info(t).name}: rel err {err:.3e} > {tol}"
        assert zero_rows_ok, f"{case} tactic {tactic_info(t).name}: rows with no allowed key are not 0"
        if t in LANE_BITMAP_TACTICS and dl.has_lane_bitmaps:
            # the same run with the bitmaps' words packed by the kernel (no lane bitmaps): the same masks, so the
            # same bits
            if dl_plain is None:
                dl_plain = DeviceLayout(layout, lane_bitmaps=False)
            out2 = torch.full_like(q, float("nan"))
            sparse_attention(q, k, v, dl_plain, scale=scale, tactic=t, key_lengths=lengths_t,
                             key_padding_mask=kpm_t, out=out2, bhsd=bhsd, workspace=workspace)
            torch.cuda.synchronize()
            assert torch.equal(out2, out), f"{case} tactic {tactic_info(t).name}: lane_bitmaps change the output"
    for t in invalid:  # tactics not listed must be refused, not run
        with pytest.raises(StofKernelError) as ei:
            sparse_attention(q, k, v, dl, tactic=t, bhsd=bhsd)
        assert ei.value.status == 3
    return tactics


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("S", [200, 333, 512])
@pytest.mark.parametrize("spec", MASKS)
def test_mask_kinds(spec, S, dtype, D):
    mask = parse_mask(spec)
    H = 3
    layout = compile_mask(mask, S, S, num_heads=H)
    dense = mask.dense(S, S, num_heads=H)
    check_all_tactics(f"{spec} S={S}", dense, layout, B=2, H=H, Sq=S, Sk=S, D=D, dtype=dtype, seed=S + D)


TILES = [(64, 64), (128, 64), (64, 128), (32, 32), (128, 128), (16, 32), (32, 64), (256, 64)]


@pytest.mark.parametrize("seed", range(40))
def test_random_masks(seed):
    """Random masks, tile shapes, sizes (tails, Sq != Sk), per-head layouts, padding, [B,S,H,D] strides."""
    rng = np.random.default_rng(1000 + seed)
    tile_m, tile_n = TILES[seed % len(TILES)]
    Sq, Sk = int(rng.integers(1, 420)), int(rng.integers(1, 420))
    if seed % 5 == 0:
        Sk = Sq
    H = int(rng.integers(1, 4))
    L = H if rng.random() < 0.3 else 1
    B = int(rng.integers(1, 4))
    dense = random_block_mask(rng, L, Sq, Sk)
    layout = TileLayout.from_dense(dense, tile_m, tile_n)
    lengths = kpm = None
    mode = seed % 4
    if mode in (1, 3):
        lengths = [int(x) for x in rng.integers(0, Sk + 1, B)]
    if mode in (2, 3):
        kpm = rng.random((B, Sk)) < rng.uniform(0.3, 1.0)
    dtype = DTYPES[seed % 2]
    D = HEAD_DIMS[(seed // 2) % 2]
    check_all_tactics(f"random seed={seed} tile={tile_m}x{tile_n} L={L} pad={mode}", dense, layout, B=B, H=H,
                      Sq=Sq, Sk=Sk, D=D, dtype=dtype, seed=seed, bhsd=bool(seed % 3), lengths=lengths, kpm=kpm,
                      scale=float(rng.uniform(0.02, 0.3)))


@pytest.mark.parametrize("scale", [-0.2, 0.0])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_nonpositive_scale(scale, dtype, D):
    """scale <= 0 is a valid argument (any finite value): every tactic, with and without the workspace, with padding
    and tails (the wgmma kernels 13-16 and 19-24 negate Q for a negative scale and fold a zero one as FLT_MIN; the
    others pre-scale the scores)."""
    rng = np.random.default_rng(int(D + 10 * (scale < 0)))
    for spec, S in (("longformer:window=64,global=4", 333), ("causal", 256)):
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S)
        kpm = rng.random((2, S)) < 0.8
        for workspace in (True, False):
            check_all_tactics(f"{spec} S={S} scale={scale}", mask.dense(S, S), layout, B=2, H=2, Sq=S, Sk=S, D=D,
                              dtype=dtype, seed=S + D, kpm=kpm if spec == "causal" else None, scale=scale,
                              workspace=workspace)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_padding_mask_with_few_holes(dtype, D):
    """A key padding mask that cuts few 64-key sub-blocks (single padded keys, one wholly padded sub-block, a padded
    tail in one sequence), so FULL tiles with and without padding meet in one item: the warp-specialised tactics
    mask only the sub-blocks the padding cuts (the padding words in their step descriptors).  Every tactic, with
    and without key_lengths, with and without the workspace (persistent and one-CTA-per-item kernels)."""
    S = 1000
    kpm = np.ones((3, S), bool)
    kpm[0, [5, 64, 127, 777]] = False
    kpm[1, 320:384] = False
    kpm[2, 700:] = False
    kpm[2, 0] = False
    for spec in ("causal", "longformer:window=128,global=16"):
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S)
        for lengths, workspace in ((None, True), (None, False), ([S, 900, 650], True)):
            check_all_tactics(f"few padding holes {spec} lengths={lengths} workspace={workspace}", mask.dense(S, S),
                              layout, B=3, H=2, Sq=S, Sk=S, D=D, dtype=dtype, seed=S + D, kpm=kpm, lengths=lengths,
                              workspace=workspace)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_growing_scores(dtype, D):
    """Scores whose row maxima jump along the row: K's rows scaled by 1 (keys < 200), 3 (a jump past the kernels'
    lazy-rescale slack of 2^8) and 40 (a jump of ~140 in the exp2 domain, where an exp against the old maximum
    overflows fp32: the speculative-exp kernels' fallback), with and without leading keys padded (rows whose first
    step has no allowed key, running maximum -inf), every tactic."""
    S = 640
    gain = np.where(np.arange(S) < 200, 1.0, np.where(np.arange(S) < 400, 3.0, 40.0))
    kpm = np.ones((2, S), bool)
    kpm[1, :150] = False
    for spec in ("causal", "sliding:window=256", "dilated:window=384,dilation=2", "longformer:window=64,global=4"):
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S)
        check_all_tactics(f"growing scores {spec}", mask.dense(S, S), layout, B=2, H=2, Sq=S, Sk=S, D=D,
                          dtype=dtype, seed=S + D, kpm=kpm, key_gain=gain)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_runtime_corner_of_compiled_layout(dtype):
    """Run-time Sq, Sk smaller than the compiled sizes use the top-left corner of the pattern."""
    mask = parse_mask("longformer:window=50,global=5")
    layout = compile_mask(mask, 512, 640)
    dense = mask.dense(512, 640)
    for Sq, Sk in [(300, 450), (64, 640), (511, 1)]:
        check_all_tactics(f"corner {Sq}x{Sk}", dense, layout, B=2, H=2, Sq=Sq, Sk=Sk, D=64, dtype=dtype, seed=Sq)


def test_long_rows_and_all_masked():
    """Many tiles per row (S=1536 causal with key_lengths incl. 0) and a mask with no allowed pair at all."""
    mask = parse_mask("causal")
    layout = compile_mask(mask, 1536, 1536)
    check_all_tactics("causal 1536 lengths", mask.dense(1536, 1536), layout, B=3, H=2, Sq=1536, Sk=1536, D=128,
                      dtype=torch.float16, seed=7, lengths=[1536, 700, 0])
    empty = np.zeros((1, 100, 130), bool)
    check_all_tactics("empty mask", empty, TileLayout.from_dense(empty, 64, 64), B=1, H=2, Sq=100, Sk=130, D=64,
                      dtype=torch.bfloat16, seed=1)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_nan_inputs_stay_in_their_rows(dtype, D):
    """A NaN in one key of K and in one row of Q: exactly the output rows the float64 reference makes NaN (those
    that attend to that key, and that row) are NaN in every tactic, and every other row is finite and within the
    tolerance.  A masked NaN key must not reach a row (masks select -inf, they do not add it), nor may a NaN reach
    the other row a thread holds (tactic 24's exp chain links a thread's two rows by an integer add of a packed P's
    sign bit; a float multiply-add by 0 there would carry the NaN)."""
    mask = parse_mask("sliding:window=100|global:n=2")
    S, B, H = 333, 2, 2
    layout = compile_mask(mask, S, S)
    dense = torch.from_numpy(np.ascontiguousarray(mask.dense(S, S)[None])).cuda()
    gen = torch.Generator(device="cuda").manual_seed(26)
    q, k, v = rand_qkv(B, H, S, S, D, dtype, gen)
    # keys 145 and 201 of (b 0, h 1), at even and odd columns of their 8-column groups: rows 45..301 and the two
    # global rows attend to them; row 37 of (b 1, h 0)
    k[0, 1, 145, 5] = float("nan")
    k[0, 1, 201, 7] = float("nan")
    q[1, 0, 37, :] = float("nan")
    scale = 1.0 / D**0.5
    ref, _ = reference(q, k, v, dense, scale)
    ref_nan = torch.isnan(ref).any(-1)
    assert 100 < int(ref_nan.sum()) < B * H * S  # the case has NaN rows and clean rows
    dl = DeviceLayout(layout)
    tol = TOL[dtype]
    for t in list_tactics(q, k, v, dl):
        out = torch.full_like(q, float("nan"))
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out)
        torch.cuda.synchronize()
        name = tactic_info(t).name
        out_nan = torch.isnan(out).any(-1)
        assert torch.equal(out_nan, ref_nan), (
            f"tactic {name}: {int((out_nan & ~ref_nan).sum())} rows NaN that the reference has finite, "
            f"{int((~out_nan & ref_nan).sum())} the other way")
        clean = ~ref_nan
        assert bool(torch.isfinite(out[clean]).all()), f"tactic {name}: non-finite values in clean rows"
        err = rel_err(out[clean], ref[clean])
        assert err <= tol, f"tactic {name}: rel err {err:.3e} > {tol} on the rows without NaN"


WS_TACTICS = (21, 22, 23, 24, 28, 29)  # warp-specialised: persistent with a workspace, one CTA per work item without


@pytest.mark.parametrize("workspace", [True, False], ids=["persistent", "cta_per_item"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_warp_specialised_forms(D, workspace):
    """Tactics 21-24, 28, 29 both ways.  Persistent: more work items (128 rows; 192 for 28/29) than SMs (each CTA
    takes many, from the work counter), a per-head BigBird layout, and layouts of 128-, 192- and 256-row tiles run
    at Sq below their compiled size (where a kernel's items match the tile rows, the row order is kept, so the
    schedule holds items past Sq, which the producer skips: 128-row tiles for 21-24, 192-row tiles for 28/29)."""
    for spec, S, H in (("causal", 2048, 6), ("bigbird:block=64,window=1,global=1,random=0.1,seed=5,per_head=1", 1536, 4)):
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S, num_heads=H)
        check_all_tactics(f"ws {spec} S={S}", mask.dense(S, S, num_heads=H), layout, B=2, H=H, Sq=S, Sk=S, D=D,
                          dtype=torch.bfloat16 if D == 128 else torch.float16, seed=S + D, workspace=workspace,
                          only=WS_TACTICS)
    mask = parse_mask("longformer:window=100,global=7")
    layout = compile_mask(mask, 1024, 1024, tile_m=128, tile_n=64)
    check_all_tactics("ws 128-row tiles Sq=800", mask.dense(1024, 1024), layout, B=3, H=5, Sq=800, Sk=1000, D=D,
                      dtype=torch.float16, seed=D, workspace=workspace, only=WS_TACTICS)
    layout = compile_mask(mask, 1152, 1152, tile_m=192, tile_n=64)
    check_all_tactics("ws 192-row tiles Sq=900", mask.dense(1152, 1152), layout, B=2, H=3, Sq=900, Sk=1000, D=D,
                      dtype=torch.bfloat16, seed=D + 1, workspace=workspace, only=WS_TACTICS)
    mask = parse_mask("bigbird:block=64,window=1,global=1,random=0.1,seed=3")
    layout = compile_mask(mask, 1024, 1024, tile_m=256, tile_n=64)
    check_all_tactics("ws 256-row tiles Sq=1000", mask.dense(1024, 1024), layout, B=2, H=3, Sq=1000, Sk=1024, D=D,
                      dtype=torch.float16, seed=D + 2, workspace=workspace, only=WS_TACTICS)


@pytest.mark.parametrize("counter", [0, 1, 57, -1, -2**31, 2**31 - 1, 123456789])
def test_workspace_needs_no_initialisation(counter):
    """The persistent kernels zero their work counter themselves (no memset before the launch): a workspace holding
    any value gives the same result.  192 work items of 128 rows (128 of 192 rows for 28/29) over the SMs, so
    every CTA claims items from the counter; without the kernel's reset a stale count would skip items (their
    rows stay NaN) or run past the schedule."""
    mask = parse_mask("causal")
    S, H = 2048, 6
    layout = compile_mask(mask, S, S, num_heads=H)
    ws = torch.empty(4, dtype=torch.int32, device="cuda")
    for t in WS_TACTICS:
        ws.fill_(counter)
        check_all_tactics(f"workspace counter {counter}", mask.dense(S, S, num_heads=H), layout, B=2, H=H, Sq=S,
                          Sk=S, D=64, dtype=torch.float16, seed=counter & 0xFFFF, workspace=ws, only=(t,))


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_warp_specialised_long_rows(D):
    """The persistent warp-specialised kernels on tile rows of more than 32 tiles (the producer's walk refills its
    shared-memory windows, which the scheduler warp handed over), and on a layout run at Sk below its compiled size
    (a walk that ends at the key bound, not at its row's last tile), there with [B, S, H, D] tensors (the O tensor
    map's strides, and rows past Sq clipped by its TMA stores)."""
    mask = parse_mask("causal")
    layout = compile_mask(mask, 4096, 4096)
    check_all_tactics("ws causal S=4096", mask.dense(4096, 4096), layout, B=1, H=2, Sq=4096, Sk=4096, D=D,
                      dtype=torch.float16, seed=41 + D, only=WS_TACTICS)
    mask = parse_mask("sliding:window=512")
    layout = compile_mask(mask, 4096, 4096)
    check_all_tactics("ws sliding:window=512 Sq=Sk=2200 on a 4096 layout, BSHD", mask.dense(4096, 4096), layout, B=2,
                      H=3, Sq=2200, Sk=2200, D=D, dtype=torch.bfloat16, seed=43 + D, bhsd=False, only=WS_TACTICS)


def check_sampled_rows(case, mask, dl, q, k, v, *, pairs, rows, bhsd=True, num_heads=None):
    """Every listed tactic on a problem too large for a whole float64 reference: the output poisoned with NaN, every
    element finite afterwards (each row written), and `rows` (query indices) of the (batch, head) `pairs` against
    float64, each head under its own layout (head h uses layout h % L).  Returns the tactics run."""
    S_q, S_k = (q.shape[2], k.shape[2]) if bhsd else (q.shape[1], k.shape[1])
    D = q.shape[-1]
    scale = 1.0 / D**0.5
    keys = np.arange(S_k, dtype=np.int64)
    rows_t = torch.from_numpy(rows).cuda()

    def head(t, b, h):  # [S, D] of (b, h)
        return t[b, h] if bhsd else t[b, :, h]

    refs = {}
    for b, h in pairs:
        lay = h % dl.num_layouts
        allowed = torch.from_numpy(np.array(np.broadcast_to(mask.evaluate(
            rows[:, None], keys[None, :], seq_q=S_q, seq_k=S_k, head=lay), (len(rows), S_k)))).cuda()
        assert bool(allowed.any(-1).all())  # every sampled row has a key (no zero rows to special-case)
        qd, kd, vd = head(q, b, h)[rows_t].double(), head(k, b, h).double(), head(v, b, h).double()
        sc = (qd @ kd.T * scale).masked_fill(~allowed, float("-inf"))
        pr = torch.exp(sc - sc.amax(-1, keepdim=True))
        refs[(b, h)] = (pr @ vd) / pr.sum(-1, keepdim=True)
    out = torch.empty_like(q)
    tol = TOL[q.dtype]
    tactics = list_tactics(q, k, v, dl, bhsd=bhsd)
    assert len(tactics) >= 10, tactics
    failure = None  # the first one; reported once the big tensors are freed (a traceback would keep them alive)
    for t in tactics:
        name = tactic_info(t).name
        out.fill_(float("nan"))
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out, bhsd=bhsd)
        torch.cuda.synchronize()
        for b in range(out.shape[0]):
            if not bool(torch.isfinite(out[b]).all()):
                failure = failure or f"{case} tactic {name}: batch {b} has unwritten rows"
        for b, h in pairs:
            err = rel_err(head(out, b, h)[rows_t], refs[(b, h)])
            _log({"case": f"{case} b={b} h={h}", "tactic": name, "dtype": str(q.dtype).split(".")[-1], "D": D,
                  "Sq": S_q, "Sk": S_k, "err": err, "tol": tol, "zero_rows_ok": True, "ok": err <= tol})
            if not err <= tol:
                failure = failure or f"{case} tactic {name}: (b {b}, h {h}) rel err {err:.3e} > {tol}"
        if failure:
            break
    del out, q, k, v
    assert failure is None, failure
    return tactics


def _sample_rows(S, seed, extra=()):
    """The first 3 and last 64 query rows, 96 random ones and `extra`, sorted and unique."""
    rng = np.random.default_rng(seed)
    return np.unique(np.concatenate([[0, 1, 2], np.arange(S - 64, S), rng.integers(3, S - 64, 96),
                                     np.asarray(extra, np.int64)]).astype(np.int64))


# (B, H, S) per head dim: q, k, v and o each past 2^31 elements (4 GiB of fp16), so every offset into them needs
# 64 bits; D=64 as [B,H,S,D], D=128 as [B,S,H,D] (the sequence stride is then H * D)
BIG_SHAPES = {64: (9, 128, 32768, True), 128: (5, 128, 32768, False)}


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_tensors_past_2_31_elements(D):
    """Every tactic on tensors of more than 2^31 elements (4.8-5.4 GB each), checked by check_sampled_rows on three
    (batch, head) pairs, the last one's rows starting past 2^32 bytes.  The mask (a band and 3 global tokens) has
    PARTIAL tiles on every row and 512-tile rows (the global queries)."""
    B, H, S, bhsd = BIG_SHAPES[D]
    nbytes = B * H * S * D * 2
    assert B * H * S * D > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * nbytes + (4 << 30):
        pytest.skip(f"needs {(4 * nbytes + (4 << 30)) / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free")
    mask = parse_mask("sliding:window=100|global:n=3")
    dl = DeviceLayout(compile_mask(mask, S, S))
    gen = torch.Generator(device="cuda").manual_seed(31 + D)
    shape = (B, H, S, D) if bhsd else (B, S, H, D)
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
    first = (q[B - 1, H - 1] if bhsd else q[B - 1, :, H - 1])[0, 0]
    assert first.data_ptr() - q.data_ptr() >= 2**32  # the last pair's rows start past 4 GiB
    del first
    try:
        check_sampled_rows("tensors past 2^31 elements", mask, dl, q, k, v,
                           pairs=[(0, 0), (B // 2, 7), (B - 1, H - 1)], rows=_sample_rows(S, D), bhsd=bhsd)
    finally:  # (a failure's traceback must not keep 19-22 GB alive for the next case)
        del q, k, v
        torch.cuda.empty_cache()


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_long_sequences_list_and_run_the_wgmma_tactics(D):
    """Layouts whose tile grids would hold more than 2^32 bytes of one-bitmap-per-tile but few bitmaps: S = 2^18
    under one layout (a band with 3 global tokens: 4,096-tile global rows) and S = 2^16 under 16 per-head BigBird
    layouts.  The wgmma tactics (32-bit bitmap offsets, bounded by the layout's bitmaps) are listed on sm_90 and
    every tactic matches float64 on sampled rows (check_sampled_rows)."""
    dtype = torch.bfloat16 if D == 128 else torch.float16
    for spec, S, H, bhsd in (("sliding:window=128|global:n=3", 1 << 18, 2, True),
                             ("bigbird:block=64,window=1,global=1,random=0.02,seed=4,per_head=1", 1 << 16, 16, False)):
        mask = parse_mask(spec)
        layout = compile_mask(mask, S, S, num_heads=H)
        assert layout.num_layouts * layout.Tq * -(-S // 64) * 512 > 2**32
        dl = DeviceLayout(layout)
        gen = torch.Generator(device="cuda").manual_seed(S + D)
        shape = (1, H, S, D) if bhsd else (1, S, H, D)
        q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
        ids = check_sampled_rows(f"{spec} S={S}", mask, dl, q, k, v, pairs=[(0, 0), (0, H - 1)],
                                 rows=_sample_rows(S, D, extra=[S // 2]), bhsd=bhsd)
        if torch.cuda.get_device_capability() == (9, 0) and any(t.family == FAMILY_HOPPER for t in all_tactics()):
            assert [t for t in ids if tactic_info(t).family == FAMILY_HOPPER], ids
            assert D != 64 or 24 in ids, ids  # the fastest two-consumer tactic at head dim 64
        del q, k, v


def test_wgmma_tactics_bounded_by_the_bitmaps():
    """The wgmma kernels address bitmap words by 32-bit byte offsets; the library bounds them by the layout's
    bitmaps (its handle knows their count), not by its tile grid: a band compiled for 2^20 x 2^20 (2^28 64x64
    tiles of 512 bytes in its grid, a few bitmaps stored) lists the same tactics as at 128 x 128."""
    small = DeviceLayout(compile_mask(parse_mask("sliding:window=128"), 128, 128))
    big_layout = compile_mask(parse_mask("sliding:window=128"), 1 << 20, 1 << 20)
    big = DeviceLayout(big_layout)
    assert big.num_bitmaps == big_layout.bitmaps.shape[0] < 64
    q, k, v = _problem()
    ids = list_tactics(q, k, v, small)
    assert set(list_tactics(q, k, v, big)) == set(ids)
    if torch.cuda.get_device_capability() == (9, 0) and any(t.family == FAMILY_HOPPER for t in all_tactics()):
        assert [t for t in ids if tactic_info(t).family == FAMILY_HOPPER], ids


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("spec", ["causal", "sliding:window=128",
                                  "bigbird:block=64,window=1,global=1,random=0.1,seed=1"])
def test_grouped_query_attention(spec, D, group, strided):
    """K/V with H / group heads (kv_heads): every listed tactic against float64 with K/V repeated per query head;
    strided: K and V are head slices of one [B, Sk, 2·Hkv + 3, D] buffer (non-contiguous head and batch strides);
    also with key_lengths (the TMA kernels' cp.async fallback) and without a workspace."""
    B, H, S = 2, 8, 333
    Hkv = H // group
    gen = torch.Generator(device="cuda").manual_seed(100 * group + D)
    dtype = torch.float16
    q = torch.randn(B, H, S, D, generator=gen, device="cuda").to(dtype)
    if strided:
        kv = torch.randn(B, S, 2 * Hkv + 3, D, generator=gen, device="cuda").to(dtype)
        k, v = kv[:, :, 1:1 + Hkv].transpose(1, 2), kv[:, :, 2 + Hkv:2 + 2 * Hkv].transpose(1, 2)
        assert not k.is_contiguous() and k.stride(3) == 1
    else:
        k, v = (torch.randn(B, Hkv, S, D, generator=gen, device="cuda").to(dtype) for _ in range(2))
    layout = compile_mask(parse_mask(spec), S, S, num_heads=H)
    dl = DeviceLayout(layout)
    dense = torch.from_numpy(np.ascontiguousarray(layout.to_dense()[:, :S, :S])).cuda()
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # query head h: K/V h // group
    lengths = torch.tensor([S, 201], dtype=torch.int32, device="cuda")
    keep = torch.arange(S, device="cuda")[None, :] < lengths[:, None].long()
    refs = {False: reference(q, kx, vx, dense, D**-0.5), True: reference(q, kx, vx, dense, D**-0.5, keep)}
    tactics = list_tactics(q, k, v, dl)
    assert tactics
    for t in tactics:
        for use_len, ws in ((False, True), (True, True), (False, False)):
            ref, has_key = refs[use_len]
            out = torch.full_like(q, float("nan"))
            sparse_attention(q, k, v, dl, tactic=t, out=out, key_lengths=lengths if use_len else None, workspace=ws)
            torch.cuda.synchronize()
            name = f"{spec} D={D} group={group} tactic {tactic_info(t).name} len={use_len} ws={ws}"
            assert torch.isfinite(out).all(), name
            err = rel_err(out, ref)
            _log({"case": "gqa " + name, "err": err, "tol": TOL[dtype], "ok": err <= TOL[dtype]})
            assert err <= TOL[dtype], f"{name}: rel err {err:.3e}"
            assert bool((out[~has_key] == 0).all()), name


def test_grouped_query_attention_bf16_and_bshd():
    """bf16, tensors [B, S, H, D] (bhsd=False), group 4: every tactic."""
    B, H, S, D, group = 2, 8, 256, 128, 4
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(B, S, H, D, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(B, S, H // group, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    layout = compile_mask(parse_mask("causal"), S, S)
    dl = DeviceLayout(layout)
    dense = torch.from_numpy(np.ascontiguousarray(layout.to_dense()[:, :S, :S])).cuda()
    bh = lambda t: t.transpose(1, 2)  # noqa: E731
    ref, _ = reference(bh(q), bh(k).repeat_interleave(group, 1), bh(v).repeat_interleave(group, 1), dense, D**-0.5)
    for t in list_tactics(q, k, v, dl, bhsd=False):
        out = sparse_attention(q, k, v, dl, tactic=t, bhsd=False)
        torch.cuda.synchronize()
        assert rel_err(bh(out), ref) <= TOL[torch.bfloat16], tactic_info(t).name


def test_grouped_query_attention_errors():
    layout = compile_mask(parse_mask("causal"), 128, 128)
    dl = DeviceLayout(layout)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 6, 128, 64, generator=gen, device="cuda").half()
    k = torch.randn(1, 4, 128, 64, generator=gen, device="cuda").half()  # 6 % 4 != 0
    with pytest.raises(StofKernelError, match="kv_heads") as ei:
        sparse_attention(q, k, k, dl)
    assert ei.value.status == 1
    with pytest.raises(ValueError, match="same number of heads"):
        sparse_attention(q, k[:, :3], k[:, :2], dl)


SPLIT_TACTIC = 30  # block_m64_n64_w4_s2_occ1_qreg_split


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ["full", "longformer", "random", "lengths", "kpm", "bshd", "gqa"])
def test_split_tactic_few_long_rows(case, dtype, D):
    """Few work items with long rows (the global rows of a Longformer layer): the split tactic walks each row in
    slices and merges them by log-sum-exp.  Against float64 with the slices (workspace > 0, so it does split) and
    without the workspace (the plain kernel); tails off the tile grid, slices with no allowed key (rows whose
    allowed keys all lie in one slice; rows with none: exact zeros), key lengths incl. 0, padding masks,
    [B, S, H, D] tensors and grouped K/V heads."""
    rng = np.random.default_rng(11 + len(case) + D)
    B, H, Sq, Sk = 2, 3, 90, 3000
    lengths = kpm = None
    if case == "longformer":
        mask = parse_mask("longformer:window=128,global=16")
        dense = mask.dense(Sq, Sk)
        layout = compile_mask(mask, Sq, Sk)
    elif case == "random":
        dense = random_block_mask(rng, H, Sq, Sk)
        dense[:, 10] = True            # a long row: the layout splits
        dense[:, 5] = False            # a row with no allowed key
        dense[:, 7] = False
        dense[:, 7, 2500:2510] = True  # a row whose keys all lie in the last slice
        layout = TileLayout.from_dense(dense, 64, 64)
    else:
        dense = np.ones((Sq, Sk), bool)
        layout = compile_mask(parse_mask("full"), Sq, Sk)
    if case == "lengths":
        lengths = [2999, 0]
    if case == "kpm":
        kpm = rng.random((B, Sk)) < 0.3
        kpm[1] = False
        kpm[1, 1234] = True  # one allowed key
    check = dict(B=B, H=H, Sq=Sq, Sk=Sk, D=D, dtype=dtype, seed=D, bhsd=case != "bshd", lengths=lengths, kpm=kpm,
                 only=[1, SPLIT_TACTIC])
    q = torch.empty((B, H, Sq, D) if case != "bshd" else (B, Sq, H, D), dtype=dtype, device="cuda")
    kv = torch.empty((B, H, Sk, D) if case != "bshd" else (B, Sk, H, D), dtype=dtype, device="cuda")
    dl = DeviceLayout(layout)
    assert workspace_size(q, kv, kv, dl, SPLIT_TACTIC, bhsd=case != "bshd") > 0  # it splits here
    if case == "gqa":
        check_gqa_split(dense, layout, dtype, D)
        return
    for ws in (True, False):
        assert SPLIT_TACTIC in check_all_tactics(f"split {case}", dense, layout, workspace=ws, **check)


def check_gqa_split(dense, layout, dtype, D):
    B, H, group = 1, 8, 4
    Sq, Sk = dense.shape[-2:]
    gen = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(B, H, Sq, D, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(B, H // group, Sk, D, generator=gen, device="cuda").to(dtype) for _ in range(2))
    dl = DeviceLayout(layout)
    assert workspace_size(q, k, v, dl, SPLIT_TACTIC) > 0
    ref, _ = reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                       torch.from_numpy(np.ascontiguousarray(dense[None])).cuda(), D**-0.5)
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, k, v, dl, tactic=SPLIT_TACTIC, out=out)
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= TOL[dtype]


def test_split_tactic_workspace_and_packed():
    """The split tactic's workspace: 0 where it splits nothing (many work items, or short rows), tactic 0 reports
    at least it; packed sequences split too (against the per-sequence float64 reference)."""
    q = torch.empty(8, 12, 4096, 64, dtype=torch.float16, device="cuda")
    many = DeviceLayout(compile_mask(parse_mask("causal"), 4096, 4096))
    assert workspace_size(q, q, q, many, SPLIT_TACTIC) == 0
    glob = DeviceLayout(compile_mask(parse_mask("full"), 64, 4096))
    q1, kv1 = q[:1, :, :32], q[:1]
    split = workspace_size(q1, kv1, kv1, glob, SPLIT_TACTIC)
    assert split >= 12 * 2 * 64 * 65 * 4 and workspace_size(q1, kv1, kv1, glob, 0) >= split
    lengths = [2000, 1, 777]
    S, H, D = 2048, 1, 64
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    T = int(offsets[-1])
    gen = torch.Generator(device="cuda").manual_seed(5)
    qp, kp, vp = (torch.randn(T, H, D, generator=gen, device="cuda").half() for _ in range(3))
    mask = parse_mask("sliding:window=900")
    dl = DeviceLayout(compile_mask(mask, S, S))
    assert workspace_size(qp, kp, vp, dl, SPLIT_TACTIC, seq_offsets=offsets) > 0
    out = torch.full_like(qp, float("nan"))
    sparse_attention(qp, kp, vp, dl, tactic=SPLIT_TACTIC, out=out, seq_offsets=offsets)
    torch.cuda.synchronize()
    for b, n in enumerate(lengths):
        r0 = int(offsets[b])
        sl = lambda t: t[r0:r0 + n].transpose(0, 1)[None]  # noqa: E731
        dense = torch.from_numpy(np.ascontiguousarray(mask.dense(n, n)[None])).cuda()
        ref, _ = reference(sl(qp), sl(kp), sl(vp), dense, D**-0.5)
        assert rel_err(sl(out), ref) <= TOL[torch.float16], (b, n)


def _problem(D=64, Sq=128, Sk=128, dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return rand_qkv(1, 2, Sq, Sk, D, dtype, gen)


def test_errors():
    layout = compile_mask(parse_mask("causal"), 128, 128)
    dl = DeviceLayout(layout)
    q, k, v = _problem(D=96)
    with pytest.raises(StofKernelError, match="head_dim 96") as ei:
        sparse_attention(q, k, v, dl)
    assert ei.value.status == 2  # UNSUPPORTED
    q, k, v = _problem(Sq=200, Sk=128)
    with pytest.raises(StofKernelError, match="exceed") as ei:
        sparse_attention(q, k, v, dl)
    assert ei.value.status == 1  # INVALID_ARGUMENT
    q, k, v = _problem()
    with pytest.raises(StofKernelError) as ei:
        sparse_attention(q, k, v, dl, tactic=999)
    assert ei.value.status == 3
    q32 = q.float()
    with pytest.raises(StofKernelError) as ei:
        sparse_attention(q32, k.float(), v.float(), dl, out=torch.empty_like(q32))
    assert ei.value.status == 2
    # tactic 0 = library default, runs
    out = sparse_attention(q, k, v, dl, tactic=0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def test_catalogue_matches_presearch():
    """The analytical pre-search mirrors the library's tactic catalogue and validity rules."""
    from stof_trt import presearch

    lib = {t.id: (t.family, t.block_m, t.block_n, t.num_warps, t.stages) for t in all_tactics()}
    ps = {t.id: (t.family, t.block_m, t.block_n, t.num_warps, t.stages) for t in presearch.TACTICS}
    assert lib == ps
    for tile in TILES:
        for D in HEAD_DIMS:
            layout = compile_mask(parse_mask("causal"), 256, 256, tile_m=tile[0], tile_n=tile[1])
            dl = DeviceLayout(layout)
            q, k, v = _problem(D=D, Sq=256, Sk=256)
            assert sorted(list_tactics(q, k, v, dl)) == sorted(presearch.valid_tactics(tile[0], tile[1], D))
