// One-warpgroup wgmma kernel (as tactic 13 / 14 of hopper.cuh) with K/V brought in by the Tensor Memory Accelerator.
//
// Why: about a fifth of tactic 13's warp instructions per 64-key step are K/V address arithmetic and cp.async
// issue, plus a CTA barrier per step for the copies' visibility.  Here one
// thread issues two bulk tensor copies (K, V) per 64-key half of a step -- a 128-key step (tactic 27) has two halves,
// any columns of the walk; an absent second half (odd walks) is not copied, its V rows are zeroed and its scores
// masked -- (cp.async.bulk.tensor, 64 rows x 128 bytes per box, written in the
// same 128-byte swizzle the wgmma descriptors read) that complete on a `full` mbarrier with a transaction count;
// the four warps wait on that barrier and release the stage through an `empty` mbarrier (one arrival per warp), so
// no CTA-wide barrier remains in the loop.  The tensor maps (K and V as 4-d [B, H, Sk, D] views of the strided
// tensors) are encoded on the host per launch; when the driver refuses one (strides the TMA cannot express), the
// launcher runs the cp.async kernel of the same shape instead.
//
// Exactness: the TMA zero-fills rows >= Sk (the tensor's extent); rows in [key_lengths[b], Sk) of a boundary tile
// hold real data, so their V rows are zeroed in shared memory before P V (a 0 weight times a non-finite padding
// value would otherwise give NaN) and their scores are masked as in every kernel.
#pragma once

#include <type_traits>

#include "hopper.cuh"
#include "hopper_sync.cuh"

namespace stof {

// Shapes of the TMA kernel: one warpgroup, 64 query rows, kKeyStep keys per step (64: one sub-block of the walk;
// 128: two consecutive sub-blocks of the walk, any columns, S as one m64n128 MMA and P V over 128 keys -- half the
// per-step bookkeeping, at 3 CTAs per SM for registers and shared memory).
template <int kHeadDim_, int kStages_, int kKeyStep, typename Elem_>
struct TmaTraits {
    using Elem = Elem_;
    static constexpr bool kDeferPV = false;
    static constexpr int kHeadDim = kHeadDim_, kWG = 1, kStages = kStages_;
    static constexpr int kBlockM = 64, kBlockN = kKeyStep, kHalves = kKeyStep / 64;
    static constexpr int kThreads = 128;
    static constexpr int kMinBlocks = kHeadDim == 64 ? (kKeyStep == 64 ? 4 : 3) : 1;
    static constexpr int kNI = kBlockN / 8, kKD = kHeadDim / 16, kKN = kBlockN / 16, kDI = kHeadDim / 8;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kWordsN = kBlockN / 32;
    static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
    static constexpr int kSmemKV = kBlockN * kHeadDim * 2;
    static constexpr int kSmemSize = kSmemQ + 2 * kStages * kSmemKV + 1024 + 2 * kStages * 8;
    static_assert(kKeyStep == 64 || kKeyStep == 128, "key step");
};

template <class HT>
__global__ void __launch_bounds__(HT::kThreads, HT::kMinBlocks) hopper_attn_fwd_tma(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename HT::Elem;
    constexpr int kNI = HT::kNI, kKD = HT::kKD, kKN = HT::kKN, kDI = HT::kDI;
    constexpr int kBlockM = HT::kBlockM, kBlockN = HT::kBlockN, kStages = HT::kStages;
    constexpr int kHalves = HT::kHalves;
    constexpr uint32_t kStageBytes = 2 * HT::kSmemKV;  // K and V of one step

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sKV = sQ + HT::kSmemQ;
    const uint32_t sBar = sKV + kStages * kStageBytes;
    auto full_bar = [&](int s) { return sBar + 8 * s; };
    auto empty_bar = [&](int s) { return sBar + 8 * (kStages + s); };

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const BlockWork work = block_work<kBlockM>(p);
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)
    const int kv_len = effective_kv_len(p, b);
    const RowWalk walk = row_walk(p, h, q0, kv_len);
    const int a0 = walk.a0, e_begin = walk.e_begin, e_end = walk.e_end;
    const int nsub = p.tile_n / 64;
    const int n_sub = (e_end - e_begin) * nsub;  // 64-key sub-blocks of the walk
    const int n_iter = (n_sub + kHalves - 1) / kHalves;

    const int hk = kv_head(p, h);  // the K/V head (the tensor maps' head coordinate)
    const Elem* gQ = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh;
    Elem* gO = static_cast<Elem*>(p.o) + b * p.o_sb + h * p.o_sh;
    const int32_t* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.seq_k : nullptr;
    const float sl2 = p.scale_log2;
    const bool fold = sl2 > 0.f;
    const float mul = fold ? sl2 : 1.f;

    auto sub_start = [&](int u) {  // first key of 64-key sub-block u of the walk
        return __ldg(p.col_idx + e_begin + u / nsub) * p.tile_n + (u % nsub) * 64;
    };
    auto issue_tma = [&](int t) {  // thread 0: K and V of step t into stage t % kStages
        const int s = t % kStages;
        const uint32_t st = sKV + s * kStageBytes;
        const int halves = min(kHalves, n_sub - t * kHalves);
        mbar_expect_tx(full_bar(s), halves * 2 * (64 * HT::kHeadDim * 2));
        for (int hf = 0; hf < halves; ++hf) {
            const int n0 = sub_start(t * kHalves + hf);
#pragma unroll
            for (int cb = 0; cb < HT::kHeadDim / 64; ++cb) {
                const uint32_t off = cb * kBlockN * 128 + hf * 64 * 128;
                tma_load_4d(st + off, &p.tma_k, cb * 64, n0, hk, b, full_bar(s));
                tma_load_4d(st + HT::kSmemKV + off, &p.tma_v, cb * 64, n0, hk, b, full_bar(s));
            }
        }
    };

    if (tid == 0) {  // barriers, then the first kStages steps' K/V in flight while Q loads
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_bar(s), 1);
            mbar_init(empty_bar(s), 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int t = 0; t < kStages && t < n_iter; ++t) issue_tma(t);
    }
    load_rows_async128<HT, kBlockM>(sQ, gQ, p.q_ss, q0, p.seq_q, tid);
    cp_async_commit();
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // Q and the initialised barriers visible to every thread and to the async proxy

    float rO[kDI * 4];
    float rS[kNI * 4];
#pragma unroll
    for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int warp_row0 = warp * 16;
    const uint64_t dQ0 = gmma_desc(sQ, 16, 1024);
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    const uint64_t dV0 = gmma_desc(sKV + HT::kSmemKV, kBlockN * 128, 1024);

    for (int it = 0; it < n_iter; ++it) {
        const int s = it % kStages;
        const uint32_t parity = (it / kStages) & 1;
        // refill the stage step it - 1 used with step it - 1 + kStages once every warp released it
        if (tid == 0 && it >= 1 && it - 1 + kStages < n_iter) {
            const int ps = (it - 1) % kStages;
            mbar_wait(empty_bar(ps), ((it - 1) / kStages) & 1);
            issue_tma(it - 1 + kStages);
        }
        int n0h[kHalves], bm[kHalves];
        bool need_mask = kpm != nullptr;
        bool tail = false;  // some half crosses the key bound or is absent
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) {
            const int u = it * kHalves + hf;
            if (u < n_sub) {
                n0h[hf] = sub_start(u);
                bm[hf] = __ldg(p.tile_bitmap_index + e_begin + u / nsub);
            } else {
                n0h[hf] = INT_MAX / 2;  // absent half: every key masked
                bm[hf] = -1;
            }
            tail = tail || n0h[hf] + 64 > kv_len;
            need_mask = need_mask || bm[hf] >= 0 || n0h[hf] + 64 > kv_len;
        }
        uint32_t bits[2][HT::kWordsN];
        if (need_mask) {
#pragma unroll
            for (int hf = 0; hf < kHalves; ++hf)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    uint32_t w2[2];
                    row_bits(w2, p, bm[hf], a0 + warp_row0 + hh * 8 + g, (n0h[hf] % p.tile_n) / 64);
                    bits[hh][2 * hf] = w2[0];
                    bits[hh][2 * hf + 1] = w2[1];
                }
        }
        mbar_wait(full_bar(s), parity);
        const uint32_t st = sKV + s * kStageBytes;
        if (tail && (kv_len < p.seq_k || (kHalves > 1 && it * kHalves + 1 >= n_sub))) {
            // V rows the TMA did not write (absent half) or filled with data past key_lengths[b]: zeros (a 0 weight
            // times a stale or non-finite value would give NaN)
            for (int i = tid; i < kBlockN * HT::kChunks; i += HT::kThreads) {
                const int row = i / HT::kChunks, ch = i % HT::kChunks;
                const int hn0 = row < 64 ? n0h[0] : n0h[kHalves - 1];  // a select: no local-memory array
                if (hn0 + row % 64 >= kv_len)
                    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(st + HT::kSmemKV + swz128<kBlockN>(row, ch)),
                                 "r"(0u)
                                 : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_barrier_sync(1, HT::kThreads);
        }
        const uint64_t stage_off = static_cast<uint64_t>((s * kStageBytes) >> 4);
        const uint64_t dK = dK0 + stage_off, dV = dV0 + stage_off;

        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            const uint64_t da = dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4);
            const uint64_t db = dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4);
            wgmma_ss<kBlockN, Elem>(rS, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rS);

        if (!fold) {
#pragma unroll
            for (int i = 0; i < kNI * 4; ++i) rS[i] *= sl2;
        }
        if (need_mask) {
#pragma unroll
            for (int hf = 0; hf < kHalves; ++hf) {
                if (n0h[hf] + 64 > kv_len || kpm != nullptr) {
                    uint32_t kw[2];
                    key_words(kw, n0h[hf] < kv_len ? n0h[hf] : kv_len, kv_len, kpm, lane);
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        bits[hh][2 * hf] &= kw[0];
                        bits[hh][2 * hf + 1] &= kw[1];
                    }
                }
            }
            mask_scores<kNI>(rS, bits, tig, mask_selector(p));
        }
        {
            float alpha[2];
            if (online_softmax<kNI>(rS, row_max, row_sum, alpha, mul)) rescale_o<kDI>(rO, alpha);
        }
        uint32_t rP[kKN][4];
        pack_p<Elem, kKN>(rP, rS);
        issue_pv<HT::kHeadDim, Elem, kKN>(rO, rP, dV);
        wgmma_wait<0>();
        fence_regs(rO);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(s));  // this warp no longer reads stage s
    }

    // Epilogue (sQ is free: the last S MMA has completed in every warp once all pass the barrier)
    __syncthreads();
    stage_o<Elem, kDI, kBlockM>(rO, row_sum, sQ, warp_row0, g, tig);
    __syncthreads();
    store_o<Elem, kBlockM, kBlockM, HT::kChunks, HT::kThreads>(sQ, gO, p.o_ss, q0, 0, p.seq_q, tid);
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

template <class HT, LaunchFn fallback>
cudaError_t launch_hopper_tma(const KernelParams& params, cudaStream_t stream) {
    KernelParams p = params;
    // packed sequences have no fixed batch stride for the tensor maps
    if (p.seq_offsets != nullptr || !encode_kv_maps(p, HT::kHeadDim, !std::is_same<typename HT::Elem, __half>::value))
        return fallback(params, stream);  // same tile shape, cp.async copies
    return launch_scheduled<HT::kBlockM, HT::kHeadDim>(hopper_attn_fwd_tma<HT>, p, HT::kThreads, HT::kSmemSize,
                                                       stream);
}

}  // namespace stof
