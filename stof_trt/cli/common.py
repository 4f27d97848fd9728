"""Shared CLI helpers: model loading/saving with clear errors, tables, JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from .._files import file_mode, output_target, write_file_atomic
from ..errors import StofError

# protobuf cannot serialise a message over 2 GiB: bigger models are written with external data.
_PROTO_LIMIT = 2**31 - 1


def load_model(path: str, *, keep_external_data: bool = False):
    """Load an ONNX model or raise a one-line StofError.

    With ``keep_external_data`` the weights of a model stored with external data stay in their files, read
    relative to the model's directory when needed (``stof_trt.rewrite.rewrite_model(external_data_dir=...)``,
    ``save_model(external_data_dir=...)``): a single tensor over 2 GB cannot live in a proto that is copied or
    serialised."""
    import onnx

    if not os.path.exists(path):
        raise StofError(f"no such file: {path}")
    if not os.path.isfile(path):
        raise StofError(f"not a file: {path}")
    try:
        model = onnx.load(path, load_external_data=not keep_external_data)
        if keep_external_data:
            _check_external_files(model, os.path.dirname(os.path.abspath(path)))
    except Exception as e:  # protobuf DecodeError, missing external data, ...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StofError(f"{path} is not a readable ONNX model ({msg})") from None
    if not model.graph.node and not model.graph.input:
        raise StofError(f"{path} is not an ONNX model (no graph)")
    check_initializers(model, path)
    return model


_ITEMSIZE = {"FLOAT": 4, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "INT32": 4, "INT64": 8, "BOOL": 1,
             "FLOAT16": 2, "DOUBLE": 8, "UINT32": 4, "UINT64": 8, "COMPLEX64": 8, "COMPLEX128": 16, "BFLOAT16": 2,
             "FLOAT8E4M3FN": 1, "FLOAT8E4M3FNUZ": 1, "FLOAT8E5M2": 1, "FLOAT8E5M2FNUZ": 1}


def check_initializers(model, path: str) -> None:
    """Raise StofError when an initializer's stored bytes do not match its shape and type (a truncated or edited
    file): numpy would fail on it deep inside the rewrite."""
    import onnx

    for t in _all_tensors(model):
        if not t.HasField("raw_data") or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        try:
            itemsize = _ITEMSIZE.get(onnx.TensorProto.DataType.Name(t.data_type))
        except ValueError:
            raise StofError(f"{path}: tensor '{t.name}' has an unknown data type {t.data_type}") from None
        if itemsize is None:   # packed sub-byte or string types: onnx's own checks speak for them
            continue
        n = 1
        for d in t.dims:
            if d < 0:
                raise StofError(f"{path}: tensor '{t.name}' has a negative dimension {list(t.dims)}")
            n *= d
        want = n * itemsize
        if len(t.raw_data) != want:
            raise StofError(f"{path}: tensor '{t.name}' holds {len(t.raw_data)} bytes, its shape {list(t.dims)} "
                            f"and type need {want} (a damaged file?)")


def default_output(inp: str, suffix: str = ".stof.onnx") -> str:
    """IN.onnx -> IN.stof.onnx, beside the input."""
    base = inp[:-5] if inp.endswith(".onnx") else inp
    return base + suffix


def check_output_path(inp: str | None, out: str) -> None:
    """Refuse an output path that cannot be written, before any work: the input itself, a directory, a device or
    pipe, a missing or read-only directory, a name too long for the file system."""
    if not out:
        raise StofError("the output path is empty: give a file name")
    if inp is not None and (os.path.abspath(inp) == os.path.abspath(out) or
                            (os.path.exists(out) and os.path.exists(inp) and os.path.samefile(inp, out))):
        raise StofError(f"output path {out} is the input: refusing to overwrite the input model")
    out = str(output_target(out))  # (a symlink: its target)
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise StofError(f"output directory does not exist: {d}")
    name = os.path.basename(out)
    try:
        name_max = os.pathconf(d, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(name.encode()) > name_max:
        raise StofError(f"output file name is {len(name.encode())} bytes, longer than this file system allows "
                        f"({name_max})")
    try:   # the model is written through a temporary file in the same directory: try one
        fd, tmp = tempfile.mkstemp(prefix=".stof-", suffix=".probe", dir=d)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise StofError(f"cannot write to {d} ({e.strerror or type(e).__name__})") from None


class Once(argparse.Action):
    """An option given at most once: a second value would silently replace the first."""

    hint = ""  # what to do instead, for the error

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in seen:
            parser.error(f"{option_string} is given more than once{self.hint}")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class OnceMask(Once):
    hint = " (combine masks in one spec with '|' or '&')"


def int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside [{lo}, {hi}]")
        return v

    return parse


def make_output_dir(d: str, what: str = "output directory") -> None:
    """Create ``d`` (and parents) or raise a one-line StofError."""
    if os.path.exists(d) and not os.path.isdir(d):
        raise StofError(f"{what} {d} exists and is not a directory")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise StofError(f"cannot create {what} {d} ({e.strerror or type(e).__name__})") from None
    if not os.access(d, os.W_OK):
        raise StofError(f"{what} {d} is not writable")


@contextlib.contextmanager
def output_dir_kept_on_success(d: str | None, what: str = "output directory"):
    """make_output_dir(d) for a command that may still fail after it: the directories it created are removed again
    (those still empty) when the body raises, so a failed run leaves nothing behind.  d None or "": nothing to do."""
    if not d:
        yield
        return
    created = []  # what makedirs will create, deepest first: the path as given (makedirs follows its symlinks)
    p = d.rstrip(os.sep) or d
    while p and not os.path.lexists(p):
        created.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        make_output_dir(d, what)
        yield
    except BaseException:
        for c in created:
            try:
                os.rmdir(c)
            except OSError:
                break
        raise


def ort_error(e: BaseException, model=None, shapes: dict | None = None) -> StofError:
    """A one-line StofError for an exception ONNX Runtime raised while running ``model`` (path or ModelProto) on
    inputs of ``shapes`` (name -> shape, when known), saying what the user can change."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    low = text.lower()
    if "cudaexecutionprovider" in low or "cuda" in low and ("not available" in low or "libcu" in low):
        return StofError(f"the CUDA execution provider cannot run here ({first[:160]}); run on the CPU with "
                         "--provider cpu")
    if any(w in low for w in ("invalid expand shape", "broadcast", "not broadcastable", "shape mismatch",
                              "got invalid dimensions", "index out of", "out of range", "indices element")):
        limit, longest, differ, source = _seq_limit(model, shapes)
        if differ:
            hint = f"{differ}; the model names them alike"
        elif limit and (longest is None or longest > limit):
            what, todo = _LIMIT_SOURCES.get(source, _LIMIT_SOURCES[""])
            hint = (f"the model was built for sequence length <= {limit} ({what}): feed shorter inputs"
                    + (f" or {todo}" if todo else ""))
        elif any(w in low for w in ("index out of", "out of range", "indices element")):
            hint = "an index input is past its table (token ids within the vocabulary?)"
        else:
            hint = "check the input shapes (--shapes / --input)"
        return StofError(f"the model cannot run on these inputs: {hint} (onnxruntime: {_short(first)})")
    return StofError(f"onnxruntime run failed: {_short(first)}")


def _short(msg: str, n: int = 200) -> str:
    msg = msg.split("] ", 1)[-1] if msg.startswith("[ONNXRuntimeError]") else msg
    return msg if len(msg) <= n else msg[:n - 3] + "..."


def _seq_limit(model, shapes: dict | None = None) -> tuple[int | None, int | None, str | None, str]:
    """(the longest sequence ``model`` runs: its stof.max_seq_len, else the smallest length its STOF attention nodes
    were compiled for, None when its layouts grow or it has none; the longest of ``shapes`` on the model's symbolic
    axes after the batch, None when not known; _disagreement of ``shapes``; its stof.max_seq_len_source, "" when
    it has none)."""
    try:
        import onnx

        from ..nodes import attention_nodes

        m = model if hasattr(model, "graph") else onnx.load(str(model))
        longest = max((n for _, n in _sequence_lengths(m, shapes or {})), default=None)
        differ = _disagreement(m, shapes or {})
        meta = {p.key: p.value for p in m.metadata_props}
        source = meta.get("stof.max_seq_len_source", "")
        if "stof.max_seq_len" in meta:
            return int(meta["stof.max_seq_len"]), longest, differ, source
        if "stof.compiled_seq_len" in meta:
            return None, longest, differ, source   # its layouts grow: the compiled length is no limit
        seqs = [min(n.layout.seq_q, n.layout.seq_k) for n in attention_nodes(m)]
        return (min(seqs) if seqs else None), longest, differ, source
    except Exception:  # noqa: BLE001 - a hint only
        return None, None, None, ""


def _disagreement(m, shapes: dict) -> str | None:
    """Inputs of ``shapes`` that disagree on an axis the model names alike (input_ids and attention_mask on 'seq'),
    in words; None when none do. ONNX Runtime does not require it, so this is a hint for its errors only."""
    seen: dict[str, tuple[int, str]] = {}
    for vi in m.graph.input:
        shape = shapes.get(vi.name)
        if shape is None or not vi.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if axis >= len(shape) or not d.dim_param:
                continue
            size, first = seen.setdefault(d.dim_param, (shape[axis], vi.name))
            if size != shape[axis]:
                return (f"inputs '{first}' and '{vi.name}' disagree on axis '{d.dim_param}' ({size} against "
                        f"{shape[axis]})")
    return None


#: What sets a rewritten model's stof.max_seq_len (its metadata stof.max_seq_len_source, rewrite.py) and what the user
#: can do about it (None: nothing, the original model has the same limit); a model without the key gets the last.
_LIMIT_SOURCES = {
    "model": ("the original model's own limit", None),
    "mask": ("the size of its fixed mask", "rewrite with a larger mask"),
    "given": ("the compiled length", "rewrite with a larger --max-seq-len"),
    "default": ("the compiled length", "rewrite with a larger --max-seq-len"),
    "": ("its limit", "rewrite with a larger --max-seq-len where the original model runs longer"),
}


def _limit_words(source: str) -> str:
    what, todo = _LIMIT_SOURCES.get(source, _LIMIT_SOURCES[""])
    return f"{what}; {todo}" if todo else what


def check_seq_limit(model, shapes: dict) -> None:
    """Refuse, before any run, a sequence length over the rewritten model's ``stof.max_seq_len`` metadata (the
    longest sequence it runs: the length its layouts were compiled for, or the model's own limit): ``shapes`` maps
    input names to the shapes about to be fed; the sequence length is each input's size on an axis after the batch
    that the model leaves symbolic.  A model whose layouts grow and that has no limit of its own has no such
    metadata: it runs at every length."""
    meta = {p.key: p.value for p in model.metadata_props}
    try:
        limit = int(meta["stof.max_seq_len"])
    except (KeyError, ValueError):
        return
    if limit < 1:
        raise StofError(f"the model's stof.max_seq_len metadata is {limit}: not a sequence length (a damaged model)")
    for name, length in _sequence_lengths(model, shapes):
        if length > limit:
            raise StofError(f"input '{name}' has sequence length {length}: the model runs at most {limit} tokens "
                            f"(stof.max_seq_len: {_limit_words(meta.get('stof.max_seq_len_source', ''))})")


def _sequence_lengths(model, shapes: dict):
    """(input name, size) of each axis after the batch that the model leaves symbolic, for the inputs of ``shapes``
    (name -> the shape about to be fed): the sequence lengths of a run."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        shape = shapes.get(vi.name)
        if vi.name in inits or shape is None or not vi.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if 0 < axis < len(shape) and not d.HasField("dim_value"):
                yield vi.name, shape[axis]


def quiet_onnxruntime() -> None:
    """CLI sessions print errors as one line of their own: ONNX Runtime's log keeps to fatal messages."""
    try:
        import onnxruntime as ort

        ort.set_default_logger_severity(4)
    except Exception:  # noqa: BLE001 - onnxruntime missing: commands that need it say so
        pass


def save_model(model, out: str, external_data_dir: str | None = None) -> None:
    """Write atomically (temp file + rename); external data when the model is over protobuf's 2 GiB limit.
    Weights still in external files (``load_model(keep_external_data=True)``) are read from
    ``external_data_dir`` first."""
    import onnx

    out = str(output_target(out))
    d = os.path.dirname(os.path.abspath(out))
    if _has_external(model):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, external_data_dir or d)
        except Exception as e:  # noqa: BLE001 - a data file went missing meanwhile
            raise StofError(f"cannot read the model's external data: {str(e).splitlines()[0][:150]}") from None
    big = _model_bytes(model) > _PROTO_LIMIT

    def write(tmp: str) -> None:
        if not big:
            onnx.save_model(model, tmp)
            return
        data_name = os.path.basename(out) + ".data"
        data_tmp = os.path.join(d, data_name + ".tmp")
        try:
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name + ".tmp", size_threshold=1024)
            os.chmod(data_tmp, file_mode())
            os.replace(data_tmp, os.path.join(d, data_name))
        finally:
            if os.path.exists(data_tmp):
                os.unlink(data_tmp)
        # The model file names its data file: rewrite the name without the .tmp suffix.
        m = onnx.load(tmp, load_external_data=False)
        for t in _all_tensors(m):
            for e in t.external_data:
                if e.key == "location":
                    e.value = data_name
        onnx.save_model(m, tmp)

    write_file_atomic(out, write, suffix=".onnx")


def _check_external_files(model, base_dir: str) -> None:
    from onnx.external_data_helper import uses_external_data

    for t in _all_tensors(model):
        if uses_external_data(t):
            for e in t.external_data:
                if e.key == "location" and not os.path.isfile(os.path.join(base_dir, e.value)):
                    raise StofError(f"external data file missing: {os.path.join(base_dir, e.value)}")


def _has_external(model) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in _all_tensors(model))


def _model_bytes(model) -> int:
    total = 0
    for t in _all_tensors(model):
        total += len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + 8 * len(t.int64_data)
    return total


def _all_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def print_table(rows: list[list], header: list[str], file=sys.stdout) -> None:
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(header))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip(),
              file=file)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=file)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return s == "-"


def print_json(obj) -> None:
    if sys.stdout is None:  # (closed by the caller: `stof ... >&-`)
        return
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    print()


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
