// Built instead of gemmEpilogue.cpp when no cuBLASLt was found: the GEMM entry points report UNSUPPORTED.
#include "epilogueCommon.h"

extern "C" int32_t stof_gemm_available(void) { return 0; }
extern "C" stof_epi_status_t stof_gemm_context_create(stof_gemm_context_t* ctx) {
    if (ctx) *ctx = nullptr;
    stof_epi::setLastError("libstof_epilogue was built without cuBLASLt");
    return STOF_EPI_ERROR_UNSUPPORTED;
}
extern "C" void stof_gemm_context_destroy(stof_gemm_context_t) {}
extern "C" size_t stof_gemm_workspace_size(void) { return 0; }
extern "C" stof_epi_status_t stof_gemm_epilogue_run(stof_gemm_context_t, int32_t, int64_t, int64_t, int64_t,
                                                    const void*, const void*, const void*, int32_t, void*, void*,
                                                    size_t, stof_epi_stream_t) {
    stof_epi::setLastError("libstof_epilogue was built without cuBLASLt");
    return STOF_EPI_ERROR_UNSUPPORTED;
}
extern "C" stof_epi_status_t stof_gemm_epilogue_run_algo(stof_gemm_context_t, int32_t, int64_t, int64_t, int64_t,
                                                         const void*, const void*, const void*, int32_t, int32_t,
                                                         void*, void*, size_t, stof_epi_stream_t) {
    stof_epi::setLastError("libstof_epilogue was built without cuBLASLt");
    return STOF_EPI_ERROR_UNSUPPORTED;
}
extern "C" stof_epi_status_t stof_gemm_epilogue_run_strided(stof_gemm_context_t, int32_t, int64_t, int64_t, int64_t,
                                                            int64_t, const void*, const void*, const void*, int32_t,
                                                            int32_t, void*, int64_t, void*, size_t, stof_epi_stream_t) {
    stof_epi::setLastError("libstof_epilogue was built without cuBLASLt");
    return STOF_EPI_ERROR_UNSUPPORTED;
}
