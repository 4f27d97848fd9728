// The warp-specialised kernels' consumers: per ring step S = Q K^T, the masked online softmax and O += P V, with an
// item's epilogue (O normalised and stored, or staged for the scheduler warp's TMA store).
#pragma once

#include "hopper_sync.cuh"
#include "hopper_ws_traits.cuh"

namespace stof {

// Flips the sign of consumer w's 64 Q rows of an item's tile (every column block; fp16 and bf16 alike: the sign
// bits), for the wgmma that reads them next: each thread's writes through the async proxy, then the warpgroup's
// barrier (named barrier 1 + w, as the epilogue's).  A negative scale's path (ws_consume_items).
template <class WT>
__device__ __forceinline__ void ws_negate_rows(uint32_t sQ, int w, int ctid) {
#pragma unroll
    for (int cb = 0; cb < WT::kHeadDim / 64; ++cb)  // 64 rows x 128 bytes of each column block
        flip_signs<64 * 128 / (16 * 128), 128>(sQ + cb * WT::kBlockM * 128 + w * 64 * 128, ctid);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_barrier_sync(1 + w, 128);
}

// A work item as the consumers see it: first query row, head, batch, whether its walk has a step, its Q tile
// (swizzled, 64 kConsumers rows; the consumers stage the item's O through their own rows of it) and the source's
// tag (the persistent kernel's Q buffer).
struct WsItem {
    int q0, h, b;
    bool has_steps;
    uint32_t sQ;
    int tag;
};

// The exp chain of the consumers' softmax (online_softmax's ExpChain): group ni's four exps are packed into P as
// they come (P's layout as pack_p's), and every second group's exp arguments from group 2 on wait for the packed P
// two groups back, so ptxas interleaves FFMAs, MUFU ops and packs.
template <class Elem, int kKN>
struct WsExpChain {
    static constexpr int kLag = 2, kEvery = 2;
    uint32_t (&rP)[kKN][4];
    template <int N>
    __device__ __forceinline__ void pack(int ni, const float (&rS)[N]) const {
        const int kn = ni >> 1, o = (ni & 1) * 2;
        rP[kn][o] = ElemTraits<Elem>::pack(rS[ni * 4 + 0], rS[ni * 4 + 1]);
        rP[kn][o + 1] = ElemTraits<Elem>::pack(rS[ni * 4 + 2], rS[ni * 4 + 3]);
    }
    __device__ __forceinline__ uint32_t packed(int ni) const { return rP[ni >> 1][(ni & 1) * 2]; }
};

// Consumer warpgroup w: every work item next_item(WsItem&) hands out (false: no more).  With WT::kChainItems the
// items are chained: an item's first step issues its S = Q K^T together with the previous item's last P V, so the
// first softmax overlaps that MMA, and the previous item's epilogue (O normalised, staged through its own Q rows,
// stored; then item_done(item)) runs once both are done.  Otherwise each item's last P V and epilogue come right
// after its last step.  Steps come as descriptors with the ring stages (ws_write_desc), from ring position 0 on.
// kStagedO: the epilogue only stages O in the item's Q buffer (then item_done); the producer stores it (the
// persistent kSchedWarp kernels).
template <class WT, bool kStagedO = false, class NextItem, class ItemDone>
__device__ __forceinline__ void ws_consume_items(const KernelParams& p, NextItem&& next_item, ItemDone&& item_done,
                                                 uint32_t sKV, uint32_t sBar, uint32_t sDesc, int w, int ctid) {
    using Elem = typename WT::Elem;
    constexpr int kNI = WT::kNI, kKD = WT::kKD, kKN = WT::kKN, kDI = WT::kDI;
    constexpr int kBlockM = WT::kBlockM, kBlockN = WT::kBlockN, kStages = WT::kStages, kSub = WT::kSub;
    auto full_bar = [&](int s) { return WT::full_k(sBar, s); };
    auto empty_bar = [&](int s) { return WT::empty_k(sBar, s); };
    // WT::kSplitKV: a stage's K is released once its S is done, its V awaited before and released after its P V
    // (position: the step's ring position, for the parity); without it both go with the P V's release.  With a
    // padding mask the softmax reads the stage's descriptor (its padding words, which the producer rewrites with
    // the stage's next K), so K is released after the softmax then: k_done(s, after_softmax) at both points.
    const bool k_after_softmax = WT::kSplitKV && p.key_padding_mask != nullptr;
    auto k_done = [&](int s, bool after_softmax) {
        if constexpr (WT::kSplitKV) {
            if (after_softmax == k_after_softmax) mbar_arrive(WT::empty_k(sBar, s));
        }
    };
    auto v_wait = [&](int s, int position) {
        if constexpr (WT::kSplitKV) mbar_wait(WT::full_v(sBar, s), (position / kStages) & 1);
    };
    auto v_done = [&](int s) { mbar_arrive(WT::empty_v(sBar, s)); };
    const int warp = ctid >> 5, lane = ctid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const float sl2 = p.scale_log2;
    // The scale is folded into the exp2 FFMA whatever its sign (folded_exp2_scale; each item's Q rows negated first
    // for scale < 0, ws_negate_rows), so the step loop has one path.
    const bool negate_q = sl2 < 0.f;
    const float mul = folded_exp2_scale(sl2);

    constexpr int kON = WT::kON;
    float rO[kON / 2];  // O (kDI groups of 8 columns), then with kSumMma the row sums (rO[kDI * 4 + {0, 2}])
    float rS[kNI * 4];
    uint32_t rP[kKN][4];
    float row_max[2], row_sum[2] = {0.f, 0.f};
    // the current item's
    int kv_len = 0, mask_len = 0, my_a0 = 0;  // my_a0: first bitmap row of this warpgroup inside its tile
    // the thread's bitmap rows (g, g + 8) of the item, in bitmap 0
    uint32_t bm_row = 0;  // the byte offset of the thread's first bitmap row (g) of the item inside a bitmap
    const uint32_t bm_tile_bytes = static_cast<uint32_t>(p.tile_m * p.tile_n / 8), bm_row8 = p.tile_n;
    const uint32_t mask_sel = mask_selector(p);
    // The layout handle's lane_bitmaps: a PARTIAL sub-block's mask words already in this thread's order, one
    // 8-byte load instead of two loads and the packing (pack_mask_bits).  Only in the 64-key-step kernels (21, 22):
    // in 24 the second path's code costs as much as it saves, and the three-consumer kernels are at the spill limit.
    constexpr bool kLaneBits = WT::kConsumers == 2 && kBlockN == 64;
    const char* const lane_bits = kLaneBits ? reinterpret_cast<const char*>(p.lane_bitmaps) : nullptr;
    const bool use_lane_bits = kLaneBits && lane_bits != nullptr;
    const uint32_t lb_tile_bytes = static_cast<uint32_t>(p.tile_m * p.tile_n / 4);
    uint32_t lb_row = 0;  // the byte offset of the thread's entry for the item's rows, sub-block 0, in bitmap 0
    const int32_t* kpm = nullptr;
    uint64_t dQ0 = 0;
    uint32_t rQ[kKD][4];  // WT::kQRegs: this warp's 16 Q rows (A fragments, one per k16 block)
    WsDesc st;
    int it = 0;  // the ring position of the step being consumed

    // descriptors = base + (byte offset >> 4) (shared addresses < 2^18: the 14-bit field never carries)
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    // V: head-dim chunks of 64 kBlockN * 128 bytes apart (the LBO); with kSumMma the next "chunk" is the ones,
    // after the ring, so each stage's V descriptor has its own LBO
    const uint32_t sOnes = sKV + WT::kOnesOffset;
    const uint64_t dV0 = gmma_desc(sKV + WT::kSmemKV, WT::kSumMma ? sOnes - (sKV + WT::kSmemKV) : kBlockN * 128, 1024);
    auto issue_s = [&](int stage) {  // S = Q K^T
        const uint64_t dK = dK0 + static_cast<uint64_t>((stage * 2 * WT::kSmemKV) >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            const uint64_t da = dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4);
            const uint64_t db = dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4);
            if constexpr (WT::kQRegs)
                wgmma_rs_kb<kBlockN, Elem>(rS, rQ[kk], db, kk > 0 ? 1 : 0);
            else
                wgmma_ss<kBlockN, Elem>(rS, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    };
    auto issue_pv = [&](int stage, int acc) {  // O += P V (acc 0: O = P V, WT::kPvOverwrite)
        const uint64_t off = static_cast<uint64_t>((stage * 2 * WT::kSmemKV) >> 4);
        const uint64_t dV = dV0 + off - (WT::kSumMma ? off << 16 : 0);  // start + off; LBO - off (the ones stay)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKN; ++kk)
            wgmma_rs<kON, Elem>(rO, rP[kk], dV + ((kk * 16 * 128) >> 4), kk > 0 || !WT::kPvOverwrite ? 1 : acc);
        wgmma_commit();
    };
    // Mask (sub-blocks this consumer's tile row lacks are -inf: the MMAs of a step run for every consumer, so
    // no wgmma sits under a data-dependent branch, which would make ptxas serialise them), online softmax;
    // leaves P in rS; true when O must be rescaled by alpha (see online_softmax).
    auto softmax = [&](float (&alpha)[2]) -> bool {  // for the step described by st
#pragma unroll
        for (int hh = 0; hh < kSub; ++hh) {
            // A sub-block this consumer lacks is masked through all-zero words: every path masks rS in place
            // (FSEL), so no branch leaves the scores in other registers (a -inf fill on one path made ptxas copy
            // all 32 scores on every step).
            const int bm_idx = st.bm[hh];  // -2: this consumer has no tile there
            const int n0 = st.n0[hh];
            // mask_len: kv_len, or -1 with a padding mask (n0 -65 in a two-consumer descriptor when the padding cuts
            // no key of the sub-block, see ws_write_desc; otherwise every sub-block is cut): one predicate fewer in
            // the step loop, where R2P's seven-predicate writes made ptxas keep the others in registers
            const bool bound = n0 + 64 > mask_len;
            if (bm_idx != -1 || bound) {
                uint2 zy = make_uint2(0u, 0u);
                if (use_lane_bits && !bound) {  // (warp-uniform)
                    if (bm_idx != -2)
                        zy = __ldg(reinterpret_cast<const uint2*>(
                            lane_bits + (static_cast<uint32_t>(bm_idx) * lb_tile_bytes + lb_row +
                                         static_cast<uint32_t>(st.sub[hh]) * 256u)));
                } else {
                    uint32_t bits[2][2] = {{0u, 0u}, {0u, 0u}};
                    if (bm_idx != -2) {
                        row_bits_pair(bits, p.bitmaps, bm_row, bm_row8, bm_idx, bm_tile_bytes, st.sub[hh]);
                        if (bound) {  // (warp-uniform)
                            // two consumers, TMA producer: a padding mask's words come with the descriptor
                            // (WsKeys), which the step's ring position gives
                            if (WT::kConsumers == 2 && WT::kTma && kpm != nullptr)
                                ws_and_desc_keys(bits, sDesc + (it % kStages) * kWsDescBytes, hh);
                            else
                                and_key_words(bits, n0, kv_len, kpm, lane);
                        }
                    }
                    zy = pack_mask_bits(bits, tig, mask_sel);
                }
                mask_scores_packed(rS, zy, hh * 32);
            }
        }
        // the turn handed over as below (kTurns); P packed by the exp chain (WsExpChain), so the outstanding P V
        // (which reads rP) is awaited first (where ptxas put that wait anyway)
        return online_softmax<kNI, true, !WT::kSumMma>(
            rS, row_max, row_sum, alpha, mul,
            [&]() {
                if constexpr (WT::kTurns) named_barrier_arrive(3 + (1 - w), 256);
                wgmma_wait<0>();
                fence_regs(rO);
            },
            WsExpChain<Elem, kKN>{rP});
    };
    // before each step's MMA issue (not the P V-only issue of finish_open, which both consumers skip alike: the
    // two issue the same steps, as the walk is the union, so the turns stay paired)
    auto my_turn = [&]() {
        if constexpr (WT::kTurns) named_barrier_sync(3 + w, 256);
    };
    // an item's O (normalised by sum) staged through this consumer's (now unused) Q rows, then 16-byte stores
    // (kStagedO: the producer's TMA store)
    auto epilogue = [&](const WsItem& item, const float (&sum)[2]) {
        if constexpr (WT::kSumMma) {
            const float mma_sum[2] = {rO[kDI * 4], rO[kDI * 4 + 2]};
            stage_o<Elem, kDI, kBlockM, false, WT::kConsumers == 2>(rO, mma_sum, item.sQ, 64 * w + warp * 16, g, tig);
        } else {
            stage_o<Elem, kDI, kBlockM, true, WT::kConsumers == 2>(rO, sum, item.sQ, 64 * w + warp * 16, g, tig);
        }
        if constexpr (!kStagedO) {
            named_barrier_sync(1 + w, 128);
            Elem* gO = static_cast<Elem*>(p.o) + item.b * p.o_sb + item.h * p.o_sh;
            int q_len = p.seq_q;
            if (!WT::kTma && p.seq_offsets != nullptr) {  // packed sequences (the one-CTA-per-item cp.async kernel)
                gO += packed_row0(p, item.b) * p.o_ss;
                q_len = min(q_len, packed_len(p, item.b));
            }
            store_o<Elem, kBlockM, 64, WT::kChunks, 128>(item.sQ, gO, p.o_ss, item.q0, 64 * w, q_len, ctid);
        }
        item_done(item);
    };
    auto zero_o = [&]() {
#pragma unroll
        for (int i = 0; i < kON / 2; ++i) rO[i] = 0.f;
    };

    // With the exp chain the softmax's hook has waited for the step's P V (it packs into rP): no second, empty
    // WARPGROUP.DEPBAR after it.  Head dim 64 only: at 128 ptxas then reorders tactic 22's exps, for the worse.
    constexpr bool kPvWaited = WT::kHeadDim == 64;
    WsItem cur, open;  // open: the item whose last P V (from ring stage prev_stage) and epilogue are outstanding
    bool pending = false;
    int prev_stage = 0, prev_it = 0;  // prev_it: prev_stage's ring position
    int pv_acc = 1, open_acc = 1;  // WT::kPvOverwrite: 0 until the current / open item's first P V is issued
    // WT::kSkip: a step with no tile of this consumer, before its first or after its last in the item, is released
    // unread (its descriptor's `more` only)
    auto skip_step = [&]() -> bool {
        const int stage = it % kStages;
        mbar_wait(full_bar(stage), (it / kStages) & 1);
        int more;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(more) : "r"(sDesc + stage * kWsDescBytes + 32) : "memory");
        mbar_arrive(empty_bar(stage));
        ++it;
        return more != 0;
    };
    auto finish_open = [&]() {  // the open item's last P V, then its epilogue
        v_wait(prev_stage, prev_it);
        issue_pv(prev_stage, open_acc);
        wgmma_wait<0>();
        fence_regs(rO);
        v_done(prev_stage);
        epilogue(open, row_sum);
        pending = false;
    };
    for (;;) {
        const bool got = next_item(cur);
        if (!got) break;
        if (negate_q) ws_negate_rows<WT>(cur.sQ, w, ctid);
        int stage0 = 0;  // the first step's ring stage
        if constexpr (WT::kSkip) {
            stage0 = it % kStages;
            if (cur.has_steps) {
                mbar_wait(full_bar(stage0), (it / kStages) & 1);
                // cp.async writes -> wgmma reads (the cp.async producer); see the first step below
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                st = ws_read_desc<WT::kConsumers, true>(sDesc + stage0 * kWsDescBytes, w);
                bool here = __shfl_sync(0xffffffffu, st.bm[0] != -2 || st.bm[1] != -2, 0) != 0;  // uniform
                if (!here) {
                    // The open item is finished first: its stage may stay held over kStages - 2 skipped steps
                    // only (see the item's end below), and these are not counted.
                    if (pending) finish_open();
                    while (!here && st.mine) {
                        mbar_arrive(empty_bar(stage0));
                        stage0 = ++it % kStages;
                        mbar_wait(full_bar(stage0), (it / kStages) & 1);
                        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                        st = ws_read_desc<WT::kConsumers, true>(sDesc + stage0 * kWsDescBytes, w);
                        here = __shfl_sync(0xffffffffu, st.bm[0] != -2 || st.bm[1] != -2, 0) != 0;
                    }
                    if (!here) {  // no tile of this consumer in the item (rows past Sq, an empty tile row)
                        mbar_arrive(empty_bar(stage0));
                        ++it;
                        for (bool more = st.more != 0; more;) more = skip_step();
                        cur.has_steps = false;
                    }
                }
            }
        }
        if (!cur.has_steps) {  // no allowed key: zeros (the open item first, its P V still to issue)
            if (pending) finish_open();
            zero_o();
            row_sum[0] = row_sum[1] = 0.f;
            epilogue(cur, row_sum);
            continue;
        }
        kv_len = ws_kv_len<!WT::kTma>(p, cur.b);
        // A power-of-two tile_m (compile_mask's default, 64) takes a mask, not the remainder: an integer division
        // by a run-time value is ~20 dependent instructions on the path into the item's first step.  Head dim 64 only.
        if (WT::kHeadDim == 64 && (p.tile_m & (p.tile_m - 1)) == 0)
            my_a0 = (cur.q0 + 64 * w) & (p.tile_m - 1);
        else
            my_a0 = (cur.q0 + 64 * w) % p.tile_m;
        bm_row = static_cast<uint32_t>((my_a0 + warp * 16 + g) * (p.tile_n / 8));
        if constexpr (kLaneBits) lb_row = static_cast<uint32_t>(((my_a0 / 16 + warp) * (p.tile_n / 64)) * 256 + lane * 8);
        kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(cur.b) * p.seq_k : nullptr;
        mask_len = kpm != nullptr ? -1 : kv_len;
        dQ0 = gmma_desc(cur.sQ + w * 64 * 128, 16, 1024);
        if constexpr (WT::kQRegs) {
            // rows 16 warp + (lane & 15) of this consumer's 64, columns 16 kk + 8 (lane >> 4): ldmatrix.x4 gives
            // the A fragment (rows g / g + 8, columns 2 tig / 8 + 2 tig)
#pragma unroll
            for (int kk = 0; kk < kKD; ++kk)
                ldmatrix_x4(rQ[kk], cur.sQ + swz128<kBlockM>(64 * w + warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        }

        // First step: S_0 (with the open item's last P V) and its softmax.
        if constexpr (!WT::kSkip) {  // (kSkip: read above)
            stage0 = it % kStages;
            mbar_wait(full_bar(stage0), (it / kStages) & 1);
            // cp.async writes -> wgmma reads (the cp.async producer); redundant with the TMA producer, whose writes
            // are async-proxy like the wgmma reads, but free there
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            st = ws_read_desc<WT::kConsumers>(sDesc + stage0 * kWsDescBytes, w);
        }
        float alpha[2];
        if (pending) {
            my_turn();
            issue_s(stage0);
            v_wait(prev_stage, prev_it);
            issue_pv(prev_stage, open_acc);
            wgmma_wait<1>();  // S_0
            fence_regs(rS);
            k_done(stage0, false);
            const float open_sum[2] = {row_sum[0], row_sum[1]};
            row_max[0] = row_max[1] = -INFINITY;
            row_sum[0] = row_sum[1] = 0.f;
            softmax(alpha);  // fresh row state: no rescale
            k_done(stage0, true);
            if constexpr (!kPvWaited) {
                wgmma_wait<0>();  // the open item's last P V
                fence_regs(rO);
            }
            v_done(prev_stage);
            epilogue(open, open_sum);
        } else {
            my_turn();
            issue_s(stage0);
            wgmma_wait<0>();
            fence_regs(rS);
            k_done(stage0, false);
            row_max[0] = row_max[1] = -INFINITY;
            row_sum[0] = row_sum[1] = 0.f;
            softmax(alpha);
            k_done(stage0, true);
        }
        if constexpr (WT::kPvOverwrite)
            pv_acc = 0;
        else
            zero_o();
        prev_stage = stage0;
        prev_it = it;
        ++it;
        // Steady state, step i: S_i and P_{i-1} V_{i-1} in flight together; softmax of S_i while P V runs.
        for (bool more = st.mine; more; ++it) {
            const int stage = it % kStages;
            mbar_wait(full_bar(stage), (it / kStages) & 1);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            st = ws_read_desc<WT::kConsumers, WT::kSkip>(sDesc + stage * kWsDescBytes, w);
            my_turn();
            issue_s(stage);
            v_wait(prev_stage, prev_it);
            issue_pv(prev_stage, pv_acc);
            pv_acc = 1;
            wgmma_wait<1>();  // S_i
            fence_regs(rS);
            k_done(stage, false);
            const bool rescale = softmax(alpha);
            k_done(stage, true);
            if constexpr (!kPvWaited) {
                wgmma_wait<0>();  // P_{i-1} V_{i-1}: O and rP free, stage i-1 no longer read
                fence_regs(rO);
            }
            v_done(prev_stage);
            if (rescale) rescale_o<kON / 8>(rO, alpha);  // with kSumMma the row sums too
            prev_stage = stage;
            prev_it = it;
            more = st.mine;
        }
        open = cur;
        open_acc = pv_acc;
        pending = true;
        if constexpr (WT::kSkip) {
            // Steps left in the item with no tile of this consumer are released unread.  Up to kStages - 2 of them
            // while the item's last P V stays pending (its stage held), so the chain to the next item survives:
            // the next item's first step, kStages - 1 on from the held stage at most, must not need it.  Beyond that,
            // the item is finished first.
            bool more = st.more != 0;
            for (int n = 0; more && n < kStages - 2; ++n) more = skip_step();
            if (more) {
                finish_open();
                while (more) more = skip_step();
            }
            if constexpr (!WT::kChainItems) {
                if (pending) finish_open();  // not chained: the item ends here
            }
        } else if constexpr (!WT::kChainItems) {
            finish_open();  // not chained: the item ends here
        }
    }
    if (pending) finish_open();
}

}  // namespace stof
