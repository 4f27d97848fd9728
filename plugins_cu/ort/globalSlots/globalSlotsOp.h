// StofGlobalSlots on ONNX Runtime's CUDA EP (docs/nodes.md): a sequence's run-time global tokens gathered into G
// slots, with the key padding words of the two attention nodes of the LongformerAttention rewrite
// (stof_global_slots_run).
#ifndef STOF_ORT_GLOBAL_SLOTS_OP_H
#define STOF_ORT_GLOBAL_SLOTS_OP_H

#include "../common/ortCommon.h"

namespace stof_ort {

constexpr char const* kGLOBAL_SLOTS_NAME = "StofGlobalSlots";
enum GlobalSlotsInput : size_t { kGS_X = 0, kGS_MASK, kGS_GLOBAL, kGS_NUM_INPUTS };
enum GlobalSlotsOutput : size_t { kGS_SLOT_X = 0, kGS_LOCAL_KPM, kGS_GLOBAL_KPM, kGS_ROW_INDEX, kGS_NUM_OUTPUTS };

class GlobalSlotsKernel {
public:
    GlobalSlotsKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type);
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    void compute(Ort::KernelContext& ctx);
    ONNXTensorElementDataType mType;
    std::string mName;
    int64_t mSlots{0};
};

class GlobalSlotsOp : public Ort::CustomOpBase<GlobalSlotsOp, GlobalSlotsKernel, true> {
public:
    explicit GlobalSlotsOp(ONNXTensorElementDataType type) : mType(type) {}
    OrtStatusPtr CreateKernelV2(OrtApi const& api, OrtKernelInfo const* info, void** kernel) const;
    char const* GetName() const { return kGLOBAL_SLOTS_NAME; }
    char const* GetExecutionProviderType() const { return kCUDA_EP; }
    size_t GetInputTypeCount() const { return kGS_NUM_INPUTS; }
    ONNXTensorElementDataType GetInputType(size_t index) const {
        return index == kGS_GLOBAL ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : mType;
    }
    size_t GetOutputTypeCount() const { return kGS_NUM_OUTPUTS; }
    ONNXTensorElementDataType GetOutputType(size_t index) const {
        return index == kGS_SLOT_X ? mType : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    }

private:
    ONNXTensorElementDataType mType;
};

}  // namespace stof_ort

#endif  // STOF_ORT_GLOBAL_SLOTS_OP_H
