#!/usr/bin/env python3
"""The served benchmark's models (docs/serving.md "Throughput on a GPU"): BERT-base with random weights, fp16,

* ``bert512.plain.onnx`` / ``bert512.stof.onnx``: 512 positions, padding mask; plain = ONNX Runtime's transformers
  optimizer (attention, SkipLayerNorm, BiasGelu fused), STOF = the default rewrite (padding removal);
* ``bert4096.plain.onnx`` / ``bert4096.longformer.stof.onnx``: 4096 positions; plain = the optimizer's model (dense
  attention, padding mask), STOF = the rewrite with ``--mask longformer:window=256,global=16``.

Exporting and transforming takes minutes of CPU and the weights are large, so the models travel as skeletons
(stof_trt.bench.e2e: weights stripped, rebuilt from seeded recipes) and are filled on the GPU machine:

    python3 scripts/serve_models.py --make-skeletons DIR          # CPU machine (~5 min)
    python3 scripts/serve_models.py --skeletons DIR --out MODELS   # GPU machine: writes MODELS/*.onnx
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper

from stof_trt.bench import e2e

LONGFORMER = "longformer:window=256,global=16"
BASES = {"bert512": 512, "bert4096": 4096}
# model file stem -> (base, what it is)
MODELS = {"bert512.plain": ("bert512", "ortopt"), "bert512.stof": ("bert512", "stof"),
          "bert4096.plain": ("bert4096", "ortopt"), "bert4096.longformer.stof": ("bert4096", "stof-longformer")}


def make_skeletons(dst: Path) -> None:
    from stof_trt.export import export_bert
    from stof_trt.rewrite import rewrite_model

    cfg = dict(e2e.MODELS["bert-base"])
    dst.mkdir(parents=True, exist_ok=True)
    info = {}
    with tempfile.TemporaryDirectory() as work:
        for base_name, positions in BASES.items():
            src = Path(work) / f"{base_name}.onnx"
            export_bert(str(src), layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"],
                        intermediate=cfg["intermediate"], max_positions=positions, vocab_size=cfg["vocab_size"],
                        mask_dims=2, seq_len=128)
            skel, _ = e2e.make_skeleton(onnx.load(str(src)))
            onnx.save(skel, str(dst / f"{base_name}.base.skel.onnx"))
            base, arrays = e2e.refill_base(skel)
            index = e2e.base_index(arrays)
            for stem, (b, kind) in MODELS.items():
                if b != base_name:
                    continue
                if kind == "ortopt":
                    (_, m, rep), = list(e2e._derive_ort(base, base_name, cfg, work, {"ortopt"}, print))
                elif kind == "stof":
                    m, rep = rewrite_model(base, max_seq_len=positions)
                    m, rep = e2e._fp16(m), {"remove_padding": rep.to_dict().get("remove_padding")}
                else:
                    m, rep = rewrite_model(base, max_seq_len=positions, mask=LONGFORMER)
                    m, rep = e2e._fp16(m), {"mask": LONGFORMER}
                sk, si = e2e.derive_skeleton(m, index)
                if si["unmatched"]:
                    raise SystemExit(f"{stem}: weights no recipe explains: {si['unmatched'][:5]}")
                onnx.save(sk, str(dst / f"{stem}.skel.onnx"))
                info[stem] = {"base": base_name, "kind": kind, "nodes": len(m.graph.node),
                              "fused": e2e.fused_op_counts(m), **{k: v for k, v in rep.items() if v is not None}}
                print(f"{stem}: {info[stem]}", flush=True)
    (dst / "serve_models.json").write_text(json.dumps(info, indent=1, default=str))


def cls_head(m: onnx.ModelProto) -> onnx.ModelProto:
    """The model answering with the first token's hidden state [B, hidden] (what a classifier reads) instead of
    [B, S, hidden]: served throughput then measures the model, not the transfer of a 6 MiB answer per sequence."""
    g = m.graph
    (out,) = g.output
    name = out.name
    g.initializer.append(onnx.numpy_helper.from_array(np.array(0, np.int64), "serve_cls_index"))
    g.node.append(onnx.helper.make_node("Gather", [name, "serve_cls_index"], ["cls"], axis=1, name="serve_cls"))
    elem = out.type.tensor_type.elem_type
    del g.output[:]
    g.output.append(onnx.helper.make_tensor_value_info("cls", elem, ["batch", None]))
    return m


def fill(skel: Path, out: Path, head: str = "cls") -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {b: e2e.refill_base(onnx.load(str(skel / f"{b}.base.skel.onnx")))[1] for b in BASES}
    for stem, (b, _) in MODELS.items():
        m = e2e.fill_derived(onnx.load(str(skel / f"{stem}.skel.onnx")), arrays[b])
        if head == "cls":
            m = cls_head(m)
        onnx.save(m, str(out / f"{stem}.onnx"))
        print(f"{out / stem}.onnx", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--make-skeletons", metavar="DIR", help="export and transform, write the skeletons to DIR")
    g.add_argument("--skeletons", metavar="DIR", help="skeletons written by --make-skeletons")
    ap.add_argument("--out", help="with --skeletons: where the filled models go")
    ap.add_argument("--head", choices=["cls", "none"], default="cls",
                    help="cls (default): answer with the first token's hidden state [B, hidden]; none: [B, S, hidden]")
    args = ap.parse_args()
    if args.make_skeletons:
        make_skeletons(Path(args.make_skeletons))
    else:
        if not args.out:
            ap.error("--skeletons needs --out")
        fill(Path(args.skeletons), Path(args.out), args.head)


if __name__ == "__main__":
    main()
