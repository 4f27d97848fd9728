// Block-wise sparse attention forward (FlashAttention-2 style, mma.sync m16n8k16, fp32 accumulate).
//
// One CTA computes kBlockM query rows of one (batch, head).  Those rows lie inside one format tile row
// (tile_m % kBlockM == 0); the CTA walks only that tile row's non-empty tiles (row_ptr/col_idx, any columns,
// not assumed contiguous), each tile in tile_n / kBlockN sub-blocks of kBlockN keys.  K/V sub-blocks stream
// through a kStages-deep cp.async ring.  FULL tiles inside the key bound apply no mask; PARTIAL tiles apply
// their bitmap (each thread reads the words of its own rows); the key tail, key_lengths and key_padding_mask
// are checked only where they can cut a sub-block.  Online softmax in the log2 domain; a row with no allowed
// key ends with row sum 0 and writes zeros.
//
// Register tiles per warp (kWarpM = kBlockM / kNWarps rows = kMI m16 tiles):
//   rQ [kMI][kHeadDim/16][4]  A fragments of Q, loaded once
//   rS [kMI][kBlockN/8][4]    S = Q K^T accumulators, then P in place
//   rO [kMI][kHeadDim/8][4]   O accumulators
// Shared memory: sQ (kBlockM, kHeadDim) | kStages x { sK (kBlockN, kHeadDim), sV (kBlockN, kHeadDim) },
// rows of 16-byte chunks XOR-swizzled by (row & 7) so ldmatrix is bank-conflict free.
#pragma once

#include "common.cuh"

namespace stof {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, int kMinBlocks_, bool kQInSmem_,
          typename Elem_>
struct BlockTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kStages = kStages_;
    static constexpr int kMinBlocks = kMinBlocks_;  // __launch_bounds__ min CTAs per SM (caps registers)
    static constexpr bool kQInSmem = kQInSmem_;     // reload Q fragments from smem each tile (fewer registers)
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpM = kBlockM / kNWarps;
    static constexpr int kMI = kWarpM / 16;         // m16 tiles per warp
    static constexpr int kNI = kBlockN / 8;         // n8 tiles of S
    static constexpr int kKD = kHeadDim / 16;       // k16 steps over D (Q K^T)
    static constexpr int kKN = kBlockN / 16;        // k16 steps over keys (P V)
    static constexpr int kDI = kHeadDim / 8;        // n8 tiles of O
    static constexpr int kChunks = kHeadDim / 8;    // 16-byte chunks per row
    static constexpr int kWordsN = kBlockN / 32;    // bitmap words per row of a sub-block
    static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
    static constexpr int kSmemKV = kBlockN * kHeadDim * 2;
    static constexpr int kSmemSize = kSmemQ + 2 * kStages * kSmemKV;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim");
    static_assert(kWarpM % 16 == 0 && kMI >= 1, "each warp owns whole m16 tiles");
    static_assert(kBlockN % 32 == 0 && kNI % 2 == 0, "kBlockN");
    static_assert(kStages >= 2, "pipeline");
    static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0, "copy split");
};

// Byte offset of 16-byte chunk `ch` of row `r` in a swizzled (rows, kChunks) tile.
template <int kChunks>
__device__ __forceinline__ uint32_t swz(int r, int ch) {
    return static_cast<uint32_t>((r * kChunks + (ch ^ (r & 7))) * 16);
}

// Async copy of rows [row0, row0 + kRows) of a (S, D) matrix into a swizzled smem tile; rows >= limit are zeros.
template <class KT, int kRows>
__device__ __forceinline__ void load_rows_async(uint32_t s_tile, const typename KT::Elem* g, int64_t stride_s,
                                                int row0, int limit, int tid) {
    constexpr int kIters = kRows * KT::kChunks / KT::kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int c = tid + it * KT::kThreads;
        const int r = c / KT::kChunks;
        const int ch = c % KT::kChunks;
        const int grow = row0 + r;
        const bool ok = grow < limit;
        const typename KT::Elem* src = g + (ok ? static_cast<int64_t>(grow) * stride_s + ch * 8 : 0);
        cp_async16(s_tile + swz<KT::kChunks>(r, ch), src, ok ? 16 : 0);
    }
}

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocks) block_attn_fwd(const KernelParams p) {
    using Elem = typename KT::Elem;
    constexpr int kMI = KT::kMI, kNI = KT::kNI, kKD = KT::kKD, kKN = KT::kKN, kDI = KT::kDI;
    constexpr int kBlockM = KT::kBlockM, kBlockN = KT::kBlockN, kStages = KT::kStages;

    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem);
    const uint32_t sKV = sQ + KT::kSmemQ;  // stage s: K at sKV + 2*s*kSmemKV, V right after

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates
    const BlockWork work = block_work<kBlockM>(p);  // longest rows first (common.cuh)
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)
    int q_len, kv_len;
    if (!item_rows(p, b, q0, q_len, kv_len)) return;
    const RowWalk walk = row_walk(p, h, q0, kv_len);  // stored tiles of the row, past the key bound dropped
    const int a0 = walk.a0, e_begin = walk.e_begin, e_end = walk.e_end;  // a0: first bitmap row of this CTA
    const int nsub = p.tile_n / kBlockN;
    const int n_iter = (e_end - e_begin) * nsub;

    const Elem* gQ = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh;
    const int hk = kv_head(p, h);  // the K/V head: once per work item, never per step
    const Elem* gK = static_cast<const Elem*>(p.k) + b * p.k_sb + hk * p.k_sh;
    const Elem* gV = static_cast<const Elem*>(p.v) + b * p.v_sb + hk * p.v_sh;
    Elem* gO = static_cast<Elem*>(p.o) + b * p.o_sb + h * p.o_sh;
    if (p.seq_offsets != nullptr) {  // packed sequences: rows from seq_offsets[b]
        const int64_t r0 = packed_row0(p, b);
        gQ += r0 * p.q_ss, gK += r0 * p.k_ss, gV += r0 * p.v_ss, gO += r0 * p.o_ss;
    }
    const int32_t* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.seq_k : nullptr;
    const int words_per_tile = p.tile_m * p.tile_n / 32;
    const int words_per_row = p.tile_n / 32;

    // Prologue: Q, then the first kStages-1 K/V sub-blocks (one commit group each, empty groups included).
    load_rows_async<KT, kBlockM>(sQ, gQ, p.q_ss, q0, q_len, tid);
    cp_async_commit();
    auto key_start = [&](int it) {
        const int e = e_begin + it / nsub;
        return __ldg(p.col_idx + e) * p.tile_n + (it % nsub) * kBlockN;
    };
    auto load_kv = [&](int it) {
        const int n0 = key_start(it);
        const uint32_t st = sKV + (it % kStages) * 2 * KT::kSmemKV;
        load_rows_async<KT, kBlockN>(st, gK, p.k_ss, n0, kv_len, tid);
        load_rows_async<KT, kBlockN>(st + KT::kSmemKV, gV, p.v_ss, n0, kv_len, tid);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_iter) load_kv(s);
        cp_async_commit();
    }

    uint32_t rQ[KT::kQInSmem ? 1 : kMI][KT::kQInSmem ? 1 : kKD][4];
    float rO[kMI][kDI][4];
    float row_max[kMI][2], row_sum[kMI][2];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
        for (int di = 0; di < kDI; ++di)
#pragma unroll
            for (int c = 0; c < 4; ++c) rO[mi][di][c] = 0.f;
        row_max[mi][0] = row_max[mi][1] = -INFINITY;
        row_sum[mi][0] = row_sum[mi][1] = 0.f;
    }
    const int warp_row0 = warp * KT::kWarpM;

    // Main loop over the non-empty sub-blocks of this tile row.
    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        if (!KT::kQInSmem && it == 0) {
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int kk = 0; kk < kKD; ++kk) {
                    const int row = warp_row0 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4(rQ[KT::kQInSmem ? 0 : mi][KT::kQInSmem ? 0 : kk],
                                sQ + swz<KT::kChunks>(row, kk * 2 + (lane >> 4)));
                }
        }
        if (it + kStages - 1 < n_iter) load_kv(it + kStages - 1);
        cp_async_commit();

        const int e = e_begin + it / nsub;
        const int sub = it % nsub;
        const int n0 = __ldg(p.col_idx + e) * p.tile_n + sub * kBlockN;
        const int bm_idx = __ldg(p.tile_bitmap_index + e);
        const bool need_mask = bm_idx >= 0 || n0 + kBlockN > kv_len || kpm != nullptr;
        // Bitmap words of this thread's rows (issued before the MMAs so their latency overlaps).
        uint32_t bits[kMI][2][KT::kWordsN];
        if (need_mask) {
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int w = 0; w < KT::kWordsN; ++w) {
                        const int a = a0 + warp_row0 + mi * 16 + hh * 8 + g;
                        bits[mi][hh][w] =
                            bm_idx >= 0 ? static_cast<uint32_t>(__ldg(p.bitmaps + static_cast<int64_t>(bm_idx) *
                                                                                   words_per_tile +
                                                                      a * words_per_row + sub * KT::kWordsN + w))
                                        : 0xffffffffu;
                    }
        }

        const uint32_t sK = sKV + (it % kStages) * 2 * KT::kSmemKV;
        const uint32_t sV = sK + KT::kSmemKV;

        // S = Q K^T  (kWarpM x kBlockN per warp)
        float rS[kMI][kNI][4];
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) rS[mi][ni][c] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            uint32_t rQs[kMI][4];
            if constexpr (KT::kQInSmem) {
#pragma unroll
                for (int mi = 0; mi < kMI; ++mi) {
                    const int row = warp_row0 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4(rQs[mi], sQ + swz<KT::kChunks>(row, kk * 2 + (lane >> 4)));
                }
            }
#pragma unroll
            for (int np = 0; np < kNI / 2; ++np) {
                uint32_t rK[4];
                const int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
                ldmatrix_x4(rK, sK + swz<KT::kChunks>(key, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                for (int mi = 0; mi < kMI; ++mi) {
                    const uint32_t(&a)[4] = KT::kQInSmem ? rQs[mi] : rQ[KT::kQInSmem ? 0 : mi][KT::kQInSmem ? 0 : kk];
                    mma_16816<Elem>(rS[mi][2 * np], a, rK[0], rK[1]);
                    mma_16816<Elem>(rS[mi][2 * np + 1], a, rK[2], rK[3]);
                }
            }
        }

        // Scale (log2 domain), then mask.
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) rS[mi][ni][c] *= p.scale_log2;
        if (need_mask) {
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = ni * 8 + tig * 2 + c;
                    const int key = n0 + col;
                    bool key_ok = key < kv_len;
                    if (kpm != nullptr && key_ok) key_ok = __ldg(kpm + key) != 0;
#pragma unroll
                    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const bool ok = key_ok && ((bits[mi][hh][ni / 4] >> (col & 31)) & 1u);
                            if (!ok) rS[mi][ni][hh * 2 + c] = -INFINITY;
                        }
                }
        }

        // Online softmax: new row max, rescale O and the row sums, P = exp2(S - max).
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = row_max[mi][hh];
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni) mx = fmaxf(mx, fmaxf(rS[mi][ni][hh * 2], rS[mi][ni][hh * 2 + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_use = (mx == -INFINITY) ? 0.f : mx;  // all masked so far: keep zeros, no NaN
                const float alpha = fast_exp2(row_max[mi][hh] - m_use);
                row_max[mi][hh] = mx;
                float sum = 0.f;
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float pv = fast_exp2(rS[mi][ni][hh * 2 + c] - m_use);
                        rS[mi][ni][hh * 2 + c] = pv;
                        sum += pv;
                    }
                row_sum[mi][hh] = row_sum[mi][hh] * alpha + sum;
#pragma unroll
                for (int di = 0; di < kDI; ++di) {
                    rO[mi][di][hh * 2] *= alpha;
                    rO[mi][di][hh * 2 + 1] *= alpha;
                }
            }

        // O += P V
#pragma unroll
        for (int kn = 0; kn < kKN; ++kn) {
            uint32_t rP[kMI][4];
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi) {
                rP[mi][0] = ElemTraits<Elem>::pack(rS[mi][2 * kn][0], rS[mi][2 * kn][1]);
                rP[mi][1] = ElemTraits<Elem>::pack(rS[mi][2 * kn][2], rS[mi][2 * kn][3]);
                rP[mi][2] = ElemTraits<Elem>::pack(rS[mi][2 * kn + 1][0], rS[mi][2 * kn + 1][1]);
                rP[mi][3] = ElemTraits<Elem>::pack(rS[mi][2 * kn + 1][2], rS[mi][2 * kn + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < kDI / 2; ++dp) {
                uint32_t rV[4];
                const int key = kn * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4_trans(rV, sV + swz<KT::kChunks>(key, dp * 2 + (lane >> 4)));
#pragma unroll
                for (int mi = 0; mi < kMI; ++mi) {
                    mma_16816<Elem>(rO[mi][2 * dp], rP[mi], rV[0], rV[1]);
                    mma_16816<Elem>(rO[mi][2 * dp + 1], rP[mi], rV[2], rV[3]);
                }
            }
        }
    }

    // Epilogue: normalise, stage through sQ (swizzled), 16-byte coalesced stores of the in-range rows.
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = row_sum[mi][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row = warp_row0 + mi * 16 + hh * 8 + g;
#pragma unroll
            for (int di = 0; di < kDI; ++di) {
                const uint32_t packed =
                    ElemTraits<Elem>::pack(rO[mi][di][hh * 2] * inv, rO[mi][di][hh * 2 + 1] * inv);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + swz<KT::kChunks>(row, di) + tig * 4),
                             "r"(packed));
            }
        }
    __syncthreads();
    constexpr int kOutIters = kBlockM * KT::kChunks / KT::kThreads;
#pragma unroll
    for (int i = 0; i < kOutIters; ++i) {
        const int c = tid + i * KT::kThreads;
        const int row = c / KT::kChunks, ch = c % KT::kChunks;
        if (q0 + row < q_len) {
            uint4 val;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                         : "r"(sQ + swz<KT::kChunks>(row, ch)));
            *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(q0 + row) * p.o_ss + ch * 8) = val;
        }
    }
}

template <class KT>
cudaError_t launch_block(const KernelParams& params, cudaStream_t stream) {
    return launch_scheduled<KT::kBlockM, KT::kHeadDim>(block_attn_fwd<KT>, params, KT::kThreads, KT::kSmemSize, stream);
}

}  // namespace stof
