// Split-walk wgmma kernel (tactic 31): one 64-row work item of tactic 13's shape walked by two warpgroups.
//
// Why: a batch of one at a few hundred keys runs far fewer CTAs than the GPU has SMs, so each item's chain of
// dependent steps (load, S MMA, softmax, P V) is what the launch waits for.  Here warpgroup w takes sub-blocks
// w, w + 2, ... of the item's row walk through its own K/V ring and runs tactic 13's step on them; at the end
// warpgroup 1 hands its O, row maxima and row sums to warpgroup 0 through shared memory, which merges them by
// log-sum-exp and stores O.  Each step's metadata (column, bitmap index, bitmap words, key padding values) is loaded
// one step ahead, after the previous step's S MMA is issued: at a few steps per item those L2 round trips were most
// of a step.
#pragma once

#include "hopper.cuh"

namespace stof {

// Both warpgroups hold the same rows in the same accumulator layout, so the merge is per thread and per register.
template <class HT>
__global__ void __launch_bounds__(2 * HT::kThreads, HT::kHeadDim == 64 ? 2 : 1) hopper_attn_fwd_split(
    const KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename HT::Elem;
    constexpr int kNI = HT::kNI, kKD = HT::kKD, kKN = HT::kKN, kDI = HT::kDI;
    constexpr int kBlockM = HT::kBlockM, kBlockN = HT::kBlockN, kStages = HT::kStages;
    static_assert(HT::kWG == 1 && kStages >= 2, "split walk: 64-row items, a K/V ring per warpgroup");
    constexpr int kRing = kStages * 2 * HT::kSmemKV;       // one warpgroup's K/V ring
    constexpr int kHandOff = (kDI * 4 + 4) * 128 * 4;      // warpgroup 1's O, maxima and sums, fp32
    static_assert(kHandOff <= kRing, "the hand-off fits warpgroup 1's ring");

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, warp = t >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const uint32_t sKV = sQ + HT::kSmemQ + wg * kRing;
    RowItem item;
    if (!row_item<kBlockM>(p, item)) return;
    const int h = item.h, b = item.b, q0 = item.q0, q_len = item.q_len, kv_len = item.kv_len;
    const int a0 = item.walk.a0, e_begin = item.walk.e_begin;
    const int nsub = p.tile_n / kBlockN;
    const int n_iter = (item.walk.e_end - e_begin) * nsub;

    const ItemTensors<Elem> io = item_tensors<Elem>(p, b, h);
    const Elem *gQ = io.q, *gK = io.k, *gV = io.v;
    Elem* const gO = io.o;
    const int32_t* const kpm = io.kpm;
    const float sl2 = p.scale_log2;
    const bool negate_q = sl2 < 0.f;
    const float mul = folded_exp2_scale(sl2);
    auto wg_sync = [&]() {  // the warpgroup's own barrier (immediate ids: ptxas reserves all 16 for a register id)
        if (wg == 0)
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else
            asm volatile("bar.sync 2, 128;\n" ::: "memory");
    };

    // this warpgroup's k-th sub-block of the walk is sub-block wg + 2k
    auto load_kv = [&](int k) {
        const int it = wg + 2 * k;
        const int n0 = __ldg(p.col_idx + e_begin + it / nsub) * p.tile_n + (it % nsub) * kBlockN;
        const uint32_t st = sKV + (k % kStages) * 2 * HT::kSmemKV;
        load_rows_async128<HT, kBlockN>(st, gK, p.k_ss, n0, kv_len, t);
        load_rows_async128<HT, kBlockN>(st + HT::kSmemKV, gV, p.v_ss, n0, kv_len, t);
    };
    // Prologue: Q (warpgroup 0; an empty group in warpgroup 1, so both count their groups alike), then the first
    // kStages-1 sub-blocks of each warpgroup's share.
    if (wg == 0) load_rows_async128<HT, kBlockM>(sQ, gQ, p.q_ss, q0, q_len, t);
    cp_async_commit();
#pragma unroll
    for (int k = 0; k < kStages - 1; ++k) {
        if (wg + 2 * k < n_iter) load_kv(k);
        cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // Q landed (warpgroup 0's copies)
    if (negate_q && wg == 0) {
        static_assert(HT::kSmemQ % (16 * HT::kThreads) == 0, "Q chunks per thread");
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
        flip_signs<HT::kSmemQ / (16 * HT::kThreads), HT::kThreads>(sQ, t);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // Q visible to both warpgroups

    float rO[kDI * 4];
    float rS[kNI * 4];
#pragma unroll
    for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
#pragma unroll
    for (int i = 0; i < kNI * 4; ++i) rS[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int warp_row0 = warp * 16;
    const uint64_t dQ0 = gmma_desc(sQ, 16, 1024);
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    const uint64_t dV0 = gmma_desc(sKV + HT::kSmemKV, kBlockN * 128, 1024);
    uint32_t rQ[kKD][4];
    if constexpr (HT::kQRegs) {
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
            ldmatrix_x4(rQ[kk], sQ + swz128<kBlockM>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }

    // A step's metadata is loaded one step ahead (after the previous step's S MMA is issued): its column, bitmap
    // index, bitmap words and key padding values are L2 round trips, the latter two depending on the former, and at
    // a few steps per item they were most of each step's latency.
    struct StepMeta {
        int n0, bm_idx, kp[2];
        uint32_t bits[2][HT::kWordsN];
    };
    auto load_meta = [&](int it, StepMeta& m) {
        const int e = e_begin + it / nsub, sub = it % nsub;
        m.n0 = __ldg(p.col_idx + e) * p.tile_n + sub * kBlockN;
        m.bm_idx = __ldg(p.tile_bitmap_index + e);
        row_bits_pair(m.bits, p.bitmaps, static_cast<uint32_t>((a0 + warp_row0 + g) * (p.tile_n / 8)), p.tile_n,
                      m.bm_idx, static_cast<uint32_t>(p.tile_m * p.tile_n / 8), sub);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const int key = m.n0 + 32 * w + lane;
            m.kp[w] = kpm != nullptr && key < kv_len ? __ldg(kpm + key) : 1;
        }
    };
    StepMeta next;
    if (wg < n_iter) load_meta(wg, next);

    for (int k = 0; wg + 2 * k < n_iter; ++k) {
        cp_async_wait<kStages - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        wg_sync();  // the warpgroup's copies visible; its warps done with the stage the prefetch overwrites
        if (wg + 2 * (k + kStages - 1) < n_iter) load_kv(k + kStages - 1);
        cp_async_commit();

        const StepMeta cur = next;
        uint32_t bits[2][HT::kWordsN];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int w = 0; w < HT::kWordsN; ++w) bits[hh][w] = cur.bits[hh][w];
        static_assert(kBlockN == 64, "two key words per step");
        if (cur.n0 + kBlockN > kv_len || kpm != nullptr) {  // the key bound / padding words, as key_words
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                const uint32_t kw = __ballot_sync(0xffffffffu, cur.n0 + 32 * w + lane < kv_len && cur.kp[w] != 0);
                bits[0][w] &= kw;
                bits[1][w] &= kw;
            }
        }
        const bool need_mask = cur.bm_idx >= 0 || (bits[0][0] & bits[0][1]) != 0xffffffffu;
        const uint64_t stage_off = static_cast<uint64_t>(((k % kStages) * 2 * HT::kSmemKV) >> 4);
        const uint64_t dK = dK0 + stage_off, dV = dV0 + stage_off;

        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            const uint64_t db = dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4);
            if constexpr (HT::kQRegs)
                wgmma_rs_kb<64, Elem>(rS, rQ[kk], db, kk > 0 ? 1 : 0);
            else
                wgmma_ss<64, Elem>(rS, dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4), db,
                                   kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        if (wg + 2 * (k + 1) < n_iter) load_meta(wg + 2 * (k + 1), next);
        wgmma_wait<0>();
        fence_regs(rS);
        mask_softmax_step<kNI, kDI>(rS, rO, row_max, row_sum, bits, need_mask, tig, mul, mask_selector(p));
        uint32_t rP[kKN][4];
        pack_p<Elem, kKN>(rP, rS);
        issue_pv<HT::kHeadDim, Elem, kKN>(rO, rP, dV);
        wgmma_wait<0>();
        fence_regs(rO);
    }
    cp_async_wait<0>();
    __syncthreads();  // both walks done: warpgroup 1's ring is free for the hand-off

    float* hand = reinterpret_cast<float*>(smem + (sQ + HT::kSmemQ + kRing - smem_u32(smem)));  // [kDI*4 + 4][128]
    if (wg == 1) {
#pragma unroll
        for (int i = 0; i < kDI * 4; ++i) hand[i * 128 + t] = rO[i];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            hand[(kDI * 4 + hh) * 128 + t] = row_max[hh];
            hand[(kDI * 4 + 2 + hh) * 128 + t] = row_sum[hh];
        }
    }
    __syncthreads();
    if (wg == 1) return;
    // O = O0 2^((m0 - m) mul) + O1 2^((m1 - m) mul), m = max(m0, m1); a walk with no allowed key (-inf) weighs 0
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float m1 = hand[(kDI * 4 + hh) * 128 + t], l1 = hand[(kDI * 4 + 2 + hh) * 128 + t];
        const float m = fmaxf(row_max[hh], m1);
        const float f0 = row_max[hh] == -INFINITY ? 0.f : fast_exp2((row_max[hh] - m) * mul);
        const float f1 = m1 == -INFINITY ? 0.f : fast_exp2((m1 - m) * mul);
        row_sum[hh] = row_sum[hh] * f0 + l1 * f1;
#pragma unroll
        for (int di = 0; di < kDI; ++di)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = di * 4 + hh * 2 + c;
                rO[i] = rO[i] * f0 + hand[i * 128 + t] * f1;
            }
    }
    stage_o<Elem, kDI, kBlockM>(rO, row_sum, sQ, warp_row0, g, tig);
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    store_o<Elem, kBlockM, kBlockM, HT::kChunks, HT::kThreads>(sQ, gO, p.o_ss, q0, 0, q_len, t);
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

template <class HT>
cudaError_t launch_hopper_split(const KernelParams& params, cudaStream_t stream) {
    constexpr int kSmem = HT::kSmemQ + 2 * (HT::kStages * 2 * HT::kSmemKV) + 1024;
    return launch_scheduled<HT::kBlockM, HT::kHeadDim>(hopper_attn_fwd_split<HT>, params, 2 * HT::kThreads, kSmem,
                                                       stream);
}

}  // namespace stof
