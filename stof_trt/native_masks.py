"""The host layer's mask-spec compiler through ctypes (``stof_mask_check``, ``stof_mask_compile``; libstof_host or
libstof_kernels): the compiler a StofSparseAttention node's ``layout_spec`` is built with at run time. Python code
compiles with ``stof_trt.format.compile_mask``; this binding is for the tests that hold the two equal and for
tools that want the plugin's own answer."""

from __future__ import annotations

import ctypes

import numpy as np

from .errors import MaskSpecError, StofError
from .format import TileLayout

__all__ = ["native_library", "check_spec", "compile_spec", "STATUS_UNSUPPORTED"]

STATUS_INVALID_ARGUMENT, STATUS_UNSUPPORTED = 1, 2


class _LayoutDesc(ctypes.Structure):
    _fields_ = [("row_ptr", ctypes.c_void_p), ("row_ptr_len", ctypes.c_int64),
                ("col_idx", ctypes.c_void_p), ("col_idx_len", ctypes.c_int64),
                ("tile_bitmap_index", ctypes.c_void_p), ("tile_bitmap_index_len", ctypes.c_int64),
                ("bitmaps", ctypes.c_void_p), ("bitmaps_len", ctypes.c_int64),
                ("tile_m", ctypes.c_int32), ("tile_n", ctypes.c_int32), ("num_layouts", ctypes.c_int32),
                ("seq_q", ctypes.c_int32), ("seq_k", ctypes.c_int32), ("format_version", ctypes.c_int32)]


_LIB: ctypes.CDLL | None = None


def native_library() -> ctypes.CDLL:
    """libstof_host ($STOF_HOST_LIB, the package's lib/ or a build tree), else libstof_kernels, with the
    mask-spec entry points; RuntimeError when neither is built."""
    global _LIB
    if _LIB is not None:
        return _LIB
    from ._libs import load_native

    lib = load_native((("libstof_host.so", "STOF_HOST_LIB"), ("libstof_kernels.so", "STOF_KERNELS_LIB")),
                      "stof_mask_compile", "the mask-spec compiler", "build with cmake and set STOF_HOST_LIB")
    lib.stof_mask_check.argtypes, lib.stof_mask_check.restype = [ctypes.c_char_p], ctypes.c_int
    lib.stof_mask_compile.argtypes = [ctypes.c_char_p] + [ctypes.c_int32] * 5 + [
        ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]
    lib.stof_mask_compile.restype = ctypes.c_int
    lib.stof_mask_layout_desc.argtypes = [ctypes.c_void_p, ctypes.POINTER(_LayoutDesc)]
    lib.stof_mask_layout_desc.restype = ctypes.c_int
    lib.stof_mask_layout_destroy.argtypes, lib.stof_mask_layout_destroy.restype = [ctypes.c_void_p], None
    lib.stof_last_error_message.argtypes, lib.stof_last_error_message.restype = [], ctypes.c_char_p
    _LIB = lib
    return lib


def _error(lib, status: int) -> StofError:
    msg = lib.stof_last_error_message().decode(errors="replace")
    err = MaskSpecError(msg) if status in (STATUS_INVALID_ARGUMENT, STATUS_UNSUPPORTED) else StofError(msg)
    err.status = status
    return err


def check_spec(spec: str) -> tuple[int, str]:
    """(status, message) of ``stof_mask_check``: 0 when the plugin builds ``spec`` for any length."""
    lib = native_library()
    st = lib.stof_mask_check(spec.encode())
    return st, ("" if st == 0 else lib.stof_last_error_message().decode(errors="replace"))


def compile_spec(spec: str, seq_q: int, seq_k: int | None = None, *, tile_m: int = 64, tile_n: int = 64,
                 num_layouts: int = 1, max_tiles: int = 0) -> TileLayout:
    """The layout ``stof_mask_compile`` builds (a MaskSpecError with its one-line message and ``.status`` when it
    refuses)."""
    lib = native_library()
    seq_k = seq_q if seq_k is None else seq_k
    handle = ctypes.c_void_p()
    st = lib.stof_mask_compile(spec.encode(), seq_q, seq_k, tile_m, tile_n, num_layouts, max_tiles,
                               ctypes.byref(handle))
    if st != 0:
        raise _error(lib, st)
    try:
        d = _LayoutDesc()
        st = lib.stof_mask_layout_desc(handle, ctypes.byref(d))
        if st != 0:
            raise _error(lib, st)

        def arr(ptr, n):
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int32)), (n,)).copy()

        words = d.tile_m * d.tile_n // 32
        return TileLayout.from_arrays(
            seq_q=d.seq_q, seq_k=d.seq_k, tile_m=d.tile_m, tile_n=d.tile_n, num_layouts=d.num_layouts,
            row_ptr=arr(d.row_ptr, d.row_ptr_len), col_idx=arr(d.col_idx, d.col_idx_len),
            tile_bitmap_index=arr(d.tile_bitmap_index, d.tile_bitmap_index_len),
            bitmaps=arr(d.bitmaps, d.bitmaps_len).reshape(-1, words), mask_spec=spec)
    finally:
        lib.stof_mask_layout_destroy(handle)
