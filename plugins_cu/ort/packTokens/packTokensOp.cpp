// StofPackTokens kernel: validation, the outputs' allocation and the launch of stof_pack_tokens_run.
#include "packTokensOp.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "stof/stof_epilogue.h"

namespace stof_ort {

PackTokensKernel::PackTokensKernel(OrtKernelInfo const* info) { mName = Ort::ConstKernelInfo(info).GetNodeName(); }

OrtStatusPtr PackTokensKernel::ComputeV2(OrtKernelContext* context) {
    return computeNode(kPACK_TOKENS_NAME, mName, context, [&](Ort::KernelContext& ctx) { compute(ctx); });
}

void PackTokensKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    TensorArg mask = getInput(ctx, kPT_MASK), capacity = getInput(ctx, kPT_CAPACITY);
    STOF_VALIDATE(mask.present && capacity.present, "missing input mask or capacity");
    expectType(mask, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "mask");
    expectRank(mask, 2, "mask");
    expectRank(capacity, 1, "capacity");
    int64_t const B = mask.shape[0], S = mask.shape[1];
    STOF_VALIDATE(B <= 65535 && B * S <= INT32_MAX - 2, "mask shape ", shapeStr(mask.shape), " above 65535 rows or ",
                  INT32_MAX - 2, " tokens");
    int64_t const C = std::min(capacity.shape[0], B * S);  // the capacity's length: its values are not read
    Ort::UnownedValue idx = ctx.GetOutput(kPT_IDX, {C});
    Ort::UnownedValue offsets = ctx.GetOutput(kPT_SEQ_OFFSETS, {B + 1});
    Ort::UnownedValue rows = ctx.GetOutput(kPT_SOURCE_ROW, {B * S});
    ScopedScratch scratch(ctx, static_cast<size_t>(std::max<int64_t>(B, 1)) * sizeof(int32_t));
    STOF_REQUIRE(B == 0 || scratch.data() != nullptr, ORT_FAIL, "no scratch memory for ", B, " row lengths");
    stof_epi_status_t s = stof_pack_tokens_run(
        B, S, C, static_cast<int32_t const*>(mask.data), idx.GetTensorMutableData<int32_t>(),
        offsets.GetTensorMutableData<int32_t>(), rows.GetTensorMutableData<int32_t>(),
        static_cast<int32_t*>(scratch.data()), reinterpret_cast<stof_epi_stream_t>(stream));
    epiCheck(s, "stof_pack_tokens_run");
}

OrtStatusPtr PackTokensOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kPACK_TOKENS_NAME, [&] { *kernel = new PackTokensKernel(info); });
}

}  // namespace stof_ort
