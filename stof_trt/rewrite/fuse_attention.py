"""Fuse a decomposed attention core (as torch.onnx.export writes it) into one StofSparseAttention node.

Matched (anchor: Softmax)::

      Q [B,H,Sq,D]      K: [B,H,Sk,D] | [B,Sk,H,D] | Kᵀ [B,H,D,Sk]
          |                   |
     Mul (scale, opt.)   Transpose (opt.) -- Mul (scale, opt.)
           \\                /
            MatMul  Q·Kᵀ                     [B,H,Sq,Sk]
               |
            Mul | Div  (scale, optional)
               |
            Add (mask / bias)  |  Where(cond, ·, fill)   (optional)
               |
            Softmax (axis -1)                <- anchor
               |
            Cast (optional)      V [B,H,Sk,D]
                 \\               /
                  MatMul  P·V                [B,H,Sq,D]

Replaced by (the Q/K/V projections stay)::

      Q   K'  V   row_ptr col_idx tile_bitmap_index bitmaps   [key_padding_mask]   [attn_bias]
       \\  |  /        (int32 initializers)                   (Cast of a [B,S]    (the graph's
        StofSparseAttention (domain stof)                      graph input)         bias)
               |
            [B,H,Sq,D]

K' is K with one composed Transpose (or none) so that it is [B,H,Sk,D]. Grouped-query attention written as repeat_kv
(Llama, Mistral, Qwen: K/V [B,Hkv,Sk,D] -> Unsqueeze(2) -> Expand [B,Hkv,H/Hkv,Sk,D] -> Reshape [B,H,Sk,D]) feeds the
node the un-expanded K and V: the kernels read K/V head h / (H/Hkv) themselves. The mask operand is classified by
:mod:`stof_trt.rewrite.mask_analysis`; a mask it cannot interpret stays exact as ``attn_bias``.
Legend: B batch, H heads, Sq/Sk query/key length, D head dim.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from .attention_common import AttentionEmitter, AttentionPlan, AttentionProbe, bool_mask_bias, choose_layout
from .base import Fusion, Match
from .mask_analysis import GraphMask, MaskTerm, name_pattern
from .matcher import const_value, internal_only, producer, scalar_value, single_consumer

#: Cast targets allowed between Softmax and P·V: TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16.
FLOAT_TYPES = (1, 10, 11, 16)
#: Ops that scale the scores by a scalar: op type -> (how the factor combines, which inputs may hold it).
SCALE_OPS = {"Mul": ("mul", (0, 1)), "Div": ("div", (1,))}


@dataclasses.dataclass
class _Core:
    softmax: gs.Node
    qk: gs.Node
    pv: gs.Node
    query: gs.Tensor
    key_source: gs.Tensor       # tensor the key is derived from
    key_perm: list[int] | None  # perm giving [B,H,Sk,D] from key_source (None = identity)
    kt: gs.Tensor               # the second MatMul input (shape probe)
    value: gs.Tensor
    scale: float
    scale_tensors: list[tuple[str, str]]  # non-constant scale factors: (tensor, "mul"|"div"), probed
    masks: list[MaskTerm]       # outermost first: a Where mask, then additive terms
    nodes: list[gs.Node]
    kv_sources: tuple[gs.Tensor, gs.Tensor] | None = None  # un-expanded K, V [B,Hkv,Sk,D] (set by _plan)


def repeat_kv_source(t: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """``t`` = Reshape(Expand(Unsqueeze(x, axes=[2]))) (repeat_kv): (x, the Expand's output); the shapes (x
    [B,Hkv,S,D], Expand [B,Hkv,g,S,D], t [B,Hkv·g,S,D]) are checked on the probe by the caller."""
    rs = producer(t)
    ex = producer(rs.inputs[0]) if rs is not None and rs.op == "Reshape" else None
    un = producer(ex.inputs[0]) if ex is not None and ex.op == "Expand" else None
    if un is None or un.op != "Unsqueeze":
        return None
    axes = un.attrs.get("axes") if len(un.inputs) < 2 else const_value(un.inputs[1])
    if axes is None or np.asarray(axes).reshape(-1).tolist() != [2]:
        return None
    return un.inputs[0], ex.outputs[0]


class FuseAttentionCore(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("Softmax",)
    pattern = "attention_core"

    def fuse(self, softmax: gs.Node) -> Match | None:
        outs = self.ctx.graph_outputs
        axis = softmax.attrs.get("axis", -1 if self.ctx.opset >= 13 else 1)
        if axis not in (-1, 3):
            self.debug(softmax, f"softmax axis {axis} is not the last axis")
            return None
        nodes = [softmax]
        # -- downstream: [Cast]* [Where(IsNaN(P), 0, P)] [Cast]* -> MatMul(P, V)
        nxt = self._skip_casts(softmax.outputs[0], nodes)
        guard = self._nan_guard(nodes[-1].outputs[0])
        if guard is not None:  # torch's SDPA export zeroes NaN rows (all keys masked): our semantics exactly
            nodes += guard
            nxt = self._skip_casts(guard[-1].outputs[0], nodes)
        if nxt is None or nxt.op != "MatMul" or nxt.inputs[0] is not nodes[-1].outputs[0]:
            probs = nodes[-1].outputs[0]
            if any(c.op == "MatMul" and c.inputs[0] is probs for c in probs.outputs):
                self.skip(softmax, "the attention probabilities are used elsewhere (e.g. output_attentions)")
            else:
                self.debug(softmax, "softmax output does not feed a single MatMul(P, V)")
            return None
        pv = nxt
        nodes.append(pv)
        # -- upstream: {Where(mask, ·, fill) | Add(·, mask or bias)}* -> [scale] -> MatMul(Q, Kᵀ)
        masks: list[MaskTerm] = []  # outermost first
        scores = softmax.inputs[0]
        for _ in range(6):
            p = producer(scores)
            if p is None or p.op not in ("Add", "Where") or self._find_qk(scores) is not None:
                break
            if p.op == "Where":
                cond, a, b = p.inputs
                if self._scores_side(a) and scalar_value(b) is not None:
                    scores, term = a, MaskTerm(cond.name, "allowed_bool", b)
                elif self._scores_side(b) and scalar_value(a) is not None:
                    scores, term = b, MaskTerm(cond.name, "masked_bool", a)
                else:
                    self.debug(softmax, "Where before softmax is not Where(mask, scores, fill)")
                    return None
            else:  # additive terms: a mask, a position bias (T5), ...
                side = next((i for i in (0, 1) if self._find_qk(p.inputs[i]) is not None), None)
                if side is None:
                    side = next((i for i in (0, 1) if self._scores_side(p.inputs[i])), None)
                if side is None:
                    self.debug(softmax, "Add before softmax has no Q·Kᵀ operand")
                    return None
                scores, term = p.inputs[side], MaskTerm(p.inputs[1 - side].name, "additive")
            masks.append(term)
            nodes.append(p)
        found = self._find_qk(scores)
        if found is None:
            self.debug(softmax, "no MatMul(Q, Kᵀ) (with an optional scalar scale) feeds the softmax")
            return None
        qk, scale_nodes, scale, scale_tensors = found
        nodes += scale_nodes + [qk]
        query, kt = qk.inputs
        # scalar scale folded into Q or K (SDPA-style exports scale both by sqrt(scale))
        query, scale, extra = self._absorb_scalar_mul(query, scale)
        nodes += extra
        key_source, key_perm, knodes, scale = self._key(kt, scale)
        nodes += knodes
        if not internal_only(nodes, {id(pv)}, outs):
            self.skip(softmax, "an intermediate of the attention core (scores or probabilities) is used elsewhere")
            return None
        core = _Core(softmax, qk, pv, query, key_source, key_perm, kt, pv.inputs[1], scale, scale_tensors, masks,
                     nodes)
        return Match(softmax, nodes, build=lambda: [], info={"core": core})

    # -- matching helpers --------------------------------------------------------------------------------------------
    def _scores_side(self, t: gs.Tensor, depth: int = 6) -> bool:
        """``t`` is the scaled Q·Kᵀ, possibly behind further mask Adds / Wheres (single-consumer chain)."""
        if self._find_qk(t) is not None:
            return True
        p = producer(t)
        if depth == 0 or p is None or p.op not in ("Add", "Where") or len(t.outputs) != 1:
            return False
        candidates = p.inputs if p.op == "Add" else p.inputs[1:]
        return any(self._scores_side(i, depth - 1) for i in candidates)

    def _skip_casts(self, t: gs.Tensor, nodes: list[gs.Node]) -> gs.Node | None:
        """Follow float Casts from ``t`` (appending them to ``nodes``); returns the next single consumer."""
        nxt = single_consumer(t, self.ctx.graph_outputs)
        while nxt is not None and nxt.op == "Cast" and nxt.attrs.get("to") in FLOAT_TYPES:
            nodes.append(nxt)
            nxt = single_consumer(nxt.outputs[0], self.ctx.graph_outputs)
        return nxt

    def _nan_guard(self, p: gs.Tensor) -> list[gs.Node] | None:
        """``Where(IsNaN(p), 0, p)`` on the probabilities: returns [IsNaN, Where] or None.

              P --> IsNaN --> Where(cond, 0, P) --> P'
              '-------------------------^
        """
        if p.name in self.ctx.graph_outputs or len(p.outputs) != 2:
            return None
        isnan = next((c for c in p.outputs if c.op == "IsNaN"), None)
        where = next((c for c in p.outputs if c.op == "Where"), None)
        if isnan is None or where is None or len(isnan.outputs[0].outputs) != 1 \
                or isnan.outputs[0].outputs[0] is not where:
            return None
        if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p or scalar_value(where.inputs[1]) != 0.0:
            return None
        return [isnan, where]

    def _find_qk(self, t: gs.Tensor):
        """MatMul(Q, Kᵀ) behind up to two scalar scale ops; returns (matmul, scale_nodes, scale, probed)."""
        outs = self.ctx.graph_outputs
        scale, scale_nodes, probed = 1.0, [], []
        for _ in range(3):
            node = producer(t)
            if node is None:
                return None
            if node.op == "MatMul":
                if scale_nodes and single_consumer(node.outputs[0], outs) is None:
                    return None
                return node, scale_nodes, scale, probed
            if node.op not in SCALE_OPS:
                return None
            how, positions = SCALE_OPS[node.op]
            choice = None
            for i in positions:  # a constant scalar factor
                v = scalar_value(node.inputs[i])
                if v is not None:
                    choice = (i, v)
                    break
            if choice is None:  # a computed factor (e.g. 1/sqrt(D) from a Shape): probed, must be one constant
                for i in positions:
                    data = producer(node.inputs[1 - i])
                    if data is not None and (data.op == "MatMul" or data.op in SCALE_OPS):
                        choice = (i, None)
                        break
            if choice is None:
                return None
            i, v = choice
            if v is not None:
                scale = scale * v if how == "mul" else scale / v
            else:
                probed.append((node.inputs[i].name, how))
            scale_nodes.append(node)
            t = node.inputs[1 - i]
        return None

    def _absorb_scalar_mul(self, t: gs.Tensor, scale: float):
        node = producer(t)
        if node is not None and node.op == "Mul" and single_consumer(t, self.ctx.graph_outputs) is not None:
            for i in (0, 1):
                v = scalar_value(node.inputs[i])
                if v is not None:
                    return node.inputs[1 - i], scale * v, [node]
        return t, scale, []

    def _key(self, kt: gs.Tensor, scale: float):
        """(source tensor, perm to [B,H,Sk,D] or None, nodes taken, scale) for the MatMul's Kᵀ operand."""
        outs = self.ctx.graph_outputs
        taken = []
        kt, scale, extra = self._absorb_scalar_mul(kt, scale)
        taken += extra
        node = producer(kt)
        swap = [0, 1, 3, 2]
        if node is not None and node.op == "Transpose" and single_consumer(kt, outs) is not None \
                and len(node.attrs.get("perm", [])) == 4:
            perm = list(node.attrs["perm"])
            composed = [perm[i] for i in swap]
            src, scale, extra = self._absorb_scalar_mul(node.inputs[0], scale)
            return src, (None if composed == [0, 1, 2, 3] else composed), taken + [node] + extra, scale
        return kt, swap, taken, scale

    # -- analysis: probe the model once for every core -----------------------------------------------------------------
    def analyze(self, matches: list[Match]) -> list[Match]:
        if not matches:
            return matches
        cores = [m.info["core"] for m in matches]
        shapes = {n for c in cores for n in (c.query.name, c.kt.name, c.value.name)}
        for c in cores:  # repeat_kv candidates (key: only when no Transpose is left to apply)
            for t in ([c.key_source] if c.key_perm is None else []) + [c.value]:
                found = repeat_kv_source(t)
                shapes.update([t.name, found[0].name, found[1].name] if found else [])
        scales = {n for c in cores for n, _ in c.scale_tensors}
        probe = AttentionProbe(self.ctx, self.graph, shapes, [t for c in cores for t in c.masks], scales)
        kept = []
        for m, c in zip(matches, cores):
            plan = self._plan(c, probe)
            if plan is None:
                continue
            m.info = plan.info()
            m.info["anchor"] = c.softmax.name
            m.info["kv_heads"] = probe.shape(c.kv_sources[0].name)[1] if c.kv_sources else plan.heads
            m.build = self._builder(c, plan, m.info)
            kept.append(m)
        return kept

    def _plan(self, c: _Core, probe: AttentionProbe) -> AttentionPlan | None:
        qs, kts, vs = probe.shape(c.query.name), probe.shape(c.kt.name), probe.shape(c.value.name)
        if len(qs) != 4 or len(kts) != 4 or len(vs) != 4:
            self.skip(c.softmax, f"Q/Kᵀ/V ranks {len(qs)}/{len(kts)}/{len(vs)}: only 4-D [B,H,S,D] attention is "
                                 "supported")
            return None
        _, H, sq, D = qs
        sk = kts[3]
        if kts[1] != H or vs[1] != H or kts[2] != D or vs[2] != sk:
            self.skip(c.softmax, f"shapes Q{qs} Kᵀ{kts} V{vs} are not [B,H,Sq,D]/[B,H,D,Sk]/[B,H,Sk,D] "
                                 "(grouped or multi-query heads are not supported)")
            return None
        c.kv_sources = self._grouped_kv(c, probe, qs)
        scale = c.scale
        for name, how in c.scale_tensors:
            v = probe.constant_scalar(name)
            if v is None:
                self.skip(c.softmax, "the score scale is not one constant")
                return None
            scale = scale * v if how == "mul" else scale / v
        gmask, bias_terms, static_terms = self._combine_masks(c, probe, sq, sk, H)
        layout, source = choose_layout(self.ctx.options, gmask, sq, sk, H, probe=probe, terms=tuple(static_terms))
        if bias_terms:
            source += " + graph bias (kept as attn_bias)"
        plan = AttentionPlan(name=c.softmax.name, heads=H, head_dim=D, seq_q=sq, seq_k=sk, scale=scale,
                             layout=layout, mask_source=source.replace("none (full layout) + ", ""),
                             padding_input=gmask.padding_input if gmask is not None else None)
        plan.bias_term = bias_terms or None
        return plan

    @staticmethod
    def _grouped_kv(c: _Core, probe: AttentionProbe, qs: tuple) -> tuple[gs.Tensor, gs.Tensor] | None:
        """The un-expanded (K, V) when both are repeat_kv of [B,Hkv,Sk,D] tensors with one Hkv, else None."""
        if c.key_perm is not None:
            return None
        found = [repeat_kv_source(t) for t in (c.key_source, c.value)]
        if None in found:
            return None
        B, H, _, D = qs
        hkv = set()
        for (src, wide), full in zip(found, (c.key_source, c.value)):
            s, w, f = probe.shape(src.name), probe.shape(wide.name), probe.shape(full.name)
            if len(s) != 4 or len(w) != 5 or s[1] < 1 or H % s[1] != 0 or s[3] != D or s[0] != B \
                    or tuple(w) != (s[0], s[1], H // s[1], s[2], s[3]) or tuple(f) != (s[0], H, s[2], s[3]):
                return None
            hkv.add(s[1])
        return (found[0][0], found[1][0]) if len(hkv) == 1 else None

    def _combine_masks(self, c: _Core, probe: AttentionProbe, sq: int, sk: int, H: int):
        """Classify every mask term; intersect the static parts, keep one key padding input, and return the
        terms that stay biases (general biases, or a second padding input) and those the static part comes from."""
        if not c.masks:
            return None, [], []
        static, pad, bias_terms, static_terms = None, None, [], []
        for term in c.masks:
            g = probe.classify(term, sq, sk, H, (c.query.name, 2, c.kt.name, 3))
            if g.kind == "bias" or (g.padding_input and pad and g.padding_input != pad):
                bias_terms.append(term)
                self.ctx.report.notes.append(f"{c.softmax.name}: {term.tensor} kept as attn_bias: "
                                             f"{g.reason or 'a second padding input'}")
                continue
            if g.static is not None:
                static = g.static if static is None else np.logical_and(static, g.static)
                static_terms.append(term)
            pad = pad or g.padding_input
        if static is None and pad is None:
            return GraphMask("none"), bias_terms, static_terms
        kind = ("static+padding" if pad else "static") if static is not None else "padding"
        return (GraphMask(kind, static, pad, name_pattern(static) if static is not None else ""), bias_terms,
                static_terms)

    def _builder(self, c: _Core, plan: AttentionPlan, info: dict):
        def build() -> list[gs.Node]:
            new: list[gs.Node] = []
            emitter = AttentionEmitter(self)
            key, value = c.kv_sources or (c.key_source, c.value)
            if c.key_perm is not None:
                key = self.new_var("stof_key", dtype=c.key_source.dtype)
                new.append(gs.Node("Transpose", self.ctx.unique("stof_key_transpose"), {"perm": c.key_perm},
                                   [c.key_source], [key]))
            biases = []
            for term in plan.bias_term or []:
                mask_t = self.graph.tensors()[term.tensor]
                if term.mode == "additive":
                    biases.append(mask_t)
                else:
                    biases.append(bool_mask_bias(self, mask_t, term.mode == "allowed_bool", term.fill, c.query, new))
            while len(biases) > 1:  # several kept terms: one summed bias
                total = self.new_var("stof_attn_bias_sum", dtype=biases[0].dtype)
                new.append(gs.Node("Add", self.ctx.unique("stof_bias_add"), {}, biases[:2], [total]))
                biases = [total] + biases[2:]
            plan.bias = biases[0] if biases else None
            emitter.node(plan, c.query, key, value, output, new)
            info["name"] = plan.name
            return new
        output = c.pv.outputs[0]  # captured now: build() runs after the matched nodes are disconnected
        return build
