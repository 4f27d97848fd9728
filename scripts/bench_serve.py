#!/usr/bin/env python3
"""Served throughput and latency: each model behind `stof serve` (Triton through PyTriton, dynamic batching),
loaded by concurrent gRPC clients for a fixed time; sequences/s and p50/p99 request latency per model.

    python3 scripts/bench_serve.py MODEL.onnx [MODEL.onnx ...] --shape 1x4096 [--padding 0.25] [--concurrency 16]
        [--duration 30] [--warmup 5] [--max-batch 8] [--instances 1] [--tactic-cache F] [--out results.json]

Every model gets the same requests (B x S token ids in [0, --vocab), a right-padded attention_mask whose row lengths
are uniform in [S(1-2R), S] for --padding R, token_type_ids zeros when the model has them), and each server runs
alone. The load client runs under the serving interpreter (it has tritonclient): this file is both the driver and,
with --client, the client.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def client(args) -> None:
    import numpy as np
    import tritonclient.grpc as g

    b, s = (int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    meta = g.InferenceServerClient(args.url).get_model_metadata(args.model, as_json=True)
    lo = max(1, int(round(s * (1 - 2 * args.padding))))
    feeds = []
    for _ in range(16):  # a few distinct requests, cycled
        lengths = rng.integers(lo, s + 1, b)
        mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
        f = {}
        for i in meta["inputs"]:
            if i["name"] == "input_ids":
                f[i["name"]] = rng.integers(0, args.vocab, (b, s)).astype(np.int64)
            elif i["name"] == "attention_mask":
                f[i["name"]] = mask
            elif i["name"] == "token_type_ids":
                f[i["name"]] = np.zeros((b, s), np.int64)
            else:
                raise SystemExit(f"input {i['name']}: this benchmark feeds input_ids/attention_mask/token_type_ids")
            if i["datatype"] != "INT64":
                f[i["name"]] = f[i["name"]].astype({"INT32": np.int32, "FP16": np.float16, "FP32": np.float32}
                                                   [i["datatype"]])
        feeds.append(f)
    types = {i["name"]: i["datatype"] for i in meta["inputs"]}
    lat, stop, start_at = [], threading.Event(), time.monotonic() + args.warmup
    lock = threading.Lock()

    errors = []

    def worker(k):
        try:
            run_requests(k)
        except Exception as e:  # noqa: BLE001 - reported once the load stops
            errors.append(f"{type(e).__name__}: {e}")
            stop.set()

    def run_requests(k):
        c = g.InferenceServerClient(args.url)
        n = k
        while not stop.is_set():
            inputs = []
            for name, arr in feeds[n % len(feeds)].items():
                x = g.InferInput(name, list(arr.shape), types[name])
                x.set_data_from_numpy(arr)
                inputs.append(x)
            t0 = time.monotonic()
            c.infer(args.model, inputs)
            t1 = time.monotonic()
            if t0 >= start_at:
                with lock:
                    lat.append(t1 - t0)
            n += 1
        c.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    stop.wait(args.warmup + args.duration)
    stop.set()
    for t in threads:
        t.join()
    if errors or not lat:
        raise SystemExit(f"load failed: {errors[0] if errors else 'no request finished after the warm-up'}")
    lat_ms = np.sort(np.array(lat) * 1e3)
    print(json.dumps({"requests": len(lat_ms), "sequences_per_s": len(lat_ms) * b / args.duration,
                      "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
                      "mean_ms": float(lat_ms.mean())}))


def drive(args) -> None:
    from stof_trt.triton.serve import find_python

    py, info = find_python(args.python)
    results = []
    for k, model in enumerate(args.models):
        name = f"m{k}"
        port = args.port
        cmd = [sys.executable, "-m", "stof_trt.cli", "serve", model, "--port", str(port), "--name", name,
               "--max-batch", str(args.max_batch), "--max-queue-delay-us", str(args.max_queue_delay_us),
               "--instances", str(args.instances), "--python", py]
        if args.tactic_cache and ".stof" in Path(model).name:
            cmd += ["--tactic-cache", args.tactic_cache]
        log = open(Path(args.log_dir) / f"serve_{k}.log", "w")
        srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = threading.Event()

        def drain(p=srv, ev=ready):
            for line in p.stdout:
                log.write(line)
                if line.startswith("stof serve: ") and " ready on " in line:
                    ev.set()

        pump = threading.Thread(target=drain, daemon=True)
        pump.start()
        deadline = time.monotonic() + 600
        while not ready.wait(1) and srv.poll() is None and time.monotonic() < deadline:
            pass
        if not ready.is_set():
            srv.kill()
            raise SystemExit(f"{model}: server not ready (log: {log.name})")
        try:
            c = subprocess.run([py, os.path.abspath(__file__), "--client", "--url", f"127.0.0.1:{port + 1}",
                                "--model", name, "--shape", args.shape, "--padding", str(args.padding),
                                "--concurrency", str(args.concurrency), "--duration", str(args.duration),
                                "--warmup", str(args.warmup), "--vocab", str(args.vocab)],
                               capture_output=True, text=True)
            if c.returncode != 0:
                raise SystemExit(f"{model}: client failed: {c.stderr.strip()[-1000:]}")
            r = json.loads(c.stdout.strip().splitlines()[-1])
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(timeout=120)
            pump.join(timeout=10)
            log.close()
        r.update(model=model, shape=args.shape, padding=args.padding, concurrency=args.concurrency,
                 max_batch=args.max_batch, instances=args.instances, pytriton=info["pytriton"],
                 onnxruntime=info["onnxruntime"])
        results.append(r)
        print(f"{Path(model).name:40s} {r['sequences_per_s']:10.1f} seq/s  p50 {r['p50_ms']:8.2f} ms  "
              f"p99 {r['p99_ms']:8.2f} ms  ({r['requests']} requests)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--shape", default="1x512", help="BxS of each request")
    ap.add_argument("--padding", type=float, default=0.0, help="mean padded fraction R (<= 0.5)")
    ap.add_argument("--vocab", type=int, default=1000, help="token ids in [0, VOCAB)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue-delay-us", type=int, default=100)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--tactic-cache", help="for the STOF models (file names containing .stof)")
    ap.add_argument("--python", help="serving interpreter (default: as `stof serve` finds it)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--out")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 0 <= args.padding <= 0.5:
        raise SystemExit("--padding must be in [0, 0.5]")
    if args.client:
        client(args)
    else:
        if not args.models:
            raise SystemExit("give at least one model")
        drive(args)


if __name__ == "__main__":
    main()
