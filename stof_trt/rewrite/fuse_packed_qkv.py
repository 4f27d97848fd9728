"""Feed StofSparseAttention from one packed Q/K/V projection, read through strides (``qkv_format="bs3hd"``).

Runs after the attention fusions, on the StofSparseAttention nodes they emitted. Matched::

    X --MatMul(Wq)--Add(bq)--Reshape[B,S,H,D]--Transpose(0,2,1,3)--.
    X --MatMul(Wk)--Add(bk)--Reshape[B,S,H,D]--Transpose(s) -------+--> StofSparseAttention --> Transpose(0,2,1,3) --> Y
    X --MatMul(Wv)--Add(bv)--Reshape[B,S,H,D]--Transpose(0,2,1,3)--'         (layout, padding, bias inputs)

(BERT-style: three projections of the same X with constant weights), or the three outputs of one ``Split`` into
equal thirds of the last axis (GPT-2's Conv1D ``c_attn``: one [B,S,3·H·D] projection) in place of the three
MatMul + Add. The key may reach the node through up to two Transposes whose composition is (0,2,1,3). X (or the
Split's input, then [B,S,3·H·D]) must be rank 3 with the B, S of the heads (checked on run-time shapes): flattened
[B·S, hidden] projections and per-head [B,S,H,3·D] splits (GPT-NeoX) stay unpacked, as do tied projections (K = Q).

Replaced by::

    X --StofGemmEpilogue(W=[Wq|Wk|Wv], bias=[bq|bk|bv])--Reshape[B,S,3,H,D]--StofSparseAttention(bs3hd)--> Y

The attention node reads Q, K and V in place from the packed tensor and writes Y = [B,S,H,D] directly: one GEMM
with the bias in its epilogue instead of three GEMMs and three bias Adds, and no transposes (4 per layer). The
downstream Reshape to [B,S,H·D] is kept (a free view). Nodes whose tensors have other consumers are left alone.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Fusion, Match
from .functions import attention_overload
from .matcher import const_value, producer, single_consumer
from .probe import Probe


def _compose(p_first: list[int], p_second: list[int]) -> list[int]:
    """Transpose(Transpose(x, p_first), p_second) == Transpose(x, result)."""
    return [p_first[i] for i in p_second]


class FusePackedQkv(Fusion):
    fused_op_type = "StofSparseAttention"
    search_op_types = ("StofSparseAttention",)
    pattern = "packed_qkv"

    def fuse(self, node: gs.Node) -> Match | None:
        if node.domain != "stof" or node.attrs.get("qkv_format", "bhsd") not in ("bhsd", b"bhsd"):
            return None
        dims = {a.get("name"): a for a in self.ctx.report.attention}.get(node.name)
        if dims is None:
            self.debug(node, "not emitted by this rewrite (heads / head dim unknown)")
            return None
        H, D = int(dims["heads"]), int(dims["head_dim"])
        if dims["seq_q"] != dims["seq_k"]:
            self.debug(node, "cross attention (Sq != Sk)")
            return None
        outs = self.ctx.graph_outputs
        taken: list[gs.Node] = [node]
        projections, heads = [], []
        for which in range(3):
            chain = self._to_reshape(node.inputs[which], H, D)
            if chain is None:
                self.debug(node, f"input {which} is not Reshape[B,S,H,D] -> Transpose(0,2,1,3)")
                return None
            reshape, transposes = chain
            taken += transposes + [reshape]
            projections.append(reshape.inputs[0])
            heads.append(reshape.outputs[0])
        if len({id(t) for t in projections}) != 3:  # tied projections (e.g. K is Q): one tensor, not three thirds
            self.debug(node, "two of Q/K/V are the same projection")
            return None
        # -- the output: [B,H,S,D] -> Transpose(0,2,1,3)
        out_t = single_consumer(node.outputs[0], outs)
        if out_t is None or out_t.op != "Transpose" or list(out_t.attrs.get("perm", [])) != [0, 2, 1, 3]:
            self.debug(node, "output does not feed a single Transpose(0,2,1,3)")
            return None
        taken.append(out_t)
        # -- the projections: one Split into thirds, or three MatMul + Add of the same X
        split = self._split_source(projections, H * D)
        if split is not None:
            split_node, packed_src = split
            taken.append(split_node)
            gemm = None
        else:
            # a new GEMM node is an epilogue node: not with rewrite_model(epilogues=False)
            gemm = self._matmul_sources(projections, H * D) if self.ctx.options.get("epilogues", True) else None
            if gemm is None:
                self.debug(node, "Q/K/V are neither one Split nor MatMul + bias of one input")
                return None
            nodes, x, w, bias = gemm
            taken += nodes
            packed_src = None
        ids = {id(n) for n in taken}
        for n in taken:
            if n is node or n is out_t:
                continue
            for o in n.outputs:
                users = [c for c in o.outputs if id(c) not in ids and not self._only_feeds(c, ids)]
                if users or o.name in outs:
                    self.debug(node, f"{n.name} has consumers outside the pattern")
                    return None
        y = out_t.outputs[0]
        inputs = list(node.inputs)
        attrs = dict(node.attrs)
        name = node.name
        overload = self.ctx.overloads.get(name, "")

        def build() -> list[gs.Node]:
            new: list[gs.Node] = []
            src = packed_src
            if gemm is not None:
                src = self.new_var("stof_qkv", dtype=x.dtype)
                new.append(self.ctx.gemm_node(x, self.new_const("stof_qkv_weight", w),
                                              self.new_const("stof_qkv_bias", bias), src))
            packed = self.new_var("stof_qkv_packed", dtype=src.dtype)
            new.append(gs.Node("Reshape", self.ctx.unique("stof_qkv_split_heads"), {},
                               [src, self.new_const("stof_qkv_shape", np.array([0, 0, 3, H, D], np.int64))],
                               [packed]))
            a = dict(attrs)
            a["qkv_format"] = "bs3hd"
            rest = inputs[3:]
            att = gs.Node("StofSparseAttention", name, a, [packed, gs.Variable.empty(), gs.Variable.empty(), *rest],
                          [y], domain="stof")
            has_pad = "padding" in overload
            has_bias = "bias" in overload
            ov = attention_overload(has_pad, has_bias, packed=True)
            self.ctx.overloads[name] = ov
            self.ctx.functions.add(("StofSparseAttention", ov))
            new.append(att)
            return new

        info = {"name": name, "heads": H, "head_dim": D, "source": "split" if gemm is None else "matmul_add",
                "_source": ((packed_src if gemm is None else x).name, heads[0].name,
                            3 * H * D if gemm is None else None)}
        return Match(node, taken, build, info)

    def apply(self) -> int:
        n = super().apply()
        if n:  # attention nodes that are no longer in the base overload may leave unused functions behind
            used = {(nd.op, self.ctx.overloads.get(nd.name, "")) for nd in self.graph.nodes if nd.domain == "stof"}
            self.ctx.functions &= used
        return n

    def analyze(self, matches: list[Match]) -> list[Match]:
        """Keep the matches whose projection source is [B, S, ·] with the B, S of the heads' Reshape [B, S, H, D]
        (a Split source: [B, S, 3·H·D]): the packed Reshape [0, 0, 3, H, D] copies its first two dims, so a
        flattened [B·S, hidden] projection or a per-head [B, S, H, 3·D] Split stays unpacked. Run-time shapes of
        the original model at two sizes, as for FuseAddLayerNorm's residual check."""
        if not matches:
            return matches
        model = self.ctx.options["_original_model"]
        known = {t for n in model.graph.node for t in n.output} | {i.name for i in model.graph.input}
        checks = [m.info.pop("_source") for m in matches]
        names = sorted({n for src, out, _ in checks for n in (src, out) if n in known})
        seq = min(self.ctx.options.get("max_seq_len") or 8, 8)
        try:
            probe = Probe(model, [], names)
            runs = [probe.run(2, seq)[1], probe.run(3, max(1, seq - 3))[1]] if names else []
        except Exception as exc:  # noqa: BLE001 - cannot prove the shapes: leave every attention unpacked
            for m in matches:
                self.skip(m.anchor, f"cannot check the projection shapes: {str(exc)[:100]}")
            return []
        kept = []
        for m, (src, out, last) in zip(matches, checks):
            if src not in known:  # made by FuseOrtAttention from the contrib op's [B, S, hidden] input
                kept.append(m)
                continue
            ok = all(len(r[src]) == 3 and (last is None or r[src][2] == last)
                     and (out not in known or tuple(r[src][:2]) == tuple(r[out][:2])) for r in runs)
            if ok:
                kept.append(m)
            else:
                self.skip(m.anchor, f"projection source {runs[0][src]} is not [B, S, hidden]"
                                    + (f" with hidden {last}" if last else "") + ": Q/K/V left unpacked")
        return kept

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _only_feeds(self, start: gs.Node, ids: set[int], limit: int = 32) -> bool:
        """``start`` (e.g. a Shape of a projection, for a Reshape target) and everything downstream of it feed
        only nodes of the pattern: once the pattern is replaced they are dead and the cleanup drops them."""
        outs = self.ctx.graph_outputs
        todo, seen = [start], set()
        while todo:
            n = todo.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if len(seen) > limit or n.op not in ("Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast",
                                                 "Mul", "Div", "Add", "Sub"):
                return False
            for o in n.outputs:
                if o.name in outs:
                    return False
                for c in o.outputs:
                    if id(c) not in ids:
                        todo.append(c)
        return True

    def _to_reshape(self, t: gs.Tensor, H: int, D: int):
        """(Reshape, [Transposes]) when ``t`` = Transpose chain (total perm (0,2,1,3)) of Reshape(P, [B,S,H,D])."""
        perm = [0, 1, 2, 3]
        transposes = []
        cur = t
        for _ in range(2):
            p = producer(cur)
            if p is None or p.op != "Transpose":
                break
            pp = list(p.attrs.get("perm", []))
            if len(pp) != 4:
                return None
            perm = _compose(pp, perm)
            transposes.append(p)
            cur = p.inputs[0]
        r = producer(cur)
        if perm != [0, 2, 1, 3] or r is None or r.op != "Reshape":
            return None
        shape = const_value(r.inputs[1])
        if shape is not None:
            shape = [int(v) for v in np.asarray(shape).reshape(-1)]
            if len(shape) != 4 or shape[2:] not in ([H, D], [H, -1], [-1, D]):
                return None
        return r, transposes

    def _split_source(self, projections: list[gs.Tensor], hd: int):
        p = [producer(t) for t in projections]
        if p[0] is None or p[0].op != "Split" or any(q is not p[0] for q in p):
            return None
        split = p[0]
        if len(split.outputs) != 3 or [split.outputs.index(t) for t in projections] != [0, 1, 2]:
            return None
        if split.attrs.get("axis", 0) not in (-1, 2):
            return None
        sizes = split.attrs.get("split")
        if sizes is None and len(split.inputs) > 1 and split.inputs[1].name:
            sizes = const_value(split.inputs[1])
            if sizes is None:
                return None
        if sizes is not None and [int(v) for v in np.asarray(sizes).reshape(-1)] != [hd] * 3:
            return None
        return split, split.inputs[0]

    def _matmul_sources(self, projections: list[gs.Tensor], hd: int):
        nodes, ws, bs, x = [], [], [], None
        for t in projections:
            add = producer(t)
            if add is None or add.op != "Add":
                return None
            mm_side = next((i for i in (0, 1) if producer(add.inputs[i]) is not None
                            and producer(add.inputs[i]).op == "MatMul"), None)
            if mm_side is None:
                return None
            mm = producer(add.inputs[mm_side])
            b = const_value(add.inputs[1 - mm_side])
            w = const_value(mm.inputs[1])
            if b is None or w is None or w.ndim != 2 or w.shape[1] != hd or b.reshape(-1).shape != (hd,):
                return None
            if x is None:
                x = mm.inputs[0]
            elif mm.inputs[0] is not x:
                return None
            nodes += [add, mm]
            ws.append(w)
            bs.append(b.reshape(-1).astype(w.dtype))
        if len({w.dtype for w in ws}) != 1:
            return None
        return nodes, x, np.ascontiguousarray(np.concatenate(ws, axis=1)), np.concatenate(bs)
