"""GPU: the persistent tactic (hopper_persist.cuh) on problems with several work items per CTA.

The kernel-wide tests (test_attention_kernels.py) run small problems, where the persistent grid has at most one
item per CTA; the paths specific to it are item boundaries: the K/V ring and the Q double buffer crossing from
one item to the next, a per-item key length (key_lengths differing per batch), items with no tile at all (their
rows must be written as zeros while the next item's copies are in flight), and items past the run-time Sq (row
order over the layout's rows, skipped).  Each case is checked against the float64 reference on fresh random
q/k/v with the output poisoned (NaN) first, and against tactic 13 (the same step arithmetic, one CTA per item);
sched_chunk=1 throughout (the persistent kernel runs only then, whatever the mask).
Skipped without a CUDA GPU or without an sm_90 GPU (the tactic is a wgmma kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (the CUDA code is compiled by cmake in CI; tests need a GPU)", allow_module_level=True)

from _gpu_helpers import TOL, rand_qkv, reference, rel_err  # noqa: E402

from stof_trt.format import compile_mask  # noqa: E402
from stof_trt.kernels import DeviceLayout, list_tactics, sparse_attention, tactic_info  # noqa: E402
from stof_trt.masks import DenseMask, parse_mask  # noqa: E402
from stof_trt.presearch import TACTICS  # noqa: E402

PERSIST = [t.id for t in TACTICS if t.persistent]
PLAIN = 13


def _empty_tile_rows_mask(S: int, seed: int) -> np.ndarray:
    """Sliding window with whole 64-row tile rows emptied (their items have no tile) and a few empty rows."""
    rng = np.random.default_rng(seed)
    q = np.arange(S)[:, None]
    k = np.arange(S)[None, :]
    m = np.abs(q - k) <= 96
    for t in rng.choice(S // 64, size=max(1, S // 256), replace=False):
        m[t * 64:(t + 1) * 64] = False
    m[rng.random(S) < 0.02] = False
    return m


def _run_and_check(q, k, v, dl, dense, scale, what, key_lengths=None):
    keep = None
    if key_lengths is not None:
        keep = torch.arange(k.shape[2], device="cuda")[None, :] < key_lengths[:, None].long()
    ref, has_key = reference(q, k, v, dense, scale, key_keep=keep)
    tactics = list_tactics(q, k, v, dl)
    if not set(PERSIST) <= set(tactics):
        pytest.skip("the persistent tactic needs an sm_90 GPU and an sm_90a build")
    tol = TOL[q.dtype]
    outs = {}
    for t in PERSIST + [PLAIN]:
        name = f"{what} tactic {tactic_info(t).name}"
        out = torch.full_like(q, float("nan"))
        # sched_chunk=1: the persistent kernel runs only then (its static item split balances near-equal rows;
        # the launcher runs tactic 13's kernel for any other value)
        sparse_attention(q, k, v, dl, scale=scale, tactic=t, out=out, key_lengths=key_lengths, sched_chunk=1)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), f"{name}: non-finite output (unwritten or NaN)"
        err = rel_err(out, ref)
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol}"
        assert bool((out[~has_key] == 0).all()), f"{name}: rows with no allowed key are not 0"
        outs[t] = out
    for t in PERSIST:
        diff = float((outs[t].float() - outs[PLAIN].float()).abs().max())
        assert diff <= 8 * tol, f"{what}: persistent tactic {t} and tactic {PLAIN} differ by {diff:.3e}"


DTYPE_DIMS = [(torch.float16, 64), (torch.bfloat16, 64), (torch.float16, 128)]


@pytest.mark.parametrize("dtype,D", DTYPE_DIMS, ids=["fp16-d64", "bf16-d64", "fp16-d128"])
@pytest.mark.parametrize("spec", ["sliding:window=128", "causal", "empty-tile-rows"])
def test_many_items_per_cta(spec, dtype, D):
    """B*H*16 = 1,536 items of 64 rows (about 3 per CTA at head dim 64, 6 at 128), key lengths per batch."""
    S, B, H = 1024, 4, 24
    if spec == "empty-tile-rows":
        mask = DenseMask(_empty_tile_rows_mask(S, seed=D), source="empty-tile-rows")
    else:
        mask = parse_mask(spec)
    layout = compile_mask(mask, S, S)
    dl = DeviceLayout(layout)
    dense = torch.from_numpy(np.ascontiguousarray(mask.dense(S, S))).cuda()[None]
    gen = torch.Generator(device="cuda").manual_seed(D + len(spec))
    q, k, v = rand_qkv(B, H, S, S, D, dtype, gen)
    lengths = torch.tensor([S, 700, 64, 1000], dtype=torch.int32, device="cuda")
    _run_and_check(q, k, v, dl, dense, 1.0 / D**0.5, f"{spec} B={B} H={H}", key_lengths=lengths)


@pytest.mark.parametrize("Sq", [900, 1000])
def test_items_past_runtime_sq(Sq):
    """Run-time Sq below the layout's rows (>= 3/4: the ordered grid spans all 16 tile rows, the items of row 15
    lie past Sq and are skipped), many items per CTA."""
    B, H, D, dtype = 4, 24, 64, torch.float16
    mask = parse_mask("longformer:window=128,global=16")
    dl = DeviceLayout(compile_mask(mask, 1024, 1024))
    dense = torch.from_numpy(np.ascontiguousarray(mask.dense(1024, 1024)[:Sq, :1000])).cuda()[None]
    gen = torch.Generator(device="cuda").manual_seed(Sq)
    q, k, v = rand_qkv(B, H, Sq, 1000, D, dtype, gen)
    _run_and_check(q, k, v, dl, dense, 0.125, f"longformer Sq={Sq}")
