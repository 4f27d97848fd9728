// The C ABI (include/stof/stof_attention.h): argument checks, the tactic table, dispatch.
// No exception crosses this file's entry points: every path returns a stof_status_t.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <vector>

#include "schedule_order.h"
#include "stof/stof_attention.h"
#include "tactics.h"

namespace {

using stof::KernelParams;
using stof::LaunchFn;

thread_local char tLastError[512] = "";

stof_status_t fail(stof_status_t s, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(tLastError, sizeof(tLastError), fmt, ap);
    va_end(ap);
    return s;
}

struct TacticDesc {
    int id, family, block_m, block_n, warps, stages;
    const char* name;
    bool persistent;  // runs persistent when given a workspace (its work counter)
    int index;        // position in its family's launcher tables
};

constexpr int64_t kWorkspaceBytes = 16;

// Listed (and tried by tactic 0) in the catalogue's order: Hopper first where it can run, then mma.sync, then
// row-wise (tactics.h, generated from plugins_cu/tactics.toml).
#define STOF_TACTIC_DESC(id, family, index, bm, bn, w, s, name, persistent) \
    {id, family, bm, bn, w, s, name, persistent, index},
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

// Compute capability of the current device (cached per device; -1 when unknown).
int current_sm() {
    static int cache[64];
    static bool init[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return -1;
    if (!init[dev]) {
        int major = 0, minor = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
            cudaGetLastError();
            return -1;
        }
        cache[dev] = major * 10 + minor;
        init[dev] = true;
    }
    return cache[dev];
}

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
    if (!p->row_ptr || !p->col_idx || !p->tile_bitmap_index || !p->bitmaps)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout array pointer is NULL");
    if (p->tile_m < 16 || p->tile_m > 256 || p->tile_m % 16 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "tile_m %d must be a multiple of 16 in [16, 256]", p->tile_m);
    if (p->tile_n < 32 || p->tile_n > 256 || p->tile_n % 32 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "tile_n %d must be a multiple of 32 in [32, 256]", p->tile_n);
    if (p->num_layouts != 1 && p->num_layouts != p->num_heads)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_layouts %d must be 1 or num_heads (%d)", p->num_layouts,
                    p->num_heads);
    if (p->sched_chunk < 0) return fail(STOF_ERROR_INVALID_ARGUMENT, "sched_chunk %d must be >= 0", p->sched_chunk);
    if (p->workspace != nullptr && (p->workspace_bytes < 0 || reinterpret_cast<uintptr_t>(p->workspace) % 16 != 0))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "workspace must be 16-byte aligned with workspace_bytes >= 0");
    if (p->layout_seq_q < 1 || p->layout_seq_k < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "compiled layout sizes must be >= 1");
    if (p->num_bitmaps < 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_bitmaps must be >= 0 (0: not given), got %d", p->num_bitmaps);
    if (p->seq_q > p->layout_seq_q || p->seq_k > p->layout_seq_k)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "run-time Sq=%d Sk=%d exceed the compiled layout (%d x %d)",
                    p->seq_q, p->seq_k, p->layout_seq_q, p->layout_seq_k);
    return STOF_SUCCESS;
}

// A bound on any bitmap byte offset: the bitmaps' bytes when the caller gives their row count (ABI 6), else one
// bitmap per tile of the layouts (every layout's tiles, stored or not), since a bitmap index is below the number
// of stored tiles.
uint64_t layout_bitmap_bytes(const stof_attn_params_t& p) {
    const uint64_t rows = p.num_bitmaps > 0
                              ? static_cast<uint64_t>(p.num_bitmaps)
                              : static_cast<uint64_t>(p.num_layouts > 0 ? p.num_layouts : 1) *
                                    static_cast<uint64_t>((p.layout_seq_q + p.tile_m - 1) / p.tile_m) *
                                    static_cast<uint64_t>((p.layout_seq_k + p.tile_n - 1) / p.tile_n);
    return rows * static_cast<uint64_t>(p.tile_m) * static_cast<uint64_t>(p.tile_n) / 8;
}

bool tactic_valid(const TacticDesc& t, const stof_attn_params_t& p) {
    if (t.family == 1 && (p.tile_m % t.block_m != 0 || p.tile_n % t.block_n != 0)) return false;
    // wgmma CTAs: 64 rows per warpgroup, each inside one tile row; a CTA may span several tile rows
    if (t.family == 3 && (p.tile_m % 64 != 0 || p.tile_n % t.block_n != 0)) return false;
    if (t.family == 3 && (!stof::kHopperCompiled || current_sm() != 90)) return false;
    // The wgmma kernels address bitmap words by 32-bit byte offsets (row_bits_pair): a bitmap index is below the
    // bitmaps' row count (or the layouts' tile count), so every offset stays below 2^32 when that times the tile's
    // bytes does.
    if (t.family == 3 && layout_bitmap_bytes(p) > 0xffffffffull) return false;
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
    k.scale_log2 = p.scale * 1.4426950408889634f;
    k.row_ptr = p.row_ptr, k.col_idx = p.col_idx, k.tile_bitmap_index = p.tile_bitmap_index;
    k.bitmaps = p.bitmaps;
    k.tile_m = p.tile_m, k.tile_n = p.tile_n, k.num_layouts = p.num_layouts;
    k.tq = (p.layout_seq_q + p.tile_m - 1) / p.tile_m;
    k.key_lengths = p.key_lengths, k.key_padding_mask = p.key_padding_mask;
    k.row_order = p.row_order;    // schedule_grid keeps it or drops it per kernel
    k.pair_order = p.pair_order;  // likewise
    k.uniform_rows = false;       // schedule_grid sets it from sched_chunk
    k.sched_chunk = p.sched_chunk;  // 0: schedule_grid picks it
    // lane_bitmaps are twice the bitmaps' bytes, addressed by 32-bit byte offsets like them (tactic_valid): beyond
    // that the kernels pack the bitmaps' words as without them (same result)
    const bool lane_ok = p.tile_m % 16 == 0 && p.tile_n % 64 == 0 && 2 * layout_bitmap_bytes(p) <= 0xffffffffull;
    k.lane_bitmaps = lane_ok ? p.lane_bitmaps : nullptr;
    k.work_counter = p.workspace != nullptr && p.workspace_bytes >= kWorkspaceBytes ? static_cast<int*>(p.workspace)
                                                                                     : nullptr;
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

// The row and pair orders (C ABI helpers) from a host row_ptr: schedule_order.h, shared with the pre-search.
stof_status_t check_orders_args(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, const void* out) {
    if (row_ptr == nullptr || out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "row_ptr or out is NULL");
    if (num_layouts < 1 || tiles_q < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_layouts %d and tiles_q %d must be >= 1", num_layouts, tiles_q);
    tLastError[0] = '\0';
    return STOF_SUCCESS;
}
}  // namespace

extern "C" {

void stof_attn_params_init(stof_attn_params_t* p) {
    if (p == nullptr) return;
    std::memset(p, 0, sizeof(*p));
    p->dtype = STOF_DTYPE_FP16;
    p->num_layouts = 1;
    p->tile_m = 64;
    p->tile_n = 64;
    p->scale = 1.f;
}

stof_status_t stof_attn_validate(const stof_attn_params_t* p) {
    stof_status_t s = validate(p);
    if (s != STOF_SUCCESS) return s;
    for (const auto& t : kTactics)
        if (tactic_valid(t, *p)) return STOF_SUCCESS;
    return fail(STOF_ERROR_UNSUPPORTED, "no tactic supports tile %dx%d", p->tile_m, p->tile_n);
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
    *bytes = t == nullptr || t->persistent ? kWorkspaceBytes : 0;
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
                        tactic, t->name, p->tile_m, p->tile_n, p->head_dim);
    }
    const LaunchFn fn = launcher_for(*t, *p);
    const cudaError_t err = fn(kernel_params(*p), reinterpret_cast<cudaStream_t>(stream));
    if (err != cudaSuccess)
        return fail(STOF_ERROR_CUDA, "tactic %s: %s", t->name, cudaGetErrorString(err));
    tLastError[0] = '\0';
    return STOF_SUCCESS;
}

stof_status_t stof_layout_row_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, int32_t* out) {
    const stof_status_t s = check_orders_args(row_ptr, num_layouts, tiles_q, out);
    if (s == STOF_SUCCESS) stof::row_order(row_ptr, num_layouts, tiles_q, out);
    return s;
}

stof_status_t stof_layout_pair_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, int32_t* out) {
    const stof_status_t s = check_orders_args(row_ptr, num_layouts, tiles_q, out);
    if (s == STOF_SUCCESS) stof::pair_order(row_ptr, num_layouts, tiles_q, out);
    return s;
}

stof_status_t stof_layout_sched_chunk(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q,
                                      int32_t* chunk) {
    if (row_ptr == nullptr || chunk == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "row_ptr or chunk is NULL");
    if (num_layouts < 1 || tiles_q < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_layouts %d and tiles_q %d must be >= 1", num_layouts, tiles_q);
    *chunk = stof::sched_chunk(row_ptr, num_layouts, tiles_q);
    tLastError[0] = '\0';
    return STOF_SUCCESS;
}

stof_status_t stof_layout_lane_bitmaps(const int32_t* bitmaps, int32_t num_bitmaps, int32_t tile_m, int32_t tile_n,
                                       int32_t* out) {
    if (bitmaps == nullptr || out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "bitmaps or out is NULL");
    if (num_bitmaps < 1 || tile_m < 16 || tile_m % 16 != 0 || tile_n < 64 || tile_n % 64 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT,
                    "num_bitmaps %d must be >= 1, tile_m %d a multiple of 16, tile_n %d a multiple of 64", num_bitmaps,
                    tile_m, tile_n);
    // entry (bitmap p, row group r of 16 rows, sub-block j of 64 keys, lane l = 4 g + t): the pair (z, y) of
    // pack_mask_bits (hopper.cuh) for rows 16 r + g (hh = 0) and 16 r + g + 8 (hh = 1)
    const int64_t words_per_row = tile_n / 32;
    int32_t* dst = out;
    for (int64_t p = 0; p < num_bitmaps; ++p)
        for (int32_t r = 0; r < tile_m / 16; ++r)
            for (int32_t j = 0; j < tile_n / 64; ++j)
                for (int32_t l = 0; l < 32; ++l, dst += 2) {
                    const int32_t g = l / 4, t = l % 4;
                    uint32_t z = 0;
                    for (int hh = 0; hh < 2; ++hh) {
                        const int64_t row = 16 * r + g + 8 * hh;
                        for (int w = 0; w < 2; ++w) {
                            const uint32_t word = static_cast<uint32_t>(
                                bitmaps[(p * tile_m + row) * words_per_row + 2 * j + w]);
                            z |= ((word >> (2 * t)) & 0x03030303u) << (2 * (2 * hh + w));
                        }
                    }
                    uint32_t y = 0;
                    for (int q = 0; q < 4; ++q) y |= ((z >> (8 * q + 7)) & 1u) << q;
                    dst[0] = static_cast<int32_t>(z);
                    dst[1] = static_cast<int32_t>(y);
                }
    tLastError[0] = '\0';
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

const char* stof_last_error_message(void) { return tLastError; }

int32_t stof_abi_version(void) { return STOF_ABI_VERSION; }

}  // extern "C"
