// The pre-search's GPU properties read from a CUDA device: the one part of the pre-search that needs the CUDA
// runtime (presearch.cc is pure host C++ and builds without it).
#include <cuda_runtime.h>

#include "stof/stof_attention.h"

extern "C" STOF_API stof_status_t stof_presearch_gpu_props(int32_t device, stof_gpu_props_t* out) {
    if (out == nullptr) return STOF_ERROR_INVALID_ARGUMENT;
    stof_gpu_props_t h;
    stof_presearch_h100_props(&h);
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        cudaGetLastError();
        return STOF_ERROR_CUDA;
    }
    // as stof_trt.presearch.gpu_props(): measured H100 rates scaled by the SM count
    double const scale = static_cast<double>(p.multiProcessorCount) / h.sm_count;
    *out = h;
    out->sm_count = p.multiProcessorCount;
    out->smem_per_sm = static_cast<int32_t>(p.sharedMemPerMultiprocessor);
    out->regs_per_sm = p.regsPerMultiprocessor;
    out->max_threads_per_sm = p.maxThreadsPerMultiProcessor;
    out->max_ctas_per_sm = 32;
    out->mma_tflops = h.mma_tflops * scale;
    out->l2_bw = h.l2_bw * scale;
    out->sm = p.major * 10 + p.minor;
    out->wgmma_tflops = p.major == 9 ? h.wgmma_tflops * scale : 0.0;
    return STOF_SUCCESS;
}
