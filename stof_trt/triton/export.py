"""A Triton Inference Server model repository for an ONNX model served by Triton's onnxruntime backend.

Layout written for model name N under the repository DIR (Triton's documented layout: one directory per
model, its ``config.pbtxt``, numeric version directories holding the model file)::

    DIR/N/config.pbtxt
    DIR/N/1/model.onnx             (+ its external data files, same relative locations)
    DIR/N/1/libstof_ort.so         (+ the libstof_* libraries it links, found through its RPATH $ORIGIN)
    DIR/N/1/stof_tactics.json      (when a tactic cache is given)

The onnxruntime backend registers ``model_operations { op_library_filename }`` by absolute path, so the config
names the library where the *server* sees the repository (``server_repo``, e.g. ``/models`` in a container).
It passes no custom session-config entries to ONNX Runtime: the plugin reads the tactic cache from the
``STOF_TACTIC_CACHE`` environment variable of the server process (``export_repository`` returns it).

A ``cpu=True`` repository has ``KIND_CPU`` instances and no custom-op library: ONNX Runtime then runs every STOF
node as its model-local ONNX function (registering the library on a CPU-only session would hide the functions).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StofError

__all__ = ["TensorSpec", "model_io", "stof_node_count", "parse_gpus", "config_text", "export_repository",
           "TRITON_DTYPES", "LIBRARY_NAME", "TACTIC_CACHE_NAME", "MODEL_FILENAME"]

LIBRARY_NAME = "libstof_ort.so"
TACTIC_CACHE_NAME = "stof_tactics.json"
MODEL_FILENAME = "model.onnx"
DEFAULT_MAX_BATCH = 8
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# ONNX TensorProto element type -> Triton model-config data type (model_config.proto DataType).
TRITON_DTYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16",
                 6: "TYPE_INT32", 7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16",
                 11: "TYPE_FP64", 12: "TYPE_UINT32", 13: "TYPE_UINT64", 16: "TYPE_BF16"}


def _stof_ort_library() -> Path | None:
    """libstof_ort.so as the rest of the package finds it (one place to change if that helper moves)."""
    from ..ort import library_path

    return library_path()


def _check_tactic_cache(path: str) -> None:
    from ..tactic_cache import TacticCache

    TacticCache.load(path)  # raises a one-line StofError on a missing or malformed cache


@dataclass
class TensorSpec:
    """A graph input or output: name, ONNX element type, full shape (-1 where dynamic)."""

    name: str
    elem_type: int
    dims: list[int] = field(default_factory=list)

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.elem_type]


def _specs(values, what: str, inferred: dict) -> list[TensorSpec]:
    out = []
    for v in values:
        t = v.type
        if not t.HasField("tensor_type"):
            raise StofError(f"{what} '{v.name}' is not a tensor (Triton's onnxruntime backend serves tensors)")
        tt = t.tensor_type
        if tt.elem_type not in TRITON_DTYPES:
            raise StofError(f"{what} '{v.name}' has ONNX element type {tt.elem_type}, which Triton has no type for")
        shape = tt.shape if tt.HasField("shape") else None
        if shape is None and v.name in inferred:
            shape = inferred[v.name]
        if shape is None:
            raise StofError(f"{what} '{v.name}' has no shape (not even a rank): Triton needs its dims")
        dims = [int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in shape.dim]
        out.append(TensorSpec(v.name, int(tt.elem_type), dims))
    return out


def model_io(model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs (initializers excluded) and outputs of an ONNX model; output ranks from shape inference when the
    graph does not state them."""
    inits = {i.name for i in model.graph.initializer}
    inferred = {}
    if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output):
        import onnx

        try:
            m = onnx.shape_inference.infer_shapes(model)
            inferred = {o.name: o.type.tensor_type.shape for o in m.graph.output
                        if o.type.tensor_type.HasField("shape")}
        except Exception:  # noqa: BLE001 - inference is best effort; a rank still missing is reported below
            pass
    inputs = _specs([i for i in model.graph.input if i.name not in inits], "input", {})
    outputs = _specs(model.graph.output, "output", inferred)
    return inputs, outputs


def refuse_token_slots(model, path: str) -> None:
    """A model packed into token slots needs its capacity input sized from each batch's padding mask
    (stof_trt.ort.with_token_capacity), which neither Triton's ONNX Runtime backend nor a client does."""
    from ..nodes import TOKEN_CAPACITY_INPUT

    if any(i.name == TOKEN_CAPACITY_INPUT for i in model.graph.input):
        raise StofError(f"{path} takes the token capacity input {TOKEN_CAPACITY_INPUT} (rewritten with "
                        "--token-capacity-input), which the server cannot size per batch: serve the default rewrite")


def stof_node_count(model) -> int:
    return sum(1 for n in model.graph.node if n.domain == "stof")


def parse_gpus(text: str | None) -> list[int] | None:
    """'0,1' -> [0, 1]; None/'' -> None (every GPU). One-line StofError on anything else."""
    if text is None or text == "":
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isascii() and p.isdigit() and int(p) < 2**31 for p in parts):
        raise StofError(f"bad --gpus '{text}' (expected GPU ids like 0,1)")
    ids = [int(p) for p in parts]
    if len(set(ids)) != len(ids):
        raise StofError(f"bad --gpus '{text}' (a GPU id is repeated)")
    return ids


def batchable(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> bool:
    """Triton's batching needs a dynamic first dimension on every input and output."""
    return all(len(t.dims) >= 1 and t.dims[0] == -1 for t in inputs + outputs)


def _q(s: str) -> str:
    """A protobuf text-format string literal: quotes and backslashes escaped, control characters (a newline ends a
    string there) as octal escapes."""
    out = []
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _tensor_block(specs: list[TensorSpec], batched: bool) -> list[str]:
    lines = []
    for i, t in enumerate(specs):
        dims = t.dims[1:] if batched else t.dims
        lines += ["  {", f"    name: {_q(t.name)}", f"    data_type: {t.triton_dtype}"]
        if dims:
            lines.append(f"    dims: [ {', '.join(str(d) for d in dims)} ]")
        else:  # a per-request scalar: Triton needs non-empty dims, the reshape gives the model its scalar
            lines += ["    dims: [ 1 ]", "    reshape: { shape: [ ] }"]
        lines.append("  }" + ("," if i + 1 < len(specs) else ""))
    return lines


def config_text(name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], *, max_batch: int,
                instances: int = 1, gpus: list[int] | None = None, cpu: bool = False,
                dynamic_batching: bool = False, max_queue_delay_us: int | None = None,
                op_library: str | None = None, cuda_options: dict | None = None,
                comments: list[str] = ()) -> str:
    """config.pbtxt (protobuf text format of Triton's ModelConfig) for the onnxruntime backend."""
    lines = [f"# {c}" for c in comments]
    lines += [f"name: {_q(name)}", 'platform: "onnxruntime_onnx"', 'backend: "onnxruntime"',
              f"max_batch_size: {max_batch}", f"default_model_filename: {_q(MODEL_FILENAME)}"]
    lines += ["input ["] + _tensor_block(inputs, max_batch > 0) + ["]"]
    lines += ["output ["] + _tensor_block(outputs, max_batch > 0) + ["]"]
    group = ["instance_group [", "  {", f"    count: {instances}", f"    kind: {'KIND_CPU' if cpu else 'KIND_GPU'}"]
    if gpus:
        group.append(f"    gpus: [ {', '.join(str(g) for g in gpus)} ]")
    lines += group + ["  }", "]"]
    if dynamic_batching:
        lines.append("dynamic_batching {")
        if max_queue_delay_us is not None:
            lines.append(f"  max_queue_delay_microseconds: {max_queue_delay_us}")
        lines.append("}")
    if not cpu:
        # The CUDA execution provider, explicitly: the STOF kernels are CUDA-EP kernels.
        lines += ["optimization {", "  execution_accelerators {", "    gpu_execution_accelerator: [", "      {",
                  '        name: "cuda"']
        for k, v in sorted((cuda_options or {}).items()):
            lines.append(f"        parameters {{ key: {_q(k)} value: {_q(str(v))} }}")
        lines += ["      }", "    ]", "  }", "}"]
    if op_library:
        lines += ["model_operations {", f"  op_library_filename: {_q(op_library)}", "}"]
    return "\n".join(lines) + "\n"


def _elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object (the libraries it links by name)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise StofError(f"{path} is not a 64-bit little-endian ELF shared library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for sec in sections:
        if sec[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sec[6]]  # sh_link: the section holding the names
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def _library_files(lib: Path) -> list[Path]:
    """libstof_ort.so and the libstof_* libraries it needs (transitively), which load through RPATH $ORIGIN and
    so must sit next to it. Other dependencies (CUDA, cuBLASLt, the C++ runtime) come from the server's
    environment."""
    search = [lib.parent, lib.parent.parent] + sorted(p for p in lib.parent.parent.iterdir() if p.is_dir())
    files, todo = [lib], [lib]
    while todo:
        for dep in _elf_needed(todo.pop()):
            if not dep.startswith("libstof_") or any(f.name == dep for f in files):
                continue
            found = next((d / dep for d in search if (d / dep).is_file()), None)
            if found is None:
                raise StofError(f"{lib} links {dep}, which is not next to it (nor in {lib.parent.parent}); "
                                "rebuild or point STOF_ORT_LIB at an installed copy")
            files.append(found)
            todo.append(found)
    return files


def _external_files(model, model_dir: Path) -> list[str]:
    """Relative locations of the model's external data files; one-line errors for missing or escaping ones."""
    locs = []
    import onnx.external_data_helper as edh

    for t in edh._get_all_tensors(model):
        if t.data_location != 1:  # TensorProto.EXTERNAL
            continue
        loc = next((e.value for e in t.external_data if e.key == "location"), None)
        if not loc or os.path.isabs(loc) or ".." in Path(loc).parts:
            raise StofError(f"tensor '{t.name}' has external data at '{loc}': only paths inside the model's "
                            "directory can be shipped")
        if not (model_dir / loc).is_file():
            raise StofError(f"external data file missing: {model_dir / loc}")
        if loc not in locs:
            locs.append(loc)
    return locs


def default_name(model_path: str) -> str:
    base = os.path.basename(model_path)
    for suffix in (".onnx", ".stof"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", base).strip("._-") or "model"
    return name if name[0].isalnum() else "m" + name


def export_repository(model_path: str, repo: str, *, name: str | None = None, max_batch: int | None = None,
                      instances: int = 1, gpus: str | list[int] | None = None, dynamic_batching: bool = False,
                      max_queue_delay_us: int | None = None, tactic_cache: str | None = None, cpu: bool = False,
                      force: bool = False, server_repo: str | None = None, library: str | None = None,
                      cuda_options: dict | None = None) -> dict:
    """Write ``repo/name`` (see the module docstring); returns a summary dict. Nothing is written on error.

    Args:
        max_batch: Triton's ``max_batch_size``; None: 8 when every input/output has a dynamic first dimension,
            else 0 (no batching).
        gpus: GPU ids for the instance group ('0,1' or [0, 1]); ``instances`` instances on each. None: all GPUs.
        server_repo: the repository's absolute path as the server sees it (config paths use it); default
            ``repo``'s absolute path.
        library: libstof_ort.so to ship; default the one the package finds (``$STOF_ORT_LIB``, stof_trt/lib,
            build trees).
    """
    import onnx

    gpu_ids = parse_gpus(",".join(str(g) for g in gpus) if isinstance(gpus, list) else gpus)
    if cpu and gpu_ids:
        raise StofError("--gpus and --cpu exclude each other")
    if not 1 <= instances < 2**31:  # (Triton's config fields are int32)
        raise StofError(f"--instances must be in [1, 2^31 - 1], got {instances}")
    if max_batch is not None and not 0 <= max_batch < 2**31:
        raise StofError(f"--max-batch must be in [0, 2^31 - 1], got {max_batch}")
    if max_queue_delay_us is not None and not dynamic_batching:
        raise StofError("--max-queue-delay-us needs --dynamic-batching")
    if max_queue_delay_us is not None and not 0 <= max_queue_delay_us < 2**63:
        raise StofError(f"--max-queue-delay-us must be in [0, 2^63 - 1], got {max_queue_delay_us}")
    if server_repo is not None and not os.path.isabs(server_repo):
        raise StofError(f"--server-repo must be an absolute path, got '{server_repo}'")
    if server_repo is not None and cpu:
        raise StofError("--server-repo places the custom-op library and the tactic cache; a --cpu repository has "
                        "neither")
    if not str(repo):
        raise StofError("--repo must name a directory")
    name = name if name is not None else default_name(model_path)
    if not _NAME_RE.match(name):
        raise StofError(f"bad model name {name!r} (letters, digits, '_', '.', '-'; starting with a letter or digit)")

    if not os.path.exists(model_path):
        raise StofError(f"no such file: {model_path}")
    if not os.path.isfile(model_path):
        raise StofError(f"not a file: {model_path}")
    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError and friends
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StofError(f"{model_path} is not a readable ONNX model ({msg})") from None
    if not model.graph.node and not model.graph.input:
        raise StofError(f"{model_path} is not an ONNX model (no graph)")
    from ..rewrite.rewrite import check_input

    check_input(model)  # a model ONNX Runtime cannot load must not become a repository
    model_dir = Path(model_path).resolve().parent
    external = _external_files(model, model_dir)
    n_stof = stof_node_count(model)
    refuse_token_slots(model, model_path)
    inputs, outputs = model_io(model)
    if not outputs:
        raise StofError(f"{model_path} has no outputs")

    can_batch = batchable(inputs, outputs)
    if max_batch is None:
        max_batch = DEFAULT_MAX_BATCH if can_batch else 0
    if max_batch > 0 and not can_batch:
        fixed = [t.name for t in inputs + outputs if not t.dims or t.dims[0] != -1]
        raise StofError(f"--max-batch {max_batch} needs a dynamic first dimension on every input and output; "
                        f"fixed: {', '.join(fixed)} (use --max-batch 0)")
    if dynamic_batching and max_batch == 0:
        raise StofError("--dynamic-batching needs --max-batch > 0")

    notes = []
    lib_files: list[Path] = []
    if n_stof == 0:
        notes.append(f"{model_path} has no STOF nodes: it is served as a plain ONNX model")
        if tactic_cache:
            raise StofError("--tactic-cache given, but the model has no STOF nodes to use it")
    elif cpu:
        notes.append("CPU repository: the STOF nodes run as their model-local ONNX functions (dense speed)")
        if tactic_cache:
            raise StofError("--tactic-cache applies to the GPU kernels; a --cpu repository does not use it")
    else:
        if tactic_cache:
            _check_tactic_cache(tactic_cache)
        lib = Path(library) if library else _stof_ort_library()
        if lib is None or not lib.is_file():
            raise StofError(f"{LIBRARY_NAME} not found: a GPU repository ships it (build it: `cmake -S . -B build "
                            "&& cmake --build build -j`, or set STOF_ORT_LIB); or export with --cpu")
        lib_files = _library_files(lib.resolve())

    repo_path = Path(repo)
    if repo_path.exists() and not repo_path.is_dir():
        raise StofError(f"--repo {repo} exists and is not a directory")
    if not repo_path.exists() and not repo_path.resolve().parent.is_dir():
        raise StofError(f"parent directory of --repo does not exist: {repo_path.resolve().parent}")
    target = repo_path / name
    if target.exists() and not target.is_dir():
        raise StofError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise StofError(f"{target} exists and is not empty (use --force to replace it)")
    if target.resolve() in (model_dir, *model_dir.parents):
        raise StofError(f"{target} contains the input model: refusing to replace it")

    served_root = server_repo or str(repo_path.resolve())
    served_version = f"{served_root.rstrip('/')}/{name}/1"
    op_library = f"{served_version}/{LIBRARY_NAME}" if lib_files else None
    cache_served = f"{served_version}/{TACTIC_CACHE_NAME}" if tactic_cache else None
    comments = [f"Written by `stof export-triton` from {os.path.basename(model_path)} ({n_stof} STOF nodes)."]
    if cache_served:
        comments.append(f"Tuned tactics: start tritonserver with STOF_TACTIC_CACHE={cache_served}")
    text = config_text(name, inputs, outputs, max_batch=max_batch, instances=instances, gpus=gpu_ids, cpu=cpu,
                       dynamic_batching=dynamic_batching, max_queue_delay_us=max_queue_delay_us,
                       op_library=op_library, cuda_options=cuda_options, comments=comments)

    created_repo = not repo_path.exists()
    repo_path.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.stof-tmp-", dir=repo_path))
    try:
        version = tmp / "1"
        version.mkdir()
        shutil.copyfile(model_path, version / MODEL_FILENAME)
        for loc in external:
            (version / loc).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_dir / loc, version / loc)
        for f in lib_files:
            shutil.copy2(f, version / f.name)
        if tactic_cache:
            shutil.copyfile(tactic_cache, version / TACTIC_CACHE_NAME)
        (tmp / "config.pbtxt").write_text(text)
        for p in [tmp, *tmp.rglob("*")]:  # mkdtemp's 0700 would hide the repository from a container's user
            p.chmod(0o755 if p.is_dir() else 0o644)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{name}.stof-old-", dir=repo_path))
            target.rename(old / name)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created_repo:
            shutil.rmtree(repo_path, ignore_errors=True)
        raise

    env = {"STOF_TACTIC_CACHE": cache_served} if cache_served else {}
    return {"repository": str(repo_path.resolve()), "name": name, "model_dir": str(target.resolve()),
            "config": str((target / "config.pbtxt").resolve()), "stof_nodes": n_stof,
            "kind": "KIND_CPU" if cpu else "KIND_GPU", "max_batch_size": max_batch,
            "dynamic_batching": dynamic_batching, "instances": instances, "gpus": gpu_ids,
            "op_library": op_library, "libraries": [f.name for f in lib_files], "external_data": external,
            "tactic_cache": cache_served, "server_env": env,
            "inputs": [{"name": t.name, "dtype": t.triton_dtype, "dims": t.dims} for t in inputs],
            "outputs": [{"name": t.name, "dtype": t.triton_dtype, "dims": t.dims} for t in outputs],
            "notes": notes}
