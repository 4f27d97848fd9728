"""The host layer of libstof_kernels without a GPU: layout handles (checks with their messages, signature), the
tactic-cache reader (the file stof_trt.tactic_cache writes) and stof_attn_select's cache, pre-search and default
paths.  Runs wherever libstof_kernels.so is built; skips otherwise."""
from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

import numpy as np
import pytest

from stof_trt import presearch as ps
from stof_trt import tactic_cache as tc
from stof_trt.format import STOF_FORMAT_VERSION, compile_mask

GPU = ("NVIDIA H100 80GB HBM3", "9.0")


def _layout(**over):
    """causal 128x128 on 64x64 tiles: rows [0], [0, 1]; one bitmap per diagonal tile (version 1 shape)."""
    base = compile_mask("causal", 128, 128)
    d = dict(row_ptr=base.row_ptr, col_idx=base.col_idx, tile_bitmap_index=base.tile_bitmap_index,
             bitmaps=base.bitmaps, tile_m=64, tile_n=64, num_layouts=1, seq_q=128, seq_k=128)
    d.update(over)
    return SimpleNamespace(**{k: np.asarray(v, np.int32) if k in ("row_ptr", "col_idx", "tile_bitmap_index",
                                                                   "bitmaps") else v for k, v in d.items()})


def _fails(kernels, layout, *words):
    with pytest.raises(kernels.StofKernelError) as ei:
        kernels.DeviceLayout(layout, device="cpu")
    assert ei.value.status == 1                                              # INVALID_ARGUMENT
    for w in words:
        assert w in str(ei.value), str(ei.value)
    return str(ei.value)


def test_layout_faults_have_messages(kernels):
    base = compile_mask("causal", 128, 128)
    P = base.bitmaps.shape[0]
    _fails(kernels, _layout(row_ptr=[1, 1, 3]), "row_ptr[0] = 1")
    _fails(kernels, _layout(row_ptr=[0, 3, 2]), "row_ptr decreases at 1")
    _fails(kernels, _layout(row_ptr=[0, 100, 2]), "row_ptr decreases at 1")  # checked before any row is read
    _fails(kernels, _layout(row_ptr=[0, 1, 4]), "row_ptr[-1] = 4", "col_idx has 3")
    _fails(kernels, _layout(row_ptr=[0, 1, 2, 3]), "row_ptr has 4 entries", "= 3")
    _fails(kernels, _layout(col_idx=[0, 0, 2]), "col_idx[2] = 2 outside [0, 2)")
    _fails(kernels, _layout(col_idx=[0, -1, 1]), "col_idx[1] = -1")
    _fails(kernels, _layout(col_idx=[0, 1, 0]), "not strictly ascending in tile row 1")
    _fails(kernels, _layout(tile_bitmap_index=[0, -1, P]), f"tile_bitmap_index[2] = {P} outside [-1, {P})")
    _fails(kernels, _layout(tile_bitmap_index=[0, -2, 1]), "tile_bitmap_index[1] = -2")
    _fails(kernels, _layout(tile_bitmap_index=[0, -1]), "must be equal non-empty vectors")
    _fails(kernels, _layout(bitmaps=np.zeros(100, np.int32)), "bitmaps hold 100 int32")
    _fails(kernels, _layout(tile_m=40), "tile_m 40")
    _fails(kernels, _layout(tile_n=48), "tile_n 48")
    _fails(kernels, _layout(num_layouts=0, row_ptr=[0]), "num_layouts 0")
    _fails(kernels, _layout(seq_k=0), "seq_q 128 and seq_k 0")
    dl = kernels.DeviceLayout(_layout(), device="cpu")                       # and a good one clears the message
    assert kernels.load_library().stof_last_error_message() == b""
    assert dl.num_bitmaps == P and dl.device is None


def test_layout_desc_checks(kernels):
    """The C entry point itself: NULL pointers, lengths and format versions."""
    lib = kernels.load_library()
    base = compile_mask("causal", 128, 128)
    arrays = [np.ascontiguousarray(a, np.int32).ravel() for a in (base.row_ptr, base.col_idx,
                                                                   base.tile_bitmap_index, base.bitmaps)]
    i32p = ctypes.POINTER(ctypes.c_int32)

    def desc(version=0, null=None):
        d = kernels._LayoutDesc()
        for name, a in zip(("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"), arrays):
            setattr(d, name, None if name == null else a.ctypes.data_as(i32p))
            setattr(d, name + "_len", a.size)
        d.tile_m = d.tile_n = 64
        d.num_layouts, d.seq_q, d.seq_k, d.format_version = 1, 128, 128, version
        return d

    h = ctypes.c_void_p()
    for version in (0, 1, STOF_FORMAT_VERSION):
        assert lib.stof_layout_create(ctypes.byref(desc(version)), ctypes.byref(h)) == 0
        lib.stof_layout_destroy(h)
    assert lib.stof_layout_create(ctypes.byref(desc(STOF_FORMAT_VERSION + 1)), ctypes.byref(h)) == 1
    assert b"format_version" in lib.stof_last_error_message() and h.value is None
    assert lib.stof_layout_create(ctypes.byref(desc(null="bitmaps")), ctypes.byref(h)) == 1
    assert b"NULL" in lib.stof_last_error_message()
    assert lib.stof_layout_create(None, ctypes.byref(h)) == 1
    assert lib.stof_layout_create(ctypes.byref(desc()), None) == 1
    lib.stof_layout_destroy(None)                                            # a no-op
    assert lib.stof_layout_upload(None, None) == 1
    info = kernels._LayoutInfo()
    assert lib.stof_layout_info(None, ctypes.byref(info)) == 1


def test_signature_and_info(kernels):
    for spec, S, H in (("causal", 1000, 1), ("longformer:window=128,global=16", 2048, 1),
                       ("bigbird:block=32,window=1,global=1,random=0.2,seed=3,per_head=1", 512, 3)):
        lay = compile_mask(spec, S, S, num_heads=H)
        for variant in (lay, lay.unshared()):
            dl = kernels.DeviceLayout(variant, device="cpu")
            assert dl.signature == variant.signature()
            assert (dl.tile_m, dl.tile_n, dl.num_layouts, dl.seq_q, dl.seq_k) == (
                variant.tile_m, variant.tile_n, variant.num_layouts, variant.seq_q, variant.seq_k)
            assert dl.num_bitmaps == variant.bitmaps.shape[0]
            assert dl.sched_chunk == variant.sched_chunk()


def test_shape_bucket_matches_python(kernels):
    rng = np.random.default_rng(0)
    for b, sq, sk in [(1, 1, 1), (3, 100, 1000), (8, 4096, 4096), (9, 65, 64)] + \
            [tuple(int(x) for x in rng.integers(1, 70000, 3)) for _ in range(50)]:
        assert kernels.shape_bucket(b, sq, sk) == tc.shape_bucket(b, sq, sk)
    with pytest.raises(kernels.StofKernelError):
        kernels.shape_bucket(0, 1, 1)


def _problem(kernels, spec="longformer:window=128,global=16", S=1024, B=2, H=4, D=64, kpm=False):
    torch = pytest.importorskip("torch")
    layout = compile_mask(spec, S, S)
    dl = kernels.DeviceLayout(layout, device="cpu")
    q = torch.zeros(B, H, S, D, dtype=torch.float16)                        # host memory: select launches nothing
    mask = torch.ones(B, S, dtype=torch.int32) if kpm else None
    return layout, dl, q, mask


def _key(layout, *, B, H, D, S, kpm=False, gpu=GPU):
    return tc.CacheKey(gpu[0], gpu[1], tc.node_signature("float16", H, D, layout.tile_m, layout.tile_n,
                                                         layout.num_layouts, layout.seq_q, layout.seq_k, kpm),
                       tc.shape_bucket(B, S, S), layout.signature())


def test_select_presearch_and_default(kernels):
    layout, dl, q, _ = _problem(kernels)
    dev = kernels.device_desc(name=GPU[0], cc=GPU[1])
    valid = kernels.list_tactics(q, q, q, dl)
    want = next(t for t, _ in ps.rank(layout, batch=2, heads=4, head_dim=64, seq_q=1024, seq_k=1024,
                                      gpu=ps.H100_SXM) if t in valid)
    assert kernels.select_tactic(q, q, q, dl, device=dev) == (want, "presearch")
    assert kernels.select_tactic(q, q, q, dl, device=dev, presearch=False) == (valid[0], "default")
    # head dim 96: no tensor-core tactic, an UNSUPPORTED status (the ORT operator then runs its general kernel)
    q96 = q.new_zeros(2, 4, 1024, 96)
    with pytest.raises(kernels.StofKernelError) as ei:
        kernels.select_tactic(q96, q96, q96, dl, device=dev)
    assert ei.value.status == 2


def test_select_cache_hit_and_misses(kernels, tmp_path):
    layout, dl, q, mask = _problem(kernels, kpm=True)
    dev = kernels.device_desc(name=GPU[0], cc=GPU[1])
    valid = kernels.list_tactics(q, q, q, dl)
    pre, src = kernels.select_tactic(q, q, q, dl, device=dev)
    assert src == "presearch"
    pick = next(t for t in reversed(valid) if t != pre)                      # a valid tactic the pre-search skips
    cache = tc.TacticCache()
    cache.put(_key(layout, B=2, H=4, D=64, S=1024), pick, source="measured")
    cache.put(_key(layout, B=2, H=4, D=64, S=1024, kpm=True), valid[0], source="measured")
    path = cache.save(tmp_path / "cache.json")                              # the Python writer's file
    assert kernels.load_tactic_cache(path) == 2
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=path) == (pick, "cache")
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=path, key_padding_mask=mask) == (
        valid[0], "cache")                                                   # kpm is part of the node key
    other = kernels.device_desc(name="NVIDIA A100-SXM4-80GB", cc="8.0")     # another GPU: no entry
    assert kernels.select_tactic(q, q, q, dl, device=other, tactic_cache=path)[1] == "presearch"
    q2 = q.new_zeros(2, 4, 512, 64)                                          # another shape bucket
    assert kernels.select_tactic(q2, q2, q2, dl, device=dev, tactic_cache=path)[1] == "presearch"
    # an entry this build cannot run here (an unknown id) is skipped for the pre-search
    cache.put(_key(layout, B=2, H=4, D=64, S=1024), 999, source="measured")
    cache.save(path)
    assert kernels.load_tactic_cache(path) == 2                              # a re-read file gets new choices
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=path) == (pre, "presearch")


def test_select_with_bad_cache(kernels, tmp_path):
    _, dl, q, _ = _problem(kernels)
    dev = kernels.device_desc(name=GPU[0], cc=GPU[1])
    bad = tmp_path / "bad.json"
    for text, words in [('{"format": "stof-tactic-cache", "version": 1, "entries": [ {"gpu": 1} ]}', "bad"),
                        ('{"format": "other", "version": 1, "entries": []}', "format"),
                        ('{"format": "stof-tactic-cache", "version": 2, "entries": []}', "version"),
                        ('{"format": "stof-tactic-cache", "version": 1, "entries": [', "malformed JSON")]:
        bad.write_text(text)
        with pytest.raises(kernels.StofKernelError) as ei:
            kernels.load_tactic_cache(bad)
        assert "tactic cache" in str(ei.value) and words in str(ei.value), str(ei.value)
    with pytest.raises(kernels.StofKernelError, match="cannot be read"):
        kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"format": "stof-tactic-cache", "version": 1, "entries": []}))
    assert kernels.load_tactic_cache(good) == 0
    assert kernels.select_tactic(q, q, q, dl, device=dev, tactic_cache=good)[1] == "presearch"


def test_run_needs_device_data(kernels):
    """A layout handle that is not uploaded validates, lists and selects, but does not run."""
    torch = pytest.importorskip("torch")
    _, dl, q, _ = _problem(kernels)
    lib = kernels.load_library()
    p = kernels._make_params(q, q, q, q, dl, None, None, None, True)
    assert lib.stof_attn_validate(ctypes.byref(p)) == 0
    assert lib.stof_attn_run(ctypes.byref(p), 0, None) == 1
    assert b"stof_layout_upload" in lib.stof_last_error_message()
    p.layout = None
    assert lib.stof_attn_validate(ctypes.byref(p)) == 1
    assert b"layout is NULL" in lib.stof_last_error_message()
    del torch


def test_select_from_threads(kernels, tmp_path):
    """One layout handle, selections from several threads (ctypes releases the GIL): the same choices as one
    thread makes, memo and cache table shared."""
    from concurrent.futures import ThreadPoolExecutor

    layout, dl, q, _ = _problem(kernels)
    dev = kernels.device_desc(name=GPU[0], cc=GPU[1])
    cache = tc.TacticCache()
    cache.put(_key(layout, B=2, H=4, D=64, S=1024), kernels.list_tactics(q, q, q, dl)[-1])
    path = cache.save(tmp_path / "cache.json")
    shapes = [(b, s) for b in (1, 2, 3, 4) for s in (256, 512, 1000, 1024)]
    qs = {(b, s): q.new_zeros(b, 4, s, 64) for b, s in shapes}
    fresh = kernels.DeviceLayout(layout, device="cpu")                       # a handle with an empty memo

    def pick(handle, shape):
        t = qs[shape]
        return kernels.select_tactic(t, t, t, handle, device=dev, tactic_cache=path)

    want = {sh: pick(dl, sh) for sh in shapes}
    assert want[(2, 1024)][1] == "cache" and {w[1] for w in want.values()} == {"cache", "presearch"}
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: (shapes[i % len(shapes)], pick(fresh, shapes[i % len(shapes)])), range(400)))
    assert all(want[sh] == r for sh, r in got)


@pytest.mark.parametrize("kv_heads, ok", [(0, True), (4, True), (2, True), (1, True), (3, False), (-1, False),
                                          (8, False)])
def test_kv_heads_validation(kernels, kv_heads, ok):
    """Grouped-query attention: kv_heads 0 or a divisor of H validates; anything else is INVALID_ARGUMENT."""
    _, dl, q, _ = _problem(kernels)                                          # H = 4
    lib = kernels.load_library()
    p = kernels._make_params(q, q, q, q, dl, None, None, None, True)
    p.kv_heads = kv_heads
    if ok:
        assert lib.stof_attn_validate(ctypes.byref(p)) == 0
    else:
        assert lib.stof_attn_validate(ctypes.byref(p)) == 1
        assert b"kv_heads" in lib.stof_last_error_message()


def test_grouped_kv_from_tensor_shapes(kernels):
    """The binding derives kv_heads from K's heads; K and V with different head counts are refused before the
    library sees them."""
    torch = pytest.importorskip("torch")
    _, dl, q, _ = _problem(kernels)
    kv = torch.zeros(2, 2, 1024, 64, dtype=torch.float16)
    p = kernels._make_params(q, kv, kv, q, dl, None, None, None, True)
    assert p.kv_heads == 2 and p.k_stride_b == 2 * 1024 * 64
    assert kernels._make_params(q, q, q, q, dl, None, None, None, True).kv_heads == 0
    with pytest.raises(ValueError, match="same number of heads"):
        kernels._make_params(q, kv, q, q, dl, None, None, None, True)
    with pytest.raises(kernels.StofKernelError, match="kv_heads 3"):
        kernels.list_tactics(q, kv[:, :1].expand(2, 3, 1024, 64), kv[:, :1].expand(2, 3, 1024, 64), dl)
