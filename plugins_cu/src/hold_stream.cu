// libstof_kernels' entry to the shared hold kernel (plugins_cu/common/hold_stream.cuh), for the host layer's
// first-use timing (host/select.cc, compiled as C++).
#include "hold_stream.cuh"

namespace stof {

cudaError_t hold_stream(cudaStream_t stream, int64_t nanoseconds) {
    return stof_common::hold_stream(stream, nanoseconds);
}

}  // namespace stof
