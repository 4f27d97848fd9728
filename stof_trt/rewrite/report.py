"""What a rewrite did: patterns matched, nodes removed and added, per-attention details, things left alone."""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class RewriteReport:
    """Filled in by the fusions; ``to_dict()`` is JSON-able, ``summary_rows()`` feeds a table."""

    patterns: dict = dataclasses.field(default_factory=lambda: collections.OrderedDict())
    attention: list = dataclasses.field(default_factory=list)
    left_alone_list: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    #: padding removal: {"applied": bool, "reason": one line when not applied, ...} (docs/rewrite.md)
    remove_padding: dict = dataclasses.field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    opset: int = 0

    def _entry(self, pattern: str, fused_op_type: str = "") -> dict:
        return self.patterns.setdefault(pattern, {"fused_op_type": fused_op_type, "matched": 0,
                                                  "nodes_removed": 0, "nodes_added": 0,
                                                  "removed_op_types": collections.Counter()})

    def matched(self, pattern: str, fused_op_type: str, *, removed, added, info: dict) -> None:
        e = self._entry(pattern, fused_op_type)
        e["fused_op_type"] = fused_op_type
        e["matched"] += 1
        e["nodes_removed"] += len(removed)
        e["nodes_added"] += len(added)
        e["removed_op_types"].update(n.op for n in removed)
        if info.get("kind") == "attention":
            self.attention.append({k: v for k, v in info.items() if k != "kind"})

    def keep_attention_in(self, model) -> int:
        """Drop attention entries whose node is not in ``model`` (a later pattern replaced it, e.g.
        dense_attention="ort" handing it to ONNX Runtime's Attention); returns how many were dropped."""
        names = {n.name for n in model.graph.node}
        kept = [a for a in self.attention if a.get("name") in names]
        dropped = len(self.attention) - len(kept)
        self.attention[:] = kept
        return dropped

    def nodes_by_cleanup(self) -> int:
        """Nodes the graph cleanup removed after the patterns ran (constant folding of shape arithmetic left by
        removed subgraphs, dead nodes): nodes_before - removed + added - nodes_after."""
        removed = sum(e["nodes_removed"] for e in self.patterns.values())
        added = sum(e["nodes_added"] for e in self.patterns.values())
        return self.nodes_before - removed + added - self.nodes_after

    def left_alone(self, pattern: str, name: str, op_type: str, reason: str) -> None:
        self.left_alone_list.append({"pattern": pattern, "node": name, "op_type": op_type, "reason": reason})

    def count(self, pattern: str) -> int:
        return self.patterns.get(pattern, {}).get("matched", 0)

    def fused_counts(self) -> dict[str, int]:
        """Number of emitted nodes per STOF op_type."""
        out: dict[str, int] = collections.Counter()
        for e in self.patterns.values():
            out[e["fused_op_type"]] += e["matched"]
        return dict(out)

    def to_dict(self) -> dict:
        return {
            "opset": self.opset,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "nodes_removed_by_cleanup": self.nodes_by_cleanup(),
            "patterns": {k: {**v, "removed_op_types": dict(v["removed_op_types"])} for k, v in self.patterns.items()},
            "attention": list(self.attention),
            "left_alone": list(self.left_alone_list),
            "notes": list(self.notes),
            "remove_padding": dict(self.remove_padding),
        }

    def summary_rows(self) -> list[dict]:
        """One row per pattern: pattern, fused op, matched, nodes removed, nodes added."""
        return [{"pattern": k, "fused_op_type": v["fused_op_type"], "matched": v["matched"],
                 "nodes_removed": v["nodes_removed"], "nodes_added": v["nodes_added"]}
                for k, v in self.patterns.items()]

    def attention_rows(self) -> list[dict]:
        """One row per attention node: name, heads, head dim, mask source, density, tile classes."""
        return [{"node": a["name"], "heads": a["heads"], "head_dim": a["head_dim"], "mask_source": a["mask_source"],
                 "density": a["density"], "tiles": a["tile_classes"]} for a in self.attention]

    def __str__(self) -> str:
        lines = [f"{'pattern':<28} {'fused op':<22} {'matched':>7} {'removed':>7} {'added':>5}"]
        for r in self.summary_rows():
            lines.append(f"{r['pattern']:<28} {r['fused_op_type']:<22} {r['matched']:>7} {r['nodes_removed']:>7} "
                         f"{r['nodes_added']:>5}")
        for a in self.attention:
            lines.append(f"  {a['name']}: H={a['heads']} D={a['head_dim']} mask={a['mask_source']} "
                         f"density={a['density']:.3f} tiles={a['tile_classes']}")
        for s in self.left_alone_list:
            lines.append(f"  left alone: {s['node']} ({s['op_type']}): {s['reason']}")
        rp = self.remove_padding
        if rp:
            lines.append("padding removal: " + ("applied: " + f"{rp['attention_nodes']} attention node(s) on packed "
                                                f"tokens, restored {', '.join(rp['restored'])}" if rp["applied"]
                                                else f"not applied: {rp['reason']}"))
        return "\n".join(lines)
