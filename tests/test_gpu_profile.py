"""stof_trt.bench.gpu_profile: kernel classes and ONNX Runtime's profile summary (CPU)."""

import json

from stof_trt.bench.gpu_profile import kernel_class, ort_node_profile


def test_kernel_classes():
    assert kernel_class("void stof::hopper_ws_attn_fwd<...>") == "attention (STOF)"
    assert kernel_class("sm90_xmma_gemm_f16f16_f16f32") == "GEMM"
    assert kernel_class("void onnxruntime::cuda::_TopKKernel<__half>") == "sort/scan"
    assert kernel_class("void onnxruntime::cuda::_ScatterNDKernel") == "transpose/copy"
    assert kernel_class("mystery") == "other"


def test_ort_node_profile_per_run_and_providers(tmp_path):
    ev = [{"name": "model_run", "cat": "Session", "dur": 900} for _ in range(2)]
    for prov, op, dur in (("CUDAExecutionProvider", "MatMul", 100), ("CPUExecutionProvider", "TopK", 300)):
        for _ in range(2):
            ev.append({"name": f"n_{op}_kernel_time", "cat": "Node", "dur": dur,
                       "args": {"op_name": op, "provider": prov}})
    f = tmp_path / "prof.json"
    f.write_text(json.dumps(ev))
    r = ort_node_profile(f)
    assert r["ort_nodes_host_ms"]["TopK"] == {"nodes": 1.0, "ms": 0.3}
    assert list(r["ort_nodes_host_ms"]) == ["TopK", "MatMul"]
    assert r["ort_ops_by_provider"] == {"CUDAExecutionProvider": ["MatMul"], "CPUExecutionProvider": ["TopK"]}
    assert "ort_profile_error" in ort_node_profile(tmp_path / "missing.json")
