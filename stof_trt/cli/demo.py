"""End-to-end demo on the CPU (no GPU needed): export a small BERT from a transformers config (random weights,
nothing downloaded) twice with the same weights — once with a 3-D attention-mask input, once with the standard
2-D padding mask — rewrite the 2-D export with a static Longformer mask, then run on ONNX Runtime CPU:

  original (3-D input fed the dense Longformer mask AND the padding)   vs   rewritten (static Longformer layout
  + run-time padding mask, through the STOF nodes' ONNX-function fallback)

and print the rewrite summary and the max difference. Exit status 1 if they differ beyond fp32 tolerance.

example:
  stof demo --seq-len 256 --mask longformer:window=32,global=8
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from ..errors import StofError


def add_args(p):
    p.add_argument("--seq-len", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--mask", default="longformer:window=32,global=8", metavar="SPEC",
                   help="static mask to rewrite with (default longformer:window=32,global=8)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--work-dir", metavar="DIR", help="keep the exported and rewritten models here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    try:
        import onnxruntime as ort

        from ..export import export_bert
    except ImportError as e:
        raise StofError(f"the demo needs torch, transformers and onnxruntime ({e}); "
                        "pip install 'stof-trt[export,ort]'") from None
    from ..cli.common import load_model, print_json, save_model
    from ..cli.rewrite import print_report
    from ..masks import parse_mask
    from ..rewrite import rewrite_model

    mask = parse_mask(args.mask)
    B, S = args.batch, args.seq_len
    if args.seq_len < 2 or args.batch < 1:
        raise StofError("--seq-len must be >= 2 and --batch >= 1")
    work = args.work_dir or tempfile.mkdtemp(prefix="stof-demo-")
    os.makedirs(work, exist_ok=True)
    orig3 = os.path.join(work, "bert_mask3d.onnx")
    orig2 = os.path.join(work, "bert.onnx")
    rewritten = os.path.join(work, "bert.stof.onnx")
    common = dict(layers=args.layers, hidden=256, heads=4, intermediate=1024, seq_len=args.seq_len, max_positions=max(512, args.seq_len), seed=args.seed)
    if not args.json:
        print(f"exporting a {args.layers}-layer BERT (random weights) to {work} ...", flush=True)
    export_bert(orig3, mask_dims=3, **common)
    export_bert(orig2, mask_dims=2, **common)

    t0 = time.perf_counter()
    model, report = rewrite_model(load_model(orig2), mask=mask, max_seq_len=S)
    save_model(model, rewritten)
    t_rewrite = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(S // 2, S + 1, size=B)
    lengths[0] = S
    pad2 = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)      # [B, S]
    static = mask.dense(S, S)
    pad3 = (static[None] & pad2[:, None, :].astype(bool)).astype(np.int64)  # [B, S, S]

    def feeds(sess, attention_mask):
        out = {}
        for i in sess.get_inputs():
            if i.name == "input_ids":
                out[i.name] = rng_ids
            elif i.name == "attention_mask":
                out[i.name] = attention_mask
            elif i.name == "token_type_ids":
                out[i.name] = np.zeros((B, S), np.int64)
            else:
                raise StofError(f"demo does not know how to feed input '{i.name}'")
        return out

    rng_ids = rng.integers(0, 1000, size=(B, S)).astype(np.int64)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s3 = ort.InferenceSession(orig3, so, providers=["CPUExecutionProvider"])
    sr = ort.InferenceSession(rewritten, so, providers=["CPUExecutionProvider"])
    ref = s3.run(None, feeds(s3, pad3))[0]
    got = sr.run(None, feeds(sr, pad2))[0]
    diff = float(np.max(np.abs(ref.astype(np.float64) - got)))
    scale = float(np.max(np.abs(ref)))
    ok = bool(np.isfinite(got).all() and diff <= 1e-4 * max(1.0, scale))
    info = report.to_dict()
    info.update(work_dir=work, mask=str(mask), seq_len=S, batch=B, lengths=lengths.tolist(),
                max_abs_diff=diff, max_abs_ref=scale, match=ok)
    if args.json:
        print_json(info)
    else:
        info.update(input=orig2, output=rewritten, seconds=round(t_rewrite, 3))
        print_report(info)
        print(f"\nONNX Runtime CPU, batch {B}, seq {S}, key lengths {lengths.tolist()}, mask {mask}")
        print(f"max |original - rewritten| = {diff:.3e}  (max |original| = {scale:.3f})  ->  "
              f"{'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1
