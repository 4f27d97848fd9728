// Block-wise sparse attention forward on Hopper tensor cores (sm_90a wgmma), same semantics as blockwise.cuh.
//
// One CTA = kWG warpgroups; warpgroup wg owns query rows [q0 + 64*wg, q0 + 64*wg + 64), inside one format tile row
// (tile_m % 64 == 0).  The warpgroups of a CTA may own different tile rows (tile_m = 64, kWG = 2): the CTA walks
// the union of their non-empty columns (a k-way merge of the ascending col_idx lists, uniform across the CTA),
// loads each K/V sub-block once for all warpgroups (halving L2->SM traffic), and a warpgroup whose own tile row
// has no tile in that column skips it.  Per non-empty kBlockN(=64)-key sub-block and warpgroup:
//   S(64x64, f32 regs) = Q(smem) K^T(smem)      wgmma m64n64k16, both operands K-major, 128B-swizzled
//   mask (PARTIAL bitmap / key bound / padding), online softmax in registers (mma.sync C layout == wgmma C layout)
//   O(64xD, f32 regs) += P(regs, fp16/bf16) V(smem)   wgmma m64nDk16, V as an MN-major (transposed) operand
// K/V sub-blocks stream through a kStages-deep cp.async ring (fence.proxy.async before the barrier, since wgmma
// reads shared memory through the async proxy).  No warp specialisation: several CTAs per SM overlap each
// other's softmax and MMAs.
//
// Shared-memory tiles use the canonical 128B-swizzle K-major layout: 64-element (128-byte) column blocks of
// kRows rows, 16-byte chunk c of row r at ((c ^ (r & 7)) * 16) inside the row; every tile 1024-byte aligned.
#pragma once

#include "common.cuh"
#include "wgmma_ops.cuh"

namespace stof {

template <int kHeadDim_, int kWG_, int kStages_, typename Elem_, bool kDeferPV_ = false>
struct HopperTraits {
    using Elem = Elem_;
    // kDeferPV (one warpgroup): O += P V is not waited for at the end of the step; its completion is awaited
    // together with the next S = Q K^T, so the two MMAs run back to back (the K/V prefetch moves after that wait).
    static constexpr bool kDeferPV = kDeferPV_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kWG = kWG_;
    static constexpr int kStages = kStages_;
    static constexpr int kBlockM = 64 * kWG;
    static constexpr int kBlockN = 64;
    static constexpr int kThreads = 128 * kWG;
    // head dim 64: cap registers at 128 so 4 warpgroups fit per SM (4 CTAs of 1, or 2 of 2)
    static constexpr int kMinBlocks = kHeadDim == 64 ? 4 / kWG : 1;
    static constexpr int kNI = kBlockN / 8;       // n8 column groups of S
    static constexpr int kKD = kHeadDim / 16;     // k16 steps over D
    static constexpr int kKN = kBlockN / 16;      // k16 steps over keys
    static constexpr int kDI = kHeadDim / 8;      // n8 column groups of O
    static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    static constexpr int kWordsN = kBlockN / 32;
    static_assert(kWordsN == 2, "bitmap words are loaded as one uint2 per row");
    static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
    static constexpr int kSmemKV = kBlockN * kHeadDim * 2;
    static constexpr int kSmemSize = kSmemQ + 2 * kStages * kSmemKV + 1024;  // + alignment slack
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim");
    static_assert(kSmemQ % 1024 == 0 && kSmemKV % 1024 == 0, "1024-byte aligned tiles");
    static_assert(!kDeferPV || kWG == 1, "deferred PV wait: one warpgroup per CTA");
    // S = Q K^T with Q in registers (ldmatrix once) at head dim 128, as WsTraits::kQRegs.  Not at head dim 64: under
    // its 128-register cap ptxas reuses the Q registers inside the step loop (wrong results; sass_rs_operands.py).
    static constexpr bool kQRegs = kHeadDim == 128;
};

// Byte offset of 16-byte chunk ch of row r in a 128B-swizzled K-major tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t swz128(int r, int ch) {
    return static_cast<uint32_t>((ch >> 3) * (kRows * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
           (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The two 32-key bitmap words of bitmap row a for 64-key sub-block `sub` of a tile (bm_idx: its bitmap, -1 for a
// FULL tile: all ones).  The two words are contiguous and 8-byte aligned (tile_n % 64 == 0): one 64-bit load.
__device__ __forceinline__ void row_bits(uint32_t (&bits)[2], const KernelParams& p, int bm_idx, int a, int sub) {
    uint2 wv = make_uint2(0xffffffffu, 0xffffffffu);
    if (bm_idx >= 0)
        wv = __ldg(reinterpret_cast<const uint2*>(p.bitmaps + static_cast<int64_t>(bm_idx) * (p.tile_m * p.tile_n / 32) +
                                                  a * (p.tile_n / 32) + sub * 2));
    bits[0] = wv.x;
    bits[1] = wv.y;
}

// The words of bitmap rows r and r + 8 of bitmap bm_idx (-1: all ones), 64-key sub-block `sub`; row_off: row r's
// byte offset inside a bitmap, row8: 8 rows' bytes.  32-bit byte offsets (tactic_valid keeps every bitmap offset of a
// wgmma launch below 2^32): an IMAD and two wide adds per pair of rows, where the 64-bit index arithmetic
// per row was ~20 instructions on every PARTIAL sub-block.
__device__ __forceinline__ void row_bits_pair(uint32_t (&bits)[2][2], const int32_t* bitmaps, uint32_t row_off,
                                              uint32_t row8, int bm_idx, uint32_t tile_bytes, int sub) {
    uint2 a = make_uint2(0xffffffffu, 0xffffffffu), b = a;
    if (bm_idx >= 0) {
        const uint32_t off = static_cast<uint32_t>(bm_idx) * tile_bytes + row_off + static_cast<uint32_t>(sub) * 8u;
        const char* base = reinterpret_cast<const char*>(bitmaps);
        a = __ldg(reinterpret_cast<const uint2*>(base + off));
        b = __ldg(reinterpret_cast<const uint2*>(base + (off + row8)));
    }
    bits[0][0] = a.x;
    bits[0][1] = a.y;
    bits[1][0] = b.x;
    bits[1][1] = b.y;
}

// ANDs the key bound / padding of the step's 64 keys into both rows' words (key_words; warp-uniform call).
__device__ __forceinline__ void and_key_words(uint32_t (&bits)[2][2], int n0, int kv_len, const int32_t* kpm,
                                              int lane) {
    uint32_t kw[2];
    key_words(kw, n0, kv_len, kpm, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        bits[hh][0] &= kw[0];
        bits[hh][1] &= kw[1];
    }
}

// A PRMT selector that is the identity at run time (0x3210) but not to the compiler: mask_scores permutes its packed
// word with it, so ptxas cannot trace the word's bits back to the bitmap words and re-gather them its own way (it did,
// on any packing written in plain C++: ~94 instructions per 64-key sub-block, against ~61 with the selector).
__device__ __forceinline__ uint32_t mask_selector(const KernelParams& p) {
    return 0x3210u | (static_cast<uint32_t>(p.tile_n) >> 20);  // tile_n <= 256 (stof_attn_validate): 0x3210
}

// The thread's mask word pair of one 64-key sub-block (bits[hh][w]: row hh's 32-key words, as mask_scores below), in
// the order mask_scores_packed reads: z with byte q holding row hh, word w's bits at 2 (2 hh + w) + {0, 1}, y the
// four bits R2P cannot reach (bit 7 of each byte of z) in bits 0-3.  The layout handle's lane bitmaps
// hold exactly these pairs, so a PARTIAL sub-block's mask is one 8-byte load there.
__device__ __forceinline__ uint2 pack_mask_bits(const uint32_t (&bits)[2][2], int tig, uint32_t sel) {
    uint32_t z = 0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int w = 0; w < 2; ++w) z |= ((bits[hh][w] >> (tig * 2)) & 0x03030303u) << (2 * (2 * hh + w));
    z = __byte_perm(z, 0u, sel);
    uint32_t y = (z >> 7) & 0x01010101u;
    y = (y | (y >> 7) | (y >> 14) | (y >> 21)) & 0xfu;
    return make_uint2(z, y);
}

// mask_scores for one 64-key sub-block from its packed word pair (pack_mask_bits, or a lane_bitmaps entry): the 28
// bits 8 q + 0..6 of z and the 4 bits of y, each selecting its score against -inf.
template <int kN>
__device__ __forceinline__ void mask_scores_packed(float (&s)[kN], uint2 zy, int off) {
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int w = 0; w < 2; ++w)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int bit = 2 * (2 * hh + w) + c;  // in byte q
                    const bool keep = bit == 7 ? (zy.y & (1u << q)) != 0u : (zy.x & (1u << (q * 8 + bit))) != 0u;
                    if (!keep) s[off + (w * 4 + q) * 4 + hh * 2 + c] = -INFINITY;
                }
}

// Masks one warp's two score rows (g and g + 8; wgmma/mma C layout, kNI groups of 8 columns) of each 64-key
// sub-block.  bits[hh][w]: the 32-key words of allowed keys of the row (the tile bitmap's words, all ones for a FULL
// tile, ANDed with key_words() where the key bound or padding cuts).  Column (w*4+q)*8 + 2*tig + c is bit q*8 + c of
// word w >> 2*tig.  Per sub-block the thread's 16 bits (two rows, two words) are packed into one register, byte q
// holding row hh, word w's bits at 2 (2 hh + w) + {0, 1}; then each byte is read into predicates at once (R2P: seven
// per instruction) and each score selected against its predicate.  The packed word goes through `sel`
// (mask_selector), or ptxas undoes the packing.  s[off ..) holds the sub-block's scores: off is a constant after
// unrolling (a 64-key sub-block of a 128-key step masked in place; copying it out and back cost 64 register moves
// per step).
template <int kNI, int kN>
__device__ __forceinline__ void mask_scores(float (&s)[kN], const uint32_t (&bits)[2][kNI / 4], int tig, uint32_t sel,
                                            int off = 0) {
    static_assert(kNI % 8 == 0, "whole 64-key sub-blocks");
#pragma unroll
    for (int j = 0; j < kNI / 8; ++j) {  // sub-block j: words 2j, 2j + 1
        const uint32_t sub[2][2] = {{bits[0][2 * j], bits[0][2 * j + 1]}, {bits[1][2 * j], bits[1][2 * j + 1]}};
        mask_scores_packed(s, pack_mask_bits(sub, tig, sel), off + 32 * j);
    }
}

// The multiplier of the raw scores in the exp2 FFMA when the scale is folded whatever its sign (the max is taken on
// raw scores): scale_log2 itself when positive; |scale_log2| when negative, with Q negated in shared memory first
// (flip_signs: S = -Q K^T, and softmax(s scale) = softmax(-s |scale|)); FLT_MIN for a zero scale, where every allowed
// p rounds to 1 and a masked -inf stays -inf.
__device__ __forceinline__ float folded_exp2_scale(float sl2) {
    return sl2 > 0.f ? sl2 : sl2 < 0.f ? -sl2 : 1.17549435e-38f;  // (FLT_MIN)
}

// Flips the sign bit of every fp16 / bf16 element in kIters * kThreads 16-byte chunks of shared memory from `base`
// (chunk t + i kThreads for thread t): Q negated for a negative scale, which the kernels then fold into the exp2.
template <int kIters, int kThreads>
__device__ __forceinline__ void flip_signs(uint32_t base, int t) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
        const uint32_t a = base + (t + i * kThreads) * 16;
        uint32_t x0, x1, x2, x3;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                     : "r"(a)
                     : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x0 ^ 0x80008000u),
                     "r"(x1 ^ 0x80008000u), "r"(x2 ^ 0x80008000u), "r"(x3 ^ 0x80008000u)
                     : "memory");
    }
}

// Rows [row0, row0 + kRows) of a [rows, stride_s] tensor into a kRows-row swizzled tile, by HT::kThreads threads;
// rows >= limit are zero-filled.  Each thread copies one 16-byte chunk column (ch) of rows r0, r0 + kRowStep, ...:
// kRowStep is a multiple of 8, so the swizzle pattern of its chunks is the same in every iteration and the source
// and destination addresses advance by constants (per-iteration address arithmetic would dominate the
// one-warpgroup kernel's integer work).
template <class HT, int kRows>
__device__ __forceinline__ void load_rows_async128(uint32_t s_tile, const typename HT::Elem* g, int64_t stride_s,
                                                   int row0, int limit, int tid) {
    constexpr int kRowStep = HT::kThreads / HT::kChunks;
    static_assert(HT::kThreads % HT::kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0, "copy split");
    constexpr int kIters = kRows / kRowStep;
    const int r0 = tid / HT::kChunks, ch = tid % HT::kChunks;
    const typename HT::Elem* src = g + static_cast<int64_t>(row0 + r0) * stride_s + ch * 8;
    const int64_t step = static_cast<int64_t>(kRowStep) * stride_s;
    const uint32_t dst = s_tile + swz128<kRows>(r0, ch);
    if (row0 + kRows <= limit) {
#pragma unroll
        for (int it = 0; it < kIters; ++it) cp_async16(dst + it * kRowStep * 128, src + it * step, 16);
    } else {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const bool ok = row0 + r0 + it * kRowStep < limit;
            cp_async16(dst + it * kRowStep * 128, ok ? src + it * step : g, ok ? 16 : 0);
        }
    }
}

// In-register tree reduction t[0] = op(t[0 .. 2W)), W a power of two.  Recursion on a template width, not a
// `for (w = N / 2; w >= 1; w /= 2)` loop: nvcc leaves that loop rolled at N = 16 (128-key steps), indexing t[]
// dynamically in local memory (1.5-2x slower kernels).
template <int W, int N, class Op>
__device__ __forceinline__ void tree_reduce(float (&t)[N], Op op) {
    if constexpr (W >= 1) {
#pragma unroll
        for (int i = 0; i < W; ++i) t[i] = op(t[i], t[i + W]);
        tree_reduce<W / 2>(t, op);
    }
}

// Slack of the lazy rescaling below, log2 domain: P values stay <= 2^8, exact enough in fp16/bf16 and far from
// overflow, and the final 1/l normalisation cancels whichever running max was used.
constexpr float kRescaleSlack = 8.f;

// Online softmax of one step's scores, two rows per thread (wgmma / mma C layout, kNI groups of 8 columns):
// exponentiates rS in place and updates row_max / row_sum.  The running max is only moved when a row's max grows
// by more than kRescaleSlack (FlashAttention-4's lazy rescaling); returns true (warp-uniform) when some row of the
// warp moved it, and then O must be multiplied by alpha (per row) -- most steps skip that multiply.
// kInterleaved: both rows' exps in one pass, each one's sum added as it comes, so ptxas interleaves the MUFU ops
// with the FFMA/FADD work instead of issuing them back to back; only the warp-specialised kernels gain from it.
// kRowSum = false: row_sum is left alone (the caller gets P's row sums from the tensor cores, hopper_ws.cuh).
struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};
// exp_chain (kInterleaved; hopper_ws.cuh's WsExpChain): before_exps (the caller's hook once the max is reduced:
// the MMA turns hand the tensor cores to the other consumer there), then P packed as the exps come, some groups'
// exp arguments waiting for an earlier group's packed P, so that ptxas interleaves the FFMAs and packs with the
// MUFU ops instead of issuing every FFMA first and every pack last.  NoExpChain (kLag 0, that pass not taken): rS
// keeps P unpacked (the caller packs it).
struct NoExpChain {
    static constexpr int kLag = 0;
};
template <int kNI, bool kInterleaved = false, bool kRowSum = true, class Hook = NoHook, class ExpChain = NoExpChain>
__device__ __forceinline__ bool online_softmax(float (&rS)[kNI * 4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], float mul, Hook before_exps = Hook(),
                                               ExpChain exp_chain = ExpChain()) {
    float mx[2];
    bool grow[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        // tree reductions (depth log2(2 kNI), not a 2 kNI-long dependency chain: the ncu profile showed the
        // softmax stalled on fixed-latency dependencies)
        float t[kNI];
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) t[ni] = fmaxf(rS[ni * 4 + hh * 2], rS[ni * 4 + hh * 2 + 1]);
        tree_reduce<kNI / 2>(t, [](float x, float y) { return fmaxf(x, y); });
        float m = t[0];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx[hh] = m;
        grow[hh] = m * mul > row_max[hh] * mul + kRescaleSlack;  // false for a fully masked row (-inf)
    }
    const bool rescale = __any_sync(0xffffffffu, grow[0] || grow[1]);
    float m_use[2];  // log2 domain
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        alpha[hh] = 1.f;
        if (rescale) {
            if (grow[hh]) {
                alpha[hh] = fast_exp2((row_max[hh] - mx[hh]) * mul);  // 0 when row_max was -inf
                row_max[hh] = mx[hh];
            }
            if constexpr (kRowSum) row_sum[hh] *= alpha[hh];
        }
        m_use[hh] = row_max[hh] == -INFINITY ? 0.f : row_max[hh] * mul;
        if constexpr (!kInterleaved) {
            float t[kNI];
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni) {
                const float p0 = fast_exp2(fmaf(rS[ni * 4 + hh * 2], mul, -m_use[hh]));
                const float p1 = fast_exp2(fmaf(rS[ni * 4 + hh * 2 + 1], mul, -m_use[hh]));
                rS[ni * 4 + hh * 2] = p0;
                rS[ni * 4 + hh * 2 + 1] = p1;
                t[ni] = p0 + p1;
            }
            if constexpr (kRowSum) {
                tree_reduce<kNI / 2>(t, [](float x, float y) { return x + y; });
                row_sum[hh] += t[0];
            }
        }
    }
    if constexpr (kInterleaved && ExpChain::kLag > 0) {
        // From group kLag on, every kEvery-th group's exp arguments (and the groups' up to the next such one) take
        // mul through an integer add of the sign bit of group ni - kLag's packed P, which is 0 (every P >= 0, and a
        // NaN is canonical): the same mul, but not before that pack (measured: hopper_ws_consumer.cuh, WsExpChain).
        // A float FMA by 0 would do the same, but a NaN P would then reach the thread's other row:
        // test_nan_inputs_stay_in_their_rows fails on that form.
        constexpr int kLag = ExpChain::kLag, kEvery = ExpChain::kEvery;
        before_exps();
        float mul_g = mul;
        float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // kRowSum: two chains per row
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) {
            if (ni >= kLag && ni % kEvery == 0) {
                uint32_t mb = __float_as_uint(mul);
                asm("{\n .reg .b32 t;\n shr.u32 t, %1, 31;\n add.u32 %0, %0, t;\n}"
                    : "+r"(mb)
                    : "r"(exp_chain.packed(ni - kLag)));
                mul_g = __uint_as_float(mb);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                rS[ni * 4 + j] = fast_exp2(fmaf(rS[ni * 4 + j], mul_g, -m_use[j >> 1]));
                if constexpr (kRowSum) acc[j >> 1][ni & 1] += rS[ni * 4 + j];
            }
            exp_chain.pack(ni, rS);
        }
        if constexpr (kRowSum) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) row_sum[hh] += acc[hh][0] + acc[hh][1];
        }
    } else if constexpr (kInterleaved) {
        float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // two chains per row
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // j: row j / 2, column j % 2 of group ni
                const float pv = fast_exp2(fmaf(rS[ni * 4 + j], mul, -m_use[j >> 1]));
                rS[ni * 4 + j] = pv;
                if constexpr (kRowSum) acc[j >> 1][ni & 1] += pv;
            }
        if constexpr (kRowSum) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) row_sum[hh] += acc[hh][0] + acc[hh][1];
        }
    }
    return rescale;
}

template <int kDI>
__device__ __forceinline__ void rescale_o(float (&rO)[kDI * 4], const float (&alpha)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int di = 0; di < kDI; ++di) {
            rO[di * 4 + hh * 2] *= alpha[hh];
            rO[di * 4 + hh * 2 + 1] *= alpha[hh];
        }
}

// P (fp16/bf16 pairs, wgmma A-fragment layout) from the exponentiated scores of a step.
template <class Elem, int kKN>
__device__ __forceinline__ void pack_p(uint32_t (&rP)[kKN][4], const float (&rS)[kKN * 8]) {
#pragma unroll
    for (int kn = 0; kn < kKN; ++kn) {
        rP[kn][0] = ElemTraits<Elem>::pack(rS[(2 * kn) * 4 + 0], rS[(2 * kn) * 4 + 1]);
        rP[kn][1] = ElemTraits<Elem>::pack(rS[(2 * kn) * 4 + 2], rS[(2 * kn) * 4 + 3]);
        rP[kn][2] = ElemTraits<Elem>::pack(rS[(2 * kn + 1) * 4 + 0], rS[(2 * kn + 1) * 4 + 1]);
        rP[kn][3] = ElemTraits<Elem>::pack(rS[(2 * kn + 1) * 4 + 2], rS[(2 * kn + 1) * 4 + 3]);
    }
}

// Issues O += P V for one step (V at descriptor dV, MN-major) and commits it; the caller waits.
template <int kHeadDim, class Elem, int kKN>
__device__ __forceinline__ void issue_pv(float (&rO)[kHeadDim / 2], const uint32_t (&rP)[kKN][4], uint64_t dV) {
    wgmma_fence();
#pragma unroll
    for (int kn = 0; kn < kKN; ++kn) wgmma_rs<kHeadDim, Elem>(rO, rP[kn], dV + ((kn * 16 * 128) >> 4), 1);
    wgmma_commit();
}

// Mask (bitmap words in bits, already ANDed with the key bound / padding words) and run the online softmax of one
// 64-key step, the scale folded into the exp2 (mul: folded_exp2_scale); rescales O when the running max moved.
// Warp-uniform call.
template <int kNI, int kDI>
__device__ __forceinline__ void mask_softmax_step(float (&rS)[kNI * 4], float (&rO)[kDI * 4], float (&row_max)[2],
                                                  float (&row_sum)[2], uint32_t (&bits)[2][kNI / 4], bool need_mask,
                                                  int tig, float mul, uint32_t sel) {
    if (need_mask) mask_scores<kNI>(rS, bits, tig, sel);
    float alpha[2];
    if (online_softmax<kNI>(rS, row_max, row_sum, alpha, mul)) rescale_o<kDI>(rO, alpha);
}

// 1 / (a row's sum of P), 0 for a row with no allowed key.  rcp.approx (one MUFU.RCP, within an ulp of fp32) rather
// than the IEEE division, whose FCHK and slow-path call sat on every item's epilogue: a non-empty row's sum is at
// least about 1 (its running max's P is 1 up to the exp2's rounding), so the approximation's ftz and range never
// matter, and O is rounded to fp16 / bf16 after.
template <bool kApprox = true>
__device__ __forceinline__ float inv_row_sum(float l) {
    if constexpr (kApprox) {
        float r;
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(l));
        return l > 0.f ? r : 0.f;
    } else {
        return l > 0.f ? 1.f / l : 0.f;
    }
}
// Epilogue, part 1: each thread normalises its two rows of O (row sums reduced over the quad; empty rows -> 0)
// and writes them as Elem pairs into the kRows-row swizzled tile at sTile (rows row0 + {g, g + 8}).  The first
// kDI * 4 of rO are O's; kQuadSum = false: row_sum already holds the whole rows' sums.  kApproxRcp: inv_row_sum's
// rcp.approx (the three-consumer kernels keep the division: the approximation cost them 4 more bytes of spills).
template <class Elem, int kDI, int kRows, bool kQuadSum = true, bool kApproxRcp = true, int kNO>
__device__ __forceinline__ void stage_o(const float (&rO)[kNO], const float (&row_sum)[2], uint32_t sTile,
                                        int row0, int g, int tig) {
    static_assert(kNO >= kDI * 4, "O registers");
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = row_sum[hh];
        if constexpr (kQuadSum) {
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
        }
        const float inv = inv_row_sum<kApproxRcp>(l);
        const int row = row0 + hh * 8 + g;
#pragma unroll
        for (int di = 0; di < kDI; ++di) {
            const uint32_t packed = ElemTraits<Elem>::pack(rO[di * 4 + hh * 2] * inv, rO[di * 4 + hh * 2 + 1] * inv);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sTile + swz128<kRows>(row, di) + tig * 4), "r"(packed));
        }
    }
}

// Epilogue, part 2 (after a barrier over the staging threads): rows [r0, r0 + kN) of the staged tile to O rows
// q0 + r, 16-byte stores by kThreads threads (t = 0..kThreads-1); rows >= seq_q are skipped.
template <class Elem, int kRows, int kN, int kChunks, int kThreads>
__device__ __forceinline__ void store_o(uint32_t sTile, Elem* gO, int64_t o_ss, int q0, int r0, int seq_q, int t) {
    constexpr int kIters = kN * kChunks / kThreads;
    static_assert(kN * kChunks % kThreads == 0, "store split");
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
        const int c = t + i * kThreads;
        const int r = r0 + c / kChunks, ch = c % kChunks;
        if (q0 + r < seq_q) {
            uint4 val;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                         : "r"(sTile + swz128<kRows>(r, ch)));
            *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(q0 + r) * o_ss + ch * 8) = val;
        }
    }
}

// The k-way merge of kWG tile rows' sorted column lists, one 64-key sub-block at a time: peek() gives the next column
// (INT_MAX when done) and each row's tile handle there (-1: no tile), advance() moves past one sub-block.  Walk (CRTP)
// holds c[] (each row's current column, INT_MAX when done) and provides handle(w) (the row's current tile) and
// next(p, w) (moves row w to its next tile, returns that tile's column).  MergedCursor below; the warp-specialised
// producers' WsWalk (hopper_ws.cuh).
template <class Walk, int kWG>
struct MergeWalk {
    int sub, nsub;

    __device__ __forceinline__ int peek(int (&ent)[kWG]) const {
        const Walk& self = static_cast<const Walk&>(*this);
        int j = INT_MAX;
#pragma unroll
        for (int w = 0; w < kWG; ++w) j = min(j, self.c[w]);
#pragma unroll
        for (int w = 0; w < kWG; ++w) ent[w] = (self.c[w] == j && j != INT_MAX) ? self.handle(w) : -1;
        return j;
    }
    __device__ __forceinline__ void advance(const KernelParams& p) {
        Walk& self = static_cast<Walk&>(*this);
        if (++sub < nsub) return;
        sub = 0;
        int j = INT_MAX;
#pragma unroll
        for (int w = 0; w < kWG; ++w) j = min(j, self.c[w]);
#pragma unroll
        for (int w = 0; w < kWG; ++w)
            if (self.c[w] == j && j != INT_MAX) self.c[w] = self.next(p, w);
    }
};

// The merged walk over the tile rows of the kWG warpgroups, reading the format arrays directly: a tile's handle is
// its format entry.
template <int kWG>
struct MergedCursor : MergeWalk<MergedCursor<kWG>, kWG> {
    int e[kWG], end[kWG], c[kWG];  // next entry, end, its column (INT_MAX when exhausted)

    __device__ __forceinline__ void init(const KernelParams& p, const int (&rows)[kWG], int kv_len) {
#pragma unroll
        for (int w = 0; w < kWG; ++w) {
            if (rows[w] < 0) {
                e[w] = end[w] = 0;
            } else {
                e[w] = __ldg(p.row_ptr + rows[w]);
                end[w] = __ldg(p.row_ptr + rows[w] + 1);
                // tiles entirely past the key bound contribute nothing (columns ascend)
                while (end[w] > e[w] && __ldg(p.col_idx + end[w] - 1) * p.tile_n >= kv_len) --end[w];
            }
            c[w] = e[w] < end[w] ? __ldg(p.col_idx + e[w]) : INT_MAX;
        }
        this->sub = 0;
        this->nsub = p.tile_n / 64;
    }
    __device__ __forceinline__ int handle(int w) const { return e[w]; }
    __device__ __forceinline__ int next(const KernelParams& p, int w) {
        ++e[w];
        return e[w] < end[w] ? __ldg(p.col_idx + e[w]) : INT_MAX;
    }
    // the descriptor's bitmap index of a tile handle from peek() -- warp-specialised producers
    static __device__ __forceinline__ int bitmap_of(const KernelParams& p, int handle) {
        return __ldg(p.tile_bitmap_index + handle);
    }
};

template <class HT>
__global__ void __launch_bounds__(HT::kThreads, HT::kMinBlocks) hopper_attn_fwd(const KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename HT::Elem;
    constexpr int kNI = HT::kNI, kKD = HT::kKD, kKN = HT::kKN, kDI = HT::kDI;
    constexpr int kBlockM = HT::kBlockM, kBlockN = HT::kBlockN, kStages = HT::kStages;

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sKV = sQ + HT::kSmemQ;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int wg = warp >> 2;
    const BlockWork work = block_work<kBlockM>(p);
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)
    int q_len, kv_len;
    if (!item_rows(p, b, q0, q_len, kv_len)) return;
    const int layout_row0 = (h % p.num_layouts) * p.tq;
    int rows[HT::kWG];  // flattened (layout, tile row) of each warpgroup, -1 when its rows are all >= Sq
#pragma unroll
    for (int w = 0; w < HT::kWG; ++w) rows[w] = q0 + 64 * w < q_len ? layout_row0 + (q0 + 64 * w) / p.tile_m : -1;
    const int my_a0 = (q0 + 64 * wg) % p.tile_m;  // first bitmap row of this warpgroup inside its tile

    const ItemTensors<Elem> io = item_tensors<Elem>(p, b, h);
    const Elem *gQ = io.q, *gK = io.k, *gV = io.v;
    Elem* const gO = io.o;
    const int32_t* const kpm = io.kpm;
    const float sl2 = p.scale_log2;
    // The scale is folded into the exp2 FFMA whatever its sign (folded_exp2_scale; Q negated below for scale < 0),
    // so the step loop carries no pre-scaled path.
    const bool negate_q = sl2 < 0.f;
    const float mul = folded_exp2_scale(sl2);

    // Prologue: Q, then the first kStages-1 K/V sub-blocks of the merged walk.
    load_rows_async128<HT, kBlockM>(sQ, gQ, p.q_ss, q0, q_len, tid);
    cp_async_commit();
    MergedCursor<HT::kWG> cur, pre;
    cur.init(p, rows, kv_len);
    pre = cur;
    auto load_kv = [&](int j, int sub, int stage) {
        const int n0 = j * p.tile_n + sub * kBlockN;
        const uint32_t st = sKV + stage * 2 * HT::kSmemKV;
        load_rows_async128<HT, kBlockN>(st, gK, p.k_ss, n0, kv_len, tid);
        load_rows_async128<HT, kBlockN>(st + HT::kSmemKV, gV, p.v_ss, n0, kv_len, tid);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        int ent[HT::kWG];
        const int j = pre.peek(ent);
        if (j != INT_MAX) {
            load_kv(j, pre.sub, s);
            pre.advance(p);
        }
        cp_async_commit();
    }
    if (negate_q) {  // Q's copies are the oldest group; every thread's landed before any thread flips signs
        cp_async_wait<kStages - 1>();
        __syncthreads();
        static_assert(HT::kSmemQ % (16 * HT::kThreads) == 0, "Q chunks per thread");
        flip_signs<HT::kSmemQ / (16 * HT::kThreads), HT::kThreads>(sQ, tid);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    }

    float rO[kDI * 4];
    float rS[kNI * 4];
#pragma unroll
    for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
#pragma unroll
    for (int i = 0; i < kNI * 4; ++i) rS[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int warp_row0 = warp * 16;  // == 64*wg + 16*(warp % 4): the wgmma accumulator rows of this warp
    const uint64_t dQ0 = gmma_desc(sQ + wg * 64 * 128, 16, 1024);
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    const uint64_t dV0 = gmma_desc(sKV + HT::kSmemKV, kBlockN * 128, 1024);
    uint32_t rQ[kKD][4];  // HT::kQRegs: this warp's 16 Q rows (A fragments, one per k16 block)
    if constexpr (HT::kQRegs) {
        if (!negate_q) {  // (negated: landed and synchronised above) Q's copies are the oldest group
            cp_async_wait<kStages - 1>();
            __syncthreads();
        }
        // rows 16 warp + (lane & 15), columns 16 kk + 8 (lane >> 4): ldmatrix.x4 gives the A fragment (rows g / g + 8,
        // columns 2 tig / 8 + 2 tig), as in ws_consume_items
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
            ldmatrix_x4(rQ[kk], sQ + swz128<kBlockM>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }

    for (int it = 0;; ++it) {
        int ent[HT::kWG];
        const int j = cur.peek(ent);
        if (j == INT_MAX) break;
        const int sub = cur.sub;
        cur.advance(p);
        cp_async_wait<kStages - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        auto prefetch = [&]() {
            int pent[HT::kWG];
            const int pj = pre.peek(pent);
            if (pj != INT_MAX) {
                load_kv(pj, pre.sub, (it + kStages - 1) % kStages);
                pre.advance(p);
            }
            cp_async_commit();
        };
        if constexpr (!HT::kDeferPV) prefetch();
        int my_ent = ent[0];
#pragma unroll
        for (int w = 1; w < HT::kWG; ++w)
            if (wg == w) my_ent = ent[w];
        if (my_ent < 0) continue;  // this warpgroup's tile row has no tile here (warpgroup-uniform)

        const int n0 = j * p.tile_n + sub * kBlockN;
        const int bm_idx = __ldg(p.tile_bitmap_index + my_ent);
        // the bitmap words (a PARTIAL tile's; all ones otherwise) and the key bound / padding words, loaded before
        // the S MMA so that their latency overlaps it; the scores are masked only where either cuts (padding that
        // leaves the step's keys alone costs two loads and ballots, not the masking)
        uint32_t bits[2][HT::kWordsN];
        row_bits_pair(bits, p.bitmaps, static_cast<uint32_t>((my_a0 + (warp & 3) * 16 + g) * (p.tile_n / 8)),
                      p.tile_n, bm_idx, static_cast<uint32_t>(p.tile_m * p.tile_n / 8), sub);
        static_assert(kBlockN == 64, "key_words covers 64 keys");
        if (n0 + kBlockN > kv_len || kpm != nullptr) and_key_words(bits, n0, kv_len, kpm, lane);  // warpgroup-uniform
        // without a bitmap, bits are the key words: warp ballots, so the same in every lane
        const bool need_mask = bm_idx >= 0 || (bits[0][0] & bits[0][1]) != 0xffffffffu;
        // descriptors = base + (byte offset >> 4): shared addresses stay below 2^18, so the 14-bit field never carries
        const uint64_t stage_off = static_cast<uint64_t>(((it % kStages) * 2 * HT::kSmemKV) >> 4);
        const uint64_t dK = dK0 + stage_off, dV = dV0 + stage_off;

        // S = Q K^T
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            const uint64_t da = dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4);
            const uint64_t db = dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4);
            if constexpr (HT::kQRegs)
                wgmma_rs_kb<64, Elem>(rS, rQ[kk], db, kk > 0 ? 1 : 0);
            else
                wgmma_ss<64, Elem>(rS, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();  // S (and, deferred, the previous step's P V)
        fence_regs(rS);
        if constexpr (HT::kDeferPV) {
            fence_regs(rO);
            __syncthreads();  // every warp's P V of the previous step is done: its K/V stage may be refilled
            prefetch();
        }

        mask_softmax_step<kNI, kDI>(rS, rO, row_max, row_sum, bits, need_mask, tig, mul, mask_selector(p));

        // O += P V
        uint32_t rP[kKN][4];
        pack_p<Elem, kKN>(rP, rS);
        issue_pv<HT::kHeadDim, Elem, kKN>(rO, rP, dV);
        if constexpr (!HT::kDeferPV) {
            wgmma_wait<0>();
            fence_regs(rO);
        } else {
            fence_regs(rO);
        }
    }
    wgmma_wait<0>();
    fence_regs(rO);

    // Epilogue
    cp_async_wait<0>();
    __syncthreads();
    stage_o<Elem, kDI, kBlockM>(rO, row_sum, sQ, warp_row0, g, tig);
    __syncthreads();
    store_o<Elem, kBlockM, kBlockM, HT::kChunks, HT::kThreads>(sQ, gO, p.o_ss, q0, 0, q_len, tid);
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

// Pipelined variant (one warpgroup per CTA), FlashAttention-3's intra-warpgroup overlap in the order of the
// warp-specialised consumer (hopper_ws.cuh): S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued together, the softmax
// of S_i while P V runs.  The K/V ring is kStages >= 3 deep (V_{i-1} is still read while tile i is).
template <class HT>
__global__ void __launch_bounds__(HT::kThreads, HT::kHeadDim == 64 ? 3 : 2) hopper_attn_fwd_pipe(const KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename HT::Elem;
    constexpr int kNI = HT::kNI, kKD = HT::kKD, kKN = HT::kKN, kDI = HT::kDI;
    constexpr int kBlockM = HT::kBlockM, kBlockN = HT::kBlockN, kStages = HT::kStages;
    static_assert(HT::kWG == 1 && kStages >= 3, "pipelined variant: one warpgroup, >= 3 stages");

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sKV = sQ + HT::kSmemQ;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    RowItem item;
    if (!row_item<kBlockM>(p, item)) return;
    const int h = item.h, b = item.b, q0 = item.q0, q_len = item.q_len, kv_len = item.kv_len;
    const int a0 = item.walk.a0, e_begin = item.walk.e_begin, e_end = item.walk.e_end;
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
    const float sl2 = p.scale_log2;
    const bool fold = sl2 > 0.f;
    const float mul = fold ? sl2 : 1.f;

    auto key_start = [&](int it) {
        return __ldg(p.col_idx + e_begin + it / nsub) * p.tile_n + (it % nsub) * kBlockN;
    };
    auto load_kv = [&](int it) {
        const int n0 = key_start(it);
        const uint32_t st = sKV + (it % kStages) * 2 * HT::kSmemKV;
        load_rows_async128<HT, kBlockN>(st, gK, p.k_ss, n0, kv_len, tid);
        load_rows_async128<HT, kBlockN>(st + HT::kSmemKV, gV, p.v_ss, n0, kv_len, tid);
    };
    const uint64_t dQ0 = gmma_desc(sQ, 16, 1024);
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    const uint64_t dV0 = gmma_desc(sKV + HT::kSmemKV, kBlockN * 128, 1024);
    float rO[kDI * 4];
    float rS[kNI * 4];
    uint32_t rP[kKN][4];
#pragma unroll
    for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int warp_row0 = warp * 16;

    auto issue_s = [&](int it) {  // S = Q K_it^T
        const uint64_t dK = dK0 + static_cast<uint64_t>(((it % kStages) * 2 * HT::kSmemKV) >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
            wgmma_ss<64, Elem>(rS, dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4),
                               dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4), kk > 0 ? 1 : 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int it) {  // O += P_it V_it
        const uint64_t dV = dV0 + static_cast<uint64_t>(((it % kStages) * 2 * HT::kSmemKV) >> 4);
        wgmma_fence();
#pragma unroll
        for (int kn = 0; kn < kKN; ++kn) wgmma_rs<HT::kHeadDim, Elem>(rO, rP[kn], dV + ((kn * 16 * 128) >> 4), 1);
        wgmma_commit();
    };
    // mask + online softmax of S_it (leaves P in rS); true when O must be rescaled by alpha
    auto softmax = [&](int it, float (&alpha)[2]) -> bool {
        const int e = e_begin + it / nsub;
        const int sub = it % nsub;
        const int n0 = __ldg(p.col_idx + e) * p.tile_n + sub * kBlockN;
        const int bm_idx = __ldg(p.tile_bitmap_index + e);
        if (!fold) {
#pragma unroll
            for (int i = 0; i < kNI * 4; ++i) rS[i] *= sl2;
        }
        if (bm_idx >= 0 || n0 + kBlockN > kv_len || kpm != nullptr) {
            uint32_t bits[2][HT::kWordsN];
            row_bits_pair(bits, p.bitmaps, static_cast<uint32_t>((a0 + warp_row0 + g) * (p.tile_n / 8)), p.tile_n,
                          bm_idx, static_cast<uint32_t>(p.tile_m * p.tile_n / 8), sub);
            if (n0 + kBlockN > kv_len || kpm != nullptr) and_key_words(bits, n0, kv_len, kpm, tid & 31);
            mask_scores<kNI>(rS, bits, tig, mask_selector(p));
        }
        return online_softmax<kNI>(rS, row_max, row_sum, alpha, mul);
    };

    // Stage of tile t: t % kStages.  The ring holds tiles i - 1 (its V still read by P_{i-1} V_{i-1}), i, and
    // kStages - 2 tiles of look-ahead: at step i, tile i + kStages - 2 goes into the stage of tile i - 2 (whose
    // P V completed in step i - 1).
    load_rows_async128<HT, kBlockM>(sQ, gQ, p.q_ss, q0, q_len, tid);
    cp_async_commit();
#pragma unroll
    for (int t = 0; t < kStages - 2; ++t) {
        if (t < n_iter) load_kv(t);
        cp_async_commit();
    }

    // Step i: S_i and P_{i-1} V_{i-1} in flight together; the softmax of S_i runs while P V does.  Every O
    // rescale and P write happens with no wgmma in flight (ptxas serialises all wgmma of a kernel that defines
    // an accumulator register between a wgmma's issue and its wait: warning C7515).
    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<kStages - 3>();  // tile it (and Q) resident for this thread
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // every thread's copies are visible, and every warp finished step it - 1 (so P_{it-2} V_{it-2}, awaited
        // there, no longer reads the stage the prefetch below overwrites)
        __syncthreads();
        if (it + kStages - 2 < n_iter) load_kv(it + kStages - 2);
        cp_async_commit();
        issue_s(it);
        if (it > 0) issue_pv(it - 1);
        if (it > 0) {
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        fence_regs(rS);
        float alpha[2];
        const bool rescale = softmax(it, alpha);
        wgmma_wait<0>();
        fence_regs(rO);
        if (rescale) rescale_o<kDI>(rO, alpha);
        pack_p<Elem, kKN>(rP, rS);
    }
    if (n_iter > 0) {
        issue_pv(n_iter - 1);
        wgmma_wait<0>();
        fence_regs(rO);
    }

    // Epilogue
    cp_async_wait<0>();
    __syncthreads();
    stage_o<Elem, kDI, kBlockM>(rO, row_sum, sQ, warp_row0, g, tig);
    __syncthreads();
    store_o<Elem, kBlockM, kBlockM, HT::kChunks, HT::kThreads>(sQ, gO, p.o_ss, q0, 0, q_len, tid);
#else
    __trap();
#endif
}

template <class HT>
cudaError_t launch_hopper_pipe(const KernelParams& params, cudaStream_t stream) {
    return launch_scheduled<HT::kBlockM, HT::kHeadDim>(hopper_attn_fwd_pipe<HT>, params, HT::kThreads, HT::kSmemSize,
                                                       stream);
}

template <class HT>
cudaError_t launch_hopper(const KernelParams& params, cudaStream_t stream) {
    return launch_scheduled<HT::kBlockM, HT::kHeadDim>(hopper_attn_fwd<HT>, params, HT::kThreads, HT::kSmemSize,
                                                       stream);
}

}  // namespace stof
