// StofGemmEpilogue on ONNX Runtime's CUDA EP: Y[...,N] = act(X[...,K] . W[K,N] + bias[N]) through
// stof_gemm_epilogue_run (cuBLASLt with the bias / GELU in the GEMM epilogue).  With the optional input `prefix`
// P [B, G, K] and X [B, S, K]: Y [B, G+S, N] = act(Concat(P, X, axis=1) . W + bias), two strided-batched GEMMs
// that write their rows of Y in place (no concatenated copy of the inputs).  With `prefix_w` / `prefix_bias`
// (inputs 4, 5) the prefix rows are projected with their own weights: Y[:, :G] = act(P . W_p + bias_p).
#ifndef STOF_ORT_GEMM_EPILOGUE_OP_H
#define STOF_ORT_GEMM_EPILOGUE_OP_H

#include <mutex>

#include "../common/ortCommon.h"
#include "stof/stof_epilogue.h"

namespace stof_ort {

constexpr char const* kGEMM_EPILOGUE_NAME = "StofGemmEpilogue";

class GemmEpilogueKernel {
public:
    GemmEpilogueKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type, bool firstUseTiming);
    ~GemmEpilogueKernel();
    OrtStatusPtr ComputeV2(OrtKernelContext* context);

private:
    void compute(Ort::KernelContext& ctx);
    ONNXTensorElementDataType mType;
    std::string mName;
    int32_t mActivation{STOF_ACT_NONE};
    int64_t mAlgo{-1};  // attribute `algo`: cuBLASLt heuristic index (-1: timed at first use, else the first)
    bool mFirstUseTiming{true};
    std::mutex mInitMutex;  // ORT may run one kernel instance from several threads (concurrent Run calls)
    stof_gemm_context_t mGemm{nullptr};
};

class GemmEpilogueOp : public Ort::CustomOpBase<GemmEpilogueOp, GemmEpilogueKernel, true> {
public:
    GemmEpilogueOp(ONNXTensorElementDataType type, bool firstUseTiming);
    OrtStatusPtr CreateKernelV2(OrtApi const& api, OrtKernelInfo const* info, void** kernel) const;
    char const* GetName() const { return kGEMM_EPILOGUE_NAME; }
    char const* GetExecutionProviderType() const { return kCUDA_EP; }
    // X, W, bias (optional), prefix, prefix_w, prefix_bias (optional)
    size_t GetInputTypeCount() const { return 6; }
    ONNXTensorElementDataType GetInputType(size_t) const { return mType; }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
        return index >= 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                          : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
    }
    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return mType; }

private:
    ONNXTensorElementDataType mType;
    bool mFirstUseTiming;  // session option stof.first_use_timing: nodes without an `algo` time cuBLASLt's candidates
};

}  // namespace stof_ort

#endif  // STOF_ORT_GEMM_EPILOGUE_OP_H
