// Host side of the Hopper (wgmma) tactics: the TMA tensor maps.  The kernels and their launcher tables are in
// hopper_<dtype>_d<head dim>.cu (one translation unit each: parallel builds).
#include "hopper_sync.cuh"

namespace stof {

namespace {
using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeFn tensor_map_encoder() {
    static const EncodeFn encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            fn = nullptr;
        return reinterpret_cast<EncodeFn>(fn);
    }();
    return encode;
}

// A [B, H, rows, D] view of a strided tensor, boxes of 64 rows x 64 elements in the wgmma's 128-byte swizzle; a dim
// of extent 1 gets a harmless stride (the TMA never steps it).
bool encode_rows_map(CUtensorMap* map, const void* base, int64_t ss, int64_t sh, int64_t sb, int rows, int heads,
                     int batch, int head_dim, bool bf16) {
    const EncodeFn encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                                static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
    const int64_t row = ss * 2;
    const int64_t hs = heads > 1 ? sh * 2 : row * rows;
    const int64_t bs = batch > 1 ? sb * 2 : hs * heads;
    if (row <= 0 || hs <= 0 || bs <= 0) return false;
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row), static_cast<cuuint64_t>(hs),
                                   static_cast<cuuint64_t>(bs)};
    const cuuint32_t box[4] = {64, 64, 1, 1};
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                  const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
}  // namespace

bool encode_kv_maps(KernelParams& p, int head_dim, bool bf16) {
    const int kv_heads = p.heads / p.kv_group;  // K and V have the K/V heads (grouped-query attention)
    return encode_rows_map(&p.tma_k, p.k, p.k_ss, p.k_sh, p.k_sb, p.seq_k, kv_heads, p.batch, head_dim, bf16) &&
           encode_rows_map(&p.tma_v, p.v, p.v_ss, p.v_sh, p.v_sb, p.seq_k, kv_heads, p.batch, head_dim, bf16);
}

bool encode_q_map(KernelParams& p, int head_dim, bool bf16) {
    return encode_rows_map(&p.tma_q, p.q, p.q_ss, p.q_sh, p.q_sb, p.seq_q, p.heads, p.batch, head_dim, bf16);
}

bool encode_o_map(KernelParams& p, int head_dim, bool bf16) {
    return encode_rows_map(&p.tma_o, p.o, p.o_ss, p.o_sh, p.o_sb, p.seq_q, p.heads, p.batch, head_dim, bf16);
}

#if defined(STOF_HAS_SM90A)
extern const bool kHopperCompiled = true;
#else
extern const bool kHopperCompiled = false;
#endif

}  // namespace stof
