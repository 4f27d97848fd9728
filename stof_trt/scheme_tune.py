"""Measured fusion schemes (stage 2): time each GEMM chain's shortlist of schemes × cuBLASLt algorithms on the GPU.

For each set of input shapes the rewritten model runs once to learn every chain's token count (the rows of its
GEMM input).  Chains with the same signature and token bucket (the 12 FFN1 chains of BERT-base) are timed once:
the cost model's shortlist (stof_trt.schemes.shortlist), each scheme with a StofGemmEpilogue node at the first
``algos`` cuBLASLt heuristic results.  Each candidate runs as a one-block ONNX model -- ``copies`` independent
chains fed by one X (and residual), built by the same graph code the rewrite uses (stof_trt.rewrite.schemes) --
on ONNX Runtime's CUDA EP with libstof_ort, inputs and outputs bound on the device; the time per chain is the
median run time / copies.  The fastest goes into the tactic cache's scheme section with the cost model's first
choice and its time, so the model's error is on record.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import schemes as S
from .errors import StofError
from .tactic_cache import SchemeKey, TacticCache

__all__ = ["chain_sites", "probe_tokens", "one_block_model", "time_candidates", "SchemeResult", "tune_schemes",
           "block_rows"]

_NP = {"float16": np.float16, "float": np.float32}


def chain_sites(model):
    """(gs graph, chain sites) of a rewritten ONNX model."""
    import onnx_graphsurgeon as gs

    from .rewrite.schemes import find_chains

    graph = gs.import_onnx(model)
    return graph, find_chains(graph)


def probe_tokens(model, feeds: dict, names: list[str], sess_kwargs: dict | None = None, *,
                 cpu: bool = False) -> dict[str, int]:
    """Rows (product of all but the last dimension) of each tensor in ``names`` when ``model`` runs on ``feeds``:
    one run with the tensors as extra outputs, bound on the GPU (nothing large is copied), or on the CPU EP."""
    import copy

    import onnx
    import onnxruntime as ort

    from . import ort as sort

    from .tune import _value_types

    m = copy.deepcopy(model)
    existing = {o.name for o in m.graph.output}
    types = _value_types(m)
    floats = [t.data_type for t in m.graph.initializer if t.data_type in (1, 10, 16)]
    dominant = max(set(floats), key=floats.count) if floats else 1
    for name in names:
        if name not in existing:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, types.get(name, dominant), None))
    try:
        if cpu:
            sess = sort.session(m, providers="cpu", register=False)
            known = {i.name for i in sess.get_inputs()}
            outs = sess.run(None, {k: v for k, v in feeds.items() if k in known})
            shapes = {o.name: list(a.shape) for o, a in zip(sess.get_outputs(), outs)}
        else:
            sess = sort.session(m, **(sess_kwargs or {}))
            binding = sess.io_binding()
            for i in sess.get_inputs():
                binding.bind_ortvalue_input(
                    i.name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[i.name]), "cuda", 0))
            out_names = [o.name for o in sess.get_outputs()]
            for name in out_names:
                binding.bind_output(name, "cuda", 0)
            sess.run_with_iobinding(binding)
            shapes = {n: list(v.shape()) for n, v in zip(out_names, binding.get_outputs())}
    except StofError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's run errors (shapes the model refuses) are user errors here
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StofError(f"onnxruntime could not run the model: {msg[:200]}") from None
    return {n: int(np.prod(shapes[n][:-1])) if shapes[n] else 1 for n in names}


def one_block_model(shape: S.ChainShape, scheme: str, algo: int = -1, *, copies: int = 4, opset: int = 17,
                    seed: int = 0):
    """An ONNX model of ``copies`` independent chains of ``shape`` in scheme ``scheme``: inputs X [M, K] (and
    residual [M, N]), outputs Y0.. (and the pre-norm sums of a sum_output chain), random weights per copy."""
    import onnx
    import onnx_graphsurgeon as gs

    from .rewrite.base import RewriteContext
    from .rewrite.functions import DOMAIN, DOMAIN_VERSION, add_layernorm_overload, build_functions, gemm_overload
    from .rewrite.report import RewriteReport
    from .rewrite.schemes import apply_scheme, find_chains

    if shape.dtype not in _NP:
        raise StofError(f"one-block timing supports float16 and float chains, not {shape.dtype}")
    dt = _NP[shape.dtype]
    rng = np.random.default_rng(seed)
    M, N, K = shape.tokens, shape.n, shape.k
    x = gs.Variable("X", dtype=dt, shape=[M, K])
    inputs = [x]
    res = None
    if shape.kind == "residual_ln":
        res = gs.Variable("residual", dtype=dt, shape=[M, N])
        inputs.append(res)
    graph = gs.Graph(inputs=inputs, opset=opset)
    ctx = RewriteContext(graph=graph, report=RewriteReport(opset=opset), opset=opset, options={})
    outputs = []
    for c in range(copies):
        w = gs.Constant(f"W{c}", (rng.standard_normal((K, N)) / np.sqrt(K)).astype(dt))
        b = gs.Constant(f"bias{c}", (0.1 * rng.standard_normal(N)).astype(dt))
        y = gs.Variable(f"Y{c}", dtype=dt, shape=[M, N])
        outputs.append(y)
        if shape.kind == "residual_ln":
            t = gs.Variable(f"gemm{c}", dtype=dt, shape=[M, N])
            graph.nodes.append(gs.Node("MatMul", f"matmul{c}", {}, [x, w], [t]))
            outs = [y]
            if shape.sum_output:
                s = gs.Variable(f"S{c}", dtype=dt, shape=[M, N])
                outs.append(s)
                outputs.append(s)
            gamma = gs.Constant(f"gamma{c}", (1 + 0.1 * rng.standard_normal(N)).astype(dt))
            beta = gs.Constant(f"beta{c}", (0.1 * rng.standard_normal(N)).astype(dt))
            ln = gs.Node("StofAddLayerNorm", f"addln{c}", {"epsilon": 1e-5}, [t, res, gamma, beta, b], outs,
                         domain=DOMAIN)
            ctx.overloads[ln.name] = add_layernorm_overload(True, shape.sum_output)
            ctx.functions.add(("StofAddLayerNorm", ctx.overloads[ln.name]))
            graph.nodes.append(ln)
        else:
            g = gs.Node("StofGemmEpilogue", f"gemm{c}", {"activation": shape.activation}, [x, w, b], [y],
                        domain=DOMAIN)
            ctx.overloads[g.name] = gemm_overload(shape.activation)
            ctx.functions.add(("StofGemmEpilogue", ctx.overloads[g.name]))
            graph.nodes.append(g)
    graph.outputs = outputs
    for site in find_chains(graph):
        if site.scheme != scheme or site.algo != algo:
            apply_scheme(ctx, site, scheme, algo)
    graph.cleanup().toposort()
    model = gs.export_onnx(graph, do_type_check=False)
    model.ir_version = 10
    del model.opset_import[:]
    model.opset_import.extend([onnx.helper.make_opsetid("", opset), onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.overload = ctx.overloads.get(node.name, "")
    model.functions.extend(build_functions(ctx.functions, opset))
    return model


def time_candidates(shape: S.ChainShape, candidates: list[tuple[str, int]], *, reps: int = 7, launches: int = 10,
                    copies: int = 4, opset: int = 17, sess_kwargs: dict | None = None,
                    seed: int = 0) -> dict[tuple[str, int], float]:
    """ms per chain of each (scheme, algo) on the GPU: its one-block model on ORT's CUDA EP, inputs and outputs
    bound on the device, median over ``reps`` of ``launches`` runs, divided by ``copies``."""
    import onnxruntime as ort

    from . import ort as sort

    rng = np.random.default_rng(seed)
    dt = _NP[shape.dtype]
    feeds = {"X": rng.standard_normal((shape.tokens, shape.k)).astype(dt)}
    if shape.kind == "residual_ln":
        feeds["residual"] = rng.standard_normal((shape.tokens, shape.n)).astype(dt)
    dev = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
    out: dict[tuple[str, int], float] = {}
    for scheme, algo in candidates:
        model = one_block_model(shape, scheme, algo, copies=copies, opset=opset, seed=seed)
        sess = sort.session(model, **(sess_kwargs or {}))
        binding = sess.io_binding()
        for k, v in dev.items():
            binding.bind_ortvalue_input(k, v)
        for o in sess.get_outputs():
            binding.bind_output(o.name, "cuda", 0)
        for _ in range(3):
            sess.run_with_iobinding(binding)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(launches):
                sess.run_with_iobinding(binding)  # ORT synchronises the stream at the end of each run
            times.append((time.perf_counter() - t0) * 1e3 / launches)
        out[(scheme, algo)] = statistics.median(times) / copies
        del binding, sess
    return out


@dataclass
class SchemeResult:
    """The measured scheme of one chain signature and token bucket.

    key: the cache key. shape: the chain shape timed (tokens of the first probe in the bucket).
    sites: [(block, role, node names)] of the chains sharing the key.
    predicted: {scheme: predicted ms} of the cost model, every applicable scheme.
    model_first: (scheme, algo) of the cost model's first choice (algo 0: the heuristic's first result).
    times: {(scheme, algo): ms per chain} measured ({} when only the model ranked).
    best: the fastest (scheme, algo) measured (the model's first choice when nothing was timed).
    """

    key: SchemeKey
    shape: S.ChainShape
    sites: list
    predicted: dict
    model_first: tuple
    times: dict = field(default_factory=dict)
    best: tuple = ("", -1)

    @property
    def best_ms(self) -> float | None:
        return self.times.get(self.best)

    @property
    def model_first_ms(self) -> float | None:
        return self.times.get(self.model_first)

    @property
    def fixed_rule(self) -> tuple:
        """(scheme, algo) of the fixed rules' scheme at the heuristic's first algorithm."""
        tpl = S.default_scheme(self.shape.kind)
        return (tpl.name, 0 if tpl.tunable else -1)

    @property
    def gain(self) -> float | None:
        """fixed rules' time / best time (>= 1): what measuring the schemes gains over the fixed rules."""
        fixed = self.times.get(self.fixed_rule)
        return fixed / self.best_ms if fixed and self.best_ms else None

    @property
    def ratio(self) -> float | None:
        """model's first choice time / best time (>= 1; 1.0 when the model picked the winner)."""
        if not self.times or not self.best_ms:
            return None
        return self.model_first_ms / self.best_ms


def _algo_of(tpl: S.SchemeTemplate, a: int) -> int:
    return a if tpl.tunable else -1


def tune_schemes(model, feeds_list: list[dict], cache: TacticCache, *, gpu: tuple[str, str] | None = None,
                 props=None, k: int = 3, algos: int = 4, reps: int = 7, copies: int = 4, measure: bool = True,
                 sess_kwargs: dict | None = None, cpu_probe: bool = False,
                 timer: Callable | None = None) -> list[SchemeResult]:
    """Choose the scheme of every chain of ``model`` for each feeds dict; update ``cache``'s scheme section.

    gpu: (name, cc) of the cache key (default: this machine's GPU). props: GpuProps for the cost model (default:
    this GPU's). measure: time the shortlist (else record the model's first choice, source "model").
    timer(shape, candidates) -> {(scheme, algo): ms}: replaces :func:`time_candidates` (tests)."""
    from .presearch import gpu_props
    from .tactic_cache import gpu_identity

    _, sites = chain_sites(model)
    if not sites:
        return []
    name, cc = gpu if gpu is not None else gpu_identity()
    cost = S.CostModel(props if props is not None else gpu_props())
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    groups: dict[SchemeKey, list] = {}
    for feeds in feeds_list:
        tokens = probe_tokens(model, feeds, sorted({s.x.name for s in sites}), sess_kwargs, cpu=cpu_probe)
        for s in sites:
            shape = s.shape(tokens[s.x.name])
            key = SchemeKey(name, cc, shape.signature(), shape.bucket())
            group = groups.setdefault(key, [shape, []])[1]
            if all(g is not s for g in group):  # two shape sets in one bucket: each chain once
                group.append(s)
    timer = timer or (lambda shape, cands: time_candidates(shape, cands, reps=reps, copies=copies, opset=opset,
                                                           sess_kwargs=sess_kwargs))
    results = []
    for key, (shape, group) in groups.items():
        ranked = S.rank(shape, cost, opset=opset)
        first = (ranked[0].name, _algo_of(ranked[0].template, 0))
        sites_info = [(s.block, s.role, s.names) for s in group]
        r = SchemeResult(key, shape, sites_info, {c.name: c.time_s * 1e3 for c in ranked}, first, best=first)
        timed = measure and shape.dtype in _NP  # bf16 chains: the model's choice (one-block timing is fp16/fp32)
        if timed:
            cands = []
            for c in S.shortlist(shape, cost, k=k, opset=opset):
                for a in (range(algos) if c.template.tunable else [-1]):
                    cands.append((c.name, a))
            if first not in cands:
                cands.insert(0, first)
            r.times = dict(timer(shape, cands))
            r.best = min(cands, key=lambda c: r.times[c])  # ties: the earlier (model-preferred) candidate
        scheme, algo = r.best
        info = {"source": "measured" if timed else "model", "model_first": first[0],
                "nodes": sorted({n for _, _, names in sites_info for n in names})}
        if timed:
            info.update(time_ms=round(r.best_ms, 5), model_first_algo=_attr(first[1]), gain=round(r.gain, 4),
                        model_first_ms=round(r.model_first_ms, 5), ratio=round(r.ratio, 4),
                        candidates={f"{s}/{a}": round(v, 5) for (s, a), v in r.times.items()})
        cache.put_scheme(key, scheme, _attr(algo), **info)
        results.append(r)
    return results


def _attr(algo: int) -> int:
    """A measured heuristic index as the node's attribute says it: the index itself (0: the first result; -1, the
    attribute's default, would time the candidates again at first use)."""
    return algo


def block_rows(results: list[SchemeResult]) -> list[dict]:
    """One row per chain of the model (block order): the JSON report of ``stof tune``; ``algo`` as the node's
    attribute (0: the heuristic's first result; -1 for templates without a GEMM node's algorithm)."""
    rows = []
    for r in results:
        for block, role, names in r.sites:
            rows.append({"block": block, "role": role, "chain": r.key.chain, "bucket": r.key.bucket,
                         "tokens": r.shape.tokens, "nodes": names, "scheme": r.best[0], "algo": _attr(r.best[1]),
                         "time_ms": r.best_ms, "model_first": r.model_first[0],
                         "model_first_algo": _attr(r.model_first[1]),
                         "model_first_ms": r.model_first_ms, "ratio": r.ratio,
                         "fixed_rule": r.fixed_rule[0], "fixed_rule_ms": r.times.get(r.fixed_rule),
                         "gain": r.gain, "predicted_ms": r.predicted.get(r.best[0])})
    order = {"attn_out": 0, "ffn1": 1, "ffn2": 2}
    rows.sort(key=lambda x: (x["block"], order.get(x["role"], 3), x["bucket"]))
    return rows
