"""Tactic choice without measuring: a tactic cache's entry, else the pre-search's first choice.

:func:`choose` answers for one problem (Python callers); :func:`add_presearch_entries` fills a cache with the
pre-search's first choices for a model's attention nodes, so a session runs them without first-use timing where
``stof tune`` has measured nothing (the library's stof_attn_select makes the same choice in C++).  Measuring lives in stof_trt.tune, the cache
file in stof_trt.tactic_cache.
"""

from __future__ import annotations

from .errors import StofError
from .nodes import attention_nodes, attention_problem_dims
from .tactic_cache import CacheKey, TacticCache, node_signature, shape_bucket

__all__ = ["choose", "add_presearch_entries"]


def choose(cache: TacticCache | None, key: CacheKey, layout, *, batch: int, heads: int, head_dim: int,
           seq_q: int, seq_k: int) -> tuple[int, str]:
    """The tactic for a problem: the cache's entry, else the pre-search's first choice.  Returns (id, source)."""
    if cache is not None:
        t = cache.lookup(key)
        if t:
            return t, "cache"
    from . import presearch

    ranked = presearch.rank(layout, batch=batch, heads=heads, head_dim=head_dim, seq_q=seq_q, seq_k=seq_k)
    if not ranked:
        raise StofError(f"no tactic supports head_dim {head_dim} with tile {layout.tile_m}x{layout.tile_n}")
    return int(ranked[0][0]), "presearch"


def add_presearch_entries(cache: TacticCache, model, shapes, gpu: str, cc: str) -> int:
    """Add the pre-search's first choice for every attention node of `model` and every (batch, seq) in `shapes`
    whose key the cache lacks (measured entries are kept).  Returns the number of entries added; nodes whose
    heads / head dim are not static are skipped."""
    from . import presearch

    dims = attention_problem_dims(model)
    added = 0
    for nd in attention_nodes(model):
        if nd.name not in dims:
            continue
        dtype, heads, head_dim = dims[nd.name]
        for batch, seq in shapes:
            lay = nd.layout_at(int(seq), int(seq))   # past the compiled length: the layout the plugin builds
            stats = presearch.tile_stats(lay)
            sq, sk = min(int(seq), lay.seq_q), min(int(seq), lay.seq_k)
            key = CacheKey(gpu, cc, node_signature(dtype, heads, head_dim, lay.tile_m, lay.tile_n, lay.num_layouts,
                                                   lay.seq_q, lay.seq_k,
                                                   nd.key_padding_mask is not None and not nd.tokens, nd.tokens),
                           shape_bucket(batch, sq, sk), lay.signature())
            if cache.get(key) is not None:
                continue
            ranked = presearch.rank(stats, batch=int(batch), heads=heads, head_dim=head_dim, seq_q=sq, seq_k=sk)
            if ranked:
                cache.put(key, int(ranked[0][0]), source="presearch", nodes=[nd.name])
                added += 1
    return added
