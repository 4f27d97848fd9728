// Error detail storage and status strings of libstof_epilogue.
#include <string>

#include "epilogueCommon.h"

namespace stof_epi {
namespace {
thread_local std::string tLastError;
}  // namespace

void setLastError(std::string const& msg) { tLastError = msg; }
const char* lastError() { return tLastError.c_str(); }
}  // namespace stof_epi

extern "C" const char* stof_epi_last_error_message(void) { return stof_epi::lastError(); }

extern "C" const char* stof_epi_status_string(stof_epi_status_t s) {
    switch (s) {
    case STOF_EPI_SUCCESS: return "success";
    case STOF_EPI_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case STOF_EPI_ERROR_UNSUPPORTED: return "unsupported";
    case STOF_EPI_ERROR_CUDA: return "CUDA error";
    case STOF_EPI_ERROR_CUBLAS: return "cuBLASLt error";
    }
    return "unknown status";
}
