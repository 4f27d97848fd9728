"""The process behind `stof serve`: an ONNX Runtime session bound to a Triton server started through PyTriton.

Standalone on purpose (numpy, onnxruntime and pytriton only, no stof_trt import): it runs under whichever
interpreter has a working PyTriton (docs/serving.md), which need not have this package installed. Prints one
``stof-serve-ready {json}`` line on stdout once the endpoints accept requests; SIGINT/SIGTERM stop the server
cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32",
              "tensor(uint64)": "uint64", "tensor(bool)": "bool"}


def _session(args):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if args.provider == "cpu":  # no custom-op library: the CPU EP runs the STOF nodes' model-local functions
        return ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001 - best effort; the session below reports what is really missing
            pass
    if args.tactic_cache:
        so.add_session_config_entry("stof.tactic_cache", args.tactic_cache)
    if args.library:
        so.register_custom_ops_library(args.library)
    sess = ort.InferenceSession(args.model, so, providers=[("CUDAExecutionProvider", {"device_id": str(args.device)}),
                                                           "CPUExecutionProvider"])
    if "CUDAExecutionProvider" not in sess.get_providers():
        raise RuntimeError(f"the CUDA execution provider did not load (session providers: {sess.get_providers()})")
    return sess


def _specs(values, batched: bool):
    import numpy as np

    from pytriton.model_config import Tensor

    out = []
    for v in values:
        if v.type not in _ORT_TYPES:
            raise RuntimeError(f"{v.name}: type {v.type} is not served")
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in v.shape]
        out.append(Tensor(name=v.name, dtype=np.dtype(_ORT_TYPES[v.type]).type,
                          shape=tuple(dims[1:] if batched else dims)))
    return out


def make_infer(sess, batched: bool):
    """Requests the dynamic batcher hands over together are grouped by their per-request shapes (a batch of
    different sequence lengths cannot be one tensor), each group runs as one ORT call, results split back."""
    import numpy as np

    names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]

    def run(feeds):
        try:
            return sess.run(None, feeds)
        except Exception as e:  # noqa: BLE001 - ORT's own types; the client gets the first line
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"onnxruntime rejected the request: {msg}") from None

    def infer(requests):
        results = [None] * len(requests)
        groups: dict = {}
        for idx, req in enumerate(requests):
            key = tuple((n, req[n].shape[1:] if batched else req[n].shape, req[n].dtype.str) for n in names)
            groups.setdefault(key, []).append(idx)
        for idxs in groups.values():
            if not batched:  # no batch dimension to concatenate along: one run per request
                for i in idxs:
                    results[i] = dict(zip(out_names, run({n: requests[i][n] for n in names})))
                continue
            outs = run({n: np.concatenate([requests[i][n] for i in idxs], axis=0) for n in names})
            start = 0
            for i in idxs:
                b = requests[i][names[0]].shape[0]
                results[i] = {n: o[start:start + b] for n, o in zip(out_names, outs)}
                start += b
        return results

    return infer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="stof serve worker (see `stof serve --help`)")
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue-delay-us", type=int, default=0)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--library")
    p.add_argument("--tactic-cache")
    p.add_argument("--server-log", help="tritonserver writes its log here (stof serve reads it when the start fails)")
    args = p.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    sess = _session(args)
    batched = args.max_batch > 0
    firsts = [v.shape[0] if v.shape else 1 for v in list(sess.get_inputs()) + list(sess.get_outputs())]
    if batched and any(isinstance(d, int) for d in firsts):
        print("stof serve: the model's first dimension is fixed on some input/output: use --max-batch 0",
              file=sys.stderr)
        return 2
    config = TritonConfig(http_address=args.host, http_port=args.http_port, grpc_address=args.host,
                          grpc_port=args.grpc_port, metrics_address=args.host, metrics_port=args.metrics_port,
                          exit_timeout_secs=5, log_file=args.server_log)
    batcher = DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us) if batched else None
    model_config = ModelConfig(batching=batched, max_batch_size=max(args.max_batch, 0), batcher=batcher)
    with Triton(config=config) as triton:
        triton.bind(model_name=args.name, infer_func=[make_infer(sess, batched) for _ in range(args.instances)],
                    inputs=_specs(sess.get_inputs(), batched), outputs=_specs(sess.get_outputs(), batched),
                    config=model_config, strict=True)
        triton.run()
        info = {"model": args.name, "http": f"{args.host}:{args.http_port}", "grpc": f"{args.host}:{args.grpc_port}",
                "metrics": f"{args.host}:{args.metrics_port}", "provider": args.provider,
                "max_batch_size": args.max_batch, "instances": args.instances}
        print("stof-serve-ready " + json.dumps(info), flush=True)
        while not stop.wait(0.5):
            if not triton.is_alive():
                print("stof serve: the Triton server stopped unexpectedly", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
