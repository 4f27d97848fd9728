/*
 * STOF fused epilogues: the C ABI of libstof_epilogue (static, linked into libstof_ort.so).
 *
 *   stof_gemm_epilogue_run:   Y[M,N] = act(X[M,K] . W[K,N] + bias[N])          (row-major, cuBLASLt)
 *   stof_gemm_epilogue_run_strided: the same per batch, each batch's Y rows at a stride (a slice of a longer Y)
 *   stof_add_layernorm_run:   S = X + bias + residual;  Y[r,:] = LayerNorm(S[r,:]) * gamma + beta  (S optional)
 *   stof_global_slots_run:    a sequence's global tokens gathered into G slots, with the key padding words of the
 *                             two attention nodes that read them (StofGlobalSlots, docs/nodes.md)
 *   stof_rows_scatter_run:    rows written over an attention output in place (StofSparseAttention's row_values)
 *   stof_pack_tokens_run:     the index arrays of padding removal into a fixed token capacity (StofPackTokens)
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

#define STOF_EPILOGUE_ABI_VERSION 3

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
 * STOF_GEMM_TIMED_CANDIDATES, timed once per plan (row-count bucket) on the call's own buffers and stream, each as
 * a CUDA graph of runs so that an algorithm's extra nodes (a workspace memset) cost what they cost in graph replays
 * (the first result while that stream captures a CUDA graph; the timing happens on a later call).  Results are
 * equal up to rounding for every algo. */
#define STOF_GEMM_ALGO_TIMED (-2)
#define STOF_GEMM_TIMED_CANDIDATES 8
stof_epi_status_t stof_gemm_epilogue_run_algo(stof_gemm_context_t ctx, int32_t dtype, int64_t m, int64_t n, int64_t k,
                                              const void* x, const void* w, const void* bias, int32_t activation,
                                              int32_t algo, void* y, void* workspace, size_t workspace_bytes,
                                              stof_epi_stream_t stream);

/* As stof_gemm_epilogue_run_algo for X: [batch, M, K] contiguous, Y's batch i at y + i * y_batch_stride elements
 * (y_batch_stride >= M*N; each batch's M rows contiguous): one strided-batched cuBLASLt call writes a [batch, M, N]
 * slice of a longer Y, e.g. rows G.. of each [batch, G + M, N] sequence, with no copy.  Plans of batch > 1 are kept
 * per exact M. */
stof_epi_status_t stof_gemm_epilogue_run_strided(stof_gemm_context_t ctx, int32_t dtype, int64_t batch, int64_t m,
                                                 int64_t n, int64_t k, const void* x, const void* w, const void* bias,
                                                 int32_t activation, int32_t algo, void* y, int64_t y_batch_stride,
                                                 void* workspace, size_t workspace_bytes, stof_epi_stream_t stream);

/* X, residual, Y: [rows, n]; gamma, beta: [n]; bias: [n] or NULL; sum: [rows, n] or NULL (receives
 * S = X + bias + residual, the pre-norm value).  Statistics in fp32 (two-pass). */
stof_epi_status_t stof_add_layernorm_run(int32_t dtype, int64_t rows, int64_t n, const void* x,
                                         const void* residual, const void* bias, const void* gamma,
                                         const void* beta, float epsilon, void* y, void* sum,
                                         stof_epi_stream_t stream);

/* Maximum row length stof_add_layernorm_run accepts. */
int64_t stof_add_layernorm_max_n(void);

/* StofGlobalSlots.  x: [B, S, N]; mask: [B, S] (x's dtype, < 0 = masked token); global: [B, S] int32 (non-zero =
 * global token).  A global token is *kept* when its mask is not < 0; slot j of sequence b holds the j-th kept global
 * token in position order.  Writes
 *   slot_x     [B, G, N]: x's row of each used slot, zeros in an unused one; every slot NaN when the sequence has
 *              more than G kept global tokens (not representable);
 *   local_kpm  [B, G+S] int32: slot j used (1/0), then position p kept and not a kept global token;
 *   global_kpm [B, S] int32: position p kept;
 *   row_index  [B, G] int32: the position of slot j's token, -1 when unused or when the sequence overflows.
 * 1 <= G <= stof_global_slots_max(); B <= 65535. */
stof_epi_status_t stof_global_slots_run(int32_t dtype, int64_t batch, int64_t seq, int64_t hidden, int32_t slots,
                                        const void* x, const void* mask, const int32_t* global, void* slot_x,
                                        int32_t* local_kpm, int32_t* global_kpm, int32_t* row_index,
                                        stof_epi_stream_t stream);
int32_t stof_global_slots_max(void);

/* out row index[b, r] (its H heads of D elements, at element strides stride_b / stride_h / stride_s, D contiguous)
 * = values[b, r] ([B, R, H, D] contiguous), for every index in [0, seq_q); other indices (-1: none) are skipped.
 * Indices repeated within a sequence leave one of their rows (unspecified which). */
stof_epi_status_t stof_rows_scatter_run(int32_t dtype, int64_t batch, int64_t rows, int64_t heads, int64_t head_dim,
                                        const void* values, const int32_t* index, int64_t seq_q, void* out,
                                        int64_t stride_b, int64_t stride_h, int64_t stride_s,
                                        stof_epi_stream_t stream);

/* StofPackTokens.  mask: [B, S] int32 (non-zero = a real token), C = capacity <= B*S token slots.  The real tokens
 * fill slots 0 .. T-1 in position order, the padded positions the slots after them in position order.  Writes
 *   idx         [C] int32: the flat position (b*S + s) of slot j;
 *   seq_offsets [B+1] int32: where sequence b starts among the slots (0, the running sum of the rows' real tokens),
 *               clamped to C;
 *   source_row  [B*S] int32: the slot of a real token, C for a padded position (a zero row after the slots), C + 1
 *               everywhere when T > C (a NaN row: a too-small capacity never passes silently).
 * scratch: [B] int32 device memory.  B <= 65535. */
stof_epi_status_t stof_pack_tokens_run(int64_t batch, int64_t seq, int64_t capacity, const int32_t* mask,
                                       int32_t* idx, int32_t* seq_offsets, int32_t* source_row, int32_t* scratch,
                                       stof_epi_stream_t stream);

const char* stof_epi_status_string(stof_epi_status_t s);
const char* stof_epi_last_error_message(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STOF_STOF_EPILOGUE_H */
