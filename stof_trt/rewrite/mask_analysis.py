"""What is the mask of an attention core? Found by evaluating the graph's own mask subgraph.

Syntax-based recognition breaks with every exporter release (transformers 5 builds its padding mask with
Flatten/Gather index arithmetic and And/Expand/Where), so the rewrite instead *evaluates* the mask tensor that
reaches the softmax for chosen inputs and checks what it is:

* boolean-like: every value allows (additive 0 / condition True) or masks (additive <= -1e4 / condition False);
  otherwise the mask is a general bias and is kept as ``attn_bias`` (exact for any bias);
* static part: the allowed pattern with all-ones padding must not depend on the batch row; it may differ per head;
* padding part: when the mask depends on the values of exactly one [B, S] graph input P, the pattern for random
  0/1 values of P must equal ``static & P[b, k] != 0`` (P becomes the node's int32 ``key_padding_mask``);
* dynamic sequence axes: the pattern at a shorter length must be the top-left corner of the compiled one.

A pattern passing all checks becomes the static tile layout; it is named causal / sliding window when it is one.
"""
from __future__ import annotations

import dataclasses

import numpy as np

#: An additive mask value at or below this masks the pair (exp underflows to exactly 0 in fp32 and fp16).
MASKED_BELOW = -1.0e4


@dataclasses.dataclass
class MaskTerm:
    """The mask operand of one attention core. ``mode``: "additive" (0 allowed, very negative masked),
    "allowed_bool" (True allowed) or "masked_bool" (True masked)."""

    tensor: str
    mode: str
    fill: object = None  # for a Where mask: the fill tensor (to rebuild an exact bias if it is kept)


@dataclasses.dataclass
class GraphMask:
    """Result of the analysis. ``kind``: "none", "static", "padding", "static+padding" or "bias"."""

    kind: str
    static: np.ndarray | None = None  # [L, Sq, Sk] bool, None when every pair is allowed
    padding_input: str | None = None
    name: str = ""
    reason: str = ""  # why a mask was kept as a bias

    @property
    def source(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "bias":
            return "graph bias (kept as attn_bias)"
        parts = [self.name] if self.static is not None else []
        if self.padding_input:
            parts.append(f"padding from input '{self.padding_input}'")
        return "graph " + " + ".join(parts) if parts else "graph (all allowed)"


def allowed_of(value: np.ndarray, mode: str) -> np.ndarray | None:
    """Boolean 'allowed' array from a mask value, or None when the value is not boolean-like."""
    v = np.asarray(value)
    if mode == "allowed_bool":
        return v.astype(bool)
    if mode == "masked_bool":
        return ~v.astype(bool)
    if v.dtype == bool:
        return None
    allowed = v == 0
    if not np.all(allowed | (v <= MASKED_BELOW)):
        return None
    return allowed


def _as4d(a: np.ndarray) -> np.ndarray | None:
    if a.ndim > 4:
        return None
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def name_pattern(static: np.ndarray) -> str:
    """A readable name for a static [L, Sq, Sk] pattern: full, causal, sliding window, or custom."""
    L, sq, sk = static.shape
    if static.all():
        return "full"
    if L == 1 and sq == sk:
        d = np.arange(sq)[:, None] - np.arange(sk)[None, :]
        m = static[0]
        if np.array_equal(m, d >= 0):
            return "causal"
        if m.any():
            lo, hi = int(d[m].min()), int(d[m].max())
            if np.array_equal(m, (d >= lo) & (d <= hi)):
                # named as the mask spec that builds it: "window" is the half-width |q-k| <= W everywhere
                if lo == 0:
                    return f"sliding:window={hi},causal=1 (0 <= q-k <= {hi})"
                if lo == -hi:
                    return f"sliding:window={hi} (|q-k| <= {hi})"
                return f"band q-k in [{lo}, {hi}]"
    return "custom per-head pattern" if L > 1 else "custom static pattern"


def classify(term: MaskTerm, sq: int, sk: int, heads: int, runs: list[dict], pad_input: str | None,
             short_run: dict | None) -> GraphMask:
    """Classify one mask term from probe runs.

    ``runs``: dicts with "values" ({tensor: value}) and "pad" (the [B, S] values fed to ``pad_input``, or None);
    runs[0] has all-ones padding. ``short_run``: a run at a shorter sequence length with its "sq"/"sk" (or None
    for a fixed-size model)."""
    def bias(reason: str) -> GraphMask:
        return GraphMask("bias", reason=reason)

    a0 = allowed_of(runs[0]["values"][term.tensor], term.mode)
    if a0 is None:
        return bias("mask values are not just 0 / large negative: a general additive bias")
    a0 = _as4d(a0)
    if a0 is None or a0.shape[1] not in (1, heads):
        return bias(f"mask of shape {np.shape(runs[0]['values'][term.tensor])} does not broadcast per head")
    try:
        a0 = np.broadcast_to(a0, (a0.shape[0], a0.shape[1], sq, sk))
    except ValueError:
        return bias(f"mask shape {a0.shape} does not broadcast to [*, *, {sq}, {sk}]")
    static = a0[0]
    if not all(np.array_equal(static, a0[b]) for b in range(1, a0.shape[0])):
        return bias("the mask differs between batch rows with all-ones padding")
    for run in runs[1:]:
        a = allowed_of(run["values"][term.tensor], term.mode)
        a = None if a is None else _as4d(a)
        if a is None:
            return bias("mask is not boolean-like for some padding values")
        pad = run["pad"]
        if pad_input is not None:
            if pad.ndim != 2 or pad.shape[1] != sk:
                return bias(f"input '{pad_input}' of shape {pad.shape} is not a [B, Sk] key padding mask")
            expect = static[None] & (pad[:, None, None, :] != 0)
        else:
            expect = static[None]
        try:
            shape = np.broadcast_shapes(a.shape, expect.shape)
            ok = np.array_equal(np.broadcast_to(a, shape), np.broadcast_to(expect, shape))
        except ValueError:
            ok = False
        if not ok:
            return bias(f"the mask is not a static pattern combined with key padding from '{pad_input}'")
    if short_run is not None:
        a = allowed_of(short_run["values"][term.tensor], term.mode)
        a = None if a is None else _as4d(a)
        s2q, s2k = short_run["sq"], short_run["sk"]
        try:
            a = np.broadcast_to(a, (a.shape[0], a.shape[1], s2q, s2k))[0]
            ok = np.array_equal(a, np.broadcast_to(static, (static.shape[0], sq, sk))[:, :s2q, :s2k])
        except (ValueError, AttributeError, IndexError):
            ok = False
        if not ok:
            return bias("the pattern at a shorter sequence length is not the top-left corner of the longer one")
    if static.shape[0] > 1 and all(np.array_equal(static[0], s) for s in static[1:]):
        static = static[:1]
    name = name_pattern(static)
    full = name == "full"
    if full and pad_input is None:
        return GraphMask("none" if full else "static", None, None, "full")
    kind = ("padding" if full else "static+padding") if pad_input else "static"
    return GraphMask(kind, None if full else np.ascontiguousarray(static), pad_input, name)
