// The general sparse-attention kernel of the ORT plugin: any dtype (fp32 / fp16 / bf16, fp32 arithmetic), any
// head dim up to kGENERIC_MAX_HEAD_DIM, an optional broadcast additive bias.  It serves what the tensor-core
// kernels of libstof_kernels (include/stof/stof_attention.h) do not: fp32 models, attn_bias, other head dims.
#ifndef STOF_ORT_GENERIC_ATTENTION_H
#define STOF_ORT_GENERIC_ATTENTION_H

#include <cuda_runtime.h>

#include <cstdint>

namespace stof_ort {

constexpr int kGENERIC_MAX_HEAD_DIM = 256;

enum class AttnDType : int32_t { kFP32 = 0, kFP16 = 1, kBF16 = 2 };

struct GenericAttnParams {
    AttnDType dtype{AttnDType::kFP32};
    int32_t batch{0}, numHeads{0}, seqQ{0}, seqK{0}, headDim{0};
    int32_t kvGroup{1};  // query heads per K/V head: K/V head = h / kvGroup (grouped-query attention)
    float scale{1.f};
    void const* q{nullptr};  // [B,H,Sq,D] (element strides below; D contiguous)
    void const* k{nullptr};  // [B,H/kvGroup,Sk,D]
    void const* v{nullptr};  // [B,H/kvGroup,Sk,D]
    void* o{nullptr};        // [B,H,Sq,D]
    // element strides (batch, head, sequence) of q, k, v, o; all zero = contiguous [B,H,S,D]
    int64_t qStride[3]{0, 0, 0}, kStride[3]{0, 0, 0}, vStride[3]{0, 0, 0}, oStride[3]{0, 0, 0};
    // tile layout (docs/format.md), device pointers
    int32_t const* rowPtr{nullptr};
    int32_t const* colIdx{nullptr};
    int32_t const* tileBitmapIndex{nullptr};
    int32_t const* bitmaps{nullptr};
    int32_t tileM{64}, tileN{64}, numLayouts{1}, layoutSeqQ{0};
    int32_t const* keyPaddingMask{nullptr};  // [B, Sk] or null
    void const* bias{nullptr};               // same dtype as q; element (b,h,q,k) at b*sb + h*sh + q*sq + k*sk
    int64_t biasStride[4]{0, 0, 0, 0};
    // [B+1] or null: packed sequences (batch b = rows seqOffsets[b] .. seqOffsets[b+1]-1 of q, k, v, o; the batch
    // strides are ignored; rows past the sequence neither read nor written)
    int32_t const* seqOffsets{nullptr};
};

cudaError_t launchGenericSparseAttention(GenericAttnParams const& p, cudaStream_t stream);

}  // namespace stof_ort

#endif  // STOF_ORT_GENERIC_ATTENTION_H
