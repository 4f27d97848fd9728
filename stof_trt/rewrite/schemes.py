"""Fusion schemes in a graph: find each block's GEMM chains after attention and rebuild them as a chosen scheme.

The fixed epilogue fusions leave every chain in its fixed-rule scheme (stof_trt.schemes.TEMPLATES):

* residual_ln: ``MatMul(X, W) -> StofAddLayerNorm(·, residual, gamma, beta, bias)`` ("matmul+bias_add_ln");
* bias_gelu:   ``StofGemmEpilogue(X, W, bias, activation=gelu_*)``                ("gemm_bias_gelu").

:func:`find_chains` also recognises a residual_ln chain already rebuilt as "gemm+bias_add_ln" or
"gemm_bias+add_ln" (a model rewritten with measured schemes can be tuned again). :func:`apply_scheme` replaces a
chain's nodes by a scheme's; :func:`apply_schemes` runs after the fusions and gives every chain the scheme the
caller chose for its signature (from the tactic cache) or, without one, the cost model's first choice for
``scheme_tokens`` tokens -- the fixed rule unless the model predicts another scheme faster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .. import schemes as S
from .base import RewriteContext
from .functions import add_layernorm_overload
from .matcher import const_value, producer

__all__ = ["ChainSite", "find_chains", "apply_scheme", "apply_schemes", "ONNX_DTYPES"]

#: numpy dtype name -> ONNX dtype name of the chain shapes.
ONNX_DTYPES = {"float16": "float16", "float32": "float", "bfloat16": "bfloat16"}


@dataclass
class ChainSite:
    """One GEMM chain of a graph.

    kind: "residual_ln" or "bias_gelu".
    role: "attn_out" (projection after attention), "ffn1" or "ffn2" (GEMM after the FFN activation).
    block: index of the transformer block (chains in graph order; a block ends with its ffn2).
    scheme: the scheme the chain is in now.
    nodes: the chain's nodes (GEMM first).
    x: the GEMM's input [..., K]; w: its constant weight [K, N]; bias: the constant bias [N].
    y: the chain's output; sum_out: residual_ln's pre-norm sum output (None when unused).
    residual, gamma, beta: residual_ln's other inputs (None for bias_gelu).
    epsilon: residual_ln's LayerNorm epsilon.
    activation: bias_gelu's "gelu_erf" / "gelu_tanh"; "none" for residual_ln.
    n, k: the GEMM's N and K. dtype: ONNX name of the element type.
    algo: the GEMM node's cuBLASLt heuristic index (-1: the first, or no StofGemmEpilogue).
    """

    kind: str
    role: str
    block: int
    scheme: str
    nodes: list
    x: gs.Tensor
    w: gs.Tensor
    bias: gs.Tensor
    y: gs.Tensor
    n: int
    k: int
    dtype: str
    activation: str = "none"
    residual: gs.Tensor | None = None
    gamma: gs.Tensor | None = None
    beta: gs.Tensor | None = None
    sum_out: gs.Tensor | None = None
    epsilon: float = 1e-5
    algo: int = -1
    extra: dict = field(default_factory=dict)

    def shape(self, tokens: int) -> S.ChainShape:
        return S.ChainShape(self.kind, int(tokens), self.n, self.k, self.dtype, self.activation,
                            self.sum_out is not None)

    def signature(self) -> str:
        return self.shape(1).signature()

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


def _weight(t: gs.Tensor):
    """(K, N, ONNX dtype name) of a constant 2-D weight, else None (external data is not read)."""
    if isinstance(t, gs.Constant):
        shape, dt = tuple(t.shape), np.dtype(t.dtype).name
    else:
        v = const_value(t)
        if v is None:
            return None
        shape, dt = v.shape, v.dtype.name
    if len(shape) != 2 or dt not in ONNX_DTYPES:
        return None
    return int(shape[0]), int(shape[1]), ONNX_DTYPES[dt]


def _vector(t: gs.Tensor | None, n: int) -> bool:
    if t is None:
        return False
    if isinstance(t, gs.Constant):
        return tuple(t.shape) == (n,)
    v = const_value(t)
    return v is not None and v.shape == (n,)


def _single_use(t: gs.Tensor, consumer: gs.Node, outs: set) -> bool:
    return t.name not in outs and len(t.outputs) == 1 and t.outputs[0] is consumer


def _algo(node: gs.Node) -> int:
    return int(node.attrs.get("algo", -1)) if node.op == "StofGemmEpilogue" else -1


def _residual_ln(ln: gs.Node, outs: set) -> ChainSite | None:
    if len(ln.inputs) < 4:
        return None
    t = ln.inputs[0]
    g = producer(t)
    if g is None or not _single_use(t, ln, outs):
        return None
    has_ln_bias = len(ln.inputs) > 4 and bool(ln.inputs[4].name)
    if g.op == "MatMul" and has_ln_bias:
        scheme, bias = "matmul+bias_add_ln", ln.inputs[4]
    elif g.op == "StofGemmEpilogue" and g.attrs.get("activation", "none") == "none":
        g_bias = len(g.inputs) > 2 and bool(g.inputs[2].name)
        if g_bias and not has_ln_bias:
            scheme, bias = "gemm_bias+add_ln", g.inputs[2]
        elif not g_bias and has_ln_bias:
            scheme, bias = "gemm+bias_add_ln", ln.inputs[4]
        else:
            return None
    else:
        return None
    wk = _weight(g.inputs[1])
    if wk is None:
        return None
    k, n, dtype = wk
    if not _vector(bias, n):
        return None
    sum_out = ln.outputs[1] if len(ln.outputs) > 1 and (ln.outputs[1].name in outs or ln.outputs[1].outputs) \
        else None
    return ChainSite("residual_ln", "attn_out", 0, scheme, [g, ln], g.inputs[0], g.inputs[1], bias, ln.outputs[0],
                     n, k, dtype, residual=ln.inputs[1], gamma=ln.inputs[2], beta=ln.inputs[3], sum_out=sum_out,
                     epsilon=float(ln.attrs.get("epsilon", 1e-5)), algo=_algo(g))


def _bias_gelu(g: gs.Node) -> ChainSite | None:
    act = g.attrs.get("activation", "none")
    if act not in ("gelu_erf", "gelu_tanh") or len(g.inputs) < 3 or not g.inputs[2].name:
        return None
    wk = _weight(g.inputs[1])
    if wk is None or not _vector(g.inputs[2], wk[1]):
        return None
    k, n, dtype = wk
    return ChainSite("bias_gelu", "ffn1", 0, "gemm_bias_gelu", [g], g.inputs[0], g.inputs[1], g.inputs[2],
                     g.outputs[0], n, k, dtype, activation=act, algo=_algo(g))


def _fed_by_gelu(x: gs.Tensor, gelu_outputs: set) -> bool:
    """Whether the GEMM input comes from a bias_gelu chain (through shape-only ops)."""
    for _ in range(4):
        if x.name in gelu_outputs:
            return True
        p = producer(x)
        if p is None or p.op not in ("Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze"):
            return False
        x = p.inputs[0]
    return False


def find_chains(graph: gs.Graph) -> list[ChainSite]:
    """The GEMM chains of ``graph`` in topological order, with their roles and block indices."""
    graph.toposort()
    outs = {t.name for t in graph.outputs}
    sites, gelu_outputs, block = [], set(), 0
    for node in graph.nodes:
        site = None
        if node.domain == "stof" and node.op == "StofAddLayerNorm":
            site = _residual_ln(node, outs)
            if site is not None and _fed_by_gelu(site.x, gelu_outputs):
                site.role = "ffn2"
        elif node.domain == "stof" and node.op == "StofGemmEpilogue":
            site = _bias_gelu(node)
            if site is not None:
                gelu_outputs.add(site.y.name)
        if site is None:
            continue
        site.block = block
        sites.append(site)
        if site.role == "ffn2":
            block += 1
    return sites


# -- rebuilding -------------------------------------------------------------------------------------------------------
def _gelu_nodes(ctx: RewriteContext, t: gs.Tensor, y: gs.Tensor, activation: str, dtype) -> list[gs.Node]:
    """y = GELU(t) in standard ops: ONNX Gelu from opset 20, else its element-wise form."""
    if ctx.opset >= 20:
        return [gs.Node("Gelu", ctx.unique("stof_scheme_gelu"),
                        {"approximate": "tanh" if activation == "gelu_tanh" else "none"}, [t], [y])]
    np_dt = np.dtype(dtype)

    def c(v):
        return gs.Constant(ctx.unique("stof_scheme_c"), np.asarray(v, np_dt))

    def v():
        return gs.Variable(ctx.unique("stof_scheme_t"), dtype=np_dt)

    nodes = []

    def op(op_type, *inputs, out=None):
        o = out if out is not None else v()
        nodes.append(gs.Node(op_type, ctx.unique("stof_scheme_" + op_type.lower()), {}, list(inputs), [o]))
        return o

    if activation == "gelu_erf":
        inner = op("Add", op("Erf", op("Div", t, c(math.sqrt(2.0)))), c(1.0))
        op("Mul", op("Mul", t, c(0.5)), inner, out=y)
    else:
        cube = op("Mul", op("Mul", op("Mul", t, t), t), c(0.044715))
        th = op("Tanh", op("Mul", op("Add", t, cube), c(math.sqrt(2.0 / math.pi))))
        op("Mul", op("Mul", t, c(0.5)), op("Add", th, c(1.0)), out=y)
    return nodes


def _add_ln(ctx: RewriteContext, site: ChainSite, x, bias) -> gs.Node:
    outs = [site.y] + ([site.sum_out] if site.sum_out is not None else [])
    inputs = [x, site.residual, site.gamma, site.beta] + ([bias] if bias is not None else [])
    node = gs.Node("StofAddLayerNorm", ctx.unique("StofAddLayerNorm"), {"epsilon": site.epsilon}, inputs, outs,
                   domain="stof")
    ov = add_layernorm_overload(bias is not None, site.sum_out is not None)
    ctx.overloads[node.name] = ov
    ctx.functions.add(("StofAddLayerNorm", ov))
    return node


def apply_scheme(ctx: RewriteContext, site: ChainSite, scheme: str, algo: int = -1) -> list[gs.Node]:
    """Replace ``site``'s nodes in ctx.graph by scheme ``scheme`` (GEMM node algorithm ``algo``); returns the new
    nodes. The chain's output tensors stay the same objects."""
    tpl = S.template(site.kind, scheme)
    if ctx.opset < tpl.needs_opset:
        raise ValueError(f"scheme {scheme} needs opset {tpl.needs_opset}, the model has {ctx.opset}")
    algo = algo if tpl.tunable else -1
    # the weight's element type (a rewritten graph's intermediate tensors often carry no dtype)
    np_dt = {"float16": np.float16, "float": np.float32, "bfloat16": onnx.TensorProto.BFLOAT16}.get(site.dtype)
    if np_dt is None:
        np_dt = site.y.dtype if site.y.dtype is not None else np.float32
    for n in site.nodes:
        n.inputs.clear()
        n.outputs.clear()
        ctx.graph.nodes.remove(n)

    def var(prefix):
        return gs.Variable(ctx.unique(prefix), dtype=np_dt)

    new: list[gs.Node] = []
    if site.kind == "residual_ln":
        t = var("stof_scheme_gemm_out")
        if scheme == "matmul+bias_add_ln":
            new = [gs.Node("MatMul", ctx.unique("stof_scheme_matmul"), {}, [site.x, site.w], [t]),
                   _add_ln(ctx, site, t, site.bias)]
        elif scheme == "gemm+bias_add_ln":
            new = [ctx.gemm_node(site.x, site.w, None, t, "none", algo=algo), _add_ln(ctx, site, t, site.bias)]
        elif scheme == "gemm_bias+add_ln":
            new = [ctx.gemm_node(site.x, site.w, site.bias, t, "none", algo=algo), _add_ln(ctx, site, t, None)]
        else:  # unfused
            mm, b = var("stof_scheme_mm"), var("stof_scheme_biased")
            s = site.sum_out if site.sum_out is not None else var("stof_scheme_sum")
            new = [gs.Node("MatMul", ctx.unique("stof_scheme_matmul"), {}, [site.x, site.w], [mm]),
                   gs.Node("Add", ctx.unique("stof_scheme_add"), {}, [mm, site.bias], [b]),
                   gs.Node("Add", ctx.unique("stof_scheme_add"), {}, [b, site.residual], [s]),
                   gs.Node("LayerNormalization", ctx.unique("stof_scheme_layernorm"),
                           {"axis": -1, "epsilon": site.epsilon}, [s, site.gamma, site.beta], [site.y])]
    else:
        if scheme == "gemm_bias_gelu":
            new = [ctx.gemm_node(site.x, site.w, site.bias, site.y, site.activation, algo=algo)]
        elif scheme == "gemm_bias+gelu":
            t = var("stof_scheme_gemm_out")
            new = [ctx.gemm_node(site.x, site.w, site.bias, t, "none", algo=algo)] + \
                _gelu_nodes(ctx, t, site.y, site.activation, np_dt)
        else:  # unfused
            mm, b = var("stof_scheme_mm"), var("stof_scheme_biased")
            new = [gs.Node("MatMul", ctx.unique("stof_scheme_matmul"), {}, [site.x, site.w], [mm]),
                   gs.Node("Add", ctx.unique("stof_scheme_add"), {}, [mm, site.bias], [b])] + \
                _gelu_nodes(ctx, b, site.y, site.activation, np_dt)
    ctx.graph.nodes.extend(new)
    return new


def apply_schemes(ctx: RewriteContext) -> dict:
    """Give every chain of ctx.graph its scheme. ``ctx.options["schemes"]``: {signature: (scheme, algo)} chosen
    by measurement (stof_trt.tactic_cache); chains without one get the cost model's first choice for
    ``ctx.options["scheme_tokens"]`` tokens (default :data:`stof_trt.schemes.DEFAULT_TOKENS`). Returns
    {(kind, scheme, algo): chains} of the chains whose nodes changed."""
    chosen = ctx.options.get("schemes") or {}
    tokens = int(ctx.options.get("scheme_tokens") or S.DEFAULT_TOKENS)
    model = ctx.options.get("cost_model")
    changed: dict = {}
    by_source: dict = {}  # (measured, (kind, scheme, algo)) -> chains: the cache's choices apart from the model's
    sites = find_chains(ctx.graph)
    matched = 0
    for site in sites:
        pick = chosen.get(site.signature())
        measured = pick is not None
        matched += measured
        if pick is None:
            pick = (S.rank(site.shape(tokens), model, opset=ctx.opset)[0].name, -1)
        scheme, algo = pick
        tpl = S.template(site.kind, scheme)
        algo = int(algo) if tpl.tunable else -1
        if scheme == site.scheme and algo == site.algo:
            continue
        apply_scheme(ctx, site, scheme, algo)
        key = (site.kind, scheme, algo)
        changed[key] = changed.get(key, 0) + 1
        by_source[(measured, key)] = by_source.get((measured, key), 0) + 1
    if changed:
        ctx.graph.cleanup().toposort()
    # the note names what differs from the fixed rules (which every rewrite applies without a word), by source
    for measured, src in ((True, "measured (tactic cache)"), (False, f"cost model at {tokens} tokens")):
        said = {key: c for (m, key), c in by_source.items() if m == measured and
                (measured or not S.template(key[0], key[1]).fixed_rule)}
        if said:
            ctx.report.notes.append("fusion schemes, " + src + ": " + ", ".join(
                f"{k} {s}{'' if a < 0 else f' algo {a}'} x{c}" for (k, s, a), c in sorted(said.items())))
    if chosen and sites and not matched:
        ctx.report.notes.append(f"the schemes cache has none of this model's {len(sites)} chains (their shapes "
                                "or dtypes differ): every chain takes the cost model's choice")
    return changed
