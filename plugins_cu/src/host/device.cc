// What the GPU can run: its compute capability and shared memory per block (the kernel families' requirements),
// whether this build has code for it (stof_device_check), and the families STOF_KERNEL_FAMILIES allows.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "host.h"

#ifndef STOF_CUDA_ARCHITECTURES
#define STOF_CUDA_ARCHITECTURES "unknown"  // CMake passes the list it builds for
#endif

namespace {

using stof::host::fail;

constexpr int kMaxDevices = 64;

// Attributes once per device (no CUDA context needed); the probe on the first run there (it loads code).
struct Caps {
    stof::host::DeviceCaps caps;
    std::atomic<bool> known{false};
    std::atomic<bool> probed{false};
    cudaError_t probe = cudaSuccess;
};
std::mutex gCapsMutex;
Caps gCaps[kMaxDevices];

Caps* caps_of_current(int* device) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
        cudaGetLastError();
        return nullptr;
    }
    if (device) *device = dev;
    Caps& c = gCaps[dev];
    if (c.known.load(std::memory_order_acquire)) return &c;
    std::lock_guard<std::mutex> lock(gCapsMutex);
    if (!c.known.load(std::memory_order_relaxed)) {
        int major = 0, minor = 0, smem = 0, sms = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
        }
        c.caps.sm = major * 10 + minor;
        c.caps.smem_optin = smem;
        c.caps.sm_count = sms;
        c.known.store(true, std::memory_order_release);
    }
    return &c;
}

}  // namespace

namespace stof {
namespace host {

const DeviceCaps* current_device_caps() {
    const Caps* c = caps_of_current(nullptr);
    return c ? &c->caps : nullptr;
}

stof_status_t check_device_code() {
    int dev = 0;
    Caps* c = caps_of_current(&dev);
    if (c == nullptr) {
        int probe_dev = 0;
        const cudaError_t err = cudaGetDevice(&probe_dev);
        cudaGetLastError();
        return fail(STOF_ERROR_CUDA, "no usable CUDA device: %s",
                    cudaGetErrorString(err != cudaSuccess ? err : cudaErrorInvalidDevice));
    }
    if (!c->probed.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(gCapsMutex);
        if (!c->probed.load(std::memory_order_relaxed)) {
            cudaFuncAttributes attr{};
            c->probe = cudaFuncGetAttributes(&attr, code_probe());
            cudaGetLastError();  // not sticky: leave nothing behind for the caller's next CUDA call
            c->probed.store(true, std::memory_order_release);
        }
    }
    if (c->probe == cudaSuccess) return STOF_SUCCESS;
    char name[256] = "";
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess) std::snprintf(name, sizeof(name), "%s", prop.name);
    cudaGetLastError();
    const int sm = c->caps.sm;
    if (c->probe == cudaErrorNoKernelImageForDevice || c->probe == cudaErrorInvalidDeviceFunction) {
        if (sm < 80)
            return fail(STOF_ERROR_CUDA, "GPU %d (%s, sm_%d) is not supported: the STOF kernels need sm_80 or newer",
                        dev, name, sm);
        return fail(STOF_ERROR_CUDA,
                    "this libstof_kernels has no code for GPU %d (%s, sm_%d): it is built for CUDA architectures %s; "
                    "rebuild it on this machine (pip install . and cmake -S . -B build build for its GPU) or with "
                    "CMAKE_CUDA_ARCHITECTURES=%d%s (docs/installation.md)",
                    dev, name, sm, STOF_CUDA_ARCHITECTURES, sm, sm == 90 ? "a" : "");
    }
    return fail(STOF_ERROR_CUDA, "GPU %d (%s, sm_%d) cannot load the STOF kernels: %s", dev, name, sm,
                cudaGetErrorString(c->probe));
}

unsigned kernel_family_mask(bool* malformed) {
    struct Mask {
        unsigned bits = 0;
        bool bad = false;
    };
    static const Mask m = [] {
        Mask r;
        const char* v = std::getenv("STOF_KERNEL_FAMILIES");
        if (v == nullptr || *v == '\0') {
            r.bits = ~0u;
            return r;
        }
        const std::string s(v);
        size_t pos = 0;
        while (pos <= s.size()) {
            const size_t comma = s.find(',', pos);
            const size_t end = comma == std::string::npos ? s.size() : comma;
            const std::string w = s.substr(pos, end - pos);
            if (w == "block") r.bits |= 1u << 1;
            else if (w == "row") r.bits |= 1u << 2;
            else if (w == "hopper") r.bits |= 1u << 3;
            else r.bad = true;
            pos = end + 1;
        }
        return r;
    }();
    if (malformed) *malformed = m.bad;
    return m.bits;
}

}  // namespace host
}  // namespace stof

extern "C" {

stof_status_t stof_device_check(int32_t device) {
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return fail(STOF_ERROR_CUDA, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    if (device >= 0 && device != current && (err = cudaSetDevice(device)) != cudaSuccess) {
        cudaGetLastError();
        return fail(STOF_ERROR_CUDA, "CUDA device %d: %s", device, cudaGetErrorString(err));
    }
    const stof_status_t s = stof::host::check_device_code();
    if (device >= 0 && device != current) cudaSetDevice(current);
    cudaGetLastError();
    if (s == STOF_SUCCESS) stof::host::clear_error();
    return s;
}

const char* stof_cuda_architectures(void) { return STOF_CUDA_ARCHITECTURES; }

}  // extern "C"
