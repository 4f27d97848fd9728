"""The anchors STOF's times are judged against, beside PyTorch's SDPA and FlexAttention:

* the roofline floor: max(q, k, v read and o written at the device's copy bandwidth, the allowed tiles' FLOPs at
  its fp16 matmul rate), both rates measured on the same GPU in the same run (docs/performance.md, "Method");
* SDPA with each backend forced (cuDNN, flash), for the causal cells, where PyTorch's default dispatch hides
  which kernel it ran;
* FlashAttention-4 (flash-attn-4, CuTe DSL) natively for causal and sliding, and FlexAttention with its Triton
  and FLASH (FA4) backends on the same BlockMask for every mask (:func:`anchors_for` says which anchor computes
  which mask);
* cuDNN's own banded attention for the sliding cells (:class:`CudnnBand`): SDPA can pass cuDNN a boolean mask
  or is_causal, never a band, so none of the other anchors is a kernel made for that mask.  It needs
  nvidia-cudnn-frontend (a PyPI wheel); :func:`try_band_anchor` says why it is missing instead of raising.

Every function that touches the GPU imports torch (and cudnn) itself: the module imports without them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .stats import rel_err

__all__ = ["COPY_ELEMS", "MATMUL_N", "floor_methods", "copy_bandwidth", "matmul_rate", "roofline_floor_ms",
           "attention_bytes", "tile_flops", "sdpa_backend_methods", "CudnnBand", "band_reference64", "band_anchor",
           "try_band_anchor", "ANCHOR_NAMES", "ANCHORS_ALL_MASKS", "ANCHORS_NATIVE", "FLEX_KERNEL_OPTIONS",
           "AnchorUnavailable", "anchors_for", "fa4_kwargs", "to_bshd", "fa4_method", "flex_kwargs", "flex_method"]

# The floor's ingredients: a 512 MiB device copy (1 GiB of traffic) and an 8192^3 fp16 matmul, large enough to run
# at the device's sustained rates rather than its launch overhead.
COPY_ELEMS, MATMUL_N = 256 * 1024 * 1024, 8192


def floor_methods() -> dict:
    """{"copy": fn, "matmul": fn} over buffers of their own, for stats.time_round and roofline_floor_ms."""
    import torch

    x = torch.randn(COPY_ELEMS, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    return {"copy": lambda: y.copy_(x), "matmul": lambda: a @ b}


def copy_bandwidth(ms: float) -> float:
    """Bytes per second of floor_methods' copy (read + write) that took ms."""
    return 2 * COPY_ELEMS * 2 / (ms * 1e-3)


def matmul_rate(ms: float) -> float:
    """FLOP per second of floor_methods' matmul that took ms."""
    return 2 * MATMUL_N**3 / (ms * 1e-3)


def roofline_floor_ms(rd: dict, nbytes: float, tile_flops: float) -> float:
    """The floor from the copy and matmul times in rd (ms): max(nbytes at the copy's bandwidth, tile_flops at the
    matmul's rate), in ms."""
    return max(nbytes / copy_bandwidth(rd["copy"]), tile_flops / matmul_rate(rd["matmul"])) * 1e3


def attention_bytes(batch: int, heads: int, seq: int, head_dim: int, elem_bytes: int = 2) -> int:
    """The floor's memory traffic: q, k, v read and o written once ([B, H, S, D] each, S_q = S_k)."""
    return 4 * batch * heads * seq * head_dim * elem_bytes


def tile_flops(layout, batch: int, heads: int, head_dim: int) -> float:
    """The floor's FLOPs: both MMAs (Q K^T and P V) over every allowed tile of a layout all heads share, masked
    elements too."""
    return 4.0 * batch * heads * head_dim * layout.nnz * layout.tile_m * layout.tile_n


def sdpa_backend_methods(q, k, v, ref, is_causal: bool = False, where: str = "", tol: float = 2e-3) -> dict:
    """{"sdpa_cudnn": fn, "sdpa_flash": fn}: SDPA with each backend forced, for those that accept (q, k, v) and match
    ref within fp16's tolerance; a backend that refuses the problem is left out with a note on stderr."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        try:
            o = fn()
            if o.is_cuda:
                torch.cuda.synchronize()
        except RuntimeError as e:  # the backend refuses this problem: not an anchor here
            print(f"{Path(sys.argv[0]).stem}: {name} unavailable{where}: {str(e)[:120]}", file=sys.stderr)
            continue
        if rel_err(o, ref) < tol:
            out[name] = fn
        else:
            print(f"{Path(sys.argv[0]).stem}: {name} differs from the reference{where}: left out", file=sys.stderr)
    return out


class CudnnBand:
    """cuDNN SDPA with keys j allowed for query i when i - left < j <= i + right (left = right + 1 for
    |i - j| <= right under the "exclusive left bound" convention; band_anchor finds which one holds)."""

    _UIDS = [1, 2, 3, 4]  # q, k, v, o

    def __init__(self, q, k, v, left: int, right: int, scale: float | None = None):
        import cudnn
        import torch

        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[q.dtype]
        self.q, self.k, self.v = q, k, v
        self.out = torch.empty_like(q)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        g = cudnn.pygraph(handle=self.handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
        ts = [g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=io, uid=u)
              for n, t, u in zip("qkv", (q, k, v), self._UIDS)]
        o, _ = g.sdpa(name="band", q=ts[0], k=ts[1], v=ts[2], generate_stats=False,
                      attn_scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                      diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                      diagonal_band_left_bound=left, diagonal_band_right_bound=right)
        o.set_uid(self._UIDS[3]).set_output(True).set_dim(list(self.out.shape)).set_stride(
            list(self.out.stride())).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.left, self.right = left, right
        self.index = None  # None: the graph's selected plan (execute); else the plan run by execute_plan_at_index
        self.plan = "heuristics' first"
        self.plan_ms: dict[str, float] = {}
        self._size_workspace()

    def _size_workspace(self):
        import torch

        n = (self.graph.get_workspace_size() if self.index is None
             else self.graph.get_workspace_size_plan_at_index(self.index))
        self.workspace = torch.empty(max(n, 1), device=self.q.device, dtype=torch.uint8)

    def __call__(self):
        pack = [self.q, self.k, self.v, self.out]
        if self.index is None:
            self.graph.execute(pack, self.workspace, handle=self.handle, tensor_uids=self._UIDS)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, index=self.index, handle=self.handle,
                                             tensor_uids=self._UIDS)
        return self.out

    def __del__(self):
        try:
            import cudnn

            cudnn.destroy_handle(self.handle)
        except Exception:  # noqa: BLE001 -- at interpreter exit the module may be gone
            pass

    def autotune(self, iters: int = 20) -> None:
        """Time every plan cuDNN offers for the graph (heuristics A + fallback, all built) and run the fastest from
        then on, by its index, so the anchor is cuDNN at its best rather than its heuristics' first guess.  Plans
        that fail to build or run are skipped.  If the list cannot be walked, the graph's selected plan stays (which
        building all plans may have changed: the workspace is sized again and self.plan says so).  The caller checks
        the output again (band_anchor)."""
        import cudnn
        import torch

        g = self.graph
        try:
            g.build_plans(cudnn.build_plan_policy.ALL)
            n = g.get_execution_plan_count()
        except Exception as e:  # noqa: BLE001 -- cudnn's own exception types
            self.plan = f"the graph's selected plan (plan list unavailable: {str(e).splitlines()[0][:120]})"
            self._size_workspace()
            return
        best = None
        for i in range(n):
            try:
                name = g.get_plan_name_at_index(i)
                ws = torch.empty(max(g.get_workspace_size_plan_at_index(i), 1), device=self.q.device,
                                 dtype=torch.uint8)

                def run(i=i, ws=ws):
                    g.execute_plan_at_index([self.q, self.k, self.v, self.out], ws, index=i, handle=self.handle,
                                            tensor_uids=self._UIDS)

                for _ in range(3):
                    run()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    run()
                end.record()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 -- a plan that cannot build or run here is not a candidate
                continue
            ms = start.elapsed_time(end) / iters
            self.plan_ms[f"{i}:{name}"] = ms
            if best is None or ms < best[0]:
                best = (ms, i, name)
        if best is None:
            self.plan = "the graph's selected plan (no plan of the list ran)"
        else:
            self.index, self.plan = best[1], f"{best[1]}:{best[2]}"
        self._size_workspace()


def band_reference64(q, k, v, window: int, b: int = 0, h: int = 0):
    """float64 attention of one (batch, head) under |i - j| <= window, scale 1/sqrt(D)."""
    import torch

    q64, k64, v64 = (t[b, h].double() for t in (q, k, v))
    s = q64 @ k64.T / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)
    s.masked_fill_((i[:, None] - i[None, :]).abs() > window, float("-inf"))
    return torch.softmax(s, -1) @ v64


def band_anchor(q, k, v, window: int, ref, tol: float = 2e-3, autotune: bool = True):
    """A CudnnBand for |i - j| <= window whose output (poisoned first) is within tol of ref and, on the first and
    the last (batch, head), of a float64 reference; the left bound's convention (window or window + 1) is the one
    that matches.  With autotune, every cuDNN plan of the matching graph is timed, the fastest kept and the output
    checked again.  Raises RuntimeError: the wheel is not installed, cuDNN fails to build the graph for both
    conventions (its error is named), or no output matches."""
    import torch

    try:
        import cudnn  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- absent, or present without a cuDNN library it can load
        raise RuntimeError(f"nvidia-cudnn-frontend is not usable here ({type(e).__name__}: {e})") from None
    B, H = q.shape[0], q.shape[1]
    refs64 = {(b, h): band_reference64(q, k, v, window, b, h) for b, h in {(0, 0), (B - 1, H - 1)}}

    def check(bd):
        bd.out.fill_(float("nan"))
        bd()
        torch.cuda.synchronize()
        errs = [rel_err(bd.out, ref)] + [rel_err(bd.out[b, h], r64) for (b, h), r64 in refs64.items()]
        return max(errs) < tol, errs  # NaN fails

    notes = {}
    for left in (window + 1, window):
        try:
            bd = CudnnBand(q, k, v, left=left, right=window)
        except Exception as e:  # noqa: BLE001 -- cudnn raises its own exception types
            notes[left] = f"cuDNN error {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        ok, errs = check(bd)
        if not ok:
            notes[left] = "rel err " + ", ".join(f"{e:.2e}" for e in errs) + " (vs ref, then float64 heads)"
            continue
        if autotune:
            bd.autotune()
            ok, errs = check(bd)
            if not ok:
                raise RuntimeError(f"cuDNN band plan {bd.plan} differs after tuning: rel err {errs}")
        bd.rel_err, bd.rel_err64 = errs[0], max(errs[1:])
        return bd
    raise RuntimeError(f"no cuDNN band matches |q-k| <= {window}: "
                       + "; ".join(f"left={left}: {m}" for left, m in notes.items()))


def try_band_anchor(q, k, v, window: int, ref, tol: float = 2e-3):
    """band_anchor or (None, why): the benchmarks leave the anchor out where it cannot be had, and say why."""
    try:
        return band_anchor(q, k, v, window, ref, tol=tol), ""
    except RuntimeError as e:
        return None, str(e)[:300]


# --- the 2026 frontier: FlashAttention-4 (CuTe DSL) natively and as FlexAttention's FLASH backend --------------

# Which anchors compute which benchmark mask ("fastest anchor" is taken over these only).  Every mask has the
# FlexAttention backends and SDPA with the boolean mask; causal and sliding have their native kernels too.
ANCHORS_ALL_MASKS = ("flex", "flex_fa4", "sdpa_mask")
ANCHORS_NATIVE = {"causal": ("fa4", "sdpa_causal", "sdpa_cudnn", "sdpa_flash"), "sliding": ("fa4", "cudnn_band")}
ANCHOR_NAMES = ("fa4", "flex_fa4", "flex", "sdpa_causal", "sdpa_cudnn", "sdpa_flash", "sdpa_mask", "cudnn_band")

# FlexAttention's kernel_options per backend: Triton is its default; FLASH runs FA4's CuTe DSL kernel with the
# mask_mod and BlockMask compiled in
FLEX_KERNEL_OPTIONS = {"flex": None, "flex_fa4": {"BACKEND": "FLASH"}}


class AnchorUnavailable(RuntimeError):
    """An anchor that cannot run here (package missing, mask without a native form): the benchmark records why."""


def anchors_for(mask_name: str) -> tuple[str, ...]:
    """The anchors that compute benchmark mask `mask_name`, in ANCHOR_NAMES order."""
    want = set(ANCHORS_ALL_MASKS) | set(ANCHORS_NATIVE.get(mask_name, ()))
    return tuple(n for n in ANCHOR_NAMES if n in want)


def fa4_kwargs(mask_name: str, mask) -> dict:
    """Keyword arguments of flash_attn.cute.flash_attn_func that mean benchmark mask `mask_name` (parsed spec
    `mask`): causal=True, or window_size=(left, right) for a sliding window -- FA4 keeps key j for query i when
    i - left <= j <= i + right, the convention of stof_trt.masks.Sliding.  Raises AnchorUnavailable for a mask FA4
    has no native form of."""
    if mask_name == "causal":
        return {"causal": True}
    if mask_name == "sliding":
        return {"window_size": (int(mask.left), int(mask.right))}
    raise AnchorUnavailable(f"FA4 has no native form of {mask_name} (FlexAttention's FLASH backend runs it)")


def to_bshd(t):
    """A contiguous [B, S, H, D] copy of a [B, H, S, D] tensor: FA4's layout, made once outside the timed region."""
    return t.transpose(1, 2).contiguous()


def fa4_method(q, k, v, mask_name: str, mask):
    """(fn, out_bhsd): fn() runs FA4 natively for the mask on [B, S, H, D] copies of q, k, v and returns its
    output; out_bhsd(o) views that output as [B, H, S, D] for the reference check.  Raises AnchorUnavailable
    without the flash-attn-4 package or a native form."""
    kw = fa4_kwargs(mask_name, mask)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 -- absent, or present without its CuTe DSL runtime
        raise AnchorUnavailable(f"flash-attn-4 is not usable here ({type(e).__name__}: {str(e)[:160]})") from None
    qt, kt, vt = to_bshd(q), to_bshd(k), to_bshd(v)

    def fn():
        r = flash_attn_func(qt, kt, vt, **kw)
        return r[0] if isinstance(r, tuple) else r  # (out, lse)

    return fn, lambda o: o.transpose(1, 2)


def flex_kwargs(name: str, block_mask) -> dict:
    """Keyword arguments of flex_attention for FlexAttention anchor `name` ("flex": the Triton backend, its
    default; "flex_fa4": kernel_options BACKEND=FLASH) with `block_mask`, the same BlockMask for both."""
    if name not in FLEX_KERNEL_OPTIONS:
        raise KeyError(f"no FlexAttention anchor named {name!r}: one of {', '.join(FLEX_KERNEL_OPTIONS)}")
    kw = {"block_mask": block_mask}
    if FLEX_KERNEL_OPTIONS[name]:
        kw["kernel_options"] = dict(FLEX_KERNEL_OPTIONS[name])
    return kw


def flex_method(flex, q, k, v, name: str, block_mask):
    """fn() running the compiled flex_attention `flex` as anchor `name` on q, k, v ([B, H, S, D])."""
    kw = flex_kwargs(name, block_mask)
    return lambda: flex(q, k, v, **kw)
