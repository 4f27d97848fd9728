"""First-use timing on the GPU (stof_attn_select with STOF_SELECT_TIME): the timed choice is no slower than the
pre-search's first choice within noise, lands in the tactic cache file, and a second layout handle reads it back
as a cache hit; timing runs on scratch output (the caller's tensors are unchanged); no timing while a CUDA graph
is being captured or with STOF_FIRST_USE_TIMING=0."""
from __future__ import annotations

import json

import numpy as np

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from _gpu_helpers import TOL, reference  # noqa: E402

from stof_trt import tactic_cache as tc  # noqa: E402
from stof_trt.format import compile_mask  # noqa: E402
from stof_trt.kernels import FAMILY_HOPPER, DeviceLayout, select_tactic, sparse_attention, tactic_info  # noqa: E402
from stof_trt.masks import parse_mask  # noqa: E402


def _qkv(B, H, S, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, device="cuda", dtype=torch.float16) for _ in range(3)]


def _median_ms(fn, reps=30):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    fn()
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(start, end))[reps // 2]


def test_timed_choice_is_fast_cached_and_read_back(tmp_path):
    B, H, S, D = 8, 12, 4096, 64
    layout = compile_mask(parse_mask("causal"), S, S)
    q, k, v = _qkv(B, H, S, D)
    dl = DeviceLayout(layout)
    pre, src = select_tactic(q, k, v, dl)
    assert src == "presearch"
    path = tmp_path / "cache.json"
    tactic, src = select_tactic(q, k, v, dl, tactic_cache=path, timing=True)
    assert src == "timed"
    # the file holds the choice under the library's key, with the candidates it timed (the pre-search's first)
    doc = json.loads(path.read_text())
    [entry] = doc["entries"]
    name, cc = tc.gpu_identity()
    assert (entry["gpu"], entry["cc"], entry["mask"], entry["tactic"], entry["source"]) == (
        name, cc, layout.signature(), tactic, "timed")
    assert entry["bucket"] == tc.shape_bucket(B, S, S) and str(pre) in entry["candidates"]
    assert 2 <= len(entry["candidates"]) <= 4
    # no slower than the pre-search's first choice, within noise (interleaved medians)
    out = torch.empty_like(q)
    times = {t: [] for t in {tactic, pre}}
    for _ in range(3):
        for t in times:
            times[t].append(_median_ms(lambda t=t: sparse_attention(q, k, v, dl, tactic=t, out=out)))
    assert min(times[tactic]) <= 1.05 * min(times[pre]), times
    # a second handle of the same problem: a cache hit, also after a fresh read of the file
    dl2 = DeviceLayout(layout)
    assert select_tactic(q, k, v, dl2, tactic_cache=path, timing=True) == (tactic, "cache")
    from stof_trt.kernels import load_tactic_cache

    assert load_tactic_cache(path) == 1
    assert select_tactic(q, k, v, DeviceLayout(layout), tactic_cache=path, timing=True) == (tactic, "cache")


def test_a_small_problem_times_every_tactic_near_the_first(tmp_path):
    """Below STOF_SELECT_TIME_SMALL_US predicted (a batch of one at a few hundred keys) the candidates are every
    valid tactic within STOF_SELECT_TIME_SMALL_RATIO of the first, not the shortlist of at most 4, and the timed
    choice is as fast as the pre-search's first choice, within noise."""
    B, H, S, D = 1, 12, 256, 64
    layout = compile_mask(parse_mask("full"), S, S)
    q, k, v = _qkv(B, H, S, D, seed=3)
    kpm = torch.ones(B, S, dtype=torch.int32, device="cuda")
    dl = DeviceLayout(layout)
    pre, _ = select_tactic(q, k, v, dl, key_padding_mask=kpm)
    path = tmp_path / "cache.json"
    tactic, src = select_tactic(q, k, v, dl, key_padding_mask=kpm, tactic_cache=path, timing=True)
    assert src == "timed"
    [entry] = json.loads(path.read_text())["entries"]
    assert len(entry["candidates"]) > 4 and str(pre) in entry["candidates"], entry["candidates"]
    out = torch.empty_like(q)
    times = {t: [] for t in {tactic, pre}}
    for _ in range(3):
        for t in times:
            times[t].append(_median_ms(lambda t=t: sparse_attention(q, k, v, dl, tactic=t, out=out,
                                                                    key_padding_mask=kpm)))
    assert min(times[tactic]) <= 1.05 * min(times[pre]), times


def test_timing_reads_the_inputs_only_and_the_output_is_right():
    B, H, S, D = 2, 4, 1536, 128
    layout = compile_mask(parse_mask("longformer:window=128,global=16"), S, S)
    q, k, v = _qkv(B, H, S, D, seed=1)
    copies = [t.clone() for t in (q, k, v)]
    dl = DeviceLayout(layout)
    # select_tactic hands the library q as the params' output pointer: a write there would show in q
    tactic, src = select_tactic(q, k, v, dl, timing=True)
    assert src == "timed"
    torch.cuda.synchronize()
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, k, v, dl, tactic=tactic, out=out)
    dense = torch.from_numpy(np.ascontiguousarray(layout.to_dense())).cuda().bool().reshape(-1, S, S)
    ref, _ = reference(q, k, v, dense, D ** -0.5)
    assert not out.isnan().any()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOL[torch.float16], err


def test_no_timing_during_capture_or_when_switched_off(monkeypatch):
    B, H, S, D = 2, 4, 1024, 64
    layout = compile_mask(parse_mask("sliding:window=128"), S, S)
    q, k, v = _qkv(B, H, S, D, seed=2)
    dl = DeviceLayout(layout)
    pre = select_tactic(q, k, v, dl)
    monkeypatch.setenv("STOF_FIRST_USE_TIMING", "0")
    assert select_tactic(q, k, v, dl, timing=True) == pre
    monkeypatch.delenv("STOF_FIRST_USE_TIMING")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(q)
    with torch.cuda.graph(graph, stream=s):
        assert select_tactic(q, k, v, dl, timing=True) == pre   # the pre-search's choice, not memoised
        sparse_attention(q, k, v, dl, tactic=pre[0], out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert select_tactic(q, k, v, dl, timing=True)[1] == "timed"


def test_packed_batches_rank_one_warpgroup_tactics_first():
    """With packed sequences the first choice without timing is a one-warpgroup Hopper tactic (the multi-warpgroup
    ones, in the cp.async form packed sequences run, measure 1.1-1.8x slower there; select.cc); the same problem
    unpadded, and with a key padding mask (whose words come with the warp-specialised tactics' step descriptors),
    keeps the pre-search's own first choice, a multi-warpgroup tactic at this size."""
    B, H, S, D = 8, 12, 1024, 64
    layout = compile_mask(parse_mask("full"), S, S)
    dl = DeviceLayout(layout)
    q, k, v = _qkv(B, H, S, D, seed=4)
    plain, src = select_tactic(q, k, v, dl)
    if tactic_info(plain).family != FAMILY_HOPPER:
        pytest.skip("no Hopper tactics on this GPU")
    assert src == "presearch" and tactic_info(plain).block_m > 64, plain
    lengths = [S] + [S // 4 + 97 * i for i in range(1, B)]
    kpm = (torch.arange(S, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]).to(torch.int32)
    padded, src = select_tactic(q, k, v, dl, key_padding_mask=kpm)
    assert src == "presearch" and padded == plain, (padded, plain)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    T = int(offsets[-1])
    qp, kp, vp = (torch.randn(T, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    packed, src = select_tactic(qp, kp, vp, dl, seq_offsets=offsets, max_seqlen=S)
    assert src == "presearch" and tactic_info(packed).family == FAMILY_HOPPER and tactic_info(packed).block_m == 64


def test_tune_times_packed_problems_under_their_own_key(tmp_path):
    """`stof tune`'s problem of a packed (t3hd) node: timed as packed sequences (seq_offsets, no padding mask, as the
    plugin runs it) and keyed as the library looks it up (``kpm0|packed``), so select_tactic with seq_offsets hits
    the entry, while the unpadded batch of the same sizes does not."""
    from stof_trt.kernels import list_tactics
    from stof_trt.nodes import AttentionNode
    from stof_trt.tune import Problem, time_tactics

    B, H, S, D = 4, 12, 256, 64
    layout = compile_mask(parse_mask("full"), S, S)
    node = AttentionNode("attn", "qkv", "qkv", "mask", None, D ** -0.5, layout, tokens=True)
    lengths = np.array([S, 200, 64, 130])
    kpm = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)
    problem = Problem(node, "float16", B, H, S, S, D, kpm, packed=True)
    gpu, cc = tc.gpu_identity()
    key = problem.key(gpu, cc)
    assert key.node.endswith("|kpm0|packed"), key.node
    offsets = torch.tensor(problem.seq_offsets(), device="cuda")
    assert offsets.tolist() == [0, *np.cumsum(lengths).tolist()]
    q = torch.randn(int(offsets[-1]), H, D, device="cuda", dtype=torch.float16)
    dl = DeviceLayout(layout)
    valid = list_tactics(q, q, q, dl, seq_offsets=offsets, max_seqlen=S)
    times = time_tactics(problem, valid[:3], reps=2)
    assert set(times) == set(valid[:3]) and all(t > 0 for t in times.values()), times
    first, _ = select_tactic(q, q, q, dl, seq_offsets=offsets, max_seqlen=S)
    pick = next(t for t in reversed(valid) if t != first)
    cache = tc.TacticCache()
    cache.put(key, pick, source="measured")
    path = cache.save(tmp_path / "cache.json")
    assert select_tactic(q, q, q, dl, seq_offsets=offsets, max_seqlen=S, tactic_cache=path) == (pick, "cache")
    qb, kb, vb = _qkv(B, H, S, D)
    assert select_tactic(qb, kb, vb, DeviceLayout(layout), tactic_cache=path)[1] != "cache"


def test_tune_times_grouped_query_problems_with_their_kv_heads(monkeypatch):
    """`stof tune` times a grouped-query problem with K/V of its own head count (as the plugin runs the node): the
    K/V tensors the timing launches have kv_heads heads."""
    from stof_trt import kernels
    from stof_trt.nodes import AttentionNode
    from stof_trt.tune import Problem, time_tactics

    B, H, KV, S, D = 2, 8, 2, 256, 64
    layout = compile_mask(parse_mask("causal"), S, S)
    node = AttentionNode("attn", "q", "k", None, None, D ** -0.5, layout)
    problem = Problem(node, "float16", B, H, S, S, D, None, kv_heads=KV)
    seen = []
    run = kernels.sparse_attention

    def spy(q, k, v, *args, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return run(q, k, v, *args, **kw)

    monkeypatch.setattr(kernels, "sparse_attention", spy)
    q, k, v = (torch.empty(B, h, S, D, device="cuda", dtype=torch.float16) for h in (H, KV, KV))
    valid = kernels.list_tactics(q, k, v, DeviceLayout(layout))
    times = time_tactics(problem, valid[:2], reps=2, launches=2)
    assert set(times) == set(valid[:2]) and all(t > 0 for t in times.values()), times
    assert seen and set(seen) == {((B, H, S, D), (B, KV, S, D), (B, KV, S, D))}, set(seen)
