#!/usr/bin/env python3
"""Check the >2 GB path end to end (not a test: it writes ~4.7 GB and takes a minute or two).

Exports a 1-layer BERT whose word-embedding table alone is 2.35 GB (one tensor over protobuf's 2 GB limit, so
torch writes it as external data), rewrites it with `stof rewrite`, and compares the outputs of the original
and the rewritten model on ONNX Runtime CPU.

    python scripts/large_model_check.py [--dir /tmp/stof-big] [--vocab 2300000]
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/stof-big")
    ap.add_argument("--vocab", type=int, default=2_300_000, help="embedding rows (x256 x4 bytes)")
    a = ap.parse_args()
    import onnxruntime as ort

    from stof_trt.export import export_bert

    os.makedirs(os.path.join(a.dir, "out"), exist_ok=True)
    src = os.path.join(a.dir, "bert_big.onnx")
    out = os.path.join(a.dir, "out", "bert_big.stof.onnx")
    t = time.time()
    export_bert(src, layers=1, hidden=256, heads=4, intermediate=512, seq_len=128, vocab_size=a.vocab)
    print(f"export: {time.time() - t:.1f} s; files: {sorted(os.listdir(a.dir))}")
    t = time.time()
    subprocess.run([sys.executable, "-m", "stof_trt.cli", "rewrite", src, "-o", out, "--max-seq-len", "128"],
                   check=True)
    print(f"rewrite: {time.time() - t:.1f} s; output files: {sorted(os.listdir(os.path.dirname(out)))}")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, a.vocab, (2, 128)).astype(np.int64),
             "attention_mask": (np.arange(128)[None] < np.array([[128], [100]])).astype(np.int64)}
    ra = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    rb = ort.InferenceSession(out, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    diff = float(np.abs(ra - rb).max())
    print(f"max |original - rewritten| = {diff:.3e} (max |original| = {np.abs(ra).max():.3f})")
    sys.exit(0 if diff < 1e-4 else 1)


if __name__ == "__main__":
    main()
