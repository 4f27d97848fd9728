"""Export small transformer models to ONNX (random weights from configs; nothing is downloaded).

Used by the tests and the demo. Every exporter seeds torch the same way before building the model, so e.g. BERT
exported with ``mask_dims=2`` and ``mask_dims=3`` has identical weights: the demo runs the original with a dense
mask fed through the 3-D mask input and the rewritten 2-D export with a static layout + padding, and compares.

Each function writes ``path`` and returns an :class:`ExportInfo` (input names, shapes with symbolic dims as
strings, output names, the config values). The transformers models use ``attn_implementation="eager"`` by
default (the plainest graph); ``"sdpa"`` exports torch's scaled_dot_product_attention decomposition instead.
``dynamo=True`` uses torch's dynamo-based exporter instead of the TorchScript one.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

__all__ = ["ExportInfo", "export_bert", "export_gpt2", "export_vit", "export_local_attention", "export_t5_encoder",
           "export_llama", "export_gpt_neo"]

OPSET = 17


@dataclasses.dataclass
class ExportInfo:
    path: str
    inputs: dict          # name -> shape (ints, or "batch"/"seq" for dynamic axes)
    outputs: list
    config: dict

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)


def _export(module, args, path, input_names, output_names, dynamic_axes, opset, dynamo=False):
    """torch.onnx.export with the TorchScript exporter (default), or the dynamo exporter (``dynamo=True``, opset
    >= 18; dynamic axes become torch.export.Dim objects shared by label)."""
    import logging

    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not dynamo:
            torch.onnx.export(module, args, str(path), input_names=input_names, output_names=output_names,
                              dynamic_axes=dynamic_axes or None, opset_version=opset, dynamo=False,
                              do_constant_folding=True)
            return str(path)
        dims: dict = {}
        shapes = tuple({axis: dims.setdefault(label, torch.export.Dim(label, min=1, max=4096))
                        for axis, label in (dynamic_axes or {}).get(name, {}).items()} or None
                       for name in input_names)
        import inspect

        params = inspect.signature(module.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):  # forward(*args): one entry
            shapes = (shapes,)
        level = logging.getLogger("torch").level
        logging.getLogger("torch").setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(module, args, input_names=input_names, output_names=output_names,
                                        dynamic_shapes=shapes if dynamic_axes else None,
                                        opset_version=max(opset, 18), dynamo=True, verbose=False)
        finally:
            logging.getLogger("torch").setLevel(level)
        program.save(str(path))
    return str(path)


def _shapes(args, names, dynamic_axes):
    out = {}
    for a, n in zip(args, names):
        shp = list(a.shape)
        for axis, label in (dynamic_axes or {}).get(n, {}).items():
            shp[axis] = label
        out[n] = shp
    return out


def _wrap(model, names, mask_dims=2):
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            kwargs = dict(zip(names, args))
            if "attention_mask" not in kwargs and "input_ids" in kwargs:  # all ones, built in the graph
                kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
            if mask_dims == 3:  # [B, S, S] (non-zero = attend) -> additive [B, 1, S, S]
                m = kwargs["attention_mask"]
                dtype = next(model.parameters()).dtype
                kwargs["attention_mask"] = (1.0 - m[:, None].to(dtype)) * torch.finfo(dtype).min
            return self.model(**kwargs, use_cache=False).last_hidden_state if _uses_cache(model) else \
                self.model(**kwargs).last_hidden_state

    return Wrapper().eval()


def _uses_cache(model) -> bool:
    return type(model).__name__.startswith(("GPT2", "Llama", "GPTNeo"))


def export_bert(path, *, layers=2, hidden=128, heads=4, intermediate=512, seq_len=128, max_positions=512,
                mask_dims=2, dynamic_axes=True, seed=0, vocab_size=1000, batch=2, opset=OPSET,
                half=False, attn_implementation="eager", dynamo=False) -> ExportInfo:
    """BERT encoder. Inputs ``input_ids`` [B,S] int64 and ``attention_mask``: [B,S] (``mask_dims=2``, the standard
    padding mask) or [B,S,S] (``mask_dims=3``: any mask, non-zero = query may attend key). Output
    ``last_hidden_state`` [B,S,hidden] (float16 weights and activations with ``half=True``)."""
    import torch
    from transformers import BertConfig, BertModel

    if mask_dims not in (2, 3):
        raise ValueError("mask_dims must be 2 or 3")
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate, max_position_embeddings=max_positions,
                     attn_implementation=attn_implementation)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    if half:
        model = model.half()
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    mask = torch.ones((batch, seq_len) if mask_dims == 2 else (batch, seq_len, seq_len), dtype=torch.int64)
    names = ["input_ids", "attention_mask"]
    dyn = {}
    if dynamic_axes:
        dyn = {"input_ids": {0: "batch", 1: "seq"},
               "attention_mask": {0: "batch", 1: "seq"} if mask_dims == 2 else {0: "batch", 1: "seq", 2: "seq"},
               "last_hidden_state": {0: "batch", 1: "seq"}}
    _export(_wrap(model, names, mask_dims), (ids, mask), path, names, ["last_hidden_state"], dyn, opset, dynamo)
    return ExportInfo(str(path), _shapes((ids, mask), names, dyn), ["last_hidden_state"],
                      dict(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, mask_dims=mask_dims,
                           vocab_size=vocab_size, dynamic_axes=dynamic_axes, half=half))


def export_gpt2(path, *, layers=2, hidden=128, heads=4, seq_len=128, max_positions=512, padding_mask=True,
                dynamic_axes=True, seed=0, vocab_size=1000, batch=2, opset=OPSET,
                attn_implementation="eager", dynamo=False) -> ExportInfo:
    """GPT-2 decoder (causal), no KV cache. Inputs ``input_ids`` [B,S] and, with ``padding_mask``,
    ``attention_mask`` [B,S]. Output ``last_hidden_state``."""
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions,
                     bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation)
    model = GPT2Model(cfg).eval()
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    args = [ids]
    names = ["input_ids"]
    if padding_mask:
        args.append(torch.ones((batch, seq_len), dtype=torch.int64))
        names.append("attention_mask")
    dyn = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]} if dynamic_axes else {}
    _export(_wrap(model, names), tuple(args), path, names, ["last_hidden_state"], dyn, opset, dynamo)
    return ExportInfo(str(path), _shapes(args, names, dyn), ["last_hidden_state"],
                      dict(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab_size=vocab_size,
                           dynamic_axes=dynamic_axes))


def export_vit(path, *, layers=2, hidden=128, heads=4, intermediate=512, image_size=64, patch_size=16,
               dynamic_axes=True, seed=0, batch=2, opset=OPSET, attn_implementation="eager",
               dynamo=False) -> ExportInfo:
    """ViT encoder (no mask). Input ``pixel_values`` [B,3,image,image]; sequence = (image/patch)² + 1."""
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=intermediate, image_size=image_size, patch_size=patch_size,
                    attn_implementation=attn_implementation)
    model = ViTModel(cfg, add_pooling_layer=False).eval()
    px = torch.randn(batch, 3, image_size, image_size)
    names = ["pixel_values"]
    dyn = {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}} if dynamic_axes else {}
    _export(_wrap(model, names), (px,), path, names, ["last_hidden_state"], dyn, opset, dynamo)
    return ExportInfo(str(path), _shapes((px,), names, dyn), ["last_hidden_state"],
                      dict(layers=layers, hidden=hidden, heads=heads, seq_len=(image_size // patch_size) ** 2 + 1,
                           dynamic_axes=dynamic_axes))


def _local_attention_model(layers, hidden, heads, window, causal, vocab_size, max_positions):
    import torch
    from torch import nn

    class LocalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.dim = heads, hidden // heads
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

        def forward(self, x, allowed):  # allowed: [B, 1, S, S] bool
            b, s, _ = x.shape
            split = lambda t: t.view(b, s, self.heads, self.dim).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
            return self.o(out.transpose(1, 2).reshape(b, s, hidden))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ln1 = LocalSelfAttention(), nn.LayerNorm(hidden)
            self.fc1, self.fc2, self.ln2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden), \
                nn.LayerNorm(hidden)

        def forward(self, x, allowed):
            x = self.ln1(x + self.attn(x, allowed))
            return self.ln2(x + self.fc2(nn.functional.gelu(self.fc1(x))))

    class LocalAttentionEncoder(nn.Module):
        """Token + position embeddings, post-LN blocks whose attention mask (a band of half-width ``window``,
        optionally causal, ∧ key padding) is built inside forward()."""

        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab_size, hidden), nn.Embedding(max_positions, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, input_ids, attention_mask):
            s = input_ids.shape[1]
            idx = torch.arange(s, device=input_ids.device)
            rel = idx[:, None] - idx[None, :]                       # q - k
            band = (rel <= window) & (rel >= (0 if causal else -window))
            allowed = band[None, None] & (attention_mask[:, None, None, :] != 0)
            x = self.tok(input_ids) + self.pos(idx)[None]
            for blk in self.blocks:
                x = blk(x, allowed)
            return x

    return LocalAttentionEncoder().eval()


def export_local_attention(path, *, layers=2, hidden=128, heads=4, window=8, causal=False, seq_len=128,
                           max_positions=512, dynamic_axes=True, seed=0, vocab_size=1000, batch=2,
                           opset=OPSET, dynamo=False) -> ExportInfo:
    """A small encoder whose sliding-window mask (|q-k| <= window, or 0 <= q-k <= window when ``causal``) and
    key padding are built inside the graph (masked_fill -> Where). Inputs ``input_ids``, ``attention_mask``."""
    import torch

    torch.manual_seed(seed)
    model = _local_attention_model(layers, hidden, heads, window, causal, vocab_size, max_positions)
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    mask = torch.ones((batch, seq_len), dtype=torch.int64)
    names = ["input_ids", "attention_mask"]
    dyn = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]} if dynamic_axes else {}
    _export(model, (ids, mask), path, names, ["last_hidden_state"], dyn, opset, dynamo)
    return ExportInfo(str(path), _shapes((ids, mask), names, dyn), ["last_hidden_state"],
                      dict(layers=layers, hidden=hidden, heads=heads, window=window, causal=causal, seq_len=seq_len,
                           vocab_size=vocab_size, dynamic_axes=dynamic_axes))


def _export_token_model(path, model, *, seq_len, vocab_size, batch, dynamic_axes, opset, dynamo, config):
    import torch

    ids = torch.randint(0, vocab_size, (batch, seq_len))
    mask = torch.ones((batch, seq_len), dtype=torch.int64)
    names = ["input_ids", "attention_mask"]
    dyn = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]} if dynamic_axes else {}
    _export(_wrap(model, names), (ids, mask), path, names, ["last_hidden_state"], dyn, opset, dynamo)
    return ExportInfo(str(path), _shapes((ids, mask), names, dyn), ["last_hidden_state"], config)


def export_t5_encoder(path, *, layers=2, hidden=128, heads=4, intermediate=512, seq_len=128, dynamic_axes=True,
                      seed=0, vocab_size=1000, batch=2, opset=OPSET, dynamo=False) -> ExportInfo:
    """T5 encoder: relative position bias added to the scores (kept as attn_bias) plus the padding mask; RMS
    norm and ReLU MLP (no STOF epilogue). Inputs ``input_ids``, ``attention_mask`` [B,S]."""
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab_size, d_model=hidden, num_layers=layers, num_heads=heads,
                   d_kv=hidden // heads, d_ff=intermediate)
    cfg._attn_implementation = "eager"
    model = T5EncoderModel(cfg).eval()
    return _export_token_model(path, model, seq_len=seq_len, vocab_size=vocab_size, batch=batch,
                               dynamic_axes=dynamic_axes, opset=opset, dynamo=dynamo,
                               config=dict(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len))


def export_llama(path, *, layers=2, hidden=128, heads=4, kv_heads=None, intermediate=256, seq_len=128,
                 max_positions=512, dynamic_axes=True, seed=0, vocab_size=1000, batch=2, opset=OPSET,
                 dynamo=False) -> ExportInfo:
    """Llama decoder (causal, rotary, RMS norm, SwiGLU), no KV cache. ``kv_heads`` < ``heads`` gives grouped-query
    attention (K/V repeated to all heads inside the graph). Inputs ``input_ids``, ``attention_mask`` [B,S]."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                      intermediate_size=intermediate, max_position_embeddings=max_positions)
    cfg._attn_implementation = "eager"
    model = LlamaModel(cfg).eval()
    return _export_token_model(path, model, seq_len=seq_len, vocab_size=vocab_size, batch=batch,
                               dynamic_axes=dynamic_axes, opset=opset, dynamo=dynamo,
                               config=dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads or heads,
                                           seq_len=seq_len))


def export_gpt_neo(path, *, layers=2, hidden=128, heads=4, window=256, seq_len=128, max_positions=512,
                   dynamic_axes=True, seed=0, vocab_size=1000, batch=2, opset=OPSET, dynamo=False) -> ExportInfo:
    """GPT-Neo: layers alternate global (causal) and local (causal sliding window of ``window`` keys) attention,
    both masks built in the graph. Inputs ``input_ids``, ``attention_mask`` [B,S]."""
    import torch
    from transformers import GPTNeoConfig, GPTNeoModel

    torch.manual_seed(seed)
    cfg = GPTNeoConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       attention_types=[[["global", "local"], (layers + 1) // 2]], window_size=window,
                       max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=0)
    cfg.num_layers = layers
    cfg.attention_layers = cfg.attention_layers[:layers]
    cfg._attn_implementation = "eager"
    model = GPTNeoModel(cfg).eval()
    return _export_token_model(path, model, seq_len=seq_len, vocab_size=vocab_size, batch=batch,
                               dynamic_axes=dynamic_axes, opset=opset, dynamo=dynamo,
                               config=dict(layers=layers, hidden=hidden, heads=heads, window=window, seq_len=seq_len))
