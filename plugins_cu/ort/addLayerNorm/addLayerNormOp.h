// StofAddLayerNorm on ONNX Runtime's CUDA EP: S = (X + bias) + residual, Y = LayerNorm(S) * gamma + beta over
// the last axis, optional output 1 = S; one fused kernel (stof_add_layernorm_run).
#ifndef STOF_ORT_ADD_LAYER_NORM_OP_H
#define STOF_ORT_ADD_LAYER_NORM_OP_H

#include "../common/ortCommon.h"

namespace stof_ort {

constexpr char const* kADD_LAYER_NORM_NAME = "StofAddLayerNorm";
enum AddLayerNormInput : size_t { kLN_X = 0, kLN_RESIDUAL, kLN_GAMMA, kLN_BETA, kLN_BIAS, kLN_NUM_INPUTS };

class AddLayerNormKernel {
public:
    AddLayerNormKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type);
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    void compute(Ort::KernelContext& ctx);
    ONNXTensorElementDataType mType;
    std::string mName;
    float mEpsilon{1e-5f};
};

class AddLayerNormOp : public Ort::CustomOpBase<AddLayerNormOp, AddLayerNormKernel, true> {
public:
    explicit AddLayerNormOp(ONNXTensorElementDataType type);
    OrtStatusPtr CreateKernelV2(OrtApi const& api, OrtKernelInfo const* info, void** kernel) const;
    char const* GetName() const { return kADD_LAYER_NORM_NAME; }
    char const* GetExecutionProviderType() const { return kCUDA_EP; }
    size_t GetInputTypeCount() const { return kLN_NUM_INPUTS; }
    ONNXTensorElementDataType GetInputType(size_t) const { return mType; }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
        return index == kLN_BIAS ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
    }
    size_t GetOutputTypeCount() const { return 2; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return mType; }
    OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
        return index == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                          : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
    }

private:
    ONNXTensorElementDataType mType;
};

}  // namespace stof_ort

#endif  // STOF_ORT_ADD_LAYER_NORM_OP_H
