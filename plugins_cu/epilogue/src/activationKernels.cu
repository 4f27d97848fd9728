// Exact (erf) GELU, in place, after a cuBLASLt GEMM whose epilogue already added the bias.
#include <cstdint>

#include "epilogueCommon.h"
#include "typeConvert.cuh"

namespace stof_epi {
namespace {

constexpr int kThreads = 256;
constexpr float kInvSqrt2 = 0.70710678118654752f;

template <typename T>
__global__ void geluErfInPlaceKernel(T* y, int64_t count) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float v = toFloat(y[i]);
        y[i] = fromFloat<T>(0.5f * v * (1.f + erff(v * kInvSqrt2)));
    }
}

__device__ __forceinline__ float geluErf(float v) { return 0.5f * v * (1.f + erff(v * kInvSqrt2)); }

// 16-byte vectors (8 fp16/bf16 or 4 fp32 per thread and step): the pass is bandwidth-bound.
template <typename T>
__global__ void geluErfInPlaceVecKernel(uint4* y, int64_t vecs) {
    constexpr int V = 16 / sizeof(T);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        union {
            uint4 raw;
            T v[V];
        } u;
        u.raw = y[i];
#pragma unroll
        for (int e = 0; e < V; ++e) u.v[e] = fromFloat<T>(geluErf(toFloat(u.v[e])));
        y[i] = u.raw;
    }
}

template <typename T>
cudaError_t launch(void* y, int64_t count, cudaStream_t stream) {
    constexpr int V = 16 / sizeof(T);
    if (count % V == 0 && (reinterpret_cast<uintptr_t>(y) & 15u) == 0) {
        int64_t const vecs = count / V;
        int64_t const blocks = (vecs + kThreads - 1) / kThreads;
        int const grid = static_cast<int>(blocks < 132 * 16 ? blocks : 132 * 16);
        geluErfInPlaceVecKernel<T><<<grid, kThreads, 0, stream>>>(static_cast<uint4*>(y), vecs);
        return cudaGetLastError();
    }
    int64_t blocks = (count + kThreads - 1) / kThreads;
    int grid = static_cast<int>(blocks < 132 * 32 ? blocks : 132 * 32);
    geluErfInPlaceKernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(y), count);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launchGeluErfInPlace(int32_t dtype, void* y, int64_t count, cudaStream_t stream) {
    switch (dtype) {
    case STOF_EPI_FP32: return launch<float>(y, count, stream);
    case STOF_EPI_FP16: return launch<__half>(y, count, stream);
    case STOF_EPI_BF16: return launch<__nv_bfloat16>(y, count, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace stof_epi
