// Warp-specialised block-wise sparse attention on Hopper (sm_90a), FlashAttention-3's structure over the STOF
// tile format.  Same semantics as blockwise.cuh / hopper.cuh.
//
// One CTA = a work item of 64 * kConsumers query rows (128, or 192 for tactics 28/29), 1 + kConsumers warpgroups:
//   warpgroup 0, the producer: walks the union of the consumers' 64-row tile rows' non-empty columns (a MergeWalk,
//     hopper.cuh: WsWalk by one warp, or MergedCursor), gathers kSub 64-key sub-blocks per step (they need not be
//     adjacent keys: a step of a sparse row joins its next two non-empty sub-blocks), streams K and V into a
//     kStages-deep ring (lane 0 issuing TMA boxes; 128 threads with cp.async and zero-fill when key_lengths is
//     given) and publishes a step descriptor with each stage (ws_write_desc), signalling one mbarrier (full[stage])
//     per step.  It gives its registers to the consumers (setmaxnreg).
//   warpgroups 1 .. kConsumers, the consumers: each owns 64 query rows (inside one format tile row) and runs, per step,
//     S_i = Q K_i^T  (wgmma, issued before the previous step's P V so the tensor cores stay fed; with two
//       consumers Q comes from registers, WsTraits::kQRegs),
//     O += P_{i-1} V_{i-1},
//     mask + online softmax of S_i while P_{i-1} V_{i-1} runs, then O rescaled and the stage released
//     (mbarrier empty[stage], one arrival per consumer thread).  A consumer whose tile row has no tile in a
//     sub-block masks it.  In tactic 24 the two consumers take turns on the tensor cores (WsTraits::kTurns): one
//     issues its MMAs once the other's max is reduced, so they run under the other's exps (session 23; the turns
//     handed over right after the MMA issue, sessions 5 and 7, were 2-4 % slower).
//   hopper_ws_persist_fwd: the same, persistent (one CTA per SM taking items from a work counter); the consumers
//     issue an item's first S with the previous item's last P V at head dim 64 (ws_consume_items).  With two
//     consumers a second producer warp starts the items (claim, Q, walk start) while the first streams K/V.
// Why: the one-warpgroup kernels (hopper.cuh) serialise barrier -> QK^T -> softmax -> PV inside each CTA and
// re-read K/V for every 64 rows; here loads never stall the math warps, K/V are read once per 128 rows, and a
// 128-key step (kSub = 2) halves the per-step softmax bookkeeping (max reductions, O rescale, barriers).
#pragma once

#include <cuda.h>

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

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"  // labels are scoped by the braces
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@!P1 bra LAB_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed (the count was set at init).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Box (64 keys x 64 elements) at coordinates (d0, n0, h, b) of a 4-d tensor map into shared memory at dst.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int d0, int n0, int h, int b,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(d0), "r"(n0), "r"(h), "r"(b), "r"(bar)
        : "memory");
}

// Box (64 rows x 64 elements) from shared memory at src to coordinates (d0, n0, h, b) of a 4-d tensor map (rows past
// the tensor's end are not written), in this thread's bulk group; ws_bulk_commit() closes the group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int d0, int n0, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(src), "r"(d0), "r"(n0), "r"(h), "r"(b)
        : "memory");
}
__device__ __forceinline__ void ws_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// until this thread's bulk stores have read their shared memory (kRead) or are complete
template <bool kRead>
__device__ __forceinline__ void ws_bulk_wait() {
    if constexpr (kRead)
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

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

// The merged walk as the two-consumer TMA producers run it: the producer warp's 32 lanes hold the same cursor, and
// each tile row's col_idx and tile_bitmap_index entries come through a 32-entry window in shared memory that the
// lanes fill with coalesced loads (every row's at once at an item's start): one L2 round trip per 32 tiles of a row
// instead of a dependent load per tile, and the bitmap indices come with the walk (the descriptor loaded them).
// Columns at or past the key bound end a row (they ascend), so no load trims its end.  A MergeWalk (hopper.cuh) whose
// tile handle is the tile's bitmap index + 2 (FULL: 1).  Measured (session 10, A/B run 9): tactic 24 -1.2 to -3.9 %
// on causal S=1024-8192, -0.4 / -1.2 % on sliding S=1024 / 4096.  The producer's per-step chain did not shrink
// (~1,300 cycles; ~1,150 with one thread: it is issue-bound, not load-bound); what shrank is the time from a stage's
// release to its TMA (the descriptor's bitmap-index loads, 250-300 -> 60-70 cycles).  Not in the three-consumer
// kernels: their producer has 32 registers (this walk measured +0.3 to +3.7 % there).
template <int kC>
struct WsWalk : MergeWalk<WsWalk<kC>, kC> {
    int e[kC], end[kC], c[kC], win[kC];  // next entry, end, its column (INT_MAX when done), window's first entry
    int col_end, lane;
    uint32_t sWin;  // [kC][32] pairs of int32: column (INT_MAX past the row's end), bitmap index

    // this lane's entry of row w's window from entry e[w] (INT_MAX, -1 past the row's end), and its store
    __device__ __forceinline__ void fetch(const KernelParams& p, int w, int& col, int& bmi) const {
        const int i = e[w] + lane;
        col = INT_MAX;
        bmi = -1;
        if (i < end[w]) {
            col = __ldg(p.col_idx + i);
            bmi = __ldg(p.tile_bitmap_index + i);
        }
    }
    __device__ __forceinline__ void put(int w, int col, int bmi) {
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(sWin + (w * 32 + lane) * 8), "r"(col), "r"(bmi)
                     : "memory");
        win[w] = e[w];
    }
    __device__ __forceinline__ void fill(const KernelParams& p, int w) {  // the window of row w from entry e[w]
        int col, bmi;
        fetch(p, w, col, bmi);
        __syncwarp();  // every lane is done with the old window
        put(w, col, bmi);
        __syncwarp();
    }
    __device__ __forceinline__ int load(const KernelParams& p, int w) {  // column of entry e[w] (INT_MAX: none)
        if (e[w] - win[w] >= 32) fill(p, w);
        int col;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(col) : "r"(sWin + (w * 32 + e[w] - win[w]) * 8) : "memory");
        return col < col_end ? col : INT_MAX;
    }
    // The walk of the item at query row q0, head h starts with row_ptr_of_lane (lane 2 w + k loads row_ptr[row of
    // consumer w + k]: one round trip for every row's range), then init_with (every row's window in one more round
    // trip); init_begin / put_windows split the latter around other work.
    // (The rows are computed per lane, as ws_item_rows gives them: a lane-indexed rows[] goes to local memory.)
    static __device__ __forceinline__ int row_ptr_of_lane(const KernelParams& p, int q0, int h, int lane) {
        const int r0 = q0 + 64 * (lane >> 1);
        if (lane >> 1 >= kC || r0 >= p.seq_q) return 0;
        return __ldg(p.row_ptr + (h % p.num_layouts) * p.tq + r0 / p.tile_m + (lane & 1));
    }
    // init, from every lane's row_ptr_of_lane value
    __device__ __forceinline__ void init_with(const KernelParams& p, int rp, int kv_len, uint32_t s_win, int lane_) {
        int col[kC], bmi[kC];
        init_begin(p, rp, kv_len, s_win, lane_, col, bmi);
        put_windows(p, col, bmi);
    }
    __device__ __forceinline__ void fetch_windows(const KernelParams& p, int (&col)[kC], int (&bmi)[kC]) const {
#pragma unroll
        for (int w = 0; w < kC; ++w) fetch(p, w, col[w], bmi[w]);
    }
    __device__ __forceinline__ void init_begin(const KernelParams& p, int rp, int kv_len, uint32_t s_win, int lane_,
                                               int (&col)[kC], int (&bmi)[kC]) {
#pragma unroll
        for (int w = 0; w < kC; ++w) {
            e[w] = __shfl_sync(0xffffffffu, rp, 2 * w);
            end[w] = __shfl_sync(0xffffffffu, rp, 2 * w + 1);
        }
        sWin = s_win;
        lane = lane_;
        col_end = (kv_len + p.tile_n - 1) / p.tile_n;
        fetch_windows(p, col, bmi);
    }
    __device__ __forceinline__ void put_windows(const KernelParams& p, const int (&col)[kC], const int (&bmi)[kC]) {
        __syncwarp();
#pragma unroll
        for (int w = 0; w < kC; ++w) put(w, col[w], bmi[w]);
        __syncwarp();
#pragma unroll
        for (int w = 0; w < kC; ++w) c[w] = load(p, w);
        this->sub = 0;
        this->nsub = p.tile_n / 64;
    }
    __device__ __forceinline__ int handle(int w) const {  // the current tile's bitmap index + 2
        int bmi;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bmi) : "r"(sWin + (w * 32 + e[w] - win[w]) * 8 + 4) : "memory");
        return bmi + 2;
    }
    __device__ __forceinline__ int next(const KernelParams& p, int w) {
        ++e[w];
        return load(p, w);
    }
    static __device__ __forceinline__ int bitmap_of(const KernelParams&, int handle) { return handle - 2; }
};

// The (up to) kC 64-row tile rows of the work item at q0 of head h (-1: past Sq), the rows of the merged walk.
template <int kC>
__device__ __forceinline__ void ws_item_rows(int (&rows)[kC], const KernelParams& p, int q0, int h) {
    const int layout_row0 = (h % p.num_layouts) * p.tq;
#pragma unroll
    for (int w = 0; w < kC; ++w) rows[w] = q0 + 64 * w < p.seq_q ? layout_row0 + (q0 + 64 * w) / p.tile_m : -1;
}
template <int kC>
__device__ __forceinline__ void ws_item_cursor(MergedCursor<kC>& cur, const KernelParams& p, int q0, int h, int kv_len) {
    int rows[kC];
    ws_item_rows(rows, p, q0, h);
    cur.init(p, rows, kv_len);
}

// The TMA producers' walk: two consumers, the producer warp's (WsWalk); three, one thread's (MergedCursor).
template <int kC>
using WsProducerWalk = std::conditional_t<kC == 2, WsWalk<kC>, MergedCursor<kC>>;
template <int kC>
constexpr int kWsProducerLanes = kC == 2 ? 32 : 1;
template <int kC>
__device__ __forceinline__ void ws_walk_init(MergedCursor<kC>& cur, const KernelParams& p, int q0, int h, int kv_len,
                                             uint32_t, int) {
    ws_item_cursor(cur, p, q0, h, kv_len);
}
template <int kC>
__device__ __forceinline__ void ws_walk_init(WsWalk<kC>& cur, const KernelParams& p, int q0, int h, int kv_len,
                                             uint32_t s_win, int lane) {
    cur.init_with(p, WsWalk<kC>::row_ptr_of_lane(p, q0, h, lane), kv_len, s_win, lane);
}

template <int kSub, int kC, class Cursor>
__device__ __forceinline__ bool ws_take_step(Cursor& cur, const KernelParams& p, WsStep<kSub, kC>& st) {
    bool any = false;
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
        int ent[kC];
        const int j = cur.peek(ent);
        if (j == INT_MAX) {
            st.n0[h] = -1;
            st.sub[h] = 0;
#pragma unroll
            for (int w = 0; w < kC; ++w) st.ent[w][h] = -1;
        } else {
            st.n0[h] = j * p.tile_n + cur.sub * 64;
            st.sub[h] = cur.sub;
#pragma unroll
            for (int w = 0; w < kC; ++w) st.ent[w][h] = ent[w];
            cur.advance(p);
            any = true;
        }
    }
    return any;
}

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

// Bit w: consumer w has a tile after the step being described (next: the step after it, cur: the walk after
// next).  A row's cursor column stays set while any sub-block of its tiles is still to come.
template <int kSub, int kC, class Cursor>
__device__ __forceinline__ int ws_more_mask(const Cursor& cur, const WsStep<kSub, kC>& next) {
    int m = 0;
#pragma unroll
    for (int w = 0; w < kC; ++w) {
        bool any = cur.c[w] != INT_MAX;
#pragma unroll
        for (int h = 0; h < kSub; ++h) any = any || next.ent[w][h] >= 0;
        m |= any ? 1 << w : 0;
    }
    return m;
}

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

// K or V rows [n0, n0 + 64) into rows [64 h, 64 h + 64) of a kBlockN-row swizzled tile, by the 128 producer
// threads (addresses advance by constants, as in load_rows_async128); rows >= limit (or n0 < 0) are zero-filled.
template <class WT>
__device__ __forceinline__ void ws_load_sub(uint32_t s_tile, int h, const typename WT::Elem* g, int64_t stride_s,
                                            int n0, int limit, int ptid) {
    constexpr int kRowStep = 128 / WT::kChunks;
    static_assert(kRowStep % 8 == 0, "swizzle pattern constant across iterations");
    constexpr int kIters = 64 / kRowStep;
    const int r0 = ptid / WT::kChunks, ch = ptid % WT::kChunks;
    const uint32_t dst = s_tile + swz128<WT::kBlockN>(64 * h + r0, ch);
    const typename WT::Elem* src = g + static_cast<int64_t>(n0 + r0) * stride_s + ch * 8;
    const int64_t step = static_cast<int64_t>(kRowStep) * stride_s;
    if (n0 >= 0 && n0 + 64 <= limit) {
#pragma unroll
        for (int it = 0; it < kIters; ++it) cp_async16(dst + it * kRowStep * 128, src + it * step, 16);
    } else {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const bool ok = n0 >= 0 && n0 + r0 + it * kRowStep < limit;
            cp_async16(dst + it * kRowStep * 128, ok ? src + it * step : g, ok ? 16 : 0);
        }
    }
}


// One step's K/V into ring stage sK, completing on its full barrier (the arrival with the expected bytes first).
// One lane.
template <class WT, int kC>
__device__ __forceinline__ void ws_tma_step(const KernelParams& p, const WsStep<WT::kSub, kC>& st, int h, int b,
                                            uint32_t sK, uint32_t full) {
    mbar_expect_tx(full, WT::kSub * 2 * 64 * WT::kHeadDim * 2);
#pragma unroll
    for (int hh = 0; hh < WT::kSub; ++hh) {
        const int n0 = st.n0[hh] >= 0 ? st.n0[hh] : st.n0[0];
#pragma unroll
        for (int cb = 0; cb < WT::kHeadDim / 64; ++cb) {
            const uint32_t off = cb * WT::kBlockN * 128 + hh * 64 * 128;
            tma_load_4d(sK + off, &p.tma_k, cb * 64, n0, h, b, full);
            tma_load_4d(sK + WT::kSmemKV + off, &p.tma_v, cb * 64, n0, h, b, full);
        }
    }
}

// Producer (one thread or warp, WsProducerWalk: all lanes walk, lane 0 issues), TMA: the K/V of one work item's
// steps into the ring from position it on (the caller has started the walk: cur after the first step st, have =
// whether there is one); returns the ring position after the item.  kSub (K, V) boxes of 64 keys per step; an
// absent sub-block (odd walk end) re-loads the step's first one: its scores are masked, so it only has to hold finite
// values.  Rows past Sk are zero-filled by the TMA; the launchers run the cp.async producer when key_lengths can end
// the keys before Sk (those rows would hold real data).
struct WsNoHook {
    template <class C>
    __device__ __forceinline__ void operator()(const C&) const {}
};
template <class WT, class Hook = WsNoHook>
__device__ __forceinline__ int ws_produce_tma(const KernelParams& p, WsProducerWalk<WT::kConsumers>& cur, int lane,
                                              WsStep<WT::kSub, WT::kConsumers> st,
                                              bool have, int h, int b, int it, uint32_t sKV, uint32_t sBar,
                                              uint32_t sDesc, Hook&& on_step = Hook{}) {
    constexpr int kStages = WT::kStages, kSub = WT::kSub;
    WsStep<kSub, WT::kConsumers> next;
    for (; have; ++it) {
        const bool more = ws_take_step<kSub>(cur, p, next);  // one step ahead: the descriptor's `more`
        on_step(cur);
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(sBar + 8 * (kStages + s), ((it / kStages) + 1) & 1);  // empty[s]
        const uint32_t full = sBar + 8 * s;
        const uint32_t sK = sKV + s * 2 * WT::kSmemKV;
        const int more_w = WT::kSkip ? ws_more_mask(cur, next) : 0;
        if (lane == 0) {
            using Walk = WsProducerWalk<WT::kConsumers>;
            ws_write_desc<WT::kSkip, Walk>(sDesc + s * kWsDescBytes, st, more, more_w, p);
            ws_tma_step<WT>(p, st, h, b, sK, full);  // its arrival releases the descriptor
        }
        // the warp reconverges every step: no lane may fall kStages positions behind lane 0 in the parity waits above
        if constexpr (kWsProducerLanes<WT::kConsumers> > 1) __syncwarp();
        st = next;
        have = more;
    }
    return it;
}

// The first step of an item (st, at ring position 0) issued by the scheduler warp itself (the CTA's first item, see
// hopper_ws_persist_fwd): cur and st move on one step, as ws_produce_tma's loop leaves them; returns whether the
// item has more steps.
template <class WT>
__device__ __forceinline__ bool ws_issue_first_step(const KernelParams& p, WsWalk<2>& cur, int lane,
                                                    WsStep<WT::kSub, 2>& st, int h, int b, uint32_t sKV,
                                                    uint32_t sBar, uint32_t sDesc) {
    WsStep<WT::kSub, 2> next;
    const bool more = ws_take_step<WT::kSub>(cur, p, next);
    const int more_w = WT::kSkip ? ws_more_mask(cur, next) : 0;
    if (lane == 0) {
        ws_write_desc<WT::kSkip, WsWalk<2>>(sDesc, st, more, more_w, p);
        ws_tma_step<WT>(p, st, h, b, sKV, sBar);
    }
    __syncwarp();
    st = next;
    return more;
}

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

// The exp chain of the two-consumer kernels' softmax (online_softmax's ExpChain; WsTraits::kExpChain): group ni's
// four exps are packed into P as they come (P's layout as pack_p's), and every second group's exp arguments from
// group 2 on wait for the packed P two groups back.
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
    auto full_bar = [&](int s) { return sBar + 8 * s; };
    auto empty_bar = [&](int s) { return sBar + 8 * (kStages + s); };
    const int warp = ctid >> 5, lane = ctid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const float sl2 = p.scale_log2;
    // kFoldAll (two consumers): the scale is folded into the exp2 FFMA whatever its sign (folded_exp2_scale; each
    // item's Q rows negated first for scale < 0, ws_negate_rows).  So the step loop has one path: the pre-scaled one it carried for scale <= 0 cost ~0.5 % there as code
    // that never ran (session 19: the loop's static size costs ~0.5 % per KB; 24 -2.3 to 0 %).  The three-consumer
    // kernels keep it: the negation's barrier under a condition took their MMA descriptors off the uniform datapath
    // and added reloads of spilled registers (tactic 29 +8 to +40 %).  Folding only scale >= 0 there, with negative
    // scales sent to the two-consumer kernel, is no better: their spills went 250 -> 478 bytes (session 20, SASS).
    constexpr bool kFoldAll = WT::kConsumers == 2;
    const bool fold = kFoldAll || sl2 > 0.f;  // otherwise scores are pre-scaled, then masked
    const bool negate_q = kFoldAll && sl2 < 0.f;
    const float mul = kFoldAll ? folded_exp2_scale(sl2) : fold ? sl2 : 1.f;

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
    // The layout's lane_bitmaps (C ABI 5): a PARTIAL sub-block's mask words already in this thread's order, one
    // 8-byte load instead of two loads and the packing (pack_mask_bits).  Only in the 64-key-step kernels (21, 22):
    // in 24 the two paths' code measured 0 to +1 % (sliding, causal) for -1 % on dilated and Longformer (session
    // 25), and the three-consumer kernels' registers are at the spill limit.
    constexpr bool kLaneBits = WT::kConsumers == 2 && kBlockN == 64;
    const char* const lane_bits = kLaneBits ? reinterpret_cast<const char*>(p.lane_bitmaps) : nullptr;
    const bool use_lane_bits = kLaneBits && lane_bits != nullptr;
    const uint32_t lb_tile_bytes = static_cast<uint32_t>(p.tile_m * p.tile_n / 4);
    uint32_t lb_row = 0;  // the byte offset of the thread's entry for the item's rows, sub-block 0, in bitmap 0
    const int32_t* kpm = nullptr;
    uint64_t dQ0 = 0;
    uint32_t rQ[kKD][4];  // WT::kQRegs: this warp's 16 Q rows (A fragments, one per k16 block)
    WsDesc st;

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
        if (!fold) {
#pragma unroll
            for (int i = 0; i < kNI * 4; ++i) rS[i] *= sl2;
        }
#pragma unroll
        for (int hh = 0; hh < kSub; ++hh) {
            // A sub-block this consumer lacks is masked through all-zero words: every path masks rS in place
            // (FSEL), so no branch leaves the scores in other registers (a -inf fill on one path made ptxas copy
            // all 32 scores on every step).
            const int bm_idx = st.bm[hh];  // -2: this consumer has no tile there
            const int n0 = st.n0[hh];
            // mask_len: kv_len, or -1 with a padding mask (every sub-block cut): one predicate fewer in the step
            // loop, where R2P's seven-predicate writes made ptxas keep the others in registers
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
                        if (bound) and_key_words(bits, n0, kv_len, kpm, lane);  // (warp-uniform)
                    }
                    zy = pack_mask_bits(bits, tig, mask_sel);
                }
                mask_scores_packed(rS, zy, hh * 32);
            }
        }
        if constexpr (WT::kExpChain) {
            // the turn handed over as below (kTurns); P packed by the exp chain, so the outstanding P V (which reads
            // rP) is awaited first (where ptxas put that wait anyway)
            return online_softmax<kNI, true, !WT::kSumMma>(
                rS, row_max, row_sum, alpha, mul,
                [&]() {
                    if constexpr (WT::kTurns) named_barrier_arrive(3 + (1 - w), 256);
                    wgmma_wait<0>();
                    fence_regs(rO);
                },
                WsExpChain<Elem, kKN>{rP});
        } else {
            return online_softmax<kNI, true, !WT::kSumMma>(rS, row_max, row_sum, alpha, mul);
        }
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
            store_o<Elem, kBlockM, 64, WT::kChunks, 128>(item.sQ, gO, p.o_ss, item.q0, 64 * w, p.seq_q, ctid);
        }
        item_done(item);
    };
    auto zero_o = [&]() {
#pragma unroll
        for (int i = 0; i < kON / 2; ++i) rO[i] = 0.f;
    };

    // With the exp chain the softmax's hook has waited for the step's P V (it packs into rP): no second, empty
    // WARPGROUP.DEPBAR after it (session 27, A/B: -0.8 to +0.3 %, noise; one instruction fewer per step).  Head dim
    // 64 only: at 128 ptxas then reordered 22's exps, and with the power-of-two tile_m below 22 measured causal
    // S=8192 +1.1 / +1.8 % in two runs, the other cells -1.9 to +0.9 %; the head-dim-128 kernels keep session 26's
    // SASS.
    constexpr bool kPvWaited = WT::kExpChain && WT::kHeadDim == 64;
    WsItem cur, open;  // open: the item whose last P V (from ring stage prev_stage) and epilogue are outstanding
    bool pending = false;
    int it = 0, prev_stage = 0;
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
        issue_pv(prev_stage, open_acc);
        wgmma_wait<0>();
        fence_regs(rO);
        mbar_arrive(empty_bar(prev_stage));
        epilogue(open, row_sum);
        pending = false;
    };
    for (;;) {
        const bool got = next_item(cur);
        if (!got) break;
        if constexpr (kFoldAll) {
            if (negate_q) ws_negate_rows<WT>(cur.sQ, w, ctid);
        }
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
        kv_len = effective_kv_len(p, cur.b);
        // A power-of-two tile_m (compile_mask's default, 64) takes a mask, not the remainder: an integer division
        // by a run-time value, ~20 dependent instructions on the path into the item's first step.  Session 27 (A/B,
        // 3 rounds): tactic 24 sliding S=2048 / 4096 / 8192 -0.7 / -1.5 / -0.4 %, causal S=4096 -1.1 %.
        // Head dim 64 only (see kPvWaited).
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
            // are async-proxy like the wgmma reads, but dropping it there measured as noise (session 7, A/B run 5)
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            st = ws_read_desc<WT::kConsumers>(sDesc + stage0 * kWsDescBytes, w);
        }
        float alpha[2];
        if (pending) {
            my_turn();
            issue_s(stage0);
            issue_pv(prev_stage, open_acc);
            wgmma_wait<1>();  // S_0
            fence_regs(rS);
            const float open_sum[2] = {row_sum[0], row_sum[1]};
            row_max[0] = row_max[1] = -INFINITY;
            row_sum[0] = row_sum[1] = 0.f;
            softmax(alpha);  // fresh row state: no rescale
            if constexpr (!kPvWaited) {
                wgmma_wait<0>();  // the open item's last P V
                fence_regs(rO);
            }
            mbar_arrive(empty_bar(prev_stage));
            epilogue(open, open_sum);
        } else {
            my_turn();
            issue_s(stage0);
            wgmma_wait<0>();
            fence_regs(rS);
            row_max[0] = row_max[1] = -INFINITY;
            row_sum[0] = row_sum[1] = 0.f;
            softmax(alpha);
        }
        if constexpr (WT::kPvOverwrite)
            pv_acc = 0;
        else
            zero_o();
        if constexpr (!WT::kExpChain) pack_p<Elem, kKN>(rP, rS);
        prev_stage = stage0;
        ++it;
        // Steady state, step i: S_i and P_{i-1} V_{i-1} in flight together; softmax of S_i while P V runs.
        for (bool more = st.mine; more; ++it) {
            const int stage = it % kStages;
            mbar_wait(full_bar(stage), (it / kStages) & 1);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            st = ws_read_desc<WT::kConsumers, WT::kSkip>(sDesc + stage * kWsDescBytes, w);
            my_turn();
            issue_s(stage);
            issue_pv(prev_stage, pv_acc);
            pv_acc = 1;
            wgmma_wait<1>();  // S_i
            fence_regs(rS);
            const bool rescale = softmax(alpha);
            if constexpr (!kPvWaited) {
                wgmma_wait<0>();  // P_{i-1} V_{i-1}: O and rP free, stage i-1 no longer read
                fence_regs(rO);
            }
            mbar_arrive(empty_bar(prev_stage));
            if (rescale) rescale_o<kON / 8>(rO, alpha);  // with kSumMma the row sums too
            if constexpr (!WT::kExpChain) pack_p<Elem, kKN>(rP, rS);
            prev_stage = stage;
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

template <class WT>
__global__ void __launch_bounds__(WT::kThreads, 1) hopper_ws_attn_fwd(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename WT::Elem;
    constexpr int kBlockM = WT::kBlockM, kStages = WT::kStages, kSub = WT::kSub;

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sKV = sQ + WT::kSmemQ;  // stage s: K at sKV + 2 s kSmemKV, V right after; then the ones
    const uint32_t sBar = sKV + WT::kSmemRing;
    const uint32_t sDesc = sBar + 16 * kStages;  // step descriptors (ws_write_desc), one per stage
    auto full_bar = [&](int s) { return sBar + 8 * s; };
    auto empty_bar = [&](int s) { return sBar + 8 * (kStages + s); };

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const BlockWork work = block_work<kBlockM>(p);
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            // TMA: the expect_tx arrival; cp.async: one arrival per producer thread's copies + thread 0's (the descriptor)
            mbar_init(full_bar(s), WT::kTma ? 1 : 129);
            mbar_init(empty_bar(s), 128 * WT::kConsumers);  // one arrival per consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    ws_fill_ones<WT>(sKV, tid);
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WT::kProducerRegs));
        if constexpr (WT::kTma) {
            if (tid < kWsProducerLanes<WT::kConsumers>) {
                WsProducerWalk<WT::kConsumers> cur;
                ws_walk_init(cur, p, q0, h, p.seq_k, sDesc + WT::kSmemDesc, tid);
                WsStep<kSub, WT::kConsumers> st;
                const bool have = ws_take_step<kSub>(cur, p, st);
                ws_produce_tma<WT>(p, cur, tid, st, have, h, b, 0, sKV, sBar, sDesc);
            }
            return;
        } else {
            const int kv_len = effective_kv_len(p, b);
            const Elem* gK = static_cast<const Elem*>(p.k) + b * p.k_sb + h * p.k_sh;
            const Elem* gV = static_cast<const Elem*>(p.v) + b * p.v_sb + h * p.v_sh;
            MergedCursor<2> cur;
            ws_item_cursor(cur, p, q0, h, kv_len);
            WsStep<kSub> st, next;
            const int ptid = tid;
            int it = 0;
            for (bool have = ws_take_step<kSub>(cur, p, st); have; ++it) {
                const bool more = ws_take_step<kSub>(cur, p, next);
                const int s = it % kStages;
                if (it >= kStages) mbar_wait(empty_bar(s), ((it / kStages) + 1) & 1);
                const uint32_t sK = sKV + s * 2 * WT::kSmemKV;
#pragma unroll
                for (int hh = 0; hh < kSub; ++hh) {
                    ws_load_sub<WT>(sK, hh, gK, p.k_ss, st.n0[hh], kv_len, ptid);
                    ws_load_sub<WT>(sK + WT::kSmemKV, hh, gV, p.v_ss, st.n0[hh], kv_len, ptid);
                }
                if (ptid == 0) {
                    ws_write_desc<WT::kSkip, decltype(cur)>(sDesc + s * kWsDescBytes, st, more,
                                                            WT::kSkip ? ws_more_mask(cur, next) : 0, p);
                    mbar_arrive(full_bar(s));  // releases the descriptor
                }
                cp_async_mbar_arrive(full_bar(s));
                st = next;
                have = more;
            }
            cp_async_wait<0>();
            return;
        }
    }

    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WT::kConsumerRegs));
    const int w = wg - 1;
    const int ctid = tid - 128 * wg;  // 0..127 inside the consumer warpgroup
    const Elem* gQ = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh;
    // this consumer's 64 Q rows (rows 64 w .. 64 w + 63 of the item's swizzled Q tile)
    {
        constexpr int kIters = 64 * WT::kChunks / 128;
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
            const int c = ctid + i * 128;
            const int r = c / WT::kChunks, ch = c % WT::kChunks;
            const int grow = q0 + 64 * w + r;
            const bool ok = grow < p.seq_q;
            cp_async16(sQ + swz128<kBlockM>(64 * w + r, ch),
                       gQ + (ok ? static_cast<int64_t>(grow) * p.q_ss + ch * 8 : 0), ok ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_barrier_sync(1 + w, 128);
    }
    bool has_steps;  // from the walk's first entries
    {
        MergedCursor<WT::kConsumers> cur;
        ws_item_cursor(cur, p, q0, h, effective_kv_len(p, b));
        int ent[WT::kConsumers];
        has_steps = cur.peek(ent) != INT_MAX;
    }
    bool given = false;
    auto next_item = [&](WsItem& item) {
        if (given) return false;
        given = true;
        item = WsItem{q0, h, b, has_steps, sQ, 0};
        return true;
    };
    if (WT::kTurns && w == 1) named_barrier_arrive(3, 256);  // consumer 0 takes the first MMA turn
    ws_consume_items<WT>(p, next_item, [](const WsItem&) {}, sKV, sBar, sDesc, w, ctid);
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

// The persistent kernels' item starts.  ws_claim_item: the CTA's j-th work item, skipping items past the run-time Sq
// (row-ordered grids); n_items when none is left.  Called by the producer thread or warp that claims (lane 0 issues
// the atomics).  The first items are static -- item blockIdx.x + s gridDim.x is the CTA's s-th (n_static counts them),
// so no atomic is on the kernel's start-up path nor between those items -- and the counter hands out the rest, from
// static_rounds gridDim.x on, in the schedule's order (dynamic list scheduling: the longest rows still go first and the
// tail balances).  static_rounds is 1 (only the CTA's own index) unless kStatic (the kernels with a scheduler warp,
// 21-24) and the caller said the layout's rows are of near-equal length (sched_chunk 1, stof_layout_sched_chunk);
// then every wave but the last is static (session 15: sliding S = 2048-4096 -2 %; with unequal items, causal
// S >= 2048 +4-5 %, the imbalance a static share leaves).  (The three-consumer kernels' single producer thread
// spilled 8 more bytes with the static count live in its loop; they are not the sliding kernels.)
// The work counter needs no memset before the launch (session 11: -1.5 to -2.5 % at S = 1024, one operation less
// per call): CTA 0's claiming thread zeroes it before its first claim.  A claim made elsewhere before that reads
// whatever the workspace held: out of range, it ends that CTA's items (CTA 0 claims after the reset, so every item is
// still handed out); in range, it runs an item that is handed out again after the reset -- twice, the same bytes.
template <int kBlockM, int kLanes, bool kStatic>
__device__ __forceinline__ int ws_claim_item(const KernelParams& p, int j, int lane, int n_items, BlockWork& wk,
                                             int& n_static) {
    if (j == 0 && blockIdx.x == 0 && lane == 0) atomicExch(p.work_counter, 0);
    const int grid = static_cast<int>(gridDim.x);  // <= n_items
    const int static_rounds = kStatic && p.uniform_rows ? max(1, n_items / grid - 1) : 1;
    const int base = static_rounds * grid;         // <= n_items
    int item;
    bool first = true;
    do {
        int claimed = 0;
        // (!kStatic: n_static is never read, so it holds no register in the claiming loop)
        const bool fixed = kStatic ? n_static < static_rounds : first && j == 0;
        if (!fixed && lane == 0) claimed = atomicAdd(p.work_counter, 1);
        if constexpr (kLanes > 1) claimed = __shfl_sync(0xffffffffu, claimed, 0);
        const bool in_range = claimed >= 0 && claimed < n_items - base;
        int s = 0;
        if constexpr (kStatic) s = fixed ? n_static++ : 0;
        item = fixed ? static_cast<int>(blockIdx.x) + s * grid : in_range ? base + claimed : n_items;
        first = false;
        if (item < n_items) wk = block_work_at<kBlockM>(p, item, p.persist_nqb);
    } while (item < n_items && wk.qb * kBlockM >= p.seq_q);
    return item;
}

// An item's kBlockM x kHeadDim tile in its Q buffer (the wgmma's swizzled layout) as 64 x 64 TMA boxes:
// f(byte offset in the buffer, first column, first row of the item) per box.
template <class WT, class F>
__device__ __forceinline__ void ws_item_boxes(F&& f) {
#pragma unroll
    for (int cb = 0; cb < WT::kHeadDim / 64; ++cb)
#pragma unroll
        for (int r = 0; r < WT::kBlockM / 64; ++r) f(cb * WT::kBlockM * 128 + r * 64 * 128, cb * 64, 64 * r);
}

// An item's Q into its buffer by TMA, completing on q_full (one lane).
template <class WT>
__device__ __forceinline__ void ws_q_copies(const KernelParams& p, uint32_t sQ, const BlockWork& wk, uint32_t q_full) {
    ws_item_boxes<WT>([&](int off, int d0, int r0) {
        tma_load_4d(sQ + off, &p.tma_q, d0, wk.qb * WT::kBlockM + r0, wk.h, wk.b, q_full);
    });
}

// The item's slot for the consumers (qb, h, b, flags: 1 = an item, 2 = it has a step, so the consumers need no walk
// of their own; `more` adds the producers' own bits: kWsFirstIssued, kWsFirstMore), then q_full's arrival:
// expect_tx for the Q copies (issued before; the tx-count may go negative until then), or a plain arrival that
// releases the consumers' last wait (no more items).  One lane.
constexpr int kWsFirstIssued = 4;  // the scheduler warp issued the item's first step (ws_issue_first_step)
constexpr int kWsFirstMore = 8;    // ... and the item has more steps
template <class WT>
__device__ __forceinline__ void ws_publish_item(uint32_t slot, const BlockWork& wk, bool valid, bool have,
                                                uint32_t q_full, int more = 0) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(wk.qb), "r"(wk.h), "r"(wk.b),
                 "r"((valid ? 1 : 0) | (have ? 2 : 0) | more)
                 : "memory");
    if (valid)
        mbar_expect_tx(q_full, WT::kBlockM * WT::kHeadDim * 2);
    else
        mbar_arrive(q_full);
}

// The scheduler warp's hand-off of a started item to the issuing warp (kSchedWarp kernels): the walk's state after
// its first step (WsWalk: e, end, c, win per row, sub; the window itself stays in the item's shared-memory window)
// and that step, as 32-bit words of a kWsRecBytes record.  The item itself (head, batch, flags) is in its slot.
constexpr int kWsRecBytes = 128;  // WsTraits::persist_smem counts it
template <int kSub, int kC>
struct WsRecord {
    static constexpr int kWords = 4 * kC + 1 + 2 * kSub + kC * kSub;
    static_assert(4 * kWords <= kWsRecBytes, "record size");
    static __device__ __forceinline__ void put(uint32_t rec, int i, int v) {
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(rec + 4 * i), "r"(v) : "memory");
    }
    static __device__ __forceinline__ int get(uint32_t rec, int i) {
        int v;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(rec + 4 * i) : "memory");
        return v;
    }
    // one lane
    static __device__ __forceinline__ void save(uint32_t rec, const WsWalk<kC>& cur, const WsStep<kSub, kC>& st) {
        int i = 0;
#pragma unroll
        for (int w = 0; w < kC; ++w) put(rec, i++, cur.e[w]), put(rec, i++, cur.end[w]), put(rec, i++, cur.c[w]),
                                       put(rec, i++, cur.win[w]);
        put(rec, i++, cur.sub);
#pragma unroll
        for (int hh = 0; hh < kSub; ++hh) {
            put(rec, i++, st.n0[hh]);
            put(rec, i++, st.sub[hh]);
#pragma unroll
            for (int w = 0; w < kC; ++w) put(rec, i++, st.ent[w][hh]);
        }
    }
    // every lane of the issuing warp; the walk's per-launch fields (nsub, col_end, lane, sWin) are the caller's to set
    static __device__ __forceinline__ void load(uint32_t rec, WsWalk<kC>& cur, WsStep<kSub, kC>& st) {
        int i = 0;
#pragma unroll
        for (int w = 0; w < kC; ++w) cur.e[w] = get(rec, i++), cur.end[w] = get(rec, i++), cur.c[w] = get(rec, i++),
                                       cur.win[w] = get(rec, i++);
        cur.sub = get(rec, i++);
#pragma unroll
        for (int hh = 0; hh < kSub; ++hh) {
            st.n0[hh] = get(rec, i++);
            st.sub[hh] = get(rec, i++);
#pragma unroll
            for (int w = 0; w < kC; ++w) st.ent[w][hh] = get(rec, i++);
        }
    }
};

// Persistent form (TMA producer; the launcher needs a work counter, which the kernel zeroes): one CTA per SM takes
// work items from the counter (atomicAdd: dynamic list scheduling in the schedule's order, so the longest rows still
// go first; a CTA's first item is its own index) until they run out.  The producer runs up to kQBufs - 1
// items ahead: it loads the next items' Q (TMA, kQBufs buffers) and their first K/V while the consumers finish the
// current one, so an item's start (Q load, pipeline fill) and end (O store) overlap other work instead of leaving
// the SM idle -- the non-persistent kernel paid that per CTA at one CTA per SM.  At head dim 64 the consumers chain
// the items (ws_consume_items: an item's first S with the previous item's last P V).  Item hand-off: per Q buffer,
// the item's (qb, h, b) in shared memory and two mbarriers (q_full: Q landed / no more items; q_empty: all consumers
// are done with the buffer: they stored the item's O, which they stage in it -- or, kSchedWarp, staged it there for
// the scheduler warp's TMA store).
template <class WT>
__global__ void __launch_bounds__(WT::kThreads, 1) hopper_ws_persist_fwd(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int kBlockM = WT::kBlockM, kStages = WT::kStages, kQBufs = WT::kQBufs;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ0 = (smem_u32(smem) + 1023u) & ~1023u;  // Q buffer j: sQ0 + j kSmemQ
    const uint32_t sKV = sQ0 + kQBufs * WT::kSmemQ;
    // full[kStages], empty[kStages], q_full[kQBufs], q_empty[kQBufs]
    const uint32_t sBar = sKV + WT::kSmemRing;
    const uint32_t sItem = sBar + 8 * (2 * kStages + 2 * kQBufs);  // int4 per Q buffer: qb, h, b, flags
    const uint32_t sDesc = sItem + 16 * kQBufs;                      // step descriptors (ws_write_desc), one per stage
    auto q_full = [&](int j) { return sBar + 8 * (2 * kStages + j); };
    auto q_empty = [&](int j) { return sBar + 8 * (2 * kStages + kQBufs + j); };
    // kSchedWarp: a walk window and a walk record per Q buffer, then the go and walk_ready[kQBufs] mbarriers
    const uint32_t sWinB = sDesc + WT::kSmemDesc;
    const uint32_t sRecB = sWinB + kQBufs * WT::kSmemWalk;
    const uint32_t sGo = sRecB + kQBufs * kWsRecBytes;
    auto walk_ready = [&](int j) { return sGo + 8 + 8 * j; };

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int n_items = p.persist_items;
    // The scheduler warp starts its first item's walk before the CTA's set-up (barrier init, the block of ones, the
    // barrier, which waits for it): row ranges, then windows (WsWalk::init_begin).  The kernel's start is a chain of
    // dependent DRAM round trips (row_ptr, the windows, the first K/V) at a cold L2; this takes the set-up off it.
    // Measured (session 14, A/B run 3): causal S=1024 -2.6 %, sliding S=4096 -1.8 %, a one-item call about
    // -0.35 us; the row ranges alone gave about half of that.
    BlockWork early_wk{0, 0, 0};
    bool early_ok = false;  // the first item (the CTA's own index) is in range and its walk begun
    WsWalk<2> early_cur;
    int early_col[2], early_bmi[2];
    if constexpr (WT::kSchedWarp) {
        if (tid >> 5 == 1 && static_cast<int>(blockIdx.x) < n_items) {
            early_wk = block_work_at<kBlockM>(p, blockIdx.x, p.persist_nqb);
            early_ok = early_wk.qb * kBlockM < p.seq_q;
            if (early_ok)  // buffer 0's window
                early_cur.init_begin(p, WsWalk<2>::row_ptr_of_lane(p, early_wk.qb * kBlockM, early_wk.h, tid & 31),
                                     p.seq_k, sWinB, tid & 31, early_col, early_bmi);
        }
    }
    if (tid == 0) {
        if constexpr (WT::kSchedWarp) {
            mbar_init(sGo, 32);  // every lane of the streaming warp arrives (see its go hook)
#pragma unroll
            for (int j = 0; j < kQBufs; ++j) mbar_init(walk_ready(j), 32);
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(sBar + 8 * s, 1);
            mbar_init(sBar + 8 * (kStages + s), 128 * WT::kConsumers);
        }
#pragma unroll
        for (int j = 0; j < kQBufs; ++j) {
            mbar_init(q_full(j), 1);
            mbar_init(q_empty(j), 128 * WT::kConsumers);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    ws_fill_ones<WT>(sKV, tid);
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WT::kProducerRegs));
        if constexpr (WT::kSchedWarp) {
            // Two producer warps.  Warp 1, the scheduler, starts the items: it claims one, issues its Q copies, walks
            // to its first step (row ranges and windows: two L2 round trips) and hands it to warp 0 through a record
            // (walk_ready[buf]).  Warp 0 streams each item's K/V steps; once the item it streams has no walk left
            // beyond its last two steps (ws_produce_tma's hook), it lets the scheduler start the next (go).  So the
            // claim, about 1.7 k cycles, and the walk's start, about 2.8 k, leave warp 0's chain (session 10
            // profile), but an item is claimed only about two steps before its predecessor's walk ends: claiming a
            // whole item early measured slower at S = 1024 (session 8; the tail grows).
            const int pw = tid >> 5, lane = tid & 31;
            using Rec = WsRecord<WT::kSub, 2>;
            if (pw == 1) {
                int buf = 0, qphase = 0;
                // Item i's O, staged by the consumers in its Q buffer b, goes out by TMA once q_empty(b) completes
                // for it (parity: the i / kQBufs-th use of b); the buffer's slot still names the item.
                auto store_o_of = [&](int b, int parity) {
                    mbar_wait(q_empty(b), parity);
                    if (lane == 0) {
                        int qb, h, bb, flags;
                        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                     : "=r"(qb), "=r"(h), "=r"(bb), "=r"(flags)
                                     : "r"(sItem + 16 * b)
                                     : "memory");
                        const uint32_t sQ = sQ0 + b * WT::kSmemQ;
                        ws_item_boxes<WT>([&](int off, int d0, int r0) {
                            tma_store_4d(&p.tma_o, sQ + off, d0, qb * kBlockM + r0, h, bb);
                        });
                        ws_bulk_commit();
                    }
                };
                int j = 0, n_static = 0;
                for (;; ++j) {
                    // Item j - kQBufs's O out of the buffer before its Q comes in -- before waiting for go, not after:
                    // its consumers are usually done with it by then, so the store leaves the chain from go to the
                    // next item's first K/V (claim, Q, walk).  It writes nothing the streaming warp reads; go still
                    // orders the slot, record and window writes below.  Session 17: 22 -0.6 to -2.7 % (D=64), 24
                    // within noise; causal S=1024's first-step K/V wait ~550 -> ~260 cycles per item (CTA 0).
                    if (j >= kQBufs) {
                        store_o_of(buf, qphase ^ 1);
                        if (lane == 0) ws_bulk_wait<true>();
                    }
                    if (j >= 1) mbar_wait(sGo, (j - 1) & 1);
                    BlockWork wk{0, 0, 0};
                    const bool early = j == 0 && early_ok;
                    bool valid;
                    if (early) {  // the CTA's own index, claimed above (a claim here measured 0.2 us slower, call 19)
                        if (blockIdx.x == 0 && lane == 0) atomicExch(p.work_counter, 0);  // as ws_claim_item does
                        wk = early_wk;
                        n_static = 1;  // it was static item 0
                        valid = true;
                    } else {
                        valid = ws_claim_item<kBlockM, 32, true>(p, j, lane, n_items, wk, n_static) < n_items;
                    }
                    if (valid && lane == 0) ws_q_copies<WT>(p, sQ0 + buf * WT::kSmemQ, wk, q_full(buf));
                    WsWalk<2> cur;
                    WsStep<WT::kSub, 2> st;
                    bool have = false;
                    if (valid) {
                        if (early) {
                            cur = early_cur;
                            cur.put_windows(p, early_col, early_bmi);
                        } else {
                            ws_walk_init(cur, p, wk.qb * kBlockM, wk.h, p.seq_k, sWinB + buf * WT::kSmemWalk, lane);
                        }
                        have = ws_take_step<WT::kSub>(cur, p, st);
                    }
                    // The CTA's first item: its first step is issued here, not by warp 0 after the record's
                    // hand-off (session 14: causal S=1024 -0.8 %, a one-item call about -0.35 us).
                    int first = 0;
                    if (early && have) {
                        const bool more = ws_issue_first_step<WT>(p, cur, lane, st, wk.h, wk.b, sKV, sBar, sDesc);
                        first = kWsFirstIssued | (more ? kWsFirstMore : 0);
                    }
                    if (lane == 0) {
                        ws_publish_item<WT>(sItem + 16 * buf, wk, valid, have, q_full(buf), first);
                        if (valid) Rec::save(sRecB + buf * kWsRecBytes, cur, st);
                    }
                    __syncwarp();
                    mbar_arrive(walk_ready(buf));  // by all 32 lanes: each releases its own window stores
                    if (!valid) break;
                    if (++buf == kQBufs) buf = 0, qphase ^= 1;
                }
                // j: the first index without an item; the O of items max(0, j - kQBufs + 1) .. j - 1 is still to go
                for (int i = max(0, j - kQBufs + 1); i < j; ++i) store_o_of(i % kQBufs, (i / kQBufs) & 1);
                if (lane == 0) ws_bulk_wait<false>();
            } else if (pw == 0) {
                int buf = 0, qphase = 0, it = 0;
                for (;;) {
                    mbar_wait(walk_ready(buf), qphase);
                    WsWalk<2> cur;
                    WsStep<WT::kSub, 2> st;
                    int qb, h, b, flags;  // the item's slot (ws_publish_item)
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(qb), "=r"(h), "=r"(b), "=r"(flags)
                                 : "r"(sItem + 16 * buf)
                                 : "memory");
                    if (!(flags & 1)) break;
                    Rec::load(sRecB + buf * kWsRecBytes, cur, st);
                    __syncwarp();  // every lane's record loads before lane 0's next arrival (the scheduler reuses it)
                    cur.nsub = p.tile_n / 64;
                    cur.col_end = (p.seq_k + p.tile_n - 1) / p.tile_n;
                    cur.lane = lane;
                    cur.sWin = sWinB + buf * WT::kSmemWalk;
                    bool go_sent = false;
                    // after each step's walk: the walk has ended (every row past its last tile or the key bound;
                    // its window is not read again)
                    // Every lane arrives (the condition is warp-uniform): each releases its own reads of this item's
                    // slot, record and window, which the scheduler overwrites kQBufs items later.  (A lane-0 arrival
                    // left compute-sanitizer racecheck reporting those reads against the scheduler's writes on grids
                    // of several items per CTA, session 15.)
                    auto go = [&](const WsWalk<2>& c) {
                        if (!go_sent && c.c[0] == INT_MAX && c.c[1] == INT_MAX) {
                            mbar_arrive(sGo);
                            go_sent = true;
                        }
                    };
                    // (ring position it held the item's first step when the scheduler issued it)
                    const bool issued = (flags & kWsFirstIssued) != 0;
                    const bool have = issued ? (flags & kWsFirstMore) != 0 : (flags & 2) != 0;
                    it = ws_produce_tma<WT>(p, cur, lane, st, have, h, b, it + (issued ? 1 : 0), sKV, sBar, sDesc, go);
                    if (!go_sent) mbar_arrive(sGo);  // an item without steps (the hook never ran)
                    if (++buf == kQBufs) buf = 0, qphase ^= 1;
                }
            }
        } else {
            constexpr int kLanes = kWsProducerLanes<WT::kConsumers>;
            if (tid >= kLanes) return;  // (one thread since the scheduler warp: the three-consumer kernels)
            const int lane = tid;
            int it = 0;
            int buf = 0, qphase = 0;  // item j's Q buffer (j % kQBufs) and the parity of its (j / kQBufs)-th use
            int n_static = 0;
            for (int j = 0;; ++j) {
                if (j >= kQBufs) mbar_wait(q_empty(buf), qphase ^ 1);  // item j - kQBufs's O is out of this buffer
                BlockWork wk{0, 0, 0};
                const bool valid = ws_claim_item<kBlockM, kLanes, false>(p, j, lane, n_items, wk, n_static) < n_items;
                // The Q copies go before the walk (their latency under its loads).
                if (valid && lane == 0) ws_q_copies<WT>(p, sQ0 + buf * WT::kSmemQ, wk, q_full(buf));
                WsProducerWalk<WT::kConsumers> cur;
                WsStep<WT::kSub, WT::kConsumers> st;
                bool have = false;
                if (valid) {
                    ws_walk_init(cur, p, wk.qb * kBlockM, wk.h, p.seq_k, sDesc + WT::kSmemDesc, lane);
                    have = ws_take_step<WT::kSub>(cur, p, st);
                }
                if (lane == 0) ws_publish_item<WT>(sItem + 16 * buf, wk, valid, have, q_full(buf));
                if (!valid) break;
                it = ws_produce_tma<WT>(p, cur, lane, st, have, wk.h, wk.b, it, sKV, sBar, sDesc);
                if (++buf == kQBufs) buf = 0, qphase ^= 1;
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WT::kConsumerRegs));
    const int w = wg - 1;
    const int ctid = tid - 128 * wg;
    int buf = 0, qphase = 0;
    auto next_item = [&](WsItem& item) -> bool {
        mbar_wait(q_full(buf), qphase);
        int qb, h, b, flags;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(qb), "=r"(h), "=r"(b), "=r"(flags)
                     : "r"(sItem + 16 * buf)
                     : "memory");
        if (!(flags & 1)) return false;
        item = WsItem{qb * kBlockM, h, b, (flags & 2) != 0, sQ0 + buf * WT::kSmemQ, buf};
        if (++buf == kQBufs) buf = 0, qphase ^= 1;
        return true;
    };
    auto item_done = [&](const WsItem& item) {
        // the O stores read the Q buffer through the generic proxy (kSchedWarp: the staging writes it, and the
        // producer's TMA store reads it); its next TMA access is async-proxy
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(q_empty(item.tag));
    };
    if (WT::kTurns && w == 1) named_barrier_arrive(3, 256);  // consumer 0 takes the first MMA turn
    ws_consume_items<WT, WT::kSchedWarp>(p, next_item, item_done, sKV, sBar, sDesc, w, ctid);
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

// Host: K and V (encode_kv_maps), Q (encode_q_map) or O (encode_o_map) tensor maps; false when the driver entry
// point or an encoding is unavailable (the caller falls back).
bool encode_kv_maps(KernelParams& p, int head_dim, bool bf16);
bool encode_q_map(KernelParams& p, int head_dim, bool bf16);
bool encode_o_map(KernelParams& p, int head_dim, bool bf16);

template <class WT>
cudaError_t launch_hopper_ws(const KernelParams& params, cudaStream_t stream) {
    auto one_cta_per_item = [&](const KernelParams& kp) {
        return launch_scheduled<WT::kBlockM, WT::kHeadDim>(hopper_ws_attn_fwd<WT>, kp, WT::kThreads, WT::kSmemSize,
                                                           stream, kSchedL2BytesOneItemPerSm);
    };
    if constexpr (!WT::kTma) {
        return one_cta_per_item(params);
    } else {
        // key_lengths / no tensor map: the cp.async producer with two consumers (same result)
        using CpAsync = WsTraits<WT::kHeadDim, WT::kStages, WT::kSub, typename WT::Elem, false, 2>;
        constexpr bool kBf16 = !std::is_same<typename WT::Elem, __half>::value;
        KernelParams p = params;
        // key_lengths can end a batch's keys before Sk, where the TMA would bring real rows (see ws_produce_tma)
        if (p.key_lengths != nullptr || !encode_kv_maps(p, WT::kHeadDim, kBf16))
            return launch_hopper_ws<CpAsync>(params, stream);
        if (p.work_counter == nullptr || !encode_q_map(p, WT::kHeadDim, kBf16) ||
            (WT::kSchedWarp && !encode_o_map(p, WT::kHeadDim, kBf16)))
            return one_cta_per_item(p);
        // persistent: one CTA per SM (at most one per item) over the schedule's grid of items
        KernelParams probe = p;
        const dim3 grid = schedule_grid<WT::kBlockM, WT::kHeadDim>(probe, kSchedL2BytesOneItemPerSm);
        const int64_t items = static_cast<int64_t>(grid.x) * grid.y * grid.z;
        if (items > INT_MAX / 2) return one_cta_per_item(p);  // the counter is an int
        p = probe;
        p.persist_items = static_cast<int>(items);
        p.persist_nqb = static_cast<int>(grid.x);
        int dev = 0, sms = 0;
        cudaError_t err = cudaGetDevice(&dev);
        if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (err == cudaSuccess)
            err = cudaFuncSetAttribute(hopper_ws_persist_fwd<WT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       WT::kSmemPersist);
        if (err != cudaSuccess) return err;
        const int ctas = static_cast<int>(std::min<int64_t>(items, std::max(sms, 1)));
        hopper_ws_persist_fwd<WT><<<ctas, WT::kThreads, WT::kSmemPersist, stream>>>(p);
        return cudaGetLastError();
    }
}

}  // namespace stof
