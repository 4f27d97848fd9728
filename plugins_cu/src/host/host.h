// The host layer of libstof_kernels (internal): errors, layout handles, tactic caches.  Pure C++ apart from the
// CUDA runtime calls of the upload and the device description.
#ifndef STOF_HOST_HOST_H
#define STOF_HOST_HOST_H

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "stof/stof_attention.h"

namespace stof {
namespace host {

// Set the calling thread's last error message and return s.
stof_status_t fail(stof_status_t s, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();

// What the current device can run (device.cc): compute capability (major * 10 + minor), the opt-in shared memory
// of one block and the SM count; nullptr without a current device (host-only use).  Cached per device.
struct DeviceCaps {
    int sm = -1;
    int smem_optin = 0;
    int sm_count = 0;
};
const DeviceCaps* current_device_caps();

// SUCCESS when this build has code for the current device; else CUDA with one line naming the GPU, its architecture
// and the build's.  Loads code_probe() there on the first call per device.
stof_status_t check_device_code();

// A kernel compiled like every other (stof_attention.cu): whether it loads on a device is whether the kernels do.
const void* code_probe();

// The families (bit 1 << family) that STOF_KERNEL_FAMILIES allows (read once; unset: all); *malformed (may be NULL)
// = it holds a word that is not a family.
unsigned kernel_family_mask(bool* malformed);

// SHA-1 (FIPS 180-4), only to reproduce TileLayout.signature(); not for security.
class Sha1 {
public:
    Sha1();
    void update(const void* data, size_t bytes);
    std::string hex_digest();  // finalises; call once

private:
    void block(const uint8_t* p);
    uint32_t h_[5];
    uint8_t buf_[64];
    size_t buf_len_ = 0;
    uint64_t total_ = 0;
};

// The generation of a cache file's read (reading it on first use): a later stof_tactic_cache_load gives a new one.
stof_status_t cache_generation(const std::string& path, uint64_t* generation);

// The tactic id a cache file holds for the key, 0 when none; INVALID_ARGUMENT when the file cannot be read.
stof_status_t cache_lookup(const std::string& path, const std::string& gpu, const std::string& cc,
                           const std::string& node, const std::string& bucket, const std::string& mask,
                           int32_t* tactic);

std::string shape_bucket(int64_t batch, int64_t seq_q, int64_t seq_k);

// One tactic-cache entry to write: the key, the tactic and what the JSON records beside it.
struct CacheEntry {
    std::string gpu, cc, node, bucket, mask;
    int32_t tactic = 0;
    double time_ms = 0;                        // <= 0: not written
    std::string source = "measured";
    int32_t presearch_tactic = 0;              // 0: not written
    double presearch_time_ms = 0;
    std::vector<std::pair<int32_t, double>> candidates;  // tactic -> median ms
};

// Merge the entry into the file (created when missing) under the file's lock and make the merged file the
// process's read of it (a new generation).  INVALID_ARGUMENT when the file is malformed or cannot be written.
stof_status_t cache_store(const std::string& path, const CacheEntry& entry);

bool cache_file_exists(const std::string& path);

// The pre-search profile file for a device: $STOF_PRESEARCH_PROFILE, else
// ${XDG_CACHE_HOME:-~/.cache}/stof-trt/profiles/<name>-<SMs>sm.json (name: characters other than letters, digits,
// '.', '-' as '_'); "" when there is no home.
std::string profile_path(const stof_device_desc_t& device);

// The profile's constants when it describes this device (same name and SM count; clock within 2 % when both
// are known, clock_mhz <= 0: unknown), else none.  A missing file: none, or INVALID_ARGUMENT with must_exist; a
// malformed one: INVALID_ARGUMENT.
stof_status_t profile_coef(const std::string& path, const stof_device_desc_t& device, int32_t clock_mhz,
                           std::vector<stof_presearch_coef_t>* out, bool must_exist);

}  // namespace host
}  // namespace stof

// The layout handle (stof_layout_t).
struct stof_layout_st {
    int32_t tile_m = 0, tile_n = 0, num_layouts = 0, seq_q = 0, seq_k = 0, tiles_q = 0, tiles_k = 0;
    int32_t num_bitmaps = 0;
    int64_t nnz = 0;
    std::vector<int32_t> row_ptr, col_idx, tile_bitmap_index, bitmaps;  // host copies
    std::vector<int32_t> row_order, pair_order, lane_bitmaps;           // derived, host
    int32_t sched_chunk = 0;
    int64_t longest_row = 0;  // stored tiles of the longest tile row (the split tactics' slice count)
    bool row_order_default = false, pair_order_default = false;
    std::string signature;

    // device data: the handle's upload (owned) or the caller's arrays
    std::mutex upload_mutex;
    int32_t* device_buffer = nullptr;
    int32_t device = -1;
    const int32_t* d_row_ptr = nullptr;
    const int32_t* d_col_idx = nullptr;
    const int32_t* d_tile_bitmap_index = nullptr;
    const int32_t* d_bitmaps = nullptr;
    const int32_t* d_row_order = nullptr;
    const int32_t* d_pair_order = nullptr;
    const int32_t* d_lane_bitmaps = nullptr;

    // stof_attn_select's choices per (problem, device, cache, flags): tactic and source
    std::mutex memo_mutex;
    std::map<std::string, std::pair<int32_t, int32_t>> memo;

    stof_host_layout_t host_view() const {
        stof_host_layout_t h{};
        h.row_ptr = row_ptr.data();
        h.col_idx = col_idx.data();
        h.tile_bitmap_index = tile_bitmap_index.data();
        h.bitmaps = bitmaps.data();
        h.num_bitmaps = num_bitmaps;
        h.tile_m = tile_m, h.tile_n = tile_n, h.num_layouts = num_layouts;
        h.layout_seq_q = seq_q, h.layout_seq_k = seq_k;
        return h;
    }
};

#endif  // STOF_HOST_HOST_H
