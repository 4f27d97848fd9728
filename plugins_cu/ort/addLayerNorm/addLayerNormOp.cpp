// StofAddLayerNorm kernel: validation and the launch of the fused bias + residual + LayerNorm kernel.
#include "addLayerNormOp.h"

#include <cuda_runtime.h>

#include <cmath>

#include "stof/stof_epilogue.h"

namespace stof_ort {

AddLayerNormKernel::AddLayerNormKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type) : mType(type) {
    Ort::ConstKernelInfo ki(info);
    mName = ki.GetNodeName();
    try {
        mEpsilon = ki.GetAttribute<float>("epsilon");
    } catch (Ort::Exception const&) {
        mEpsilon = 1e-5f;
    }
    STOF_VALIDATE(std::isfinite(mEpsilon) && mEpsilon >= 0.f, "node '", mName, "': bad epsilon ", mEpsilon);
}

OrtStatusPtr AddLayerNormKernel::ComputeV2(OrtKernelContext* context) {
    return computeNode(kADD_LAYER_NORM_NAME, mName, context, [&](Ort::KernelContext& ctx) { compute(ctx); });
}

void AddLayerNormKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    static char const* kNames[kLN_NUM_INPUTS] = {"X", "residual", "gamma", "beta", "bias"};
    TensorArg in[kLN_NUM_INPUTS];
    for (size_t i = 0; i < kLN_NUM_INPUTS; ++i) {
        in[i] = getInput(ctx, i);
        STOF_VALIDATE(in[i].present || i == kLN_BIAS, "missing input '", kNames[i], "'");
        if (in[i].present) expectType(in[i], mType, kNames[i]);
    }
    auto const& xs = in[kLN_X].shape;
    STOF_VALIDATE(!xs.empty(), "X must have rank >= 1");
    STOF_VALIDATE(in[kLN_RESIDUAL].shape == xs, "residual shape ", shapeStr(in[kLN_RESIDUAL].shape),
                  " != X shape ", shapeStr(xs));
    int64_t const N = xs.back();
    for (size_t i : {kLN_GAMMA, kLN_BETA, kLN_BIAS}) {
        if (!in[i].present) continue;
        STOF_VALIDATE(in[i].shape.size() == 1 && in[i].shape[0] == N, kNames[i], " shape ", shapeStr(in[i].shape),
                      ", expected [", N, "]");
    }
    Ort::UnownedValue y = ctx.GetOutput(0, xs);
    void* sum = nullptr;
    if (ctx.GetOutputCount() > 1) {
        Ort::UnownedValue s = ctx.GetOutput(1, xs);
        if (s) sum = s.GetTensorMutableRawData();
    }
    int64_t const total = numel(xs);
    if (total == 0) return;
    STOF_REQUIRE(N <= stof_add_layernorm_max_n(), ORT_NOT_IMPLEMENTED, "hidden size ", N, " above ",
                 stof_add_layernorm_max_n());
    stof_epi_status_t s = stof_add_layernorm_run(epiDType(mType), total / N, N, in[kLN_X].data, in[kLN_RESIDUAL].data,
                                                 in[kLN_BIAS].present ? in[kLN_BIAS].data : nullptr,
                                                 in[kLN_GAMMA].data, in[kLN_BETA].data, mEpsilon,
                                                 y.GetTensorMutableRawData(), sum,
                                                 reinterpret_cast<stof_epi_stream_t>(stream));
    epiCheck(s, "stof_add_layernorm_run");
}

AddLayerNormOp::AddLayerNormOp(ONNXTensorElementDataType type) : mType(type) {
    OrtCustomOp::InferOutputShapeFn = [](OrtCustomOp const* op, OrtShapeInferContext* ctx) -> OrtStatusPtr {
        return inferShapeFromInput(ctx, kLN_X, static_cast<AddLayerNormOp const*>(op)->mType, -1, 0, 2);
    };
}

OrtStatusPtr AddLayerNormOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kADD_LAYER_NORM_NAME, [&] { *kernel = new AddLayerNormKernel(info, mType); });
}

}  // namespace stof_ort
