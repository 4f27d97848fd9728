// A one-thread kernel that keeps a stream busy for a while. Queued ahead of timed launches, it lets the host enqueue
// all of them before the first starts, so CUDA events around them time the GPU, not the host's launch rate (small
// problems run in a few microseconds, about what the host spends launching one). Used by the first-use timing of
// the attention tactics (libstof_kernels) and of the GEMM algorithms (libstof_epilogue).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace stof_common {
namespace {  // internal linkage: each library that includes this has its own copy

__global__ void hold_kernel(int64_t nanoseconds) {
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (static_cast<int64_t>(now - start) < nanoseconds);
}

inline cudaError_t hold_stream(cudaStream_t stream, int64_t nanoseconds) {
    hold_kernel<<<1, 1, 0, stream>>>(nanoseconds);
    return cudaGetLastError();
}

}  // namespace
}  // namespace stof_common
