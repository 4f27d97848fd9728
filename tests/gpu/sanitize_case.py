"""One small case per kernel family for compute-sanitizer (memcheck / racecheck), run as a script with stof_trt
importable (installed, or PYTHONPATH=$PWD from the repository root); Python puts this file's folder, and so
_gpu_helpers, on the path itself:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python tests/gpu/sanitize_case.py

(no caching allocator: every tensor is its own cudaMalloc, so out-of-bounds accesses are visible).  Covers
tails (S=200/333 not multiples of 64), partial and full tiles, Sq != Sk, key_lengths and key_padding_mask, both
dtypes and head dims, every valid tactic of a 128x64 layout (all block shapes) and a 32x32 one (row-wise), and
the warp-specialised tactics without key_lengths (TMA producer), persistent and one CTA per item, the two-row
tactics on 64x64 layouts of an even and an odd number of tile rows with the layout's pair order and without it, and
the persistent tactics over a grid of four waves with sched_chunk 1 (all but the last wave of items handed out
statically), packed sequences (seq_offsets) over exactly-sized [T, H, D] tensors with every tactic, and the split
tactic's slices in an exactly-sized workspace (split_cases).
"""

import numpy as np
import torch
from _gpu_helpers import TOL, rand_qkv, reference, rel_err

from stof_trt.format import TileLayout
from stof_trt.kernels import DeviceLayout, list_tactics, sparse_attention, tactic_info, workspace_size
from stof_trt.masks import parse_mask


def main():
    mask = parse_mask("longformer:window=40,global=5|dilated:window=90,dilation=3")
    Sq, Sk, B, H = 200, 333, 2, 2
    dense = mask.dense(Sq, Sk)[None]
    worst = 0.0
    n = 0
    for tile in [(128, 64), (32, 32)]:
        layout = TileLayout.from_dense(dense, *tile)
        dl = DeviceLayout(layout)
        for dtype in (torch.float16, torch.bfloat16):
            for D in (64, 128):
                gen = torch.Generator(device="cuda").manual_seed(D)
                q, k, v = rand_qkv(B, H, Sq, Sk, D, dtype, gen)
                lengths = torch.tensor([Sk, 150], dtype=torch.int32, device="cuda")
                kpm = (torch.rand(B, Sk, device="cuda") < 0.8).to(torch.int32)
                keep = (torch.arange(Sk, device="cuda")[None] < lengths[:, None]) & (kpm != 0)
                ref, _ = reference(q, k, v, torch.from_numpy(dense).cuda(), D**-0.5, keep)
                for t in list_tactics(q, k, v, dl):
                    out = torch.full_like(q, float("nan"))
                    sparse_attention(q, k, v, dl, tactic=t, key_lengths=lengths, key_padding_mask=kpm, out=out)
                    torch.cuda.synchronize()
                    err = rel_err(out, ref)
                    assert err <= TOL[dtype], (tactic_info(t).name, dtype, D, err)
                    worst = max(worst, err / TOL[dtype])
                    n += 1
    # The TMA producer and the persistent form run only without key_lengths (the cp.async form above otherwise):
    # one causal-ish case per warp-specialised tactic, with and without the work-counter workspace.
    layout = TileLayout.from_dense(dense, 128, 64)
    dl = DeviceLayout(layout)
    for D in (64, 128):
        gen = torch.Generator(device="cuda").manual_seed(D + 1)
        q, k, v = rand_qkv(B, H, Sq, Sk, D, torch.float16, gen)
        ref, _ = reference(q, k, v, torch.from_numpy(dense).cuda(), D**-0.5, None)
        for t in list_tactics(q, k, v, dl):
            if "_ws_" not in tactic_info(t).name:
                continue
            for workspace in (True, False):
                out = torch.full_like(q, float("nan"))
                sparse_attention(q, k, v, dl, tactic=t, out=out, workspace=workspace)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                assert err <= TOL[torch.float16], (tactic_info(t).name, D, workspace, err)
                worst = max(worst, err / TOL[torch.float16])
                n += 1
    # Two-row kernels (128-row CTAs or items on 64-row tiles) read the pair order: Sq = 333 -> 6 tile rows
    # (pairs 0..2), Sq' = 300 -> 5 tile rows (the last pair has one row).
    for sq in (333, 300):
        d2 = mask.dense(sq, Sk)[None]
        layout = TileLayout.from_dense(d2, 64, 64)
        dl = DeviceLayout(layout)
        gen = torch.Generator(device="cuda").manual_seed(sq)
        q, k, v = rand_qkv(B, H, sq, Sk, 64, torch.float16, gen)
        ref, _ = reference(q, k, v, torch.from_numpy(d2).cuda(), 64**-0.5, None)
        for t in list_tactics(q, k, v, dl):
            if tactic_info(t).block_m != 128:
                continue
            for workspace, pairs in ((True, True), (False, True), (True, False)):
                out = torch.full_like(q, float("nan"))
                sparse_attention(q, k, v, dl, tactic=t, out=out, workspace=workspace, pair_order=pairs)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                assert err <= TOL[torch.float16], (tactic_info(t).name, sq, workspace, pairs, err)
                worst = max(worst, err / TOL[torch.float16])
                n += 1
    # Several waves of persistent items with sched_chunk 1 (static items): sliding S=1024, B=4, H=16 -> 512 two-row
    # items over at most 132 CTAs.
    sl = parse_mask("sliding:window=128")
    layout = TileLayout.from_dense(sl.dense(1024, 1024)[None], 64, 64)
    dl = DeviceLayout(layout)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = rand_qkv(4, 16, 1024, 1024, 64, torch.float16, gen)
    ref, _ = reference(q, k, v, torch.from_numpy(sl.dense(1024, 1024)).cuda()[None], 64**-0.5, None)
    for t in list_tactics(q, k, v, dl):
        if "_ws_" not in tactic_info(t).name:
            continue
        out = torch.full_like(q, float("nan"))
        sparse_attention(q, k, v, dl, tactic=t, out=out, sched_chunk=1)
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        assert err <= TOL[torch.float16], (tactic_info(t).name, "static items", err)
        worst = max(worst, err / TOL[torch.float16])
        n += 1
    # Packed sequences (seq_offsets): [T, H, D] tensors of exactly T rows, each its own allocation, so a load past
    # the last sequence's end or a store outside the sequences is an out-of-bounds access; every tactic of both
    # layouts, with and without the workspace.
    S = 200
    dsq = mask.dense(S, S)[None]
    lengths = [77, 1, S, 64]
    offs = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    T = sum(lengths)
    for tile in [(128, 64), (32, 32)]:
        dl = DeviceLayout(TileLayout.from_dense(dsq, *tile))
        for D in (64, 128):
            gen = torch.Generator(device="cuda").manual_seed(D + 7)
            q, k, v = (torch.randn((T, H, D), generator=gen, device="cuda").to(torch.float16) for _ in range(3))
            refs = []
            for b, m in enumerate(lengths):
                r = slice(int(offs[b]), int(offs[b + 1]))
                refs.append(reference(*(t[r].permute(1, 0, 2)[None] for t in (q, k, v)),
                                      torch.from_numpy(dsq[:, :m, :m]).cuda(), D**-0.5)[0])
            for t in list_tactics(q, k, v, dl, seq_offsets=offs, max_seqlen=S):
                for workspace in (True, False):
                    out = torch.full_like(q, float("nan"))
                    sparse_attention(q, k, v, dl, tactic=t, out=out, workspace=workspace, seq_offsets=offs,
                                     max_seqlen=S)
                    torch.cuda.synchronize()
                    for b, ref in enumerate(refs):
                        o = out[int(offs[b]):int(offs[b + 1])].permute(1, 0, 2)[None]
                        err = rel_err(o, ref)
                        assert err <= TOL[torch.float16], (tactic_info(t).name, "packed", D, b, err)
                        worst = max(worst, err / TOL[torch.float16])
                    n += 1
    n_split, worst_split = split_cases()
    print(f"sanitize_case: {n + n_split} runs ok, worst err/tol {max(worst, worst_split):.3f}")


def split_cases():
    """The split tactic (30) where it splits: few work items with long rows (Sq=70 against Sk=1500, B=2, H=2: 8
    items of 24 key tiles, 6 slices each), its workspace an exact-size allocation, with key_lengths and a padding
    mask, and packed sequences; both head dims."""
    mask = parse_mask("longformer:window=100,global=3|dilated:window=700,dilation=5")
    Sq, Sk, B, H = 70, 1500, 2, 2
    dense = mask.dense(Sq, Sk)[None]
    dl = DeviceLayout(TileLayout.from_dense(dense, 64, 64))
    n, worst = 0, 0.0
    for D in (64, 128):
        gen = torch.Generator(device="cuda").manual_seed(D + 3)
        q, k, v = rand_qkv(B, H, Sq, Sk, D, torch.float16, gen)
        ws_bytes = workspace_size(q, k, v, dl, 30)
        assert ws_bytes > 0
        lengths = torch.tensor([Sk, 901], dtype=torch.int32, device="cuda")
        kpm = (torch.rand(B, Sk, device="cuda") < 0.8).to(torch.int32)
        keep = (torch.arange(Sk, device="cuda")[None] < lengths[:, None]) & (kpm != 0)
        ref, _ = reference(q, k, v, torch.from_numpy(dense).cuda(), D**-0.5, keep)
        out = torch.full_like(q, float("nan"))
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
        sparse_attention(q, k, v, dl, tactic=30, key_lengths=lengths, key_padding_mask=kpm, out=out, workspace=ws)
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        assert err <= TOL[torch.float16], ("split", D, err)
        worst = max(worst, err / TOL[torch.float16])
        n += 1
        # packed: sequences of 1500, 1 and 640 rows over exactly T rows (the layout's first n_b rows and columns)
        S = 1500
        lens = [S, 1, 640]
        dsq = mask.dense(S, S)[None]
        offs = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        T = sum(lens)
        dlp = DeviceLayout(TileLayout.from_dense(dsq, 64, 64))
        qp, kp, vp = (torch.randn((T, 1, D), generator=gen, device="cuda").to(torch.float16) for _ in range(3))
        ws_bytes = workspace_size(qp, kp, vp, dlp, 30, seq_offsets=offs, max_seqlen=S)
        assert ws_bytes > 0
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
        out = torch.full_like(qp, float("nan"))
        sparse_attention(qp, kp, vp, dlp, tactic=30, out=out, workspace=ws, seq_offsets=offs, max_seqlen=S)
        torch.cuda.synchronize()
        for b, m in enumerate(lens):
            r = slice(int(offs[b]), int(offs[b + 1]))
            ref = reference(*(t[r].permute(1, 0, 2)[None] for t in (qp, kp, vp)),
                            torch.from_numpy(dsq[:, :m, :m]).cuda(), D**-0.5)[0]
            err = rel_err(out[r].permute(1, 0, 2)[None], ref)
            assert err <= TOL[torch.float16], ("split packed", D, b, err)
            worst = max(worst, err / TOL[torch.float16])
        n += 1
    return n, worst


if __name__ == "__main__":
    main()
