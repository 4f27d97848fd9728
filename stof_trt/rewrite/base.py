"""The fusion base class: iterate anchors, collect matches, apply them in one batch.

A fusion subclasses :class:`Fusion`, names the op types of its anchor nodes and implements ``fuse(anchor)``,
which either returns a :class:`Match` (the nodes to remove and a function building the replacement) or calls
``self.skip(anchor, reason)`` / returns None. ``apply()`` then

1. runs ``fuse`` on every anchor (nothing is changed while matching),
2. gives ``analyze(matches)`` one chance to look at all matches together (e.g. to probe the model once),
3. drops matches that overlap an earlier one (a node is never claimed twice),
4. disconnects the removed nodes, builds the new ones, and counts everything in the report.

A match is applied whole or not at all: a half-rewritten pattern cannot happen.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import onnx_graphsurgeon as gs

from .functions import gemm_overload
from .matcher import logger
from .report import RewriteReport


@dataclasses.dataclass
class Match:
    """One matched subgraph.

    ``remove``: the nodes the replacement takes over (their outputs must be re-produced by ``build``'s nodes or be
    used only inside ``remove``). ``build()`` returns the new nodes; it runs after ``remove`` is disconnected.
    ``info``: what the report records for this match."""

    anchor: gs.Node
    remove: list[gs.Node]
    build: Callable[[], list[gs.Node]]
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RewriteContext:
    """State shared by the fusions of one ``rewrite_model`` call."""

    graph: gs.Graph
    report: RewriteReport
    opset: int
    options: dict
    #: node name -> function overload ("" = the base function); written into the NodeProtos after export.
    overloads: dict[str, str] = dataclasses.field(default_factory=dict)
    #: (op_type, overload) pairs whose FunctionProto the model needs.
    functions: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    _names: itertools.count = dataclasses.field(default_factory=itertools.count)

    def unique(self, prefix: str) -> str:
        taken = self.graph.tensors().keys() | {n.name for n in self.graph.nodes}
        while True:
            name = f"{prefix}_{next(self._names)}"
            if name not in taken:
                return name

    @property
    def graph_outputs(self) -> set[str]:
        return {t.name for t in self.graph.outputs}

    def gemm_node(self, x, w, bias, out, activation: str = "none", *, algo: int = -1, prefix=None, prefix_w=None,
                  prefix_bias=None) -> gs.Node:
        """A StofGemmEpilogue node ``out = act(x·w + bias)`` (bias None: none), its function overload registered;
        ``prefix`` rows in front (with ``prefix_w`` / ``prefix_bias``: their own weights; docs/nodes.md);
        ``algo`` >= 0: a measured algorithm."""
        attrs = {"activation": activation}
        if algo >= 0:
            attrs["algo"] = int(algo)
        inputs = [x, w] + ([bias] if bias is not None else [])
        if prefix is not None:
            inputs += ([] if bias is not None else [gs.Variable.empty()]) + [prefix]
            inputs += [prefix_w] + ([prefix_bias] if prefix_bias is not None else []) if prefix_w is not None else []
        node = gs.Node("StofGemmEpilogue", self.unique("StofGemmEpilogue"), attrs, inputs, [out], domain="stof")
        overload = gemm_overload(activation, bias is not None, prefix is not None, prefix_w is not None)
        self.overloads[node.name] = overload
        self.functions.add(("StofGemmEpilogue", overload))
        return node


class Fusion:
    """Base of every rewrite (see the module docstring)."""

    #: The op_type of the node(s) this fusion emits (for the report).
    fused_op_type: str = ""
    #: Op types of the anchor nodes ``fuse`` is called on.
    search_op_types: tuple[str, ...] = ()
    #: Name of the pattern in the report.
    pattern: str = ""

    def __init__(self, ctx: RewriteContext):
        self.ctx = ctx
        self.graph = ctx.graph

    # -- to implement ---------------------------------------------------------------------------------------------
    def fuse(self, anchor: gs.Node) -> Match | None:
        raise NotImplementedError

    def analyze(self, matches: list[Match]) -> list[Match]:
        """Look at all matches at once before any is applied; return those to keep."""
        return matches

    # -- helpers for subclasses -----------------------------------------------------------------------------------
    def debug(self, anchor: gs.Node, message: str) -> None:
        logger.debug("%s: %s: %s", type(self).__name__, anchor.name, message)

    def skip(self, anchor: gs.Node, reason: str) -> None:
        """Record a candidate left alone on purpose (it looked like the pattern but is not supported)."""
        logger.info("%s: left %s alone: %s", type(self).__name__, anchor.name, reason)
        self.ctx.report.left_alone(self.pattern, anchor.name, anchor.op, reason)

    def new_var(self, prefix: str, dtype=None, shape=None) -> gs.Variable:
        return gs.Variable(self.ctx.unique(prefix), dtype=dtype, shape=shape)

    def new_const(self, prefix: str, values) -> gs.Constant:
        return gs.Constant(self.ctx.unique(prefix), values)

    # -- driver ---------------------------------------------------------------------------------------------------
    def apply(self) -> int:
        anchors = [n for n in self.graph.nodes if n.op in self.search_op_types]
        matches = [m for m in (self.fuse(a) for a in anchors) if m is not None]
        matches = self.analyze(matches)
        claimed: set[int] = set()
        applied = 0
        for m in matches:
            ids = {id(n) for n in m.remove}
            if ids & claimed:
                self.skip(m.anchor, "overlaps another match of the same pattern")
                continue
            claimed |= ids
            for n in m.remove:
                n.inputs.clear()
                n.outputs.clear()
            new_nodes = m.build()
            self.graph.nodes.extend(new_nodes)
            for n in m.remove:
                self.graph.nodes.remove(n)
            self.ctx.report.matched(self.pattern, self.fused_op_type, removed=m.remove, added=new_nodes,
                                    info=m.info)
            applied += 1
        if applied:
            logger.info("Fused %s (%s): %d", self.fused_op_type, self.pattern, applied)
            self.graph.cleanup().toposort()
        return applied
