// Shared helpers of libstof_epilogue: the thread-local error detail and the status-returning guards.
#ifndef STOF_EPILOGUE_COMMON_H
#define STOF_EPILOGUE_COMMON_H

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "stof/stof_epilogue.h"

namespace stof_epi {

void setLastError(std::string const& msg);

// Return `status` from the enclosing function with a formatted message when `cond` fails.
#define STOF_EPI_CHECK(cond, status, ...)                                \
    do {                                                                 \
        if (!(cond)) {                                                   \
            char buf_[512];                                              \
            std::snprintf(buf_, sizeof(buf_), __VA_ARGS__);              \
            ::stof_epi::setLastError(buf_);                              \
            return (status);                                             \
        }                                                                \
    } while (0)

#define STOF_EPI_CUDA(call)                                                                                   \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        STOF_EPI_CHECK(e_ == cudaSuccess, STOF_EPI_ERROR_CUDA, "%s: %s", #call, cudaGetErrorString(e_));      \
    } while (0)

template <typename T>
struct DType;

}  // namespace stof_epi

#endif  // STOF_EPILOGUE_COMMON_H
