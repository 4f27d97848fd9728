// The warp-specialised kernels' producer: walks the union of the consumers' tile rows, streams each step's K and V
// into the ring (TMA boxes from one lane, or cp.async from 128 threads) and publishes the step's descriptor.
#pragma once

#include <type_traits>

#include "hopper_sync.cuh"
#include "hopper_ws_traits.cuh"

namespace stof {

// The merged walk as the two-consumer TMA producers run it: the producer warp's 32 lanes hold the same cursor, and
// each tile row's col_idx and tile_bitmap_index entries come through a 32-entry window in shared memory that the
// lanes fill with coalesced loads (every row's at once at an item's start): one L2 round trip per 32 tiles of a row
// instead of a dependent load per tile, and the bitmap indices come with the walk (the descriptor loaded them).
// Columns at or past the key bound end a row (they ascend), so no load trims its end.  A MergeWalk (hopper.cuh) whose
// tile handle is the tile's bitmap index + 2 (FULL: 1).  It shortens the time from a stage's release to its TMA.
// Not in the three-consumer kernels: their producer has 32 registers.
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


// One step's K or V (kPart: 1 = K, 2 = V, 3 = both) into ring stage s, completing on its full barrier(s) (the
// arrival with the expected bytes first).  One lane.
template <class WT, int kPart = 3, int kC>
__device__ __forceinline__ void ws_tma_step(const KernelParams& p, const WsStep<WT::kSub, kC>& st, int hk, int b,
                                            uint32_t sKV, uint32_t sBar, int s) {
    constexpr int kBytes = WT::kSub * 64 * WT::kHeadDim * 2;  // one of K or V
    const uint32_t sK = sKV + s * 2 * WT::kSmemKV;
    static_assert(kPart == 3 || WT::kSplitKV, "K and V apart: split barriers only");
    // without kSplitKV full_v is full_k: one arrival expects both
    if constexpr (kPart & 1) mbar_expect_tx(WT::full_k(sBar, s), WT::kSplitKV ? kBytes : 2 * kBytes);
    if constexpr ((kPart & 2) && WT::kSplitKV) mbar_expect_tx(WT::full_v(sBar, s), kBytes);
#pragma unroll
    for (int hh = 0; hh < WT::kSub; ++hh) {
        const int n0 = st.n0[hh] >= 0 ? st.n0[hh] : st.n0[0];
#pragma unroll
        for (int cb = 0; cb < WT::kHeadDim / 64; ++cb) {
            const uint32_t off = cb * WT::kBlockN * 128 + hh * 64 * 128;
            if constexpr (kPart & 1) tma_load_4d(sK + off, &p.tma_k, cb * 64, n0, hk, b, WT::full_k(sBar, s));
            if constexpr (kPart & 2)
                tma_load_4d(sK + WT::kSmemKV + off, &p.tma_v, cb * 64, n0, hk, b, WT::full_v(sBar, s));
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
                                              bool have, int hk, int b, int it, uint32_t sKV, uint32_t sBar,
                                              uint32_t sDesc, Hook&& on_step = Hook{}) {
    constexpr int kStages = WT::kStages, kSub = WT::kSub;
    if constexpr (WT::kConsumers == 3) {
        // The three-consumer kernels' producer is one thread at 32 registers: no step of look-ahead (a second
        // WsStep spilled on every step, and the consumers waited for their stages).  A step's `more` and `more_w`
        // come from the walk after it: consumer w has a further tile while its cursor column is set.
        for (; have; ++it) {
            int more_w = 0;
#pragma unroll
            for (int w = 0; w < 3; ++w) more_w |= cur.c[w] != INT_MAX ? 1 << w : 0;
            const int s = it % kStages;
            if (it >= kStages) mbar_wait(WT::empty_k(sBar, s), ((it / kStages) + 1) & 1);
            ws_write_desc<WT::kSkip, WsProducerWalk<3>>(sDesc + s * kWsDescBytes, st, more_w != 0, more_w, p);
            ws_tma_step<WT>(p, st, hk, b, sKV, sBar, s);  // the arrival releases the descriptor
            have = more_w != 0 && ws_take_step<kSub>(cur, p, st);
        }
        return it;
    } else {
        WsStep<kSub, WT::kConsumers> next;
        const int32_t* kpm = ws_kpm_row(p, b);
        const int kv_len = effective_kv_len(p, b);
        for (; have; ++it) {
            const bool more = ws_take_step<kSub>(cur, p, next);  // one step ahead: the descriptor's `more`
            on_step(cur);
            WsKeys<kSub> keys{};  // (the mask's loads before the wait for the stage)
            if (kpm != nullptr) keys = ws_step_keys(st, kv_len, kpm, lane);
            const int s = it % kStages;
            const int parity = ((it / kStages) + 1) & 1;
            if (it >= kStages) mbar_wait(WT::empty_k(sBar, s), parity);
            const int more_w = WT::kSkip ? ws_more_mask(cur, next) : 0;
            if (lane == 0) {
                using Walk = WsProducerWalk<WT::kConsumers>;
                ws_write_desc<WT::kSkip, Walk>(sDesc + s * kWsDescBytes, st, more, more_w, p,
                                               kpm != nullptr, keys);
                // the (K) arrival releases the descriptor
                ws_tma_step<WT, WT::kSplitKV ? 1 : 3>(p, st, hk, b, sKV, sBar, s);
            }
            if constexpr (WT::kSplitKV) {  // V once the stage's previous V is released (its P V done)
                if (it >= kStages) mbar_wait(WT::empty_v(sBar, s), parity);
                if (lane == 0) ws_tma_step<WT, 2>(p, st, hk, b, sKV, sBar, s);
            }
            // the warp reconverges every step: no lane may fall kStages positions behind lane 0 in the parity
            // waits above
            if constexpr (kWsProducerLanes<WT::kConsumers> > 1) __syncwarp();
            st = next;
            have = more;
        }
        return it;
    }
}

// The first step of an item (st, at ring position 0) issued by the scheduler warp itself (the CTA's first item, see
// hopper_ws_persist_fwd): cur and st move on one step, as ws_produce_tma's loop leaves them; returns whether the
// item has more steps.
template <class WT>
__device__ __forceinline__ bool ws_issue_first_step(const KernelParams& p, WsWalk<2>& cur, int lane,
                                                    WsStep<WT::kSub, 2>& st, int hk, int b, uint32_t sKV,
                                                    uint32_t sBar, uint32_t sDesc) {
    WsStep<WT::kSub, 2> next;
    const bool more = ws_take_step<WT::kSub>(cur, p, next);
    const int more_w = WT::kSkip ? ws_more_mask(cur, next) : 0;
    const int32_t* kpm = ws_kpm_row(p, b);
    WsKeys<WT::kSub> keys{};
    if (kpm != nullptr) keys = ws_step_keys(st, effective_kv_len(p, b), kpm, lane);
    if (lane == 0) {
        ws_write_desc<WT::kSkip, WsWalk<2>>(sDesc, st, more, more_w, p, kpm != nullptr, keys);
        ws_tma_step<WT>(p, st, hk, b, sKV, sBar, 0);  // (stage 0 is free: K and V at once)
    }
    __syncwarp();
    st = next;
    return more;
}

}  // namespace stof
