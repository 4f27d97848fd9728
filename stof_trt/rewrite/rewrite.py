"""``rewrite_model``: the entry point. Runs the fusions in a fixed order and adds the model-local functions.

Order: attention cores (decomposed, then the ONNX ``Attention`` op, then ORT contrib Attention /
MultiHeadAttention), then epilogues (MatMul + bias + GELU and ORT's BiasGelu / FastGelu, decomposed LayerNorm,
residual Add + LayerNorm and ORT's SkipLayerNormalization). Attention runs first
because it probes the *original* model, whose tensor names it still shares.
"""
from __future__ import annotations

import copy

import onnx
import onnx_graphsurgeon as gs

from ..errors import StofError

from .base import RewriteContext
from .functions import DOMAIN, DOMAIN_VERSION, MIN_OPSET, build_functions
from .matcher import EXTERNAL_DATA_DIR
from .report import RewriteReport


def _fusions(epilogues: bool, packed_qkv: bool = True, dense_attention: str = "stof", remove_padding: bool = True):
    from .fuse_add_layernorm import FuseAddLayerNorm, FuseLayerNormDecomposed
    from .fuse_attention import FuseAttentionCore
    from .fuse_gemm_gelu import FuseGemmGelu
    from .fuse_onnx_attention import FuseOnnxAttention
    from .fuse_ort_attention import FuseOrtAttention, FuseOrtMultiHeadAttention
    from .fuse_ort_epilogues import FuseOrtBiasGelu, FuseOrtSkipLayerNorm
    from .fuse_ort_gqa import FuseOrtGroupQueryAttention
    from .fuse_ort_longformer import FuseOrtLongformerAttention
    from .fuse_ort_sparse_attention import FuseOrtSparseAttention
    from .fuse_packed_qkv import FusePackedQkv

    order = [FuseAttentionCore, FuseOnnxAttention, FuseOrtAttention, FuseOrtMultiHeadAttention]
    order.append(FuseOrtGroupQueryAttention)
    order.append(FuseOrtSparseAttention)
    order.append(FuseOrtLongformerAttention)
    if packed_qkv:
        order.append(FusePackedQkv)
        if dense_attention == "ort":
            from .fuse_dense_ort_attention import FuseDenseOrtAttention

            order.append(FuseDenseOrtAttention)
    if epilogues:
        order += [FuseGemmGelu, FuseOrtBiasGelu, FuseLayerNormDecomposed, FuseAddLayerNorm, FuseOrtSkipLayerNorm]
    if remove_padding:
        from .remove_padding import RemovePadding

        order.append(RemovePadding)
    return order


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise StofError("the model imports no default ONNX opset")


def rewrite_model(model: onnx.ModelProto, *, mask=None, epilogues: bool = True, tile_m: int = 64, tile_n: int = 64,
                  max_seq_len: int | None = None, external_data_dir: str | None = None,
                  packed_qkv: bool = True, dense_attention: str = "stof", schemes: dict | None = None,
                  scheme_tokens: int | None = None, remove_padding: bool = True,
                  token_capacity_input: bool = False) -> tuple[onnx.ModelProto, RewriteReport]:
    """Rewrite masked attention cores and epilogues of ``model`` into STOF nodes (domain ``stof``).

    Args:
        model: the ONNX model (not modified).
        mask: a user mask (``stof_trt.masks.MaskSpec`` or spec string): the static sparsity of every attention
            node, intersected with any static pattern found in the graph.
        epilogues: also fuse MatMul + bias + GELU and residual Add + LayerNorm.
        tile_m, tile_n: tile size of the compiled layouts (docs/format.md).
        max_seq_len: the compiled sequence length for models with a dynamic sequence axis (run-time lengths
            must be <= it; the layout's top-left corner is used).
        packed_qkv: feed attention nodes whose Q, K, V are projections of one input (three MatMul + bias, or one
            Split into thirds) from one packed GEMM, read in place (``qkv_format="bs3hd"``, no transposes).
        dense_attention: "stof" (default): every attention core runs on the STOF kernels; "ort": attention with no
            sparsity (no mask, or key padding only) whose Q/K/V were packed becomes ONNX Runtime's contrib
            ``Attention`` (com.microsoft; its fused kernels), the model then needing ONNX Runtime for it. Needs
            packed_qkv=True and (for three MatMul + bias projections) epilogues=True; dense attention left on the
            STOF kernels is listed in the report's notes.
        schemes: {chain signature: (scheme, algo)}: measured fusion schemes (TacticCache.scheme_choices); chains
            without one get the cost model's first choice at ``scheme_tokens`` tokens (docs/schemes.md).
        remove_padding: run the token-wise part of the model (GEMMs, LayerNorms, activations, attention) on the
            real tokens only when it has one padding mask and every attention is full or causal: pack the tokens
            after the embeddings (``qkv_format="t3hd"``) and restore [B, S, ·] at the outputs, with zeros at padded
            positions. The report's ``remove_padding`` says whether it applied and, if not, why.
        token_capacity_input: where padding is removed, pack into a fixed number of token slots, the length of
            a new int32 input ``stof_token_capacity`` (values unused; at least the batch's real tokens), instead
            of exactly the real tokens. The run then has no data-dependent shape, so ORT can replay it through a
            CUDA graph, one per capacity; ``stof_trt.ort.Binding`` fills the input from the padding mask
            (docs/rewrite.md, "CUDA graphs"). A StofError where padding removal does not apply.
        external_data_dir: for a model loaded with ``onnx.load(..., load_external_data=False)`` (needed when a
            single tensor is over 2 GB): the directory its external data locations are relative to. Those
            weights are read where a value is needed and stay external in the returned model.

    Returns:
        (rewritten model, RewriteReport). Patterns that are not supported are left untouched and listed in the
        report with the reason.
    """
    token = EXTERNAL_DATA_DIR.set(external_data_dir)
    try:
        return _rewrite_model(model, mask=mask, epilogues=epilogues, tile_m=tile_m, tile_n=tile_n,
                              max_seq_len=max_seq_len, packed_qkv=packed_qkv, dense_attention=dense_attention,
                              schemes=schemes, scheme_tokens=scheme_tokens, remove_padding=remove_padding,
                              token_capacity_input=token_capacity_input)
    finally:
        EXTERNAL_DATA_DIR.reset(token)


def _rewrite_model(model, *, mask, epilogues, tile_m, tile_n, max_seq_len, packed_qkv=True, dense_attention="stof",
                   schemes=None, scheme_tokens=None, remove_padding=True, token_capacity_input=False):
    from ..format import check_tile_shape
    from ..masks import parse_mask

    if not isinstance(model, onnx.ModelProto):
        raise StofError("rewrite_model expects an onnx.ModelProto")
    check_tile_shape(tile_m, tile_n)
    if dense_attention not in ("stof", "ort"):
        raise StofError(f"dense_attention must be 'stof' or 'ort', got {dense_attention!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise StofError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if mask is not None:
        mask = parse_mask(mask)
    if token_capacity_input and not remove_padding:
        raise StofError("token_capacity_input sizes the packed tokens: it needs remove_padding=True")
    if any(imp.domain == DOMAIN for imp in model.opset_import):
        raise StofError("the model already contains STOF nodes (domain 'stof'): rewrite the original model")
    check_input(model)
    original = model
    model = copy.deepcopy(model)  # onnx-graphsurgeon shares some protos with the model it imports
    opset = default_opset(model)
    if opset < MIN_OPSET:
        from onnx import version_converter

        try:
            model = version_converter.convert_version(model, 17)
        except Exception as exc:  # noqa: BLE001
            raise StofError(f"opset {opset} is too old and converting it to 17 failed: {str(exc)[:120]}") from None
        opset = 17
    report = RewriteReport(opset=opset)
    graph = gs.import_onnx(model)
    report.nodes_before = len(graph.nodes)
    ctx = RewriteContext(graph=graph, report=report, opset=opset,
                         options={"mask": mask, "epilogues": epilogues, "tile_m": tile_m, "tile_n": tile_n, "max_seq_len": max_seq_len,
                                  "_original_model": model, "schemes": schemes, "scheme_tokens": scheme_tokens,
                                  "token_capacity_input": token_capacity_input})
    if opset != default_opset(original):
        report.notes.append(f"model converted from opset {default_opset(original)} to {opset}")
    fusions = _fusions(epilogues, packed_qkv, dense_attention, remove_padding)
    # the GEMM chains get their schemes on the padded graph; padding removal, which only re-shapes the token
    # axis, runs last
    last = [f for f in fusions if f.__name__ == "RemovePadding"]
    for fusion in [f for f in fusions if f not in last]:
        fusion(ctx).apply()
    if epilogues:
        from .schemes import apply_schemes

        apply_schemes(ctx)
    for fusion in last:
        fusion(ctx).apply()
    if not remove_padding:
        report.remove_padding = {"applied": False, "reason": "turned off (remove_padding=False)"}
    if token_capacity_input and not report.remove_padding.get("applied"):  # asked for, so not dropped in silence
        why = report.remove_padding.get("reason") or "no padding mask found"
        raise StofError(f"token_capacity_input sizes the packed tokens of padding removal, which does not apply to "
                        f"this model: {why}")
    report.nodes_after = len(graph.nodes)
    if dense_attention == "ort":
        _note_dense_on_stof(report, packed_qkv, epilogues)
    if mask is not None and not report.attention:
        report.notes.append("a mask was given but no attention was rewritten")
    # (LongformerAttention's nodes have global_slots keys in front of the sequence: the local node's query rows are
    # the sequence)
    if max_seq_len is not None and report.attention and all(a["seq_q"] != max_seq_len for a in report.attention):
        report.notes.append(f"max_seq_len={max_seq_len} not used: the model's attention sizes are fixed")
    if not ctx.functions:
        out = copy.deepcopy(original)
        return out, report
    report.notes.extend(ctx.options.get("_spec_notes", ()))
    grows = _layouts_grow(ctx, graph, report)
    if not grows:  # a limit of the model's own (or a node without a spec): past it the plugin refuses, as it should
        for n in graph.nodes:
            if n.op == "StofSparseAttention":
                n.attrs.pop("layout_spec", None)
    specs = _spec_overloads(ctx, graph)
    graph.cleanup().toposort()
    out = gs.export_onnx(graph, do_type_check=False)
    # metadata gs does not carry
    out.ir_version = max(original.ir_version, 10)  # function overloads need IR 10
    out.producer_name = original.producer_name
    out.producer_version = original.producer_version
    out.model_version = original.model_version
    out.doc_string = original.doc_string
    del out.metadata_props[:]
    out.metadata_props.extend(original.metadata_props)
    out.metadata_props.add(key="stof.rewritten", value="1")
    if report.remove_padding.get("applied"):  # outputs are 0 at padded positions (docs/rewrite.md)
        out.metadata_props.add(key="stof.padding_removed", value="1")
        out.metadata_props.add(key="stof.padding_mask_input", value=report.remove_padding["padding_mask_input"])
        if token_capacity_input:
            out.metadata_props.add(key="stof.token_capacity_input",
                                   value=report.remove_padding["token_capacity_input"])
    # the longest sequence it runs and what sets it, which the CLI's refusal names (docs/rewrite.md)
    if "_compiled_seq" in ctx.options and not grows:
        out.metadata_props.add(key="stof.max_seq_len", value=str(ctx.options["_compiled_seq"]))
        out.metadata_props.add(key="stof.max_seq_len_source", value=ctx.options.get("_compiled_seq_source", ""))
    elif "_compiled_seq" in ctx.options:   # every layout is built for longer inputs: for information
        out.metadata_props.add(key="stof.compiled_seq_len", value=str(ctx.options["_compiled_seq"]))
        if "_model_seq_limit" in ctx.options:  # a given length below the model's own limit: that limit stays
            out.metadata_props.add(key="stof.max_seq_len", value=str(ctx.options["_model_seq_limit"]))
            out.metadata_props.add(key="stof.max_seq_len_source", value="model")
    for imp in list(out.opset_import):
        if imp.domain == DOMAIN:
            out.opset_import.remove(imp)
    out.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if any(n.domain == "com.microsoft" for n in out.graph.node) and \
            not any(imp.domain == "com.microsoft" for imp in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    for node in out.graph.node:
        if node.domain == DOMAIN:
            node.overload = ctx.overloads.get(node.name, "")
    del out.functions[:]
    out.functions.extend(list(original.functions) + build_functions(ctx.functions, opset, specs))
    check(out)
    return out, report


def _spec_overloads(ctx, graph: gs.Graph) -> dict[str, str]:
    """Give each StofSparseAttention node with a layout_spec the function overload that evaluates its spec at the
    run-time length (functions.spec_overload: one per base overload and spec), so the ONNX function fallback runs at
    every length too; returns {overload: spec} for build_functions."""
    from .functions import spec_overload

    nodes = [n for n in graph.nodes if n.op == "StofSparseAttention" and "layout_spec" in n.attrs]
    index = {s: i for i, s in enumerate(sorted({n.attrs["layout_spec"] for n in nodes}))}
    specs = {}
    for n in nodes:
        ov = spec_overload(ctx.overloads.get(n.name, ""), index[n.attrs["layout_spec"]])
        ctx.overloads[n.name] = ov
        specs[ov] = n.attrs["layout_spec"]
    used = {(n.op, ctx.overloads.get(n.name, "")) for n in graph.nodes if n.domain == DOMAIN}
    ctx.functions = {f for f in ctx.functions if f in used} | {("StofSparseAttention", ov) for ov in specs}
    return specs


def _layouts_grow(ctx, graph: gs.Graph, report: RewriteReport) -> bool:
    """Whether every StofSparseAttention node carries a layout_spec (its layout is built for any run-time length in
    the plugin) and the compiled length is no limit of the model's own: then the model runs at every length the
    original runs at, and the report's notes say so instead of naming a limit."""
    nodes = [n for n in graph.nodes if n.op == "StofSparseAttention"]
    source = ctx.options.get("_compiled_seq_source")
    if not nodes or source not in ("default", "given") or any("layout_spec" not in n.attrs for n in nodes):
        return False
    seq = ctx.options["_compiled_seq"]
    msg = (f"compiled for sequence length {seq}; longer inputs build their layouts at run time from the nodes' "
           "layout_spec (the CUDA plugin; the ONNX functions evaluate the spec at the run-time length)")
    own = ctx.options.get("_model_seq_limit")
    if own is not None:
        msg += f", up to the model's own limit of {own} positions (a position-embedding table or mask buffer)"
    at = ctx.options.get("_compiled_seq_note")
    if at is not None and at < len(report.notes):
        report.notes[at] = msg
    else:
        report.notes.append(msg)
    # a graph band with a side it does not reach at the compiled length that could not be checked longer
    unchecked = sorted(ctx.options.get("_unchecked_specs", ()))
    if unchecked:
        report.notes.append(f"layout_spec {', '.join(repr(s) for s in unchecked)} read from the graph's mask at "
                            f"length {seq} without a longer check: a sliding window wider than {seq} would read as "
                            "unbounded there; pass max_seq_len above such a window")
    return True


def _note_dense_on_stof(report: RewriteReport, packed_qkv: bool, epilogues: bool) -> None:
    """dense_attention="ort" converts only attention fed from the packed Q/K/V GEMM: say so when attention with no
    sparsity stays on the STOF kernels (with packed_qkv=False or epilogues=False, every such node does)."""
    from .fuse_dense_ort_attention import no_sparsity

    left = sum(no_sparsity(a) for a in report.attention) - report.count("dense_attention_to_ort")
    if left <= 0:
        return
    why = ("packed_qkv=False" if not packed_qkv else "epilogues=False" if not epilogues else
           "their Q/K/V are not packed into one GEMM")
    report.notes.append(f"dense_attention='ort': {left} attention node(s) with no sparsity stay on the STOF kernels "
                        f"({why}); only attention fed from the packed Q/K/V GEMM (packed_qkv=True, epilogues=True) "
                        "becomes ONNX Runtime's Attention")


def check_input(model: onnx.ModelProto) -> None:
    """Refuse, before any work, a model ONNX Runtime cannot load, as one line: an opset newer than this onnx knows,
    a node reading a tensor that no node, input or initializer makes, a cycle. (Not onnx.checker: models that ONNX
    Runtime runs, such as its transformers optimizer's, often fail its stricter rules.)"""
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > newest:
            raise StofError(f"the model imports opset {imp.version}; this onnx {onnx.__version__} knows opsets up to "
                            f"{newest}")
    g = model.graph
    made = {i.name for i in g.input} | {t.name for t in g.initializer} | {t.name for t in g.sparse_initializer}
    producer = {o: n for n in g.node for o in n.output if o}
    for n in g.node:
        for name in n.input:
            if name and name not in made and name not in producer:
                raise StofError(f"not a valid ONNX model: node '{n.name or n.op_type}' reads '{name}', which no node, "
                                "input or initializer makes")
    # Kahn's order over the nodes: a node left unordered lies on a cycle
    waiting = {id(n): sum(1 for x in n.input if x in producer) for n in g.node}
    readers: dict = {}
    for n in g.node:
        for x in n.input:
            if x in producer:
                readers.setdefault(x, []).append(n)
    ready = [n for n in g.node if waiting[id(n)] == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for o in n.output:
            for r in readers.get(o, ()):
                waiting[id(r)] -= 1
                if waiting[id(r)] == 0:
                    ready.append(r)
    if done < len(g.node):
        stuck = next(n for n in g.node if waiting[id(n)] > 0)
        raise StofError(f"not a valid ONNX model: its graph has a cycle (through node '{stuck.name or stuck.op_type}')")


def check(model: onnx.ModelProto) -> None:
    """onnx.checker with full_check (shape inference). A model over protobuf's 2 GB limit is checked by path:
    written with external data to a temporary directory (which moves its weights out of the proto), checked,
    and its weights loaded back, so the proto is unchanged afterwards."""
    import os
    import tempfile

    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    from .probe import LARGE_MODEL_BYTES

    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if external:
        # Weights still in the input's data files (their storage is checked when they are read and written):
        # check a copy in which they are typed graph inputs, so the checker does not look for the files.
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        names = {t.name for t in external}
        kept = [t for t in probe.graph.initializer if t.name not in names]
        del probe.graph.initializer[:]
        probe.graph.initializer.extend(kept)
        have = {i.name for i in probe.graph.input}
        probe.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in external if t.name not in have)
        model = probe
    if model.ByteSize() < LARGE_MODEL_BYTES:
        onnx.checker.check_model(model, full_check=True)
        return

    with tempfile.TemporaryDirectory(prefix="stof_check_") as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.weights", size_threshold=1024)
        try:
            onnx.checker.check_model(path, full_check=True)
        finally:
            load_external_data_for_model(model, tmp)
