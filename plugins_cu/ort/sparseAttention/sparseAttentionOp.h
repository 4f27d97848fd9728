// StofSparseAttention on ONNX Runtime's CUDA EP (docs/nodes.md): a thin shell over stof_attn_run (tensor-core
// kernels, fp16/bf16, head dim 64/128) with the general kernel of genericAttention.cu for the rest.
#ifndef STOF_ORT_SPARSE_ATTENTION_OP_H
#define STOF_ORT_SPARSE_ATTENTION_OP_H

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>

#include "../common/ortCommon.h"
#include "../common/tacticCache.h"
#include "stof/stof_attention.h"

namespace stof_ort {

constexpr char const* kSPARSE_ATTENTION_NAME = "StofSparseAttention";
constexpr size_t kSA_NUM_INPUTS = 9;
enum SparseAttentionInput : size_t {
    kQUERY = 0, kKEY, kVALUE, kROW_PTR, kCOL_IDX, kTILE_BITMAP_INDEX, kBITMAPS, kKEY_PADDING_MASK, kATTN_BIAS
};

class SparseAttentionKernel {
public:
    SparseAttentionKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type,
                          std::shared_ptr<TacticCache const> cache);
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    struct LayoutCheck {  // what the host-side validation of the layout arrays found
        void const* ptrs[4]{};
        int64_t sizes[4]{};
        std::string signature;  // TileLayout.signature()
        std::vector<int32_t> host[4];  // the arrays on the host (for the pre-search)
        // stof_layout_row_order() of host[0] ([L*Tq], tile rows longest first: stof_attn_params_t::row_order),
        // then at pairOrderOffset stof_layout_pair_order()'s ([L*ceil(Tq/2)]: stof_attn_params_t::pair_order, ABI
        // v4), then at laneOffset (when laneCount > 0) stof_layout_lane_bitmaps() of host[3] (the bitmaps in the
        // kernels' thread order: stof_attn_params_t::lane_bitmaps, ABI v5), on the host and uploaded once to
        // rowOrderDevice, which this object owns (cudaFree in the destructor)
        std::vector<int32_t> rowOrderHost;
        int32_t* rowOrderDevice{nullptr};
        int64_t pairOrderOffset{0};
        int64_t laneOffset{0}, laneCount{0};
        // either order equal to the kernels' default (every layout last first: causal) is not passed (same schedule,
        // one dependent load less per work item)
        bool rowOrderDefault{false}, pairOrderDefault{false};
        // stof_layout_sched_chunk() of host[0] (stof_attn_params_t::sched_chunk: 1 for near-equal row lengths,
        // else 0 = the library's default), computed with rowOrderHost
        int32_t schedChunk{0};

        LayoutCheck() = default;
        LayoutCheck(LayoutCheck const&) = delete;
        LayoutCheck& operator=(LayoutCheck const&) = delete;
        ~LayoutCheck();
    };
    void compute(Ort::KernelContext& ctx);
    // the (cached) check of these layout arrays; the shared_ptr keeps its device row order alive while a call
    // that read it enqueues its kernel, even if another thread replaces the cached check meanwhile
    std::shared_ptr<LayoutCheck const> checkLayout(TensorArg const* arrays, cudaStream_t stream);
    int32_t chooseTactic(std::string const& nodeSig, std::string const& bucket, std::string const& mask,
                         bool* fromCache);
    // the pre-search's first choice among the library's valid tactics for this problem (0: none)
    int32_t presearchTactic(stof_attn_params_t const& p, std::string const& maskSig, std::string const& memoKey);

    // metadata
    ONNXTensorElementDataType mType;
    std::string mName;
    float mScale;
    int64_t mTileM, mTileN, mSeqQ, mSeqK, mNumLayouts;
    std::string mMaskSpec;
    bool mPacked{false};  // qkv_format "bs3hd": query [B,S,3,H,D], key/value absent, output [B,S,H,D]
    bool mLayoutConstant{false};
    std::shared_ptr<TacticCache const> mCache;
    // lazily filled, guarded by mMutex
    std::mutex mMutex;
    std::shared_ptr<LayoutCheck const> mChecked;
    std::string mGpuName, mGpuCc;
    std::unordered_map<std::string, int32_t> mTacticMemo;
    std::unordered_map<std::string, int32_t> mPresearchMemo;
    bool mHavePresearchGpu{false};
    stof_gpu_props_t mPresearchGpu{};
};

class SparseAttentionOp : public Ort::CustomOpBase<SparseAttentionOp, SparseAttentionKernel, true> {
public:
    SparseAttentionOp(ONNXTensorElementDataType type, std::shared_ptr<TacticCache const> cache);
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
    std::shared_ptr<TacticCache const> mCache;
};

}  // namespace stof_ort

#endif  // STOF_ORT_SPARSE_ATTENTION_OP_H
