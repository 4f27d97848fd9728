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

template <typename T>
cudaError_t launch(void* y, int64_t count, cudaStream_t stream) {
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
