"""The benchmarks' masks by name: the spec STOF compiles and the FlexAttention mask_mod that means the same mask.

A mask_mod is written out by hand rather than derived from the spec so that FlexAttention's side stays an
independent statement of the mask; tests/test_bench_masks.py checks the two agree element by element.
"""

from __future__ import annotations

__all__ = ["MASKS", "LONG_SEQ_MASKS", "mask_mod_for"]

# the attention benchmark (scripts/bench_attention.py), one layout for all heads
MASKS = {
    "causal": "causal",
    "sliding": "sliding:window=128",
    "dilated": "dilated:window=256,dilation=2",
    "longformer": "longformer:window=128,global=16",
    "bigbird": "bigbird:block=64,window=1,global=1,random=0.05,seed=0",
}

# the long-sequence benchmark (scripts/bench_long_seq.py): name -> (spec, one layout per head)
LONG_SEQ_MASKS = {
    "sliding": ("sliding:window=128", False),
    "dilated": ("dilated:window=256,dilation=2", False),
    "longformer": ("longformer:window=128,global=16", False),
    "bigbird_per_head": ("bigbird:block=64,window=1,global=1,random=0.02,seed=4,per_head=1", True),
}


def mask_mod_for(name: str, mask, seq: int, heads: int | None = None, device: str = "cuda"):
    """FlexAttention's mask_mod(b, h, q, k) for the benchmark mask `name`; `mask` is its parsed spec (the BigBird
    masks read their random blocks from it), `seq` the sequence length, `heads` the head count of a per-head mask.
    """
    if name == "causal":
        return lambda b, h, q, k: q >= k
    if name == "sliding":
        return lambda b, h, q, k: (q - k).abs() <= 128
    if name == "dilated":
        return lambda b, h, q, k: ((q - k).abs() <= 256) & ((q - k) % 2 == 0)
    if name == "longformer":
        return lambda b, h, q, k: ((q - k).abs() <= 128) | (q < 16) | (k < 16)
    import numpy as np
    import torch

    if name == "bigbird":  # block-constant: the dense mask sampled at block corners is the block table
        blocks = torch.from_numpy(np.ascontiguousarray(mask.dense(seq, seq)[::64, ::64])).to(device)
        return lambda b, h, q, k: blocks[q // 64, k // 64]
    if name == "bigbird_per_head":
        if not heads:
            raise ValueError("bigbird_per_head needs the head count")
        # block tables per head, [H, S/64, S/64]: the dense mask would be H * S^2 bytes
        blocks = torch.from_numpy(np.stack([mask.layout(seq, seq, head=h) for h in range(heads)])).to(device)
        return lambda b, h, q, k: blocks[h, q // 64, k // 64]
    raise KeyError(f"no benchmark mask named {name!r}: one of {', '.join([*MASKS, 'bigbird_per_head'])}")
