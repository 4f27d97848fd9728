// Persistent one-warpgroup wgmma kernel: tactic 13's step (hopper.cuh) with one CTA per occupancy slot looping
// over the schedule's work items.
//
// Why: a sliding-window tile row is 3-5 steps; tactic 13 spends about a third of such a CTA's life before its
// first step (Q and the first K/V sub-block from DRAM) and after its last (O staged and stored), and the other
// CTAs of the SM cover only part of it.  Here the K/V ring runs across item boundaries (the next item's first
// K/V sub-block is prefetched during the current item's last step, like any other step) and Q is double-buffered
// (the next item's Q is requested when the current item starts), so an item boundary costs the O epilogue only.
//
// Work distribution: CTA c takes items c, c + G, c + 2G, ... (G = gridDim.x = SMs x CTAs per SM) of the same
// schedule as the other kernels (block_work_at), which balances only rows of near-equal length (sliding,
// dilated): the launcher runs it only for those (sched_chunk == 1) and tactic 13 otherwise.  Items past the
// run-time Sq (row order over the layout's rows) are skipped; items with no tile still write their zero rows.
#pragma once

#include <atomic>
#include <climits>

#include "hopper.cuh"

namespace stof {

template <class HT>
struct PersistTraits {
    static_assert(HT::kWG == 1 && HT::kStages == 2 && !HT::kDeferPV, "persistent kernel: tactic 13's shape");
    static constexpr int kSmemSize = HT::kSmemSize + HT::kSmemQ;  // Q double buffer
};

template <class HT>
__global__ void __launch_bounds__(HT::kThreads, HT::kMinBlocks) hopper_attn_fwd_persist(const KernelParams p,
                                                                                       int nqb, int num_items) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Elem = typename HT::Elem;
    constexpr int kNI = HT::kNI, kKD = HT::kKD, kKN = HT::kKN, kDI = HT::kDI;
    constexpr int kBlockM = HT::kBlockM, kBlockN = HT::kBlockN, kStages = HT::kStages;

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ0 = (smem_u32(smem) + 1023u) & ~1023u;  // Q buffers 0 and 1, then the K/V ring
    const uint32_t sKV = sQ0 + 2 * HT::kSmemQ;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int stride = gridDim.x;

    // A work item, resolved once: its (q-block, head, batch), key length and tile-row cursor.  The consumer
    // resolves the item after its current one when it starts the current one (the cursor's index loads then have
    // a whole item to land); the producer takes that resolved item when it runs out of the current one, so it
    // does no dependent index loads inside a step (the first version resolved items there: 25 % slower).
    struct Item {
        int lin;  // >= num_items: none
        BlockWork w;
        int kv_len;
        MergedCursor<1> c0;  // at the item's first step
    };
    auto resolve = [&](int lin) {  // the first item at or after lin of this CTA whose rows start below Sq
        Item it;
        for (; lin < num_items; lin += stride) {
            it.w = block_work_at<kBlockM, int>(p, lin, nqb);
            if (it.w.qb * kBlockM < p.seq_q) break;
        }
        it.lin = lin;
        if (lin < num_items) {
            it.kv_len = effective_kv_len(p, it.w.b);
            const int rows[1] = {(it.w.h % p.num_layouts) * p.tq + (it.w.qb * kBlockM) / p.tile_m};
            it.c0.init(p, rows, it.kv_len);
        }
        return it;
    };
    auto load_q = [&](const Item& it, uint32_t buf) {
        const Elem* gQ = static_cast<const Elem*>(p.q) + it.w.b * p.q_sb + it.w.h * p.q_sh;
        load_rows_async128<HT, kBlockM>(buf, gQ, p.q_ss, it.w.qb * kBlockM, p.seq_q, tid);
    };

    Item ci = resolve(blockIdx.x);  // consumer: the item whose steps run
    if (ci.lin >= num_items) return;
    Item ni = resolve(ci.lin + stride);  // the consumer's next item
    int qbuf = 0;                        // Q of item ci is in buffer qbuf, ni's in qbuf ^ 1

    // Producer: the item whose K/V sub-blocks are being prefetched (kStages - 1 = 1 step ahead of the consumer).
    int p_lin = ci.lin, p_kv_len = ci.kv_len;
    BlockWork pw = ci.w;
    MergedCursor<1> pre = ci.c0;
    auto produce = [&](int stage) {
        int ent[1];
        for (;;) {
            const int j = pre.peek(ent);
            if (j != INT_MAX) {
                const Elem* gK = static_cast<const Elem*>(p.k) + pw.b * p.k_sb + pw.h * p.k_sh;
                const Elem* gV = static_cast<const Elem*>(p.v) + pw.b * p.v_sb + pw.h * p.v_sh;
                const int n0 = j * p.tile_n + pre.sub * kBlockN;
                const uint32_t st = sKV + stage * 2 * HT::kSmemKV;
                load_rows_async128<HT, kBlockN>(st, gK, p.k_ss, n0, p_kv_len, tid);
                load_rows_async128<HT, kBlockN>(st + HT::kSmemKV, gV, p.v_ss, n0, p_kv_len, tid);
                pre.advance(p);
                break;
            }
            // this item's steps are all issued: on to the next one (the consumer's resolved next item, unless the
            // producer is already past it -- only after an item without tiles)
            const Item nx = ni.lin > p_lin ? ni : resolve(p_lin + stride);
            if (nx.lin >= num_items) break;
            p_lin = nx.lin;
            pw = nx.w;
            p_kv_len = nx.kv_len;
            pre = nx.c0;
        }
        cp_async_commit();
    };

    // Prologue: Q of the first item, its first K/V sub-block, then Q of the second item (a later group: the first
    // step waits for everything but it).
    load_q(ci, sQ0);
    cp_async_commit();
    produce(0);
    if (ni.lin < num_items) load_q(ni, sQ0 + HT::kSmemQ);
    cp_async_commit();
    bool q_group_newest = true;  // the newest cp.async group holds only a Q load (the step need not wait for it)
    bool stepped = false;        // item ci has run a step (so its Q load, older than that step's K/V, is complete)
    MergedCursor<1> cur = ci.c0;

    const float sl2 = p.scale_log2;
    const bool fold = sl2 > 0.f;
    const float mul = fold ? sl2 : 1.f;
    float rO[kDI * 4];
    float rS[kNI * 4];
#pragma unroll
    for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
#pragma unroll
    for (int i = 0; i < kNI * 4; ++i) rS[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int warp_row0 = warp * 16;
    const uint64_t dK0 = gmma_desc(sKV, 16, 1024);
    const uint64_t dV0 = gmma_desc(sKV + HT::kSmemKV, kBlockN * 128, 1024);

    for (int it = 0;;) {
        int ent[1];
        const int j = cur.peek(ent);
        if (j == INT_MAX) {
            // Item ci is done: O epilogue through its (now free) Q buffer.
            const uint32_t sQ = sQ0 + qbuf * HT::kSmemQ;
            if (!stepped) cp_async_wait<0>();  // an item with no tile: its Q copy may still be writing the buffer
            __syncthreads();  // every warp's last MMA (reading this Q buffer) has completed
            stage_o<Elem, kDI, kBlockM>(rO, row_sum, sQ, warp_row0, g, tig);
            __syncthreads();
            Elem* gO = static_cast<Elem*>(p.o) + ci.w.b * p.o_sb + ci.w.h * p.o_sh;
            store_o<Elem, kBlockM, kBlockM, HT::kChunks, HT::kThreads>(sQ, gO, p.o_ss, ci.w.qb * kBlockM, 0,
                                                                       p.seq_q, tid);
            if (ni.lin >= num_items) break;
            ci = ni;
            cur = ci.c0;
            ni = resolve(ci.lin + stride);
#pragma unroll
            for (int i = 0; i < kDI * 4; ++i) rO[i] = 0.f;
            row_max[0] = row_max[1] = -INFINITY;
            row_sum[0] = row_sum[1] = 0.f;
            qbuf ^= 1;
            stepped = false;
            // the freed buffer takes the Q of the item after ci, once every thread has read its O rows out of it
            __syncthreads();
            if (ni.lin < num_items) load_q(ni, sQ0 + (qbuf ^ 1) * HT::kSmemQ);
            cp_async_commit();
            q_group_newest = true;
            continue;
        }
        const int sub = cur.sub;
        cur.advance(p);
        // this step's K/V (and, older, this item's Q) are complete; a Q load committed after them may still fly
        if (q_group_newest)
            cp_async_wait<1>();
        else
            cp_async_wait<0>();
        q_group_newest = false;
        stepped = true;
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        produce((it + 1) % kStages);

        const int n0 = j * p.tile_n + sub * kBlockN;
        const int my_ent = ent[0];
        const int32_t* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(ci.w.b) * p.seq_k : nullptr;
        const int bm_idx = __ldg(p.tile_bitmap_index + my_ent);
        const int kv_len = ci.kv_len;
        const bool need_mask = bm_idx >= 0 || n0 + kBlockN > kv_len || kpm != nullptr;
        uint32_t bits[2][HT::kWordsN];
        if (need_mask) {
            const int a0 = (ci.w.qb * kBlockM) % p.tile_m;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) row_bits(bits[hh], p, bm_idx, a0 + (warp & 3) * 16 + hh * 8 + g, sub);
        }
        const uint64_t stage_off = static_cast<uint64_t>(((it % kStages) * 2 * HT::kSmemKV) >> 4);
        const uint64_t dK = dK0 + stage_off, dV = dV0 + stage_off;
        const uint64_t dQ0 = gmma_desc(sQ0 + qbuf * HT::kSmemQ, 16, 1024);

        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
            const uint64_t da = dQ0 + (((kk >> 2) * (kBlockM * 128) + (kk & 3) * 32) >> 4);
            const uint64_t db = dK + (((kk >> 2) * (kBlockN * 128) + (kk & 3) * 32) >> 4);
            wgmma_ss<64, Elem>(rS, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rS);

        mask_softmax_step<kNI, kDI>(rS, rO, row_max, row_sum, bits, need_mask, n0, kv_len, kpm, lane, tig, fold, sl2,
                                    mul);
        uint32_t rP[kKN][4];
        pack_p<Elem, kKN>(rP, rS);
        issue_pv<HT::kHeadDim, Elem, kKN>(rO, rP, dV);
        wgmma_wait<0>();
        fence_regs(rO);
        ++it;
    }
    cp_async_wait<0>();  // nothing may still write shared memory when the CTA exits
#else
    __trap();  // built without sm_90a: the dispatcher never selects this tactic then
#endif
}

// Host: as many CTAs as fit on the GPU at once (cached per device), each looping over the schedule's items.
// The items are dealt out statically, which balances only rows of near-equal length: for any other layout (the
// caller's sched_chunk is not 1, see stof_layout_sched_chunk) this runs tactic 13's kernel instead.  (A causal
// grid dealt out round-robin over its longest-first order ends 17-35 % after the list-scheduled one, by a model
// of the session-4 measurement: docs/performance.md.)
template <class HT>
cudaError_t launch_hopper_persist(const KernelParams& params, cudaStream_t stream) {
    if (params.sched_chunk != 1) return launch_hopper<HT>(params, stream);
    KernelParams p = params;
    auto kernel = hopper_attn_fwd_persist<HT>;
    constexpr int kSmem = PersistTraits<HT>::kSmemSize;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    const dim3 grid = schedule_grid<HT::kBlockM, HT::kHeadDim>(p);
    const int64_t items = static_cast<int64_t>(grid.x) * grid.y * grid.z;
    if (items > INT_MAX) return cudaErrorInvalidValue;
    int dev = 0;
    if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
    static std::atomic<int> slots_cache[64];  // SMs x CTAs per SM, per device (0 = not yet asked)
    int slots = dev < 64 ? slots_cache[dev].load(std::memory_order_relaxed) : 0;
    if (slots == 0) {
        int sms = 0, per_sm = 0;
        if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
        if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, HT::kThreads, kSmem)) != cudaSuccess)
            return err;
        slots = std::max(1, sms * per_sm);
        if (dev < 64) slots_cache[dev].store(slots, std::memory_order_relaxed);
    }
    const int ctas = static_cast<int>(std::min<int64_t>(items, slots));
    if (ctas == 0) return cudaSuccess;
    kernel<<<ctas, HT::kThreads, kSmem, stream>>>(p, static_cast<int>(grid.x), static_cast<int>(items));
    return cudaGetLastError();
}

}  // namespace stof
