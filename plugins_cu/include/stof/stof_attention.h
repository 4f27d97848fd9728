/*
 * STOF sparse multi-head attention, forward pass: the one C ABI.
 *
 * The ONNX Runtime plugin, the TensorRT plugin and the Python binding (stof_trt/kernels.py) all call these
 * functions.  Plain C types only; no C++ exception ever crosses this boundary; every entry point returns a
 * status code.  The mask is the tile layout of docs/format.md (format version 1); the kernels are described in
 * docs/kernels.md.
 *
 *   O[b,h,q,:] = sum_k softmax_k(scale * Q[b,h,q,:].K[b,h,k,:] | allowed(b,h,q,k)) * V[b,h,k,:]
 *   allowed(b,h,q,k) = layout[h % L][q][k]  &&  k < key_lengths[b]  &&  key_padding_mask[b][k] != 0
 *   A query row with no allowed key gives O = 0.
 */
#ifndef STOF_STOF_ATTENTION_H
#define STOF_STOF_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STOF_FORMAT_VERSION 2  /* docs/format.md; layouts of version 1 are read as well */
#define STOF_ABI_VERSION 6

#if defined(_WIN32)
#define STOF_API __declspec(dllexport)
#else
#define STOF_API __attribute__((visibility("default")))
#endif

/* cudaStream_t without including the CUDA headers. */
typedef struct CUstream_st* stof_stream_t;

typedef enum {
    STOF_SUCCESS = 0,
    STOF_ERROR_INVALID_ARGUMENT = 1, /* null pointer, bad size/stride, Sq > compiled seq_q, ... */
    STOF_ERROR_UNSUPPORTED = 2,      /* valid request this build cannot run: head dim not 64/128, dtype, ... */
    STOF_ERROR_INVALID_TACTIC = 3,   /* unknown tactic id, or a tactic not valid for this problem */
    STOF_ERROR_CUDA = 4,             /* a CUDA call or kernel launch failed */
    STOF_ERROR_INSUFFICIENT_BUFFER = 5 /* list_tactics: capacity too small (n still receives the count) */
} stof_status_t;

typedef enum { STOF_DTYPE_FP16 = 0, STOF_DTYPE_BF16 = 1 } stof_dtype_t;

typedef struct {
    /* --- problem --------------------------------------------------------------------------------------- */
    int32_t dtype;        /* stof_dtype_t: q, k, v and o share it */
    int32_t batch;        /* B >= 1 */
    int32_t num_heads;    /* H >= 1 */
    int32_t seq_q;        /* run-time Sq >= 1, <= layout_seq_q */
    int32_t seq_k;        /* run-time Sk >= 1, <= layout_seq_k */
    int32_t head_dim;     /* D: 64 or 128 */
    float scale;          /* multiplies Q.K^T (usually 1/sqrt(D)) */

    /* --- tensors (device pointers; element strides; the last dim (D) contiguous, 16-byte aligned rows) --- */
    const void* q;        /* [B,H,Sq,D] or any layout expressible with the strides below */
    const void* k;
    const void* v;
    void* o;              /* must not overlap q, k or v (a work item may run twice: see workspace) */
    int64_t q_stride_b, q_stride_h, q_stride_s;
    int64_t k_stride_b, k_stride_h, k_stride_s;
    int64_t v_stride_b, v_stride_h, v_stride_s;
    int64_t o_stride_b, o_stride_h, o_stride_s;

    /* --- tile layout (docs/format.md; device pointers to int32 arrays) ---------------------------------- */
    const int32_t* row_ptr;            /* [L*Tq + 1] */
    const int32_t* col_idx;            /* [max(nnz,1)] */
    const int32_t* tile_bitmap_index;  /* [max(nnz,1)]: -1 (FULL) or a row of bitmaps; tiles may share a row */
    const int32_t* bitmaps;            /* [max(P,1), tile_m*tile_n/32] */
    int32_t tile_m, tile_n;
    int32_t num_layouts;               /* L: 1 or H; head h uses layout h % L */
    int32_t layout_seq_q, layout_seq_k;/* compiled sizes */

    /* --- run-time key padding (both optional, may be combined) ----------------------------------------- */
    const int32_t* key_lengths;        /* [B] or NULL: keys >= key_lengths[b] dropped */
    const int32_t* key_padding_mask;   /* [B, seq_k] row-major or NULL: 0 = key dropped */

    /* --- schedule (optional; ABI version 2) ------------------------------------------------------------- */
    /* [L*Tq] device int32 or NULL: per layout, its tile rows longest first, exactly as stof_layout_row_order()
     * writes them (a permutation of 0..Tq-1 within each layout; anything else leaves rows unwritten -- entries
     * outside [0, Tq) are skipped, never dereferenced).  Kernels
     * whose CTA covers at most one tile row start the longest rows first, so short rows fill the tail of the
     * grid (Longformer/BigBird global rows otherwise start last).  NULL: the last tile rows first (causal). */
    const int32_t* row_order;
    /* (batch, head) pairs whose CTAs are interleaved (docs/kernels.md "Schedule"); 0 = the library's default
     * (as many pairs as fit a share of L2), 1 = one pair at a time.  stof_layout_sched_chunk() gives the value for
     * a layout: 1 when its rows are of near-equal length (interleaving measured 4-5 % slower there), else 0.  With 1
     * the persistent tactics 21-24 also hand out all but their last wave of work items statically (no atomic
     * between items; unequal items then balance worse: same result, other timing). */
    int32_t sched_chunk;

    /* --- workspace (optional; ABI version 3) ------------------------------------------------------------ */
    /* Device memory of at least stof_attn_workspace_size() bytes, 16-byte aligned, for this call only (the next
     * call may reuse it once this one's stream work is ordered before it), or NULL.  The warp-specialised tactics
     * (21-24, 28, 29) use it for a work counter and then run persistent (one CTA per SM taking work items in the
     * schedule's order) unless key_lengths is given; with NULL they run one CTA per work item.  Same result
     * either way.  Its contents need no initialisation: the kernel resets its counter itself. */
    void* workspace;
    int64_t workspace_bytes;

    /* --- schedule of two-row work items (optional; ABI version 4) ------------------------------------------ */
    /* [L*ceil(Tq/2)] device int32 or NULL: per layout, its pairs of tile rows (pair i = rows 2i and 2i+1; the last
     * pair of an odd Tq has one row) longest first, exactly as stof_layout_pair_order() writes them (a permutation
     * of 0..ceil(Tq/2)-1 within each layout; entries outside that range are skipped, never dereferenced).  Kernels
     * whose CTA or work item covers two tile rows (the two-warpgroup tactics at tile_m 64) start the longest pairs
     * first, as row_order does for one-row kernels; NULL: the last pairs first.  Independent of row_order, under
     * the same rule (used when the run-time rows are >= 3/4 of the layout's).  For either order, a caller may pass
     * NULL where the helper's order is that default (every layout last first, e.g. causal): the same schedule, and
     * the kernels skip one dependent load before each work item. */
    const int32_t* pair_order;

    /* --- the bitmaps in the kernels' thread order (optional; ABI version 5) -------------------------------- */
    /* [max(P,1) * tile_m*tile_n/16] device int32, exactly as stof_layout_lane_bitmaps() writes them from this
     * layout's bitmaps, or NULL.  Derived, never stored (docs/format.md "Derived: the lane bitmaps").  The
     * two-consumer warp-specialised tactics (21-24) then read a PARTIAL 64-key sub-block's mask with one 8-byte load
     * per thread instead of two loads and a packing step; the others ignore it.  Same result either way. */
    const int32_t* lane_bitmaps;

    /* --- the bitmaps' row count (optional; ABI version 6) ------------------------------------------------- */
    /* P, the rows of `bitmaps` (a layout without PARTIAL tiles has its one padding row), or 0: not given.  The
     * wgmma tactics address bitmap words (and lane_bitmaps) by 32-bit byte offsets, so they are valid while
     * P * tile_m*tile_n/8 bytes stay below 2^32.  Without P the library bounds it by the layouts' whole tile grid
     * (L * Tq * Tk tiles): on 64x64 tiles that refuses them from S of about 185k with one layout (54k with 12
     * per-head layouts), however few tiles are stored.  Same result either way; < 0 is INVALID_ARGUMENT. */
    int32_t num_bitmaps;
} stof_attn_params_t;

/* Zero the struct and fill the defaults (dtype fp16, num_layouts 1, tile 64x64). */
STOF_API void stof_attn_params_init(stof_attn_params_t* p);

/* Check the parameters without launching anything (STOF_SUCCESS when some tactic can run them). */
STOF_API stof_status_t stof_attn_validate(const stof_attn_params_t* p);

/* Tactic ids valid for this problem, best-first by a fixed static order (the pre-search ranks them better).
 * Ids are >= 1 (0 is TensorRT's "default").  On return *n is the number of valid tactics; when it exceeds cap,
 * the first cap are written and STOF_ERROR_INSUFFICIENT_BUFFER is returned.  ids may be NULL when cap is 0. */
STOF_API stof_status_t stof_attn_list_tactics(const stof_attn_params_t* p, int32_t* ids, int32_t cap,
                                              int32_t* n);

/* Every tactic id of this build (regardless of the problem), same calling convention. */
STOF_API stof_status_t stof_attn_all_tactics(int32_t* ids, int32_t cap, int32_t* n);

/* Static description of a tactic; returns STOF_ERROR_INVALID_TACTIC for an unknown id.
 * family: 1 = block-wise (tensor cores), 2 = row-wise.  Any out-pointer may be NULL. */
STOF_API stof_status_t stof_attn_tactic_info(int32_t tactic, int32_t* family, int32_t* block_m,
                                             int32_t* block_n, int32_t* num_warps, int32_t* stages);

/* "block_m64_n64_w4_s2" etc.; "invalid" for an unknown id.  Static storage. */
STOF_API const char* stof_attn_tactic_name(int32_t tactic);

/* Workspace bytes the tactic can use (16 for the warp-specialised tactics, else 0; tactic 0: the most any tactic
 * uses), see stof_attn_params_t.workspace. */
STOF_API stof_status_t stof_attn_workspace_size(const stof_attn_params_t* p, int32_t tactic, size_t* bytes);

/* Run the forward pass on the stream.  tactic 0 (or < 0) = the library's default choice for the problem. */
STOF_API stof_status_t stof_attn_run(const stof_attn_params_t* p, int32_t tactic, stof_stream_t stream);

/* Human-readable status; static storage. */
STOF_API const char* stof_status_string(stof_status_t s);

/* Detail of the last error on the calling thread ("" when none). */
STOF_API const char* stof_last_error_message(void);

STOF_API int32_t stof_abi_version(void);

/* Host helper: the row_order of stof_attn_params_t for a layout (host row_ptr of num_layouts*tiles_q + 1
 * entries).  Within each layout l, out[l*tiles_q + i] is the tile row with the i-th most stored tiles; ties go to
 * the higher row first.  Same result as stof_trt.format.TileLayout.row_order(). */
STOF_API stof_status_t stof_layout_row_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q,
                                             int32_t* out);

/* Host helper: the pair_order of stof_attn_params_t for a layout (host row_ptr of num_layouts*tiles_q + 1
 * entries).  Within each layout l, out[l*ceil(tiles_q/2) + i] is the pair of tile rows whose longer row has the
 * i-th most stored tiles; ties go to the higher pair first.  Same result as stof_trt.format.TileLayout.pair_order(). */
STOF_API stof_status_t stof_layout_pair_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q,
                                              int32_t* out);

/* Host helper: the sched_chunk of stof_attn_params_t for a layout: 1 when, in every layout, the longest tile row
 * holds at most 5/4 of the mean number of stored tiles per row (uniform rows: sliding, dilated), else 0.
 * Same result as stof_trt.format.TileLayout.sched_chunk(). */
STOF_API stof_status_t stof_layout_sched_chunk(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q,
                                               int32_t* chunk);

/* Host helper: the lane_bitmaps of stof_attn_params_t (ABI version 5) from num_bitmaps host bitmaps of a layout
 * (tile_m % 16 == 0, tile_n % 64 == 0; num_bitmaps >= 1, the padding row of a layout without one counts) into out,
 * num_bitmaps * tile_m*tile_n/16 int32.  Same result as stof_trt.format.TileLayout.lane_bitmaps(). */
STOF_API stof_status_t stof_layout_lane_bitmaps(const int32_t* bitmaps, int32_t num_bitmaps, int32_t tile_m,
                                                int32_t tile_n, int32_t* out);

/* --- analytical pre-search (host only: plugins_cu/src/presearch.cc, also in libstof_host; stof_trt.presearch
 * calls it) --- */

/* GPU properties the pre-search model reads (stof_trt.presearch.GpuProps). */
typedef struct {
    int32_t sm_count;
    int32_t smem_per_sm;        /* bytes usable by CTAs on one SM */
    int32_t regs_per_sm;
    int32_t max_threads_per_sm;
    int32_t max_ctas_per_sm;
    int32_t sm;                 /* compute capability major*10 + minor */
    double clock_hz;
    double mma_tflops;          /* whole-chip mma.sync rate (FLOP/s) */
    double dram_bw;             /* bytes/s */
    double l2_bw;               /* bytes/s */
    double wgmma_tflops;        /* whole-chip wgmma rate (FLOP/s); 0 = no wgmma tactics */
} stof_gpu_props_t;

/* A tile layout in HOST memory (docs/format.md arrays). */
typedef struct {
    const int32_t* row_ptr;            /* [L*Tq + 1] */
    const int32_t* col_idx;            /* [max(nnz,1)] */
    const int32_t* tile_bitmap_index;  /* [max(nnz,1)] */
    const int32_t* bitmaps;            /* [num_bitmaps, tile_m*tile_n/32] */
    int32_t num_bitmaps;
    int32_t tile_m, tile_n, num_layouts, layout_seq_q, layout_seq_k;
} stof_host_layout_t;

/* The H100 SXM constants of stof_trt.presearch.H100_SXM. */
STOF_API void stof_presearch_h100_props(stof_gpu_props_t* out);

/* Properties of a CUDA device (libstof_kernels only: cudaGetDeviceProperties; rates scaled from the H100's by SM
 * count, as stof_trt.presearch.gpu_props()). */
STOF_API stof_status_t stof_presearch_gpu_props(int32_t device, stof_gpu_props_t* out);

/* Rank the tactics the pre-search considers valid for (layout, tile shape, head_dim, GPU) by predicted time,
 * fastest first (= stof_trt.presearch.rank()).  seq_q/seq_k <= 0 mean the layout's sizes.  Host only: no GPU
 * needed.  Writes min(cap, *n) ids and predicted seconds (either pointer may be NULL); *n = number ranked;
 * STOF_ERROR_INSUFFICIENT_BUFFER when *n > cap.  The library's own valid set for a concrete problem
 * (stof_attn_list_tactics) may be smaller (e.g. no sm_90a code): intersect with it.
 * The layout must already be valid (docs/format.md: row_ptr non-decreasing from 0 with num_layouts * Tq + 1
 * entries, col_idx / tile_bitmap_index of row_ptr[last] entries, bitmaps of the partial tiles): its arrays are read
 * as described, without lengths to check them against (libstof_ort validates a layout before it calls this). */
STOF_API stof_status_t stof_presearch_rank(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                           int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                           int32_t seq_k, int32_t* ids, double* seconds, int32_t cap, int32_t* n);

/* One (tactic, head dim) entry of the pre-search's per-CTA constants, in microseconds: a per FULL 64-key
 * sub-block, b per PARTIAL one, c per CTA, d per launch (plugins_cu/tactics.toml's coef). */
typedef struct {
    int32_t tactic;
    int32_t head_dim;
    double a, b, c, d;
} stof_presearch_coef_t;

/* stof_presearch_rank with num_coef entries of constants in place of the catalogue's (an entry for a tactic without
 * constants gives it some): for replaying a refit.  INVALID_ARGUMENT for an unknown or row-wise tactic. */
STOF_API stof_status_t stof_presearch_rank_coef(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                                int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                                int32_t seq_k, const stof_presearch_coef_t* coef, int32_t num_coef,
                                                int32_t* ids, double* seconds, int32_t cap, int32_t* n);

/* The four terms the constants (a, b, c, d) of `tactic` multiply in a large grid's makespan, for fitting them:
 * terms[0..3] = (FULL sub-blocks, PARTIAL sub-blocks, CTAs) over all (batch, head) pairs per occupancy slot
 * (SMs x CTAs per SM), and 1.  seq_q <= 0 means the layout's.  UNSUPPORTED for a row-wise tactic or one that
 * does not fit on an SM; INVALID_TACTIC for an unknown id. */
STOF_API stof_status_t stof_presearch_terms(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                            int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                            int32_t tactic, double* terms);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STOF_STOF_ATTENTION_H */
