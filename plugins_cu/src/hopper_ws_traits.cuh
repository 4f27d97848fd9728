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
    static constexpr int kSmemBar = 16 * kStages;            // full[] and empty[] mbarriers
    static constexpr int kSmemDesc = 64 * kStages;           // a step descriptor per stage (kWsDescBytes)
    static constexpr int kSmemWalk = 2 * 32 * 8;             // the two-consumer TMA producer's walk (WsWalk)
    // Row sums of P on the tensor cores: P V runs with N = kHeadDim + 8, the 8 extra columns of B read from a
    // kBlockN-row block of ones after the K/V ring (kSmemOnes), so every consumer thread gets its two rows' full
    // sums in rO -- no FADDs (64 per thread and 128-key step), no quad shuffles.  The sums are of the fp16/bf16
    // P that P V multiplies.  Head dim 64 (softmax-bound): tactic 24 -0.1 to -2.5 %, 22 -1.4 to -6.2 % (session 9).
    // The extra MMA work costs no measurable energy: sums by FADD ran 24 -0.9 to +3.0 % (faster at causal S=8192
    // only) and drew the same energy per call at the board's power cap there (session 20).
    // Head dim 64 only: at 128 the ones would have to be V's third 64-column chunk, 2 LBOs on, where the next
    // stage's K is (and the accumulators would need 136 / 2 registers).
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
    // The persistent two-consumer kernels start their items in a second producer warp (hopper_ws_persist_fwd):
    // it claims the next item, loads its Q and starts its walk while the first warp streams the current item's
    // K/V (session 11: 22 -2 to -10 %, 24 within noise), and it stores each item's O by TMA, so the consumers only
    // stage it (epilogue ~1,000 -> ~500 cycles per item; 24 -1 to -4 %).
    static constexpr bool kSchedWarp = kConsumers == 2 && kTma;
    // persistent form: kQBufs Q buffers, the ring, full/empty[kStages] + q_full/q_empty[kQBufs] mbarriers, an item
    // slot per Q buffer; kSchedWarp: per Q buffer a walk window and record, and kQBufs + 1 mbarriers
    static constexpr int persist_smem(int qbufs) {
        return qbufs * kSmemQ + kSmemRing + 8 * (2 * kStages + 2 * qbufs) + 16 * qbufs + kSmemDesc + kSmemWalk + 1024 +
               (kSchedWarp ? qbufs * (kSmemWalk + 128) + 8 * (1 + qbufs) : 0);  // 128: kWsRecBytes
    }
    // Consumers chain their work items (ws_consume_items) at head dim 64: tactic 24 sliding -5.6 %, causal within
    // noise; at 128 (tactic 22) chaining measured +4 to +7 % on sliding, so those finish each item first (session 8).
    static constexpr bool kChainItems = kHeadDim == 64;
    // Chained consumers release an item's Q buffer only at the next item's first step; with two buffers the producer
    // then waits to load the next Q (sliding +12 %), so they get three.
    static constexpr int kQBufs = kChainItems ? 3 : 2;
    // A consumer runs only the steps from its first tile of an item to its last (the descriptors' more_w,
    // ws_consume_items); the others' MMAs would give masked scores only.  Three-consumer causal items end with a
    // step of which consumer 0 has no tile, banded ones start with one of which consumer 2 has none, and a head's
    // last item has rows past Sq.  Measured (session 10): 29 -2 to -8 % (causal S <= 4096, sliding, bigbird;
    // noise at S = 8192).  Not with two consumers: nothing to skip on causal with 128-key steps, and with 64-key
    // steps (22) sliding -4 % but causal +1 to +3 % (head dim 128: the step loop's MMA descriptors were
    // rematerialised, 570 -> 590 instructions).
    static constexpr bool kSkip = kConsumers == 3;
    static_assert(!kChainItems || persist_smem(3) <= 227 * 1024, "shared memory for three Q buffers");
    // S = Q K^T with the consumer's Q rows in registers (16 per thread at head dim 64, 32 at 128; loaded once per
    // item by ldmatrix): the S MMA reads only K from shared memory, a third less of its operand traffic for the
    // same MMA work, and its loop loses the Q descriptors' R2URs.  Session 21 (A/B, 5 rounds): head dim 64, 24
    // -1.2 / -1.5 % at causal S=4096 / 8192, -0.6 % sliding, +1.0 % dilated, 22 -2 to -3.4 % everywhere, and -1 %
    // energy per call under sustained load at causal S=8192 (where the board's 700 W cap sets the clock); head
    // dim 128, 22 -2.8 / -3.8 / -6.2 % causal S=1024 / 4096 / 8192, -2.5 % sliding, -3.5 % bigbird, 0 dilated,
    // 21 -1 to -3 %.  (The one-warpgroup kernels, at 128 registers for four CTAs per SM, measured mixed with it,
    // session 3.)  Not with three consumers (160 registers each).
    static constexpr bool kQRegs = kConsumers == 2;
    // MMA turns (FlashAttention-3's ping-pong, handed over mid-softmax): a consumer issues a step's MMAs only once
    // the other has finished its max reduction (named barriers 3 + w; bar.arrive lands after the max tree, before
    // the exps' FFMAs, where ptxas puts it), so one consumer's MMAs run under the other's exps, not under its max
    // tree.  Why (session 23, plugins_cu/tools/mb_rs_overlap.cu): a warpgroup's MMAs run at full speed beside
    // another warpgroup's MUFU work (+6-18 %), but beside FFMA/FMNMX work both slow down (MMAs +63-70 %, the ALU
    // work +27-30 %), and a warpgroup's own softmax cannot overlap its own MMAs (their issue blocks the warps).
    // Measured (A/B, 5 rounds): tactic 24 -1.2 to -6.2 % in every cell (causal S=1024 / 4096 / 8192 -4.3 / -1.9 /
    // -1.7 %, sliding S=4096 -2.5 %, BigBird -6.2 %).  Sessions 5 and 7 handed the turn over right after the MMA
    // issue, so the other's MMAs ran under the max tree: +2 to +4 %.  Only with 128-key steps and the 4-stage
    // ring (tactic 24): the 2-stage 21 and 23 measured +6 to +9 % and +1 to +5 % with it, the 64-key 22 -5 to +2 %.
    // Needs the row sums on the tensor cores (the exps' pass without sums, online_softmax's hook).
    static constexpr bool kTurns = kConsumers == 2 && kSumMma && kSub == 2 && kStages >= 4;
    // The exp chain (WsExpChain, online_softmax): P packed as the exps come (the step's P V awaited first), the
    // exp arguments of every second 8-column group chained to the packed P two groups back, so ptxas interleaves
    // FFMAs, MUFU ops and packs (it otherwise issued 64 FFMAs, then 64 MUFU ops, then most of the 32 packs).
    // Session 26 (A/B, 5-6 rounds): tactic 24 -1 to -2 % in 8 of 9 cells; 22 at head dim 128 causal S=1024 / 4096
    // -1.0 / -3.8 %, dilated -4.3 %, Longformer -0.7 %, sliding +0.4 %, 21 -1.0 to -1.5 %; 22 at 64 -1.2 / -1.6 %
    // (Longformer S=1024, sliding S=4096).  Not in the three-consumer kernels (registers at the spill limit).
    static constexpr bool kExpChain = kConsumers == 2;
    // An item's first P V overwrites O (the wgmma's scale-d 0: O = P V) instead of adding to an O the consumer
    // zeroed: ptxas zeroed the 36 accumulators with 72 uniform moves per item, on the path from one item's last step
    // to the next one's first MMA.  Session 27 (A/B, 3 rounds): tactic 24 sliding S=2048 / 4096 / 8192 -0.7 / -1.5 /
    // -0.8 %, causal S=1024 / 4096 -1.0 / -0.5 %, the other cells -0.3 to -0.6 %; with the power-of-two tile_m
    // below (4 rounds) 24 -1.6 / -1.9 / -2.5 % on sliding, -0.5 to -1.5 % elsewhere, 22 level (-0.7 to +1.0 %).
    // Head dim 64 only: at 128 the epilogue's registers moved onto those of Q (scripts/sass_rs_operands.py).
    static constexpr bool kPvOverwrite = kConsumers == 2 && kHeadDim == 64;
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
// index of its tile there.  The consumers read it instead of walking the tile lists themselves: the walk's
// dependent index loads (col_idx, then tile_bitmap_index) stalled them on every step (ncu, session 5).
//   int n0[2]      first key of sub-block h (-1: absent)                             bytes  0..15 (with sub)
//   int sub[2]     the sub-block's 64-key index inside its tile
//   int bm[2][2]   [consumer][h] for consumers 0, 1: tile_bitmap_index of the          bytes 16..31
//                  consumer's entry (-1: FULL), -2: no tile there
//   int more       1 when the work item has a further step                            bytes 32..35
//   int more_w     bit w: consumer w has a tile in a further step (ws_more_mask;     bytes 36..39
//                  WsTraits::kSkip kernels only)
//   int bm2[2]     consumer 2's (three-consumer kernels)                              bytes 40..47
constexpr int kWsDescBytes = 64;

template <bool kSkip, class Cursor, int kSub, int kC>
__device__ __forceinline__ void ws_write_desc(uint32_t d, const WsStep<kSub, kC>& st, bool more, int more_w,
                                              const KernelParams& p) {
    int bm[3][2];
#pragma unroll
    for (int w = 0; w < 3; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            bm[w][h] = w < kC && h < kSub && st.ent[w < kC ? w : 0][h < kSub ? h : 0] >= 0
                           ? Cursor::bitmap_of(p, st.ent[w < kC ? w : 0][h < kSub ? h : 0])
                           : -2;
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(d), "r"(st.n0[0]), "r"(kSub > 1 ? st.n0[kSub - 1] : -1),
                 "r"(st.sub[0]), "r"(kSub > 1 ? st.sub[kSub - 1] : 0)
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

}  // namespace stof
