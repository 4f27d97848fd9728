// The warp-specialised kernels' shapes (WsTraits: tile, ring, registers, shared memory and the features each shape
// takes) and what their producer hands the consumers with each ring stage: the step and its descriptor.
#pragma once

#include <type_traits>

#include "hopper.cuh"

namespace stof {

template <int kHeadDim_, int kStages_, int kSub_, typename Elem_, bool kTma_ = false, int kConsumers_ = 2>
struct WsTraits {
    using Elem = Elem_;
    static constexpr bool kTma = kTma_;  // producer: one lane issuing TMA boxes instead of 128 threads' cp.async
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kStages = kStages_;
    static constexpr int kSub = kSub_;  // 64-key sub-blocks per step
    static constexpr int kConsumers = kConsumers_;  // 2, or 3 (FlashAttention-3's D=64 shape; TMA producer only)
    static_assert(kConsumers == 2 || (kConsumers == 3 && kTma), "consumers");
    static constexpr int kBlockM = 64 * kConsumers;
    static constexpr int kBlockN = 64 * kSub;
    static constexpr int kThreads = 128 * (kConsumers + 1);
    // 2 consumers: the unrolled cp.async address arithmetic spills below ~72; 128 * 72 + 256 * 216 = 64,512.
    // 3 consumers (512 threads, 128 registers each at launch): 128 * 32 + 384 * 160 = 65,536.
    static constexpr int kProducerRegs = kConsumers == 2 ? 72 : 32;
    static constexpr int kConsumerRegs = kConsumers == 2 ? 216 : 160;
    static constexpr int kNI = kBlockN / 8;
    static constexpr int kKD = kHeadDim / 16;
    static constexpr int kKN = kBlockN / 16;
    static constexpr int kDI = kHeadDim / 8;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
    static constexpr int kSmemKV = kBlockN * kHeadDim * 2;  // one of K or V, one stage
    // Head dim 128 with 128-key steps (tactic 23): S, P and O take 160 of the consumers' registers, so Q stays in
    // shared memory, and two 64 KB stages fit beside two Q buffers.  A stage's K and V complete and are released
    // apart (K once S is done, V once P V is): held for both until P V ends, two stages leave no room to prefetch
    // (causal 17-23 % slower than tactic 22 that way, 2-6 % faster split).  TMA producer only; the cp.async
    // producer keeps one barrier pair per stage.
    static constexpr bool kWide = kHeadDim == 128 && kSub == 2;
    static constexpr bool kSplitKV = kWide && kTma;
    static constexpr int kRingBars = (kSplitKV ? 4 : 2) * kStages;  // full[], empty[] (K, or K and V), full_v[], empty_v[]
    static constexpr int kSmemBar = 8 * kRingBars;
    // the ring's mbarriers from sBar: stage s's K (with kSplitKV) or K and V (without) completing and released,
    // and with kSplitKV its V's
    static __device__ __forceinline__ uint32_t full_k(uint32_t sBar, int s) { return sBar + 8 * s; }
    static __device__ __forceinline__ uint32_t empty_k(uint32_t sBar, int s) { return sBar + 8 * (kStages + s); }
    static __device__ __forceinline__ uint32_t full_v(uint32_t sBar, int s) {
        return kSplitKV ? sBar + 8 * (2 * kStages + s) : full_k(sBar, s);
    }
    static __device__ __forceinline__ uint32_t empty_v(uint32_t sBar, int s) {
        return kSplitKV ? sBar + 8 * (3 * kStages + s) : empty_k(sBar, s);
    }
    static constexpr int kSmemDesc = 64 * kStages;           // a step descriptor per stage (kWsDescBytes)
    static constexpr int kSmemWalk = 2 * 32 * 8;             // the two-consumer TMA producer's walk (WsWalk)
    // Row sums of P on the tensor cores: P V runs with N = kHeadDim + 8 against a block of ones after the ring, so
    // the softmax (the bottleneck at head dim 64) loses its FADDs and quad shuffles (three consumers too: FADD sums
    // measure 5.5 % slower there).  Not at 128: no room in the LBO.
    static constexpr bool kSumMma = kHeadDim == 64;
    static constexpr int kON = kHeadDim + (kSumMma ? 8 : 0);  // P V's N
    static constexpr int kSmemOnes = kSumMma ? kBlockN * 128 : 0;
    static constexpr int kOnesOffset = 2 * kStages * kSmemKV;  // from the ring's start
    static constexpr int kSmemRing = kOnesOffset + kSmemOnes;  // K/V stages, then the ones
    // each stage's V descriptor's LBO (14 bits of 16-byte units) reaches the ones
    static_assert(!kSumMma || kOnesOffset - kSmemKV < (1 << 18), "ones block beyond the LBO field");
    static constexpr int kSmemSize = kSmemQ + kSmemRing + kSmemBar + kSmemDesc + kSmemWalk + 1024;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim");
    static_assert(kSub == 1 || kSub == 2, "64 or 128 keys per step");
    static_assert(!kSplitKV || kConsumers == 2, "split K/V barriers: the two-consumer kernels");
    // A second producer warp starts the persistent kernel's items (claim, Q, walk) and stores their O by TMA, so
    // neither sits on the K/V stream nor on the consumers' epilogue.
    static constexpr bool kSchedWarp = kConsumers == 2 && kTma;
    // persistent form: kQBufs Q buffers, the ring, its kRingBars + q_full/q_empty[kQBufs] mbarriers, an item
    // slot per Q buffer; kSchedWarp: per Q buffer a walk window and record, and kQBufs + 1 mbarriers
    static constexpr int persist_smem(int qbufs) {
        return qbufs * kSmemQ + kSmemRing + 8 * (kRingBars + 2 * qbufs) + 16 * qbufs + kSmemDesc + kSmemWalk + 1024 +
               (kSchedWarp ? qbufs * (kSmemWalk + 128) + 8 * (1 + qbufs) : 0);  // 128: kWsRecBytes
    }
    // Consumers chain their work items (ws_consume_items) at head dim 64; at 128 chaining is slower (registers), so
    // those finish each item first.
    static constexpr bool kChainItems = kHeadDim == 64;
    // Chained consumers release an item's Q buffer only at the next item's first step; with two buffers the producer
    // then waits to load the next Q (sliding +12 %), so they get three.
    static constexpr int kQBufs = kChainItems ? 3 : 2;
    // A consumer runs only the steps from its first tile of an item to its last (the descriptors' more_w): with
    // three consumers causal and banded items have steps where one consumer has no tile.  Two consumers gain nothing.
    static constexpr bool kSkip = kConsumers == 3;
    static_assert(!kChainItems || persist_smem(3) <= 227 * 1024, "shared memory for three Q buffers");
    // S = Q K^T with the consumer's Q rows in registers (ldmatrix once per item): the S MMA reads only K from shared
    // memory and its loop loses the Q descriptors.  Not with three consumers (160 registers each).
    static constexpr bool kQRegs = kConsumers == 2 && !kWide;
    // MMA turns (FlashAttention-3's ping-pong): a consumer issues a step's MMAs once the other has reduced its max
    // (named barriers 3 + w), so they run beside the other's exps; beside FFMA/FMNMX work both would slow down.
    // Only with 128-key steps and a 4-stage ring (tactic 24); needs the row sums on the tensor cores (tactic 23 at
    // head dim 128, sums on the CUDA cores: 3 % slower with turns).  Three consumers gain nothing from a ring of
    // turns, passed after the max or right after the issue (tactic 29, causal S=8192: within 1 % of none).
    static constexpr bool kTurns = kConsumers == 2 && kSumMma && kSub == 2 && kStages >= 4;
    // An item's first P V overwrites O (scale-d 0) instead of adding to a zeroed O: no accumulator zeroing between
    // items.  Head dim 64 only: at 128 ptxas then moves the epilogue's registers onto Q's (sass_rs_operands.py).
    static constexpr bool kPvOverwrite = kHeadDim == 64;
    static constexpr int kSmemPersist = persist_smem(kQBufs);
    static_assert(kSmemSize <= 227 * 1024 && kSmemPersist <= 227 * 1024, "shared memory");
    // setmaxnreg moves registers inside what the CTA got at launch (ptxas: 65536 / kThreads, rounded down to 8)
    static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * ((65536 / kThreads) & ~7),
                  "setmaxnreg budget");
};

// The block of ones P V's extra columns read (WT::kSumMma), written by all threads before the CTA's first barrier.
template <class WT>
__device__ __forceinline__ void ws_fill_ones(uint32_t sKV, int tid) {
    if constexpr (WT::kSumMma) {
        const uint32_t one = std::is_same<typename WT::Elem, __half>::value ? 0x3C003C00u : 0x3F803F80u;
        const uint32_t sOnes = sKV + WT::kOnesOffset;
        for (int i = tid; i < WT::kSmemOnes / 16; i += WT::kThreads)
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(sOnes + 16 * i), "r"(one) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // read by wgmma (async proxy)
    }
}

// One step of the merged walk: up to kSub sub-blocks; n0 = first key (-1: absent), sub = the 64-key sub-block
// inside its tile, ent[w][h] = consumer w's tile there as the cursor's handle (-1: none; Cursor::bitmap_of gives
// its tile_bitmap_index).
template <int kSub, int kC = 2>
struct WsStep {
    int n0[kSub], sub[kSub], ent[kC][kSub];
};

// The step descriptor the producer publishes with each ring stage (64 bytes of shared memory per stage, written
// before the stage's full-barrier arrival, which releases it): the step's sub-blocks and, per consumer, the bitmap
// index of its tile there.  The consumers read it instead of walking the tile lists: the walk's dependent index
// loads would stall them on every step.
//   int n0[2]      first key of sub-block h (-1: absent)                             bytes  0..15 (with sub)
//   int sub[2]     the sub-block's 64-key index inside its tile
//   int bm[2][2]   [consumer][h] for consumers 0, 1: tile_bitmap_index of the          bytes 16..31
//                  consumer's entry (-1: FULL), -2: no tile there
//   int more       1 when the work item has a further step                            bytes 32..35
//   int more_w     bit w: consumer w has a tile in a further step (ws_more_mask;     bytes 36..39
//                  WsTraits::kSkip kernels only)
//   int bm2[2]     consumer 2's (three-consumer kernels)                              bytes 40..47
//   uint kw[2][2]  [h]: sub-block h's "key allowed" words (key_words; two-consumer   bytes 48..63
//                  TMA kernels with a key padding mask: WsKeys)
// With those words, n0[h] is -65 when they allow every key of sub-block h: the consumers test n0 + 64 against -1
// then (the key bound of a padding mask), so only the sub-blocks that padding cuts are masked.
constexpr int kWsDescBytes = 64;

// Batch b's row of key_padding_mask (nullptr: none).
__device__ __forceinline__ const int32_t* ws_kpm_row(const KernelParams& p, int b) {
    return p.key_padding_mask != nullptr ? p.key_padding_mask + static_cast<int64_t>(b) * p.seq_k : nullptr;
}

// The padding of a step's keys as the producer warp reads it for the descriptor (two-consumer TMA kernels with a
// key_padding_mask; the cp.async form, run with key_lengths, reads the mask in its consumers): the consumers then mask only the sub-blocks that padding cuts, with words from shared memory;
// a FULL sub-block without padding goes unmasked, as it does without a padding mask.  (Read by each consumer
// thread on every sub-block instead, the mask's loads and ballots made 24 slower than the one-warpgroup tactics on
// padded batches.)  Every lane of the warp computes it (ballots); n0 < 0 (an absent sub-block) reads as cut.
template <int kSub>
struct WsKeys {
    uint32_t kw[kSub][2];
    int cut;  // bit h: sub-block h has a key the words exclude
};
template <int kSub, int kC>
__device__ __forceinline__ WsKeys<kSub> ws_step_keys(const WsStep<kSub, kC>& st, int kv_len, const int32_t* kpm,
                                                     int lane) {
    WsKeys<kSub> k;
    k.cut = 0;
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
        key_words(k.kw[h], st.n0[h] >= 0 ? st.n0[h] : kv_len, kv_len, kpm, lane);  // (absent: no key allowed)
        k.cut |= (k.kw[h][0] & k.kw[h][1]) != 0xffffffffu ? 1 << h : 0;
    }
    return k;
}

template <bool kSkip, class Cursor, int kSub, int kC>
__device__ __forceinline__ void ws_write_desc(uint32_t d, const WsStep<kSub, kC>& st, bool more, int more_w,
                                              const KernelParams& p, bool with_keys = false,
                                              const WsKeys<kSub>& keys = WsKeys<kSub>{}) {
    int bm[3][2];
#pragma unroll
    for (int w = 0; w < 3; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            bm[w][h] = w < kC && h < kSub && st.ent[w < kC ? w : 0][h < kSub ? h : 0] >= 0
                           ? Cursor::bitmap_of(p, st.ent[w < kC ? w : 0][h < kSub ? h : 0])
                           : -2;
    int n0[2] = {st.n0[0], kSub > 1 ? st.n0[kSub - 1] : -1};
    if (kC == 2 && with_keys) {
#pragma unroll
        for (int h = 0; h < kSub; ++h) n0[h] = (keys.cut >> h) & 1 ? n0[h] : -65;
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(d), "r"(n0[0]), "r"(n0[1]), "r"(st.sub[0]),
                 "r"(kSub > 1 ? st.sub[kSub - 1] : 0)
                 : "memory");
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(d + 16), "r"(bm[0][0]), "r"(bm[0][1]), "r"(bm[1][0]),
                 "r"(bm[1][1])
                 : "memory");
    if constexpr (kSkip)
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(d + 32), "r"(more ? 1 : 0), "r"(more_w) : "memory");
    else
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(d + 32), "r"(more ? 1 : 0) : "memory");
    if constexpr (kC == 3)
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(d + 40), "r"(bm[2][0]), "r"(bm[2][1]) : "memory");
    if (kC == 2 && with_keys) {
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(d + 48), "r"(keys.kw[0][0]),
                     "r"(keys.kw[0][1]), "r"(keys.kw[kSub - 1][0]), "r"(keys.kw[kSub - 1][1])
                     : "memory");
    }
}

struct WsDesc {
    int n0[2], sub[2], bm[2], more;  // bm: the reading consumer's
    bool mine;                       // kSkip: the reading consumer has a tile in a further step (more_w)
};

// kSkip: `mine` is made warp-uniform by a shuffle from lane 0 (it is: every thread reads the same word), as ptxas
// cannot tell, and the ring position it steers would otherwise leave the uniform registers (the MMA descriptors
// then cost 40 more instructions per step).
template <int kC, bool kSkip = false>
__device__ __forceinline__ WsDesc ws_read_desc(uint32_t d, int w) {
    WsDesc r;
    int b00, b01, b10, b11;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.n0[0]), "=r"(r.n0[1]), "=r"(r.sub[0]), "=r"(r.sub[1])
                 : "r"(d)
                 : "memory");
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(b00), "=r"(b01), "=r"(b10), "=r"(b11)
                 : "r"(d + 16)
                 : "memory");
    if constexpr (kSkip) {
        int more_w;
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(r.more), "=r"(more_w) : "r"(d + 32) : "memory");
        r.mine = __shfl_sync(0xffffffffu, (more_w >> w) & 1, 0) != 0;
    } else {
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r.more) : "r"(d + 32) : "memory");
        r.mine = r.more != 0;
    }
    r.bm[0] = w == 0 ? b00 : b10;  // selects: no dynamic register indexing
    r.bm[1] = w == 0 ? b01 : b11;
    if constexpr (kC == 3) {
        int b20, b21;
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(b20), "=r"(b21) : "r"(d + 40) : "memory");
        r.bm[0] = w == 2 ? b20 : r.bm[0];
        r.bm[1] = w == 2 ? b21 : r.bm[1];
    }
    return r;
}

// ANDs sub-block h's "key allowed" words of descriptor d (WsKeys) into both rows' bitmap words.
__device__ __forceinline__ void ws_and_desc_keys(uint32_t (&bits)[2][2], uint32_t d, int h) {
    uint32_t k0, k1;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(k0), "=r"(k1) : "r"(d + 48 + 8 * h) : "memory");
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        bits[hh][0] &= k0;
        bits[hh][1] &= k1;
    }
}

}  // namespace stof
