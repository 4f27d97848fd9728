// The persistent warp-specialised kernel's scheduler: claims work items, loads their Q by TMA, publishes them to the
// consumers and hands a started walk to the streaming producer warp.
#pragma once

#include "hopper_sync.cuh"
#include "hopper_ws_producer.cuh"

namespace stof {

// The persistent kernels' item starts.  ws_claim_item: the CTA's j-th work item, skipping items past the run-time Sq
// (row-ordered grids); n_items when none is left.  Called by the producer thread or warp that claims (lane 0 issues
// the atomics).  The first items are static -- item blockIdx.x + s gridDim.x is the CTA's s-th (n_static counts them),
// so no atomic is on the kernel's start-up path nor between those items -- and the counter hands out the rest, from
// static_rounds gridDim.x on, in the schedule's order (dynamic list scheduling: the longest rows still go first and the
// tail balances).  static_rounds is 1 (only the CTA's own index) unless kStatic (the kernels with a scheduler warp,
// 21-24) and the caller said the layout's rows are of near-equal length (sched_chunk 1, the layout handle's rule);
// then every wave but the last is static (with unequal items a static share leaves an imbalance).
// The work counter needs no memset before the launch (one operation less per call): CTA 0's claiming thread zeroes
// it before its first claim.  A claim made elsewhere before that reads
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

}  // namespace stof
