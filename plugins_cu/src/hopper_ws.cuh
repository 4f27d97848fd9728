// Warp-specialised block-wise sparse attention on Hopper (sm_90a), FlashAttention-3's structure over the STOF
// tile format.  Same semantics as blockwise.cuh / hopper.cuh.
//
// One CTA = a work item of 64 * kConsumers query rows (128, or 192 for tactics 28/29), 1 + kConsumers warpgroups:
//   warpgroup 0, the producer (hopper_ws_producer.cuh): walks the union of the consumers' 64-row tile rows'
//     non-empty columns (a MergeWalk: WsWalk by one warp, or MergedCursor), gathers kSub 64-key sub-blocks per
//     step (they need not be adjacent keys: a step of a sparse row joins its next two non-empty sub-blocks),
//     streams K and V into a
//     kStages-deep ring (lane 0 issuing TMA boxes; 128 threads with cp.async and zero-fill when key_lengths is
//     given) and publishes a step descriptor with each stage (ws_write_desc), signalling one mbarrier (full[stage])
//     per step.  It gives its registers to the consumers (setmaxnreg).
//   warpgroups 1 .. kConsumers, the consumers (hopper_ws_consumer.cuh): each owns 64 query rows (inside one format
//     tile row) and runs, per step,
//     S_i = Q K_i^T  (wgmma, issued before the previous step's P V so the tensor cores stay fed; with two
//       consumers Q comes from registers, WsTraits::kQRegs, except in tactic 23 at head dim 128),
//     O += P_{i-1} V_{i-1},
//     mask + online softmax of S_i while P_{i-1} V_{i-1} runs, then O rescaled and the stage released
//     (mbarrier empty[stage], one arrival per consumer thread; tactic 23 at head dim 128 releases a stage's K once
//     S_i is done and its V after P_i V_i, WsTraits::kSplitKV).  A consumer whose tile row has no tile in a
//     sub-block masks it.  In tactic 24 the two consumers take turns on the tensor cores (WsTraits::kTurns): one
//     issues its MMAs once the other's max is reduced, so they run under the other's exps.
//   hopper_ws_persist_fwd: the same, persistent (one CTA per SM taking items from a work counter); the consumers
//     issue an item's first S with the previous item's last P V at head dim 64 (ws_consume_items).  With two
//     consumers a second producer warp starts the items (claim, Q, walk start) while the first streams K/V
//     (hopper_ws_scheduler.cuh).  The mbarrier and TMA primitives are in hopper_sync.cuh.
// Why: the one-warpgroup kernels (hopper.cuh) serialise barrier -> QK^T -> softmax -> PV inside each CTA and
// re-read K/V for every 64 rows; here loads never stall the math warps, K/V are read once per 128 rows, and a
// 128-key step (kSub = 2) halves the per-step softmax bookkeeping (max reductions, O rescale, barriers).
#pragma once

#include <type_traits>

#include "hopper_sync.cuh"
#include "hopper_ws_consumer.cuh"
#include "hopper_ws_producer.cuh"
#include "hopper_ws_scheduler.cuh"
#include "hopper_ws_traits.cuh"

namespace stof {

template <class WT>
__global__ void __launch_bounds__(WT::kThreads, 1) hopper_ws_attn_fwd(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename WT::Elem;
    constexpr int kBlockM = WT::kBlockM, kStages = WT::kStages, kSub = WT::kSub;

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sKV = sQ + WT::kSmemQ;  // stage s: K at sKV + 2 s kSmemKV, V right after; then the ones
    const uint32_t sBar = sKV + WT::kSmemRing;
    const uint32_t sDesc = sBar + WT::kSmemBar;  // step descriptors (ws_write_desc), one per stage
    auto full_bar = [&](int s) { return WT::full_k(sBar, s); };
    auto empty_bar = [&](int s) { return WT::empty_k(sBar, s); };

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const BlockWork work = block_work<kBlockM>(p);
    const int qb = work.qb, h = work.h, b = work.b;
    const int q0 = qb * kBlockM;
    if (q0 >= p.seq_q) return;  // a tile row past the run-time Sq (ordered schedule)
    // packed sequences (the launcher runs the cp.async form only): n_b rows from row seq_offsets[b]
    int q_len = p.seq_q;
    int64_t r0 = 0;
    if (!WT::kTma && p.seq_offsets != nullptr) {
        q_len = min(q_len, packed_len(p, b));
        if (q0 >= q_len) return;
        r0 = packed_row0(p, b);
    }

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            // TMA: the expect_tx arrival; cp.async: one arrival per producer thread's copies + thread 0's (the descriptor)
            mbar_init(full_bar(s), WT::kTma ? 1 : 129);
            mbar_init(empty_bar(s), 128 * WT::kConsumers);  // one arrival per consumer thread
            if constexpr (WT::kSplitKV) {
                mbar_init(WT::full_v(sBar, s), 1);
                mbar_init(WT::empty_v(sBar, s), 128 * WT::kConsumers);
            }
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
                ws_produce_tma<WT>(p, cur, tid, st, have, kv_head(p, h), b, 0, sKV, sBar, sDesc);
            }
            return;
        } else {
            const int kv_len = ws_kv_len<!WT::kTma>(p, b);
            const int hk = kv_head(p, h);  // the K/V head
            const Elem* gK = static_cast<const Elem*>(p.k) + b * p.k_sb + hk * p.k_sh + r0 * p.k_ss;
            const Elem* gV = static_cast<const Elem*>(p.v) + b * p.v_sb + hk * p.v_sh + r0 * p.v_ss;
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
    const Elem* gQ = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh + r0 * p.q_ss;
    // this consumer's 64 Q rows (rows 64 w .. 64 w + 63 of the item's swizzled Q tile)
    {
        constexpr int kIters = 64 * WT::kChunks / 128;
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
            const int c = ctid + i * 128;
            const int r = c / WT::kChunks, ch = c % WT::kChunks;
            const int grow = q0 + 64 * w + r;
            const bool ok = grow < q_len;
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
        ws_item_cursor(cur, p, q0, h, ws_kv_len<!WT::kTma>(p, b));
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
    // the ring's mbarriers (WsTraits::full_k ...), q_full[kQBufs], q_empty[kQBufs]
    const uint32_t sBar = sKV + WT::kSmemRing;
    const uint32_t sItem = sBar + WT::kSmemBar + 16 * kQBufs;  // int4 per Q buffer: qb, h, b, flags
    const uint32_t sDesc = sItem + 16 * kQBufs;                  // step descriptors (ws_write_desc), one per stage
    auto q_full = [&](int j) { return sBar + WT::kSmemBar + 8 * j; };
    auto q_empty = [&](int j) { return sBar + WT::kSmemBar + 8 * (kQBufs + j); };
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
            mbar_init(WT::full_k(sBar, s), 1);
            mbar_init(WT::empty_k(sBar, s), 128 * WT::kConsumers);
            if constexpr (WT::kSplitKV) {
                mbar_init(WT::full_v(sBar, s), 1);
                mbar_init(WT::empty_v(sBar, s), 128 * WT::kConsumers);
            }
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
            // claim and the walk's start (thousands of cycles) leave warp 0's chain, but an item is claimed only
            // about two steps before its predecessor's walk ends: claiming earlier lengthens the tail.
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
                        tma_store_commit();
                    }
                };
                int j = 0, n_static = 0;
                for (;; ++j) {
                    // Item j - kQBufs's O out of the buffer before its Q comes in -- before waiting for go, not after:
                    // its consumers are usually done with it by then, so the store leaves the chain from go to the
                    // next item's first K/V (claim, Q, walk).  It writes nothing the streaming warp reads; go still
                    // orders the slot, record and window writes below.
                    if (j >= kQBufs) {
                        store_o_of(buf, qphase ^ 1);
                        if (lane == 0) tma_store_wait<true>();
                    }
                    if (j >= 1) mbar_wait(sGo, (j - 1) & 1);
                    BlockWork wk{0, 0, 0};
                    const bool early = j == 0 && early_ok;
                    bool valid;
                    if (early) {  // the CTA's own index, claimed above (off the start-up chain)
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
                    // hand-off, one hand-off less on the kernel's start-up chain.
                    int first = 0;
                    if (early && have) {
                        const bool more =
                            ws_issue_first_step<WT>(p, cur, lane, st, kv_head(p, wk.h), wk.b, sKV, sBar, sDesc);
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
                if (lane == 0) tma_store_wait<false>();
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
                    // slot, record and window, which the scheduler overwrites kQBufs items later (a lane-0 arrival
                    // would leave the other lanes' reads unordered: compute-sanitizer racecheck reports them).
                    auto go = [&](const WsWalk<2>& c) {
                        if (!go_sent && c.c[0] == INT_MAX && c.c[1] == INT_MAX) {
                            mbar_arrive(sGo);
                            go_sent = true;
                        }
                    };
                    // (ring position it held the item's first step when the scheduler issued it)
                    const bool issued = (flags & kWsFirstIssued) != 0;
                    const bool have = issued ? (flags & kWsFirstMore) != 0 : (flags & 2) != 0;
                    it = ws_produce_tma<WT>(p, cur, lane, st, have, kv_head(p, h), b, it + (issued ? 1 : 0), sKV, sBar,
                                            sDesc, go);
                    if (!go_sent) mbar_arrive(sGo);  // an item without steps (the hook never ran)
                    if (++buf == kQBufs) buf = 0, qphase ^= 1;
                }
            }
        } else {
            constexpr int kLanes = kWsProducerLanes<WT::kConsumers>;
            if (tid >= kLanes) return;  // one thread: the three-consumer kernels
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
                it = ws_produce_tma<WT>(p, cur, lane, st, have, kv_head(p, wk.h), wk.b, it, sKV, sBar, sDesc);
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

template <class WT>
cudaError_t launch_hopper_ws(const KernelParams& params, cudaStream_t stream) {
    auto one_cta_per_item = [&](const KernelParams& kp) {
        return launch_scheduled<WT::kBlockM, WT::kHeadDim>(hopper_ws_attn_fwd<WT>, kp, WT::kThreads, WT::kSmemSize,
                                                           stream, kSchedL2BytesOneItemPerSm);
    };
    if constexpr (!WT::kTma) {
        return one_cta_per_item(params);
    } else {
        // key_lengths / packed sequences / no tensor map: the cp.async producer with two consumers (same result)
        using CpAsync = WsTraits<WT::kHeadDim, WT::kStages, WT::kSub, typename WT::Elem, false, 2>;
        constexpr bool kBf16 = !std::is_same<typename WT::Elem, __half>::value;
        KernelParams p = params;
        // key_lengths can end a batch's keys before Sk, where the TMA would bring real rows (see ws_produce_tma);
        // packed sequences have no fixed batch stride for the tensor maps
        if (p.key_lengths != nullptr || p.seq_offsets != nullptr || !encode_kv_maps(p, WT::kHeadDim, kBf16))
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
