"""Fuse MatMul + bias + GELU (erf or tanh form) into StofGemmEpilogue.

Matched (anchor: the Erf or Tanh of the activation)::

      X [..., K]   W [K, N] (constant)              X2 [M, K]   W (constant)   bias
           \\       /                                     \\       |         /
            MatMul                                         Gemm (alpha = beta = 1, transA = 0)
              |      bias [N] (constant)                     |
             Add ----/                                     Reshape (to [..., N])
              |                                              |
              x  -----------------.                          x  ---.
              |                    \\                          |     \\
         (element-wise GELU subgraph: erf or tanh form, any operand order)
              |
              y [..., N]

Replaced by ``StofGemmEpilogue(X, W, bias, activation="gelu_erf" | "gelu_tanh") -> y`` (for the Gemm variant:
``StofGemmEpilogue(X2, W, bias) -> Reshape -> y``; a transB Gemm gets W pre-transposed).

The activation is recognised by *evaluating* the element-wise subgraph between x and y on sample points and
comparing with both GELU forms, so any operand order / constant placement the exporter picks is accepted; the
subgraph must read only x and scalar constants, and x must have no other consumer.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from .base import Fusion, Match
from .matcher import ELEMENTWISE_OPS, const_value, match_parent_path, producer

_SAMPLES = np.linspace(-7.0, 7.0, 281)
_ERF = np.vectorize(math.erf)
GELU_FORMS = {
    "gelu_erf": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
}
_NUMPY_OPS = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power, "Sqrt": np.sqrt,
    "Erf": _ERF, "Tanh": np.tanh, "Neg": np.negative, "Exp": np.exp, "Reciprocal": np.reciprocal,
    "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
}

#: Producers of the pre-activation x: variant -> (op of x's producer, further op types upwards, input indices).
PRE_ACTIVATION = {
    "matmul_bias": ("Add", ["MatMul"], [None]),
    "gemm_reshape": ("Reshape", ["Gemm"], [0]),
    "gemm": ("Gemm", [], []),
}


class FuseGemmGelu(Fusion):
    fused_op_type = "StofGemmEpilogue"
    search_op_types = ("Erf", "Tanh")
    pattern = "gemm_bias_gelu"

    def fuse(self, anchor: gs.Node) -> Match | None:
        outs = self.ctx.graph_outputs
        sources, _ = self._cone(anchor.outputs[0], None)
        if sources is None or len(sources) != 1:
            self.debug(anchor, "the activation does not read exactly one pre-activation tensor")
            return None
        x = next(iter(sources.values()))
        # Walk down until the subgraph x -> y evaluates to a GELU.
        t, activation, region = anchor.outputs[0], None, None
        for _ in range(6):
            nodes_ok, nodes = self._cone(t, x)
            if nodes_ok is not None:
                activation = self._which_gelu(nodes, x, t)
                if activation:
                    region = nodes
                    break
            if t.name in outs or len(t.outputs) != 1 or t.outputs[0].op not in ELEMENTWISE_OPS:
                break
            t = t.outputs[0].outputs[0]
        if activation is None:
            self.debug(anchor, "the element-wise subgraph is not a GELU (erf or tanh form)")
            return None
        y = t
        region_ids = {id(n) for n in region}
        if x.name in outs or any(id(c) not in region_ids for c in x.outputs):
            self.debug(anchor, "the pre-activation has consumers outside the activation")
            return None
        for n in region:
            for o in n.outputs:
                if o is not y and (o.name in outs or any(id(c) not in region_ids for c in o.outputs)):
                    self.debug(anchor, "an activation intermediate is used elsewhere")
                    return None
        return self._pre_activation(anchor, x, y, region, activation)

    # -- pre-activation: MatMul + bias, or Gemm (+ Reshape) ---------------------------------------------------------
    def _pre_activation(self, anchor, x, y, region, activation) -> Match | None:
        outs = self.ctx.graph_outputs
        first = producer(x)
        if first is None:
            self.debug(anchor, "the pre-activation is a graph input")
            return None
        name, path = None, None
        for variant, (op0, ops, indices) in PRE_ACTIVATION.items():
            rest = match_parent_path(first, ops, indices) if first.op == op0 else None
            if rest is not None:
                name, path = variant, [first] + rest
                break
        if name is None:
            self.debug(anchor, f"pre-activation produced by {first.op}: not MatMul + bias or Gemm")
            return None
        if name == "matmul_bias":
            add, mm = path
            if add.inputs[0] is mm.outputs[0]:
                bias_t = add.inputs[1]
            elif add.inputs[1] is mm.outputs[0]:
                bias_t = add.inputs[0]
            else:
                self.debug(anchor, "Add is not MatMul + bias")
                return None
            gemm = None
        else:
            gemm = path[-1]
            mm, add = None, None
            if gemm.attrs.get("alpha", 1.0) != 1.0 or gemm.attrs.get("beta", 1.0) != 1.0 \
                    or gemm.attrs.get("transA", 0) or len(gemm.inputs) < 3:
                self.skip(anchor, "Gemm with alpha/beta != 1, transA or no bias is not fused")
                return None
            bias_t = gemm.inputs[2]
        node = mm if mm is not None else gemm
        X, W_t = node.inputs[0], node.inputs[1]
        W = const_value(W_t)
        bias = const_value(bias_t)
        if W is None or W.ndim != 2:
            self.debug(anchor, "weight is not a constant 2-D matrix")
            return None
        if gemm is not None and gemm.attrs.get("transB", 0):
            W = np.ascontiguousarray(W.T)
        N = W.shape[1]
        if bias is None or bias.size != N or (bias.ndim > 1 and bias.shape[-1] != N):
            self.debug(anchor, f"bias is not a constant of size N={N}")
            return None
        chain = list(path)
        for n in chain:
            for o in n.outputs:
                if o is not x and (o.name in outs or len(o.outputs) != 1):
                    self.debug(anchor, "a MatMul/Gemm intermediate is used elsewhere")
                    return None
        remove = chain + region
        reshape = path[0] if name == "gemm_reshape" else None

        def build() -> list[gs.Node]:
            w_in = W_t if (gemm is None or not gemm.attrs.get("transB", 0)) and isinstance(W_t, gs.Constant) \
                else self.new_const("stof_gemm_weight", W)
            b_in = bias_t if isinstance(bias_t, gs.Constant) and bias.ndim == 1 \
                else self.new_const("stof_gemm_bias", np.ascontiguousarray(bias.reshape(N)))
            new = []
            out = y
            if reshape is not None:
                out = self.new_var("stof_gemm_out", dtype=y.dtype)
                new.append(gs.Node("Reshape", self.ctx.unique("stof_gemm_reshape"), dict(reshape.attrs),
                                   [out, reshape_shape], [y]))
            return [self.ctx.gemm_node(X, w_in, b_in, out, activation)] + new

        reshape_shape = reshape.inputs[1] if reshape is not None else None
        return Match(anchor, remove, build, {"variant": name, "activation": activation})

    # -- the activation subgraph -------------------------------------------------------------------------------------
    def _cone(self, t: gs.Tensor, x: gs.Tensor | None):
        """Walk up from ``t`` through element-wise nodes with scalar-constant operands.

        With ``x`` None: returns ({name: tensor} of the non-constant leaves, nodes); a leaf is a tensor with several
        consumers or a non-element-wise producer. With ``x`` given: returns (True, nodes) when ``t`` is computed
        from ``x`` and scalar constants only, else (None, None)."""
        leaves, nodes, seen = {}, [], set()
        stack = [t]
        while stack:
            cur = stack.pop()
            if id(cur) in seen:
                continue
            seen.add(id(cur))
            if x is not None and cur is x:
                continue
            c = const_value(cur)
            if c is not None:
                if c.size != 1:
                    return None, None
                continue
            node = producer(cur)
            is_leaf = node is None or node.op not in ELEMENTWISE_OPS or (cur is not t and len(cur.outputs) > 1)
            if is_leaf:
                if x is not None:
                    return None, None
                leaves[cur.name] = cur
                continue
            nodes.append(node)
            stack.extend(node.inputs)
        return (leaves if x is None else True), nodes

    @staticmethod
    def _which_gelu(nodes: list[gs.Node], x: gs.Tensor, y: gs.Tensor) -> str | None:
        values = {x.name: _SAMPLES}
        pending = list(nodes)
        for _ in range(len(nodes) + 1):
            progressed = False
            for n in list(pending):
                args = []
                for i in n.inputs:
                    if i.name in values:
                        args.append(values[i.name])
                    elif const_value(i) is not None:
                        args.append(float(const_value(i).reshape(())))
                    else:
                        break
                else:
                    with np.errstate(all="ignore"):
                        values[n.outputs[0].name] = np.asarray(_NUMPY_OPS[n.op](*args), np.float64)
                    pending.remove(n)
                    progressed = True
            if not progressed:
                break
        if pending or y.name not in values:
            return None
        got = values[y.name]
        # Constants stored in fp16/bf16 are rounded (√2 -> 1.4140625): allow that much, but the form must still be
        # clearly closer than the other one (erf and tanh GELU differ by up to ~5e-4).
        low_precision = any(np.asarray(const_value(i)).dtype in (np.float16,) or
                            str(np.asarray(const_value(i)).dtype) == "bfloat16"
                            for n in nodes for i in n.inputs if const_value(i) is not None)
        tol = 3e-3 if low_precision else 1e-5
        errors = {}
        for name, fn in GELU_FORMS.items():
            ref = fn(_SAMPLES)
            errors[name] = float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref))))
        best, other = sorted(errors, key=errors.get)
        if errors[best] <= tol and errors[best] < 0.5 * errors[other]:
            return best
        return None

