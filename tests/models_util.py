"""Shared helpers for the rewrite tests: cached tiny exports, ORT runs, parity and fusion assertions."""
from __future__ import annotations

import atexit
import collections
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx

#: Tiny model sizes: the whole rewrite suite must run in a few minutes on 2 CPU cores.
TINY = dict(layers=2, hidden=32, heads=4)
TILE = dict(tile_m=16, tile_n=32)

_CACHE_DIR = Path(tempfile.mkdtemp(prefix="stof_rewrite_tests_"))
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)  # the exports live as long as the test process


@functools.lru_cache(maxsize=None)
def _export(kind: str, items: tuple) -> str:
    from stof_trt import export

    kwargs = dict(items)
    path = _CACHE_DIR / (kind + "_" + "_".join(f"{k}{v}" for k, v in items).replace(":", "") + ".onnx")
    getattr(export, f"export_{kind}")(str(path), **kwargs)
    return str(path)


def exported(kind: str, **kwargs) -> onnx.ModelProto:
    """Export (once per argument set) and load a tiny model: kind in bert, gpt2, vit, local_attention, t5_encoder,
    llama."""
    defaults = dict(TINY)
    if kind in ("bert", "vit", "t5_encoder", "llama"):
        defaults["intermediate"] = 64
    if kind == "vit":
        defaults.update(image_size=32, patch_size=8)
    else:
        defaults.update(seq_len=16, vocab_size=100)
    defaults.update(kwargs)
    return onnx.load(_export(kind, tuple(sorted(defaults.items()))))


def session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(model_or_session, feeds: dict) -> list[np.ndarray]:
    sess = model_or_session if hasattr(model_or_session, "run") else session(model_or_session)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def padding_mask(rng, batch: int, seq: int, min_len: int = 1) -> np.ndarray:
    """Right padding with random lengths in [min_len, seq]; row 0 is unpadded."""
    lengths = rng.integers(min_len, seq + 1, batch)
    lengths[0] = seq
    return (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)


def token_feeds(rng, batch: int, seq: int, vocab: int = 100, mask: np.ndarray | None = None) -> dict:
    feeds = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64)}
    feeds["attention_mask"] = mask if mask is not None else np.ones((batch, seq), np.int64)
    return feeds


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| relative to max(1, max |a|)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))


def padding_removed(model_or_session) -> bool:
    """The rewrite packed the model's tokens (docs/rewrite.md "Padding removal")."""
    if hasattr(model_or_session, "get_modelmeta"):
        meta = model_or_session.get_modelmeta().custom_metadata_map
    else:
        meta = {p.key: p.value for p in model_or_session.metadata_props}
    return meta.get("stof.padding_removed") == "1"


def assert_parity(original, rewritten, feeds: dict, atol: float = 1e-4) -> float:
    """Outputs of the two models agree within ``atol`` relative to magnitude; returns the max difference.
    A model with its padding removed is compared at the real tokens of [B, S, ...] outputs, and its padded
    positions must be 0."""
    outs_a, outs_b = run(original, feeds), run(rewritten, feeds)
    assert len(outs_a) == len(outs_b)
    keep = None
    if feeds.get("attention_mask") is not None and padding_removed(rewritten):
        keep = np.asarray(feeds["attention_mask"]) != 0
    worst = 0.0
    for a, b in zip(outs_a, outs_b):
        if keep is not None and a.shape[:2] == keep.shape:
            assert b.shape == a.shape and not np.any(b[~keep]), "padded positions are not 0"
            a, b = a[keep], b[keep]
        d = max_rel_diff(a, b)
        assert d <= atol, f"max relative difference {d:.3g} > {atol}"
        worst = max(worst, d)
    return worst


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def assert_fused(model: onnx.ModelProto, counts: dict[str, int]) -> None:
    """The rewritten model has exactly ``counts`` nodes of each given op_type, passes the full checker, and
    carries a model-local function for each STOF (op_type, overload) it uses."""
    got = op_counts(model)
    for op, n in counts.items():
        assert got.get(op, 0) == n, f"{op}: expected {n}, found {got.get(op, 0)} ({dict(got)})"
    onnx.checker.check_model(model, full_check=True)
    funcs = {(f.domain, f.name, f.overload) for f in model.functions}
    for node in model.graph.node:
        if node.domain == "stof":
            assert ("stof", node.op_type, node.overload) in funcs, (node.op_type, node.overload)
            for a in node.attribute:
                assert a.type != onnx.AttributeProto.TENSOR
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.domain == "stof":
            for name in node.input:
                if name in inits:
                    assert inits[name].data_type in (onnx.TensorProto.INT32, onnx.TensorProto.FLOAT,
                                                     onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16), name


# -- Model families with no export helper in stof_trt.export: tiny random-weight exports on CPU ---------------------
#: Each family: (kind of input, its maximum length or None for no position table). ``seq`` inputs are input_ids +
#: attention_mask [B, S]; ``image`` / ``audio`` inputs have a fixed length.
FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "vit", "modernbert", "t5_encoder", "llama", "mistral",
            "clip_text", "whisper_encoder")


def _family_module(name: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    h, L, heads, inter, vocab = TINY["hidden"], TINY["layers"], TINY["heads"], 64, 100
    if name == "roberta":
        cfg = tf.RobertaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                               intermediate_size=inter, max_position_embeddings=66, pad_token_id=1)
        return tf.RobertaModel(cfg, add_pooling_layer=False), cfg, 64  # positions start after the padding id
    if name == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=vocab, dim=h, n_layers=L, n_heads=heads, hidden_dim=inter,
                                  max_position_embeddings=96)
        return tf.DistilBertModel(cfg), cfg, 96
    if name == "modernbert":
        cfg = tf.ModernBertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                                  intermediate_size=inter, global_attn_every_n_layers=2, local_attention=16,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0)
        return tf.ModernBertModel(cfg), cfg, None
    if name == "mistral":
        cfg = tf.MistralConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                               num_key_value_heads=2, intermediate_size=inter, sliding_window=24)
        return tf.MistralModel(cfg), cfg, None
    if name == "clip_text":
        cfg = tf.CLIPTextConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                                intermediate_size=inter, max_position_embeddings=77, pad_token_id=1,
                                bos_token_id=0, eos_token_id=2)
        return tf.CLIPTextModel(cfg), cfg, 77
    if name == "whisper_encoder":
        cfg = tf.WhisperConfig(vocab_size=vocab, d_model=h, encoder_layers=L, encoder_attention_heads=heads,
                               decoder_layers=1, decoder_attention_heads=heads, encoder_ffn_dim=inter,
                               decoder_ffn_dim=inter, num_mel_bins=8, max_source_positions=24,
                               pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
        return tf.WhisperModel(cfg).get_encoder(), cfg, None
    raise ValueError(name)


@functools.lru_cache(maxsize=None)
def _export_family(name: str) -> str:
    import torch

    from stof_trt.export import _export

    module, cfg, _ = _family_module(name)
    module.eval()
    for attr in ("_attn_implementation",):
        setattr(cfg, attr, "eager")
    path = _CACHE_DIR / f"family_{name}.onnx"
    if name == "whisper_encoder":  # fixed length: 2 x max_source_positions frames
        feats = torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions)

        class Enc(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = module

            def forward(self, x):
                return self.m(x).last_hidden_state

        _export(Enc().eval(), (feats,), path, ["input_features"], ["last_hidden_state"],
                {"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}}, 17)
        return str(path)
    ids = torch.randint(2, 100, (2, 16))
    mask = torch.ones((2, 16), dtype=torch.int64)

    class Tok(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, input_ids, attention_mask):
            kw = {"use_cache": False} if name == "mistral" else {}
            return self.m(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state

    names = ["input_ids", "attention_mask"]
    _export(Tok().eval(), (ids, mask), path, names, ["last_hidden_state"],
            {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]}, 17)
    return str(path)


def family(name: str) -> tuple[onnx.ModelProto, int | None]:
    """A tiny export of model family ``name`` (FAMILIES) and its maximum sequence length (None: no limit of its
    own). bert, gpt2, vit, t5_encoder and llama come from stof_trt.export."""
    builtin = {"bert": ("bert", dict(max_positions=80), 80), "gpt2": ("gpt2", dict(max_positions=72), 72),
               "vit": ("vit", {}, None), "t5_encoder": ("t5_encoder", {}, None), "llama": ("llama", {}, None)}
    if name in builtin:
        kind, kw, limit = builtin[name]
        return exported(kind, **kw), limit
    return onnx.load(_export_family(name)), _FAMILY_LIMITS[name]


_FAMILY_LIMITS = {"roberta": 64, "distilbert": 96, "modernbert": None, "mistral": None, "clip_text": 77,
                  "whisper_encoder": None}


def layout_specs(model: onnx.ModelProto) -> list[str | None]:
    """Each StofSparseAttention node's layout_spec attribute, None where it has none."""
    out = []
    for n in model.graph.node:
        if n.op_type == "StofSparseAttention":
            a = {x.name: x for x in n.attribute}
            out.append(a["layout_spec"].s.decode() if "layout_spec" in a else None)
    return out
