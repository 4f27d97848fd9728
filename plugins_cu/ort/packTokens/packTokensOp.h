// StofPackTokens on ONNX Runtime's CUDA EP (docs/nodes.md): the index arrays of padding removal into a fixed token
// capacity (stof_pack_tokens_run).
#ifndef STOF_ORT_PACK_TOKENS_OP_H
#define STOF_ORT_PACK_TOKENS_OP_H

#include "../common/ortCommon.h"

namespace stof_ort {

constexpr char const* kPACK_TOKENS_NAME = "StofPackTokens";
enum PackTokensInput : size_t { kPT_MASK = 0, kPT_CAPACITY, kPT_NUM_INPUTS };
enum PackTokensOutput : size_t { kPT_IDX = 0, kPT_SEQ_OFFSETS, kPT_SOURCE_ROW, kPT_NUM_OUTPUTS };

class PackTokensKernel {
public:
    explicit PackTokensKernel(OrtKernelInfo const* info);
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    void compute(Ort::KernelContext& ctx);
    std::string mName;
};

// One op for every model dtype: its tensors are int32 (the mask as the rewrite casts it, the capacity input whose
// length only is read).
class PackTokensOp : public Ort::CustomOpBase<PackTokensOp, PackTokensKernel, true> {
public:
    OrtStatusPtr CreateKernelV2(OrtApi const& api, OrtKernelInfo const* info, void** kernel) const;
    char const* GetName() const { return kPACK_TOKENS_NAME; }
    char const* GetExecutionProviderType() const { return kCUDA_EP; }
    size_t GetInputTypeCount() const { return kPT_NUM_INPUTS; }
    ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32; }
    size_t GetOutputTypeCount() const { return kPT_NUM_OUTPUTS; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32; }
};

}  // namespace stof_ort

#endif  // STOF_ORT_PACK_TOKENS_OP_H
