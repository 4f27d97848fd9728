"""End-to-end demo on the CPU (no GPU needed): export a small BERT from a transformers config (random weights,
nothing downloaded) twice with the same weights — once with a 3-D attention-mask input, once with the standard
2-D padding mask — rewrite the 2-D export with a static Longformer mask, then run on ONNX Runtime CPU:

  original (3-D input fed the dense Longformer mask AND the padding)   vs   rewritten (static Longformer layout
  + run-time padding mask, through the STOF nodes' ONNX-function fallback)

and print the rewrite summary and the max difference over the real tokens. Padded query rows are not compared: a
padded query whose whole window is padding attends to nothing, which the STOF nodes define as zeros and the original
softmax as a uniform average (docs/rewrite.md); no real token reads them. Exit status 1 if the real tokens differ
beyond fp32 tolerance. The exported models live in a temporary directory removed at the end (--work-dir keeps them).

example:
  stof demo --seq-len 256 --mask longformer:window=32,global=8
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from ..errors import StofError
from .common import OnceMask, int_in


def add_args(p):
    p.add_argument("--seq-len", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=2,
                   help="batch size; sequence 0 is full length, the others padded to random lengths (default 2)")
    p.add_argument("--mask", action=OnceMask, default="longformer:window=32,global=8", metavar="SPEC",
                   help="static mask to rewrite with (default longformer:window=32,global=8)")
    p.add_argument("--layers", type=int, default=2, help="encoder layers of the exported BERT (default 2)")
    p.add_argument("--work-dir", metavar="DIR", help="keep the exported and rewritten models here")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed of the weights, token ids and lengths (default 0)")
    p.add_argument("--json", action="store_true", help="print the report and the comparison as JSON")


def run(args) -> int:
    try:
        import onnxruntime as ort

        from ..export import export_bert
    except ImportError as e:
        raise StofError(f"the demo needs torch, transformers and onnxruntime ({e}); "
                        "pip install 'stof-trt[export,ort]'") from None
    from ..cli.common import make_output_dir
    from ..masks import parse_mask

    mask = parse_mask(args.mask)
    if not 2 <= args.seq_len <= 4096 or not 1 <= args.batch <= 64 or not 1 <= args.layers <= 24:
        raise StofError("the demo takes --seq-len in [2, 4096], --batch in [1, 64] and --layers in [1, 24]")
    mask.check_size(args.seq_len, args.seq_len)
    if args.work_dir:
        make_output_dir(args.work_dir, "--work-dir")
        return _run(args, mask, args.work_dir, ort, export_bert)
    with tempfile.TemporaryDirectory(prefix="stof-demo-") as work:
        return _run(args, mask, work, ort, export_bert, keep=False)


def _run(args, mask, work, ort, export_bert, keep=True) -> int:
    from ..cli.common import load_model, print_json, save_model
    from ..cli.rewrite import print_report
    from ..rewrite import rewrite_model

    B, S = args.batch, args.seq_len
    orig3 = os.path.join(work, "bert_mask3d.onnx")
    orig2 = os.path.join(work, "bert.onnx")
    rewritten = os.path.join(work, "bert.stof.onnx")
    common = dict(layers=args.layers, hidden=256, heads=4, intermediate=1024, seq_len=args.seq_len, max_positions=max(512, args.seq_len), seed=args.seed)
    if not args.json:
        where = work if keep else "a temporary directory"
        print(f"exporting a {args.layers}-layer BERT (random weights) to {where} ...", flush=True)
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
    # Real tokens only: a padded query row is defined differently (zeros vs a uniform average) and unused.
    real = pad2.astype(bool)
    ref_r, got_r = ref[real].astype(np.float64), got[real]
    diff = float(np.max(np.abs(ref_r - got_r)))
    scale = float(np.max(np.abs(ref_r)))
    ok = bool(np.isfinite(got_r).all() and diff <= 1e-4 * max(1.0, scale))
    info = report.to_dict()
    info.update(work_dir=work if keep else None, mask=str(mask), seq_len=S, batch=B, lengths=lengths.tolist(),
                compared="real tokens (padded query rows excluded)", max_abs_diff=diff, max_abs_ref=scale, match=ok)
    if args.json:
        print_json(info)
    else:
        info.update(input=orig2, output=rewritten, seconds=round(t_rewrite, 3))
        print_report(info, wrote=keep)
        print(f"\nONNX Runtime CPU, batch {B}, seq {S}, key lengths {lengths.tolist()}, mask {mask}")
        print(f"max |original - rewritten| over the {int(real.sum())} real tokens = {diff:.3e}  "
              f"(max |original| = {scale:.3f})  ->  {'MATCH' if ok else 'MISMATCH'}")
        print("(padded query rows are not compared: STOF gives zeros where the original averages padding)")
    return 0 if ok else 1
