// Tactic selection (stof_attn_select): the tactic cache's entry, else the pre-search's fastest valid tactic, else
// the library's first valid one; memoised per layout handle.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "host.h"

namespace {

using stof::host::fail;

constexpr int kMaxTactics = 128;
constexpr int kMaxDevices = 64;

std::mutex gDeviceMutex;
stof_device_desc_t gDevices[kMaxDevices];
bool gDeviceKnown[kMaxDevices];

const char* dtype_name(int32_t dtype) { return dtype == STOF_DTYPE_BF16 ? "bfloat16" : "float16"; }

bool contains(const int32_t* ids, int32_t n, int32_t id) {
    for (int32_t i = 0; i < n; ++i)
        if (ids[i] == id) return true;
    return false;
}

}  // namespace

extern "C" {

stof_status_t stof_device_describe(int32_t device, stof_device_desc_t* out) {
    if (out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "out is NULL");
    if (device < 0 || device >= kMaxDevices) return fail(STOF_ERROR_INVALID_ARGUMENT, "device %d", device);
    std::lock_guard<std::mutex> lock(gDeviceMutex);
    if (!gDeviceKnown[device]) {
        cudaDeviceProp prop{};
        const cudaError_t err = cudaGetDeviceProperties(&prop, device);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return fail(STOF_ERROR_CUDA, "cudaGetDeviceProperties(%d): %s", device, cudaGetErrorString(err));
        }
        stof_device_desc_t d{};
        std::snprintf(d.name, sizeof(d.name), "%s", prop.name);
        std::snprintf(d.cc, sizeof(d.cc), "%d.%d", prop.major, prop.minor);
        const stof_status_t s = stof_presearch_gpu_props(device, &d.props);
        if (s != STOF_SUCCESS) return fail(s, "stof_presearch_gpu_props(%d) failed", device);
        gDevices[device] = d;
        gDeviceKnown[device] = true;
    }
    *out = gDevices[device];
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_attn_select(const stof_attn_params_t* p, const char* tactic_cache, const stof_device_desc_t* device,
                               uint32_t flags, int32_t* tactic, int32_t* source) {
    if (tactic == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "tactic is NULL");
    int32_t valid[kMaxTactics], n_valid = 0;
    stof_status_t s = stof_attn_list_tactics(p, valid, kMaxTactics, &n_valid);  // validates p
    if (s != STOF_SUCCESS) return s;
    if (n_valid == 0) return fail(STOF_ERROR_UNSUPPORTED, "no tactic supports this problem");
    stof_device_desc_t current;
    if (device == nullptr) {
        int dev = 0;
        const cudaError_t err = cudaGetDevice(&dev);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return fail(STOF_ERROR_CUDA, "cudaGetDevice: %s", cudaGetErrorString(err));
        }
        s = stof_device_describe(dev, &current);
        if (s != STOF_SUCCESS) return s;
        device = &current;
    }
    stof_layout_st& L = *p->layout;
    const std::string cache = tactic_cache != nullptr ? tactic_cache : "";
    const bool kpm = p->key_padding_mask != nullptr;
    char node[256];
    std::snprintf(node, sizeof(node), "StofSparseAttention|%s|H%d|D%d|tile%dx%d|L%d|seq%dx%d|kpm%d",
                  dtype_name(p->dtype), p->num_heads, p->head_dim, L.tile_m, L.tile_n, L.num_layouts, L.seq_q,
                  L.seq_k, kpm ? 1 : 0);
    const std::string bucket = stof::host::shape_bucket(p->batch, p->seq_q, p->seq_k);
    uint64_t generation = 0;  // a re-read cache file gets new choices
    if (!cache.empty()) {
        s = stof::host::cache_generation(cache, &generation);
        if (s != STOF_SUCCESS) return s;
    }
    const std::string memo_key = std::string(node) + '\n' + std::to_string(p->batch) + '\n' +
                                 std::to_string(p->seq_q) + '\n' + std::to_string(p->seq_k) + '\n' + device->name +
                                 '\n' + device->cc + '\n' + std::to_string(flags) + '\n' + cache + '\n' +
                                 std::to_string(generation);
    {
        std::lock_guard<std::mutex> lock(L.memo_mutex);
        auto it = L.memo.find(memo_key);
        if (it != L.memo.end()) {
            *tactic = it->second.first;
            if (source) *source = it->second.second;
            stof::host::clear_error();
            return STOF_SUCCESS;
        }
    }
    int32_t choice = 0, from = STOF_TACTIC_DEFAULT;
    if (!cache.empty()) {
        int32_t hit = 0;
        s = stof::host::cache_lookup(cache, device->name, device->cc, node, bucket, L.signature, &hit);
        if (s != STOF_SUCCESS) return s;
        if (hit != 0 && contains(valid, n_valid, hit)) choice = hit, from = STOF_TACTIC_FROM_CACHE;
    }
    if (choice == 0 && (flags & STOF_SELECT_NO_PRESEARCH) == 0) {
        const stof_host_layout_t hl = L.host_view();
        int32_t ranked[kMaxTactics], n = 0;
        s = stof_presearch_rank(&device->props, &hl, p->batch, p->num_heads, p->head_dim, p->seq_q, p->seq_k,
                                ranked, nullptr, kMaxTactics, &n);
        if (s == STOF_SUCCESS || s == STOF_ERROR_INSUFFICIENT_BUFFER)
            for (int32_t i = 0; i < n && i < kMaxTactics && choice == 0; ++i)
                if (contains(valid, n_valid, ranked[i])) choice = ranked[i], from = STOF_TACTIC_FROM_PRESEARCH;
    }
    if (choice == 0) choice = valid[0], from = STOF_TACTIC_DEFAULT;
    {
        std::lock_guard<std::mutex> lock(L.memo_mutex);
        L.memo[memo_key] = {choice, from};
    }
    *tactic = choice;
    if (source) *source = from;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

}  // extern "C"
