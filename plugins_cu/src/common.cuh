// Device helpers shared by the STOF attention kernels: PTX wrappers (cp.async, ldmatrix, mma.sync m16n8k16),
// the kernel-side parameter block and the element-type traits.  See docs/kernels.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap (a plain struct; nothing links against the driver library)
#include <cuda_runtime.h>
#include <algorithm>
#include <stdint.h>
#include <stdlib.h>

namespace stof {

// Kernel-side parameters: the C ABI struct and its layout handle's device data, with derived fields (Tq, ...).
struct KernelParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    int64_t q_sb, q_sh, q_ss;
    int64_t k_sb, k_sh, k_ss;
    int64_t v_sb, v_sh, v_ss;
    int64_t o_sb, o_sh, o_ss;
    int batch, heads, seq_q, seq_k;
    float scale_log2;  // scale * log2(e): softmax is computed with exp2
    const int32_t* row_ptr;
    const int32_t* col_idx;
    const int32_t* tile_bitmap_index;
    const int32_t* bitmaps;
    // the bitmaps in the tensor-core kernels' thread order (derived by the layout handle), or null
    const int32_t* lane_bitmaps;
    int tile_m, tile_n, num_layouts, tq;  // tq = tile rows per layout = ceil(layout_seq_q / tile_m)
    const int32_t* key_lengths;           // [B] or null
    const int32_t* key_padding_mask;      // [B, seq_k] or null
    // Schedule (set by schedule_grid): the layout handle's row_order, kept only when a CTA covers at most one tile row;
    // sched_chunk = heads*batch pairs whose CTAs are interleaved (see block_work).
    const int32_t* row_order;
    int sched_chunk;
    // the handle's pair_order, kept only when a CTA covers exactly two tile rows (then row_order is dropped)
    const int32_t* pair_order;
    // the caller's sched_chunk was 1 (the layout handle's: rows of near-equal length): the persistent kernels with
    // a scheduler warp then hand out all but their last wave of items statically (hopper_ws.cuh, ws_claim_item)
    bool uniform_rows;
    // K and V (and Q, O) as TMA tensor maps (encoded by the TMA kernels' launchers, unused by every other kernel)
    CUtensorMap tma_k, tma_v, tma_q, tma_o;
    // Persistent kernels (hopper_ws_persist_fwd): the work counter (zeroed by the kernel; C ABI workspace),
    // the items of the schedule's grid and its query blocks per (batch, head)
    int* work_counter;
    int persist_items, persist_nqb;
    // Grouped-query attention: kv_group query heads per K/V head (1 = none); the kernels take K/V head h / kv_group
    // as kv_head() computes it (after every other field: a build without it keeps the others' offsets)
    int kv_group;
    uint32_t kv_mul, kv_keep;
    // Packed variable-length sequences ([B+1] or null): batch b's rows start at row seq_offsets[b] (the batch
    // strides are 0 then: kernel_params) and it has n_b = seq_offsets[b+1] - seq_offsets[b] queries and keys
    const int32_t* seq_offsets;
    // The split tactics (kv_split): each work item's key walk in kv_splits slices, one CTA each, whose fp32 outputs
    // and log-sum-exps go to split_ws (the workspace) for the merge kernel (blockwise.cuh); 1 and null otherwise
    int kv_splits;
    float* split_ws;
};

// h / p.kv_group in three instructions per work item, not a division: kv_mul = floor(2^32 / kv_group) + 1 and
// kv_keep = 0 when kv_group >= 2 (exact for h * kv_group < 2^32: heads <= 65535); kv_mul = 0, kv_keep = ~0 without
// grouping.
__device__ __forceinline__ int kv_head(const KernelParams& p, int h) {
    const uint32_t u = static_cast<uint32_t>(h);
    return static_cast<int>(__umulhi(u, p.kv_mul) + (u & p.kv_keep));
}

using LaunchFn = cudaError_t (*)(const KernelParams&, cudaStream_t);

template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<__half> {
    static __device__ __forceinline__ uint32_t pack(float x, float y) {
        __half2 h = __floats2half2_rn(x, y);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __half2 h = *reinterpret_cast<__half2*>(&u);
        return __half22float2(h);
    }
};
template <>
struct ElemTraits<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float x, float y) {
        __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&u);
        return __bfloat1622float2(h);
    }
};

// D[4] += A[4] (16x16, row) * B[2] (16x8, col), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination (tails).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The 64 keys [n0, n0 + 64) of a step as two "key allowed" words in the bitmap's bit order (bit i of word w =
// key n0 + 32 w + i is below the key length and not padded): one coalesced load and one ballot per word and warp
// (per-column loads would cost 16 loads and ~30 integer instructions per thread and step, on every tile of a
// padded batch).  Every lane of the warp must call it (warp-uniform control flow).
__device__ __forceinline__ void key_words(uint32_t (&kw)[2], int n0, int kv_len, const int32_t* kpm, int lane) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        const int key = n0 + 32 * w + lane;
        bool ok = key < kv_len;
        if (kpm != nullptr && ok) ok = __ldg(kpm + key) != 0;
        kw[w] = __ballot_sync(0xffffffffu, ok);
    }
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------------------------
// CTA schedule.  The hardware starts CTAs in linear block-id order, so the id -> (q-block, head, batch) map is
// the schedule.  Two goals: (1) longest rows first, so the grid's tail is made of short rows (with a fixed
// reversed order a causal grid ends on the long rows of its last head, and a Longformer/BigBird grid on its
// dense global rows: 1.5-1.6x the ideal time in a list-scheduling model); (2) K/V reuse in L2: the CTAs in flight
// belong to few (batch, head) pairs.  So the (batch, head) pairs are cut into chunks of sched_chunk pairs (their
// K and V fit a share of L2); inside a chunk, position pos of the row order runs for every pair of the chunk
// before pos + 1.  A CTA of two tile rows (128 rows at tile_m 64) takes the pair order instead: the pairs of rows
// whose longer row is longest first.  docs/kernels.md, "Schedule".
struct BlockWork {
    int qb, h, b;
};

// Work item `lin` (0 .. nqb * heads * batch - 1, in start order) of a grid of nqb query blocks per (batch, head).
template <int kBlockM>
__device__ __forceinline__ BlockWork block_work_at(const KernelParams& p, int64_t lin, int nqb) {
    const int64_t nhb = static_cast<int64_t>(p.heads) * p.batch;
    const int64_t per_chunk = static_cast<int64_t>(p.sched_chunk) * nqb;
    const int chunk = static_cast<int>(lin / per_chunk);
    const int hb0 = chunk * p.sched_chunk;
    const int width = static_cast<int>(min(static_cast<int64_t>(p.sched_chunk), nhb - hb0));
    const int r = static_cast<int>(lin - chunk * per_chunk);
    const int pos = r / width;
    const int hb = hb0 + (r - pos * width);
    BlockWork w;
    w.h = hb % p.heads;
    w.b = hb / p.heads;
    if (p.row_order != nullptr) {
        const int f = p.tile_m / kBlockM;  // CTAs per tile row
        const int t = pos / f;
        const int row = __ldg(p.row_order + (w.h % p.num_layouts) * p.tq + t);
        // an entry outside [0, tq) makes the CTA exit (q0 >= Sq) instead of indexing out of bounds (the layout
        // handle's orders are permutations, schedule_order.h, so this guards against memory faults only)
        w.qb = static_cast<unsigned>(row) < static_cast<unsigned>(p.tq) ? row * f + (f - 1 - (pos - t * f)) : nqb;
    } else if (p.pair_order != nullptr) {  // a CTA covers tile rows 2 qb and 2 qb + 1
        const int tp = (p.tq + 1) / 2;
        const int pair = __ldg(p.pair_order + (w.h % p.num_layouts) * tp + pos);
        w.qb = static_cast<unsigned>(pair) < static_cast<unsigned>(tp) ? pair : nqb;  // as for row_order
    } else {
        w.qb = nqb - 1 - pos;
    }
    return w;
}

// This CTA's work item (grid = schedule_grid's: nqb x heads x batch).
template <int kBlockM>
__device__ __forceinline__ BlockWork block_work(const KernelParams& p) {
    const int64_t lin = blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
    return block_work_at<kBlockM>(p, lin, gridDim.x);
}

// The schedule's L2 budget, the K/V bytes of the (batch, head) pairs whose work it interleaves (docs/kernels.md
// "Schedule"), by how many CTAs a kernel keeps in flight: the warp-specialised kernels hold one work item per SM
// (persistent, or one CTA per SM), every other kernel several CTAs per SM.  Several CTAs per SM run best with 32 MiB
// (at 16 the last chunk's long rows start late; 64 is slower again), one item per SM with 16.
constexpr int64_t kSchedL2BytesOneItemPerSm = static_cast<int64_t>(16) << 20;
constexpr int64_t kSchedL2BytesManyCtas = static_cast<int64_t>(32) << 20;
// Host: fill the schedule fields of p for a kernel of kBlockM query rows per CTA and return its grid.  The row
// order is used when a CTA covers at most one tile row, the pair order when it covers exactly two, either only when
// the run-time rows are >= 3/4 of the layout's (the grid then spans every tile row of the layout; CTAs past seq_q
// exit at once).  l2_budget: see above.
template <int kBlockM, int kHeadDim>
inline dim3 schedule_grid(KernelParams& p, int64_t l2_budget = kSchedL2BytesManyCtas) {
    const int needed = (p.seq_q + kBlockM - 1) / kBlockM;
    int nqb = needed;
    if (p.row_order != nullptr && p.tile_m % kBlockM == 0) {
        const int all = p.tq * (p.tile_m / kBlockM);
        if (4 * static_cast<int64_t>(needed) >= 3 * static_cast<int64_t>(all))
            nqb = all;
        else
            p.row_order = nullptr;
        p.pair_order = nullptr;
    } else if (p.pair_order != nullptr && kBlockM == 2 * p.tile_m) {
        const int all = (p.tq + 1) / 2;
        if (4 * static_cast<int64_t>(needed) >= 3 * static_cast<int64_t>(all))
            nqb = all;
        else
            p.pair_order = nullptr;
        p.row_order = nullptr;
    } else {
        p.row_order = nullptr;
        p.pair_order = nullptr;
    }
    const int64_t kv_bytes = 2 * static_cast<int64_t>(p.seq_k) * kHeadDim * 2;
    const int64_t nhb = static_cast<int64_t>(p.heads) * p.batch;
    p.uniform_rows = p.sched_chunk == 1;
    const int64_t chunk = p.sched_chunk > 0 ? p.sched_chunk : l2_budget / kv_bytes;
    p.sched_chunk = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nhb, chunk)));
    return dim3(nqb, p.heads, p.batch);
}

// Host: the launch every block-scheduled attention kernel shares (the row-wise family has its own grid): the
// dynamic shared-memory opt-in above 48 KB, the schedule's grid (schedule_grid fills the schedule fields of p),
// the launch and its error.
template <int kBlockM, int kHeadDim>
inline cudaError_t launch_scheduled(void (*kernel)(KernelParams), KernelParams p, int threads, int smem,
                                    cudaStream_t stream, int64_t l2_budget = kSchedL2BytesManyCtas) {
    if (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return err;
    }
    const dim3 grid = schedule_grid<kBlockM, kHeadDim>(p, l2_budget);
    kernel<<<grid, threads, smem, stream>>>(p);
    return cudaGetLastError();
}

// The stored tiles of the tile row holding query row q0 of head h: entries [e_begin, e_end) of the format, tiles
// entirely past the key bound dropped (columns ascend); a0 = q0's row inside its tile (its first bitmap row).
struct RowWalk {
    int e_begin, e_end, a0;
};
__device__ __forceinline__ RowWalk row_walk(const KernelParams& p, int h, int q0, int kv_len) {
    const int trow = q0 / p.tile_m;
    const int r = (h % p.num_layouts) * p.tq + trow;
    RowWalk w;
    w.a0 = q0 - trow * p.tile_m;
    w.e_begin = __ldg(p.row_ptr + r);
    w.e_end = __ldg(p.row_ptr + r + 1);
    while (w.e_end > w.e_begin && __ldg(p.col_idx + w.e_end - 1) * p.tile_n >= kv_len) --w.e_end;
    return w;
}

// Effective key length of batch b (run-time Sk combined with key_lengths).
__device__ __forceinline__ int effective_kv_len(const KernelParams& p, int b) {
    int n = p.seq_k;
    if (p.key_lengths != nullptr) n = min(n, max(__ldg(p.key_lengths + b), 0));
    return n;
}

// Packed sequences (seq_offsets set): batch b's length n_b, which bounds its queries and keys (rows past it belong
// to the next sequence: never loaded as queries, never stored), and its first row of q/k/v/o (the batch strides are
// 0 then: kernel_params).  The caller guarantees n_b <= seq_q, seq_k.  The kernels apply them in a branch on the
// null pointer, after the unpacked set-up: folded into that set-up, ptxas allocates more registers for it.
__device__ __forceinline__ int packed_len(const KernelParams& p, int b) {
    return max(__ldg(p.seq_offsets + b + 1) - __ldg(p.seq_offsets + b), 0);
}
__device__ __forceinline__ int64_t packed_row0(const KernelParams& p, int b) {
    return static_cast<int64_t>(__ldg(p.seq_offsets + b));
}

// A work item's tensors: (batch b, head h)'s Q, K, V and O (K/V of its K/V head; packed sequences: from row
// seq_offsets[b]) and its key padding row (null without a mask).
template <class Elem>
struct ItemTensors {
    const Elem* q;
    const Elem* k;
    const Elem* v;
    Elem* o;
    const int32_t* kpm;
};
template <class Elem>
__device__ __forceinline__ ItemTensors<Elem> item_tensors(const KernelParams& p, int b, int h) {
    const int hk = kv_head(p, h);  // the K/V head: once per work item, never per step
    ItemTensors<Elem> t;
    t.q = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh;
    t.k = static_cast<const Elem*>(p.k) + b * p.k_sb + hk * p.k_sh;
    t.v = static_cast<const Elem*>(p.v) + b * p.v_sb + hk * p.v_sh;
    t.o = static_cast<Elem*>(p.o) + b * p.o_sb + h * p.o_sh;
    if (p.seq_offsets != nullptr) {  // packed sequences: rows from seq_offsets[b]
        const int64_t r0 = packed_row0(p, b);
        t.q += r0 * p.q_ss, t.k += r0 * p.k_ss, t.v += r0 * p.v_ss, t.o += r0 * p.o_ss;
    }
    t.kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.seq_k : nullptr;
    return t;
}

// The rows a block work item of batch b covers: q_len queries (run-time Sq, or a packed sequence's n_b) and kv_len
// keys (key_lengths, and n_b); false when the item, at query row q0, has no real row.
__device__ __forceinline__ bool item_rows(const KernelParams& p, int b, int q0, int& q_len, int& kv_len) {
    int n_packed = INT_MAX;
    q_len = p.seq_q;
    if (p.seq_offsets != nullptr) {  // packed sequences: n_b rows (the base pointers move in the kernels)
        n_packed = packed_len(p, b);
        q_len = min(q_len, n_packed);
        if (q0 >= q_len) return false;
    }
    kv_len = min(effective_kv_len(p, b), n_packed);
    return true;
}

// A work item that walks one tile row (the one-warpgroup wgmma kernels): its (batch, head), first query row, its
// rows and keys (item_rows) and its row's stored tiles (row_walk); false when there is nothing to compute (a row
// past the run-time Sq, or no real row).
struct RowItem {
    int h, b, q0, q_len, kv_len;
    RowWalk walk;
};
template <int kBlockM>
__device__ __forceinline__ bool row_item(const KernelParams& p, RowItem& it) {
    const BlockWork work = block_work<kBlockM>(p);
    it.h = work.h, it.b = work.b, it.q0 = work.qb * kBlockM;
    if (it.q0 >= p.seq_q) return false;  // a tile row past the run-time Sq (ordered schedule)
    if (!item_rows(p, it.b, it.q0, it.q_len, it.kv_len)) return false;
    it.walk = row_walk(p, it.h, it.q0, it.kv_len);
    return true;
}

// The key bound of the warp-specialised kernels: key_lengths and, in their cp.async form (kMayPack; the launchers
// never run the TMA form with packed sequences, whose code stays without the check), packed sequences.
template <bool kMayPack>
__device__ __forceinline__ int ws_kv_len(const KernelParams& p, int b) {
    const int n = effective_kv_len(p, b);
    if constexpr (kMayPack) return p.seq_offsets != nullptr ? min(n, packed_len(p, b)) : n;
    return n;
}

}  // namespace stof
