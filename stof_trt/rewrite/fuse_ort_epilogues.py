"""ONNX Runtime's own epilogue ops (com.microsoft, from onnxruntime.transformers.optimizer) -> STOF epilogues.

FuseOrtSkipLayerNorm (anchor: SkipLayerNormalization)::

      input [..., N]   skip [..., N]   gamma   beta   bias (optional)
              \\           |            |      |      /
               SkipLayerNormalization (epsilon) -> Y [, mean, inv_std (unused), input_skip_bias_sum]

  becomes ``StofAddLayerNorm(X=input, residual=skip, gamma, beta[, bias]) -> Y[, sum]`` (same shapes checked as in
  FuseAddLayerNorm; a broadcast skip is left alone).

FuseOrtBiasGelu (anchor: BiasGelu | FastGelu | Gelu)::

      X [..., K]   W [K, N] (constant)
            \\      /
             MatMul          bias [N] (constant, optional)
                \\            /
      BiasGelu (erf) | FastGelu (tanh) | Gelu (erf, no bias)  -> y

  becomes ``StofGemmEpilogue(X, W, bias, activation) -> y`` (zeros when the op has no bias).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Fusion, Match
from .fuse_add_layernorm import keep_same_shapes
from .functions import add_layernorm_overload
from .matcher import const_value, producer

ORT_DOMAIN = "com.microsoft"

#: op type -> (activation, index of the bias input or None)
GELU_OPS = {"BiasGelu": ("gelu_erf", 1), "FastGelu": ("gelu_tanh", 1), "Gelu": ("gelu_erf", None)}


class FuseOrtSkipLayerNorm(Fusion):
    fused_op_type = "StofAddLayerNorm"
    search_op_types = ("SkipLayerNormalization",)
    pattern = "ort_skip_layernorm"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        outs = self.ctx.graph_outputs
        if any(i < len(node.outputs) and (node.outputs[i].name in outs or node.outputs[i].outputs)
               for i in (1, 2)):
            self.skip(node, "mean / inv_std outputs are used")
            return None
        x, skip_t, gamma = node.inputs[:3]
        beta = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
        bias = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4].name else None
        g = const_value(gamma)
        if beta is None and (g is None or g.ndim != 1):
            self.skip(node, "no beta and gamma is not a constant vector")
            return None
        y = node.outputs[0]
        sum_t = node.outputs[3] if len(node.outputs) > 3 and (node.outputs[3].name in outs or
                                                              node.outputs[3].outputs) else None
        eps = float(node.attrs.get("epsilon", 1e-12))

        def build():
            beta_in = beta if beta is not None else self.new_const("stof_zero_beta", np.zeros_like(g))
            inputs = [x, skip_t, gamma, beta_in] + ([bias] if bias is not None else [])
            new = gs.Node("StofAddLayerNorm", self.ctx.unique("StofAddLayerNorm"), {"epsilon": eps}, inputs,
                          [y, sum_t] if sum_t is not None else [y], domain="stof")
            overload = add_layernorm_overload(bias is not None, sum_t is not None)
            self.ctx.overloads[new.name] = overload
            self.ctx.functions.add(("StofAddLayerNorm", overload))
            return [new]

        return Match(node, [node], build, {"bias": bias is not None, "sum_output": sum_t is not None,
                                           "_shapes": (x.name, skip_t.name)})

    def analyze(self, matches: list[Match]) -> list[Match]:
        return keep_same_shapes(self, matches)


class FuseOrtBiasGelu(Fusion):
    fused_op_type = "StofGemmEpilogue"
    search_op_types = tuple(GELU_OPS)
    pattern = "ort_bias_gelu"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != ORT_DOMAIN:
            return None
        outs = self.ctx.graph_outputs
        activation, bias_index = GELU_OPS[node.op]
        pre = node.inputs[0]
        mm = producer(pre)
        if mm is None or mm.op != "MatMul" or pre.name in outs or len(pre.outputs) != 1:
            self.debug(node, "input is not a MatMul used only by the activation")
            return None
        W = const_value(mm.inputs[1])
        if W is None or W.ndim != 2:
            self.debug(node, "MatMul weight is not a constant 2-D matrix")
            return None
        N = W.shape[1]
        bias_t = node.inputs[bias_index] if bias_index is not None and len(node.inputs) > bias_index \
            and node.inputs[bias_index].name else None
        bias = const_value(bias_t) if bias_t is not None else np.zeros(N, W.dtype)
        if bias is None or bias.size != N:
            self.debug(node, f"bias is not a constant of size N={N}")
            return None
        X, W_t, y = mm.inputs[0], mm.inputs[1], node.outputs[0]

        def build():
            w_in = W_t if isinstance(W_t, gs.Constant) else self.new_const("stof_gemm_weight", W)
            b_in = bias_t if isinstance(bias_t, gs.Constant) and bias.ndim == 1 else \
                self.new_const("stof_gemm_bias", np.ascontiguousarray(bias.reshape(N)))
            return [self.ctx.gemm_node(X, w_in, b_in, y, activation)]

        return Match(node, [mm, node], build, {"variant": node.op, "activation": activation})
