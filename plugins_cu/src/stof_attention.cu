// The C ABI (include/stof/stof_attention.h): argument checks, the tactic table, dispatch.
// No exception crosses this file's entry points: every path returns a stof_status_t.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "host/host.h"
#include "schedule_order.h"
#include "stof/stof_attention.h"
#include "tactics.h"

namespace {

using stof::KernelParams;
using stof::LaunchFn;
using stof::host::fail;

struct TacticDesc {
    int id, family, block_m, block_n, warps, stages;
    const char* name;
    bool persistent;  // runs persistent when given a workspace (its work counter)
    bool kv_split;    // splits each work item's key walk over several CTAs (their slices in the workspace)
    int index;        // position in its family's launcher tables
};

constexpr int64_t kWorkspaceBytes = 16;

// Listed (and tried by tactic 0) in the catalogue's order: Hopper first where it can run, then mma.sync, then
// row-wise (tactics.h, generated from plugins_cu/tactics.toml).
#define STOF_TACTIC_DESC(id, family, index, bm, bn, w, s, name, persistent, kv_split) \
    {id, family, bm, bn, w, s, name, persistent, kv_split, index},
const TacticDesc kTactics[] = {STOF_TACTIC_TABLE(STOF_TACTIC_DESC)};
#undef STOF_TACTIC_DESC
constexpr int kNumTactics = sizeof(kTactics) / sizeof(kTactics[0]);
static_assert(kNumTactics == stof::kNumBlockTactics + stof::kNumRowTactics + stof::kNumHopperTactics, "catalogue");

const TacticDesc* find_tactic(int id) {
    for (const auto& t : kTactics)
        if (t.id == id) return &t;
    return nullptr;
}

int family_index(const TacticDesc& t) { return t.index; }

// Compute capability of the current device (-1 when unknown).
int current_sm() {
    const stof::host::DeviceCaps* c = stof::host::current_device_caps();
    return c ? c->sm : -1;
}

// Compiled for every architecture of the build, like the kernels (stof::host::check_device_code loads it).
__global__ void code_probe_kernel() {}

LaunchFn launcher_for(const TacticDesc& t, const stof_attn_params_t& p) {
    const int dt = p.dtype, d = p.head_dim == 64 ? 0 : 1;
    if (t.family == 2) return stof::kRowLaunchers[dt][d][family_index(t)];
    static const LaunchFn* hopper[2][2] = {{stof::kHopperLaunchersF16D64, stof::kHopperLaunchersF16D128},
                                           {stof::kHopperLaunchersBF16D64, stof::kHopperLaunchersBF16D128}};
    if (t.family == 3) return hopper[dt][d][family_index(t)];
    static const LaunchFn* block[2][2] = {{stof::kBlockLaunchersF16D64, stof::kBlockLaunchersF16D128},
                                          {stof::kBlockLaunchersBF16D64, stof::kBlockLaunchersBF16D128}};
    return block[dt][d][family_index(t)];
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

stof_status_t validate(const stof_attn_params_t* p) {
    if (p == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "params is NULL");
    bool bad_families = false;
    stof::host::kernel_family_mask(&bad_families);
    if (bad_families)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "STOF_KERNEL_FAMILIES=%s: expected a comma-separated list of "
                    "hopper, block, row", std::getenv("STOF_KERNEL_FAMILIES"));
    if (p->dtype != STOF_DTYPE_FP16 && p->dtype != STOF_DTYPE_BF16)
        return fail(STOF_ERROR_UNSUPPORTED, "dtype %d not supported (0 = fp16, 1 = bf16)", p->dtype);
    if (p->head_dim != 64 && p->head_dim != 128)
        return fail(STOF_ERROR_UNSUPPORTED, "head_dim %d not supported (supported: 64, 128)", p->head_dim);
    if (p->batch < 1 || p->num_heads < 1 || p->seq_q < 1 || p->seq_k < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "sizes must be >= 1 (B=%d H=%d Sq=%d Sk=%d)", p->batch,
                    p->num_heads, p->seq_q, p->seq_k);
    if (p->num_heads > 65535 || p->batch > 65535)
        return fail(STOF_ERROR_UNSUPPORTED, "batch and heads must be <= 65535");
    if (!std::isfinite(p->scale)) return fail(STOF_ERROR_INVALID_ARGUMENT, "scale is not finite");
    if (!p->q || !p->k || !p->v || !p->o) return fail(STOF_ERROR_INVALID_ARGUMENT, "q/k/v/o pointer is NULL");
    if (!aligned16(p->q) || !aligned16(p->k) || !aligned16(p->v) || !aligned16(p->o))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "q/k/v/o must be 16-byte aligned");
    const int64_t strides[12] = {p->q_stride_b, p->q_stride_h, p->q_stride_s, p->k_stride_b,
                                 p->k_stride_h, p->k_stride_s, p->v_stride_b, p->v_stride_h,
                                 p->v_stride_s, p->o_stride_b, p->o_stride_h, p->o_stride_s};
    for (int64_t s : strides)
        if (s < 0 || s % 8 != 0)
            return fail(STOF_ERROR_INVALID_ARGUMENT,
                        "element strides must be >= 0 and multiples of 8 (16-byte rows); got %lld", (long long)s);
    if (p->q_stride_s < p->head_dim || p->o_stride_s < p->head_dim || p->k_stride_s < p->head_dim ||
        p->v_stride_s < p->head_dim)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "sequence strides must be >= head_dim");
    if (p->kv_heads < 0 || (p->kv_heads > 0 && p->num_heads % p->kv_heads != 0))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "kv_heads %d must be 0 or divide num_heads (%d)", p->kv_heads,
                    p->num_heads);
    if (p->layout == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout is NULL (stof_layout_create)");
    const stof_layout_st& L = *p->layout;
    if (L.num_layouts != 1 && L.num_layouts != p->num_heads)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "the layout's num_layouts %d must be 1 or num_heads (%d)",
                    L.num_layouts, p->num_heads);
    if (p->sched_chunk < -1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "sched_chunk %d must be >= -1 (-1: the layout's)", p->sched_chunk);
    if (p->workspace != nullptr && (p->workspace_bytes < 0 || reinterpret_cast<uintptr_t>(p->workspace) % 16 != 0))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "workspace must be 16-byte aligned with workspace_bytes >= 0");
    if (p->seq_offsets != nullptr && (p->key_lengths != nullptr || p->key_padding_mask != nullptr))
        return fail(STOF_ERROR_INVALID_ARGUMENT,
                    "seq_offsets (packed sequences) cannot be combined with key_lengths or key_padding_mask");
    if (p->seq_offsets != nullptr && reinterpret_cast<uintptr_t>(p->seq_offsets) % 4 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "seq_offsets must be 4-byte aligned (int32)");
    if (p->seq_q > L.seq_q || p->seq_k > L.seq_k)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "run-time Sq=%d Sk=%d exceed the compiled layout (%d x %d)",
                    p->seq_q, p->seq_k, L.seq_q, L.seq_k);
    return STOF_SUCCESS;
}

// A bound on any bitmap byte offset: the bitmaps' bytes.
uint64_t layout_bitmap_bytes(const stof_layout_st& L) {
    return static_cast<uint64_t>(L.num_bitmaps) * static_cast<uint64_t>(L.tile_m) * static_cast<uint64_t>(L.tile_n) / 8;
}

// A split tactic's slices per work item on the current device (schedule_order.h kv_split_count; 1: no split) and
// the workspace they need: each slice's fp32 rows and their log-sum-exps.
int split_count(const TacticDesc& t, const stof_attn_params_t& p) {
    if (!t.kv_split) return 1;
    const stof::host::DeviceCaps* caps = stof::host::current_device_caps();
    const stof_layout_st& L = *p.layout;
    const int64_t items = static_cast<int64_t>((p.seq_q + t.block_m - 1) / t.block_m) * p.num_heads * p.batch;
    return stof::kv_split_count(items, L.longest_row * (L.tile_n / t.block_n), caps ? caps->sm_count : 0);
}
int64_t split_bytes(const TacticDesc& t, const stof_attn_params_t& p, int splits) {
    if (splits < 2) return 0;
    const int64_t slots = static_cast<int64_t>((p.seq_q + t.block_m - 1) / t.block_m) * p.num_heads * p.batch * splits;
    return (slots * t.block_m * (p.head_dim + 1) * 4 + 15) / 16 * 16;
}

bool tactic_valid(const TacticDesc& t, const stof_attn_params_t& p) {
    const stof_layout_st& L = *p.layout;
    if ((stof::host::kernel_family_mask(nullptr) & (1u << t.family)) == 0) return false;
    // the mma.sync kernels' shared memory (blockwise.cuh kSmemSize) must fit one block of the GPU: 3 stages at head
    // dim 128 need 112 KiB, more than sm_86 / sm_89 give (99 KiB)
    const stof::host::DeviceCaps* caps = t.family == 1 ? stof::host::current_device_caps() : nullptr;
    if (caps != nullptr && (t.block_m + 2 * t.stages * t.block_n) * p.head_dim * 2 > caps->smem_optin) return false;
    if (t.family == 1 && (L.tile_m % t.block_m != 0 || L.tile_n % t.block_n != 0)) return false;
    // wgmma CTAs: 64 rows per warpgroup, each inside one tile row; a CTA may span several tile rows
    if (t.family == 3 && (L.tile_m % 64 != 0 || L.tile_n % t.block_n != 0)) return false;
    if (t.family == 3 && (!stof::kHopperCompiled || current_sm() != 90)) return false;
    // The wgmma kernels address bitmap words by 32-bit byte offsets (row_bits_pair): a bitmap index is below the
    // bitmaps' row count, so every offset stays below 2^32 when that times the tile's bytes does.
    if (t.family == 3 && layout_bitmap_bytes(L) > 0xffffffffull) return false;
    return launcher_for(t, p) != nullptr;
}

KernelParams kernel_params(const stof_attn_params_t& p) {
    KernelParams k;
    k.q = p.q;
    k.k = p.k;
    k.v = p.v;
    k.o = p.o;
    k.q_sb = p.q_stride_b, k.q_sh = p.q_stride_h, k.q_ss = p.q_stride_s;
    k.k_sb = p.k_stride_b, k.k_sh = p.k_stride_h, k.k_ss = p.k_stride_s;
    k.v_sb = p.v_stride_b, k.v_sh = p.v_stride_h, k.v_ss = p.v_stride_s;
    k.o_sb = p.o_stride_b, k.o_sh = p.o_stride_h, k.o_ss = p.o_stride_s;
    k.batch = p.batch, k.heads = p.num_heads, k.seq_q = p.seq_q, k.seq_k = p.seq_k;
    k.kv_group = p.kv_heads > 0 ? p.num_heads / p.kv_heads : 1;  // validate: kv_heads divides num_heads
    k.kv_mul = k.kv_group > 1 ? static_cast<uint32_t>((uint64_t{1} << 32) / static_cast<uint64_t>(k.kv_group) + 1)
                              : 0u;
    k.kv_keep = k.kv_group > 1 ? 0u : ~0u;
    k.scale_log2 = p.scale * 1.4426950408889634f;
    const stof_layout_st& L = *p.layout;
    k.row_ptr = L.d_row_ptr, k.col_idx = L.d_col_idx, k.tile_bitmap_index = L.d_tile_bitmap_index;
    k.bitmaps = L.d_bitmaps;
    k.tile_m = L.tile_m, k.tile_n = L.tile_n, k.num_layouts = L.num_layouts;
    k.tq = L.tiles_q;
    k.key_lengths = p.key_lengths, k.key_padding_mask = p.key_padding_mask;
    k.seq_offsets = p.seq_offsets;
    if (p.seq_offsets != nullptr) k.q_sb = k.k_sb = k.v_sb = k.o_sb = 0;  // the offsets place every batch
    // an order equal to the kernels' own (last first: causal) is not passed: the same schedule, one dependent
    // load less per work item; schedule_grid keeps or drops each per kernel
    k.row_order = (p.options & STOF_OPT_NO_ROW_ORDER) == 0 && !L.row_order_default ? L.d_row_order : nullptr;
    k.pair_order = (p.options & STOF_OPT_NO_PAIR_ORDER) == 0 && !L.pair_order_default ? L.d_pair_order : nullptr;
    k.uniform_rows = false;  // schedule_grid sets it from sched_chunk
    k.sched_chunk = p.sched_chunk < 0 ? L.sched_chunk : p.sched_chunk;  // 0: schedule_grid picks it
    // lane_bitmaps are twice the bitmaps' bytes, addressed by 32-bit byte offsets like them (tactic_valid): beyond
    // that the kernels pack the bitmaps' words as without them (same result)
    const bool lane_ok = (p.options & STOF_OPT_NO_LANE_BITMAPS) == 0 && 2 * layout_bitmap_bytes(L) <= 0xffffffffull;
    k.lane_bitmaps = lane_ok ? L.d_lane_bitmaps : nullptr;
    k.work_counter = p.workspace != nullptr && p.workspace_bytes >= kWorkspaceBytes ? static_cast<int*>(p.workspace)
                                                                                     : nullptr;
    k.kv_splits = 1;  // stof_attn_run sets the split tactics' slices
    k.split_ws = nullptr;
    return k;
}

stof_status_t write_ids(const int32_t* src, int32_t count, int32_t* ids, int32_t cap, int32_t* n) {
    if (n == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "n is NULL");
    if (cap > 0 && ids == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "ids is NULL");
    *n = count;
    for (int i = 0; i < count && i < cap; ++i) ids[i] = src[i];
    if (count > cap) return fail(STOF_ERROR_INSUFFICIENT_BUFFER, "%d tactics, capacity %d", count, cap);
    return STOF_SUCCESS;
}

}  // namespace

const void* stof::host::code_probe() { return reinterpret_cast<const void*>(&code_probe_kernel); }

extern "C" {

void stof_attn_params_init(stof_attn_params_t* p) {
    if (p == nullptr) return;
    std::memset(p, 0, sizeof(*p));
    p->dtype = STOF_DTYPE_FP16;
    p->scale = 1.f;
    p->sched_chunk = -1;
}

stof_status_t stof_attn_validate(const stof_attn_params_t* p) {
    stof_status_t s = validate(p);
    if (s != STOF_SUCCESS) return s;
    for (const auto& t : kTactics)
        if (tactic_valid(t, *p)) return STOF_SUCCESS;
    return fail(STOF_ERROR_UNSUPPORTED, "no tactic supports tile %dx%d", p->layout->tile_m, p->layout->tile_n);
}

stof_status_t stof_attn_list_tactics(const stof_attn_params_t* p, int32_t* ids, int32_t cap, int32_t* n) {
    stof_status_t s = validate(p);
    if (s != STOF_SUCCESS) return s;
    int32_t valid[kNumTactics];
    int32_t count = 0;
    for (const auto& t : kTactics)
        if (tactic_valid(t, *p)) valid[count++] = t.id;
    return write_ids(valid, count, ids, cap, n);
}

stof_status_t stof_attn_all_tactics(int32_t* ids, int32_t cap, int32_t* n) {
    int32_t all[kNumTactics];
    for (int i = 0; i < kNumTactics; ++i) all[i] = kTactics[i].id;
    return write_ids(all, kNumTactics, ids, cap, n);
}

stof_status_t stof_attn_tactic_info(int32_t tactic, int32_t* family, int32_t* block_m, int32_t* block_n,
                                    int32_t* num_warps, int32_t* stages) {
    const TacticDesc* t = find_tactic(tactic);
    if (t == nullptr) return fail(STOF_ERROR_INVALID_TACTIC, "unknown tactic %d", tactic);
    if (family) *family = t->family;
    if (block_m) *block_m = t->block_m;
    if (block_n) *block_n = t->block_n;
    if (num_warps) *num_warps = t->warps;
    if (stages) *stages = t->stages;
    return STOF_SUCCESS;
}

const char* stof_attn_tactic_name(int32_t tactic) {
    const TacticDesc* t = find_tactic(tactic);
    return t ? t->name : "invalid";
}

stof_status_t stof_attn_workspace_size(const stof_attn_params_t* p, int32_t tactic, size_t* bytes) {
    if (bytes == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "bytes is NULL");
    *bytes = 0;
    stof_status_t s = validate(p);
    if (s != STOF_SUCCESS) return s;
    const TacticDesc* t = tactic > 0 ? find_tactic(tactic) : nullptr;
    if (tactic > 0 && t == nullptr) return fail(STOF_ERROR_INVALID_TACTIC, "unknown tactic %d", tactic);
    if (t == nullptr) {  // the most any valid tactic uses
        int64_t most = kWorkspaceBytes;
        for (const auto& c : kTactics)
            if (c.kv_split && tactic_valid(c, *p)) most = std::max(most, split_bytes(c, *p, split_count(c, *p)));
        *bytes = static_cast<size_t>(most);
    } else {
        *bytes = t->persistent ? kWorkspaceBytes : static_cast<size_t>(split_bytes(*t, *p, split_count(*t, *p)));
    }
    return STOF_SUCCESS;
}

stof_status_t stof_attn_run(const stof_attn_params_t* p, int32_t tactic, stof_stream_t stream) {
    stof_status_t s = validate(p);
    if (s != STOF_SUCCESS) return s;
    const TacticDesc* t = nullptr;
    if (tactic <= 0) {
        for (const auto& c : kTactics)
            if (tactic_valid(c, *p)) {
                t = &c;
                break;
            }
        if (t == nullptr) return fail(STOF_ERROR_UNSUPPORTED, "no tactic supports this problem");
    } else {
        t = find_tactic(tactic);
        if (t == nullptr) return fail(STOF_ERROR_INVALID_TACTIC, "unknown tactic %d", tactic);
        if (!tactic_valid(*t, *p))
            return fail(STOF_ERROR_INVALID_TACTIC,
                        "tactic %d (%s) is not valid for tile %dx%d, head_dim %d (block_m must divide tile_m)",
                        tactic, t->name, p->layout->tile_m, p->layout->tile_n, p->head_dim);
    }
    if (p->layout->d_row_ptr == nullptr)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "the layout has no device data (stof_layout_upload)");
    if (p->layout->device >= 0) {
        int dev = -1;
        if (cudaGetDevice(&dev) != cudaSuccess || dev != p->layout->device)
            return fail(STOF_ERROR_INVALID_ARGUMENT, "the layout is uploaded to device %d, the current device is %d",
                        p->layout->device, dev);
    }
    s = stof::host::check_device_code();  // after the argument checks: those are the caller's to fix first
    if (s != STOF_SUCCESS) return s;
    const LaunchFn fn = launcher_for(*t, *p);
    KernelParams k = kernel_params(*p);
    if (t->kv_split) {  // without the workspace the split tactic runs unsplit (same result)
        const int splits = split_count(*t, *p);
        const int64_t need = split_bytes(*t, *p, splits);
        if (need > 0 && p->workspace != nullptr && p->workspace_bytes >= need) {
            k.kv_splits = splits;
            k.split_ws = static_cast<float*>(p->workspace);
        }
    }
    const cudaError_t err = fn(k, reinterpret_cast<cudaStream_t>(stream));
    if (err != cudaSuccess)
        return fail(STOF_ERROR_CUDA, "tactic %s: %s", t->name, cudaGetErrorString(err));
    stof::host::clear_error();
    return STOF_SUCCESS;
}

const char* stof_status_string(stof_status_t s) {
    switch (s) {
        case STOF_SUCCESS: return "success";
        case STOF_ERROR_INVALID_ARGUMENT: return "invalid argument";
        case STOF_ERROR_UNSUPPORTED: return "unsupported";
        case STOF_ERROR_INVALID_TACTIC: return "invalid tactic";
        case STOF_ERROR_CUDA: return "CUDA error";
        case STOF_ERROR_INSUFFICIENT_BUFFER: return "insufficient buffer";
    }
    return "unknown status";
}

int32_t stof_abi_version(void) { return STOF_ABI_VERSION; }

}  // extern "C"
