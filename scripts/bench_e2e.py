#!/usr/bin/env python3
"""End-to-end benchmark (issue 39): whole models on ONNX Runtime's CUDA EP, fp16, IO binding -- the unoptimised
model, ONNX Runtime's fastest configurations and the STOF rewrite -- on the same inputs, outputs compared.

Grid (stof_trt/bench/e2e.py): BERT-base, BERT-large, RoBERTa-base (padding mask), GPT-2 (causal + padding), ViT-base
(no mask; image sides 176/256/368 -> 122/257/530 tokens for S = 128/256/512); B in {1, 8, 32}, S in {128, 256,
512}; padding "U[0.25S,S]", "U[0.75S,S]" (key lengths uniform in that range, row 0 full, seeded by the case) and
"none" (full-length batches).  Variants:
  original      the export converted to fp16 (onnxruntime.transformers.float16), CUDA EP
  ortopt        onnxruntime.transformers.optimizer (model_type bert / gpt2 / vit, opt_level 0 and the session's own
                optimisations) + fp16; the export is first put in the graph form its attention fusion matches
                (identity Casts bypassed, the score scale a Div): same function
  ortopt-graph  the same replayed through CUDA graphs (one graph per case: run option gpu_graph_id)
  ortpacking    convert_to_packing_mode of the ortopt model (RemovePadding / PackedAttention / RestorePadding);
                BERT and RoBERTa
  stof          the STOF rewrite (stof_trt.rewrite.rewrite_model, defaults) + fp16 with libstof_ort
  stof-graph    the rewrite with a token capacity input (--token-capacity-input: the real tokens packed into
                token_capacity(T) slots, a fixed shape) through CUDA graphs, one graph per case
  stof-padded-graph  the rewrite with padding removal off (--no-remove-padding), through CUDA graphs; models
                with a padding mask
Each variant has one session per model, reused across B, S and padding (dynamic axes); a case times its variants in
interleaved rounds (shuffled order each round) after warm-up, the host clock around run_with_iobinding (ORT
synchronises its stream at the end of a run), as many rounds as --case-budget allows within [--min-iters,
--iters].  STOF outputs are compared with the original's at real tokens.

Skeletons: the models are exported and transformed on the CPU machine (its torch/transformers give graphs ORT's
optimizer fuses, and the transformations cost minutes of CPU time); they travel without weights and the GPU machine
refills them (stof_trt/bench/e2e.py says how the variants keep one set of weights):

    python3 scripts/bench_e2e.py --make-skeletons DIR [--models ...]        # CPU machine, once (~10 min)
    python3 scripts/bench_e2e.py --make-skeletons DIR --variants stof       # remake the rewrite's models only
    python3 scripts/bench_e2e.py --skeletons DIR --out OUT [--models bert-base,gpt2] [--batches 1,8]
        [--seqs 128,512] [--paddings "U[0.25S,S],none"] [--variants ...] [--time-limit 500]
    python3 scripts/bench_e2e.py --merge OUT1 OUT2 --out OUT                # one result of two calls
    python3 scripts/bench_e2e.py --make-skeletons DIR --tiny; ... --skeletons DIR --cpu   # CPU smoke test

Writes OUT/e2e.json (one object per case: model, mask, B, S, padding, variants {name: {median_ms, p90_ms}},
fused_ops {ORT variant: operator counts}, max_diff_real_tokens {STOF variant: max |diff|}), OUT/e2e.meta.json
(environment, per model: fused operators, the rewrite's patterns and whether it removes padding, errors) and
OUT/e2e.md (table, target lines, summary); with --profile, OUT/e2e.meta.json's `profiles` holds every case's GPU
kernel time per variant, by kernel class (where the time goes).  Cases already in OUT/e2e.json are kept and skipped (--no-resume to redo
them), so a second call completes the grid; --time-limit stops before a case that would not fit and writes what it
has.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stof_trt.bench import e2e  # noqa: E402

T0 = time.time()


def log(*a):
    print(time.strftime("%H:%M:%S"), f"[{time.time() - T0:6.1f} s]", *a, flush=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# skeletons (CPU machine)
# ---------------------------------------------------------------------------------------------------------------
def make_skeletons(dst: Path, work: Path, models: list[str], seqs: list[int], tiny: bool, variants) -> None:
    """Export, transform and strip; with a subset of variants (e.g. stof after a rewrite change) only those model
    files are remade and the manifest keeps the others."""
    import onnx
    import torch
    import transformers

    dst.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    manifest_path = dst / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    exported_with = f"torch {torch.__version__}, transformers {transformers.__version__}"
    for name in models:
        for key in e2e.model_keys(name, seqs):
            t0 = time.time()
            src = work / f"{key}.onnx"
            e2e.export_model(key, str(src), tiny=tiny)
            skel, n = e2e.make_skeleton(onnx.load(str(src)))
            onnx.save(skel, str(dst / f"{key}.base.skel.onnx"))
            base, arrays = e2e.refill_base(skel)
            index = e2e.base_index(arrays)
            del arrays
            want = {e2e.VARIANT_MODEL[v] for v in variants}
            entry = manifest.get(key, {}) if want != set(e2e.VARIANT_MODEL.values()) else {}
            entry.update({"model": name, "exported_with": exported_with, "tiny": tiny})
            entry.setdefault("variants", {})
            for v, m, info in e2e.derive_models(base, name, str(work), tiny=tiny, log=log, want=want):
                entry.update(info)
                if m is None:
                    continue
                sk, si = e2e.derive_skeleton(m, index)
                onnx.save(sk, str(dst / f"{key}.{v}.skel.onnx"))
                entry["variants"][v] = {"fused_ops": e2e.fused_op_counts(m) if v.startswith("ort") else None,
                                        "unmatched": si["unmatched"]}
                if si["unmatched"]:
                    log(f"{key} {v}: {len(si['unmatched'])} tensors no recipe explains (refilled at random): "
                        f"{si['unmatched'][:4]}")
                del m, sk
                gc.collect()
            manifest[key] = entry
            _atomic_write(manifest_path, json.dumps(manifest, indent=1))
            size = sum(p.stat().st_size for p in dst.glob(f"{key}.*.skel.onnx"))
            log(f"{key}: {len(entry['variants'])} models, skeletons {size / 1e6:.2f} MB ({time.time() - t0:.0f} s)")
            del base, index
            gc.collect()
    total = sum(p.stat().st_size for p in dst.glob("*.skel.onnx"))
    log(f"skeletons in {dst}: {total / 1e6:.2f} MB")


def load_models(skel: Path, key: str, variants: set[str]) -> dict:
    """{model variant: ModelProto} refilled from DIR/<key>.*.skel.onnx."""
    import onnx

    _, arrays = e2e.refill_base(onnx.load(str(skel / f"{key}.base.skel.onnx")))
    out = {}
    for v in sorted({e2e.VARIANT_MODEL[x] for x in variants}):
        p = skel / f"{key}.{v}.skel.onnx"
        if p.exists():
            out[v] = e2e.fill_derived(onnx.load(str(p)), arrays)
    return out


# ---------------------------------------------------------------------------------------------------------------
# sessions and timing (GPU machine)
# ---------------------------------------------------------------------------------------------------------------
class Run:
    """One variant bound to one case: inputs copied to the device once, outputs preallocated; a -graph variant runs
    with its own gpu_graph_id (a CUDA graph per case in one session), or -1 (no capture) for its first run."""

    def __init__(self, sess, feeds: dict, graph_id: int | None):
        import onnxruntime as ort

        from stof_trt import ort as sort

        self.b = sort.Binding(sess, feeds)
        self.sess = sess
        self.ro = None
        if graph_id is not None:
            self.plain = ort.RunOptions()
            self.plain.add_run_config_entry("gpu_graph_id", "-1")
            self.ro = ort.RunOptions()
            self.ro.add_run_config_entry("gpu_graph_id", str(graph_id))
            self._run(self.plain)  # first run at this shape without capture (STOF's first-use timing runs here)

    def _run(self, ro):
        b = self.b
        if b._outputs is None:
            for name in b._output_names:
                b.binding.bind_output(name, b.device, b.device_id)
            self.sess.run_with_iobinding(b.binding, ro)
            b._outputs = b.binding.get_outputs()
            for name, v in zip(b._output_names, b._outputs):
                b.binding.bind_ortvalue_output(name, v)
        else:
            self.sess.run_with_iobinding(b.binding, ro)

    def run(self) -> float:
        t0 = time.perf_counter()
        self._run(self.ro)
        return (time.perf_counter() - t0) * 1e3

    def output(self) -> np.ndarray:
        return self.b.outputs()[0]


def make_session(model, variant: str, cpu: bool, tactic_cache: Path | None):
    from stof_trt import ort as sort

    stof = variant.startswith("stof")
    return sort.session(model, providers="cpu" if cpu else None, register=stof and not cpu,
                        cuda_graphs=variant.endswith("-graph") and not cpu,
                        tactic_cache=tactic_cache if stof and not cpu else None)


def _cast_feeds(sess, feeds: dict) -> dict:
    types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}
    # (a token capacity input is not a case feed: Binding sizes it from the padding mask)
    return {i.name: feeds[i.name].astype(types.get(i.type, feeds[i.name].dtype)) for i in sess.get_inputs()
            if i.name in feeds}


def bench_case(case: dict, sessions: dict, args, graph_id: int, errors: dict) -> tuple[dict, dict]:
    """Time every variant of one case; (stats per variant, output per variant)."""
    from stof_trt import ort as sort

    feeds, lengths = e2e.case_feeds(case)
    runs, est = {}, {}
    for v, sess in sessions.items():
        if v in errors:  # failed in an earlier case of this model (no capture, ...): not retried
            continue
        try:
            r = Run(sess, _cast_feeds(sess, feeds), graph_id if v.endswith("-graph") else None)
            for _ in range(args.warmup):
                r.run()
            est[v] = min(r.run() for _ in range(2))
            runs[v] = r
        except Exception as e:  # noqa: BLE001 - one variant failing (out of memory, no capture) leaves the others
            msg = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
            errors.setdefault(v, msg)
            log(f"  {v}: FAILED {msg}")
    if not runs:
        return {}, {}
    iters = int(max(args.min_iters, min(args.iters, args.case_budget * 1e3 / max(sum(est.values()), 1e-3))))
    times = {v: [] for v in runs}
    for rd in range(iters):
        order = list(runs)
        random.Random(rd).shuffle(order)
        for v in order:
            try:
                times[v].append(runs[v].run())
            except Exception as e:  # noqa: BLE001 - drop the variant, keep the case
                errors.setdefault(v, str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__)
                log(f"  {v}: FAILED while timed: {errors[v]}")
                del runs[v], times[v]
    stats = {v: sort.latency_stats(t) for v, t in times.items()}
    if args.profile:  # after the timed rounds, so the profiler's overhead does not enter the times
        from stof_trt.bench.gpu_profile import cuda_kernel_profile

        for v in runs:
            prof = cuda_kernel_profile(runs[v].run, runs=5, top=8)
            stats[v]["profile"] = prof
    outs = {v: runs[v].output() for v in runs}
    del runs
    return stats, outs


def run_grid(args, cases: list[dict], variants: list[str], out: Path, done: list[dict], meta: dict) -> list[dict]:
    skel = Path(args.skeletons)
    manifest = json.loads((skel / "manifest.json").read_text())
    records = list(done)
    todo_keys = []
    for c in cases:
        if c["key"] not in todo_keys:
            todo_keys.append(c["key"])
    tactic_cache = out / "tactic_cache.json"
    case_s_per_token: list[float] = []
    gid = 0
    for key in todo_keys:
        kcases = [c for c in cases if c["key"] == key]
        if key not in manifest:
            meta["notes"].append(f"{key}: no skeleton in {skel} (run --make-skeletons there)")
            continue
        elapsed = time.time() - T0
        if args.time_limit and elapsed + args.model_setup_s > args.time_limit:
            meta["stopped"] = f"time limit before {key} ({elapsed:.0f} s elapsed)"
            log(meta["stopped"])
            break
        name = manifest[key]["model"]
        vs = [v for v in variants if v in e2e.variants_for(name) and not (args.cpu and v.endswith("-graph"))]
        t0 = time.time()
        models = load_models(skel, key, set(vs))
        mm = meta["models"].setdefault(key, {})
        mm.update(exported_with=manifest[key].get("exported_with"), rewrite=manifest[key].get("rewrite"),
                  stof=e2e.stof_meta(models["stof"]) if "stof" in models else None,
                  canonicalized=manifest[key].get("canonicalized"),
                  unmatched={v: x["unmatched"] for v, x in manifest[key]["variants"].items() if x["unmatched"]},
                  fused_ops={v: e2e.fused_op_counts(models[e2e.VARIANT_MODEL[v]]) for v in vs
                             if v.startswith("ort") and e2e.VARIANT_MODEL[v] in models},
                  errors={})
        for v, counts in mm["fused_ops"].items():
            if not e2e.attention_fused(counts):
                log(f"{key} {v}: ORT fused no attention ({counts}): reported UNFUSED, not a target baseline")
        sessions = {}
        for v in vs:
            mv = e2e.VARIANT_MODEL[v]
            if mv not in models:
                mm["errors"][v] = "no model (see the manifest's notes)"
                continue
            try:
                sessions[v] = make_session(models[mv], v, args.cpu, tactic_cache)
            except Exception as e:  # noqa: BLE001 - e.g. a CUDA graph session over CPU nodes
                mm["errors"][v] = str(e).strip().splitlines()[0][:240]
                log(f"{key} {v}: no session: {mm['errors'][v]}")
        del models
        gc.collect()
        mm["setup_s"] = round(time.time() - t0, 1)
        log(f"{key}: {len(sessions)} sessions in {mm['setup_s']} s")
        for c in kcases:
            tokens = c["B"] * c["S"]
            # the most efficient recent case per token (the largest), plus a fixed part for warm-up and capture
            guess = 0.5 + tokens * (min(case_s_per_token) if case_s_per_token else 2e-4)
            if args.time_limit and time.time() - T0 + guess > args.time_limit:
                meta["stopped"] = f"time limit before {key} B={c['B']} S={c['S']} {c['padding']}"
                log(meta["stopped"])
                break
            gid += 1
            tc = time.time()
            stats, outs = bench_case(c, sessions, args, gid, mm["errors"])
            if not stats:
                continue
            profiles = {v: st.pop("profile") for v, st in stats.items() if "profile" in st}
            if profiles:  # per variant: GPU kernel time per run, per kernel class, the top kernels (e2e.meta.json)
                meta.setdefault("profiles", {})[f"{c['model']}|{c['B']}|{c['S']}|{c['padding']}"] = profiles
            _, lengths = e2e.case_feeds(c)
            every = {v: e2e.real_token_max_diff(outs["original"], outs[v], lengths)
                     for v in outs if v != "original" and "original" in outs}
            diffs = {v: d for v, d in every.items() if v.startswith("stof")}
            # ORT's variants too (meta only): a large difference there means the baseline computes another function
            meta.setdefault("ort_max_diff_real_tokens", {})[f"{c['model']}|{c['B']}|{c['S']}|{c['padding']}"] = {
                v: d for v, d in every.items() if v.startswith("ort")}
            ref = float(np.abs(outs["original"].astype(np.float32)).max()) if "original" in outs else None
            rec = e2e.case_record(c, stats, {v: mm["fused_ops"][v] for v in stats if v in mm["fused_ops"]}, diffs)
            records = e2e.merge_records(records, [rec])
            meta.setdefault("max_abs_original", {})[f"{c['model']}|{c['B']}|{c['S']}|{c['padding']}"] = ref
            dt = time.time() - tc
            case_s_per_token = (case_s_per_token + [dt / tokens])[-4:]
            log(f"{c['model']} B={c['B']} S={c['S']} {c['padding']}: "
                + ", ".join(f"{v} {s['median_ms']:.3f}" for v, s in stats.items())
                + (f"; max diff {', '.join(f'{v} {d:.1e}' for v, d in diffs.items())}" if diffs else "")
                + f" ({dt:.1f} s)")
            write_outputs(out, records, meta, args.cmd)
        else:
            del sessions
            gc.collect()
            continue
        break
    return records


def write_outputs(out: Path, records: list[dict], meta: dict, cmd: str) -> None:
    order = {m: i for i, m in enumerate(e2e.MODELS)}
    pads = {p: i for i, p in enumerate(e2e.PADDINGS)}
    records = sorted(records, key=lambda r: (order.get(r["model"], 99), r["S"], pads.get(r["padding"], 9), r["B"]))
    _atomic_write(out / "e2e.json", json.dumps(records, indent=1))
    meta["elapsed_s"] = round(time.time() - T0, 1)
    _atomic_write(out / "e2e.meta.json", json.dumps(meta, indent=1))
    _atomic_write(out / "e2e.md", e2e.report_md(records, meta, cmd))


def _commit() -> str:
    """The checkout's commit (the GPU machine's copy of the tree may have no git metadata: "?")."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def _list(s: str, conv=str) -> list:
    return [conv(x) for x in s.split(",") if x.strip()] if s else []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--skeletons", help="DIR written by --make-skeletons")
    ap.add_argument("--make-skeletons", metavar="DIR", help="export and transform here, write DIR, then stop")
    ap.add_argument("--work", default="/tmp/stof-e2e", help="scratch folder of --make-skeletons")
    ap.add_argument("--models", default=",".join(e2e.MODELS))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seqs", default="128,256,512")
    ap.add_argument("--paddings", default=",".join(e2e.PADDINGS),
                    help='comma-separated of "U[0.25S,S]", "U[0.75S,S]", "none"')
    ap.add_argument("--variants", default=",".join(e2e.VARIANTS))
    ap.add_argument("--iters", type=int, default=30, help="most timed rounds per case")
    ap.add_argument("--min-iters", type=int, default=5, help="fewest timed rounds per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--case-budget", type=float, default=0.6,
                    help="seconds of timed rounds per case (the rounds are fitted to it)")
    ap.add_argument("--time-limit", type=float, default=0, help="stop before what would not fit (s; 0 = none)")
    ap.add_argument("--model-setup-s", type=float, default=20, help="time kept for a model's sessions (s)")
    ap.add_argument("--no-resume", action="store_true", help="redo the cases OUT/e2e.json already has")
    ap.add_argument("--profile", action="store_true",
                    help="after each case's timed rounds: every variant's GPU kernel time per run by kernel class and "
                         "its top kernels (CUPTI through torch.profiler), in e2e.meta.json's `profiles`")
    ap.add_argument("--cpu", action="store_true", help="CPU EP (a smoke test; no CUDA graphs or packing mode)")
    ap.add_argument("--tiny", action="store_true", help="--make-skeletons: 2-layer 128-wide models")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="merge the e2e.json/e2e.meta.json of these OUT folders "
                    "(calls on machines that did not keep the first's files) into --out, then stop")
    args = ap.parse_args(argv)
    args.models = _list(args.models)
    args.batches = _list(args.batches, int)
    args.seqs = _list(args.seqs, int)
    # the padding names hold commas: split on the commas between names
    args.paddings = [p for p in e2e.PADDINGS if p in args.paddings] if args.paddings else []
    args.variants = _list(args.variants)
    bad = [v for v in args.variants if v not in e2e.VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad} (known: {', '.join(e2e.VARIANTS)})")
    if not args.paddings:
        ap.error('--paddings: none of "U[0.25S,S]", "U[0.75S,S]", "none"')
    try:
        args.cases = e2e.grid(args.models, args.batches, args.seqs, args.paddings)
    except ValueError as e:
        ap.error(str(e))
    args.cmd = "python3 scripts/bench_e2e.py " + " ".join(f"'{a}'" if "[" in a else a for a in (argv or sys.argv[1:]))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        records, meta = [], {"models": {}, "notes": [], "commands": []}
        for d in map(Path, args.merge):
            if not (d / "e2e.json").is_file():
                print(f"bench_e2e: {d / 'e2e.json'} not found", file=sys.stderr)
                return 2
            records = e2e.merge_records(records, json.loads((d / "e2e.json").read_text()))
            m = json.loads((d / "e2e.meta.json").read_text()) if (d / "e2e.meta.json").is_file() else {}
            for k, v in m.items():
                if k == "models":
                    meta["models"].update(v)
                elif k in ("notes", "commands"):
                    meta[k] += v
                elif k == "max_abs_original":
                    meta.setdefault(k, {}).update(v)
                else:
                    meta[k] = v
        write_outputs(out, records, meta, " && ".join(meta["commands"]) or args.cmd)
        print(f"merged {len(records)} cases into {out / 'e2e.json'}")
        return 0
    if args.make_skeletons:
        make_skeletons(Path(args.make_skeletons), Path(args.work), args.models, args.seqs, args.tiny, args.variants)
        return 0
    if not args.skeletons:
        print("bench_e2e: give --skeletons DIR (written by --make-skeletons on the CPU machine)", file=sys.stderr)
        return 2
    if not (Path(args.skeletons) / "manifest.json").exists():
        print(f"bench_e2e: {args.skeletons}/manifest.json not found (run --make-skeletons)", file=sys.stderr)
        return 2
    import onnxruntime as ort

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    if (out / "e2e.json").exists() and not args.no_resume:
        done = json.loads((out / "e2e.json").read_text())
    have = {e2e.record_key(r) for r in done}
    cases = [c for c in args.cases if (c["model"], c["B"], c["S"], c["padding"]) not in have]
    meta = json.loads((out / "e2e.meta.json").read_text()) if (out / "e2e.meta.json").exists() and done else {}
    meta.setdefault("models", {})
    meta["notes"] = []
    meta["environment"] = {"onnxruntime": ort.__version__, "providers": "CPU" if args.cpu else "CUDA EP",
                           "numpy": np.__version__, "commit": _commit()}
    meta.setdefault("commands", []).append(args.cmd)
    meta.pop("stopped", None)
    log(f"{len(cases)} cases to run ({len(args.cases) - len(cases)} already in {out / 'e2e.json'})")
    records = run_grid(args, cases, args.variants, out, done, meta)
    write_outputs(out, records, meta, args.cmd)
    print((out / "e2e.md").read_text())
    log(f"done: {len(records)} cases in {out / 'e2e.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
