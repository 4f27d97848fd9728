"""Evaluate intermediate tensors of the original model on ONNX Runtime CPU with chosen inputs.

The rewrite uses this to learn what a graph-built mask really is (by evaluating it for chosen padding masks and
sequence lengths), the run-time shapes of Q/K/V and scale factors computed from shapes. Only the subgraph the
requested tensors need is run (basic graph optimizations only: constant folding and redundancy elimination,
which keep values exact). Output types are left to ORT, so untyped intermediates (after contrib ops) work.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx import helper

from ..errors import StofError

from .matcher import constant_array, is_external

#: Protos at or above this size cannot be serialized in one piece (protobuf's 2 GB limit): they go through a
#: temporary directory with external data instead.
LARGE_MODEL_BYTES = 2**31 - 2**24

_INT_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
              onnx.TensorProto.INT16}


class InputSpec:
    """A graph input: name, element type and dims (ints, or None for a symbolic dim)."""

    def __init__(self, vi: onnx.ValueInfoProto):
        self.name = vi.name
        self.elem_type = vi.type.tensor_type.elem_type
        self.dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]

    def shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """Dim 0 symbolic -> batch; any other symbolic dim -> seq."""
        return tuple(d if d is not None else (batch if i == 0 else seq) for i, d in enumerate(self.dims))

    @property
    def dynamic_seq(self) -> bool:
        return any(d is None for d in self.dims[1:])

    @property
    def np_dtype(self):
        return helper.tensor_dtype_to_np_dtype(self.elem_type)


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {i.name for i in model.graph.initializer}
    return [InputSpec(vi) for vi in model.graph.input if vi.name not in inits]


def value_inputs(graph: gs.Graph, tensor: gs.Tensor) -> set[str]:
    """Names of graph inputs whose *values* ``tensor`` depends on (paths through Shape/Size count as shape-only)."""
    inputs = {t.name for t in graph.inputs}
    seen, stack, found = set(), [tensor], set()
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.name in inputs:
            found.add(t.name)
        for node in t.inputs:
            if node.op in ("Shape", "Size"):
                continue
            stack.extend(node.inputs)
            for sub in node.subgraphs():  # If/Loop bodies may read outer values
                stack.extend(sub.inputs)
    return found


class Probe:
    """Runs a pruned copy of the model that outputs chosen tensors (and the shapes of others)."""

    def __init__(self, model: onnx.ModelProto, values: list[str], shapes: list[str]):
        import onnxruntime as ort

        graph = gs.import_onnx(model)
        tensors = graph.tensors()
        outs = []
        self.constants = {}
        self.fed_constants: dict[str, np.ndarray] = {}
        for name in dict.fromkeys(values):
            if isinstance(tensors[name], gs.Constant):  # an initializer: no need to run anything
                self.constants[name] = constant_array(tensors[name])
            else:
                outs.append(tensors[name])
        values = [n for n in values if n not in self.constants]
        self.shape_names = {}
        for name in dict.fromkeys(shapes):
            shp = gs.Variable(f"__stof_probe_shape_{len(self.shape_names)}", dtype=np.int64)
            graph.nodes.append(gs.Node("Shape", inputs=[tensors[name]], outputs=[shp]))
            self.shape_names[name] = shp.name
            outs.append(shp)
        self.value_names = [n for n in dict.fromkeys(values)]
        self.session = None
        self.specs = {s.name: s for s in graph_inputs(model)}
        if not outs:  # only initializers were asked for
            self.input_names = set()
            return
        graph.outputs = list(outs)
        for t in graph.outputs:
            t.shape = None
        graph.cleanup(remove_unused_graph_inputs=False)
        self._feed_large_constants(graph)
        pruned = gs.export_onnx(graph, do_type_check=False)
        pruned.ir_version = model.ir_version
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 4  # failures are expected while searching a model's length limit: no ORT log lines
        if pruned.ByteSize() < LARGE_MODEL_BYTES:
            self.session = ort.InferenceSession(pruned.SerializeToString(), so, providers=["CPUExecutionProvider"])
        else:  # > 2 GB: ORT reads the weights from external data files, kept until the probe goes away
            self._tmp = tempfile.TemporaryDirectory(prefix="stof_probe_")
            path = os.path.join(self._tmp.name, "probe.onnx")
            onnx.save_model(pruned, path, save_as_external_data=True, all_tensors_to_one_file=True,
                            location="probe.weights", size_threshold=1024)
            self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.specs = {s.name: s for s in graph_inputs(model)}

    def _feed_large_constants(self, graph: gs.Graph) -> None:
        """Turn large or external initializers into graph inputs fed from numpy at run time: the pruned proto stays
        small (a single tensor over 2 GB cannot be serialized at all) and weights in external data files are read
        wherever the probe runs (matcher.EXTERNAL_DATA_DIR)."""
        for t in list(graph.tensors().values()):
            if not isinstance(t, gs.Constant) or not _large_or_external(t):
                continue
            values = constant_array(t)
            var = gs.Variable(t.name, dtype=values.dtype, shape=list(values.shape))
            for node in list(t.outputs):
                for i, x in enumerate(node.inputs):
                    if x is t:
                        node.inputs[i] = var
            graph.inputs.append(var)
            self.fed_constants[t.name] = values

    def feeds(self, batch: int, seq: int, overrides: dict[str, np.ndarray] | None = None, seed: int = 0):
        rng = np.random.default_rng(seed)
        out = {}
        for name in self.input_names:
            if name in self.fed_constants:
                out[name] = self.fed_constants[name]
                continue
            spec = self.specs[name]
            if overrides and name in overrides:
                out[name] = overrides[name].astype(spec.np_dtype)
            elif spec.elem_type in _INT_TYPES or spec.elem_type == onnx.TensorProto.BOOL:
                out[name] = np.ones(spec.shape(batch, seq), spec.np_dtype)
            else:
                out[name] = rng.standard_normal(spec.shape(batch, seq)).astype(spec.np_dtype)
        return out

    def run(self, batch: int, seq: int, overrides=None) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """Returns ({tensor: value}, {tensor: shape})."""
        import onnxruntime as ort

        if self.session is None:
            return dict(self.constants), {}
        try:
            ro = ort.RunOptions()
            ro.log_severity_level = 4
            res = self.session.run(None, self.feeds(batch, seq, overrides), ro)
        except Exception as exc:  # noqa: BLE001 - any ORT failure means the model cannot run at this size
            msg = str(exc).strip().splitlines()[0][:200]
            raise StofError(f"cannot evaluate the model at batch {batch}, sequence length {seq}: {msg}") from None
        names = self.value_names + list(self.shape_names)
        vals = dict(zip(names, res))
        values = {n: vals[n] for n in self.value_names}
        values.update(self.constants)
        shapes = {n: tuple(int(x) for x in vals[n]) for n in self.shape_names}
        return values, shapes




#: Initializers at least this large are fed to the probe as inputs instead of being copied into its proto.
_FEED_BYTES = 1 << 26


def _large_or_external(c: gs.Constant) -> bool:
    return is_external(c) or int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize >= _FEED_BYTES
