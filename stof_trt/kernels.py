"""Python binding of the STOF attention kernels (ctypes over plugins_cu/include/stof/stof_attention.h).

Serves tests, tuning and benchmarks; the ONNX Runtime and TensorRT plugins call the same C ABI directly.
Device memory comes from torch (``tensor.data_ptr()``); any object with ``data_ptr()``, ``shape``, ``stride()``
and ``dtype`` like a torch tensor works, and cupy arrays are accepted through ``torch.as_tensor``.

Typical use::

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, sparse_attention, list_tactics, select_tactic
    layout = compile_mask("sliding:window=128", 4096, 4096)
    dl = DeviceLayout(layout, device="cuda")          # checked, derived and uploaded by the library
    o = sparse_attention(q, k, v, dl)                  # q,k,v: [B,H,S,D] fp16/bf16 CUDA tensors
    for t in list_tactics(q, k, v, dl):
        o = sparse_attention(q, k, v, dl, tactic=t)
    t, source = select_tactic(q, k, v, dl, tactic_cache="h100.json")   # cache, else pre-search, else default
    o = sparse_attention(q, k, v, dl, row_order=False)   # the kernels' default order, not the layout's
    o = sparse_attention(q, k, v, dl, sched_chunk=1)     # one (batch, head) pair at a time

``DeviceLayout`` owns a layout handle of the library: the library checks the arrays (a bad layout raises
``StofKernelError`` with the first fault), derives the schedules (tile rows and pairs of tile rows longest first,
the bitmaps in the kernels' thread order, the (batch, head) interleaving) and uploads everything once.  Runs pass
the handle; the schedule switches (``row_order``, ``pair_order``, ``lane_bitmaps``, ``sched_chunk``) change the
timing, never the result.

The library is found at ``$STOF_KERNELS_LIB``, else ``build/plugins_cu/libstof_kernels.so`` under the
repository root (``cmake -S . -B build && cmake --build build -j``).
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "StofKernelError", "load_library", "library_available", "DeviceLayout", "Tactic", "all_tactics",
    "tactic_info", "list_tactics", "workspace_size", "sparse_attention", "Runner", "STATUS", "ABI_VERSION", "select_tactic",
    "DeviceDesc", "device_desc", "shape_bucket", "load_tactic_cache", "store_tactic",
    "profile_path", "profile_coef", "check_device", "cuda_architectures",
]

ABI_VERSION = 9  # STOF_ABI_VERSION of the header this module mirrors

STATUS = {0: "SUCCESS", 1: "INVALID_ARGUMENT", 2: "UNSUPPORTED", 3: "INVALID_TACTIC", 4: "CUDA",
          5: "INSUFFICIENT_BUFFER"}
DTYPE_FP16, DTYPE_BF16 = 0, 1
FAMILY_BLOCK, FAMILY_ROW, FAMILY_HOPPER = 1, 2, 3
OPT_NO_ROW_ORDER, OPT_NO_LANE_BITMAPS, OPT_NO_PAIR_ORDER = 1, 2, 4
SOURCES = {1: "cache", 2: "presearch", 3: "default", 4: "timed"}
_DERIVED = {"row_order": 0, "pair_order": 1, "lane_bitmaps": 2}
SELECT_NO_PRESEARCH, SELECT_TIME = 1, 2
# STOF_SELECT_TIME_SMALL_US / _SMALL_RATIO: a problem whose first choice is predicted at most this (seconds) is
# timed over every valid tactic within this ratio of the first (first-use timing; stof tune does the same)
SELECT_TIME_SMALL_S, SELECT_TIME_SMALL_RATIO = 50e-6, 4.0


class StofKernelError(RuntimeError):
    """A C ABI call returned an error status; ``status`` holds the code, the message the library's detail."""

    def __init__(self, status: int, message: str):
        super().__init__(f"stof kernels: {STATUS.get(status, status)}: {message}")
        self.status = status


_i32p = ctypes.POINTER(ctypes.c_int32)


class _Params(ctypes.Structure):
    """Mirror of stof_attn_params_t (field order and types must match the header)."""

    _fields_ = [
        ("dtype", ctypes.c_int32), ("batch", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("seq_q", ctypes.c_int32), ("seq_k", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
        ("q_stride_b", ctypes.c_int64), ("q_stride_h", ctypes.c_int64), ("q_stride_s", ctypes.c_int64),
        ("k_stride_b", ctypes.c_int64), ("k_stride_h", ctypes.c_int64), ("k_stride_s", ctypes.c_int64),
        ("v_stride_b", ctypes.c_int64), ("v_stride_h", ctypes.c_int64), ("v_stride_s", ctypes.c_int64),
        ("o_stride_b", ctypes.c_int64), ("o_stride_h", ctypes.c_int64), ("o_stride_s", ctypes.c_int64),
        ("layout", ctypes.c_void_p),
        ("key_lengths", ctypes.c_void_p), ("key_padding_mask", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_int64),
        ("sched_chunk", ctypes.c_int32), ("options", ctypes.c_uint32),
        ("kv_heads", ctypes.c_int32),
        ("seq_offsets", ctypes.c_void_p),
    ]


class _LayoutDesc(ctypes.Structure):
    """Mirror of stof_layout_desc_t."""

    _fields_ = [
        ("row_ptr", _i32p), ("row_ptr_len", ctypes.c_int64),
        ("col_idx", _i32p), ("col_idx_len", ctypes.c_int64),
        ("tile_bitmap_index", _i32p), ("tile_bitmap_index_len", ctypes.c_int64),
        ("bitmaps", _i32p), ("bitmaps_len", ctypes.c_int64),
        ("tile_m", ctypes.c_int32), ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32),
        ("seq_q", ctypes.c_int32), ("seq_k", ctypes.c_int32), ("format_version", ctypes.c_int32),
    ]


class _LayoutInfo(ctypes.Structure):
    """Mirror of stof_layout_info_t."""

    _fields_ = [
        ("tile_m", ctypes.c_int32), ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32),
        ("seq_q", ctypes.c_int32), ("seq_k", ctypes.c_int32), ("tiles_q", ctypes.c_int32),
        ("tiles_k", ctypes.c_int32), ("nnz", ctypes.c_int64), ("num_bitmaps", ctypes.c_int32),
        ("sched_chunk", ctypes.c_int32), ("row_order_is_default", ctypes.c_int32),
        ("pair_order_is_default", ctypes.c_int32), ("has_lane_bitmaps", ctypes.c_int32),
        ("device", ctypes.c_int32), ("signature", ctypes.c_char * 41),
    ]


class _GpuProps(ctypes.Structure):
    """Mirror of stof_gpu_props_t."""

    _fields_ = [(n, ctypes.c_int32) for n in ("sm_count", "smem_per_sm", "regs_per_sm", "max_threads_per_sm",
                                               "max_ctas_per_sm", "sm")] + [
        (n, ctypes.c_double) for n in ("clock_hz", "mma_tflops", "dram_bw", "l2_bw", "wgmma_tflops")]


class DeviceDesc(ctypes.Structure):
    """Mirror of stof_device_desc_t: a GPU's identity (the tactic cache's "gpu" and "cc") and pre-search
    properties."""

    _fields_ = [("name", ctypes.c_char * 256), ("cc", ctypes.c_char * 16), ("props", _GpuProps)]


_LIB: ctypes.CDLL | None = None


def _default_paths() -> list[Path]:
    root = Path(__file__).resolve().parent.parent
    return [root / "build" / "plugins_cu" / "libstof_kernels.so", root / "build" / "libstof_kernels.so"]


def load_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load libstof_kernels.so once (explicit path, $STOF_KERNELS_LIB, or the build tree)."""
    global _LIB
    if _LIB is not None and path is None:
        return _LIB
    from ._libs import find_library

    candidates = [Path(path)] if path else []
    if not candidates and os.environ.get("STOF_KERNELS_LIB"):
        candidates = [Path(os.environ["STOF_KERNELS_LIB"])]
    found = None if candidates else find_library("libstof_kernels.so", "STOF_KERNELS_LIB", "plugins_cu")
    candidates = candidates or ([found] if found else _default_paths())
    for cand in candidates:
        if cand.is_file():
            lib = ctypes.CDLL(str(cand))
            break
    else:
        raise FileNotFoundError(
            "libstof_kernels.so not found (tried " + ", ".join(map(str, candidates)) + "); build it with "
            "`cmake -S . -B build && cmake --build build -j` or set STOF_KERNELS_LIB")
    lib.stof_abi_version.argtypes, lib.stof_abi_version.restype = [], ctypes.c_int32
    if lib.stof_abi_version() != ABI_VERSION:
        raise RuntimeError(f"libstof_kernels ABI version {lib.stof_abi_version()}, expected {ABI_VERSION} "
                           f"(rebuild the library, or point STOF_KERNELS_LIB at a current build)")
    P = ctypes.POINTER(_Params)
    vp, i32, i64, c_int = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int
    sigs = {
        "stof_attn_params_init": ([P], None),
        "stof_attn_validate": ([P], c_int),
        "stof_attn_list_tactics": ([P, _i32p, i32, _i32p], c_int),
        "stof_attn_all_tactics": ([_i32p, i32, _i32p], c_int),
        "stof_attn_tactic_info": ([i32] + [_i32p] * 5, c_int),
        "stof_attn_tactic_name": ([i32], ctypes.c_char_p),
        "stof_attn_workspace_size": ([P, i32, ctypes.POINTER(ctypes.c_size_t)], c_int),
        "stof_attn_run": ([P, i32, vp], c_int),
        "stof_attn_select": ([P, ctypes.c_char_p, ctypes.POINTER(DeviceDesc), ctypes.c_uint32, _i32p, _i32p], c_int),
        "stof_status_string": ([c_int], ctypes.c_char_p),
        "stof_last_error_message": ([], ctypes.c_char_p),
        "stof_layout_create": ([ctypes.POINTER(_LayoutDesc), ctypes.POINTER(vp)], c_int),
        "stof_layout_upload": ([vp, vp], c_int),
        "stof_layout_use_device_arrays": ([vp, vp, vp, vp, vp], c_int),
        "stof_layout_destroy": ([vp], None),
        "stof_layout_info": ([vp, ctypes.POINTER(_LayoutInfo)], c_int),
        "stof_layout_derived": ([vp, i32, _i32p, i64, ctypes.POINTER(i64)], c_int),
        "stof_device_describe": ([i32, ctypes.POINTER(DeviceDesc)], c_int),
        "stof_tactic_cache_load": ([ctypes.c_char_p, _i32p], c_int),
        "stof_shape_bucket": ([i64, i64, i64, ctypes.c_char_p, ctypes.c_size_t], c_int),
        "stof_attn_select_on_stream": ([P, ctypes.c_char_p, ctypes.POINTER(DeviceDesc), ctypes.c_uint32, vp, _i32p,
                                        _i32p], c_int),
        "stof_tactic_cache_store": ([ctypes.c_char_p] * 6 + [i32, ctypes.c_double], c_int),
        "stof_presearch_profile_path": ([ctypes.POINTER(DeviceDesc), ctypes.c_char_p, ctypes.c_size_t], c_int),
        "stof_presearch_profile_coef": ([ctypes.c_char_p, ctypes.POINTER(DeviceDesc), vp, i32, _i32p], c_int),
        "stof_device_check": ([i32], c_int),
        "stof_cuda_architectures": ([], ctypes.c_char_p),
    }
    optional = {"stof_attn_select_on_stream", "stof_tactic_cache_store", "stof_presearch_profile_path",
                "stof_presearch_profile_coef",  # first-use timing: newer builds only
                "stof_device_check", "stof_cuda_architectures"}
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name, None)
        if fn is None and name in optional:
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _LIB = lib
    return lib


def library_available() -> bool:
    try:
        load_library()
        return True
    except (FileNotFoundError, OSError):
        return False


def cuda_architectures(lib=None) -> str | None:
    """The CUDA architectures the loaded library is built for ("80 86 89 90a"); None for a build that does not
    say."""
    lib = lib or load_library()
    fn = getattr(lib, "stof_cuda_architectures", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return fn().decode()


def check_device(device: int | None = None, lib=None) -> None:
    """Raise ``StofError`` (one line: the GPU, its architecture, the build's and how to rebuild) when the library
    has no code for CUDA device ``device`` (None: the current one), e.g. a build for sm_90a on an A100.  Creates the
    device's CUDA context; a build without the check passes."""
    from .errors import StofError

    lib = lib or load_library()
    fn = getattr(lib, "stof_device_check", None)
    if fn is None:
        return
    fn.argtypes, fn.restype = [ctypes.c_int32], ctypes.c_int
    lib.stof_last_error_message.argtypes, lib.stof_last_error_message.restype = [], ctypes.c_char_p
    if fn(-1 if device is None else int(device)) != 0:
        raise StofError(lib.stof_last_error_message().decode())


def _check(status: int) -> None:
    if status != 0:
        raise StofKernelError(status, _LIB.stof_last_error_message().decode())


@dataclass(frozen=True)
class Tactic:
    id: int
    name: str
    family: int  # FAMILY_BLOCK (mma.sync), FAMILY_ROW (warp per query row) or FAMILY_HOPPER (wgmma)
    block_m: int
    block_n: int
    num_warps: int
    stages: int


def tactic_info(tactic: int) -> Tactic:
    lib = load_library()
    vals = [ctypes.c_int32() for _ in range(5)]
    _check(lib.stof_attn_tactic_info(tactic, *[ctypes.byref(v) for v in vals]))
    return Tactic(tactic, lib.stof_attn_tactic_name(tactic).decode(), *[v.value for v in vals])


def all_tactics() -> list[Tactic]:
    """Every tactic of the loaded library (regardless of problem)."""
    lib = load_library()
    ids = (ctypes.c_int32 * 128)()
    n = ctypes.c_int32()
    _check(lib.stof_attn_all_tactics(ids, 128, ctypes.byref(n)))
    return [tactic_info(ids[i]) for i in range(n.value)]


class DeviceLayout:
    """A TileLayout as a layout handle of the library, checked and with its derived schedules, uploaded to
    ``device`` (``"cpu"``: host only, for host-side calls such as ``list_tactics`` and ``select_tactic``).

    Attributes: the layout's sizes (``tile_m``, ``tile_n``, ``seq_q``, ``seq_k``, ``num_layouts``,
    ``num_bitmaps``), its derived ``sched_chunk``, ``row_order_is_default`` / ``pair_order_is_default`` (an order
    equal to the kernels' own, which the library then does not pass), ``signature`` (``TileLayout.signature()``)
    and ``lane_bitmaps`` (False: runs leave the lane bitmaps out, the same result).  ``derived(name)`` returns
    the library's ``row_order``, ``pair_order`` or ``lane_bitmaps`` as int32 numpy."""

    def __init__(self, layout, device="cuda", lane_bitmaps: bool = True):
        import numpy as np

        self._lib = lib = load_library()
        self._handle = None
        self.layout = layout
        arrays = [np.ascontiguousarray(a, np.int32).ravel() for a in
                  (layout.row_ptr, layout.col_idx, layout.tile_bitmap_index, layout.bitmaps)]
        d = _LayoutDesc()
        for name, a in zip(("row_ptr", "col_idx", "tile_bitmap_index", "bitmaps"), arrays):
            setattr(d, name, a.ctypes.data_as(_i32p))
            setattr(d, name + "_len", a.size)
        d.tile_m, d.tile_n, d.num_layouts = int(layout.tile_m), int(layout.tile_n), int(layout.num_layouts)
        d.seq_q, d.seq_k = int(layout.seq_q), int(layout.seq_k)
        h = ctypes.c_void_p()
        _check(lib.stof_layout_create(ctypes.byref(d), ctypes.byref(h)))
        self._handle = h
        info = _LayoutInfo()
        _check(lib.stof_layout_info(h, ctypes.byref(info)))
        self.tile_m, self.tile_n, self.num_layouts = info.tile_m, info.tile_n, info.num_layouts
        self.seq_q, self.seq_k, self.num_bitmaps = info.seq_q, info.seq_k, info.num_bitmaps
        self.sched_chunk = info.sched_chunk
        self.row_order_is_default = bool(info.row_order_is_default)
        self.pair_order_is_default = bool(info.pair_order_is_default)
        self.has_lane_bitmaps = bool(info.has_lane_bitmaps)
        self.signature = info.signature.decode()
        self.lane_bitmaps = bool(lane_bitmaps)
        self.device = None
        if not str(device).startswith("cpu"):
            import torch

            dev = torch.device(device)
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            with torch.cuda.device(dev):
                _check(lib.stof_layout_upload(h, torch.cuda.current_stream(dev).cuda_stream))
            self.device = dev

    def derived(self, name: str):
        """The library's derived host array ``row_order``, ``pair_order`` or ``lane_bitmaps`` (int32 numpy; the
        last is empty for tile shapes without lane bitmaps)."""
        import numpy as np

        n = ctypes.c_int64()
        st = self._lib.stof_layout_derived(self._handle, _DERIVED[name], None, 0, ctypes.byref(n))
        if st not in (0, 5):
            _check(st)
        out = np.empty(max(n.value, 1), np.int32)
        _check(self._lib.stof_layout_derived(self._handle, _DERIVED[name], out.ctypes.data_as(_i32p), out.size,
                                             ctypes.byref(n)))
        return out[:n.value]

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self._lib.stof_layout_destroy(self._handle)
            self._handle = None

    def __repr__(self) -> str:
        return f"DeviceLayout({self.layout!r})"


def _as_torch(x):
    if hasattr(x, "data_ptr") and hasattr(x, "stride"):
        return x
    import torch  # cupy or anything with __cuda_array_interface__ / dlpack

    return torch.as_tensor(x, device="cuda")


def _make_params(q, k, v, o, dl: DeviceLayout, scale, key_lengths, key_padding_mask, bhsd: bool,
                 row_order: bool = True, sched_chunk: int | None = None, pair_order: bool = True,
                 seq_offsets=None, max_seqlen: int | None = None) -> _Params:
    import torch

    if seq_offsets is not None:
        return _make_packed_params(q, k, v, o, dl, scale, key_lengths, key_padding_mask, row_order, sched_chunk,
                                   pair_order, seq_offsets, max_seqlen)
    if q.dtype not in (torch.float16, torch.bfloat16):
        dt = -1
    else:
        dt = DTYPE_FP16 if q.dtype == torch.float16 else DTYPE_BF16
    for name, t in (("k", k), ("v", v), ("o", o)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.dim() != 4 or t.stride(3) != 1:
            raise ValueError(f"{name} must be 4-D with a contiguous last dim, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
    # axes: b, h, s, d  (bhsd=False: tensors are [B, S, H, D])
    ax = (0, 1, 2) if bhsd else (0, 2, 1)
    B, H, Sq, D = q.shape[ax[0]], q.shape[ax[1]], q.shape[ax[2]], q.shape[3]
    Sk, Hkv = k.shape[ax[2]], k.shape[ax[1]]
    if Hkv < 1 or v.shape[ax[1]] != Hkv:  # k/v [B,Hkv,Sk,D]: grouped-query attention when Hkv < H
        raise ValueError(f"k and v must have the same number of heads >= 1, got {k.shape[ax[1]]} and "
                         f"{v.shape[ax[1]]}")
    p = _Params()
    _LIB.stof_attn_params_init(ctypes.byref(p))
    p.dtype, p.batch, p.num_heads, p.seq_q, p.seq_k, p.head_dim = dt, B, H, Sq, Sk, D
    p.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        st = t.stride()
        setattr(p, f"{prefix}_stride_b", st[ax[0]])
        setattr(p, f"{prefix}_stride_h", st[ax[1]])
        setattr(p, f"{prefix}_stride_s", st[ax[2]])
    p.kv_heads = 0 if Hkv == H else Hkv  # the library checks H % kv_heads == 0
    p.layout = dl._handle
    # None = the layout's choice (-1); an explicit value goes to the library as given (< -1 is INVALID_ARGUMENT)
    p.sched_chunk = -1 if sched_chunk is None else int(sched_chunk)
    p.options = ((0 if row_order else OPT_NO_ROW_ORDER | OPT_NO_PAIR_ORDER) | (0 if pair_order else OPT_NO_PAIR_ORDER)
                 | (0 if dl.lane_bitmaps else OPT_NO_LANE_BITMAPS))
    if key_lengths is not None:
        if key_lengths.dtype != torch.int32 or not key_lengths.is_contiguous() or key_lengths.numel() != B:
            raise ValueError("key_lengths must be a contiguous int32 [B] tensor")
        p.key_lengths = key_lengths.data_ptr()
    if key_padding_mask is not None:
        if (key_padding_mask.dtype != torch.int32 or not key_padding_mask.is_contiguous()
                or tuple(key_padding_mask.shape) != (B, Sk)):
            raise ValueError("key_padding_mask must be a contiguous int32 [B, Sk] tensor")
        p.key_padding_mask = key_padding_mask.data_ptr()
    return p


def _make_packed_params(q, k, v, o, dl: DeviceLayout, scale, key_lengths, key_padding_mask, row_order: bool,
                        sched_chunk: int | None, pair_order: bool, seq_offsets, max_seqlen: int | None) -> _Params:
    """Packed variable-length sequences: q/o [T, H, D], k/v [T, Hkv, D] (any row and head strides, the last dim
    contiguous: views of a [T, 3, H, D] projection work), seq_offsets int32 [B+1] on the tensors' device.  The
    run-time Sq = Sk = max_seqlen (None: the layout's sizes), which must bound every sequence's length."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be 3-D [T, H, D] with a contiguous last dim when seq_offsets is given, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} tokens, q has {q.shape[0]}")
    if (seq_offsets.dtype != torch.int32 or seq_offsets.dim() != 1 or not seq_offsets.is_contiguous()
            or seq_offsets.numel() < 2):
        raise ValueError("seq_offsets must be a contiguous int32 [B+1] tensor with B >= 1")
    # the 4-D path with a batch of one gives every other field (dtype, heads, strides, options)
    q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, o))
    p = _make_params(q4, k4, v4, o4, dl, scale, None, None, False, row_order, sched_chunk, pair_order)
    # key_lengths / key_padding_mask go to the library as given: it refuses them with seq_offsets
    for name, t in (("key_lengths", key_lengths), ("key_padding_mask", key_padding_mask)):
        if t is not None:
            setattr(p, name, t.data_ptr())
    p.batch = seq_offsets.numel() - 1
    p.seq_q, p.seq_k = (dl.seq_q, dl.seq_k) if max_seqlen is None else (int(max_seqlen), int(max_seqlen))
    p.q_stride_b = p.k_stride_b = p.v_stride_b = p.o_stride_b = 0
    p.seq_offsets = seq_offsets.data_ptr()
    return p


def _attach_workspace(lib, p: _Params, tactic: int, device, given=None):
    """Allocate the workspace the library asks for (the persistent tactics' work counter) and point p at it, or
    use `given` (a CUDA tensor of at least that many bytes, 16-byte aligned; its contents need no initialisation);
    returns the tensor (keep it alive while the call runs) or None."""
    import torch

    n = ctypes.c_size_t()
    _check(lib.stof_attn_workspace_size(ctypes.byref(p), int(tactic), ctypes.byref(n)))
    if n.value == 0:
        return None
    if given is not None:
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"workspace must be a bool or a torch CUDA tensor, not {type(given).__name__}")
        nbytes = given.numel() * given.element_size()
        if not given.is_cuda or nbytes < n.value or given.data_ptr() % 16 or not given.is_contiguous():
            raise ValueError(f"workspace must be a contiguous, 16-byte aligned CUDA tensor of >= {n.value} bytes")
        p.workspace, p.workspace_bytes = given.data_ptr(), nbytes
        return given
    ws = torch.empty(n.value, dtype=torch.uint8, device=device)  # the caching allocator aligns to 512 bytes
    p.workspace, p.workspace_bytes = ws.data_ptr(), n.value
    return ws


def _keep_for_stream(ws, stream, device) -> None:
    """ws was allocated on the current stream; the call runs on `stream` (a torch stream or a raw handle): keep
    the memory from the caching allocator until that stream's work is done."""
    import torch

    if ws is not None and stream is not None:
        ws.record_stream(stream if isinstance(stream, torch.cuda.Stream)
                         else torch.cuda.ExternalStream(getattr(stream, "cuda_stream", stream), device=device))


def list_tactics(q, k, v, dl: DeviceLayout, *, bhsd: bool = True, row_order: bool = True,
                 sched_chunk: int | None = None, seq_offsets=None, max_seqlen: int | None = None) -> list[int]:
    """Tactic ids valid for this problem (library's static order); seq_offsets: packed sequences, as
    ``sparse_attention``."""
    lib = load_library()
    p = _make_params(q, k, v, q, dl, None, None, None, bhsd, row_order, sched_chunk, seq_offsets=seq_offsets,
                     max_seqlen=max_seqlen)
    ids = (ctypes.c_int32 * 128)()
    n = ctypes.c_int32()
    _check(lib.stof_attn_list_tactics(ctypes.byref(p), ids, 128, ctypes.byref(n)))
    return [ids[i] for i in range(n.value)]


def workspace_size(q, k, v, dl: DeviceLayout, tactic: int = 0, *, bhsd: bool = True, seq_offsets=None,
                   max_seqlen: int | None = None) -> int:
    """Workspace bytes ``tactic`` uses on this problem on the current GPU (0: none): the persistent tactics' work
    counter, the split tactics' slices (0 where they split nothing); tactic 0: the most any tactic uses."""
    lib = load_library()
    p = _make_params(q, k, v, q, dl, None, None, None, bhsd, True, None, seq_offsets=seq_offsets,
                     max_seqlen=max_seqlen)
    n = ctypes.c_size_t()
    _check(lib.stof_attn_workspace_size(ctypes.byref(p), int(tactic), ctypes.byref(n)))
    return int(n.value)


def device_desc(device: int | None = None, *, name: str | None = None, cc: str | None = None) -> DeviceDesc:
    """A GPU as ``select_tactic`` sees it: CUDA device ``device`` (None: the current one), or, given ``name`` and
    ``cc``, that identity with the H100 SXM's pre-search properties (host only: no GPU needed)."""
    lib = load_library()
    d = DeviceDesc()
    if name is not None or cc is not None:
        if name is None or cc is None:
            raise ValueError("give both name and cc, or neither")
        d.name, d.cc = name.encode(), cc.encode()
        lib.stof_presearch_h100_props(ctypes.byref(d.props))
        return d
    if device is None:
        import torch

        device = torch.cuda.current_device()
    _check(lib.stof_device_describe(int(device), ctypes.byref(d)))
    return d


def select_tactic(q, k, v, dl: DeviceLayout, *, key_padding_mask=None, bhsd: bool = True,
                  tactic_cache: str | os.PathLike | None = None, device: DeviceDesc | None = None,
                  presearch: bool = True, timing: bool = False, stream=None, seq_offsets=None,
                  max_seqlen: int | None = None) -> tuple[int, str]:
    """The library's tactic for this problem and where it came from: ``"cache"`` (the tactic cache's entry, when
    valid here), ``"timed"`` (``timing=True``: the fastest of the pre-search's shortlist, timed now on the current
    GPU on scratch output, or earlier in this process), ``"presearch"`` (the pre-search's fastest valid tactic) or
    ``"default"`` (the library's first valid one; ``presearch=False`` skips the pre-search).  With ``timing`` the
    timed choice is written to ``tactic_cache`` (created when missing); q, k and v are only read, and the
    environment variable STOF_FIRST_USE_TIMING=0 turns timing off.  ``device``: a ``device_desc()`` (None: the
    current CUDA device).  ``stream``: where the timing runs (None: torch's current stream).  Memoised per layout
    handle.  ``seq_offsets`` / ``max_seqlen``: packed sequences, as ``sparse_attention``."""
    lib = load_library()
    p = _make_params(q, k, v, q, dl, None, None, key_padding_mask, bhsd, seq_offsets=seq_offsets,
                     max_seqlen=max_seqlen)
    t, src = ctypes.c_int32(), ctypes.c_int32()
    path = None if tactic_cache is None else os.fsencode(tactic_cache)
    flags = (0 if presearch else SELECT_NO_PRESEARCH) | (SELECT_TIME if timing else 0)
    dev = None if device is None else ctypes.byref(device)
    if timing:
        try:
            select = lib.stof_attn_select_on_stream
        except AttributeError:
            raise StofKernelError(2, "this libstof_kernels has no first-use timing (rebuild it)") from None
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(_as_torch(q).device).cuda_stream
        stream = getattr(stream, "cuda_stream", stream)  # a torch.cuda.Stream or a raw handle
        _check(select(ctypes.byref(p), path, dev, flags, ctypes.c_void_p(stream or None), ctypes.byref(t),
                      ctypes.byref(src)))
    else:
        _check(lib.stof_attn_select(ctypes.byref(p), path, dev, flags, ctypes.byref(t), ctypes.byref(src)))
    return t.value, SOURCES[src.value]


def profile_path(device: DeviceDesc) -> str:
    """The pre-search profile file the library reads for a device (stof_presearch_profile_path)."""
    lib = load_library()
    buf = ctypes.create_string_buffer(4096)
    _check(lib.stof_presearch_profile_path(ctypes.byref(device), buf, len(buf)))
    return os.fsdecode(buf.value)


def profile_coef(device: DeviceDesc | None = None, path: str | os.PathLike | None = None) -> dict:
    """The constants the library ranks with for a device from its profile: {(tactic, head dim): (a, b, c, d)};
    {} when no profile applies (stof_presearch_profile_coef).  device None: the current CUDA device."""
    from .presearch import _Coef

    lib = load_library()
    n = ctypes.c_int32()
    buf = (_Coef * 512)()
    _check(lib.stof_presearch_profile_coef(None if path is None else os.fsencode(path),
                                           None if device is None else ctypes.byref(device), buf, len(buf),
                                           ctypes.byref(n)))
    return {(buf[i].tactic, buf[i].head_dim): (buf[i].a, buf[i].b, buf[i].c, buf[i].d) for i in range(n.value)}


def store_tactic(path: str | os.PathLike, gpu: str, cc: str, node: str, bucket: str, mask: str, tactic: int,
                 time_ms: float = 0.0) -> None:
    """Merge one entry into a tactic cache file through the library's writer (lock file, re-read, temp file,
    atomic rename: stof_tactic_cache_store)."""
    lib = load_library()
    _check(lib.stof_tactic_cache_store(os.fsencode(path), gpu.encode(), cc.encode(), node.encode(), bucket.encode(),
                                       mask.encode(), int(tactic), float(time_ms)))


def load_tactic_cache(path: str | os.PathLike) -> int:
    """(Re)read a tactic cache file into the library's table (``select_tactic`` reads a path on first use);
    returns its entry count.  A missing or malformed file raises ``StofKernelError``."""
    lib = load_library()
    n = ctypes.c_int32()
    _check(lib.stof_tactic_cache_load(os.fsencode(path), ctypes.byref(n)))
    return n.value


def shape_bucket(batch: int, seq_q: int, seq_k: int) -> str:
    """The library's shape bucket of the tactic-cache key (= stof_trt.tactic_cache.shape_bucket)."""
    lib = load_library()
    buf = ctypes.create_string_buffer(96)
    _check(lib.stof_shape_bucket(int(batch), int(seq_q), int(seq_k), buf, len(buf)))
    return buf.value.decode()


def sparse_attention(q, k, v, dl: DeviceLayout, *, scale: float | None = None, tactic: int = 0,
                     key_lengths=None, key_padding_mask=None, out=None, bhsd: bool = True, stream=None,
                     row_order: bool = True, sched_chunk: int | None = None, workspace=True,
                     pair_order: bool = True, seq_offsets=None, max_seqlen: int | None = None):
    """O = softmax(scale * Q K^T, masked by the layout and padding) V on the current (or given) CUDA stream.

    q: [B,H,Sq,D] (or [B,Sq,H,D] with bhsd=False), k/v: [B,Hkv,Sk,D] with H % Hkv == 0 (grouped-query attention:
    query head h reads K/V head h // (H // Hkv); Hkv = H without grouping); fp16 or bf16; D in {64, 128}.
    scale defaults to 1/sqrt(D); tactic 0 runs the library's first valid tactic.  row_order=False runs without
    the layout's longest-first schedules (the kernels' default order; same result), pair_order=False without the
    one for two-row work items only.  sched_chunk: (batch, head) pairs whose CTAs are interleaved (0 = the
    library's L2-sized default, 1 = one pair at a time; same result); None = the layout's choice.
    workspace=False passes no workspace (the persistent tactics then run one CTA per work item; same result); a
    CUDA tensor is used as the workspace (any contents).  Returns `out` (allocated if None).
    seq_offsets (a CUDA int32 [B+1] tensor): packed variable-length sequences; q/k/v/out are then [T, H, D]
    (k/v [T, Hkv, D]) and sequence b is rows seq_offsets[b] .. seq_offsets[b+1]-1 (self-attention, the layout
    applied to its first n_b rows and columns); rows of `out` outside every sequence are not written.  max_seqlen
    bounds every n_b (None: the layout's sizes).  Not with key_lengths or key_padding_mask.
    """
    import torch

    lib = load_library()
    q, k, v = _as_torch(q), _as_torch(k), _as_torch(v)
    if out is None:
        out = torch.empty_like(q)
    p = _make_params(q, k, v, out, dl, scale, key_lengths, key_padding_mask, bhsd, row_order, sched_chunk,
                     pair_order, seq_offsets, max_seqlen)
    if workspace is None or isinstance(workspace, (bool, int)):
        ws = _attach_workspace(lib, p, tactic, q.device) if workspace else None
    else:
        ws = _attach_workspace(lib, p, tactic, q.device, given=workspace)
    if stream is None:
        stream = torch.cuda.current_stream(q.device).cuda_stream
    else:
        _keep_for_stream(ws, stream, q.device)
        if hasattr(stream, "cuda_stream"):
            stream = stream.cuda_stream
    _check(lib.stof_attn_run(ctypes.byref(p), int(tactic), ctypes.c_void_p(stream)))
    return out


class Runner:
    """A prepared call (parameters packed once): ``runner()`` launches with ~µs host overhead (benchmarks)."""

    def __init__(self, q, k, v, dl: DeviceLayout, *, out=None, tactic: int = 0, scale=None, key_lengths=None,
                 key_padding_mask=None, bhsd: bool = True, stream=None, row_order: bool = True,
                 sched_chunk: int | None = None, workspace: bool = True, pair_order: bool = True,
                 seq_offsets=None, max_seqlen: int | None = None):
        import torch

        self._lib = load_library()
        self.out = torch.empty_like(q) if out is None else out
        self._keep = (q, k, v, dl, key_lengths, key_padding_mask, seq_offsets)  # keep the memory alive
        self._p = _make_params(q, k, v, self.out, dl, scale, key_lengths, key_padding_mask, bhsd, row_order,
                               sched_chunk, pair_order, seq_offsets, max_seqlen)
        self._pref = ctypes.byref(self._p)
        self.tactic = int(tactic)
        self._ws = _attach_workspace(self._lib, self._p, self.tactic, q.device) if workspace else None
        _keep_for_stream(self._ws, stream, q.device)
        s = torch.cuda.current_stream(q.device).cuda_stream if stream is None else getattr(stream, "cuda_stream", stream)
        self._stream = ctypes.c_void_p(s)
        _check(self._lib.stof_attn_validate(self._pref))

    def __call__(self):
        st = self._lib.stof_attn_run(self._pref, self.tactic, self._stream)
        if st != 0:
            _check(st)
        return self.out
