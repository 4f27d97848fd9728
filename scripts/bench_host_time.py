#!/usr/bin/env python3
"""Host time per call: what the STOF library and its ONNX Runtime nodes cost the CPU, against ORT's own nodes.

* the library (through ctypes, on a small causal problem: B=1, H=12, S=128, D=64): ``stof_attn_list_tactics``,
  ``stof_attn_select_on_stream`` with its memo hit (without and with first-use timing and a tactic cache) and
  ``stof_attn_run``'s launch, next to a ctypes call that does nothing and a torch launch;
* ONNX Runtime (CUDA EP, IO binding, fp16): chains of 1 and N GEMM nodes (M=64, K=N=768) as ``StofGemmEpilogue``,
  ``MatMul`` and ``MatMul`` + ``Add``; (chain N - chain 1) / (N - 1) is the host time one more node costs.

    python3 scripts/bench_host_time.py [--nodes 8] [--runs 1000] [--json OUT.json]

Every number is microseconds of wall time per call or per run, averaged after a warm-up; the GPU work is small
enough that the host sets the pace.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def chain_model(kind: str, nodes: int, m: int = 64, k: int = 768):
    """A chain of ``nodes`` GEMMs [m, k] x [k, k] (+ bias): ``stof`` (StofGemmEpilogue), ``matmul`` or
    ``matmul_add``."""
    rng = np.random.default_rng(0)
    inits, graph_nodes, x = [], [], "x"
    for i in range(nodes):
        inits.append(numpy_helper.from_array((rng.standard_normal((k, k)) * 0.02).astype(np.float16), f"w{i}"))
        inits.append(numpy_helper.from_array(np.zeros(k, np.float16), f"b{i}"))
        y = f"y{i}" if i < nodes - 1 else "y"
        if kind == "stof":
            graph_nodes.append(helper.make_node("StofGemmEpilogue", [x, f"w{i}", f"b{i}"], [y], domain="stof",
                                                activation="none"))
        elif kind == "matmul_add":
            graph_nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"{y}_mm"]))
            graph_nodes.append(helper.make_node("Add", [f"{y}_mm", f"b{i}"], [y]))
        elif kind == "matmul":
            graph_nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [y]))
        else:
            raise ValueError(kind)
        x = y
    g = helper.make_graph(graph_nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [m, k])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])
    model.ir_version = 9
    return model


def per_call_us(fn, n: int, sync) -> float:
    for _ in range(min(200, n)):
        fn()
    sync()
    t = time.perf_counter_ns()
    for _ in range(n):
        fn()
    dt = (time.perf_counter_ns() - t) / n / 1000
    sync()
    return round(dt, 2)


def library_times(runs: int) -> dict:
    import torch

    from stof_trt import kernels as K
    from stof_trt.format import compile_mask

    lib = K.load_library()
    sync = torch.cuda.synchronize
    q = torch.randn(1, 12, 128, 64, device="cuda", dtype=torch.float16)
    k, v, o = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
    dl = K.DeviceLayout(compile_mask("causal", 128, 128))
    p = K._make_params(q, k, v, o, dl, None, None, None, True)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    t, src, n = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
    ids = (ctypes.c_int32 * 64)()
    cache = tempfile.mktemp(suffix=".json").encode()
    out = {"noop_ctypes": per_call_us(lambda: lib.stof_abi_version(), runs, sync),
           "list_tactics": per_call_us(lambda: lib.stof_attn_list_tactics(ctypes.byref(p), ids, 64, ctypes.byref(n)),
                                       runs, sync),
           "select_memoised": per_call_us(lambda: lib.stof_attn_select_on_stream(
               ctypes.byref(p), None, None, 0, stream, ctypes.byref(t), ctypes.byref(src)), runs, sync),
           "select_memoised_timing_cache": per_call_us(lambda: lib.stof_attn_select_on_stream(
               ctypes.byref(p), cache, None, K.SELECT_TIME, stream, ctypes.byref(t), ctypes.byref(src)), runs, sync)}
    ws = K._attach_workspace(lib, p, t.value, q.device)  # noqa: F841 -- alive while the launches run
    out["tactic"] = K.tactic_info(t.value).name
    out["run_launch"] = per_call_us(lambda: lib.stof_attn_run(ctypes.byref(p), t.value, stream), runs, sync)
    out["torch_add_launch"] = per_call_us(lambda: torch.add(q, k, out=o), runs, sync)
    return out


def ort_times(nodes: int, runs: int) -> dict:
    import onnxruntime as ort

    from stof_trt.ort import library_path

    def per_run(kind: str, n: int) -> float:
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(library_path()))
        s = ort.InferenceSession(chain_model(kind, n).SerializeToString(), so, providers=["CUDAExecutionProvider"])
        x = ort.OrtValue.ortvalue_from_numpy(np.ones((64, 768), np.float16), "cuda", 0)
        io = s.io_binding()
        io.bind_ortvalue_input("x", x)
        io.bind_output("y", "cuda")
        return per_call_us(lambda: s.run_with_iobinding(io), runs, lambda: None)

    out = {}
    for kind in ("stof", "matmul", "matmul_add"):
        one, many = per_run(kind, 1), per_run(kind, nodes)
        out[kind] = {"chain_1_us": one, f"chain_{nodes}_us": many,
                     "per_added_node_us": round((many - one) / ((nodes - 1) * (2 if kind == "matmul_add" else 1)),
                                                2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--nodes", type=int, default=8, help="length of the long chains (default 8)")
    ap.add_argument("--runs", type=int, default=1000, help="timed calls per number (default 1000)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if args.nodes < 2 or args.runs < 1:
        ap.error("--nodes must be >= 2 and --runs >= 1")
    res = {"library": library_times(args.runs), "ort": ort_times(args.nodes, args.runs)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
