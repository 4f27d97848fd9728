"""Write a Triton Inference Server model repository for a (STOF-rewritten) ONNX model, served by Triton's
onnxruntime backend: DIR/NAME/config.pbtxt and DIR/NAME/1/ with model.onnx (+ its external data), libstof_ort.so
(registered through model_operations, CUDA EP) and the tactic cache. See docs/serving.md.

examples:
  stof export-triton bert.stof.onnx --repo models --dynamic-batching --tactic-cache h100.json
  stof export-triton bert.stof.onnx --repo models --name bert --gpus 0,1 --instances 2 --server-repo /models
  stof export-triton bert.stof.onnx --repo models --cpu        # no GPU: the STOF nodes run as ONNX functions
"""

from __future__ import annotations

from .common import print_json


def add_args(p):
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--repo", required=True, metavar="DIR", help="model repository (created if missing)")
    p.add_argument("--name", help="model name (default: from the file name, e.g. bert.stof.onnx -> bert)")
    p.add_argument("--max-batch", type=int, metavar="B",
                   help="max_batch_size (default: 8 when the first dimension is dynamic everywhere, else 0)")
    p.add_argument("--instances", type=int, default=1, metavar="K", help="model instances per GPU (default 1)")
    p.add_argument("--gpus", metavar="IDS", help="GPU ids of the instance group, e.g. 0,1 (default: every GPU)")
    p.add_argument("--dynamic-batching", action="store_true", help="enable Triton's dynamic batcher")
    p.add_argument("--max-queue-delay-us", type=int, metavar="U",
                   help="the dynamic batcher's max_queue_delay_microseconds")
    p.add_argument("--tactic-cache", metavar="FILE.json", help="tactic cache from `stof tune`, shipped with the model")
    p.add_argument("--cpu", action="store_true",
                   help="KIND_CPU instances without the custom-op library: the STOF nodes run as ONNX functions")
    p.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a CUDA execution provider option for the config's cuda accelerator (repeatable)")
    p.add_argument("--server-repo", metavar="PATH",
                   help="the repository's absolute path as the server sees it, e.g. /models in a container "
                        "(default: DIR's absolute path)")
    p.add_argument("--force", action="store_true", help="replace an existing DIR/NAME")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from ..errors import StofError
    from ..triton.export import export_repository

    opts = {}
    for kv in args.cuda_option:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise StofError(f"bad --cuda-option '{kv}' (expected KEY=VALUE)")
        opts[k] = v
    if args.cpu and opts:
        raise StofError("--cuda-option does not apply to a --cpu repository")
    info = export_repository(args.model, args.repo, name=args.name, max_batch=args.max_batch,
                             instances=args.instances, gpus=args.gpus, dynamic_batching=args.dynamic_batching,
                             max_queue_delay_us=args.max_queue_delay_us, tactic_cache=args.tactic_cache,
                             cpu=args.cpu, force=args.force, server_repo=args.server_repo, cuda_options=opts)
    if args.json:
        print_json(info)
        return 0
    for n in info["notes"]:
        print(f"note: {n}")
    print(f"wrote {info['model_dir']}: {info['kind']}, max_batch_size {info['max_batch_size']}, "
          f"{info['instances']} instance(s) per {'GPU' if info['kind'] == 'KIND_GPU' else 'server'}"
          + (f" on GPUs {','.join(map(str, info['gpus']))}" if info["gpus"] else "")
          + (", dynamic batching" if info["dynamic_batching"] else ""))
    for t in info["inputs"]:
        print(f"  input  {t['name']}: {t['dtype']} {t['dims']}")
    for t in info["outputs"]:
        print(f"  output {t['name']}: {t['dtype']} {t['dims']}")
    if info["op_library"]:
        print(f"  custom ops: {info['op_library']}")
    for k, v in info["server_env"].items():
        print(f"start tritonserver with {k}={v}")
    print(f"serve: tritonserver --model-repository={info['repository']}")
    return 0
