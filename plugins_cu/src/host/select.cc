// Tactic selection (stof_attn_select): the tactic cache's entry, else (STOF_SELECT_TIME) the fastest of the
// pre-search's shortlist timed on this GPU, else the pre-search's fastest valid tactic, else the library's first
// valid one; memoised per layout handle.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "host.h"

namespace stof {
cudaError_t hold_stream(cudaStream_t stream, int64_t nanoseconds);  // hold_stream.cu
}  // namespace stof

namespace {

using stof::host::fail;

constexpr int kMaxTactics = 128;
constexpr int kMaxDevices = 64;

// Packed batches: the pre-search's constants, fitted on unpadded problems, rank the Hopper tactics of 128 or 192
// rows per work item (two or three warpgroups) first there, yet in their cp.async form (packed sequences) they
// measure 1.0-1.8x (median 1.2x) slower than the best, while a one-warpgroup tactic is within 6 % of the best (H200,
// BERT-base/large shapes up to S=4096).  Their predicted times are scaled by this first.  (A key padding mask
// costs them no more than an unpadded batch: its words come with their steps' descriptors, WsKeys.)
constexpr double kPackedMultiWarpgroupFactor = 3.0;

std::mutex gDeviceMutex;
stof_device_desc_t gDevices[kMaxDevices];
bool gDeviceKnown[kMaxDevices];

const char* dtype_name(int32_t dtype) { return dtype == STOF_DTYPE_BF16 ? "bfloat16" : "float16"; }

bool contains(const int32_t* ids, int32_t n, int32_t id) {
    for (int32_t i = 0; i < n; ++i)
        if (ids[i] == id) return true;
    return false;
}

// Tactics timed in this process, by tactic-cache key: another handle of the same problem needs no second timing
// when there is no cache file (or it cannot be written).
std::mutex gTimedMutex;
std::map<std::string, int32_t>& timed_choices() {
    static auto* m = new std::map<std::string, int32_t>();  // never freed: handles may be in use at exit
    return *m;
}

// The first valid tactic of the ranking with the multi-warpgroup Hopper tactics' predictions scaled by
// kPackedMultiWarpgroupFactor (ties keep the pre-search's order); 0 when none is valid.
int32_t packed_first_choice(const int32_t* ranked, const double* predicted, int32_t n, const int32_t* valid,
                            int32_t n_valid) {
    int32_t best = 0;
    double best_t = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!contains(valid, n_valid, ranked[i])) continue;
        int32_t family = 0, block_m = 0;
        const bool multi = stof_attn_tactic_info(ranked[i], &family, &block_m, nullptr, nullptr, nullptr) ==
                               STOF_SUCCESS &&
                           family == 3 && block_m > 64;
        const double t = predicted[i] * (multi ? kPackedMultiWarpgroupFactor : 1.0);
        if (best == 0 || t < best_t) best = ranked[i], best_t = t;
    }
    return best;
}

bool timing_disabled_by_env() {
    const char* v = std::getenv("STOF_FIRST_USE_TIMING");
    return v != nullptr && (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0 || std::strcmp(v, "false") == 0);
}

// RAII for the scratch memory and events of one timing.
struct Scratch {
    cudaStream_t stream = nullptr;
    void* ptr = nullptr;
    bool async = false;
    std::vector<cudaEvent_t> events;
    ~Scratch() {
        for (cudaEvent_t e : events) cudaEventDestroy(e);
        if (ptr != nullptr) {
            if (async) cudaFreeAsync(ptr, stream);
            else cudaFree(ptr);
        }
        cudaGetLastError();  // nothing here may leave an error behind for the caller's next CUDA call
    }
};

// stof::hold_stream keeps the stream busy for this long, so the timed launches queue up behind it
constexpr int64_t kHoldNs = 200 * 1000;

// Median milliseconds of each candidate (a negative time: it did not run) on the stream, into scratch output.
// false (nothing timed) when the stream is being captured or the scratch cannot be had.
bool time_candidates(const stof_attn_params_t* p, const std::vector<int32_t>& cands, cudaStream_t stream,
                     std::vector<double>* ms) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return false;
    }
    const int64_t elem = 2;  // fp16 and bf16
    const int64_t out_elems = int64_t(p->batch) * p->num_heads * p->seq_q * p->head_dim;
    size_t ws_bytes = 0;
    if (stof_attn_workspace_size(p, 0, &ws_bytes) != STOF_SUCCESS) return false;
    const size_t out_bytes = (size_t(out_elems * elem) + 255) / 256 * 256;
    Scratch scratch;
    scratch.stream = stream;
    if (cudaMallocAsync(&scratch.ptr, out_bytes + ws_bytes + 16, stream) == cudaSuccess) {
        scratch.async = true;
    } else {
        cudaGetLastError();
        scratch.ptr = nullptr;
        if (cudaMalloc(&scratch.ptr, out_bytes + ws_bytes + 16) != cudaSuccess) {
            cudaGetLastError();
            scratch.ptr = nullptr;
            return false;
        }
    }
    stof_attn_params_t t = *p;  // the caller's inputs, the library's output and workspace
    t.o = scratch.ptr;
    t.o_stride_s = p->head_dim;
    t.o_stride_h = int64_t(p->seq_q) * p->head_dim;
    t.o_stride_b = int64_t(p->num_heads) * t.o_stride_h;
    t.workspace = ws_bytes > 0 ? static_cast<char*>(scratch.ptr) + out_bytes : nullptr;
    t.workspace_bytes = int64_t(ws_bytes);
    constexpr int kReps = STOF_SELECT_TIME_REPS;
    scratch.events.resize(2 * kReps);
    for (cudaEvent_t& e : scratch.events)
        if (cudaEventCreate(&e) != cudaSuccess) {
            cudaGetLastError();
            e = nullptr;
            return false;
        }
    const stof_stream_t s = reinterpret_cast<stof_stream_t>(stream);
    ms->assign(cands.size(), -1.0);
    for (size_t c = 0; c < cands.size(); ++c) {
        if (stof_attn_run(&t, cands[c], s) != STOF_SUCCESS) continue;  // warm-up (and module load)
        bool ok = stof::hold_stream(stream, kHoldNs) == cudaSuccess;
        for (int r = 0; r < kReps && ok; ++r) {
            ok = cudaEventRecord(scratch.events[2 * r], stream) == cudaSuccess &&
                 stof_attn_run(&t, cands[c], s) == STOF_SUCCESS &&
                 cudaEventRecord(scratch.events[2 * r + 1], stream) == cudaSuccess;
        }
        if (!ok || cudaEventSynchronize(scratch.events[2 * kReps - 1]) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        std::vector<double> reps;
        for (int r = 0; r < kReps; ++r) {
            float e = 0;
            if (cudaEventElapsedTime(&e, scratch.events[2 * r], scratch.events[2 * r + 1]) == cudaSuccess)
                reps.push_back(e);
        }
        if (reps.empty()) continue;
        std::sort(reps.begin(), reps.end());
        (*ms)[c] = reps[reps.size() / 2];
    }
    stof::host::clear_error();
    return true;
}

// The current device's SM clock in MHz, 0 when unknown.
// Read once per device: every selection keys its memo on it, and a driver query per call costs more than a launch.
int32_t clock_mhz(int dev) {
    static std::atomic<int32_t> known[kMaxDevices];  // 0: not read yet, -1: unknown, else MHz
    if (dev < 0 || dev >= kMaxDevices) return 0;
    int32_t v = known[dev].load(std::memory_order_relaxed);
    if (v == 0) {
        int khz = 0;
        if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess) {
            cudaGetLastError();
            khz = 0;
        }
        v = khz > 0 ? khz / 1000 : -1;
        known[dev].store(v, std::memory_order_relaxed);
    }
    return v > 0 ? v : 0;
}

}  // namespace

extern "C" {

stof_status_t stof_presearch_profile_path(const stof_device_desc_t* device, char* out, size_t cap) {
    if (device == nullptr || out == nullptr || cap == 0) return fail(STOF_ERROR_INVALID_ARGUMENT, "a pointer is NULL");
    const std::string path = stof::host::profile_path(*device);
    if (path.size() + 1 > cap) return fail(STOF_ERROR_INSUFFICIENT_BUFFER, "the path needs %zu bytes", path.size() + 1);
    std::snprintf(out, cap, "%s", path.c_str());
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_presearch_profile_coef(const char* path, const stof_device_desc_t* device,
                                          stof_presearch_coef_t* coef, int32_t cap, int32_t* n) {
    if (n == nullptr || cap < 0 || (coef == nullptr && cap > 0))
        return fail(STOF_ERROR_INVALID_ARGUMENT, "n is NULL or coef/cap inconsistent");
    stof_device_desc_t current;
    int32_t clock = 0;
    if (device == nullptr) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess) {
            cudaGetLastError();
            return fail(STOF_ERROR_CUDA, "no current CUDA device");
        }
        const stof_status_t s = stof_device_describe(dev, &current);
        if (s != STOF_SUCCESS) return s;
        device = &current;
        clock = clock_mhz(dev);
    }
    const bool given = path != nullptr && *path != '\0';
    const std::string p = given ? std::string(path) : stof::host::profile_path(*device);
    std::vector<stof_presearch_coef_t> v;
    if (!p.empty()) {
        const stof_status_t s = stof::host::profile_coef(p, *device, clock, &v, given);
        if (s != STOF_SUCCESS) return s;
    }
    *n = int32_t(v.size());
    for (int32_t i = 0; i < *n && i < cap; ++i) coef[i] = v[size_t(i)];
    if (*n > cap) return fail(STOF_ERROR_INSUFFICIENT_BUFFER, "%d entries", *n);
    stof::host::clear_error();
    return STOF_SUCCESS;
}

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
    return stof_attn_select_on_stream(p, tactic_cache, device, flags, nullptr, tactic, source);
}

stof_status_t stof_attn_select_on_stream(const stof_attn_params_t* p, const char* tactic_cache,
                                         const stof_device_desc_t* device, uint32_t flags, stof_stream_t stream,
                                         int32_t* tactic, int32_t* source) {
    if (tactic == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "tactic is NULL");
    int32_t valid[kMaxTactics], n_valid = 0;
    stof_status_t s = stof_attn_list_tactics(p, valid, kMaxTactics, &n_valid);  // validates p
    if (s != STOF_SUCCESS) return s;
    if (n_valid == 0) return fail(STOF_ERROR_UNSUPPORTED, "no tactic supports this problem");
    if ((flags & STOF_SELECT_TIME) != 0 && timing_disabled_by_env()) flags &= ~uint32_t(STOF_SELECT_TIME);
    const bool timing = (flags & STOF_SELECT_TIME) != 0;
    stof_device_desc_t current;
    int32_t clock = 0;  // unknown for a described device
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
        clock = clock_mhz(dev);
    }
    // the constants `stof calibrate` fitted on this GPU, when there is such a profile (a bad one is ignored here:
    // stof_presearch_profile_coef reports it)
    const std::string profile = stof::host::profile_path(*device);
    std::vector<stof_presearch_coef_t> profile_coef;
    if (!profile.empty() && stof::host::profile_coef(profile, *device, clock, &profile_coef, false) != STOF_SUCCESS)
        profile_coef.clear();
    stof_layout_st& L = *p->layout;
    const std::string cache = tactic_cache != nullptr ? tactic_cache : "";
    const bool kpm = p->key_padding_mask != nullptr;
    char node[256];
    // packed sequences run other kernel forms than an unpadded batch of the same sizes: their own key
    std::snprintf(node, sizeof(node), "StofSparseAttention|%s|H%d|D%d|tile%dx%d|L%d|seq%dx%d|kpm%d%s",
                  dtype_name(p->dtype), p->num_heads, p->head_dim, L.tile_m, L.tile_n, L.num_layouts, L.seq_q,
                  L.seq_k, kpm ? 1 : 0, p->seq_offsets != nullptr ? "|packed" : "");
    const std::string bucket = stof::host::shape_bucket(p->batch, p->seq_q, p->seq_k);
    // with timing a missing cache file is one to create, not an error
    const bool cache_readable = !cache.empty() && (!timing || stof::host::cache_file_exists(cache));
    uint64_t generation = 0;  // a re-read cache file gets new choices
    if (cache_readable) {
        s = stof::host::cache_generation(cache, &generation);
        if (s != STOF_SUCCESS) return s;
    }
    const std::string memo_key = std::string(node) + '\n' + std::to_string(p->batch) + '\n' +
                                 std::to_string(p->seq_q) + '\n' + std::to_string(p->seq_k) + '\n' + device->name +
                                 '\n' + device->cc + '\n' + std::to_string(flags) + '\n' + cache + '\n' +
                                 std::to_string(generation) + '\n' + profile + '\n' +
                                 std::to_string(profile_coef.size());
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
    if (cache_readable) {
        int32_t hit = 0;
        s = stof::host::cache_lookup(cache, device->name, device->cc, node, bucket, L.signature, &hit);
        if (s != STOF_SUCCESS) return s;
        if (hit != 0 && contains(valid, n_valid, hit)) choice = hit, from = STOF_TACTIC_FROM_CACHE;
    }
    const std::string cache_key = std::string(device->name) + '\n' + device->cc + '\n' + node + '\n' + bucket +
                                  '\n' + L.signature;
    if (choice == 0 && timing) {
        std::lock_guard<std::mutex> lock(gTimedMutex);
        auto it = timed_choices().find(cache_key);
        if (it != timed_choices().end() && contains(valid, n_valid, it->second))
            choice = it->second, from = STOF_TACTIC_TIMED;
    }
    int32_t ranked[kMaxTactics];
    double predicted[kMaxTactics];
    int32_t n_ranked = 0;
    if (choice == 0 && (flags & STOF_SELECT_NO_PRESEARCH) == 0) {
        const stof_host_layout_t hl = L.host_view();
        s = STOF_ERROR_INVALID_ARGUMENT;
        if (!profile_coef.empty())
            s = stof_presearch_rank_coef(&device->props, &hl, p->batch, p->num_heads, p->head_dim, p->seq_q,
                                         p->seq_k, profile_coef.data(), int32_t(profile_coef.size()), ranked,
                                         predicted, kMaxTactics, &n_ranked);
        if (s != STOF_SUCCESS && s != STOF_ERROR_INSUFFICIENT_BUFFER)
            s = stof_presearch_rank(&device->props, &hl, p->batch, p->num_heads, p->head_dim, p->seq_q, p->seq_k,
                                    ranked, predicted, kMaxTactics, &n_ranked);
        if (s != STOF_SUCCESS && s != STOF_ERROR_INSUFFICIENT_BUFFER) n_ranked = 0;
        n_ranked = std::min(n_ranked, kMaxTactics);
        if (p->seq_offsets != nullptr) choice = packed_first_choice(ranked, predicted, n_ranked, valid, n_valid);
        for (int32_t i = 0; i < n_ranked && choice == 0; ++i)
            if (contains(valid, n_valid, ranked[i])) choice = ranked[i];
        if (choice != 0) from = STOF_TACTIC_FROM_PRESEARCH;
    }
    if (choice == 0) choice = valid[0], from = STOF_TACTIC_DEFAULT;
    bool remember = true;
    if (timing && from != STOF_TACTIC_FROM_CACHE && from != STOF_TACTIC_TIMED) {
        // the shortlist: the pre-search's valid tactics within the ratio of its first, then the library default;
        // a small problem (its first predicted below STOF_SELECT_TIME_SMALL_US) takes every valid tactic within
        // STOF_SELECT_TIME_SMALL_RATIO of the first
        std::vector<int32_t> cands;
        double first = -1;
        int32_t most = STOF_SELECT_TIME_MAX - 1;
        double ratio = STOF_SELECT_TIME_RATIO;
        for (int32_t i = 0; i < n_ranked; ++i) {
            if (!contains(valid, n_valid, ranked[i])) continue;
            if (first < 0) {
                first = predicted[i];
                if (first * 1e6 <= STOF_SELECT_TIME_SMALL_US) most = kMaxTactics, ratio = STOF_SELECT_TIME_SMALL_RATIO;
            }
            if (int32_t(cands.size()) >= most || predicted[i] > first * ratio) break;
            cands.push_back(ranked[i]);
        }
        // the first choice (a packed batch's may lie outside the ratio), then the library default
        if (std::find(cands.begin(), cands.end(), choice) == cands.end()) cands.push_back(choice);
        if (std::find(cands.begin(), cands.end(), valid[0]) == cands.end()) cands.push_back(valid[0]);
        std::vector<double> ms;
        if (cands.size() > 1 && time_candidates(p, cands, reinterpret_cast<cudaStream_t>(stream), &ms)) {
            int best = -1;
            for (size_t c = 0; c < cands.size(); ++c)
                if (ms[c] > 0 && (best < 0 || ms[c] < ms[size_t(best)])) best = int(c);
            if (best >= 0) {
                stof::host::CacheEntry e;
                e.gpu = device->name, e.cc = device->cc, e.node = node, e.bucket = bucket, e.mask = L.signature;
                e.tactic = cands[size_t(best)], e.time_ms = ms[size_t(best)], e.source = "timed";
                for (size_t c = 0; c < cands.size(); ++c) {
                    if (ms[c] > 0) e.candidates.emplace_back(cands[c], ms[c]);
                    if (cands[c] == choice && ms[c] > 0) e.presearch_tactic = choice, e.presearch_time_ms = ms[c];
                }
                choice = e.tactic, from = STOF_TACTIC_TIMED;
                {
                    std::lock_guard<std::mutex> lock(gTimedMutex);
                    timed_choices()[cache_key] = choice;
                }
                // a cache that cannot be written costs the next process a timing, not this call its result
                if (!cache.empty()) stof::host::cache_store(cache, e);
            }
        } else if (cands.size() > 1) {
            remember = false;  // captured (or no scratch): time on a later call
        }
    }
    if (remember) {
        std::lock_guard<std::mutex> lock(L.memo_mutex);
        L.memo[memo_key] = {choice, from};
    }
    *tactic = choice;
    if (source) *source = from;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

}  // extern "C"
