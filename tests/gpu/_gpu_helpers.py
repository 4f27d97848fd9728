"""Helpers of the GPU kernel tests (imported by test modules after their GPU guard): float64 reference,
random inputs, random block-structured masks."""

from __future__ import annotations

import numpy as np
import torch

# relative-error criterion of issue 3
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(q, k, v, dense, scale, key_keep=None):
    """float64 masked attention.  q [B,H,Sq,D], k/v [B,H,Sk,D]; dense bool [L,Sq,Sk] (head h uses h % L);
    key_keep bool [B,Sk] or None.  Rows with no allowed key give 0."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    qd, kd, vd = q.double(), k.double(), v.double()
    L = dense.shape[0]
    allowed = dense[torch.arange(H, device=dense.device) % L][None]  # [1,H,Sq,Sk]
    if key_keep is not None:
        allowed = allowed & key_keep[:, None, None, :]
    allowed = allowed.expand(B, H, Sq, Sk)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m) * allowed
    denom = p.sum(-1, keepdim=True)
    o = torch.matmul(p, vd) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return o, allowed.any(-1)  # output, row_has_key [B,H,Sq]


def rand_qkv(B, H, Sq, Sk, D, dtype, gen, bhsd=True):
    def r(S):
        shape = (B, H, S, D) if bhsd else (B, S, H, D)
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    return r(Sq), r(Sk), r(Sk)


def random_block_mask(rng: np.random.Generator, L, Sq, Sk, block=None):
    """Random boolean [L,Sq,Sk] with random block structure: a random block grid (random block size, density
    of non-empty blocks), each non-empty block full or random at its own element density; a few empty rows."""
    block = block or int(rng.choice([8, 16, 32, 64, 64, 96, 128]))
    gq, gk = -(-Sq // block), -(-Sk // block)
    out = np.zeros((L, Sq, Sk), bool)
    for l in range(L):
        occ = rng.random((gq, gk)) < rng.uniform(0.05, 0.9)
        kind = rng.random((gq, gk))
        dens = rng.uniform(0.0, 1.0, (gq, gk))
        up = np.kron(np.ones((gq, gk)), np.ones((block, block)))[:Sq, :Sk]
        elem = rng.random((Sq, Sk))
        d_up = np.repeat(np.repeat(dens, block, 0), block, 1)[:Sq, :Sk]
        f_up = np.repeat(np.repeat(kind < 0.5, block, 0), block, 1)[:Sq, :Sk]
        o_up = np.repeat(np.repeat(occ, block, 0), block, 1)[:Sq, :Sk]
        out[l] = o_up & (f_up | (elem < d_up)) & (up > 0)
        empty_rows = rng.random(Sq) < 0.03
        out[l, empty_rows] = False
    return out


def rel_err(o, ref):
    return float((o.double() - ref).norm() / ref.norm().clamp_min(1e-30))
