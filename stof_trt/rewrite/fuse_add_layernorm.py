"""Residual Add (+ bias) + LayerNormalization -> StofAddLayerNorm; decomposed LayerNorm -> LayerNormalization.

FuseAddLayerNorm (anchor: LayerNormalization)::

      X [..., N]   bias [N] (constant, optional)
          \\        /
           Add (bias)         residual [..., N]  (same shape as X)
              \\               /
                Add (residual)  ----> S, may feed other nodes (pre-LN models reuse it as the next residual)
                  |
          LayerNormalization (last axis; gamma [N], beta [N])      <- anchor
                  |
                  Y

becomes ``StofAddLayerNorm(X, residual, gamma, beta[, bias], epsilon) -> Y[, S]`` (output 1 only when S has
other consumers). The MatMul that produced X stays a MatMul. X and residual must have the same run-time shape
(checked by evaluating the original model at two sizes), so kernels never broadcast.

FuseLayerNormDecomposed (anchor: Div), for exporters that spell LayerNorm out::

      x --> ReduceMean --> Sub(x, mean) = d --> Pow(d, 2) --> ReduceMean --> Add(eps) --> Sqrt
                              \\                                                        /
                               `-------------------------> Div(d, ·) <-----------------'
                                                            |
                                                  Mul(gamma) --> Add(beta) --> y

becomes ``LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)`` (opset >= 17), which FuseAddLayerNorm
then fuses with its residual Add. Legend: N hidden size.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Fusion, Match
from .functions import add_layernorm_overload
from .matcher import const_value, match_parent_path, producer, scalar_value, single_consumer
from .probe import Probe


class FuseLayerNormDecomposed(Fusion):
    fused_op_type = "LayerNormalization"
    search_op_types = ("Div",)
    pattern = "layernorm_decomposed"

    #: From Div upwards through the denominator: op types and input indices.
    DENOMINATOR = (["Sqrt", "Add", "ReduceMean", "Pow", "Sub"], [1, 0, None, 0, 0])

    def fuse(self, div: gs.Node) -> Match | None:
        outs = self.ctx.graph_outputs
        path = match_parent_path(div, *self.DENOMINATOR)
        if path is None:
            self.debug(div, "no Sqrt(ReduceMean(Pow(Sub)) + eps) denominator")
            return None
        sqrt, add_eps, var_mean, pow_, sub = path
        if producer(div.inputs[0]) is not sub:
            self.debug(div, "numerator is not the centred input")
            return None
        x = sub.inputs[0]
        mean = producer(sub.inputs[1])
        if mean is None or mean.op != "ReduceMean" or mean.inputs[0] is not x:
            self.debug(div, "Sub is not x - ReduceMean(x)")
            return None
        if not all(self._last_axis(r) for r in (mean, var_mean)):
            self.debug(div, "ReduceMean is not over the last axis only")
            return None
        if scalar_value(pow_.inputs[1]) != 2.0:
            self.debug(div, "Pow exponent is not 2")
            return None
        eps = scalar_value(add_eps.inputs[1]) if scalar_value(add_eps.inputs[1]) is not None \
            else scalar_value(add_eps.inputs[0])
        if eps is None:
            self.debug(div, "epsilon is not a scalar constant")
            return None
        mul = single_consumer(div.outputs[0], outs)
        add_beta = single_consumer(mul.outputs[0], outs) if mul is not None and mul.op == "Mul" else None
        if add_beta is None or add_beta.op != "Add":
            self.debug(div, "no Mul(gamma) -> Add(beta) after the normalisation")
            return None
        gamma = next((i for i in mul.inputs if i is not div.outputs[0]), None)
        beta = next((i for i in add_beta.inputs if i is not mul.outputs[0]), None)
        g, b = const_value(gamma), const_value(beta)
        if g is None or b is None or g.ndim != 1 or b.shape != g.shape:
            self.debug(div, "gamma / beta are not constant vectors")
            return None
        nodes = [mean, sub, pow_, var_mean, add_eps, sqrt, div, mul, add_beta]
        ids = {id(n) for n in nodes}
        for n in nodes[:-1]:
            for o in n.outputs:
                if o.name in outs or any(id(c) not in ids for c in o.outputs):
                    self.debug(div, "a LayerNorm intermediate is used elsewhere")
                    return None
        if self.ctx.opset < 17:
            self.skip(div, f"opset {self.ctx.opset} has no LayerNormalization: decomposed LayerNorm kept")
            return None
        y = add_beta.outputs[0]

        def build():
            return [gs.Node("LayerNormalization", self.ctx.unique("stof_layernorm"),
                            {"axis": -1, "epsilon": float(eps)}, [x, gamma, beta], [y])]

        return Match(div, nodes, build, {"epsilon": eps})

    @staticmethod
    def _last_axis(node: gs.Node) -> bool:
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1:
            v = const_value(node.inputs[1])
            axes = None if v is None else v.tolist()
        return axes is not None and list(np.atleast_1d(axes)) == [-1] and node.attrs.get("keepdims", 1) == 1


class FuseAddLayerNorm(Fusion):
    fused_op_type = "StofAddLayerNorm"
    search_op_types = ("LayerNormalization",)
    pattern = "add_layernorm"

    def fuse(self, ln: gs.Node) -> Match | None:
        outs = self.ctx.graph_outputs
        if ln.attrs.get("axis", -1) != -1 or ln.attrs.get("stash_type", 1) != 1:
            self.debug(ln, "LayerNormalization is not over the last axis with fp32 stash")
            return None
        if len(ln.inputs) < 3 or len(ln.outputs) != 1 and any(o.outputs for o in ln.outputs[1:]):
            self.debug(ln, "LayerNormalization without beta or with mean/inv-std outputs in use")
            return None
        s = ln.inputs[0]
        add = producer(s)
        if add is None or add.op != "Add" or any(const_value(i) is not None for i in add.inputs):
            self.debug(ln, "LayerNorm input is not a residual Add of two tensors")
            return None
        gamma, beta = ln.inputs[1], ln.inputs[2]
        g = const_value(gamma)
        if g is not None and g.ndim != 1:
            self.debug(ln, "gamma is not a vector")
            return None
        x, residual, bias, bias_add = add.inputs[0], add.inputs[1], None, None
        for i in (0, 1):
            p = producer(add.inputs[i])
            if p is None or p.op != "Add" or single_consumer(add.inputs[i], outs) is None:
                continue
            for j in (0, 1):
                c = const_value(p.inputs[j])
                if c is not None and g is not None and c.size == g.size and const_value(p.inputs[1 - j]) is None:
                    x, bias, bias_add = p.inputs[1 - j], p.inputs[j], p
                    residual = add.inputs[1 - i]
                    break
            if bias is not None:
                break
        remove = [n for n in (bias_add, add, ln) if n is not None]
        extra_sum = s.name in outs or any(c is not ln for c in s.outputs)
        y = ln.outputs[0]
        eps = float(ln.attrs.get("epsilon", 1e-5))
        bias_value = const_value(bias) if bias is not None else None

        def build():
            bias_in = bias
            if bias is not None and (not isinstance(bias, gs.Constant) or bias_value.ndim != 1):
                bias_in = self.new_const("stof_addln_bias", np.ascontiguousarray(bias_value.reshape(-1)))
            inputs = [x, residual, gamma, beta] + ([bias_in] if bias is not None else [])
            node = gs.Node("StofAddLayerNorm", self.ctx.unique("StofAddLayerNorm"), {"epsilon": eps}, inputs,
                           [y, s] if extra_sum else [y], domain="stof")
            overload = add_layernorm_overload(bias is not None, extra_sum)
            self.ctx.overloads[node.name] = overload
            self.ctx.functions.add(("StofAddLayerNorm", overload))
            return [node]

        return Match(ln, remove, build, {"bias": bias is not None, "sum_output": extra_sum,
                                         "_shapes": (x.name, residual.name)})

    def analyze(self, matches: list[Match]) -> list[Match]:
        return keep_same_shapes(self, matches)


def keep_same_shapes(fusion: Fusion, matches: list[Match]) -> list[Match]:
    """Keep the matches whose two tensors ``info["_shapes"]`` (X, residual) have the same run-time shape, evaluated
    on the original model at two batch sizes and lengths (so kernels never have to broadcast)."""
    if not matches:
        return matches
    ctx = fusion.ctx
    model = ctx.options["_original_model"]
    known = {t for n in model.graph.node for t in n.output} | {i.name for i in model.graph.input}
    names = sorted({n for m in matches for n in m.info["_shapes"] if n in known})
    seq = min(ctx.options.get("max_seq_len") or 8, 8)  # any length shows a broadcast; short is cheap
    try:
        probe = Probe(model, [], names)
        runs = [probe.run(2, seq)[1], probe.run(3, max(1, seq - 3))[1]]
    except Exception as exc:  # noqa: BLE001 - cannot prove the shapes: leave every match alone
        for m in matches:
            fusion.skip(m.anchor, f"cannot check residual shapes: {str(exc)[:100]}")
        return []
    kept = []
    for m in matches:
        a, b = m.info.pop("_shapes")
        if a not in known or b not in known:
            fusion.skip(m.anchor, "X / residual not in the original model: shapes cannot be checked")
        elif all(r[a] == r[b] for r in runs):
            kept.append(m)
        else:
            fusion.skip(m.anchor, f"X {runs[0][a]} and residual {runs[0][b]} differ in shape (broadcast add)")
    return kept
