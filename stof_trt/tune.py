"""Measured tactic selection (the second search stage) for the StofSparseAttention nodes of a rewritten model.

For each set of input shapes the model is run once on the CUDA EP (with libstof_ort) to learn each attention
node's run-time problem -- q/k shapes and the key-padding mask actually fed -- without copying q/k/v to the host
(IO binding keeps them on the GPU).  Nodes with the same cache key (e.g. the 12 layers of BERT share dtype, heads,
head dim, layout and shapes) are timed once: the pre-search shortlist (stof_trt.presearch) through the kernels'
C ABI (stof_trt.kernels) with CUDA events, median of several repetitions.  The fastest goes into the tactic cache
with the pre-search's first choice and its time, so the gain of measuring over the analytical ranking is on
record.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from .errors import StofError
from .nodes import AttentionNode, attention_nodes, view_rows
from .tactic_cache import CacheKey, TacticCache, gpu_identity, node_signature, shape_bucket

__all__ = ["probe_problems", "Problem", "time_tactics", "tune_model", "TuneResult", "TargetGpu", "target_gpu"]


@dataclass
class Problem:
    """One attention node's run-time problem, as the plugin will see it."""

    node: AttentionNode
    dtype: str        # ONNX name: float16 / bfloat16 / float
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    key_padding_mask: np.ndarray | None
    # packed sequences (qkv_format t3hd): the plugin runs them with seq_offsets (sequence b: the mask's row b's
    # real tokens) and no padding mask
    packed: bool = False
    kv_heads: int = 0  # K/V heads (grouped-query attention when below heads); 0: heads

    def seq_offsets(self) -> np.ndarray:
        """int32 [B+1]: where each packed sequence starts (its length: the real tokens of its mask row)."""
        lengths = np.count_nonzero(self.key_padding_mask, axis=1)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    def key(self, gpu: str, cc: str) -> CacheKey:
        lay = self.node.layout
        sig = node_signature(self.dtype, self.heads, self.head_dim, lay.tile_m, lay.tile_n, lay.num_layouts,
                             lay.seq_q, lay.seq_k, self.key_padding_mask is not None and not self.packed,
                             packed=self.packed)
        return CacheKey(gpu, cc, sig, shape_bucket(self.batch, self.seq_q, self.seq_k), lay.signature())


@dataclass(frozen=True)
class TargetGpu:
    """A GPU named by the user instead of read from a device (``stof tune --presearch-only --gpu``): the cache key's
    identity, the pre-search's properties for it and, from a profile, its fitted constants."""

    name: str
    cc: str
    props: object              # presearch.GpuProps
    coef: dict | None = None   # {(tactic, head_dim): (a, b, c, d)}


def probe_problems(model, feeds: dict, sess_kwargs: dict | None = None, *, cpu: bool = False) -> list[Problem]:
    """Run the model once on the CUDA EP with extra outputs (q, k, key padding of each attention node) bound on
    the device, and read their shapes (and the small padding masks). ``cpu``: on the CPU EP instead (the STOF
    nodes run as their ONNX functions; the shapes are the same)."""
    import copy

    import onnx
    import onnxruntime as ort

    from . import ort as sort

    nodes = attention_nodes(model)
    if not nodes:
        return []
    m = copy.deepcopy(model)
    existing = {o.name for o in m.graph.output}
    dtype_of = _value_types(m)
    extra = []
    for nd in nodes:
        for name in (nd.query, nd.key, nd.key_padding_mask):
            if name and name not in existing and name not in extra:
                extra.append(name)
    for name in extra:
        m.graph.output.append(onnx.helper.make_tensor_value_info(name, dtype_of.get(name, 0), None))
    if cpu:
        sess = sort.session(m, providers="cpu", register=False)
        feeds = sort.with_token_capacity(sess, feeds)
        names = {i.name for i in sess.get_inputs()}
        try:
            outs = sess.run(None, {k: v for k, v in feeds.items() if k in names})
        except Exception as e:  # noqa: BLE001 - ORT's run errors (shapes the model refuses) are user errors here
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StofError(f"onnxruntime could not run the model on the CPU: {msg[:200]}") from None
        vals = {o.name: _HostValue(a) for o, a in zip(sess.get_outputs(), outs)}
        return _problems(nodes, vals)
    sess = sort.session(m, **(sess_kwargs or {}))
    feeds = sort.with_token_capacity(sess, feeds)
    binding = sess.io_binding()
    for i in sess.get_inputs():
        binding.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[i.name]),
                                                                            "cuda", 0))
    out_names = [o.name for o in sess.get_outputs()]
    for name in out_names:
        binding.bind_output(name, "cuda", 0)
    sess.run_with_iobinding(binding)
    vals = dict(zip(out_names, binding.get_outputs()))
    return _problems(nodes, vals)


class _HostValue:
    """A numpy output read through the few OrtValue methods _problems uses."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def shape(self):
        return list(self._a.shape)

    def data_type(self):
        return f"tensor({self._a.dtype.name})"

    def numpy(self):
        return self._a


def _problems(nodes, vals) -> list[Problem]:
    probs = []
    for nd in nodes:
        probs.extend(_grown(p) for p in _node_problems(nd, vals))
    return probs


def _grown(p: Problem) -> Problem:
    """Past the compiled length a node with a layout_spec runs the layout the plugin builds (AttentionNode.layout_at):
    the problem is timed and keyed on that one."""
    lay = p.node.layout_at(p.seq_q, p.seq_k)
    if lay is p.node.layout:
        return p
    return dataclasses.replace(p, node=dataclasses.replace(p.node, layout=lay))


def _node_problems(nd, vals) -> list[Problem]:
    q, k = vals[nd.query], vals[nd.key]
    qs, ks = q.shape(), k.shape()
    t = q.data_type()  # e.g. "tensor(float16)"
    dtype = t[t.index("(") + 1:-1] if "(" in t else t
    dtype = {"float32": "float"}.get(dtype, dtype)
    kpm = vals[nd.key_padding_mask].numpy() if nd.key_padding_mask else None
    if nd.tokens and kpm is not None:  # [T, 3, H, D]: the packed sequences of the mask [B, S]'s real tokens
        return [Problem(nd, dtype, kpm.shape[0], qs[2], kpm.shape[1], kpm.shape[1], qs[3], kpm, packed=True)]
    if nd.packed:  # [B, S, 3, H, D]
        return [Problem(nd, dtype, qs[0], qs[3], qs[1], qs[1], qs[4], kpm)]
    if nd.query_view is not None:  # windows of row tensors: Q [B, Sq, H·D], K/V [B, Sk, 2·Hkv·D]
        D = nd.query_view[3] // nd.num_heads
        return [Problem(nd, dtype, qs[0], nd.num_heads, view_rows(nd.query_view, qs[1]),
                        view_rows(nd.key_view, ks[1]), D, kpm, kv_heads=nd.key_view[3] // (2 * D))]
    if nd.kv and len(qs) == 3 and nd.num_heads > 0:  # query [B, Sq, H·D], key [B, Sk, 2, Hkv, D]
        return [Problem(nd, dtype, qs[0], nd.num_heads, qs[1], ks[1], qs[2] // nd.num_heads, kpm, kv_heads=ks[3])]
    if nd.kv:  # query [B, Sq, H, D], key [B, Sk, 2, Hkv, D]
        return [Problem(nd, dtype, qs[0], qs[2], qs[1], ks[1], qs[3], kpm, kv_heads=ks[3])]
    return [Problem(nd, dtype, qs[0], qs[1], qs[2], ks[2], qs[3], kpm, kv_heads=ks[1])]


def _value_types(model) -> dict:
    """Element types of named values where the model says (value_info, inputs, outputs, initializers);
    STOF node outputs and their q/k/v usually come from an onnx shape-inference pass."""
    import onnx

    types = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - shape inference is best effort here
        inferred = model
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in model.graph.initializer:
        types[t.name] = t.data_type
    # q/k of fp16 models: fall back to the dominant float initializer type
    floats = [t.data_type for t in model.graph.initializer if t.data_type in (1, 10, 16)]
    dominant = max(set(floats), key=floats.count) if floats else 1
    for n in model.graph.node:
        if n.op_type == "StofSparseAttention":
            for name in n.input[:3]:
                if name:
                    types.setdefault(name, dominant)
            types.setdefault(n.input[7] if len(n.input) > 7 else "", 6)
    types.pop("", None)
    return types


def time_tactics(problem: Problem, tactics: list[int], *, reps: int = 7, launches: int = 20,
                 seed: int = 0) -> dict[int, float]:
    """ms per launch of each tactic on this problem (random q/k/v, the probed padding), median of `reps`."""
    import torch

    from . import kernels

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(problem.dtype)
    if tdt is None:
        raise StofError(f"node '{problem.node.name}': dtype {problem.dtype} runs on the plugin's general kernel "
                        "(one tactic), nothing to tune")
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H, Sq, Sk, D = problem.batch, problem.heads, problem.seq_q, problem.seq_k, problem.head_dim
    Hkv = problem.kv_heads or H
    kpm = offsets = None
    if problem.packed:  # [T, H, D] with seq_offsets, as the plugin runs t3hd
        offsets_np = problem.seq_offsets()
        offsets = torch.as_tensor(offsets_np, device="cuda")
        shape_q = shape_k = (max(int(offsets_np[-1]), 1), H, D)
    else:
        shape_q, shape_k = (B, H, Sq, D), (B, Hkv, Sk, D)
        if problem.key_padding_mask is not None:
            kpm = torch.as_tensor(np.ascontiguousarray(problem.key_padding_mask, np.int32), device="cuda")
    q = torch.randn(shape_q, device="cuda", dtype=tdt, generator=g)
    k = torch.randn(shape_k, device="cuda", dtype=tdt, generator=g)
    v = torch.randn(shape_k, device="cuda", dtype=tdt, generator=g)
    out = torch.empty_like(q)
    dl = kernels.DeviceLayout(problem.node.layout, device="cuda")
    res = {}
    for t in tactics:
        def launch():
            kernels.sparse_attention(q, k, v, dl, scale=problem.node.scale, tactic=t, key_padding_mask=kpm, out=out,
                                     seq_offsets=offsets, max_seqlen=Sq if offsets is not None else None)

        launch()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(launches):
                launch()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / launches)
        res[t] = statistics.median(times)
    return res


@dataclass
class TuneResult:
    key: CacheKey
    nodes: list[str]
    presearch_tactic: int
    shortlist: list[int]
    times_ms: dict[int, float]
    best_tactic: int
    default_tactic: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def best_ms(self) -> float:
        return self.times_ms[self.best_tactic]

    @property
    def presearch_ms(self) -> float:
        return self.times_ms[self.presearch_tactic]

    @property
    def gain(self) -> float:
        """pre-search first choice time / measured best time (>= 1)."""
        return self.presearch_ms / self.best_ms if self.best_ms > 0 else math.nan


def tune_candidates(ranked: list[tuple[int, float]], *, k: int = 3, all_tactics: bool = False) -> list[int]:
    """The tactics `stof tune` times from the pre-search's ranking ((tactic, predicted seconds), fastest first):
    the first k within 1.5x of the first; for a small problem (the first predicted at most
    kernels.SELECT_TIME_SMALL_S) every one within kernels.SELECT_TIME_SMALL_RATIO, as the library's first-use
    timing takes them; with all_tactics every one."""
    from . import kernels

    if all_tactics or not ranked:
        return [t for t, _ in ranked]
    best = ranked[0][1]
    if best <= kernels.SELECT_TIME_SMALL_S:
        return [t for t, tp in ranked if tp <= best * kernels.SELECT_TIME_SMALL_RATIO]
    return [t for t, tp in ranked[:k] if tp <= best * 1.5]


def tune_model(model, feeds_list: list[dict], cache: TacticCache, *, k: int = 3, all_tactics: bool = False,
               presearch_only: bool = False, reps: int = 7, progress: bool = True,
               sess_kwargs: dict | None = None, target: TargetGpu | None = None) -> list[TuneResult]:
    """Tune every attention problem of `model` for each feeds dict; update `cache` in place. ``target``: a GPU named
    instead of this machine's (pre-search only; no GPU needed): the problems are read on the CPU EP and the valid
    tactics are the pre-search's for the target's properties."""
    from . import kernels, presearch

    if target is not None and not presearch_only:
        raise StofError("a named target GPU is for the pre-search only: timing runs on this machine's GPU")
    gpu, cc = (target.name, target.cc) if target is not None else gpu_identity()
    problems: dict[CacheKey, list[Problem]] = {}
    for feeds in feeds_list:
        for p in probe_problems(model, feeds, sess_kwargs, cpu=target is not None):
            problems.setdefault(p.key(gpu, cc), []).append(p)
    results = []
    items = list(problems.items())
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="stof tune", unit="problem")
        except ImportError:
            bar = None
    for key, probs in items:
        p = probs[0]
        names = sorted({q.node.name for q in probs})
        if p.dtype not in ("float16", "bfloat16"):
            if bar:
                bar.update(1)
            continue  # the general kernel (fp32 / bias): nothing to choose
        if target is not None:
            # no library to ask: the pre-search's own validity rules for the target's properties
            ranked = presearch.rank(p.node.layout, batch=p.batch, heads=p.heads, head_dim=p.head_dim, seq_q=p.seq_q,
                                    seq_k=p.seq_k, gpu=target.props, coef=target.coef)
            if not ranked:
                raise StofError(f"no tactic for node {names[0]} (head dim {p.head_dim}) on {target.name}")
            first = int(ranked[0][0])
            r = TuneResult(key, names, first, [first], {}, first, None)
            results.append(r)
            cache.put(key, first, tactic_name=_tactic_name(first), source="presearch", presearch_tactic=first,
                      nodes=names)
            if bar:
                bar.update(1)
            continue
        # the library's valid tactics for this exact problem (the pre-search may know tactics this build lacks)
        import torch

        tdt = torch.float16 if p.dtype == "float16" else torch.bfloat16
        lib_first = None  # packed sequences: the library's own first choice (select.cc ranks them apart)
        if p.packed:
            offsets = p.seq_offsets()
            qt = kt = torch.empty(max(int(offsets[-1]), 1), p.heads, p.head_dim, device="cuda", dtype=tdt)
            packed = dict(seq_offsets=torch.as_tensor(offsets, device="cuda"), max_seqlen=p.seq_q)
            dl = kernels.DeviceLayout(p.node.layout)
            lib_valid = [int(t) for t in kernels.list_tactics(qt, kt, kt, dl, **packed)]
            lib_first = kernels.select_tactic(qt, kt, kt, dl, **packed)[0]
        else:
            qt = torch.empty(p.batch, p.heads, p.seq_q, p.head_dim, device="cuda", dtype=tdt)
            kt = torch.empty(p.batch, p.kv_heads or p.heads, p.seq_k, p.head_dim, device="cuda", dtype=tdt)
            lib_valid = [int(t) for t in kernels.list_tactics(qt, kt, kt, kernels.DeviceLayout(p.node.layout))]
        del qt, kt
        default = lib_valid[0] if lib_valid else None
        ranked = [(int(t), tp) for t, tp in presearch.rank(p.node.layout, batch=p.batch, heads=p.heads,
                                                             head_dim=p.head_dim, seq_q=p.seq_q, seq_k=p.seq_k)
                  if int(t) in lib_valid]
        if not ranked:
            raise StofError(f"no tactic for node {names[0]} (head dim {p.head_dim})")
        first = ranked[0][0]
        cands = tune_candidates(ranked, k=k, all_tactics=all_tactics)
        if first not in cands:
            cands.insert(0, first)
        if lib_first is not None and lib_first not in cands:
            cands.append(lib_first)
        if presearch_only:
            times = {}
            best = first
        else:
            timed = list(cands) + ([default] if default and default not in cands else [])
            times = time_tactics(p, timed, reps=reps)
            # the library default is timed anyway: never record a measured choice slower than it
            best = min(timed, key=lambda t: times[t])
        r = TuneResult(key, names, first, cands, times, best, default)
        results.append(r)
        info = {"tactic_name": _tactic_name(best), "source": "presearch" if presearch_only else "measured",
                "presearch_tactic": first, "nodes": names}
        if not presearch_only:
            info.update(time_ms=round(times[best], 5), presearch_time_ms=round(times[first], 5),
                        candidates={str(t): round(v, 5) for t, v in times.items()})
        cache.put(key, best, **info)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return results


def _tactic_name(tid: int) -> str:
    from . import presearch

    for t in presearch.TACTICS:
        if t.id == tid:
            return t.name
    return f"tactic{tid}"


def target_gpu(name: str, *, cc: str = "9.0", sm_count: int | None = None, profile: str | None = None) -> TargetGpu:
    """A TargetGpu from the user's description: ``name`` as the library reports the device (e.g. "NVIDIA H200"),
    compute capability ``cc``, SM count (default: the profile's, else the H100's 132) and, optionally, a pre-search
    profile of ``stof calibrate`` whose constants rank the tactics as the library does on that GPU. Properties not
    given are the H100 SXM's, scaled by the SM count as presearch.gpu_props scales them."""
    import dataclasses
    import re

    from . import presearch, profiles

    if not name or not name.strip():
        raise StofError("--gpu needs a name, e.g. --gpu 'NVIDIA H200'")
    m = re.fullmatch(r"(\d+)\.(\d)", cc or "")
    if not m:
        raise StofError(f"--cc must be MAJOR.MINOR (e.g. 9.0), got {cc!r}")
    if not 8 <= int(m.group(1)) <= 12:  # the kernel library's families start at sm_80
        raise StofError(f"--cc {cc}: the kernels run on compute capability 8.0 (A100) to 12.x")
    coef = None
    if profile is not None:
        doc = profiles.load(profile)
        if doc["gpu"]["name"] != name:
            raise StofError(f"profile {profile} is for {doc['gpu']['name']!r}, not {name!r}")
        if sm_count is not None and sm_count != doc["gpu"]["sm_count"]:
            raise StofError(f"profile {profile} is for {doc['gpu']['sm_count']} SMs, not {sm_count}")
        sm_count = doc["gpu"]["sm_count"]
        coef = profiles.coef_of(doc, profile)
    if sm_count is None:
        sm_count = presearch.H100_SXM.sm_count
    if not 1 <= sm_count <= 4096:
        raise StofError(f"--sm-count must be in [1, 4096], got {sm_count}")
    try:
        presearch.native_library()
    except RuntimeError as e:
        raise StofError(str(e)) from None
    major, minor = int(m.group(1)), int(m.group(2))
    h, scale = presearch.H100_SXM, sm_count / presearch.H100_SXM.sm_count
    props = dataclasses.replace(h, name=name, sm_count=sm_count, mma_tflops=h.mma_tflops * scale,
                                l2_bw=h.l2_bw * scale, sm=major * 10 + minor,
                                wgmma_tflops=h.wgmma_tflops * scale if major == 9 else 0.0)
    return TargetGpu(name, f"{major}.{minor}", props, coef)
