"""Mask specs: parsing, semantics against hand-written predicates, errors."""

import numpy as np
import pytest

from stof_trt.errors import MaskSpecError
from stof_trt.masks import parse_mask

Q = np.arange(300)[:, None]
K = np.arange(280)[None, :]
D = K - Q

CASES = {
    "causal": D <= 0,
    "causal:offset=3": D <= 3,
    "sliding:window=10": np.abs(D) <= 10,
    "sliding:window=10,causal=1": (D <= 0) & (D >= -10),
    "sliding:left=2,right=9": (D >= -2) & (D <= 9),
    "dilated:window=20,dilation=3": (np.abs(D) <= 20) & (D % 3 == 0),
    "global:n=4": (Q < 4) | (K < 4),
    "global:tokens=5;100": np.isin(Q, [5, 100]) | np.isin(K, [5, 100]),
    "longformer:window=7,global=2": (np.abs(D) <= 7) | (Q < 2) | (K < 2),
    "bigbird:block=32,window=1,global=1": (np.abs(K // 32 - Q // 32) <= 1) | (Q < 32) | (K < 32),
    "causal&sliding:window=5": (D <= 0) & (np.abs(D) <= 5),
    "causal&sliding:window=5|global:n=1": ((D <= 0) & (np.abs(D) <= 5)) | (Q < 1) | (K < 1),
    "causal&(sliding:window=5|global:n=1)": (D <= 0) & ((np.abs(D) <= 5) | (Q < 1) | (K < 1)),
    "full": np.ones((300, 280), bool),
}


@pytest.mark.parametrize("spec", list(CASES))
def test_spec_semantics(spec):
    m = parse_mask(spec)
    assert np.array_equal(m.dense(300, 280), CASES[spec])
    # str() round-trips to the same mask
    assert np.array_equal(parse_mask(str(m)).dense(300, 280), CASES[spec])


def test_bigbird_random_is_seeded_and_per_head():
    a = parse_mask("bigbird:block=16,random=0.3,seed=1").dense(160, 160)
    b = parse_mask("bigbird:block=16,random=0.3,seed=1").dense(160, 160)
    c = parse_mask("bigbird:block=16,random=0.3,seed=2").dense(160, 160)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    h = parse_mask("bigbird:block=16,random=0.3,per_head=1").dense(160, 160, num_heads=2)
    assert h.shape == (2, 160, 160) and not np.array_equal(h[0], h[1])


def test_npy_and_blocks(tmp_path):
    rng = np.random.default_rng(0)
    m = rng.random((50, 60)) < 0.3
    np.save(tmp_path / "m.npy", m)
    assert np.array_equal(parse_mask(f"npy:{tmp_path}/m.npy").dense(40, 60), m[:40])
    lay = rng.random((4, 4)) < 0.5
    np.save(tmp_path / "b.npy", lay)
    got = parse_mask(f"blocks:{tmp_path}/b.npy,block=16").dense(64, 50)
    assert np.array_equal(got, lay.repeat(16, 0).repeat(16, 1)[:64, :50])
    with pytest.raises(MaskSpecError, match="smaller than"):
        parse_mask(f"npy:{tmp_path}/m.npy").dense(51, 60)


@pytest.mark.parametrize("bad", [
    "", "nosuch", "sliding", "sliding:window=x", "sliding:width=3", "causal:offset", "dilated:window=3,dilation=0",
    "global:n=2,tokens=1", "npy:/no/such/file.npy", "(causal", "causal)", "bigbird:random=2", "sliding:window=-1",
])
def test_bad_specs_raise_clear_errors(bad):
    with pytest.raises(MaskSpecError) as e:
        parse_mask(bad).dense(10, 10)
    assert "\n" not in str(e.value) and str(e.value)
