/*
 * STOF sparse multi-head attention, forward pass: the one C ABI.
 *
 * The ONNX Runtime plugin, the TensorRT plugin and the Python binding (stof_trt/kernels.py) all call these
 * functions.  Plain C types only; no C++ exception ever crosses this boundary; every entry point returns a
 * status code.  The mask is the tile layout of docs/format.md, held by a layout handle; the kernels are described
 * in docs/kernels.md.
 *
 *   O[b,h,q,:] = sum_k softmax_k(scale * Q[b,h,q,:].K[b,g(h),k,:] | allowed(b,h,q,k)) * V[b,g(h),k,:]
 *   g(h) = h / (H / kv_heads) (grouped-query attention; g(h) = h without it)
 *   allowed(b,h,q,k) = layout[h % L][q][k]  &&  k < key_lengths[b]  &&  key_padding_mask[b][k] != 0
 *   (packed sequences, seq_offsets: batch b is rows seq_offsets[b] .. seq_offsets[b+1]-1, k < n_b in place of
 *   key_lengths)
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
#define STOF_ABI_VERSION 9

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

/* --- tile layouts --------------------------------------------------------------------------------------------- */

/* A tile layout the library has checked: its host arrays, the data derived from them (tile rows and pairs of tile
 * rows longest first, the bitmaps in the kernels' thread order, the (batch, head) interleaving, the bitmaps' row
 * count, the SHA-1 signature of docs/format.md) and, once uploaded, a device copy of all of it.  Immutable after
 * creation apart from the upload; any thread may use it once created (and, for runs, uploaded). */
typedef struct stof_layout_st* stof_layout_t;

/* The arrays of docs/format.md in HOST memory, with their lengths in int32 elements (the library checks them). */
typedef struct {
    const int32_t* row_ptr;            int64_t row_ptr_len;            /* num_layouts * Tq + 1 */
    const int32_t* col_idx;            int64_t col_idx_len;            /* >= max(nnz, 1) */
    const int32_t* tile_bitmap_index;  int64_t tile_bitmap_index_len;  /* == col_idx_len */
    const int32_t* bitmaps;            int64_t bitmaps_len;            /* num_bitmaps * tile_m*tile_n/32, >= 1 row */
    int32_t tile_m, tile_n;            /* tile_m: multiple of 16 in [16, 256]; tile_n: of 32 in [32, 256] */
    int32_t num_layouts;               /* L >= 1: head h uses layout h % L */
    int32_t seq_q, seq_k;              /* compiled sizes */
    int32_t format_version;            /* 1 or 2 (docs/format.md); 0 = STOF_FORMAT_VERSION */
} stof_layout_desc_t;

/* Copy, check and derive.  A layout that breaks docs/format.md (row_ptr not starting at 0 or decreasing, col_idx
 * outside [0, Tk) or not ascending in a row, a bitmap index outside [-1, P), wrong lengths) is INVALID_ARGUMENT with
 * the first fault in stof_last_error_message().  Host only: no GPU needed. */
STOF_API stof_status_t stof_layout_create(const stof_layout_desc_t* desc, stof_layout_t* out);

/* Copy the arrays and the derived data to the current CUDA device (one allocation, owned by the handle), ordered
 * on the stream, then wait for it, so that any stream may run with the layout afterwards.  Once per handle; a
 * second call is a no-op.  Runs need an uploaded layout (or stof_layout_use_device_arrays). */
STOF_API stof_status_t stof_layout_upload(stof_layout_t layout, stof_stream_t stream);

/* Instead of an upload: run on the caller's device copies of the four arrays (same contents as the host arrays;
 * they must outlive the runs).  The derived schedules then stay on the host: the kernels use their default order
 * and pack the bitmaps themselves (same result, other timing).  For layouts fed at run time, where an upload per
 * call would cost more than it saves. */
STOF_API stof_status_t stof_layout_use_device_arrays(stof_layout_t layout, const int32_t* row_ptr,
                                                     const int32_t* col_idx, const int32_t* tile_bitmap_index,
                                                     const int32_t* bitmaps);

/* Free the handle and its device copy (cudaFree: waits for work that may still read it).  NULL is a no-op. */
STOF_API void stof_layout_destroy(stof_layout_t layout);

typedef struct {
    int32_t tile_m, tile_n, num_layouts, seq_q, seq_k;
    int32_t tiles_q, tiles_k;          /* ceil(seq_q / tile_m), ceil(seq_k / tile_n) */
    int64_t nnz;                       /* stored tiles: row_ptr[L*Tq] */
    int32_t num_bitmaps;               /* P, the bitmaps' rows */
    int32_t sched_chunk;               /* 1: rows of near-equal length (at most 5/4 of the mean), else 0 */
    int32_t row_order_is_default;      /* 1: every layout's row order is the kernels' own (last row first) */
    int32_t pair_order_is_default;     /* likewise for the pair order */
    int32_t has_lane_bitmaps;          /* 1: tile_m % 16 == 0 and tile_n % 64 == 0 */
    int32_t device;                    /* the CUDA device of the upload; -1: none (host only or caller's arrays) */
    char signature[41];                /* TileLayout.signature(): SHA-1, hex */
} stof_layout_info_t;

STOF_API stof_status_t stof_layout_info(stof_layout_t layout, stof_layout_info_t* out);

/* A derived host array (docs/format.md "Derived"), as the kernels receive it. */
typedef enum {
    STOF_LAYOUT_ROW_ORDER = 0,    /* [L*Tq]: per layout, tile rows by decreasing stored tiles, ties higher first */
    STOF_LAYOUT_PAIR_ORDER = 1,   /* [L*ceil(Tq/2)]: pairs (2i, 2i+1) by their longer row, ties higher first */
    STOF_LAYOUT_LANE_BITMAPS = 2  /* [P * tile_m*tile_n/16]: empty where has_lane_bitmaps is 0 */
} stof_layout_array_t;

/* Copies min(cap, *n) entries into out (NULL when cap is 0); *n = the array's length; INSUFFICIENT_BUFFER when it
 * exceeds cap. */
STOF_API stof_status_t stof_layout_derived(stof_layout_t layout, int32_t which, int32_t* out, int64_t cap,
                                           int64_t* n);

/* --- attention calls ------------------------------------------------------------------------------------------ */

/* stof_attn_params_t.options: schedule switches for benchmarks and tests (same result, other timing). */
#define STOF_OPT_NO_ROW_ORDER 1u      /* one-row work items in the kernels' order (last first), not the layout's */
#define STOF_OPT_NO_LANE_BITMAPS 2u   /* the kernels pack the bitmaps themselves */
#define STOF_OPT_NO_PAIR_ORDER 4u     /* two-row work items in the kernels' order (last first), not the layout's */

typedef struct {
    /* problem */
    int32_t dtype;        /* stof_dtype_t: q, k, v and o share it */
    int32_t batch;        /* B >= 1 */
    int32_t num_heads;    /* H >= 1; the layout's num_layouts is 1 or H */
    int32_t seq_q;        /* run-time Sq >= 1, <= the layout's seq_q */
    int32_t seq_k;        /* run-time Sk >= 1, <= the layout's seq_k */
    int32_t head_dim;     /* D: 64 or 128 */
    float scale;          /* multiplies Q.K^T (usually 1/sqrt(D)) */

    /* tensors: device pointers, element strides, the last dim (D) contiguous, 16-byte aligned rows */
    const void* q;        /* [B,H,Sq,D] or any layout expressible with the strides below */
    const void* k;
    const void* v;
    void* o;              /* must not overlap q, k or v (a work item may run twice: see workspace) */
    int64_t q_stride_b, q_stride_h, q_stride_s;
    int64_t k_stride_b, k_stride_h, k_stride_s;
    int64_t v_stride_b, v_stride_h, v_stride_s;
    int64_t o_stride_b, o_stride_h, o_stride_s;

    /* the mask: a layout handle (stof_layout_create; uploaded for runs) */
    stof_layout_t layout;

    /* run-time key padding (both optional, may be combined) */
    const int32_t* key_lengths;        /* [B] device int32 or NULL: keys >= key_lengths[b] dropped */
    const int32_t* key_padding_mask;   /* [B, seq_k] row-major device int32 or NULL: 0 = key dropped */

    /* Device memory of at least stof_attn_workspace_size() bytes, 16-byte aligned, for this call only (the next
     * call may reuse it once this one's stream work is ordered before it), or NULL.  The persistent tactics use it
     * for a work counter (one CTA per SM taking work items in the schedule's order) unless key_lengths or
     * seq_offsets is given; with NULL they run one CTA per work item.  The split tactic keeps its slices' rows
     * there; with less it runs unsplit.  Same result either way; no initialisation needed. */
    void* workspace;
    int64_t workspace_bytes;

    /* (batch, head) pairs whose CTAs are interleaved (docs/kernels.md "Schedule"): -1 = the layout's choice
     * (stof_attn_params_init's default), 0 = as many as fit a share of L2, N >= 1 = N.  Same result. */
    int32_t sched_chunk;
    uint32_t options;                  /* STOF_OPT_* bits; 0 = every schedule the layout has */

    /* Grouped-query attention: K and V have kv_heads heads, query head h reads K/V head h / (H / kv_heads) (their
     * strides describe [B, kv_heads, Sk, D]).  0 or H = one K/V head per query head; else H % kv_heads == 0. */
    int32_t kv_heads;

    /* [B+1] device int32 or NULL: packed variable-length sequences.  Batch b's rows start at row seq_offsets[b] of
     * q, k, v and o (base + seq_offsets[b]*stride_s; the *_stride_b are ignored), and it has
     * n_b = seq_offsets[b+1] - seq_offsets[b] queries and keys (self-attention): keys >= n_b dropped (like
     * key_lengths), output rows >= n_b not written.  seq_q / seq_k (run-time) bound every n_b (a larger n_b is
     * clamped to them: the caller guarantees the bound).  The layout applies to each sequence's first n_b rows and
     * columns.  key_lengths and key_padding_mask must be NULL with it; the persistent tactics run one CTA per work
     * item and the TMA tactics their cp.async form (as with key_lengths). */
    const int32_t* seq_offsets;
} stof_attn_params_t;

/* Zero the struct and fill the defaults (dtype fp16, scale 1, sched_chunk -1). */
STOF_API void stof_attn_params_init(stof_attn_params_t* p);

/* Check the parameters without launching anything (STOF_SUCCESS when some tactic can run them).  Host only: the
 * layout need not be uploaded. */
STOF_API stof_status_t stof_attn_validate(const stof_attn_params_t* p);

/* Tactic ids valid for this problem, best-first by a fixed static order (stof_attn_select ranks them better).
 * Ids are >= 1 (0 is TensorRT's "default").  On return *n is the number of valid tactics; when it exceeds cap,
 * the first cap are written and STOF_ERROR_INSUFFICIENT_BUFFER is returned.  ids may be NULL when cap is 0. */
STOF_API stof_status_t stof_attn_list_tactics(const stof_attn_params_t* p, int32_t* ids, int32_t cap,
                                              int32_t* n);

/* Every tactic id of this build (regardless of the problem), same calling convention. */
STOF_API stof_status_t stof_attn_all_tactics(int32_t* ids, int32_t cap, int32_t* n);

/* Static description of a tactic; returns STOF_ERROR_INVALID_TACTIC for an unknown id.
 * family: 1 = block-wise (mma.sync tensor cores), 2 = row-wise, 3 = Hopper (wgmma).  Any out-pointer may be NULL. */
STOF_API stof_status_t stof_attn_tactic_info(int32_t tactic, int32_t* family, int32_t* block_m,
                                             int32_t* block_n, int32_t* num_warps, int32_t* stages);

/* "block_m64_n64_w4_s2" etc.; "invalid" for an unknown id.  Static storage. */
STOF_API const char* stof_attn_tactic_name(int32_t tactic);

/* Workspace bytes the tactic can use on this problem and the current device (16 for the persistent tactics, the
 * slices of a split tactic where it splits (docs/kernels.md), else 0; tactic 0: the most any tactic uses), see
 * stof_attn_params_t.workspace. */
STOF_API stof_status_t stof_attn_workspace_size(const stof_attn_params_t* p, int32_t tactic, size_t* bytes);

/* Run the forward pass on the stream.  tactic 0 (or < 0) = the library's first valid tactic.  On a GPU this build
 * has no code for: STOF_ERROR_CUDA and one line naming the GPU and the build's architectures (stof_device_check). */
STOF_API stof_status_t stof_attn_run(const stof_attn_params_t* p, int32_t tactic, stof_stream_t stream);

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
 * as described, without lengths to check them against (stof_layout_create checks a layout; stof_attn_select calls
 * this with the handle's arrays). */
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

/* --- tactic selection ----------------------------------------------------------------------------------------- */

/* What the selection knows of a GPU: its identity (the tactic cache's "gpu" and "cc" keys) and the pre-search's
 * properties. */
typedef struct {
    char name[256];                    /* cudaDeviceProp.name */
    char cc[16];                       /* "major.minor" */
    stof_gpu_props_t props;
} stof_device_desc_t;

/* The description of a CUDA device (cached per device). */
STOF_API stof_status_t stof_device_describe(int32_t device, stof_device_desc_t* out);

/* Read a tactic cache (the JSON that stof_trt/tactic_cache.py writes, docs/ort.md) into the process's table of
 * caches, replacing an earlier read of the same path; *entries (may be NULL) = its entry count.  A missing or
 * malformed file is INVALID_ARGUMENT. */
STOF_API stof_status_t stof_tactic_cache_load(const char* path, int32_t* entries);

typedef enum {
    STOF_TACTIC_FROM_CACHE = 1,        /* the tactic cache's entry for this problem */
    STOF_TACTIC_FROM_PRESEARCH = 2,    /* the pre-search's fastest valid tactic */
    STOF_TACTIC_DEFAULT = 3,           /* the library's first valid tactic */
    STOF_TACTIC_TIMED = 4              /* the fastest of the shortlist, timed on this GPU (STOF_SELECT_TIME) */
} stof_tactic_source_t;

#define STOF_SELECT_NO_PRESEARCH 1u    /* stof_attn_select: without a cache hit, the library default */
/* First-use timing (the convention of ONNX Runtime's TunableOp and TensorRT's builder): without a cache hit, run
 * the shortlist -- the pre-search's first STOF_SELECT_TIME_MAX - 1 valid tactics whose predicted time is within
 * STOF_SELECT_TIME_RATIO of the first (for a small problem, whose first is predicted at most STOF_SELECT_TIME_SMALL_US
 * microseconds, every valid tactic within STOF_SELECT_TIME_SMALL_RATIO: the constants come from problems of many
 * waves and rank least well below one), plus the first choice and the library default -- on the caller's stream
 * (one warm-up and STOF_SELECT_TIME_REPS timed runs each, queued behind a short hold of the stream so that the
 * events time the GPU; median by CUDA events) into scratch output and workspace the library
 * allocates and frees (the caller's inputs are only read, its output untouched), keep the fastest, remember it for
 * the process and write it to the tactic cache file when one is given (merged under "<path>.lock"; a missing file
 * is created).  Needs the layout uploaded (or device arrays) and q, k, v on the current device; skipped (the
 * pre-search's choice, not remembered) while the stream is being captured into a CUDA graph.  The environment
 * variable STOF_FIRST_USE_TIMING=0 turns this flag off process-wide. */
#define STOF_SELECT_TIME 2u
#define STOF_SELECT_TIME_MAX 4
#define STOF_SELECT_TIME_RATIO 2.0
#define STOF_SELECT_TIME_REPS 5
#define STOF_SELECT_TIME_SMALL_US 50
#define STOF_SELECT_TIME_SMALL_RATIO 4.0

/* The tactic for a problem: the cache's entry when valid here (tactic_cache: a path, read on first use like
 * stof_tactic_cache_load; NULL: none), else the pre-search's fastest tactic among stof_attn_list_tactics() (with
 * seq_offsets, the Hopper tactics of more than 64 rows per work item rank as if 3x slower: the pre-search's
 * constants come from unpadded problems, where those tactics win), else the first valid one.
 * device: the GPU the keys and the pre-search describe (NULL: the current CUDA device).
 * Results are memoised in the layout handle per (problem, device, cache file and its read).  Host only when
 * device is given.
 * The cache key: gpu = device->name, cc = device->cc, node = "StofSparseAttention|<float16|bfloat16>|H<H>|D<D>|
 * tile<tm>x<tn>|L<L>|seq<Sq>x<Sk>|kpm<0|1>[|packed]" (the layout's sizes; kpm: key_padding_mask given; packed:
 * seq_offsets given), bucket =
 * stof_shape_bucket(), mask = the layout's signature. */
STOF_API stof_status_t stof_attn_select(const stof_attn_params_t* p, const char* tactic_cache,
                                        const stof_device_desc_t* device, uint32_t flags, int32_t* tactic,
                                        int32_t* source);

/* stof_attn_select with the stream first-use timing (STOF_SELECT_TIME) runs on; stof_attn_select times on the
 * legacy default stream. */
STOF_API stof_status_t stof_attn_select_on_stream(const stof_attn_params_t* p, const char* tactic_cache,
                                                  const stof_device_desc_t* device, uint32_t flags,
                                                  stof_stream_t stream, int32_t* tactic, int32_t* source);

/* Merge one entry (key fields as stof_attn_select builds them, tactic >= 1, time_ms <= 0: none) into a tactic cache
 * file, created when missing: under an exclusive flock on "<path>.lock" it re-reads the file, replaces the entry of
 * the same key, writes a temp file in the same directory and renames it over the path, so concurrent writers
 * (threads, processes, stof_trt.tactic_cache) lose no entry and readers always see a whole file.  The process's read
 * of the file becomes the merged one.  A malformed file is INVALID_ARGUMENT and stays as it is. */
STOF_API stof_status_t stof_tactic_cache_store(const char* path, const char* gpu, const char* cc, const char* node,
                                               const char* bucket, const char* mask, int32_t tactic,
                                               double time_ms);

/* Pre-search profiles (`stof calibrate`, docs/ort.md): the pre-search constants fitted on one GPU, as JSON
 *   {"format": "stof-presearch-profile", "version": 1,
 *    "gpu": {"name": "NVIDIA H200", "sm_count": 132, "clock_mhz": 1980, ...},
 *    "coef": [{"tactic": 19, "head_dim": 64, "a": ..., "b": ..., "c": ..., "d": ...}, ...], ...}
 * stof_attn_select ranks with a profile's constants (stof_presearch_rank_coef) when the profile file for the device
 * describes it (same name and SM count; SM clock within 2 % when the device is the current one), else with the
 * catalogue's.  The file: $STOF_PRESEARCH_PROFILE, else ${XDG_CACHE_HOME:-$HOME/.cache}/stof-trt/profiles/
 * <name>-<SMs>sm.json, name with characters other than letters, digits, '.' and '-' as '_'. */

/* The profile path the library reads for a device (writes at most cap bytes with the NUL; "" without a home). */
STOF_API stof_status_t stof_presearch_profile_path(const stof_device_desc_t* device, char* out, size_t cap);

/* The constants a profile gives the device (path NULL: the library's path for it, where a missing file means
 * none; device NULL: the current CUDA device, clock included).  *n = 0 when the profile describes another GPU;
 * INVALID_ARGUMENT for a malformed file (or a given path that cannot be read); INSUFFICIENT_BUFFER when *n > cap. */
STOF_API stof_status_t stof_presearch_profile_coef(const char* path, const stof_device_desc_t* device,
                                                   stof_presearch_coef_t* coef, int32_t cap, int32_t* n);

/* The tactic cache's shape bucket: B, Sq and Sk rounded up to powers of two (Sq, Sk at least 64),
 * "B8|Sq4096|Sk4096"; writes at most cap bytes with the NUL. */
STOF_API stof_status_t stof_shape_bucket(int64_t batch, int64_t seq_q, int64_t seq_k, char* out, size_t cap);

/* --- mask specs (host only; also in libstof_host) ---------------------------------------------------------- */

/* A layout compiled from a mask spec: the arrays of docs/format.md in host memory. */
typedef struct stof_mask_layout_st* stof_mask_layout_t;

/* The most stored tiles stof_mask_compile builds by default (stof_trt.format.MAX_STORED_TILES). */
#define STOF_MASK_MAX_TILES (1LL << 28)

/* SUCCESS when `spec` (the grammar of stof_trt/masks.py) is a closed-form spec this library compiles for any
 * length: full, causal, sliding, dilated, global, longformer, bigbird without random blocks, combined with '|', '&'
 * and parentheses.  UNSUPPORTED for a valid spec it cannot build per length (npy:, blocks:, bigbird with random
 * blocks); INVALID_ARGUMENT for a malformed one.  stof_last_error_message says why. */
STOF_API stof_status_t stof_mask_check(const char* spec);

/* Compile `spec` for a seq_q x seq_k attention in tile_m x tile_n tiles: exactly the arrays of
 * stof_trt.format.compile_mask (same stored tiles, order and bits; bitmaps numbered by first use), with
 * num_layouts copies of the one pattern (closed-form specs are the same for every head).  Time and memory follow
 * the stored tiles, not the tile grid.  A mask that may store more than max_tiles tiles (<= 0: STOF_MASK_MAX_TILES)
 * is INVALID_ARGUMENT before anything is allocated; the statuses of stof_mask_check otherwise. */
STOF_API stof_status_t stof_mask_compile(const char* spec, int32_t seq_q, int32_t seq_k, int32_t tile_m,
                                         int32_t tile_n, int32_t num_layouts, int64_t max_tiles,
                                         stof_mask_layout_t* out);

/* The compiled arrays as a layout description (pointers into the handle: valid until it is destroyed), ready for
 * stof_layout_create. */
STOF_API stof_status_t stof_mask_layout_desc(stof_mask_layout_t layout, stof_layout_desc_t* out);

STOF_API void stof_mask_layout_destroy(stof_mask_layout_t layout);

/* --- the GPU and the build ----------------------------------------------------------------------------------- */

/* STOF_SUCCESS when this build has code for CUDA device `device` (< 0: the current one) and can load it there; else
 * STOF_ERROR_CUDA with a one-line message naming the GPU, its architecture and the build's (e.g. a build for sm_90a
 * on an sm_80 GPU, or a GPU older than sm_80).  stof_attn_run makes the same check on its first call per device.
 * Creates the device's CUDA context. */
STOF_API stof_status_t stof_device_check(int32_t device);

/* The CUDA architectures this library is built for, as CMake got them ("80 86 89 90a"). Static storage. */
STOF_API const char* stof_cuda_architectures(void);

/* Kernel families (stof_attn_tactic_info's family) by GPU: wgmma/TMA (3) only on sm_90 with sm_90a code, block-wise
 * mma.sync (1) and row-wise (2) on every sm_80+ GPU, block-wise tactics only where their shared memory fits one
 * block (3 stages at head dim 128 need 112 KiB: not on sm_86 / sm_89).  The environment variable
 * STOF_KERNEL_FAMILIES (a comma-separated subset of hopper, block, row; read once per process) restricts them
 * further, e.g. "block,row" runs an H100 as an A100-class GPU; any other word makes every call INVALID_ARGUMENT. */

/* --- status --------------------------------------------------------------------------------------------------- */

/* Human-readable status; static storage. */
STOF_API const char* stof_status_string(stof_status_t s);

/* Detail of the last error on the calling thread ("" when none). */
STOF_API const char* stof_last_error_message(void);

STOF_API int32_t stof_abi_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STOF_STOF_ATTENTION_H */
