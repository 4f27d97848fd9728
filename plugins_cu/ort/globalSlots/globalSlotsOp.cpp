// StofGlobalSlots kernel: validation, the outputs' allocation and the launch of stof_global_slots_run.
#include "globalSlotsOp.h"

#include <cuda_runtime.h>

#include "stof/stof_epilogue.h"

namespace stof_ort {

GlobalSlotsKernel::GlobalSlotsKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type) : mType(type) {
    Ort::ConstKernelInfo ki(info);
    mName = ki.GetNodeName();
    mSlots = intAttr(ki, "slots");
    STOF_VALIDATE(mSlots >= 1 && mSlots <= stof_global_slots_max(), "node '", mName, "': slots ", mSlots,
                  " outside [1, ", stof_global_slots_max(), "]");
}

OrtStatusPtr GlobalSlotsKernel::ComputeV2(OrtKernelContext* context) {
    return computeNode(kGLOBAL_SLOTS_NAME, mName, context, [&](Ort::KernelContext& ctx) { compute(ctx); });
}

void GlobalSlotsKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    TensorArg x = getInput(ctx, kGS_X), mask = getInput(ctx, kGS_MASK), global = getInput(ctx, kGS_GLOBAL);
    STOF_VALIDATE(x.present && mask.present && global.present, "missing input X, mask or global");
    expectType(x, mType, "X");
    expectType(mask, mType, "mask");
    expectType(global, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "global");
    expectRank(x, 3, "X");
    int64_t const B = x.shape[0], S = x.shape[1], N = x.shape[2], G = mSlots;
    STOF_VALIDATE(mask.shape == std::vector<int64_t>({B, S}) && global.shape == mask.shape, "mask shape ",
                  shapeStr(mask.shape), " and global shape ", shapeStr(global.shape), ": expected [B, S] = [", B, ",",
                  S, "] (X ", shapeStr(x.shape), ")");
    STOF_VALIDATE(B <= 65535, "batch ", B, " above 65535");
    Ort::UnownedValue slotX = ctx.GetOutput(kGS_SLOT_X, {B, G, N});
    Ort::UnownedValue localKpm = ctx.GetOutput(kGS_LOCAL_KPM, {B, G + S});
    Ort::UnownedValue globalKpm = ctx.GetOutput(kGS_GLOBAL_KPM, {B, S});
    Ort::UnownedValue rowIndex = ctx.GetOutput(kGS_ROW_INDEX, {B, G});
    if (B == 0) return;
    stof_epi_status_t s = stof_global_slots_run(
        epiDType(mType), B, S, N, static_cast<int32_t>(G), x.data, mask.data, static_cast<int32_t const*>(global.data),
        slotX.GetTensorMutableRawData(), localKpm.GetTensorMutableData<int32_t>(),
        globalKpm.GetTensorMutableData<int32_t>(), rowIndex.GetTensorMutableData<int32_t>(),
        reinterpret_cast<stof_epi_stream_t>(stream));
    epiCheck(s, "stof_global_slots_run");
}

OrtStatusPtr GlobalSlotsOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kGLOBAL_SLOTS_NAME, [&] { *kernel = new GlobalSlotsKernel(info, mType); });
}

}  // namespace stof_ort
