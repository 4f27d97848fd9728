"""Shared CLI helpers: model loading/saving with clear errors, tables, JSON."""

from __future__ import annotations

import json
import os
import sys
import tempfile

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
    return model


def check_output_path(inp: str, out: str) -> None:
    if os.path.abspath(inp) == os.path.abspath(out) or (os.path.exists(out) and os.path.samefile(inp, out)):
        raise StofError(f"output path {out} is the input: refusing to overwrite the input model")
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise StofError(f"output directory does not exist: {d}")


def save_model(model, out: str, external_data_dir: str | None = None) -> None:
    """Write atomically (temp file + rename); external data when the model is over protobuf's 2 GiB limit.
    Weights still in external files (``load_model(keep_external_data=True)``) are read from
    ``external_data_dir`` first."""
    import onnx

    d = os.path.dirname(os.path.abspath(out))
    if _has_external(model):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, external_data_dir or d)
        except Exception as e:  # noqa: BLE001 - a data file went missing meanwhile
            raise StofError(f"cannot read the model's external data: {str(e).splitlines()[0][:150]}") from None
    big = _model_bytes(model) > _PROTO_LIMIT
    fd, tmp = tempfile.mkstemp(prefix=".stof-", suffix=".onnx", dir=d)
    os.close(fd)
    try:
        if big:
            data_name = os.path.basename(out) + ".data"
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name + ".tmp", size_threshold=1024)
            os.chmod(os.path.join(d, data_name + ".tmp"), _file_mode())
            os.replace(os.path.join(d, data_name + ".tmp"), os.path.join(d, data_name))
            # The model file names its data file: rewrite the name without the .tmp suffix.
            m = onnx.load(tmp, load_external_data=False)
            for t in _all_tensors(m):
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data_name
            onnx.save_model(m, tmp)
        else:
            onnx.save_model(model, tmp)
        os.chmod(tmp, _file_mode())   # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


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
