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

// kSplit (the split tactics): gridDim.x holds kv_splits slices per query block; the CTA walks its slice of the row's
// sub-blocks and writes its normalised fp32 output and log-sum-exp to p.split_ws for block_split_merge.
template <class KT, bool kSplit = false>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocks) block_attn_fwd(const KernelParams p) {
    using Elem = typename KT::Elem;
    constexpr int kMI = KT::kMI, kNI = KT::kNI, kKD = KT::kKD, kKN = KT::kKN, kDI = KT::kDI;
    constexpr int kBlockM = KT::kBlockM, kBlockN = KT::kBlockN, kStages = KT::kStages;

    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem);
    const uint32_t sKV = sQ + KT::kSmemQ;  // stage s: K at sKV + 2*s*kSmemKV, V right after

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates
    BlockWork work;
    int split = 0;
    if constexpr (kSplit) {
        const int nqb = static_cast<int>(gridDim.x) / p.kv_splits;
        split = static_cast<int>(blockIdx.x) % p.kv_splits;
        const int64_t pair = blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z;
        work = block_work_at<kBlockM>(p, blockIdx.x / p.kv_splits + nqb * pair, nqb);
    } else {
        work = block_work<kBlockM>(p);  // longest rows first (common.cuh)
    }
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)
    int q_len, kv_len;
    if (!item_rows(p, b, q0, q_len, kv_len)) return;
    const RowWalk walk = row_walk(p, h, q0, kv_len);  // stored tiles of the row, past the key bound dropped
    const int a0 = walk.a0, e_begin = walk.e_begin, e_end = walk.e_end;  // a0: first bitmap row of this CTA
    const int nsub = p.tile_n / kBlockN;
    // sub-blocks [it_base, it_base + n_iter) of the row: all of them, or this CTA's slice
    const int n_all = (e_end - e_begin) * nsub;
    const int it_base = kSplit ? static_cast<int>(static_cast<int64_t>(n_all) * split / p.kv_splits) : 0;
    const int n_iter =
        kSplit ? static_cast<int>(static_cast<int64_t>(n_all) * (split + 1) / p.kv_splits) - it_base : n_all;

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
        const int e = e_begin + (it + it_base) / nsub;
        return __ldg(p.col_idx + e) * p.tile_n + ((it + it_base) % nsub) * kBlockN;
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

        const int e = e_begin + (it + it_base) / nsub;
        const int sub = (it + it_base) % nsub;
        const int n0 = __ldg(p.col_idx + e) * p.tile_n + sub * kBlockN;
        const int bm_idx = __ldg(p.tile_bitmap_index + e);
        // Bitmap words of this thread's rows (a PARTIAL tile's; all ones otherwise) and the key bound / padding of the
        // sub-block's 64 keys as two words (two loads and ballots per thread, not a load per column), both issued
        // before the MMAs so that their latency overlaps.  The scores are masked only where either cuts: padding
        // that leaves the sub-block's keys alone costs the ballots, not the masking.
        uint32_t bits[kMI][2][KT::kWordsN];
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
        static_assert(kBlockN == 64, "key_words covers 64 keys");
        uint32_t kw[2] = {0xffffffffu, 0xffffffffu};
        if (n0 + kBlockN > kv_len || kpm != nullptr) key_words(kw, n0, kv_len, kpm, lane);  // CTA-uniform branch
        const bool need_mask = bm_idx >= 0 || (kw[0] & kw[1]) != 0xffffffffu;  // the ballots are warp-uniform

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
                    const bool key_ok = (kw[col >> 5] >> (col & 31)) & 1u;
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

    cp_async_wait<0>();
    // each of the thread's rows: its full sum (the quad's four partial sums) and 1 / sum (0: no allowed key)
    float row_l[kMI][2], row_inv[kMI][2];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = row_sum[mi][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            row_l[mi][hh] = l;
            row_inv[mi][hh] = l > 0.f ? 1.f / l : 0.f;
        }
    if constexpr (kSplit) {
        // The slice's rows in fp32 at its slot of split_ws (slots in (batch, head, query block, slice) order), then
        // each row's log-sum-exp (log2 domain; -inf when the slice allows no key of the row) after all slots' rows.
        const int nqb = static_cast<int>(gridDim.x) / p.kv_splits;
        const int64_t n_slots = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
        const int64_t slot = ((static_cast<int64_t>(b) * p.heads + h) * nqb + qb) * p.kv_splits + split;
        float* ws_o = p.split_ws + slot * kBlockM * KT::kHeadDim;
        float* ws_lse = p.split_ws + n_slots * kBlockM * KT::kHeadDim + slot * kBlockM;
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = warp_row0 + mi * 16 + hh * 8 + g;
                if (q0 + row >= q_len) continue;
                const float inv = row_inv[mi][hh];
#pragma unroll
                for (int di = 0; di < kDI; ++di)
                    *reinterpret_cast<float2*>(ws_o + row * KT::kHeadDim + di * 8 + tig * 2) =
                        make_float2(rO[mi][di][hh * 2] * inv, rO[mi][di][hh * 2 + 1] * inv);
                const float l = row_l[mi][hh];
                if (tig == 0) ws_lse[row] = l > 0.f ? row_max[mi][hh] + __log2f(l) : -INFINITY;
            }
        return;
    }

    // Epilogue: normalise, stage through sQ (swizzled), 16-byte coalesced stores of the in-range rows.
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float inv = row_inv[mi][hh];
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

// The split tactics' merge: one warp per query row of every work item.  Lane s reads slice s's log-sum-exp; the row
// is the slices' outputs weighted by 2^(lse_s - max) over their sum (zeros when no slice allows a key).  The lanes
// read the slices' rows as float4 chunks, 32 / (D / 4) slices per instruction, all loads of a lane independent.
constexpr int kMergeWarps = 4;
template <class KT>
__global__ void __launch_bounds__(kMergeWarps * 32) block_split_merge(const KernelParams p, int nqb) {
    using Elem = typename KT::Elem;
    constexpr int D = KT::kHeadDim, kBlockM = KT::kBlockM;
    constexpr int kChunks = D / 4;               // float4 chunks per row: 16 or 32
    constexpr int kSliceStep = 32 / kChunks;     // slices read per instruction: 2 or 1
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t n_items = static_cast<int64_t>(nqb) * p.heads * p.batch;
    const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kMergeWarps + warp;
    if (row_id >= n_items * kBlockM) return;
    const int64_t item = row_id / kBlockM;
    const int row = static_cast<int>(row_id - item * kBlockM);
    const int qb = static_cast<int>(item % nqb);
    const int64_t hb = item / nqb;
    const int h = static_cast<int>(hb % p.heads), b = static_cast<int>(hb / p.heads);
    const int q0 = qb * kBlockM;
    int q_len, kv_len;
    // the rows the attention kernel wrote (it skips the same ones)
    if (q0 >= p.seq_q || !item_rows(p, b, q0, q_len, kv_len) || q0 + row >= q_len) return;
    const int n_split = p.kv_splits;
    const int64_t slot0 = item * n_split;
    const float* lse_all = p.split_ws + n_items * n_split * kBlockM * D;
    const float lse = lane < n_split ? lse_all[(slot0 + lane) * kBlockM + row] : -INFINITY;
    float m = lse;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float w = m == -INFINITY ? 0.f : exp2f(lse - m);
    float w_sum = w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o);
    const int chunk = lane % kChunks, s_first = lane / kChunks;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* src = reinterpret_cast<const float4*>(p.split_ws) + (slot0 * kBlockM + row) * kChunks + chunk;
#pragma unroll 4
    for (int s0 = 0; s0 < n_split; s0 += kSliceStep) {  // the same trip count in every lane (the shuffle)
        const int s = s0 + s_first;
        const float ws = __shfl_sync(0xffffffffu, w, s & 31);  // 0 past n_split (lane s holds no slice)
        if (ws != 0.f) {
            const float4 v = src[static_cast<int64_t>(s) * kBlockM * kChunks];
            acc.x += ws * v.x, acc.y += ws * v.y, acc.z += ws * v.z, acc.w += ws * v.w;
        }
    }
#pragma unroll
    for (int o = kChunks; o < 32; o <<= 1) {  // the lanes of one chunk hold different slices: sum them
        acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
        acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
        acc.z += __shfl_xor_sync(0xffffffffu, acc.z, o);
        acc.w += __shfl_xor_sync(0xffffffffu, acc.w, o);
    }
    if (lane >= kChunks) return;
    const float inv = w_sum > 0.f ? 1.f / w_sum : 0.f;
    Elem* gO = static_cast<Elem*>(p.o) + b * p.o_sb + h * p.o_sh;
    if (p.seq_offsets != nullptr) gO += packed_row0(p, b) * p.o_ss;
    *reinterpret_cast<uint2*>(gO + static_cast<int64_t>(q0 + row) * p.o_ss + chunk * 4) =
        make_uint2(ElemTraits<Elem>::pack(acc.x * inv, acc.y * inv), ElemTraits<Elem>::pack(acc.z * inv, acc.w * inv));
}

// The split tactics' launch: the slices (no row or pair order: every item's slices start together and the grid is
// at most two CTAs per SM), then the merge.  Without a split (kv_splits 1 or no workspace) the plain kernel.
template <class KT>
cudaError_t launch_block_split(const KernelParams& params, cudaStream_t stream) {
    if (params.kv_splits < 2 || params.split_ws == nullptr) return launch_block<KT>(params, stream);
    KernelParams p = params;
    p.row_order = nullptr;
    p.pair_order = nullptr;
    if (KT::kSmemSize > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(block_attn_fwd<KT, true>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize, KT::kSmemSize);
        if (err != cudaSuccess) return err;
    }
    dim3 grid = schedule_grid<KT::kBlockM, KT::kHeadDim>(p);
    const int nqb = static_cast<int>(grid.x);
    grid.x *= p.kv_splits;
    block_attn_fwd<KT, true><<<grid, KT::kThreads, KT::kSmemSize, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const int64_t rows = static_cast<int64_t>(nqb) * p.heads * p.batch * KT::kBlockM;
    block_split_merge<KT><<<static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps), kMergeWarps * 32, 0,
                            stream>>>(p, nqb);
    return cudaGetLastError();
}

}  // namespace stof
