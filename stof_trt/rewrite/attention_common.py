"""Pieces shared by the attention fusions: layout choice, layout initializers, key padding, node creation."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from .._host import available_memory
from ..errors import StofError
from ..format import STOF_FORMAT_VERSION, TileLayout, compile_mask

from .base import Fusion
from .functions import attention_overload
from .mask_analysis import GraphMask

FORMAT_VERSION = STOF_FORMAT_VERSION


@dataclasses.dataclass
class AttentionPlan:
    """Everything needed to emit one StofSparseAttention node."""

    name: str
    heads: int
    head_dim: int
    seq_q: int
    seq_k: int
    scale: float
    layout: TileLayout
    mask_source: str
    padding_input: str | None = None      # graph input to derive key_padding_mask from (Cast to int32)
    padding_tensor: gs.Tensor | None = None  # an existing [B, Sk] tensor to use as key_padding_mask (Cast to int32)
    bias: gs.Tensor | None = None
    bias_term: object | None = None       # the graph mask to turn into ``bias`` when the node is built

    def info(self) -> dict:
        lay = self.layout
        return {"kind": "attention", "name": self.name, "heads": self.heads, "head_dim": self.head_dim,
                "seq_q": self.seq_q, "seq_k": self.seq_k, "scale": self.scale, "mask_source": self.mask_source,
                "num_layouts": lay.num_layouts, "tile": [lay.tile_m, lay.tile_n],
                "density": round(float(lay.density()), 6), "tile_density": round(float(lay.tile_density()), 6),
                "tile_classes": lay.class_counts(), "layout_signature": lay.signature(),
                "key_padding": bool(self.padding_input or self.padding_tensor is not None),
                "attn_bias": self.bias is not None or self.bias_term is not None}


def choose_layout(options: dict, graph_mask: GraphMask | None, sq: int, sk: int, heads: int,
                  extra_static: np.ndarray | None = None, extra_name: str = "", *, extra_spec: str | None = None,
                  probe: AttentionProbe | None = None, terms: tuple = ()) -> tuple[TileLayout, str]:
    """The static layout: the user's mask spec ∧ the graph's static pattern ∧ ``extra_static`` (e.g. an op's
    is_causal), or all FULL tiles without any. Returns the layout and a description of the mask source.

    The layout's closed-form spec, when it has one, becomes the node's layout_spec (growable_spec): ``extra_spec``
    names ``extra_static``'s exactly (an op attribute's pattern); ``probe`` and ``terms`` (the mask terms of the
    graph's static pattern) let a band side the pattern does not reach at ``sq`` be checked at a longer length."""
    tm, tn, user = options["tile_m"], options["tile_n"], options.get("mask")
    statics, names = [], []
    if graph_mask is not None and graph_mask.static is not None:
        statics.append(graph_mask.static)
    if extra_static is not None:
        statics.append(extra_static)
        names.append(extra_name)
    if graph_mask is not None and graph_mask.kind not in ("none",):
        names.append(graph_mask.source)
    if user is not None:
        layout = compile_mask(user, sq, sk, tile_m=tm, tile_n=tn, num_heads=heads)
        if layout.density() == 0:   # every output row would be zero: a spec mistake, not a model to write
            raise StofError(f"the mask '{layout.mask_spec}' allows no key for any query at {sq}x{sk}: every "
                            "attention output would be zero")
        names.insert(0, f"user '{layout.mask_spec}'")
        if statics:
            dense = layout.to_dense()
            for s in statics:
                dense = _and_heads(dense, s)
            layout = TileLayout.from_dense(dense, tm, tn, mask_spec=f"{layout.mask_spec} & graph")
    elif statics:
        dense = statics[0]
        for s in statics[1:]:
            dense = _and_heads(dense, s)
        layout = TileLayout.from_dense(dense, tm, tn, mask_spec="graph")
    else:
        layout = TileLayout.from_dense(np.ones((1, sq, sk), bool), tm, tn, mask_spec="full")
    graph_static = graph_mask.static if graph_mask is not None else None
    spec = growable_spec(options, user, graph_static, extra_static, extra_spec, layout, heads, probe, terms)
    if spec is not None:   # the node's layout_spec (AttentionEmitter.node): its layout at any length
        options.setdefault("_layout_specs", {})[id(layout)] = (layout, spec)
    return layout, " & ".join(names) if names else "none (full layout)"


def band_spec(static: np.ndarray) -> str | None:
    """The closed-form spec of a static pattern [L, S, S] when it is one band ``lo <= k - q <= hi`` for every
    layout (causal, a sliding window, full), else None. A side the pattern does not reach inside the matrix is
    taken as unbounded: the pattern seen at one length cannot tell causal from a window wider than that length
    (band_unseen; docs/rewrite.md "Sequence length")."""
    sides = _band_sides(static)
    if sides is None:
        return None
    lo, hi, lower, upper = sides
    if not lower:
        return "full" if not upper else f"causal:offset={hi}"
    if lo > 0:
        return None                                           # keys strictly after the query: no spec names it
    if not upper:
        return f"sliding:left={-lo},right=2147483647"
    if hi < 0:
        return f"causal:offset={hi}&sliding:left={-lo},right=0"
    return f"sliding:left={-lo},right={hi}"


def _band_sides(static: np.ndarray) -> tuple[int, int, bool, bool] | None:
    """(lo, hi, lower seen, upper seen) of a static pattern [L, S, S] that is one band ``lo <= k - q <= hi`` in every
    layout, else None; a side is seen when the band's edge lies inside the matrix."""
    static = np.asarray(static, bool).reshape((-1,) + np.shape(static)[-2:])
    L, sq, sk = static.shape
    if sq != sk or not all(np.array_equal(static[0], s) for s in static[1:]):
        return None
    m = static[0]
    if not m.any():
        return None
    d = np.arange(sk)[None, :] - np.arange(sq)[:, None]     # k - q
    lo, hi = int(d[m].min()), int(d[m].max())
    if not np.array_equal(m, (d >= lo) & (d <= hi)):
        return None
    return lo, hi, lo > -(sq - 1), hi < sk - 1


def band_unseen(static: np.ndarray) -> bool:
    """Whether band_spec reads a side of ``static`` as unbounded because its edge is not inside the matrix."""
    sides = _band_sides(static)
    return sides is not None and not (sides[2] and sides[3])


#: The longest length a graph band's unseen side is checked at (growable_spec; a [1, 1, S, S] float32 mask is
#: 4 S^2 bytes: 268 MB here).
CHECK_SEQ_MAX = 8194


def growable_spec(options: dict, user, graph_static, extra_static, extra_spec: str | None, layout: TileLayout,
                  heads: int, probe=None, terms: tuple = ()) -> str | None:
    """The closed-form spec (masks.closed_form, in its canonical spelling) whose compilation at the layout's size is
    exactly ``layout``: the user's spec ∧ the graph's static pattern read as a band ∧ ``extra_spec`` (or
    ``extra_static`` read as a band with both sides seen); None when a part is not closed-form (an npy: or blocks:
    mask, BigBird's random blocks, a custom graph pattern) or the compiled spec differs.

    A graph band with a side it does not reach at the compiled length (causal at 2048 could be a window of 4096) is
    evaluated once more at about twice the length (``probe.static_at``, batch 1, at most CHECK_SEQ_MAX) when
    ``probe`` and ``terms`` are given: a pattern that is not the same band there gets no spec (the report says so);
    without them the spec is kept and listed in ``options["_unchecked_specs"]`` for the report."""
    from ..masks import closed_form, parse_mask

    parts = []
    if user is not None:
        parsed = parse_mask(user)
        if not closed_form(parsed):
            return None
        parts.append(str(parsed))
    if extra_static is not None:
        if extra_spec is None and (band_unseen(extra_static) or band_spec(extra_static) is None):
            return None   # an op's window as wide as the sequence reads as causal: only its own spec is exact
        parts.append(extra_spec or band_spec(extra_static))
    unchecked = None
    if graph_static is not None:
        b = band_spec(graph_static)
        if b is None:
            return None
        if band_unseen(graph_static):
            n = np.shape(graph_static)[-1]
            longer = min(2 * n + 2, max(n + 2, CHECK_SEQ_MAX))
            seen = probe.static_at(terms, longer) if probe is not None and terms else None
            if seen is None:
                unchecked = b
            elif not np.array_equal(seen, parse_mask(b).dense(longer, longer)):
                note = (f"the graph's mask reads as '{parse_mask(b)}' at length {n} but not at {longer} (a window "
                        f"wider than {n}?): its nodes keep the compiled length {n}; pass max_seq_len above the "
                        "window to compile it")
                notes = options.setdefault("_spec_notes", [])
                if note not in notes:
                    notes.append(note)
                return None
        parts.append(b)
    text = "&".join(f"({p})" for p in parts) if len(parts) > 1 else (parts[0] if parts else "full")
    spec = parse_mask(text)
    if not closed_form(spec):
        return None
    try:
        again = compile_mask(spec, layout.seq_q, layout.seq_k, tile_m=layout.tile_m, tile_n=layout.tile_n,
                             num_heads=heads)
    except StofError:
        return None
    if again.num_layouts != layout.num_layouts or again.signature() != layout.signature():
        return None
    if unchecked is not None:
        options.setdefault("_unchecked_specs", set()).add(unchecked)
    return str(spec)


def _and_heads(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0]):
        raise StofError(f"cannot combine masks with {a.shape[0]} and {b.shape[0]} layouts")
    return np.logical_and(a, b)


def _is_bool(t: gs.Tensor) -> bool:
    try:
        return t.dtype is not None and np.dtype(t.dtype) == np.bool_
    except TypeError:  # a dtype numpy does not know
        return False


class AttentionEmitter:
    """Creates STOF attention nodes, sharing layout initializers and key-padding casts across nodes."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        self.ctx = fusion.ctx
        cache = self.ctx.options.setdefault("_attention_cache", {})
        self.layouts: dict = cache.setdefault("layouts", {})
        self.paddings: dict = cache.setdefault("paddings", {})

    def layout_inputs(self, layout: TileLayout) -> list[gs.Constant]:
        sig = layout.signature()
        if sig not in self.layouts:
            k = len(self.layouts)
            self.layouts[sig] = [gs.Constant(self.ctx.unique(f"stof_layout{k}_{name}"),
                                             np.ascontiguousarray(arr, np.int32))
                                 for name, arr in layout.arrays().items()]
        return self.layouts[sig]

    def key_padding(self, source: gs.Tensor, new_nodes: list[gs.Node]) -> gs.Tensor:
        """int32 [B, Sk] key_padding_mask (non-zero = kept) from any-typed ``source``: Cast to bool, then int32 (an
        int32 source is the op's own form already)."""
        key = source.name
        if key not in self.paddings and np.dtype(source.dtype or np.float32) == np.int32:
            self.paddings[key] = source
        if key not in self.paddings:
            as_bool = source  # a bool tensor needs no first Cast
            if not _is_bool(source):
                as_bool = self.fusion.new_var("stof_key_padding_bool", dtype=np.bool_)
                new_nodes.append(gs.Node("Cast", self.ctx.unique("stof_key_padding_cast"), {"to": 9},
                                         [source], [as_bool]))
            as_i32 = self.fusion.new_var("stof_key_padding_mask", dtype=np.int32)
            new_nodes.append(gs.Node("Cast", self.ctx.unique("stof_key_padding_cast"), {"to": 6},
                                     [as_bool], [as_i32]))
            self.paddings[key] = as_i32
        return self.paddings[key]

    def node(self, plan: AttentionPlan, query: gs.Tensor, key: gs.Tensor | None, value: gs.Tensor | None,
             output: gs.Tensor, new_nodes: list[gs.Node], *, flat: bool = False,
             rows: tuple[gs.Tensor, gs.Tensor] | None = None,
             views: tuple[list[int], list[int]] | None = None) -> gs.Node:
        """The node for ``plan``. ``key`` and ``value`` None: the packed form (``qkv_format="bs3hd"``, ``query``
        [B, S, 3, H, D], ``output`` [B, S, H, D]); ``value`` None only: K and V packed in ``key``
        (``qkv_format="bshd_kv"``, ``query`` [B, Sq, H, D], ``key`` [B, Sk, 2, H, D], ``output`` [B, Sq, H, D];
        with ``flat`` query and output [B, Sq, H·D]; docs/nodes.md). ``rows``: (row_values [B, R, H, D], row_index
        [B, R] int32), rows written over the output. ``views``: (query_view, key_view), each [row0, rows, col0,
        cols]: a flat bshd_kv node reads these windows of the row tensors ``query`` and ``key`` ([B, R, C])."""
        packed = key is None and value is None
        kv = key is not None and value is None
        if packed:
            key, value = gs.Variable.empty(), gs.Variable.empty()
        elif kv:
            value = gs.Variable.empty()
        inputs = [query, key, value, *self.layout_inputs(plan.layout)]
        kpm = None
        if plan.padding_input is not None:
            kpm = self.key_padding(self.ctx.graph.tensors()[plan.padding_input], new_nodes)
        elif plan.padding_tensor is not None:
            kpm = self.key_padding(plan.padding_tensor, new_nodes)
        if kpm is not None or plan.bias is not None:
            inputs.append(kpm if kpm is not None else gs.Variable.empty())
        if plan.bias is not None:
            inputs.append(plan.bias)
        if rows is not None:
            inputs += [gs.Variable.empty() for _ in range(10 - len(inputs))] + list(rows)
        lay = plan.layout
        attrs = {"scale": float(plan.scale), "tile_m": lay.tile_m, "tile_n": lay.tile_n, "seq_q": lay.seq_q,
                 "seq_k": lay.seq_k, "num_layouts": lay.num_layouts, "format_version": FORMAT_VERSION,
                 "mask_spec": lay.mask_spec or ""}
        spec = self.ctx.options.get("_layout_specs", {}).get(id(lay))
        if spec is not None and spec[0] is lay:
            attrs["layout_spec"] = spec[1]
        if packed or kv:
            attrs["qkv_format"] = "bs3hd" if packed else "bshd_kv"
        if kv and flat:
            attrs["num_heads"] = int(plan.heads)
        if views is not None:
            if not (kv and flat):
                raise ValueError("views read flat bshd_kv rows")
            attrs["query_view"], attrs["key_view"] = [int(v) for v in views[0]], [int(v) for v in views[1]]
        node = gs.Node("StofSparseAttention", self.ctx.unique("StofSparseAttention"), attrs, inputs, [output],
                       domain="stof")
        overload = attention_overload(kpm is not None, plan.bias is not None, packed=packed, kv=kv,
                                      flat=kv and flat, rows=rows is not None, view=views is not None)
        self.ctx.overloads[node.name] = overload
        self.ctx.functions.add(("StofSparseAttention", overload))
        plan.name = node.name
        new_nodes.append(node)
        return node


class AttentionProbe:
    """Evaluates, once for all attention candidates of a fusion, the tensors their analysis needs.

    Two pruned copies of the original model: the *mask* probe (mask tensors only; usually a small subgraph) runs at
    the compiled sequence length with all-ones padding and three random 0/1 paddings of every [B, S] input a mask
    depends on, plus once at a shorter length for dynamic models; the *shape* probe (Q/K/V shapes and computed
    scale factors; the model up to the last attention) runs once at batch 1 (and at the shorter length when a
    scale factor must be shown constant)."""

    BATCH = 3

    def __init__(self, ctx, graph: gs.Graph, shape_names: set[str], mask_terms: list, value_names: set[str]):
        from .probe import Probe, graph_inputs, value_inputs

        model = ctx.options["_original_model"]
        specs = graph_inputs(model)
        self.dynamic = any(s.dynamic_seq for s in specs)
        seq = compiled_length(ctx, graph, shape_names, mask_terms) if self.dynamic else 1
        short_seq = max(1, (2 * seq) // 3 - 1)
        tensors = graph.tensors()
        self.pad_of: dict[str, set[str]] = {}
        for term in mask_terms:
            if term.tensor not in self.pad_of:
                self.pad_of[term.tensor] = value_inputs(graph, tensors[term.tensor])
        self.runs = [{"values": {}, "shapes": {}, "overrides": {}} for _ in range(4)]
        self.short = {"values": {}, "shapes": {}} if self.dynamic else None
        self._mask_probe, self._pads, self._spec_by = None, [], {}
        if self.pad_of:
            pads = sorted({next(iter(v)) for v in self.pad_of.values() if len(v) == 1})
            mask_probe = Probe(model, sorted(self.pad_of), [])
            spec_by = {s.name: s for s in specs}
            if self.dynamic:
                self._mask_probe, self._pads, self._spec_by = mask_probe, pads, spec_by
            rng = np.random.default_rng(1234)
            for k, run in enumerate(self.runs):
                for name in pads:
                    shp = spec_by[name].shape(self.BATCH, seq)
                    run["overrides"][name] = (np.ones(shp, np.int64) if k == 0 else
                                              (rng.random(shp) < (0.3, 0.6, 0.9)[k - 1]).astype(np.int64))
                run["values"].update(mask_probe.run(self.BATCH, seq, run["overrides"])[0])
            if self.short is not None:
                self.short["values"].update(mask_probe.run(self.BATCH, short_seq)[0])
        shape_probe = Probe(model, sorted(value_names), sorted(shape_names))
        values, shapes = shape_probe.run(1, seq)
        self.runs[0]["values"].update(values)
        self.runs[0]["shapes"].update(shapes)
        self.scale_values = {n: [v] for n, v in values.items()}
        if self.short is not None:
            values, shapes = shape_probe.run(1, short_seq) if (value_names or self.pad_of) else ({}, {})
            self.short["shapes"].update(shapes)
            for n, v in values.items():
                self.scale_values[n].append(v)

    def shape(self, name: str) -> tuple:
        return self.runs[0]["shapes"][name]

    def static_at(self, terms, seq: int) -> np.ndarray | None:
        """The allowed pattern [seq, seq] of the mask ``terms`` (their ∧) at length ``seq``, batch 1 with all-ones
        padding; None when the model does not run there or a term is not one pattern for every head."""
        from .mask_analysis import allowed_of

        if self._mask_probe is None:
            return None
        ones = {n: np.ones(self._spec_by[n].shape(1, seq), np.int64) for n in self._pads}
        try:
            values = self._mask_probe.run(1, seq, ones)[0]
        except StofError:
            return None
        out = None
        for t in terms:
            a = allowed_of(values[t.tensor], t.mode)
            if a is None or a.ndim < 2 or a.shape[-2:] != (seq, seq):
                return None
            a = a.reshape(-1, seq, seq)
            if not all(np.array_equal(a[0], x) for x in a[1:]):
                return None
            out = a[0] if out is None else out & a[0]
        return out

    def constant_scalar(self, name: str) -> float | None:
        """The value of a computed scale factor when it is one number at both probed lengths."""
        vals = self.scale_values[name]
        if any(np.asarray(v).size != 1 for v in vals):
            return None
        floats = {float(np.asarray(v).reshape(())) for v in vals}
        return floats.pop() if len(floats) == 1 else None

    def classify(self, term, sq: int, sk: int, heads: int, short_sizes: tuple[str, int, str, int] | None):
        """GraphMask of ``term``. ``short_sizes``: (tensor, dim, tensor, dim) giving Sq and Sk at the short run."""
        from .mask_analysis import GraphMask, classify

        if term.mode == "additive" and np.asarray(self.runs[0]["values"][term.tensor]).dtype == bool:
            term.mode = "allowed_bool"  # a boolean attn_mask whose type the graph did not declare
        vins = self.pad_of[term.tensor]
        if len(vins) > 1:
            return GraphMask("bias", reason=f"mask depends on several inputs {sorted(vins)}")
        pad_input = next(iter(vins)) if vins else None
        pruns = [{"values": r["values"], "pad": r["overrides"].get(pad_input)} for r in self.runs]
        srun = None
        if self.short is not None and short_sizes is not None:
            qn, qd, kn, kd = short_sizes
            srun = {"values": self.short["values"], "sq": self.short["shapes"][qn][qd],
                    "sk": self.short["shapes"][kn][kd]}
        return classify(term, sq, sk, heads, pruns, pad_input, srun)


#: The compiled length of a dynamic model with no length limit of its own (and no max_seq_len or fixed-size mask).
DEFAULT_MAX_SEQ = 2048
#: The longest max_seq_len accepted: the mask analysis evaluates [B, 1, S, S] masks at the compiled length.
MAX_SEQ = 1 << 16


def compiled_length(ctx, graph: gs.Graph, shape_names: set[str], mask_terms: list) -> int:
    """The sequence length the layouts of a dynamic model are compiled for (docs/rewrite.md "Sequence length"):
    ``max_seq_len`` when given, else the longest length the model itself runs at (a position-embedding table, a
    mask buffer), capped by the size of a fixed user mask (npy:, blocks:) and by DEFAULT_MAX_SEQ. Resolved once per
    rewrite; the report's notes say where it came from."""
    opts = ctx.options
    if "_compiled_seq" in opts:
        return opts["_compiled_seq"]
    from .probe import Probe

    model = opts["_original_model"]
    given = opts.get("max_seq_len")
    if given is not None and given > MAX_SEQ:
        raise StofError(f"max_seq_len={given} is over the supported {MAX_SEQ} (the rewrite evaluates the model's "
                        "masks at that length)")
    if given is not None and mask_terms and _mask_probe_bytes(given) > MASK_PROBE_BYTES:
        raise StofError(f"max_seq_len={given} is too long to analyse the model's graph masks (about "
                        f"{_mask_probe_bytes(given) / 2**30:.0f} GiB of [B, 1, S, S] masks); at most "
                        f"{_longest_mask_probe()} fits")
    fixed = fixed_mask_size(opts.get("mask"))
    cap = given or min(DEFAULT_MAX_SEQ, fixed or DEFAULT_MAX_SEQ)
    # (tokens, what): an operator's own limit that the CPU probe cannot run into (SparseAttention's block table)
    op_limit = opts.get("_op_seq_limit") if given is None else None
    if op_limit is not None:
        cap = min(op_limit[0], fixed or op_limit[0], MAX_SEQ)
    # The earliest attention input's shape and every mask: a position table or mask buffer limits them.
    order = {id(t): i for i, n in enumerate(graph.nodes) for t in n.outputs}
    tensors = graph.tensors()
    first = sorted(shape_names, key=lambda n: order.get(id(tensors[n]), 1 << 30))[:1]
    probe = Probe(model, sorted({t.tensor for t in mask_terms}), first)
    if given is not None:
        check_probe_memory(model, given, _heads_at_length_one(probe, first), bool(mask_terms))
    # with a given length, the model is run up to the default cap as well: a limit of its own above the given
    # length stays the limit of the rewritten model, whose layouts grow past the given length (rewrite.py)
    limit = _longest_runnable(probe, max(cap, DEFAULT_MAX_SEQ) if given is not None else cap)
    notes = ctx.report.notes
    # _compiled_seq_source says why (rewrite.py keeps stof.max_seq_len only for a limit that stays one)
    if given is not None:
        if limit < given:
            raise StofError(f"max_seq_len={given} is longer than the model runs: it accepts at most {limit} "
                            "positions (a position-embedding table or mask buffer)")
        seq, source = given, "given"
        if limit == given and limit < max(given, DEFAULT_MAX_SEQ):  # the model's own limit: as without the flag
            source = "model"
            notes.append(f"compiled for sequence length {seq}: the model's own limit (longer inputs fail in the "
                         "original model too)")
        elif limit < max(given, DEFAULT_MAX_SEQ):
            opts["_model_seq_limit"] = limit
    elif limit < cap:
        seq, source = limit, "model"
        notes.append(f"compiled for sequence length {seq}: the model's own limit (longer inputs fail in the "
                     "original model too)")
    elif op_limit is not None and cap == op_limit[0]:
        seq, source = cap, "model"
        notes.append(f"compiled for sequence length {seq}: {op_limit[1]}, the operator's own limit (longer inputs "
                     "fail in the original model too)")
    elif fixed is not None and fixed <= DEFAULT_MAX_SEQ:
        seq, source = fixed, "mask"
        notes.append(f"compiled for sequence length {seq}: the size of the mask {opts['mask']} (a fixed mask "
                     "cannot grow; longer inputs are an error)")
    else:
        seq, source = cap, "default"
        opts["_compiled_seq_note"] = len(notes)   # rewrite.py words it for models whose layouts grow
        notes.append(f"compiled for sequence length {seq}, no limit found in the model: longer inputs are an "
                     "error; pass max_seq_len (stof rewrite --max-seq-len S) to compile for longer")
    opts["_compiled_seq"] = seq
    opts["_compiled_seq_source"] = source
    return seq


#: Memory the mask analysis may use: it keeps five evaluations of [3, 1, S, S] float32 masks.
MASK_PROBE_BYTES = 8 << 30


def _mask_probe_bytes(seq: int) -> int:
    return 5 * AttentionProbe.BATCH * 4 * seq * seq


def _longest_mask_probe() -> int:
    return int((MASK_PROBE_BYTES / (5 * AttentionProbe.BATCH * 4)) ** 0.5)


#: Score-sized tensors of one attention that the shape probe holds at once: Q·Kᵀ, its scaled/masked copy, softmax.
SCORE_COPIES = 3
#: The model's activations between attentions, as a multiple of its inputs (hidden states, Q/K/V, MLP).
ACTIVATION_FACTOR = 4


def probe_bytes(model, seq: int, heads: int, masks: bool) -> dict[str, int]:
    """What evaluating ``model`` at ``seq`` for the analysis allocates, by part (bytes): ``inputs`` (every input at
    the mask probe's batch, symbolic dims after the batch taken as ``seq``, and the activations they feed),
    ``scores`` (the shape probe runs the model to its last attention at batch 1: SCORE_COPIES float32
    [1, heads, S, S] tensors live at once), ``masks`` (the mask probe's kept [B, 1, S, S] evaluations, when the
    graph builds masks); ``total`` is their sum. An estimate made before anything is allocated."""
    from onnx import helper

    inits = {t.name for t in model.graph.initializer}
    per_batch = 0
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        try:
            item = helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
        except Exception:  # noqa: BLE001 - an exotic type: the probe says what it thinks of it
            continue
        n = 1
        for d in list(tt.shape.dim)[1:]:
            n *= d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else seq
        per_batch += n * item
    parts = {"inputs": ACTIVATION_FACTOR * AttentionProbe.BATCH * per_batch,
             "scores": SCORE_COPIES * max(1, heads) * 4 * seq * seq,
             "masks": _mask_probe_bytes(seq) if masks else 0}
    parts["total"] = sum(parts.values())
    return parts


def _heads_at_length_one(probe, first: list[str]) -> int:
    """Heads of the earliest attention input, read from its shape at batch 1 and length 1 (elements per head-dim
    row: H for [1, H, 1, D], 3H for a packed [1, 1, 3, H, D]); 1 when it cannot be read."""
    if not first:
        return 1
    try:
        shape = probe.run(1, 1)[1][first[0]]
    except StofError:
        return 1
    return max(1, int(np.prod(shape[:-1], dtype=np.int64))) if len(shape) >= 2 else 1


def check_probe_memory(model, seq: int, heads: int, masks: bool, what: str | None = None) -> None:
    """Refuse a compiled length whose shape probe would not fit in memory (probe_bytes), with the numbers;
    ``what`` names the length as the caller's user gave it."""
    parts = probe_bytes(model, seq, heads, masks)
    avail = available_memory()
    if avail and parts["total"] > avail:
        g = {k: _size(v) for k, v in parts.items()}
        masks_part = f", graph masks {g['masks']}" if masks else ""
        raise StofError(f"{what or f'max_seq_len={seq}'} needs about {g['total']} to evaluate the model at that "
                        f"length (attention scores [1, {heads}, S, S] {g['scores']}{masks_part}, inputs and "
                        f"activations {g['inputs']}); {_size(avail)} is available: give a smaller max_seq_len "
                        "(stof rewrite --max-seq-len)")


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _longest_runnable(probe, cap: int) -> int:
    """The longest sequence length in [1, cap] at which ``probe`` runs (bisection: a model that runs at S runs at
    every shorter length). A model that does not run at length 1 is an error (the probe's message)."""
    def runs(seq: int) -> bool:
        # Token ids 2, not 1: RoBERTa-style position ids skip the padding id (1), so all-ones ids never reach the
        # end of the position table.
        ids = {n: np.full(probe.specs[n].shape(1, seq), 2) for n in probe.input_names
               if n.endswith("input_ids") and n in probe.specs}
        try:
            probe.run(1, seq, ids)
            return True
        except StofError:
            return False

    # Doubling from a short length first, so a model with a short table is never run at a huge length.
    lo, hi = 0, cap
    seq = 64
    while seq < cap:
        if not runs(seq):
            hi = seq
            break
        lo, seq = seq, seq * 2
    if hi == cap:
        if runs(cap):
            return cap
    if lo == 0:
        probe.run(1, 1)  # raises the model's own one-line error when even length 1 fails
        lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if runs(mid) else (lo, mid)
    return lo


def fixed_mask_size(spec) -> int | None:
    """The largest square size a user mask can be compiled at when it has a fixed size (npy:, blocks:), else None."""
    from ..masks import BigBird, BlockLayout, DenseMask

    if spec is None:
        return None
    if isinstance(spec, DenseMask):
        return int(min(spec.array.shape[-2:]))
    if isinstance(spec, BlockLayout) and not isinstance(spec, BigBird) and getattr(spec, "_layout", None) is not None:
        return int(min(spec._layout.shape[-2:])) * spec.block
    sizes = [s for s in (fixed_mask_size(p) for p in getattr(spec, "parts", ())) if s is not None]
    return min(sizes) if sizes else None


def to_heads(fusion: Fusion, t: gs.Tensor, heads: int, head_dim: int, new: list[gs.Node]) -> gs.Tensor:
    """[B, S, H·D] -> Reshape [B, S, H, D] -> Transpose -> [B, H, S, D]."""
    ctx = fusion.ctx
    r = fusion.new_var("stof_heads", dtype=t.dtype)
    out = fusion.new_var("stof_bhsd", dtype=t.dtype)
    shape = fusion.new_const("stof_heads_shape", np.array([0, 0, heads, head_dim], np.int64))
    new.append(gs.Node("Reshape", ctx.unique("stof_split_heads"), {}, [t, shape], [r]))
    new.append(gs.Node("Transpose", ctx.unique("stof_split_heads_t"), {"perm": [0, 2, 1, 3]}, [r], [out]))
    return out


def from_heads(fusion: Fusion, out: gs.Tensor, hidden: int, new: list[gs.Node], dtype=None) -> gs.Tensor:
    """Returns a fresh [B, H, S, D] tensor whose Transpose + Reshape [B, S, H·D] is written into ``out``."""
    ctx = fusion.ctx
    bhsd = fusion.new_var("stof_attn_out", dtype=dtype)
    t = fusion.new_var("stof_bshd", dtype=dtype)
    shape = fusion.new_const("stof_merge_shape", np.array([0, 0, hidden], np.int64))
    new.append(gs.Node("Transpose", ctx.unique("stof_merge_heads_t"), {"perm": [0, 2, 1, 3]}, [bhsd], [t]))
    new.append(gs.Node("Reshape", ctx.unique("stof_merge_heads"), {}, [t, shape], [out]))
    return bhsd


def lengths_to_padding(fusion: Fusion, lengths: gs.Tensor, key: gs.Tensor, new: list[gs.Node]) -> gs.Tensor:
    """[B] key lengths -> [B, Sk] int64 0/1 (key k kept iff k < length); Sk from dim 1 of ``key`` [B, Sk, ...]."""
    ctx = fusion.ctx
    v = lambda p, dt=np.int64: fusion.new_var(p, dtype=dt)  # noqa: E731
    c = lambda p, a: fusion.new_const(p, np.array(a, np.int64))  # noqa: E731
    shape, sk, rng, l64, l2, keep, out = (v("stof_len_shape"), v("stof_len_sk"), v("stof_len_range"),
                                          v("stof_len_i64"), v("stof_len_col"), v("stof_len_keep", np.bool_),
                                          v("stof_len_mask"))
    new += [gs.Node("Shape", ctx.unique("stof_len"), {"start": 1, "end": 2}, [key], [shape]),
            gs.Node("Squeeze", ctx.unique("stof_len"), {}, [shape, c("stof_len_axes", [0])], [sk]),
            gs.Node("Range", ctx.unique("stof_len"), {}, [c("stof_len_zero", 0), sk, c("stof_len_one", 1)], [rng]),
            gs.Node("Cast", ctx.unique("stof_len"), {"to": 7}, [lengths], [l64]),
            gs.Node("Unsqueeze", ctx.unique("stof_len"), {}, [l64, c("stof_len_axes1", [1])], [l2]),
            gs.Node("Less", ctx.unique("stof_len"), {}, [rng, l2], [keep]),
            gs.Node("Cast", ctx.unique("stof_len"), {"to": 7}, [keep], [out])]
    return out


def bool_mask_bias(fusion: Fusion, cond: gs.Tensor, allowed_value_true: bool, fill, like: gs.Tensor,
                   new: list[gs.Node]) -> gs.Tensor:
    """Additive bias from a boolean mask: 0 where allowed, ``fill`` (a float or a scalar tensor) elsewhere, cast
    like ``like`` (the query) so an fp16 model gets an fp16 bias."""
    zero = fusion.new_const("stof_zero", np.zeros((), np.float32))
    f = fill if isinstance(fill, gs.Tensor) else fusion.new_const("stof_fill", np.array(fill, np.float32))
    if isinstance(fill, gs.Tensor):
        zero = fusion.new_var("stof_zero_like", dtype=None)
        new.append(gs.Node("CastLike", fusion.ctx.unique("stof_zero_like"), {},
                           [fusion.new_const("stof_zero", np.zeros((), np.float32)), fill], [zero]))
    raw = fusion.new_var("stof_attn_bias_raw")
    bias = fusion.new_var("stof_attn_bias")
    a, b = (zero, f) if allowed_value_true else (f, zero)
    new.append(gs.Node("Where", fusion.ctx.unique("stof_bias_where"), {}, [cond, a, b], [raw]))
    new.append(gs.Node("CastLike", fusion.ctx.unique("stof_bias_cast"), {}, [raw, like], [bias]))
    return bias
