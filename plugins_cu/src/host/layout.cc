// Layout handles: the tile-layout arrays of docs/format.md checked once on the host, the data derived from them
// (row and pair orders, lane bitmaps, sched_chunk, signature) and their device copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>

#include "host.h"
#include "schedule_order.h"

namespace {

using stof::host::fail;

bool last_first(const std::vector<int32_t>& order, int32_t num_layouts, int32_t n) {
    for (int32_t l = 0; l < num_layouts; ++l)
        for (int32_t i = 0; i < n; ++i)
            if (order[static_cast<size_t>(l) * n + i] != n - 1 - i) return false;
    return true;
}

// The bitmaps in the kernels' thread order (docs/format.md "Derived: the lane bitmaps"): entry (bitmap p, row group
// r of 16 rows, sub-block j of 64 keys, lane l = 4 g + t) is the pair (z, y) of pack_mask_bits (hopper.cuh) for
// rows 16 r + g and 16 r + g + 8.
void lane_bitmaps(const std::vector<int32_t>& bitmaps, int32_t num_bitmaps, int32_t tile_m, int32_t tile_n,
                  std::vector<int32_t>& out) {
    const int64_t words_per_row = tile_n / 32;
    out.resize(static_cast<size_t>(num_bitmaps) * tile_m * tile_n / 16);
    int32_t* dst = out.data();
    for (int64_t p = 0; p < num_bitmaps; ++p)
        for (int32_t r = 0; r < tile_m / 16; ++r)
            for (int32_t j = 0; j < tile_n / 64; ++j)
                for (int32_t l = 0; l < 32; ++l, dst += 2) {
                    const int32_t g = l / 4, t = l % 4;
                    uint32_t z = 0;
                    for (int hh = 0; hh < 2; ++hh) {
                        const int64_t row = 16 * r + g + 8 * hh;
                        for (int w = 0; w < 2; ++w) {
                            const uint32_t word =
                                static_cast<uint32_t>(bitmaps[(p * tile_m + row) * words_per_row + 2 * j + w]);
                            z |= ((word >> (2 * t)) & 0x03030303u) << (2 * (2 * hh + w));
                        }
                    }
                    uint32_t y = 0;
                    for (int q = 0; q < 4; ++q) y |= ((z >> (8 * q + 7)) & 1u) << q;
                    dst[0] = static_cast<int32_t>(z);
                    dst[1] = static_cast<int32_t>(y);
                }
}

stof_status_t check_desc(const stof_layout_desc_t& d) {
    if (!d.row_ptr || !d.col_idx || !d.tile_bitmap_index || !d.bitmaps)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: an array pointer is NULL");
    if (d.format_version != 0 && (d.format_version < 1 || d.format_version > STOF_FORMAT_VERSION))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: format_version %d (this library reads 1 to %d)",
                    d.format_version, STOF_FORMAT_VERSION);
    if (d.tile_m < 16 || d.tile_m > 256 || d.tile_m % 16 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: tile_m %d must be a multiple of 16 in [16, 256]", d.tile_m);
    if (d.tile_n < 32 || d.tile_n > 256 || d.tile_n % 32 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: tile_n %d must be a multiple of 32 in [32, 256]", d.tile_n);
    if (d.seq_q < 1 || d.seq_k < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: seq_q %d and seq_k %d must be >= 1", d.seq_q, d.seq_k);
    if (d.num_layouts < 1 || d.num_layouts > 65535)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: num_layouts %d must be in [1, 65535]", d.num_layouts);
    const int64_t tiles_q = (static_cast<int64_t>(d.seq_q) + d.tile_m - 1) / d.tile_m;
    const int64_t rows = d.num_layouts * tiles_q;
    if (rows > INT32_MAX - 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: num_layouts * Tq = %lld tile rows (at most 2^31 - 2)",
                    static_cast<long long>(rows));
    if (d.row_ptr_len != rows + 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT,
                    "layout: row_ptr has %lld entries, expected num_layouts*ceil(seq_q/tile_m)+1 = %lld",
                    static_cast<long long>(d.row_ptr_len), static_cast<long long>(rows + 1));
    if (d.col_idx_len < 1 || d.tile_bitmap_index_len != d.col_idx_len)
        return fail(STOF_ERROR_INVALID_ARGUMENT,
                    "layout: col_idx (%lld) and tile_bitmap_index (%lld) must be equal non-empty vectors",
                    static_cast<long long>(d.col_idx_len), static_cast<long long>(d.tile_bitmap_index_len));
    const int64_t words = static_cast<int64_t>(d.tile_m) * d.tile_n / 32;
    if (d.bitmaps_len < words || d.bitmaps_len % words != 0 || d.bitmaps_len / words > INT32_MAX)
        return fail(STOF_ERROR_INVALID_ARGUMENT,
                    "layout: bitmaps hold %lld int32, expected max(P,1) rows of tile_m*tile_n/32 = %lld",
                    static_cast<long long>(d.bitmaps_len), static_cast<long long>(words));
    return STOF_SUCCESS;
}

// The faults of docs/format.md the kernels rely on not to read out of bounds.
stof_status_t check_arrays(const stof_layout_st& L) {
    const std::vector<int32_t>& rp = L.row_ptr;
    if (rp[0] != 0) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: row_ptr[0] = %d (must be 0)", rp[0]);
    const int64_t nnz = rp.back();
    if (nnz < 0 || nnz > static_cast<int64_t>(L.col_idx.size()))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: row_ptr[-1] = %lld but col_idx has %zu entries",
                    static_cast<long long>(nnz), L.col_idx.size());
    for (size_t r = 0; r + 1 < rp.size(); ++r)
        if (rp[r] > rp[r + 1]) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: row_ptr decreases at %zu", r);
    for (size_t r = 0; r + 1 < rp.size(); ++r) {
        for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
            const int32_t c = L.col_idx[e], b = L.tile_bitmap_index[e];
            if (c < 0 || c >= L.tiles_k)
                return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: col_idx[%lld] = %d outside [0, %d)",
                            static_cast<long long>(e), c, L.tiles_k);
            if (e > rp[r] && c <= L.col_idx[e - 1])
                return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: col_idx not strictly ascending in tile row %zu", r);
            if (b < -1 || b >= L.num_bitmaps)
                return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: tile_bitmap_index[%lld] = %d outside [-1, %d)",
                            static_cast<long long>(e), b, L.num_bitmaps);
        }
    }
    return STOF_SUCCESS;
}

stof_status_t build(const stof_layout_desc_t& d, stof_layout_st& L) {
    L.tile_m = d.tile_m, L.tile_n = d.tile_n, L.num_layouts = d.num_layouts, L.seq_q = d.seq_q, L.seq_k = d.seq_k;
    L.tiles_q = (d.seq_q + d.tile_m - 1) / d.tile_m;
    L.tiles_k = (d.seq_k + d.tile_n - 1) / d.tile_n;
    L.num_bitmaps = static_cast<int32_t>(d.bitmaps_len / (static_cast<int64_t>(d.tile_m) * d.tile_n / 32));
    L.row_ptr.assign(d.row_ptr, d.row_ptr + d.row_ptr_len);
    L.col_idx.assign(d.col_idx, d.col_idx + d.col_idx_len);
    L.tile_bitmap_index.assign(d.tile_bitmap_index, d.tile_bitmap_index + d.tile_bitmap_index_len);
    L.bitmaps.assign(d.bitmaps, d.bitmaps + d.bitmaps_len);
    stof_status_t s = check_arrays(L);
    if (s != STOF_SUCCESS) return s;
    L.nnz = L.row_ptr.back();
    const int32_t tq = L.tiles_q;
    // the schedules the pre-search ranks on (schedule_order.h)
    L.row_order.resize(static_cast<size_t>(L.num_layouts) * tq);
    L.pair_order.resize(static_cast<size_t>(L.num_layouts) * ((tq + 1) / 2));
    stof::row_order(L.row_ptr.data(), L.num_layouts, tq, L.row_order.data());
    stof::pair_order(L.row_ptr.data(), L.num_layouts, tq, L.pair_order.data());
    L.row_order_default = last_first(L.row_order, L.num_layouts, tq);
    L.pair_order_default = last_first(L.pair_order, L.num_layouts, (tq + 1) / 2);
    L.sched_chunk = stof::sched_chunk(L.row_ptr.data(), L.num_layouts, tq);
    L.longest_row = stof::longest_row(L.row_ptr.data(), L.num_layouts, tq);
    if (L.tile_m % 16 == 0 && L.tile_n % 64 == 0)
        lane_bitmaps(L.bitmaps, L.num_bitmaps, L.tile_m, L.tile_n, L.lane_bitmaps);
    // TileLayout.signature(): the current format version whatever the input's (version 1 reads as version 2)
    stof::host::Sha1 sha;
    const int64_t header[6] = {STOF_FORMAT_VERSION, L.seq_q, L.seq_k, L.tile_m, L.tile_n, L.num_layouts};
    sha.update(header, sizeof(header));
    for (const auto* a : {&L.row_ptr, &L.col_idx, &L.tile_bitmap_index, &L.bitmaps})
        sha.update(a->data(), a->size() * sizeof(int32_t));
    L.signature = sha.hex_digest();
    return STOF_SUCCESS;
}

}  // namespace

extern "C" {

stof_status_t stof_layout_create(const stof_layout_desc_t* desc, stof_layout_t* out) {
    if (out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: out is NULL");
    *out = nullptr;
    if (desc == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: desc is NULL");
    stof_status_t s = check_desc(*desc);
    if (s != STOF_SUCCESS) return s;
    stof_layout_st* L = nullptr;
    try {
        L = new stof_layout_st();
        s = build(*desc, *L);
    } catch (const std::bad_alloc&) {
        s = fail(STOF_ERROR_INVALID_ARGUMENT, "layout: out of host memory");
    }
    if (s != STOF_SUCCESS) {
        delete L;
        return s;
    }
    *out = L;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_layout_upload(stof_layout_t L, stof_stream_t stream) {
    if (L == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout is NULL");
    std::lock_guard<std::mutex> lock(L->upload_mutex);
    if (L->device_buffer != nullptr) return STOF_SUCCESS;
    if (L->d_row_ptr != nullptr)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: runs on the caller's device arrays (use one or the other)");
    const std::vector<int32_t>* parts[7] = {&L->row_ptr,   &L->col_idx,    &L->tile_bitmap_index, &L->bitmaps,
                                            &L->row_order, &L->pair_order, &L->lane_bitmaps};
    size_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) {
        offsets[i] = total;
        total += (parts[i]->size() + 3) / 4 * 4;  // 16-byte aligned parts
    }
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    int32_t* buf = nullptr;
    if (err == cudaSuccess) err = cudaMalloc(&buf, total * sizeof(int32_t));
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    for (int i = 0; i < 7 && err == cudaSuccess; ++i)
        if (!parts[i]->empty())
            err = cudaMemcpyAsync(buf + offsets[i], parts[i]->data(), parts[i]->size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, st);
    // complete before any other stream reads it
    if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    if (err != cudaSuccess) {
        if (buf != nullptr) cudaFree(buf);
        cudaGetLastError();
        return fail(STOF_ERROR_CUDA, "layout upload: %s", cudaGetErrorString(err));
    }
    L->device_buffer = buf;
    L->device = dev;
    L->d_row_ptr = buf + offsets[0];
    L->d_col_idx = buf + offsets[1];
    L->d_tile_bitmap_index = buf + offsets[2];
    L->d_bitmaps = buf + offsets[3];
    L->d_row_order = buf + offsets[4];
    L->d_pair_order = buf + offsets[5];
    L->d_lane_bitmaps = L->lane_bitmaps.empty() ? nullptr : buf + offsets[6];
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_layout_use_device_arrays(stof_layout_t L, const int32_t* row_ptr, const int32_t* col_idx,
                                            const int32_t* tile_bitmap_index, const int32_t* bitmaps) {
    if (L == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout is NULL");
    if (!row_ptr || !col_idx || !tile_bitmap_index || !bitmaps)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: a device array pointer is NULL");
    std::lock_guard<std::mutex> lock(L->upload_mutex);
    if (L->device_buffer != nullptr)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "layout: already uploaded (use one or the other)");
    L->d_row_ptr = row_ptr, L->d_col_idx = col_idx, L->d_tile_bitmap_index = tile_bitmap_index;
    L->d_bitmaps = bitmaps;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

void stof_layout_destroy(stof_layout_t L) {
    if (L == nullptr) return;
    // cudaFree waits for pending work that may read the buffer; a destructor has no one to report an error to
    if (L->device_buffer != nullptr && cudaFree(L->device_buffer) != cudaSuccess) cudaGetLastError();
    delete L;
}

stof_status_t stof_layout_info(stof_layout_t L, stof_layout_info_t* out) {
    if (L == nullptr || out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout or out is NULL");
    std::memset(out, 0, sizeof(*out));
    out->tile_m = L->tile_m, out->tile_n = L->tile_n, out->num_layouts = L->num_layouts;
    out->seq_q = L->seq_q, out->seq_k = L->seq_k, out->tiles_q = L->tiles_q, out->tiles_k = L->tiles_k;
    out->nnz = L->nnz;
    out->num_bitmaps = L->num_bitmaps;
    out->sched_chunk = L->sched_chunk;
    out->row_order_is_default = L->row_order_default;
    out->pair_order_is_default = L->pair_order_default;
    out->has_lane_bitmaps = !L->lane_bitmaps.empty();
    {
        std::lock_guard<std::mutex> lock(L->upload_mutex);
        out->device = L->device_buffer != nullptr ? L->device : -1;
    }
    std::snprintf(out->signature, sizeof(out->signature), "%s", L->signature.c_str());
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_layout_derived(stof_layout_t L, int32_t which, int32_t* out, int64_t cap, int64_t* n) {
    if (L == nullptr || n == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "layout or n is NULL");
    if (cap > 0 && out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "out is NULL");
    const std::vector<int32_t>* a = which == STOF_LAYOUT_ROW_ORDER    ? &L->row_order
                                    : which == STOF_LAYOUT_PAIR_ORDER ? &L->pair_order
                                    : which == STOF_LAYOUT_LANE_BITMAPS ? &L->lane_bitmaps
                                                                        : nullptr;
    if (a == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "unknown derived array %d", which);
    *n = static_cast<int64_t>(a->size());
    std::copy(a->begin(), a->begin() + std::min<int64_t>(*n, std::max<int64_t>(cap, 0)), out);
    if (*n > cap)
        return fail(STOF_ERROR_INSUFFICIENT_BUFFER, "%lld entries, capacity %lld", static_cast<long long>(*n),
                    static_cast<long long>(cap));
    stof::host::clear_error();
    return STOF_SUCCESS;
}

}  // extern "C"
