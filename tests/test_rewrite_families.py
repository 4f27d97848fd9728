"""Every model family rewrites with no flags and equals the original at real tokens at every length up to its
compiled one; one past it is the model's own limit, or, for models without one, runs and equals the original (the
layouts grow from the nodes' layout_spec)."""
from __future__ import annotations

import numpy as np
import pytest

from models_util import FAMILIES, family, padding_mask, session, token_feeds
from stof_trt.rewrite import rewrite_model
from stof_trt.rewrite.attention_common import DEFAULT_MAX_SEQ

LENGTHS = (1, 17, 64, 100)


def _real_token_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None) -> float:
    assert a.shape == b.shape and np.isfinite(b).all()
    keep = np.ones(a.shape[:2], bool) if mask is None else mask.astype(bool)
    return float(np.abs(a - b)[keep].max() / max(1.0, float(np.abs(a[keep]).max())))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_rewrites_with_no_flags_at_every_length(name):
    model, limit = family(name)
    new, report = rewrite_model(model)
    attention = report.to_dict()["attention"]
    assert attention, f"{name}: no attention rewritten ({report.notes})"
    orig, sess = session(model), session(new)
    rng = np.random.default_rng(0)
    if name in ("vit", "whisper_encoder"):  # fixed sequence length: only the batch is dynamic
        inp = orig.get_inputs()[0]
        feeds = {inp.name: rng.standard_normal([3, *inp.shape[1:]]).astype(np.float32)}
        assert _real_token_diff(orig.run(None, feeds)[0], sess.run(None, feeds)[0], None) <= 1e-4
        return
    compiled = attention[0]["seq_q"]
    assert all(a["seq_q"] == compiled for a in attention)
    assert compiled == (limit or DEFAULT_MAX_SEQ), (compiled, limit, report.notes)
    for seq in sorted({s for s in LENGTHS if s <= compiled} | {compiled}):
        mask = padding_mask(rng, 2, seq)
        feeds = token_feeds(rng, 2, seq, mask=mask)
        feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)  # no special ids (RoBERTa counts positions past them)
        d = _real_token_diff(orig.run(None, feeds)[0], sess.run(None, feeds)[0], mask)
        assert d <= 1e-4, f"{name} at length {seq}: max relative difference {d:.3g}"
    feeds = token_feeds(rng, 1, compiled + 1)
    feeds["input_ids"] = np.maximum(feeds["input_ids"], 3)
    if limit is None:  # the model runs longer, and so do its closed-form layouts (layout_spec)
        d = _real_token_diff(orig.run(None, feeds)[0], sess.run(None, feeds)[0], None)
        assert d <= 1e-4, f"{name} one past its compiled length {compiled}: max relative difference {d:.3g}"
    else:  # the model's own limit: the original fails there too
        with pytest.raises(Exception):
            orig.run(None, feeds)
        with pytest.raises(Exception):
            sess.run(None, feeds)
