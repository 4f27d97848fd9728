// A one-thread kernel that keeps a stream busy for a while: queued ahead of timed launches, it lets the host enqueue
// all of them before the first starts, so CUDA events around each time the GPU, not the host's launch rate (small
// attention problems run in a few microseconds, about what the host spends launching one).
#include <cuda_runtime.h>

#include <cstdint>

namespace stof {
namespace {

__global__ void hold_kernel(int64_t nanoseconds) {
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (static_cast<int64_t>(now - start) < nanoseconds);
}

}  // namespace

cudaError_t hold_stream(cudaStream_t stream, int64_t nanoseconds) {
    hold_kernel<<<1, 1, 0, stream>>>(nanoseconds);
    return cudaGetLastError();
}

}  // namespace stof
