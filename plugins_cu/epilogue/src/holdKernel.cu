// A one-thread kernel that keeps a stream busy for a while: queued ahead of timed work, it lets the host enqueue
// every timed launch before the first one starts, so CUDA events around them time the GPU, not the launch rate.
#include <cstdint>

#include "epilogueCommon.h"

namespace stof_epi {
namespace {

__global__ void holdKernel(int64_t nanoseconds) {
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (static_cast<int64_t>(now - start) < nanoseconds);
}

}  // namespace

cudaError_t launchHold(int64_t nanoseconds, cudaStream_t stream) {
    holdKernel<<<1, 1, 0, stream>>>(nanoseconds);
    return cudaGetLastError();
}

}  // namespace stof_epi
