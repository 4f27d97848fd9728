"""Run the token-wise part of a padded model on the real tokens only (``qkv_format="t3hd"``).

Runs last, on the graph the other fusions left. From the tensor that feeds the first block ([B, S, hidden], e.g.
the embeddings' sum) the *region* grows forward through ops that act on each token on its own: MatMul / Gemm
with constant weights, element-wise ops with constants or other region tensors, LayerNormalization over the
features, activations, Cast / Identity / Dropout, StofGemmEpilogue and StofAddLayerNorm, Reshapes that keep the
token axes ([B, S, ·] <-> [B·S, ·], the [B, S, 3, H, D] heads split) and packed (bs3hd) attention nodes. Then::

    mask [B,S] --> idx = NonZero(mask != 0) [T], seq_offsets = [0, cumsum(lengths)] int32 [B+1]
    X [B,S,hidden] --Reshape[-1,hidden]--Gather(idx)--> Xp [T,hidden] --> region ops on T tokens -->
        StofSparseAttention(t3hd, seq_offsets) ... --> Yp [T,F] --Gather rows [Yp ; 0] by position--Reshape--> Y [B,S,F]

Every Reshape of the region gets a token target [-1, F], every attention node reads [T, 3, H, D] with the
packed sequences' offsets, every tensor leaving the region (graph outputs, a pooler's Gather, ...) is restored to
its padded layout with zeros at padded positions, and a Shape of a region tensor is rebuilt from the mask's
[B, S]. Packing is exact for any padding (right, left, holes) when each attention only depends on the order of the
real tokens: a full or causal layout. Otherwise (sliding windows, global tokens, a kept attn_bias, several masks)
the model keeps its padded form and the report says why in one line.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..format import TileLayout
from ..nodes import TOKEN_CAPACITY_INPUT
from .base import Fusion
from .functions import attention_overload
from .matcher import const_value, producer

_UNARY = {"Gelu", "Erf", "Tanh", "Sigmoid", "Relu", "Cast", "Identity", "Dropout", "Sqrt", "Reciprocal", "Neg",
          "Abs", "Softplus", "FastGelu", "BiasGelu"}
_BINARY = {"Add", "Sub", "Mul", "Div", "Pow"}
_PROBE_SIZES = ((2, 5), (3, 7))


def _full_or_causal(lay: TileLayout) -> bool:
    """Every pair allowed, or exactly ``key <= query``; compared on the stored arrays (no dense matrix)."""
    from ..format import compile_mask

    counts = lay.class_counts()
    if counts["partial"] == 0 and counts["empty"] == 0:
        return True
    causal = compile_mask("causal", lay.seq_q, lay.seq_k, tile_m=lay.tile_m, tile_n=lay.tile_n)
    if lay.num_layouts == 1:
        return all(np.array_equal(a, b) for a, b in zip(lay.arrays().values(), causal.arrays().values()))
    if lay.num_layouts * lay.seq_q * lay.seq_k > 1 << 27:  # per-head layouts of a long model: not worth a check
        return False
    return bool((lay.to_dense() == np.tril(np.ones((lay.seq_q, lay.seq_k), bool))).all())


class NotApplicable(Exception):
    """Why the model keeps its padded form (one line, in the report)."""


def _fmt(node: gs.Node) -> str:
    f = node.attrs.get("qkv_format", "bhsd")
    return f.decode() if isinstance(f, bytes) else str(f)


def _swap(tensors, old: gs.Tensor, new: gs.Tensor) -> None:
    """Replace ``old`` by ``new`` in a node's inputs or outputs (graphsurgeon lists take item assignment only)."""
    for i, x in enumerate(tensors):
        if x is old:
            tensors[i] = new


def _present(t) -> bool:
    return t is not None and bool(t.name)


class RemovePadding(Fusion):
    fused_op_type = "t3hd attention"
    pattern = "remove_padding"

    def apply(self) -> int:
        try:
            plan = self._plan()
        except NotApplicable as why:
            self.ctx.report.remove_padding = {"applied": False, "reason": str(why)}
            return 0
        self._rewrite(*plan)
        return 1

    # -- analysis -----------------------------------------------------------------------------------------------
    def _plan(self):
        g = self.graph
        g.toposort()
        atts = [n for n in g.nodes if n.op == "StofSparseAttention" and n.domain == "stof"]
        if not atts:
            raise NotApplicable("no attention node")
        masks = {}
        for n in atts:
            if _fmt(n) != "bs3hd":
                raise NotApplicable(f"{n.name}: Q/K/V are not one packed projection (qkv_format {_fmt(n)})")
            if len(n.inputs) > 8 and _present(n.inputs[8]):
                raise NotApplicable(f"{n.name}: has an attn_bias (a mask kept exact as a bias)")
            if len(n.inputs) < 8 or not _present(n.inputs[7]):
                raise NotApplicable(f"{n.name}: no padding mask")
            masks[n.inputs[7].name] = n.inputs[7]
            self._check_order_only(n)
        if len(masks) != 1:
            raise NotApplicable(f"{len(masks)} different padding masks: packing needs exactly one")
        kpm = next(iter(masks.values()))
        entry = self._entry(atts[0])
        orig_names = {t for n in self.ctx.options["_original_model"].graph.node for t in n.output}
        probed = self._probe(entry, kpm, orig_names)
        info, region = self._grow(entry, probed)
        missing = [n.name for n in atts if id(n) not in region]
        if missing:
            raise NotApplicable(f"{missing[0]}: not reached through token-wise ops from {entry.name}")
        return entry, kpm, info, region

    def _check_order_only(self, node: gs.Node) -> None:
        """The node's layout is full or causal over the sequence, so it only depends on the tokens' order."""
        arrays = [const_value(t) for t in node.inputs[3:7]]
        if any(a is None for a in arrays):
            raise NotApplicable(f"{node.name}: layout inputs are not constants")
        a = node.attrs
        lay = TileLayout.from_arrays(seq_q=a["seq_q"], seq_k=a["seq_k"], tile_m=a["tile_m"], tile_n=a["tile_n"],
                                     num_layouts=a["num_layouts"], row_ptr=arrays[0], col_idx=arrays[1],
                                     tile_bitmap_index=arrays[2], bitmaps=arrays[3])
        key = lay.signature()
        cache = self.ctx.options.setdefault("_order_only", {})
        if key not in cache:
            cache[key] = lay.seq_q == lay.seq_k and _full_or_causal(lay)
        if not cache[key]:
            spec = a.get("mask_spec", b"")
            spec = spec.decode() if isinstance(spec, bytes) else spec
            raise NotApplicable(f"{node.name}: mask '{spec}' is neither full nor causal, so packing would change "
                                "which keys a query sees")

    def _entry(self, att: gs.Node) -> gs.Tensor:
        """Walk back from the first attention's packed input through ops with one non-constant data input."""
        t = att.inputs[0]
        for _ in range(64):
            p = producer(t)
            if p is None or p.op not in _UNARY | _BINARY | {"Reshape", "LayerNormalization", "MatMul", "Gemm",
                                                             "StofGemmEpilogue"}:
                return t
            data = [x for i, x in enumerate(p.inputs) if _present(x) and const_value(x) is None
                    and not (p.op == "Reshape" and i == 1)]
            if len(data) != 1:
                return t
            if p.op in _BINARY and any(np.squeeze(const_value(x)).ndim > 1 for x in p.inputs if x is not data[0]):
                return t  # e.g. + a position table [1, S, hidden]: the tokens differ from here on
            t = data[0]
        return t

    def _probe(self, entry: gs.Tensor, kpm: gs.Tensor, orig_names: set[str]) -> list[dict]:
        """Run-time shapes (two batch sizes and lengths) of the original model's tensors still in the graph."""
        from .probe import Probe

        pad = self._pad_input(kpm)
        names = sorted({t.name for n in self.graph.nodes for t in n.outputs if t.name in orig_names}
                       | ({entry.name} & orig_names) | {pad})
        seq = self.ctx.options.get("_compiled_seq") or 8
        runs = []
        try:
            probe = Probe(self.ctx.options["_original_model"], [], names)
            for b, s in _PROBE_SIZES:
                runs.append(probe.run(b, min(s, seq))[1])
        except Exception as exc:  # noqa: BLE001 - cannot prove the token axes: keep the padded form
            raise NotApplicable(f"cannot evaluate the model's shapes: {str(exc)[:100]}") from None
        out = []
        for shapes in runs:
            if len(shapes[pad]) != 2:
                raise NotApplicable(f"the padding mask input {pad} is not [B, S]")
            out.append({"_bs": tuple(shapes[pad]), **shapes})
        if entry.name not in out[0]:
            raise NotApplicable(f"cannot tell the token axes of {entry.name}")
        return out

    def _pad_input(self, kpm: gs.Tensor) -> str | None:
        from .probe import value_inputs

        ins = value_inputs(self.graph, kpm)
        if len(ins) != 1:
            raise NotApplicable(f"the padding mask depends on {len(ins)} graph inputs")
        return next(iter(ins))

    @staticmethod
    def _kind(shape: tuple, bs: tuple) -> tuple | None:
        b, s = bs
        if len(shape) >= 2 and tuple(shape[:2]) == (b, s):
            return "bs", tuple(shape[2:])
        if len(shape) >= 1 and shape[0] == b * s:
            return "flat", tuple(shape[1:])
        return None

    def _probed(self, name: str, probed: list[dict]):
        """(kind, features) of an original tensor, the same at both probed sizes; None if not probed, "mixed" when
        it is not token-shaped or differs between the sizes."""
        if name not in probed[0]:
            return None
        got = {self._kind(r[name], r["_bs"]) for r in probed}
        return got.pop() if len(got) == 1 and None not in got else "mixed"

    def _grow(self, entry: gs.Tensor, probed: list[dict]):
        start = self._probed(entry.name, probed)
        if start is None or start == "mixed" or start[0] != "bs":
            raise NotApplicable(f"{entry.name} is not [B, S, hidden]")
        info = {entry.name: start}
        self._probed_names = set(probed[0])
        region: dict[int, gs.Node] = {}
        for n in self.graph.nodes:
            if not any(_present(t) and t.name in info for t in n.inputs):
                continue
            outs = self._tokenwise(n, info)
            if outs == "probe":  # a Reshape of the original model: its run-time shapes tell the token axes
                p = self._probed(n.outputs[0].name, probed)
                size = int(np.prod(info[n.inputs[0].name][1], dtype=np.int64))
                ok = p not in (None, "mixed") and int(np.prod(p[1], dtype=np.int64)) == size
                outs = [p] if ok else None
            elif outs is not None:
                for t, o in zip(n.outputs, outs):
                    p = self._probed(t.name, probed)
                    if p is not None and p != o:
                        outs = None
                        break
            if outs is None:  # reads a region tensor, acts across tokens: that tensor is restored for it
                continue
            region[id(n)] = n
            for t, o in zip(n.outputs, outs):
                if _present(t):
                    info[t.name] = o
        return info, region

    def _tokenwise(self, n: gs.Node, info: dict):
        """The (kind, features) of each output when ``n`` acts on each token on its own, else None."""
        def reg(i):
            return info.get(n.inputs[i].name) if i < len(n.inputs) and _present(n.inputs[i]) else None

        def cst(i):
            return const_value(n.inputs[i]) if i < len(n.inputs) and _present(n.inputs[i]) else None

        def consts(first):  # weights, biases, LayerNorm scales: the same for every token
            return all(cst(i) is not None for i in range(first, len(n.inputs)) if _present(n.inputs[i]))

        op, a = n.op, reg(0)
        used = [t for t in n.outputs if _present(t) and (t.outputs or t.name in self.ctx.graph_outputs)]
        if op in _UNARY:
            if a is None or any(reg(i) is not None or cst(i) is None for i in range(1, len(n.inputs))
                                if _present(n.inputs[i])):
                return None
            if op == "Dropout" and (len(n.inputs) > 2 and _present(n.inputs[2]) and bool(cst(2))
                                    or any(id(t) in {id(u) for u in used} for t in n.outputs[1:])):
                return None
            return [a] * len(n.outputs)
        if op in _BINARY:
            b = reg(1)
            if a is not None and b is not None:
                if op == "Pow" or a[0] != b[0]:
                    return None
                try:
                    return [(a[0], tuple(np.broadcast_shapes(a[1], b[1])))]
                except ValueError:
                    return None
            x, c = (a, cst(1)) if a is not None else (b, cst(0))
            if c is None or (op == "Pow" and a is None):
                return None
            cs = list(c.shape)
            while cs and cs[0] == 1 and len(cs) > len(x[1]):
                cs.pop(0)
            if len(cs) > len(x[1]):
                return None
            try:
                return [(x[0], tuple(np.broadcast_shapes(x[1], tuple(cs))))]
            except ValueError:
                return None
        if op == "LayerNormalization":
            if a is None or not consts(1) or any(id(t) in {id(u) for u in used} for t in n.outputs[1:]):
                return None
            rank = len(a[1]) + (2 if a[0] == "bs" else 1)
            axis = int(n.attrs.get("axis", -1))
            axis = axis - rank if axis >= 0 else axis
            if -axis > len(a[1]):
                return None
            return [a] * len(n.outputs)
        if op in ("MatMul", "StofGemmEpilogue"):
            w = cst(1)
            if a is None or w is None or w.ndim != 2 or not a[1] or a[1][-1] != w.shape[0] or not consts(1):
                return None
            return [(a[0], a[1][:-1] + (int(w.shape[1]),))]
        if op == "Gemm":
            w = cst(1)
            if a is None or w is None or len(a[1]) != 1 or n.attrs.get("transA", 0) or \
                    (len(n.inputs) > 2 and _present(n.inputs[2]) and (cst(2) is None or cst(2).ndim > 1)):
                return None
            return [(a[0], (int(w.shape[0 if n.attrs.get("transB", 0) else 1]),))]
        if op == "StofAddLayerNorm":
            r = reg(1)
            if a is None or r != a or not consts(2):
                return None
            return [a] * len(n.outputs)
        if op == "Reshape":
            if a is None or n.attrs.get("allowzero", 0):
                return None
            t = cst(1)
            if t is None or n.outputs[0].name in self._probed_names:
                return "probe"  # the original's run-time shapes tell the token axes (fixed targets like [2, 16, 32])
            t = [int(v) for v in t.reshape(-1)]
            size = int(np.prod(a[1], dtype=np.int64))
            if len(t) >= 2 and t[:2] == [0, 0] and a[0] == "bs" and all(v > 0 for v in t[2:]):
                out = ("bs", tuple(t[2:]))
            elif t and t[0] == -1 and all(v > 0 for v in t[1:]):
                out = ("flat", tuple(t[1:]))
            else:
                return None
            return [out] if int(np.prod(out[1], dtype=np.int64)) == size else None
        if op == "StofSparseAttention":
            if a is None or _fmt(n) != "bs3hd" or a[0] != "bs" or len(a[1]) != 3 or a[1][0] != 3 \
                    or any(reg(i) is not None for i in range(1, len(n.inputs))):
                return None
            return [("bs", a[1][1:])]
        return None

    # -- rewrite ------------------------------------------------------------------------------------------------
    def _slots(self, kpm):
        """Pack into C = min(len(stof_token_capacity), B·S) token slots, a size fixed by an input's shape, so the
        run has no data-dependent shape and a CUDA graph can replay it (one graph per capacity). The real tokens
        fill the first T slots, the rest hold padded tokens no sequence reads: one StofPackTokens node gives the
        slots' positions, the sequences' offsets and the restore rows (docs/nodes.md). With T > C every restored
        output is NaN: a too-small capacity never passes silently."""
        g = self.graph
        slots_in = gs.Variable(TOKEN_CAPACITY_INPUT, dtype=np.int32, shape=["token_capacity"])
        g.inputs.append(slots_in)
        idx, offsets, source_row = (self.new_var(f"stof_unpad_{n}", dtype=np.int32)
                                    for n in ("idx", "seq_offsets", "source_row"))
        # kpm: the attention nodes' key_padding_mask, int32 by the node's contract, as StofPackTokens reads it
        node = gs.Node("StofPackTokens", self.ctx.unique("StofPackTokens"), {}, [kpm, slots_in],
                       [idx, offsets, source_row], domain="stof")
        self.ctx.overloads[node.name] = ""
        self.ctx.functions.add(("StofPackTokens", ""))
        return node, idx, offsets, source_row, [float("nan")]                         # row C + 1: NaN

    def _rewrite(self, entry, kpm, info, region) -> None:
        g, ctx = self.graph, self.ctx
        i64 = lambda v: self.new_const("stof_unpad_c", np.array(v, np.int64))  # noqa: E731
        new: list[gs.Node] = []

        def op(op_type, inputs, dtype=None, **attrs):
            out = self.new_var(f"stof_unpad_{op_type.lower()}", dtype=dtype)
            new.append(gs.Node(op_type, ctx.unique(f"stof_unpad_{op_type.lower()}"), attrs, list(inputs), [out]))
            return out

        # Token index and sequence offsets from the one padding mask.
        bs = op("Shape", [kpm], np.int64)                                             # [B, S]
        flat = op("ReduceProd", [bs], np.int64, keepdims=1)                         # [B·S]
        extra_rows = []
        if ctx.options.get("token_capacity_input"):
            node, idx, offsets, source_row, extra_rows = self._slots(kpm)
            new.append(node)
        else:
            keep = op("Cast", [kpm], np.bool_, to=9)                                    # [B, S]
            lengths = op("ReduceSum", [op("Cast", [keep], np.int32, to=6), i64([1])], np.int32, keepdims=0)
            offsets = op("Concat", [self.new_const("stof_unpad_zero", np.zeros(1, np.int32)),
                                    op("CumSum", [lengths, i64(0)], np.int32)], np.int32, axis=0)   # [B+1]
            keep_flat = op("Reshape", [keep, i64([-1])], np.bool_)                       # [B·S]
            keep_i64 = op("Cast", [keep_flat], np.int64, to=7)
            rank = op("Sub", [op("CumSum", [keep_i64, i64(0)], np.int64), i64(1)], np.int64)   # of each real token
            idx = op("Squeeze", [op("NonZero", [keep_flat], np.int64), i64([0])], np.int64)   # [T]
            # Restore as a Gather: padded position p reads packed row rank(p), a padded one the zero row T
            # appended after the packed rows. (ScatterND's CUDA kernel copies each [F] row in one thread: ~0.4 ms
            # per output.)
            source_row = op("Where", [keep_flat, rank, op("Shape", [idx], np.int64)], np.int64)   # in [0, T]

        def prefix(kind):
            return bs if kind == "bs" else flat

        # Pack the entry: its region consumers read [T, F].
        kind, feats = info[entry.name]
        packed = op("Gather", [op("Reshape", [entry, i64([-1, *feats])], entry.dtype), idx], entry.dtype, axis=0)
        for n in region.values():
            _swap(n.inputs, entry, packed)

        # Region tensors are now [T, F]: Reshapes get token targets, LayerNorm axes count from the end.
        for n in region.values():
            if n.op == "Reshape":
                n.inputs[1] = i64([-1, *info[n.outputs[0].name][1]])
            elif n.op == "LayerNormalization" and int(n.attrs.get("axis", -1)) >= 0:
                k, f = info[n.inputs[0].name]
                n.attrs["axis"] = int(n.attrs["axis"]) - (len(f) + (2 if k == "bs" else 1))
            elif n.op == "StofSparseAttention":
                a = dict(n.attrs)
                a["qkv_format"] = "t3hd"
                n.attrs = a
                ins = list(n.inputs) + [gs.Variable.empty()] * (9 - len(n.inputs))
                n.inputs.clear()
                n.inputs.extend([ins[0], gs.Variable.empty(), gs.Variable.empty(), *ins[3:8], gs.Variable.empty(),
                                 offsets])
                ov = attention_overload(True, False, varlen=True)
                ctx.overloads[n.name] = ov
                ctx.functions.add(("StofSparseAttention", ov))

        # Tensors leaving the region are restored to the padded layout; Shapes of region tensors are rebuilt.
        region_ids = set(region)
        restored = []
        outs = ctx.graph_outputs
        for n in list(g.nodes):
            if id(n) not in region_ids:
                continue
            for t in n.outputs:
                if not _present(t) or t.name not in info:
                    continue
                k, f = info[t.name]
                shapes = [c for c in t.outputs if c.op == "Shape" and id(c) not in region_ids]
                exits = [c for c in t.outputs if id(c) not in region_ids and c.op != "Shape"]
                for c in shapes:  # Shape(X) -> [B, S, F] / [B·S, F] from the mask's shape (dead ones are dropped)
                    full = op("Concat", [prefix(k), i64(list(f))], np.int64, axis=0)
                    lo, hi = c.attrs.get("start", 0), c.attrs.get("end")
                    if lo or hi is not None:
                        full = op("Slice", [full, i64([lo]), i64([hi if hi is not None else 1 << 62])], np.int64)
                    new.append(gs.Node("Identity", ctx.unique("stof_unpad_shape"), {}, [full], list(c.outputs)))
                    c.outputs.clear()
                if not exits and t.name not in outs:
                    t.shape = None
                    continue
                tp = self.new_var(f"{t.name}_packed", dtype=t.dtype)
                for c in list(t.outputs):
                    if id(c) in region_ids:
                        _swap(c.inputs, t, tp)
                _swap(n.outputs, t, tp)
                rows = [tp] + [op("Expand", [op("CastLike", [self.new_const("stof_unpad_fill", np.array(v, np.float32)),
                                                              tp], t.dtype), i64([1, *f])], t.dtype)
                               for v in [0.0] + extra_rows]
                scattered = op("Gather", [op("Concat", rows, t.dtype, axis=0), source_row], t.dtype, axis=0)
                new.append(gs.Node("Reshape", ctx.unique("stof_unpad_restore"), {},
                                   [scattered, op("Concat", [prefix(k), i64(list(f))], np.int64, axis=0)], [t]))
                restored.append(t.name)
        for n in region.values():
            for t in n.inputs:
                if _present(t) and t.name in info and t is not entry:
                    t.shape = None
        g.nodes.extend(new)
        used = {(nd.op, ctx.overloads.get(nd.name, "")) for nd in g.nodes if nd.domain == "stof"}
        ctx.functions &= used
        g.cleanup().toposort()
        n_att = sum(1 for n in region.values() if n.op == "StofSparseAttention")
        ctx.report.remove_padding = {"applied": True, "reason": "", "entry": entry.name,
                                     "region_nodes": len(region), "attention_nodes": n_att, "restored": restored,
                                     "padding_mask_input": self._pad_input(kpm)}
        if ctx.options.get("token_capacity_input"):
            ctx.report.remove_padding["token_capacity_input"] = TOKEN_CAPACITY_INPUT
        alive = {id(n) for n in g.nodes}  # rebuilt Shapes that only fed the old Reshape targets are gone
        ctx.report.matched(self.pattern, self.fused_op_type, removed=[], added=[n for n in new if id(n) in alive],
                           info={"entry": entry.name, "restored": restored})
