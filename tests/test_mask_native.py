"""The host layer's mask-spec compiler (plugins_cu/src/host/mask_spec.cc, ``stof_mask_compile`` in libstof_host)
against stof_trt.format.compile_mask: the same four arrays, byte for byte, over specs x lengths x tile shapes
(lengths that are not tile multiples, 1, 17, 100, 4099; random specs through hypothesis), what it refuses and
why, and its speed on band-like masks at millions of tokens.  Runs on the CPU with libstof_host (every install
with a C++ compiler builds it) or libstof_kernels."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stof_trt.errors import MaskSpecError
from stof_trt.format import compile_mask
from stof_trt.masks import closed_form, parse_mask

native = pytest.importorskip("stof_trt.native_masks")

try:
    native.native_library()
except RuntimeError as e:  # a pure-Python install: nothing to compare
    pytest.skip(str(e), allow_module_level=True)

SPECS = [
    "full", "causal", "causal:offset=3", "causal:offset=-5", "causal:offset=100000",
    "sliding:window=16", "sliding:window=0", "sliding:left=5,right=70", "sliding:window=9,causal=1",
    "sliding:left=0,right=33", "dilated:window=40,dilation=3", "dilated:window=100,dilation=1",
    "dilated:window=64,dilation=4,causal=1", "dilated:left=7,right=90,dilation=10**3".replace("10**3", "1000"),
    "global:n=5", "global:n=0", "global:n=1000000", "global:tokens=3;70;200", "global:tokens=",
    "global:tokens=64;63;64;4098", "global:tokens=+5; 7", "longformer:window=4,tokens=+1", "longformer:window=20,global=3", "longformer:window=7,tokens=1;99",
    "longformer:window=256,global=32", "longformer:window=3",
    "bigbird:block=32,window=1,global=1", "bigbird:block=16,window=2,global=3", "bigbird:block=100,window=0,global=0",
    "bigbird:block=64", "bigbird:block=48,window=1,global=2,random=0,seed=3,draw=grid",
    "causal&sliding:window=30", "(causal|global:n=2)&sliding:window=50", "full&dilated:window=500,dilation=7",
    "causal|sliding:window=3", "(sliding:window=40&dilated:window=100,dilation=2)|global:tokens=0;5",
    "((causal))", " Sliding : window = 12 ", "causal&global:n=3&sliding:left=20,right=4",
    "bigbird:block=16,window=1,global=1&causal", "sliding:window=10|sliding:window=30&causal",
]
LENGTHS = [1, 17, 64, 100, 257]
TILES = [(64, 64), (32, 32), (128, 64), (16, 128), (64, 256)]


def assert_same(spec: str, sq: int, sk: int, tm: int, tn: int, num_layouts: int = 1):
    ref = compile_mask(spec, sq, sk, tile_m=tm, tile_n=tn, num_heads=num_layouts)
    got = native.compile_spec(spec, sq, sk, tile_m=tm, tile_n=tn, num_layouts=ref.num_layouts)
    assert (got.seq_q, got.seq_k, got.tile_m, got.tile_n, got.num_layouts) == (sq, sk, tm, tn, ref.num_layouts)
    for name, a in ref.arrays().items():
        b = got.arrays()[name]
        assert a.dtype == b.dtype == np.int32 and a.shape == b.shape, (spec, sq, sk, tm, tn, name, a.shape, b.shape)
        assert np.array_equal(a, b), (spec, sq, sk, tm, tn, name)
    assert got.signature() == ref.signature()


@pytest.mark.parametrize("spec", SPECS)
def test_equal_to_compile_mask(spec):
    for s in LENGTHS:
        for tm, tn in TILES:
            assert_same(spec, s, s, tm, tn)
            assert_same(spec, s, s + 29, tm, tn)   # seq_k != seq_q, not a tile multiple


@pytest.mark.parametrize("spec", ["causal", "sliding:window=100", "longformer:window=64,global=8",
                                  "dilated:window=96,dilation=3", "bigbird:block=32,window=1,global=2",
                                  "global:tokens=0;4098"])
@pytest.mark.parametrize("seq", [4096, 4099])
def test_equal_at_4k(spec, seq):
    for tm, tn in [(64, 64), (128, 128), (64, 32)]:
        assert_same(spec, seq, seq, tm, tn)


def test_num_layouts_repeat_the_pattern():
    """Closed-form specs are one pattern for every head: num_layouts copies (as compile_mask of a per-head
    BigBird without random blocks)."""
    assert_same("bigbird:block=32,window=1,global=1,per_head=1", 200, 200, 64, 64, num_layouts=4)
    one = native.compile_spec("longformer:window=20,global=2", 150, tile_m=32, tile_n=32)
    three = native.compile_spec("longformer:window=20,global=2", 150, tile_m=32, tile_n=32, num_layouts=3)
    assert np.array_equal(three.to_dense(), np.repeat(one.to_dense(), 3, axis=0))
    assert np.array_equal(three.bitmaps, one.bitmaps)


@st.composite
def specs(draw, depth=0):
    atoms = [
        lambda: "full",
        lambda: f"causal:offset={draw(st.integers(-80, 80))}",
        lambda: f"sliding:left={draw(st.integers(0, 150))},right={draw(st.integers(0, 150))}",
        lambda: f"dilated:window={draw(st.integers(0, 200))},dilation={draw(st.integers(1, 9))}"
                + (",causal=1" if draw(st.booleans()) else ""),
        lambda: f"global:n={draw(st.integers(0, 90))}",
        lambda: "global:tokens=" + ";".join(str(t) for t in draw(st.lists(st.integers(0, 300), max_size=5))),
        lambda: f"longformer:window={draw(st.integers(0, 70))},global={draw(st.integers(0, 40))}",
        lambda: f"bigbird:block={draw(st.sampled_from([8, 16, 24, 32, 64, 100]))},window={draw(st.integers(0, 2))},"
                f"global={draw(st.integers(0, 2))}",
    ]
    if depth < 2 and draw(st.integers(0, 2)) == 0:
        parts = draw(st.lists(specs(depth + 1), min_size=2, max_size=3))
        op = draw(st.sampled_from("|&"))
        return "(" + op.join(parts) + ")"
    return atoms[draw(st.integers(0, len(atoms) - 1))]()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), st.integers(1, 300), st.integers(1, 300), st.sampled_from(TILES + [(48, 96), (256, 32)]))
def test_random_specs(spec, sq, sk, tile):
    assert_same(spec, sq, sk, *tile)


@pytest.mark.parametrize("spec", SPECS + ["bigbird:block=64,random=0.2", "npy:/nonexistent.npy",
                                          "causal|npy:'a|b.npy'", "blocks:x.npy,block=64"])
def test_check_agrees_with_closed_form(spec):
    """The rewrite writes a node's layout_spec when masks.closed_form says so: the host layer accepts exactly
    those (and the canonical spelling str(spec) it writes)."""
    try:
        parsed = parse_mask(spec)
    except MaskSpecError:   # npy:/blocks: files that do not exist: the host layer refuses them too
        assert native.check_spec(spec)[0] != 0
        return
    st_raw, _ = native.check_spec(spec)
    st_canon, msg = native.check_spec(str(parsed))
    assert (st_canon == 0) == closed_form(parsed), msg
    assert (st_raw == 0) == closed_form(parsed)


@pytest.mark.parametrize("spec, status, words", [
    ("npy:mask.npy", native.STATUS_UNSUPPORTED, "fixed-size"),
    ("blocks:lay.npy,block=64", native.STATUS_UNSUPPORTED, "fixed-size"),
    ("bigbird:block=64,random=0.25,seed=1", native.STATUS_UNSUPPORTED, "random blocks"),
    ("causal|bigbird:random=0.5", native.STATUS_UNSUPPORTED, "random blocks"),
    ("", native.STATUS_INVALID_ARGUMENT, "empty mask spec"),
    ("wavy:x=1", native.STATUS_INVALID_ARGUMENT, "unknown mask 'wavy'"),
    ("sliding", native.STATUS_INVALID_ARGUMENT, "needs 'window=...'"),
    ("sliding:window=-1", native.STATUS_INVALID_ARGUMENT, "must be >= 0"),
    ("sliding:window=3,left=2", native.STATUS_INVALID_ARGUMENT, "not both"),
    ("sliding:window=x", native.STATUS_INVALID_ARGUMENT, "bad value 'x'"),
    ("sliding:window=3,", native.STATUS_INVALID_ARGUMENT, "expected key=value"),
    ("sliding:size=3", native.STATUS_INVALID_ARGUMENT, "unknown argument 'size'"),
    ("causal:offset=99999999999", native.STATUS_INVALID_ARGUMENT, "out of range"),
    ("dilated:window=4,dilation=0", native.STATUS_INVALID_ARGUMENT, "dilation must be >= 1"),
    ("global:n=3,tokens=1", native.STATUS_INVALID_ARGUMENT, "exactly one of"),
    ("global:n=-3", native.STATUS_INVALID_ARGUMENT, "is negative"),
    ("sliding:window=2,window=300", native.STATUS_INVALID_ARGUMENT, "given twice"),
    ("global:tokens=1; ;2", native.STATUS_INVALID_ARGUMENT, "bad value"),
    ("longformer:window=4,global=-1", native.STATUS_INVALID_ARGUMENT, "is negative"),
    ("global:tokens=1;\u0663", native.STATUS_INVALID_ARGUMENT, "bad value"),
    ("global:tokens=1;-2", native.STATUS_INVALID_ARGUMENT, ">= 0"),
    ("global:tokens=1;99999999999", native.STATUS_INVALID_ARGUMENT, "out of range"),
    ("longformer:global=3", native.STATUS_INVALID_ARGUMENT, "needs 'window=...'"),
    ("longformer:window=3,global=1,tokens=2", native.STATUS_INVALID_ARGUMENT, "not both"),
    ("bigbird:block=0", native.STATUS_INVALID_ARGUMENT, "block must be >= 1"),
    ("bigbird:draw=diag", native.STATUS_INVALID_ARGUMENT, "draw must be"),
    ("bigbird:seed=-1", native.STATUS_INVALID_ARGUMENT, "seed >= 0"),
    ("bigbird:random=nan", native.STATUS_INVALID_ARGUMENT, "0 <= random <= 1"),
    ("(causal", native.STATUS_INVALID_ARGUMENT, "unbalanced '('"),
    ("causal)", native.STATUS_INVALID_ARGUMENT, "unbalanced ')'"),
    ("causal|'x", native.STATUS_INVALID_ARGUMENT, "unclosed quote"),
    ("causal|", native.STATUS_INVALID_ARGUMENT, "empty mask spec"),
    ("full:x=1", native.STATUS_INVALID_ARGUMENT, "unknown argument 'x'"),
    ("(" * 70 + "causal" + ")" * 70, native.STATUS_INVALID_ARGUMENT, "deeper than 64"),
    ("(" * 5000 + "causal" + ")" * 5000, native.STATUS_INVALID_ARGUMENT, "deeper than 64"),
])
def test_refusals(spec, status, words):
    """What the host layer cannot build per length, or cannot read: an error status and one line naming it
    (the parse errors word for word as stof_trt.masks says them where Python refuses too)."""
    st_, msg = native.check_spec(spec)
    assert st_ == status and words in msg and "\n" not in msg, (spec, st_, msg)
    with pytest.raises(MaskSpecError, match=None) as e:
        native.compile_spec(spec, 128)
    assert e.value.status == status and words in str(e.value)
    if status == native.STATUS_INVALID_ARGUMENT and not spec.startswith("(" * 70):
        with pytest.raises(MaskSpecError) as py:
            parse_mask(spec)
        assert str(py.value) == msg


@pytest.mark.parametrize("args, words", [
    (("causal", 0, 5), "positive"), (("causal", 5, -1), "positive"),
    (("causal", 64, 64, 8, 64), "tile_m"), (("causal", 64, 64, 64, 48), "tile_n"),
    (("causal", 64, 64, 64, 64, 0), "num_layouts"),
])
def test_size_refusals(args, words):
    spec, sq, sk, *rest = args
    kw = dict(zip(("tile_m", "tile_n", "num_layouts"), rest))
    with pytest.raises(MaskSpecError) as e:
        native.compile_spec(spec, sq, sk, **kw)
    assert words in str(e.value) and e.value.status == native.STATUS_INVALID_ARGUMENT


def test_stored_tile_limit_refused_before_work():
    """A mask that may store more tiles than the limit is refused at once, whatever the grid: causal and dense at
    2^31 - 1 tokens, and a small limit passed by the caller (the plugin bounds what a run-time length builds)."""
    for spec in ("causal", "full", "global:n=2147483647", "sliding:window=2147483647"):
        t = time.perf_counter()
        with pytest.raises(MaskSpecError, match="may store more than"):
            native.compile_spec(spec, 2**31 - 1)
        assert time.perf_counter() - t < 2.0
    with pytest.raises(MaskSpecError, match="more than 1000 tiles"):
        native.compile_spec("causal", 64 * 50, max_tiles=1000)
    assert native.compile_spec("causal", 64 * 40, max_tiles=1000).nnz == 40 * 41 // 2


@pytest.mark.parametrize("spec", ["sliding:window=128", "longformer:window=256,global=32",
                                  "dilated:window=128,dilation=2", "bigbird:block=64,window=1,global=1"])
def test_band_at_4m_tokens_is_fast(spec):
    """Work follows the stored tiles: a band at 2^22 tokens (a 65536 x 65536 tile grid) compiles in well under a
    second, and its rows hold what the band reaches."""
    t = time.perf_counter()
    lay = native.compile_spec(spec, 1 << 22)
    assert time.perf_counter() - t < 2.0
    counts = np.diff(lay.row_ptr)
    assert lay.Tq == 65536 and counts.max() <= 65536 and np.median(counts) <= 11
