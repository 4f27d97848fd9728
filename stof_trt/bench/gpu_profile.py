"""Where a run's GPU time goes: CUPTI kernel records (torch.profiler, which sees every kernel of the process,
ONNX Runtime's and libstof's alike), grouped by kernel class, plus ONNX Runtime's own node profile.

torch is imported inside the functions: the module imports without it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["KERNEL_CLASSES", "kernel_class", "cuda_kernel_profile", "ort_node_profile"]

#: kernel name -> class (first match wins)
KERNEL_CLASSES = [
    ("LayerNorm", ("addLayerNorm",)),
    ("GELU/bias/elementwise", ("geluErf",)),
    ("attention (STOF)", ("stof", "sparse_attention", "SparseAttention", "hopper_attn", "rowwise", "blockwise")),
    ("attention (ORT)", ("fmha", "flash", "Fmha", "cutlass::fmha", "attention", "Attention", "softmax", "Softmax",
                         "Longformer", "longformer")),
    ("GEMM", ("gemm", "Gemm", "cutlass", "xmma", "cublas", "sm90_", "nvjet", "Kernel2")),
    ("LayerNorm", ("LayerNorm", "layer_norm", "layerNorm", "SkipLayerNorm", "LayerNormalization")),
    ("transpose/copy", ("Transpose", "transpose", "Copy", "copy", "Split", "Concat", "Gather", "Slice", "Scatter",
                        "Expand")),
    ("sort/scan", ("TopK", "topk", "Sort", "sort", "radix", "Radix", "CumSum", "cumsum", "Scan", "scan")),
    ("GELU/bias/elementwise", ("Gelu", "gelu", "Elementwise", "elementwise", "BinaryElementWise", "Unary",
                               "_Add", "Add", "Mul", "Cast", "Where", "bias", "Bias")),
]


def kernel_class(name: str) -> str:
    for cls, keys in KERNEL_CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def cuda_kernel_profile(run, runs: int = 10, top: int = 30) -> dict:
    """Run ``run()`` ``runs`` times under CUPTI: GPU kernel time per run (ms), per class and the top kernels;
    ``{"cupti_error": ...}`` when the profiler is unavailable. Call after warm-up."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                run()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a missing profiler is reported, not raised
        return {"cupti_error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}
    kernels: dict = {}
    api: dict = {}  # CUDA runtime / driver calls (CUPTI records them as host events): where the host waits
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif e.name.startswith("cu"):
            a = api.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.cpu_time_total
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    classes: dict = {}
    for name, (n, us) in ranked:
        c = classes.setdefault(kernel_class(name), [0, 0.0])
        c[0] += n / runs
        c[1] += us / runs / 1e3
    return {
        "runs": runs,
        "gpu_kernel_ms_per_run": round(sum(v[1] for _, v in ranked) / runs / 1e3, 4),
        "classes_ms": {k: {"launches": round(v[0], 1), "ms": round(v[1], 4)}
                       for k, v in sorted(classes.items(), key=lambda kv: -kv[1][1])},
        "top_kernels": [{"name": name[:160], "class": kernel_class(name), "launches": n / runs,
                         "ms": round(us / runs / 1e3, 4)} for name, (n, us) in ranked[:top]],
        "cuda_api_host_ms": {name: {"calls": round(n / runs, 1), "ms": round(us / runs / 1e3, 4)}
                             for name, (n, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:12]},
    }


def ort_node_profile(profile_file: str | Path) -> dict:
    """ONNX Runtime's profile (SessionOptions.enable_profiling; ``sess.end_profiling()`` returns the file): host
    time per op type per run (for the CUDA EP these are launch times) and which execution provider ran each op
    type (a CPU node inside a CUDA model costs copies and a synchronisation)."""
    try:
        ev = json.loads(Path(profile_file).read_text())
    except (OSError, ValueError) as e:
        return {"ort_profile_error": str(e)[:200]}
    n_runs = max(sum(1 for e in ev if e.get("name") == "model_run"), 1)
    per_op: dict = {}
    eps: dict = {}
    for e in ev:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            a = e.get("args", {})
            op = a.get("op_name", "?")
            per_op.setdefault(op, [0, 0.0])
            per_op[op][0] += 1
            per_op[op][1] += e.get("dur", 0)
            eps.setdefault(a.get("provider", "?"), set()).add(op)
    return {
        "ort_nodes_host_ms": {op: {"nodes": round(n / n_runs, 1), "ms": round(us / n_runs / 1e3, 4)}
                              for op, (n, us) in sorted(per_op.items(), key=lambda kv: -kv[1][1])},
        "ort_ops_by_provider": {k: sorted(v) for k, v in eps.items()},
    }
