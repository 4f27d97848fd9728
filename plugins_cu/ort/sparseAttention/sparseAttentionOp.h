// StofSparseAttention on ONNX Runtime's CUDA EP (docs/nodes.md): an adapter over libstof_kernels' C ABI (layout
// handle, stof_attn_select, stof_attn_run: tensor-core kernels, fp16/bf16, head dim 64/128) with the general kernel
// of genericAttention.cu for the rest.
#ifndef STOF_ORT_SPARSE_ATTENTION_OP_H
#define STOF_ORT_SPARSE_ATTENTION_OP_H

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../common/ortCommon.h"
#include "stof/stof_attention.h"

namespace stof_ort {

constexpr char const* kSPARSE_ATTENTION_NAME = "StofSparseAttention";
constexpr size_t kSA_NUM_INPUTS = 12;
constexpr size_t kGROWN_CACHE_SIZE = 8;  // layouts built from layout_spec kept per node
enum SparseAttentionInput : size_t {
    kQUERY = 0, kKEY, kVALUE, kROW_PTR, kCOL_IDX, kTILE_BITMAP_INDEX, kBITMAPS, kKEY_PADDING_MASK, kATTN_BIAS,
    kSEQ_OFFSETS, kROW_VALUES, kROW_INDEX
};

class SparseAttentionKernel {
public:
    SparseAttentionKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type, std::string cachePath,
                          bool firstUseTiming);
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    // A layout handle made from the node's layout inputs; the shared_ptr keeps it (and its device copy) alive
    // while a call that uses it enqueues its kernel, even if another thread replaces the cached one.
    struct Layout {
        void const* ptrs[4]{};
        int64_t sizes[4]{};
        stof_layout_t handle{nullptr};
        // A layout built from layout_spec for a run-time length: its own device copy of the four arrays (the
        // general kernel reads them) and its compiled length.
        int32_t* owned{nullptr};
        int64_t seqQ{0}, seqK{0};
        Layout() = default;
        Layout(Layout const&) = delete;
        Layout& operator=(Layout const&) = delete;
        ~Layout();
    };
    void compute(Ort::KernelContext& ctx);
    std::shared_ptr<Layout const> layout(TensorArg const* arrays, cudaStream_t stream);
    // The layout of layout_spec for a run-time Sq x Sk above the compiled one, built by the host layer's mask
    // compiler at a length bucket that holds it and cached per bucket (the least recently used of
    // kGROWN_CACHE_SIZE goes).
    std::shared_ptr<Layout const> grownLayout(int64_t Sq, int64_t Sk, cudaStream_t stream);

    ONNXTensorElementDataType mType;
    std::string mName;
    float mScale;
    int64_t mTileM, mTileN, mSeqQ, mSeqK, mNumLayouts, mFormatVersion;
    bool mPacked{false};  // qkv_format "bs3hd": query [B,S,3,H,D], key/value absent, output [B,S,H,D]
    bool mTokens{false};  // qkv_format "t3hd": query [T,3,H,D] of packed sequences (seq_offsets), output [T,H,D]
    bool mKvPacked{false};  // qkv_format "bshd_kv": query [B,Sq,H,D], key [B,Sk,2,Hkv,D] (K, V), value absent
    int64_t mNumHeads{0};   // attribute num_heads: a bshd_kv query (and output) of rows [B,Sq,H*D]
    // attributes query_view / key_view ([row0, rows, col0, cols], rows -1: to the end): the bshd_kv query and key
    // are windows of wider row tensors [B, R, C] (one projection GEMM's output read in place)
    std::vector<int64_t> mQueryView, mKeyView;
    bool mLayoutConstant{false};
    std::string mLayoutSpec;  // closed-form spec of the layout: any run-time length builds its layout from it
    std::vector<std::pair<std::pair<int64_t, int64_t>, std::shared_ptr<Layout const>>> mGrown;  // most recent last
    std::string mCachePath;
    bool mFirstUseTiming{true};  // stof_attn_select's STOF_SELECT_TIME
    std::mutex mMutex;  // guards mLayout, mGrown and mReported
    std::shared_ptr<Layout const> mLayout;
    std::set<std::string> mReported;  // verbose: choices already printed
};

class SparseAttentionOp : public Ort::CustomOpBase<SparseAttentionOp, SparseAttentionKernel, true> {
public:
    SparseAttentionOp(ONNXTensorElementDataType type, std::string cachePath, bool firstUseTiming);
    OrtStatusPtr CreateKernelV2(OrtApi const& api, OrtKernelInfo const* info, void** kernel) const;
    char const* GetName() const { return kSPARSE_ATTENTION_NAME; }
    char const* GetExecutionProviderType() const { return kCUDA_EP; }
    size_t GetInputTypeCount() const { return kSA_NUM_INPUTS; }
    ONNXTensorElementDataType GetInputType(size_t index) const;
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const;
    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return mType; }

private:
    ONNXTensorElementDataType mType;
    std::string mCachePath;
    bool mFirstUseTiming;
};

}  // namespace stof_ort

#endif  // STOF_ORT_SPARSE_ATTENTION_OP_H
