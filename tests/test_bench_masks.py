"""stof_trt.bench.masks: each FlexAttention mask_mod the benchmarks time means the same mask as the spec STOF
compiles, element by element (CPU tensors, no FlexAttention needed)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stof_trt.bench.masks import LONG_SEQ_MASKS, MASKS, mask_mod_for  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402

S = 576  # 9 blocks of 64: past every window and global band above, with a partial BigBird block grid


def _evaluate(mod, seq, head=0):
    q = torch.arange(seq)[:, None]
    k = torch.arange(seq)[None, :]
    return np.asarray(torch.broadcast_to(mod(0, head, q, k), (seq, seq)).numpy(), dtype=bool)


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_mod_is_the_spec(name):
    mask = parse_mask(MASKS[name])
    got = _evaluate(mask_mod_for(name, mask, S, device="cpu"), S)
    want = mask.dense(S, S)
    assert got.shape == want.shape and (got == want).all(), f"{name}: {int((got != want).sum())} elements differ"
    assert 0 < want.sum() < S * S  # a real mask, so a wrong mod could not pass by accident


@pytest.mark.parametrize("name", list(LONG_SEQ_MASKS))
def test_long_sequence_mask_mods_are_their_specs(name):
    spec, per_head = LONG_SEQ_MASKS[name]
    mask = parse_mask(spec)
    heads = 3 if per_head else None
    mod = mask_mod_for(name, mask, S, heads=heads, device="cpu")
    want = mask.dense(S, S, num_heads=heads)
    for h in range(heads or 1):
        w = want[h] if want.ndim == 3 else want
        assert (_evaluate(mod, S, head=h) == w).all(), f"{name} head {h}"
    if per_head:  # the heads differ, so indexing the table by head is what is checked
        assert not (want[0] == want[1]).all()


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="no benchmark mask named 'band'"):
        mask_mod_for("band", None, S)
    with pytest.raises(ValueError, match="head count"):
        mask_mod_for("bigbird_per_head", parse_mask(LONG_SEQ_MASKS["bigbird_per_head"][0]), S, device="cpu")
