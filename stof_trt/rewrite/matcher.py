"""Small helpers to match subgraphs on an onnx-graphsurgeon graph.

Patterns are data: a parent path is two parallel lists, op types and input indices, walked upwards from an
anchor node (``None`` as an index means "any input"); ``match_parent_paths`` tries named variants in order::

    PATHS = {"scale_mul": (["Mul", "MatMul"], [0, None]),
             "no_scale":  (["MatMul"],        [0])}
    name, nodes = match_parent_paths(softmax, PATHS)

Constants are either ``gs.Constant`` tensors (initializers) or outputs of ``Constant`` nodes; ``const_value``
reads both.
"""
from __future__ import annotations

import contextvars
import logging

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnx.numpy_helper

from ..errors import StofError

logger = logging.getLogger("stof_trt.rewrite")

#: Element-wise ops whose outputs depend on their inputs point by point (used by the activation matcher).
ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Erf", "Tanh", "Neg", "Exp", "Sigmoid",
                             "Reciprocal"})


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node that produces ``tensor`` (None for graph inputs and initializers)."""
    return tensor.inputs[0] if len(tensor.inputs) else None


def consumers(tensor: gs.Tensor) -> list[gs.Node]:
    return list(tensor.outputs)


#: Directory that external-data locations of the model being rewritten are relative to (set by rewrite_model).
EXTERNAL_DATA_DIR: contextvars.ContextVar[str | None] = contextvars.ContextVar("stof_external_data_dir",
                                                                              default=None)


def _lazy_tensor(c: gs.Constant):
    """The TensorProto behind a constant whose values are not loaded yet, else None."""
    v = c._values
    return getattr(v, "tensor", None) if type(v).__name__ == "LazyValues" else None


def is_external(c: gs.Constant) -> bool:
    t = _lazy_tensor(c)
    return t is not None and t.data_location == onnx.TensorProto.EXTERNAL


def constant_array(c: gs.Constant) -> np.ndarray:
    """An initializer's values. Weights kept in external data files are read (relative to EXTERNAL_DATA_DIR)
    without loading them into the graph, so the exported model still refers to the files."""
    if is_external(c):
        try:
            return onnx.numpy_helper.to_array(_lazy_tensor(c), base_dir=EXTERNAL_DATA_DIR.get() or "")
        except Exception as exc:  # noqa: BLE001 - missing or short data file
            raise StofError(f"cannot read external data of initializer '{c.name}': {str(exc)[:150]}") from None
    return np.asarray(c.values)


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of ``tensor`` if it is an initializer or the output of a ``Constant`` node, else None."""
    if isinstance(tensor, gs.Constant):
        return constant_array(tensor)
    node = producer(tensor)
    if node is not None and node.op == "Identity":  # exporters alias deduplicated initializers via Identity
        return const_value(node.inputs[0])
    if node is not None and node.op == "Constant" and not node.inputs:
        attr = node.attrs.get("value")
        if isinstance(attr, gs.Constant):
            return np.asarray(attr.values)
        if isinstance(attr, onnx.TensorProto):
            return onnx.numpy_helper.to_array(attr)
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
            if key in node.attrs:
                return np.asarray(node.attrs[key], dtype=dtype)
        for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in node.attrs:
                return np.asarray(list(node.attrs[key]), dtype=dtype)
    return None


def scalar_value(tensor: gs.Tensor) -> float | None:
    """A constant holding a single number (any rank), as a Python float; else None."""
    v = const_value(tensor)
    if v is None or v.size != 1:
        return None
    return float(v.reshape(()))


def match_parent(node: gs.Node, op_type: str, input_index: int | None = None) -> gs.Node | None:
    """The producer of one of ``node``'s inputs if it has op type ``op_type`` (any input when index is None)."""
    indices = range(len(node.inputs)) if input_index is None else [input_index]
    for i in indices:
        if i >= len(node.inputs):
            continue
        parent = producer(node.inputs[i])
        if parent is not None and parent.op == op_type:
            return parent
    return None


def match_parent_path(node: gs.Node, op_types: list[str], input_indices: list[int | None]) -> list[gs.Node] | None:
    """Walk upwards from ``node``: parent k has op type ``op_types[k]`` and feeds input ``input_indices[k]`` of the
    node before it. Returns the matched parents (nearest first) or None."""
    assert len(op_types) == len(input_indices)
    path, current = [], node
    for op_type, index in zip(op_types, input_indices):
        parent = match_parent(current, op_type, index)
        if parent is None:
            return None
        path.append(parent)
        current = parent
    return path


def match_parent_paths(node: gs.Node, paths: dict[str, tuple[list[str], list[int | None]]]):
    """Try named path variants in order; returns ``(name, nodes)`` of the first that matches, or ``(None, None)``."""
    for name, (op_types, indices) in paths.items():
        nodes = match_parent_path(node, op_types, indices)
        if nodes is not None:
            return name, nodes
    return None, None


def single_consumer(tensor: gs.Tensor, graph_outputs: set[str]) -> gs.Node | None:
    """The only consumer of ``tensor`` when it has exactly one and is not a graph output."""
    if tensor.name in graph_outputs or len(tensor.outputs) != 1:
        return None
    return tensor.outputs[0]


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """For a two-input node, the input that is not ``tensor``."""
    ins = list(node.inputs)
    if len(ins) != 2:
        return None
    if ins[0] is tensor:
        return ins[1]
    if ins[1] is tensor:
        return ins[0]
    return None


def internal_only(nodes: list[gs.Node], keep: set[int], graph_outputs: set[str]) -> bool:
    """True when every output of ``nodes`` except those of nodes in ``keep`` (by id) is used only inside ``nodes``
    and is not a graph output: removing them then leaves nothing dangling."""
    ids = {id(n) for n in nodes}
    for n in nodes:
        if id(n) in keep:
            continue
        for t in n.outputs:
            if t.name in graph_outputs:
                return False
            if any(id(c) not in ids for c in t.outputs):
                return False
    return True
