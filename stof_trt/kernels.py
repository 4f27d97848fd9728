"""Python binding of the STOF attention kernels (ctypes over plugins_cu/include/stof/stof_attention.h).

Serves tests, tuning and benchmarks; the ONNX Runtime and TensorRT plugins call the same C ABI directly.
Device memory comes from torch (``tensor.data_ptr()``); any object with ``data_ptr()``, ``shape``, ``stride()``
and ``dtype`` like a torch tensor works, and cupy arrays are accepted through ``torch.as_tensor``.

Typical use::

    from stof_trt.format import compile_mask
    from stof_trt.kernels import DeviceLayout, sparse_attention, list_tactics
    layout = compile_mask("sliding:window=128", 4096, 4096)
    dl = DeviceLayout(layout, device="cuda")
    o = sparse_attention(q, k, v, dl)                  # q,k,v: [B,H,S,D] fp16/bf16 CUDA tensors
    for t in list_tactics(q, k, v, dl):
        o = sparse_attention(q, k, v, dl, tactic=t)
    o = sparse_attention(q, k, v, dl, row_order=False)   # without the longest-rows-first schedule
    o = sparse_attention(q, k, v, dl, sched_chunk=1)     # one (batch, head) pair at a time

``DeviceLayout`` also uploads ``layout.row_order()`` (C ABI version 2: tile rows longest first) and
``layout.pair_order()`` (version 4: pairs of tile rows longest first, for the kernels whose work item covers two
tile rows); every run passes both unless called with ``row_order=False`` (then the kernels use their default
order, last rows first) or an order is that default already (causal layouts: passing it would only cost the
kernels a load per work item).  It also keeps
``layout.sched_chunk()`` (C ABI version 2 ``sched_chunk``: 1 for layouts of near-equal row lengths, else 0 = the
library's default); every run passes it unless called with an explicit ``sched_chunk=N`` (N >= 0; benchmarks).
The two are independent: ``row_order=False`` still passes the layout's ``sched_chunk``.  And it uploads
``layout.lane_bitmaps()`` (C ABI version 5: the bitmaps in the kernels' thread order; ``DeviceLayout(layout,
lane_bitmaps=False)`` leaves them out, the same result), which every run passes, as it does the bitmaps' row
count (C ABI version 6 ``num_bitmaps``: the wgmma tactics' 32-bit bitmap offsets are then bounded by the bitmaps
themselves, not by the whole tile grid, which refused them on long sequences).

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
    "tactic_info", "list_tactics", "sparse_attention", "Runner", "STATUS", "ABI_VERSION", "native_row_order",
    "native_sched_chunk", "native_pair_order", "native_lane_bitmaps",
]

ABI_VERSION = 6  # STOF_ABI_VERSION of the header this module mirrors

STATUS = {0: "SUCCESS", 1: "INVALID_ARGUMENT", 2: "UNSUPPORTED", 3: "INVALID_TACTIC", 4: "CUDA",
          5: "INSUFFICIENT_BUFFER"}
DTYPE_FP16, DTYPE_BF16 = 0, 1
FAMILY_BLOCK, FAMILY_ROW, FAMILY_HOPPER = 1, 2, 3


class StofKernelError(RuntimeError):
    """A C ABI call returned an error status; ``status`` holds the code, the message the library's detail."""

    def __init__(self, status: int, message: str):
        super().__init__(f"stof kernels: {STATUS.get(status, status)}: {message}")
        self.status = status


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
        ("row_ptr", ctypes.c_void_p), ("col_idx", ctypes.c_void_p), ("tile_bitmap_index", ctypes.c_void_p),
        ("bitmaps", ctypes.c_void_p),
        ("tile_m", ctypes.c_int32), ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32),
        ("layout_seq_q", ctypes.c_int32), ("layout_seq_k", ctypes.c_int32),
        ("key_lengths", ctypes.c_void_p), ("key_padding_mask", ctypes.c_void_p),
        ("row_order", ctypes.c_void_p),  # ABI version 2
        ("sched_chunk", ctypes.c_int32),  # ABI version 2 (then 4 bytes of padding, as in C)
        ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_int64),  # ABI version 3
        ("pair_order", ctypes.c_void_p),  # ABI version 4
        ("lane_bitmaps", ctypes.c_void_p),  # ABI version 5
        ("num_bitmaps", ctypes.c_int32),  # ABI version 6
    ]


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
    P = ctypes.POINTER(_Params)
    i32p = ctypes.POINTER(ctypes.c_int32)
    lib.stof_attn_params_init.argtypes, lib.stof_attn_params_init.restype = [P], None
    lib.stof_attn_validate.argtypes, lib.stof_attn_validate.restype = [P], ctypes.c_int
    lib.stof_attn_list_tactics.argtypes = [P, i32p, ctypes.c_int32, i32p]
    lib.stof_attn_list_tactics.restype = ctypes.c_int
    lib.stof_attn_all_tactics.argtypes, lib.stof_attn_all_tactics.restype = [i32p, ctypes.c_int32, i32p], ctypes.c_int
    lib.stof_attn_tactic_info.argtypes = [ctypes.c_int32] + [i32p] * 5
    lib.stof_attn_tactic_info.restype = ctypes.c_int
    lib.stof_attn_tactic_name.argtypes, lib.stof_attn_tactic_name.restype = [ctypes.c_int32], ctypes.c_char_p
    lib.stof_attn_workspace_size.argtypes = [P, ctypes.c_int32, ctypes.POINTER(ctypes.c_size_t)]
    lib.stof_attn_workspace_size.restype = ctypes.c_int
    lib.stof_attn_run.argtypes, lib.stof_attn_run.restype = [P, ctypes.c_int32, ctypes.c_void_p], ctypes.c_int
    lib.stof_status_string.argtypes, lib.stof_status_string.restype = [ctypes.c_int], ctypes.c_char_p
    lib.stof_last_error_message.argtypes, lib.stof_last_error_message.restype = [], ctypes.c_char_p
    lib.stof_abi_version.argtypes, lib.stof_abi_version.restype = [], ctypes.c_int32
    if lib.stof_abi_version() != ABI_VERSION:
        raise RuntimeError(f"libstof_kernels ABI version {lib.stof_abi_version()}, expected {ABI_VERSION} "
                           f"(rebuild the library, or point STOF_KERNELS_LIB at a current build)")
    lib.stof_layout_row_order.argtypes = [i32p, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.stof_layout_row_order.restype = ctypes.c_int
    if not hasattr(lib, "stof_layout_sched_chunk"):  # an unreleased ABI-2 build from before sched_chunk
        raise RuntimeError("libstof_kernels lacks stof_layout_sched_chunk (a stale ABI-2 build: rebuild the library, "
                           "or point STOF_KERNELS_LIB at a current build)")
    lib.stof_layout_sched_chunk.argtypes = [i32p, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.stof_layout_sched_chunk.restype = ctypes.c_int
    lib.stof_layout_pair_order.argtypes = [i32p, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.stof_layout_pair_order.restype = ctypes.c_int
    lib.stof_layout_lane_bitmaps.argtypes = [i32p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.stof_layout_lane_bitmaps.restype = ctypes.c_int
    _LIB = lib
    return lib


def library_available() -> bool:
    try:
        load_library()
        return True
    except (FileNotFoundError, OSError):
        return False


def _host_row_ptr(row_ptr, num_layouts, tiles_q):
    """row_ptr as contiguous int32 numpy, checked to hold num_layouts*tiles_q + 1 entries (the C helpers read that
    many and cannot check the length themselves); sizes < 1 are left for the library to report."""
    import numpy as np

    rp = np.ascontiguousarray(row_ptr, dtype=np.int32)
    num_layouts, tiles_q = int(num_layouts), int(tiles_q)
    n = num_layouts * tiles_q
    if n >= 1 and rp.shape != (n + 1,):
        raise ValueError(f"row_ptr must have num_layouts*tiles_q + 1 = {n + 1} entries, has shape {rp.shape}")
    return rp, num_layouts, tiles_q, n


def native_row_order(row_ptr, num_layouts: int, tiles_q: int):
    """The C helper ``stof_layout_row_order`` on a host ``row_ptr`` (``num_layouts*tiles_q + 1`` entries): int32
    numpy ``[num_layouts*tiles_q]``, per layout its tile rows longest first (= ``TileLayout.row_order()``)."""
    import numpy as np

    lib = load_library()
    rp, num_layouts, tiles_q, n = _host_row_ptr(row_ptr, num_layouts, tiles_q)
    out = np.empty(max(n, 1), np.int32)   # sizes < 1: the library reports them (INVALID_ARGUMENT)
    i32p = ctypes.POINTER(ctypes.c_int32)
    _check(lib.stof_layout_row_order(rp.ctypes.data_as(i32p), num_layouts, tiles_q, out.ctypes.data_as(i32p)))
    return out


def native_pair_order(row_ptr, num_layouts: int, tiles_q: int):
    """The C helper ``stof_layout_pair_order`` on a host ``row_ptr`` (``num_layouts*tiles_q + 1`` entries): int32
    numpy ``[num_layouts*ceil(tiles_q/2)]``, per layout its pairs of tile rows longest first
    (= ``TileLayout.pair_order()``)."""
    import numpy as np

    lib = load_library()
    rp, num_layouts, tiles_q, n = _host_row_ptr(row_ptr, num_layouts, tiles_q)
    out = np.empty(max(num_layouts * ((tiles_q + 1) // 2), 1), np.int32)  # sizes < 1: INVALID_ARGUMENT
    i32p = ctypes.POINTER(ctypes.c_int32)
    _check(lib.stof_layout_pair_order(rp.ctypes.data_as(i32p), num_layouts, tiles_q, out.ctypes.data_as(i32p)))
    return out


def native_lane_bitmaps(bitmaps, tile_m: int, tile_n: int):
    """The C helper ``stof_layout_lane_bitmaps`` on host ``bitmaps`` (``[P, tile_m*tile_n/32]`` int32, P >= 1):
    int32 numpy ``[P * tile_m*tile_n/16]`` (= ``TileLayout.lane_bitmaps()``)."""
    import numpy as np

    lib = load_library()
    tile_m, tile_n = int(tile_m), int(tile_n)
    bm = np.ascontiguousarray(bitmaps, dtype=np.int32)
    per = tile_m * tile_n // 32
    if per < 1 or bm.size % per != 0:
        raise ValueError(f"bitmaps of {bm.size} int32 are not whole {tile_m}x{tile_n} bitmaps")
    n = bm.size // per
    out = np.empty(max(n * per * 2, 1), np.int32)
    i32p = ctypes.POINTER(ctypes.c_int32)
    _check(lib.stof_layout_lane_bitmaps(bm.ctypes.data_as(i32p), n, tile_m, tile_n, out.ctypes.data_as(i32p)))
    return out


def native_sched_chunk(row_ptr, num_layouts: int, tiles_q: int) -> int:
    """The C helper ``stof_layout_sched_chunk`` on a host ``row_ptr`` (``num_layouts*tiles_q + 1`` entries): 1 when
    in every layout the longest tile row holds at most 5/4 of the mean, else 0 (= ``TileLayout.sched_chunk()``)."""
    import numpy as np

    lib = load_library()
    rp, num_layouts, tiles_q, n = _host_row_ptr(row_ptr, num_layouts, tiles_q)
    if rp.size == 0:
        rp = np.zeros(1, np.int32)        # sizes < 1: the library reports them (INVALID_ARGUMENT), reads nothing
    chunk = ctypes.c_int32(-1)
    i32p = ctypes.POINTER(ctypes.c_int32)
    _check(lib.stof_layout_sched_chunk(rp.ctypes.data_as(i32p), num_layouts, tiles_q, ctypes.byref(chunk)))
    return chunk.value


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
    ids = (ctypes.c_int32 * 64)()
    n = ctypes.c_int32()
    _check(lib.stof_attn_all_tactics(ids, 64, ctypes.byref(n)))
    return [tactic_info(ids[i]) for i in range(n.value)]


class DeviceLayout:
    """A TileLayout's four int32 arrays on the GPU (torch tensors), its derived ``row_order`` (``[L*Tq]``, tile rows
    longest first) and ``pair_order`` (``[L*ceil(Tq/2)]``, pairs of tile rows longest first; set it to None to run
    two-row kernels in their default order), both passed to the kernels unless a run says ``row_order=False``, its
    derived ``sched_chunk`` (an int, ``layout.sched_chunk()``; passed unless a run gives ``sched_chunk=N``), its
    derived ``lane_bitmaps`` (``layout.lane_bitmaps()``, C ABI 5; None with ``lane_bitmaps=False`` or a tile shape
    without them; always passed when present), its bitmaps' row count ``num_bitmaps`` (C ABI 6; always passed) plus
    its metadata."""

    def __init__(self, layout, device="cuda", lane_bitmaps: bool = True):
        import torch

        self.layout = layout
        self.tile_m, self.tile_n = int(layout.tile_m), int(layout.tile_n)
        self.seq_q, self.seq_k = int(layout.seq_q), int(layout.seq_k)
        self.num_layouts = int(layout.num_layouts)
        # torch.tensor copies: the layout's arrays may be read-only (as_tensor would warn and share them)
        def upload(a):
            return torch.tensor(a, dtype=torch.int32).contiguous().to(device)

        self.row_ptr = upload(layout.row_ptr)
        self.col_idx = upload(layout.col_idx)
        self.tile_bitmap_index = upload(layout.tile_bitmap_index)
        self.bitmaps = upload(layout.bitmaps)
        ro, po = layout.row_order(), layout.pair_order()
        self.row_order = upload(ro)
        self.pair_order = upload(po)
        # An order that is the kernels' own (last rows first: causal) is not passed: the same schedule, without one
        # dependent load before each work item (session 15: causal S=1024, tactic 24 +0.6 us with the pair order)
        self.row_order_is_default = _last_first(ro, self.num_layouts, int(layout.Tq))
        self.pair_order_is_default = _last_first(po, self.num_layouts, (int(layout.Tq) + 1) // 2)
        self.sched_chunk = int(layout.sched_chunk())
        # (C ABI 5) None for tile shapes without them, or when not asked for (the kernels then pack the bitmaps'
        # words themselves: the same result, slower)
        lb = layout.lane_bitmaps() if lane_bitmaps else None
        self.lane_bitmaps = None if lb is None else upload(lb)
        # (C ABI 6) the bitmaps' row count, passed with every run; 0 = not given (the library then bounds it by the
        # whole tile grid)
        self.num_bitmaps = int(self.bitmaps.shape[0])

    def __repr__(self) -> str:
        return f"DeviceLayout({self.layout!r})"


def _last_first(order, num_layouts: int, n: int) -> bool:
    """order ([num_layouts*n]) lists each layout's n entries last first: the kernels' order without one."""
    import numpy as np

    return bool(np.array_equal(order, np.tile(np.arange(n - 1, -1, -1, dtype=np.int32), num_layouts)))


def _as_torch(x):
    if hasattr(x, "data_ptr") and hasattr(x, "stride"):
        return x
    import torch  # cupy or anything with __cuda_array_interface__ / dlpack

    return torch.as_tensor(x, device="cuda")


def _make_params(q, k, v, o, dl: DeviceLayout, scale, key_lengths, key_padding_mask, bhsd: bool,
                 row_order: bool = True, sched_chunk: int | None = None) -> _Params:
    import torch

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
    Sk = k.shape[ax[2]]
    p = _Params()
    p.dtype, p.batch, p.num_heads, p.seq_q, p.seq_k, p.head_dim = dt, B, H, Sq, Sk, D
    p.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        st = t.stride()
        setattr(p, f"{prefix}_stride_b", st[ax[0]])
        setattr(p, f"{prefix}_stride_h", st[ax[1]])
        setattr(p, f"{prefix}_stride_s", st[ax[2]])
    p.row_ptr, p.col_idx = dl.row_ptr.data_ptr(), dl.col_idx.data_ptr()
    p.tile_bitmap_index, p.bitmaps = dl.tile_bitmap_index.data_ptr(), dl.bitmaps.data_ptr()
    p.tile_m, p.tile_n, p.num_layouts = dl.tile_m, dl.tile_n, dl.num_layouts
    p.layout_seq_q, p.layout_seq_k = dl.seq_q, dl.seq_k
    if row_order:  # both schedules (the library uses the one that fits the kernel), unless the kernels' own
        if not dl.row_order_is_default:
            p.row_order = dl.row_order.data_ptr()
        if dl.pair_order is not None and not dl.pair_order_is_default:
            p.pair_order = dl.pair_order.data_ptr()
    # independent of row_order; None = the layout's value; an explicit value goes to the library as given
    # (a negative one is its INVALID_ARGUMENT)
    p.sched_chunk = dl.sched_chunk if sched_chunk is None else int(sched_chunk)
    if dl.lane_bitmaps is not None:
        p.lane_bitmaps = dl.lane_bitmaps.data_ptr()
    p.num_bitmaps = dl.num_bitmaps
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


def _attach_workspace(lib, p: _Params, tactic: int, device, given=None):
    """Allocate the workspace the library asks for (C ABI v3; the warp-specialised tactics then run persistent)
    and point p at it, or use `given` (a CUDA tensor of at least that many bytes, 16-byte aligned; its contents
    need no initialisation); returns the tensor (keep it alive while the call runs) or None."""
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
                 sched_chunk: int | None = None) -> list[int]:
    """Tactic ids valid for this problem (library's static order)."""
    lib = load_library()
    p = _make_params(q, k, v, q, dl, None, None, None, bhsd, row_order, sched_chunk)
    ids = (ctypes.c_int32 * 64)()
    n = ctypes.c_int32()
    _check(lib.stof_attn_list_tactics(ctypes.byref(p), ids, 64, ctypes.byref(n)))
    return [ids[i] for i in range(n.value)]


def sparse_attention(q, k, v, dl: DeviceLayout, *, scale: float | None = None, tactic: int = 0,
                     key_lengths=None, key_padding_mask=None, out=None, bhsd: bool = True, stream=None,
                     row_order: bool = True, sched_chunk: int | None = None, workspace=True):
    """O = softmax(scale * Q K^T, masked by the layout and padding) V on the current (or given) CUDA stream.

    q: [B,H,Sq,D] (or [B,Sq,H,D] with bhsd=False), k/v: [B,H,Sk,D]; fp16 or bf16; D in {64, 128}.
    scale defaults to 1/sqrt(D); tactic 0 lets the library choose.  row_order=False runs without the layout's
    longest-rows-first schedule (the kernels' default order; same result).  sched_chunk: (batch, head) pairs whose
    CTAs are interleaved (C ABI v2; 0 = the library's L2-sized default, 1 = one pair at a time; same result);
    None = the layout's ``DeviceLayout.sched_chunk``.  workspace=False passes no workspace (C ABI v3: the
    warp-specialised tactics then run one CTA per work item instead of persistent; same result); a CUDA tensor
    is used as the workspace (any contents).  Returns `out` (allocated if None).
    """
    import torch

    lib = load_library()
    q, k, v = _as_torch(q), _as_torch(k), _as_torch(v)
    if out is None:
        out = torch.empty_like(q)
    p = _make_params(q, k, v, out, dl, scale, key_lengths, key_padding_mask, bhsd, row_order, sched_chunk)
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
                 sched_chunk: int | None = None, workspace: bool = True):
        import torch

        self._lib = load_library()
        self.out = torch.empty_like(q) if out is None else out
        self._keep = (q, k, v, dl, key_lengths, key_padding_mask)  # keep the memory alive
        self._p = _make_params(q, k, v, self.out, dl, scale, key_lengths, key_padding_mask, bhsd, row_order,
                               sched_chunk)
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
