// libstof_epilogue's entry to the shared hold kernel (plugins_cu/common/hold_stream.cuh), for the GEMM algorithms'
// first-use timing (gemmEpilogue.cpp, compiled as C++).
#include "epilogueCommon.h"
#include "hold_stream.cuh"

namespace stof_epi {

cudaError_t launchHold(int64_t nanoseconds, cudaStream_t stream) {
    return stof_common::hold_stream(stream, nanoseconds);
}

}  // namespace stof_epi
