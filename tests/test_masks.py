"""Mask specs: parsing, semantics against hand-written predicates, errors."""

import numpy as np
import pytest

from stof_trt.errors import MaskSpecError
from stof_trt.format import TileLayout, compile_mask
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


# --- bad input and unbounded work ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    "bigbird:random=0.1,seed=-1", f"dilated:window=8,dilation={10**12}", f"global:n={10**12}",
    "blocks:x.npy,block=0", "(" * 2000 + "causal" + ")" * 2000, f"sliding:window={2**31}",
    f"global:tokens=1;{10**12}", "global:n=-1", "sliding:window=2,window=300", "sliding:window=\u0663",
    "sliding:window=\uff13", "global:tokens=1;\u0663",
])
def test_bad_specs_are_one_line_errors(spec):
    with pytest.raises(MaskSpecError) as e:
        parse_mask(spec)
    assert "\n" not in str(e.value)


def test_mask_files_that_are_not_npy_arrays(tmp_path):
    (tmp_path / "text.npy").write_text("0 1\n1 0\n")
    with pytest.raises(MaskSpecError, match="not a numpy .npy array file"):
        parse_mask(f"npy:{tmp_path / 'text.npy'}")
    with pytest.raises(MaskSpecError, match="is a directory"):
        parse_mask(f"blocks:{tmp_path},block=16")
    with pytest.raises(MaskSpecError, match="takes a path only"):
        parse_mask(f"npy:{tmp_path / 'a.npy'},block=2")


def test_specs_combine_with_specs_only():
    with pytest.raises(TypeError):
        parse_mask("causal") & 5
    with pytest.raises(TypeError):
        parse_mask("causal") | "causal"


def test_compile_mask_refuses_sizes_and_heads_out_of_range():
    from stof_trt.errors import StofError

    for args, kw in [(("sliding:window=1", 2**31), {}), (("causal", 10**18), {}), (("causal", True), {}),
                     (("causal", 128), {"num_heads": 0}), (("causal", 128), {"num_heads": "4"}),
                     (("causal", 128), {"num_heads": 10**9})]:
        with pytest.raises(StofError):
            compile_mask(*args, **kw)
    lay = compile_mask("causal", 128, num_heads=2)
    with pytest.raises(StofError, match="layout 5"):
        lay.to_string(layout=5)


def test_nesting_limit_is_named():
    with pytest.raises(MaskSpecError, match="deeper than"):
        parse_mask("(" * 2000 + "causal" + ")" * 2000)
    assert str(parse_mask("(" * 30 + "causal" + ")" * 30)) == "causal"


@pytest.mark.parametrize("layout", [np.array([["a", "b"], ["c", "d"]]), np.array([[0.5, 1.0], [0, 1]]),
                                    np.array([[7, 0], [0, 1]])])
def test_block_layouts_must_be_boolean_or_01(tmp_path, layout):
    p = tmp_path / "lay.npy"
    np.save(p, layout)
    with pytest.raises(MaskSpecError, match="boolean or 0/1"):
        parse_mask(f"blocks:{p},block=16")


def test_global_n_is_capped_at_the_sequence():
    m = parse_mask("global:n=1000000000").dense(100, 90)
    assert m.all()
    lay = compile_mask("global:n=1000000000", 128, 128)
    assert lay.class_counts()["full"] == 4
    capped = compile_mask("global:n=1000000000&causal", 100, 100)
    assert capped.signature() == compile_mask("causal", 100, 100).signature()


def test_huge_dilation_keeps_the_diagonal():
    assert np.array_equal(parse_mask("dilated:window=50,dilation=2000000000").dense(70, 70), np.eye(70, dtype=bool))
    assert np.array_equal(compile_mask("dilated:window=50,dilation=2000000000", 70, 70).to_dense()[0],
                          np.eye(70, dtype=bool))


def test_bigbird_random_blocks_are_prefix_stable():
    for spec, heads in (("bigbird:block=16,random=0.3,seed=5", None), ("bigbird:block=16,random=0.3,per_head=1", 2)):
        m = parse_mask(spec)
        small, big = m.dense(64, 64, num_heads=heads), m.dense(100, 100, num_heads=heads)
        assert np.array_equal(small, big[..., :64, :64])
        tiles = dict(tile_m=16, tile_n=32, num_heads=heads)
        assert np.array_equal(compile_mask(spec, 64, 64, **tiles).to_dense(),
                              compile_mask(spec, 100, 100, **tiles).to_dense()[:, :64, :64])


def test_bigbird_at_a_huge_length_is_refused_before_allocating():
    with pytest.raises(MaskSpecError, match="block grid"):
        compile_mask("bigbird:block=64,random=0.1", 10**7, 10**7)


@pytest.mark.parametrize("spec", [
    "causal", "causal:offset=70", "sliding:window=5", "sliding:left=100,right=0", "dilated:window=90,dilation=3",
    "global:n=3", "global:tokens=5;130;131", "longformer:window=40,global=2", "bigbird:block=16,random=0.2",
    "sliding:window=30&causal", "(sliding:window=3|global:n=70)&causal", "dilated:window=20,dilation=4|global:n=1",
])
@pytest.mark.parametrize("sq,sk", [(1, 1), (100, 77), (257, 300), (130, 1), (300, 129)])
def test_compile_mask_matches_the_dense_compile(spec, sq, sk):
    """Candidates and shared tile keys change how compile_mask works, never what it builds."""
    for tm, tn in ((64, 64), (16, 32)):
        lay = compile_mask(spec, sq, sk, tile_m=tm, tile_n=tn)
        ref = TileLayout.from_dense(parse_mask(spec).dense(sq, sk), tm, tn)
        assert lay.signature() == ref.signature(), (spec, sq, sk, tm, tn)


def test_band_compile_keeps_only_the_band():
    # 2^20 tokens: a grid of 2^28 tiles, of which a few per tile row are stored
    lay = compile_mask("longformer:window=256,global=32", 2**20, 2**20)
    assert lay.nnz < 3 * 2**14 * 6


@pytest.mark.parametrize("spec", ["causal", "full", "global:n=1000000000"])
def test_compile_refuses_more_stored_tiles_than_it_can_hold(spec):
    from stof_trt.errors import StofError

    with pytest.raises(StofError, match="may store up to"):
        compile_mask(spec, 2**22, 2**22)


def test_bigbird_grid_draw_rebuilds_recorded_layouts():
    """draw=grid: one stream over the block grid, as the recorded benchmark runs were drawn."""
    from stof_trt.masks import grid_drawn

    spec = grid_drawn(parse_mask("bigbird:block=16,window=0,global=0,random=0.3,seed=4"))
    assert str(spec).endswith(",draw=grid") and str(parse_mask(str(spec))) == str(spec)
    want = np.random.default_rng(4).random((7, 7)) < 0.3
    assert np.array_equal(spec.layout(100, 100) & ~np.eye(7, dtype=bool), want & ~np.eye(7, dtype=bool))


@pytest.mark.parametrize("spec, words", [
    ("sliding:window=99999999999", "window=99999999999 is out of range"),
    ("global:tokens=1;99999999999", "a token of tokens= is out of range"),
    ("sliding:window=abc", "bad value 'abc' for 'window'"),
])
def test_spec_errors_are_value_errors_with_their_own_message(spec, words):
    """StofError is a ValueError (API callers catch bad arguments that way); an out-of-range value keeps its own
    message rather than the generic "bad value" one."""
    with pytest.raises(ValueError) as e:
        parse_mask(spec)
    assert isinstance(e.value, MaskSpecError) and words in str(e.value), str(e.value)
