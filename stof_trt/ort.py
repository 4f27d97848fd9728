"""ONNX Runtime sessions with the STOF custom-op library (libstof_ort.so) on the CUDA execution provider.

Typical use::

    from stof_trt import ort as sort
    sess = sort.session("bert.stof.onnx", tactic_cache="h100.json")       # CUDA EP + STOF kernels
    out = sess.run(None, feeds)                                           # plain numpy in, numpy out
    b = sort.Binding(sess, feeds)                                         # inputs/outputs on the GPU
    b.run(); y = b.outputs()[0]                                           # IO binding, no host copies
    ms = sort.time_session(sess, feeds, iters=100)                        # latencies (ms) for benchmarks

The library is found at ``$STOF_ORT_LIB``, inside the installed package (``stof_trt/lib``), or in a CMake build
tree under the repository root (``build*/plugins_cu/ort/libstof_ort.so``).  Without it (or on the CPU EP) STOF
nodes run as their model-local ONNX functions: same results, dense speed.

Session options the plugin reads (set here from the keyword arguments): ``stof.tactic_cache`` (or
``$STOF_TACTIC_CACHE``), a cache written by ``stof tune`` and by first-use timing; ``stof.first_use_timing`` (or
``$STOF_FIRST_USE_TIMING``; "0" turns first-use timing off, docs/ort.md); ``stof.verbose`` (or
``$STOF_ORT_VERBOSE``).
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import statistics
import time
from pathlib import Path

from ._host import available_memory
from .errors import StofError

__all__ = ["library_path", "library_available", "session", "Binding", "time_session", "latency_stats",
           "token_capacity", "with_token_capacity", "CONFIG_TACTIC_CACHE", "CONFIG_VERBOSE",
           "CONFIG_FIRST_USE_TIMING"]

CONFIG_TACTIC_CACHE = "stof.tactic_cache"
CONFIG_FIRST_USE_TIMING = "stof.first_use_timing"
CONFIG_VERBOSE = "stof.verbose"
META_TOKEN_CAPACITY = "stof.token_capacity_input"
_LIB_NAME = "libstof_ort.so"


def library_path() -> Path | None:
    """Where libstof_ort.so is: $STOF_ORT_LIB, the package's lib/ folder, the site-packages copy of an editable
    install, or a CMake build tree of the repository (stof_trt._libs.find_library)."""
    from ._libs import find_library

    return find_library(_LIB_NAME, "STOF_ORT_LIB", "plugins_cu/ort")


def library_available() -> bool:
    return library_path() is not None


def _preload_cuda_libs() -> None:
    """Make libcublasLt (a dependency of libstof_ort) loadable: ORT's own preload, then the nvidia wheels."""
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001 - best effort; the explicit load below reports real failures
            pass
    try:
        ctypes.CDLL("libcublasLt.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []):
        for sub in ("cu13/lib", "cublas/lib"):
            for so in sorted(glob.glob(os.path.join(base, sub, "libcublasLt.so*"))):
                try:
                    ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


def _providers(providers, device_id: int, cuda_options: dict | None, cuda_graphs: bool):
    if providers is None or providers == "cuda":
        opts = {"device_id": str(device_id)}
        opts.update({k: str(v) for k, v in (cuda_options or {}).items()})
        if cuda_graphs:
            opts["enable_cuda_graph"] = "1"
        return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]
    if providers == "cpu":
        return ["CPUExecutionProvider"]
    if isinstance(providers, str):  # a list of one name is meant, or a typo: list("tpu") would be three names
        raise StofError(f"providers={providers!r}: expected 'cuda', 'cpu' or a list of ONNX Runtime providers")
    return list(providers)


def session(model, *, providers=None, device_id: int = 0, cuda_options: dict | None = None,
            tactic_cache: str | os.PathLike | None = None, cuda_graphs: bool = False, verbose: bool = False,
            register: bool | None = None, session_options=None, optimization_level: str | None = None,
            library: str | os.PathLike | None = None, presearch_shapes=None, first_use_timing: bool | None = None):
    """An ``onnxruntime.InferenceSession`` for ``model`` (path or ModelProto) with the STOF library registered.

    Args:
        providers: None or "cuda" (CUDA EP then CPU), "cpu", or an explicit ORT providers list.
        cuda_options: extra CUDA EP provider options (strings), e.g. {"arena_extend_strategy": "kSameAsRequested"}.
        tactic_cache: a ``stof tune`` cache (session option ``stof.tactic_cache``); None keeps $STOF_TACTIC_CACHE.
            With first-use timing a missing file is created (its directory must exist).
        first_use_timing: the plugin times the pre-search's shortlist on the first call of each attention problem
            without a cache entry (session option ``stof.first_use_timing``); None keeps $STOF_FIRST_USE_TIMING
            (default on).
        cuda_graphs: capture the whole run in a CUDA graph (ORT's ``enable_cuda_graph``); needs IO binding with
            fixed input/output buffers -- use :class:`Binding`.
        register: register libstof_ort (default: whenever the CUDA EP is requested).  True without a library
            found raises StofError.
        optimization_level: "disable" | "basic" | "extended" | "all" (ORT default: all).
        presearch_shapes: [(batch, seq), ...]: for these problem sizes, attention nodes the tactic cache has no
            entry for get the pre-search's first choice (a temporary cache merged over `tactic_cache`) instead of
            the kernel library's default.
    """
    import onnxruntime as ort

    so = session_options or ort.SessionOptions()
    if optimization_level is not None:
        levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        if optimization_level not in levels:
            raise StofError(f"optimization_level must be one of {sorted(levels)}")
        so.graph_optimization_level = levels[optimization_level]
    meta = _model_meta(model) if cuda_graphs else {}
    if meta.get("stof.padding_removed") == "1" and not meta.get(META_TOKEN_CAPACITY):
        raise StofError("CUDA graphs cannot replay a model whose padding is removed: its token count changes with "
                        "every batch's padding (rewrite with --token-capacity-input to capture graphs)")
    provs = _providers(providers, device_id, cuda_options, cuda_graphs)
    wants_cuda = any((p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider" for p in provs)
    if wants_cuda and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise StofError("the CUDA execution provider is not available in this onnxruntime "
                        f"({ort.__version__}, providers {ort.get_available_providers()}); install onnxruntime-gpu")
    if register is None:
        register = wants_cuda
    timing = first_use_timing if first_use_timing is not None else os.environ.get("STOF_FIRST_USE_TIMING") != "0"
    if tactic_cache is not None and not Path(tactic_cache).is_file():
        if not timing or presearch_shapes:
            raise StofError(f"tactic cache not found: {tactic_cache}")
        if not Path(tactic_cache).resolve().parent.is_dir():
            raise StofError(f"tactic cache directory does not exist: {Path(tactic_cache).resolve().parent}")
    if first_use_timing is not None:
        so.add_session_config_entry(CONFIG_FIRST_USE_TIMING, "1" if first_use_timing else "0")
    if presearch_shapes:
        tactic_cache = _with_presearch(model, tactic_cache, presearch_shapes, device_id)
    if tactic_cache is not None:
        so.add_session_config_entry(CONFIG_TACTIC_CACHE, str(tactic_cache))
    if verbose:
        so.add_session_config_entry(CONFIG_VERBOSE, "1")
    if wants_cuda:
        _preload_cuda_libs()
    if register:
        lib = Path(library) if library else library_path()
        if lib is None or not lib.is_file():
            raise StofError("libstof_ort.so not found: build it (`cmake -S . -B build && cmake --build build -j`, "
                            "or `pip install .` with nvcc present) or set STOF_ORT_LIB")
        try:
            so.register_custom_ops_library(str(lib))
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise StofError(f"registering {lib} failed: {str(e).splitlines()[0]}") from None
    src = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    try:
        sess = ort.InferenceSession(src, sess_options=so, providers=provs)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StofError(f"onnxruntime could not load the model: {msg}") from None
    if wants_cuda and "CUDAExecutionProvider" not in sess.get_providers():
        # ORT falls back to the CPU EP when the CUDA EP cannot load (missing CUDA/cuDNN libraries): never time that
        raise StofError(f"the CUDA execution provider did not load (session providers: {sess.get_providers()}); "
                        "check the CUDA/cuDNN libraries (onnxruntime.preload_dlls())")
    if register and "CUDAExecutionProvider" in sess.get_providers():
        _check_device(device_id)
    return sess


def _model_meta(model) -> dict:
    """The model's metadata (a path or a ModelProto); {} when it cannot be read (ORT reports that itself)."""
    if not hasattr(model, "metadata_props"):
        import onnx

        try:
            model = onnx.load(str(model), load_external_data=False)
        except Exception:  # noqa: BLE001
            return {}
    return {p.key: p.value for p in model.metadata_props}


def token_capacity(tokens: int, limit: int) -> int:
    """The token slots for a batch of ``tokens`` real tokens, at most ``limit`` (B·S): rounded up to an eighth of
    its power-of-two octave (at least 64), so at most 12.5 % of the slots are spare and a server replays at most
    eight CUDA graphs per octave of batch sizes."""
    tokens = max(int(tokens), 1)
    step = max(64, 1 << max((tokens - 1).bit_length() - 4, 0))
    return max(1, min(int(limit), -(-tokens // step) * step))


def _token_slot_inputs(sess) -> tuple[str | None, str | None]:
    """(token capacity input, padding mask input) of a model packed into token slots, else (None, None)."""
    meta = sess.get_modelmeta().custom_metadata_map
    if not meta.get(META_TOKEN_CAPACITY):
        return None, None
    return meta[META_TOKEN_CAPACITY], meta.get("stof.padding_mask_input")


def with_token_capacity(sess, feeds: dict, capacity: int | None = None) -> dict:
    """``feeds`` plus the ``stof_token_capacity`` input of a model rewritten with ``token_capacity_input``: an int32
    buffer of ``capacity`` slots (default :func:`token_capacity` of the padding mask's real tokens). Feeds of
    other models, or that already have it, come back unchanged."""
    import numpy as np

    name, mask_name = _token_slot_inputs(sess)
    if not name or name in feeds:
        return feeds
    if capacity is None:
        if mask_name not in feeds:
            raise StofError(f"missing input {mask_name} (the padding mask the token capacity is counted from)")
        mask = np.asarray(feeds[mask_name])
        capacity = token_capacity(np.count_nonzero(mask), mask.size)
    if capacity < 1:
        raise StofError(f"token capacity must be at least 1, got {capacity}")
    return {**feeds, name: np.zeros(int(capacity), np.int32)}


def _check_device(device_id: int) -> None:
    """StofError when the kernel library that libstof_ort loaded has no code for the GPU (e.g. built for sm_90a, run
    on an A100): one clear line now rather than a failing first run."""
    from .kernels import check_device

    try:  # the copy libstof_ort linked, already in the process (matched by its soname)
        lib = ctypes.CDLL("libstof_kernels.so")
    except OSError:
        return
    check_device(device_id, lib=lib)


def _with_presearch(model, tactic_cache, shapes, device_id: int) -> str:
    """A temporary cache file: `tactic_cache`'s entries plus pre-search first choices for the missing keys."""
    import tempfile

    import onnx

    from .selection import add_presearch_entries
    from .tactic_cache import TacticCache, gpu_identity

    proto = model if hasattr(model, "graph") else onnx.load(str(model), load_external_data=False)
    cache = TacticCache.load(tactic_cache) if tactic_cache is not None else TacticCache()
    gpu, cc = gpu_identity(device_id)
    add_presearch_entries(cache, proto, shapes, gpu, cc)
    fd, path = tempfile.mkstemp(prefix="stof-tactics-", suffix=".json")
    os.close(fd)
    cache.save(path)
    return path


class Binding:
    """IO binding of a session: inputs copied to the device once, outputs preallocated there.

    With ``cuda_graphs=True`` sessions the buffers stay fixed across runs, as ORT's graph replay requires.
    ``update(feeds)`` copies new host values into the same device buffers. A model rewritten with
    ``token_capacity_input`` gets its ``stof_token_capacity`` input from the padding mask (:func:`with_token_capacity`);
    ``update`` keeps that capacity and refuses a batch with more real tokens (a new capacity is a new CUDA graph:
    make a new Binding).
    """

    def __init__(self, sess, feeds: dict, device_id: int = 0, device: str | None = None):
        import numpy as np
        import onnxruntime as ort

        self.sess = sess
        self._slot_inputs = _token_slot_inputs(sess)  # (capacity input, padding mask input), read once
        on_gpu = "CUDAExecutionProvider" in sess.get_providers()
        self.device = device or ("cuda" if on_gpu else "cpu")
        self.device_id = device_id
        self.binding = sess.io_binding()
        self._inputs = {}
        feeds = with_token_capacity(sess, feeds)
        names = [i.name for i in sess.get_inputs()]
        missing = [n for n in names if n not in feeds]
        if missing:
            raise StofError(f"missing inputs: {', '.join(missing)}")
        for name in names:
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[name]), self.device, device_id)
            self._inputs[name] = v
            self.binding.bind_ortvalue_input(name, v)
        self._outputs = None
        self._output_names = [o.name for o in sess.get_outputs()]

    def update(self, feeds: dict) -> None:
        import numpy as np

        cap, mask_name = self._slot_inputs
        if cap in self._inputs and mask_name in feeds:
            slots, tokens = self._inputs[cap].shape()[0], int(np.count_nonzero(feeds[mask_name]))
            if tokens > slots:
                raise StofError(f"the batch has {tokens} real tokens, more than the {slots} token slots this binding "
                                "was made for: make a new Binding (a new capacity is a new CUDA graph)")
        for name, arr in feeds.items():
            self._inputs[name].update_inplace(np.ascontiguousarray(arr))

    def run(self) -> None:
        if self._outputs is None:
            # First run: ORT allocates the outputs on the device; keep them bound so later runs (and CUDA graph
            # replays) write to the same buffers.
            for name in self._output_names:
                self.binding.bind_output(name, self.device, self.device_id)
            self.sess.run_with_iobinding(self.binding)
            self._outputs = self.binding.get_outputs()
            for name, v in zip(self._output_names, self._outputs):
                self.binding.bind_ortvalue_output(name, v)
            return
        self.sess.run_with_iobinding(self.binding)

    def outputs(self) -> list:
        """The outputs as numpy arrays (copied to the host)."""
        if self._outputs is None:
            self.run()
        return [v.numpy() for v in self._outputs]


def time_session(sess, feeds: dict, *, warmup: int = 10, iters: int = 50, device_id: int = 0,
                 binding: Binding | None = None) -> list[float]:
    """Per-run latencies in ms of ``sess`` with IO binding (inputs on the device, outputs preallocated).

    ORT's CUDA EP synchronises its stream at the end of each run, so the host clock around
    ``run_with_iobinding`` measures the full GPU time of the run plus ORT's launch overhead."""
    b = binding or Binding(sess, feeds, device_id)
    for _ in range(max(warmup, 1)):
        b.run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.run()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def latency_stats(times_ms: list[float]) -> dict:
    """median, p90, min, mean of a list of latencies (ms)."""
    s = sorted(times_ms)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return {"median_ms": statistics.median(s), "p90_ms": p90, "min_ms": s[0], "mean_ms": statistics.fmean(s),
            "runs": len(s)}


# ---------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------
_NP_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8",
             "tensor(int8)": "int8", "tensor(bfloat16)": "bfloat16"}


def parse_shapes(specs) -> dict:
    """["input_ids=8x512,attention_mask=8x512", ...] -> {"input_ids": (8, 512), ...}; one spec may list several."""
    out = {}
    for spec in specs or []:
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise StofError(f"bad shape spec '{part}' (expected NAME=DxDx...)")
            name, dims = part.split("=", 1)
            try:
                shape = tuple(int(d) for d in dims.lower().split("x") if d != "")
            except ValueError:
                raise StofError(f"bad shape spec '{part}' (dims must be integers)") from None
            if not shape or any(d < 0 for d in shape):
                raise StofError(f"bad shape spec '{part}'")
            if name.strip() in out:
                raise StofError(f"the shape of '{name.strip()}' is given twice")
            out[name.strip()] = shape
    return out


def input_specs(sess) -> list[tuple[str, list, str]]:
    """(name, shape with None for symbolic dims, numpy dtype name) of each session input."""
    res = []
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else None for d in i.shape]
        res.append((i.name, shape, _NP_TYPES.get(i.type, i.type)))
    return res


def random_feeds(sess, shapes: dict | None = None, *, seed: int = 0, vocab: int = 100) -> dict:
    """Random inputs for a session: ids in [0, vocab), masks of ones, token types 0, position ids 0..S-1, floats
    N(0,1).  Symbolic dims come from `shapes` (name -> tuple); a static input may be given there too.  A token
    capacity input is left out unless `shapes` names it (:func:`with_token_capacity` and Binding size it)."""
    import numpy as np

    from .nodes import TOKEN_CAPACITY_INPUT

    rng = np.random.default_rng(seed)
    shapes = dict(shapes or {})
    planned = []
    for name, shape, dt in input_specs(sess):
        if name == TOKEN_CAPACITY_INPUT and name not in shapes:
            continue
        if name in shapes:
            shp = tuple(shapes.pop(name))
            if len(shp) != len(shape) or any(s is not None and s != d for s, d in zip(shape, shp)):
                raise StofError(f"input '{name}': shape {shp} does not fit the model's {shape}")
        elif all(d is not None for d in shape):
            shp = tuple(shape)
        else:
            raise StofError(f"input '{name}' has symbolic dims {shape}: give --shapes {name}=DxD...")
        planned.append((name, shp, dt))
    if shapes:
        raise StofError(f"--shapes names inputs the model does not have: {', '.join(shapes)}")
    kinds = [_random_kind(name, dt) for name, _, dt in planned]
    # checked before the first array is made: every array, plus the int64 / float64 draw of the largest drawn one
    sizes = [math.prod(shp) for _, shp, _ in planned]
    need = sum(n * np.dtype(dt).itemsize for n, (_, _, dt) in zip(sizes, planned)) + max(
        [8 * n for n, kind in zip(sizes, kinds) if kind in ("ids", "normal")], default=0)
    avail = available_memory()
    if avail is not None and need > avail:
        raise StofError(f"random inputs of these shapes need {need / 2**30:.1f} GiB of host memory and "
                        f"{avail / 2**30:.1f} GiB is available: give smaller --shapes")
    feeds = {}
    for (name, shp, dt), kind in zip(planned, kinds):
        if kind == "ones":
            arr = np.ones(shp, dt)
        elif kind == "zeros":
            arr = np.zeros(shp, dt)
        elif kind == "positions":
            arr = np.broadcast_to(np.arange(shp[-1]), shp).astype(dt)
        elif kind == "ids":
            arr = rng.integers(0, vocab, size=shp).astype(dt)
        else:
            arr = rng.standard_normal(shp).astype(dt)
        feeds[name] = arr
    return feeds


def _random_kind(name: str, dt: str) -> str:
    """How random_feeds fills an input: masks of ones, token types 0, positions 0..S-1, ids, floats N(0, 1)."""
    low = name.lower()
    if dt in ("int64", "int32", "int8", "uint8", "bool"):
        return "ones" if "mask" in low else "zeros" if "token_type" in low else "positions" if "position" in low \
            else "ids"
    if dt in ("float32", "float16", "float64"):
        return "normal"
    raise StofError(f"input '{name}': cannot make random values of type {dt}")
