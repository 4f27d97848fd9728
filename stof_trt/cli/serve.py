"""Serve a (STOF-rewritten) ONNX model with NVIDIA Triton Inference Server through PyTriton: HTTP and gRPC
endpoints (KServe v2 protocol), dynamic batching, an ONNX Runtime session behind it (CUDA EP + libstof_ort.so on a
GPU; the STOF nodes' model-local ONNX functions on the CPU). Ctrl-C / SIGTERM stop it cleanly.

PyTriton runs under a Python with `nvidia-pytriton`, `onnxruntime`, numpy<2 and a shared libpython: --python,
$STOF_SERVE_PYTHON, ~/.cache/stof-trt/serve-venv/bin/python, or this interpreter (docs/serving.md).

examples:
  stof serve bert.stof.onnx --port 8000 --max-batch 8
  stof serve bert.stof.onnx --tactic-cache h100.json --instances 2
  STOF_SERVE_PYTHON=/opt/serve-venv/bin/python stof serve bert.stof.onnx --provider cpu
"""

from __future__ import annotations

from .common import int_in


def add_args(p):
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--port", type=int, default=8000, metavar="P", help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, metavar="P", help="gRPC port (default HTTP port + 1)")
    p.add_argument("--metrics-port", type=int, metavar="P", help="metrics port (default HTTP port + 2)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--name", help="model name (default: from the file name)")
    p.add_argument("--max-batch", type=int, default=8, metavar="B",
                   help="max_batch_size; requests are batched dynamically (default 8; 0: no batching)")
    p.add_argument("--max-queue-delay-us", type=int, default=100, metavar="U",
                   help="the dynamic batcher's queue delay in microseconds (default 100)")
    p.add_argument("--instances", type=int, default=1, metavar="K", help="model instances (default 1)")
    p.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA EP + libstof_ort when both are available, else CPU")
    p.add_argument("--device", type=int_in(0, 1023), help="CUDA device id (default 0)")
    p.add_argument("--tactic-cache", metavar="FILE.json", help="tactic cache from `stof tune`")
    p.add_argument("--python", metavar="PYTHON", help="the interpreter that runs PyTriton")
    p.add_argument("--ready-timeout", type=float, default=300, metavar="S",
                   help="seconds to wait for the server to come up (default 300)")


def run(args) -> int:
    from ..errors import StofError
    from ..triton.serve import serve

    if args.provider == "cpu" and args.device is not None:
        raise StofError("--device applies to the CUDA provider only, not --provider cpu")
    return serve(args.model, port=args.port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                 host=args.host, name=args.name, max_batch=args.max_batch,
                 max_queue_delay_us=args.max_queue_delay_us, instances=args.instances, provider=args.provider,
                 device=args.device or 0, tactic_cache=args.tactic_cache, python=args.python,
                 ready_timeout=args.ready_timeout)
