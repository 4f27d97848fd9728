"""Run-time sequence lengths of rewritten models: never a silently wrong answer between the compiled length and
the next tile multiple; one clear error above the model's limit."""
from __future__ import annotations

import numpy as np
import pytest

from models_util import TILE, assert_parity, exported, padding_mask, run, session, token_feeds
from stof_trt.rewrite import rewrite_model


@pytest.mark.parametrize("kind,spec", [("gpt2", None), ("bert", None)])
def test_fallback_refuses_lengths_above_the_compiled_one(kind, spec):
    """Compiled at 20 with 16-row tiles: 20 runs right; 21..32 (inside the last tile) and 33 fail with a message
    that names the compiled sizes, never a wrong output."""
    model = exported(kind)
    new, _ = rewrite_model(model, mask=spec, max_seq_len=20, **TILE)
    sess = session(new)
    rng = np.random.default_rng(0)
    assert_parity(model, new, token_feeds(rng, 2, 20, mask=padding_mask(rng, 2, 20)))
    for seq in (21, 25, 32, 33):
        with pytest.raises(Exception, match=r"exceeds_compiled_seq_q_seq_k.*\{1,20,20\}"):
            run(sess, token_feeds(rng, 2, seq))


def test_fixed_user_mask_sets_the_compiled_length(tmp_path):
    """An npy: mask cannot grow: a dynamic model with no max_seq_len is compiled at the mask's size, and says so."""
    rng = np.random.default_rng(3)
    arr = rng.random((40, 40)) < 0.5
    arr[np.arange(40), np.arange(40)] = True
    np.save(tmp_path / "m.npy", arr)
    new, report = rewrite_model(exported("gpt2"), mask=f"npy:{tmp_path / 'm.npy'}", **TILE)
    att = report.to_dict()["attention"]
    assert att and all(a["seq_q"] == 40 for a in att)
    assert any("the size of the mask" in n for n in report.notes), report.notes
    sess = session(new)
    run(sess, token_feeds(rng, 2, 40))
    with pytest.raises(Exception, match=r"\{1,40,40\}"):
        run(sess, token_feeds(rng, 2, 41))
