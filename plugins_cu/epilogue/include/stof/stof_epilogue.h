/*
 * STOF fused epilogues: the C ABI of libstof_epilogue (static, linked into libstof_ort.so).
 *
 *   stof_gemm_epilogue_run:   Y[M,N] = act(X[M,K] . W[K,N] + bias[N])          (row-major, cuBLASLt)
 *   stof_add_layernorm_run:   S = X + bias + residual;  Y[r,:] = LayerNorm(S[r,:]) * gamma + beta  (S optional)
 *
 * Plain C types; no C++ exception crosses this boundary; every entry point returns a status code and leaves a
 * detail message for stof_epi_last_error_message().  Arithmetic: fp32 accumulation for every dtype; fp32
 * tensors are multiplied in true fp32 (no TF32).
 */
#ifndef STOF_STOF_EPILOGUE_H
#define STOF_STOF_EPILOGUE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STOF_EPILOGUE_ABI_VERSION 2

typedef struct CUstream_st* stof_epi_stream_t;

typedef enum {
    STOF_EPI_SUCCESS = 0,
    STOF_EPI_ERROR_INVALID_ARGUMENT = 1, /* null pointer, non-positive size, unknown enum */
    STOF_EPI_ERROR_UNSUPPORTED = 2,      /* valid request this build cannot run (e.g. LayerNorm row too long) */
    STOF_EPI_ERROR_CUDA = 4,             /* a CUDA call or kernel launch failed */
    STOF_EPI_ERROR_CUBLAS = 6            /* a cuBLASLt call failed or found no algorithm */
} stof_epi_status_t;

typedef enum { STOF_EPI_FP32 = 0, STOF_EPI_FP16 = 1, STOF_EPI_BF16 = 2 } stof_epi_dtype_t;

typedef enum {
    STOF_ACT_NONE = 0,
    STOF_ACT_GELU_ERF = 1,  /* 0.5 x (1 + erf(x / sqrt 2)): GEMM + bias in cuBLASLt, exact GELU in a fused pass */
    STOF_ACT_GELU_TANH = 2  /* 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))): cuBLASLt GELU_BIAS epilogue */
} stof_activation_t;

/* A cuBLASLt handle plus a cache of matmul descriptors and heuristic algorithms per problem. Thread-safe. */
typedef struct stof_gemm_context* stof_gemm_context_t;

/* 1 when this build has the cuBLASLt GEMM (0: the GEMM entry points return STOF_EPI_ERROR_UNSUPPORTED). */
int32_t stof_gemm_available(void);

stof_epi_status_t stof_gemm_context_create(stof_gemm_context_t* ctx);
void stof_gemm_context_destroy(stof_gemm_context_t ctx);

/* Workspace bytes the GEMM may use (give at least this much for the best algorithms; 0 is allowed). */
size_t stof_gemm_workspace_size(void);

/* X: [M,K], W: [K,N], bias: [N] or NULL, Y: [M,N]; all row-major, contiguous, device pointers, one dtype. */
stof_epi_status_t stof_gemm_epilogue_run(stof_gemm_context_t ctx, int32_t dtype, int64_t m, int64_t n, int64_t k,
                                         const void* x, const void* w, const void* bias, int32_t activation,
                                         void* y, void* workspace, size_t workspace_bytes,
                                         stof_epi_stream_t stream);

/* As stof_gemm_epilogue_run, running cuBLASLt's algorithm number `algo` of its heuristic's results for this problem
 * (cublasLtMatmulAlgoGetHeuristic, up to 16 asked for): -1 = the first (what stof_gemm_epilogue_run runs); an index
 * past the results the heuristic returns runs the first too; STOF_GEMM_ALGO_TIMED = the fastest of the first
 * STOF_GEMM_TIMED_CANDIDATES, timed once per plan (row-count bucket) on the call's own buffers and stream (the
 * first result while that stream captures a CUDA graph; the timing happens on a later call).  Results are equal up
 * to rounding for every algo. */
#define STOF_GEMM_ALGO_TIMED (-2)
#define STOF_GEMM_TIMED_CANDIDATES 8
stof_epi_status_t stof_gemm_epilogue_run_algo(stof_gemm_context_t ctx, int32_t dtype, int64_t m, int64_t n, int64_t k,
                                              const void* x, const void* w, const void* bias, int32_t activation,
                                              int32_t algo, void* y, void* workspace, size_t workspace_bytes,
                                              stof_epi_stream_t stream);

/* X, residual, Y: [rows, n]; gamma, beta: [n]; bias: [n] or NULL; sum: [rows, n] or NULL (receives
 * S = X + bias + residual, the pre-norm value).  Statistics in fp32 (two-pass). */
stof_epi_status_t stof_add_layernorm_run(int32_t dtype, int64_t rows, int64_t n, const void* x,
                                         const void* residual, const void* bias, const void* gamma,
                                         const void* beta, float epsilon, void* y, void* sum,
                                         stof_epi_stream_t stream);

/* Maximum row length stof_add_layernorm_run accepts. */
int64_t stof_add_layernorm_max_n(void);

const char* stof_epi_status_string(stof_epi_status_t s);
const char* stof_epi_last_error_message(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STOF_STOF_EPILOGUE_H */
