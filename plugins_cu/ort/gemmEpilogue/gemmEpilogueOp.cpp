// StofGemmEpilogue kernel: validation, output allocation, cuBLASLt workspace from ORT's CUDA allocator.
#include "gemmEpilogueOp.h"

#include <cuda_runtime.h>

namespace stof_ort {

GemmEpilogueKernel::GemmEpilogueKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type,
                                       bool firstUseTiming)
    : mType(type), mFirstUseTiming(firstUseTiming) {
    Ort::ConstKernelInfo ki(info);
    mName = ki.GetNodeName();
    std::string act = "none";
    try {
        act = ki.GetAttribute<std::string>("activation");
    } catch (Ort::Exception const&) {
    }
    if (act == "none") mActivation = STOF_ACT_NONE;
    else if (act == "gelu_erf" || act == "gelu") mActivation = STOF_ACT_GELU_ERF;
    else if (act == "gelu_tanh") mActivation = STOF_ACT_GELU_TANH;
    else throw StofOrtError(ORT_INVALID_ARGUMENT, strCat("node '", mName, "': unknown activation '", act,
                                                         "' (none, gelu_erf, gelu_tanh)"));
    try {
        mAlgo = ki.GetAttribute<int64_t>("algo");
    } catch (Ort::Exception const&) {
    }
    if (mAlgo < -1 || mAlgo > 1023)
        throw StofOrtError(ORT_INVALID_ARGUMENT, strCat("node '", mName, "': algo ", mAlgo,
                                                         " (the cuBLASLt heuristic index, 0..1023; -1 = timed at "
                                                         "first use)"));
}

GemmEpilogueKernel::~GemmEpilogueKernel() { stof_gemm_context_destroy(mGemm); }

OrtStatusPtr GemmEpilogueKernel::ComputeV2(OrtKernelContext* context) {
    return computeNode(kGEMM_EPILOGUE_NAME, mName, context, [&](Ort::KernelContext& ctx) { compute(ctx); });
}

void GemmEpilogueKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    TensorArg x = getInput(ctx, 0), w = getInput(ctx, 1), bias = getInput(ctx, 2);
    STOF_VALIDATE(x.present && w.present, "missing input X or W");
    expectType(x, mType, "X");
    expectType(w, mType, "W");
    STOF_VALIDATE(x.shape.size() >= 1, "X must have rank >= 1");
    expectRank(w, 2, "W");
    int64_t const K = w.shape[0], N = w.shape[1];
    STOF_VALIDATE(x.shape.back() == K, "X shape ", shapeStr(x.shape), " and W shape ", shapeStr(w.shape),
                  " do not chain (last dim of X must be W's first)");
    if (bias.present) {
        expectType(bias, mType, "bias");
        STOF_VALIDATE(bias.shape.size() == 1 && bias.shape[0] == N, "bias shape ", shapeStr(bias.shape),
                      ", expected [", N, "]");
    }
    TensorArg prefix = getInput(ctx, 3);
    int64_t batch = 1, seq = 0, slots = 0;  // with a prefix: X [batch, seq, K], P [batch, slots, K]
    std::vector<int64_t> yShape = x.shape;
    yShape.back() = N;
    if (prefix.present) {
        expectType(prefix, mType, "prefix");
        STOF_VALIDATE(x.shape.size() == 3 && prefix.shape.size() == 3 && prefix.shape[0] == x.shape[0] &&
                          prefix.shape[2] == K,
                      "prefix shape ", shapeStr(prefix.shape), " and X shape ", shapeStr(x.shape),
                      ": expected [B, G, K] and [B, S, K] with K = ", K);
        batch = x.shape[0], seq = x.shape[1], slots = prefix.shape[1];
        yShape[1] = slots + seq;
    }
    // the prefix rows' own weights and bias (a Longformer rewrite's slot rows: global Q where X's rows take Q)
    TensorArg prefixW = getInput(ctx, 4), prefixBias = getInput(ctx, 5);
    STOF_VALIDATE(!prefixW.present || prefix.present, "prefix_w needs the input prefix");
    STOF_VALIDATE(prefixBias.present == (prefixW.present && bias.present),
                  "prefix_bias goes with prefix_w and bias (all three or neither)");
    if (prefixW.present) {
        expectType(prefixW, mType, "prefix_w");
        STOF_VALIDATE(prefixW.shape == w.shape, "prefix_w shape ", shapeStr(prefixW.shape), " != W shape ",
                      shapeStr(w.shape));
    }
    if (prefixBias.present) {
        expectType(prefixBias, mType, "prefix_bias");
        STOF_VALIDATE(prefixBias.shape == bias.shape, "prefix_bias shape ", shapeStr(prefixBias.shape),
                      " != bias shape ", shapeStr(bias.shape));
    }
    Ort::UnownedValue y = ctx.GetOutput(0, yShape);
    int64_t const M = numel(x.shape) / (K == 0 ? 1 : K);
    if (numel(yShape) == 0) return;
    void* yData = y.GetTensorMutableRawData();
    if (K == 0) {  // empty reduction: Y = act(bias) (or 0); rare enough for a plain path
        STOF_REQUIRE(!bias.present, ORT_NOT_IMPLEMENTED, "K = 0 with a bias is not supported");
        size_t const elem = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
        STOF_REQUIRE(cudaMemsetAsync(yData, 0, static_cast<size_t>(numel(yShape)) * elem, stream) == cudaSuccess,
                     ORT_RUNTIME_EXCEPTION, "cudaMemsetAsync failed");
        return;
    }
    stof_gemm_context_t gemm = nullptr;
    {
        std::lock_guard<std::mutex> lock(mInitMutex);
        if (mGemm == nullptr) {
            stof_epi_status_t s = stof_gemm_context_create(&mGemm);
            STOF_REQUIRE(s == STOF_EPI_SUCCESS, ORT_RUNTIME_EXCEPTION, "cuBLASLt init: ",
                         stof_epi_last_error_message());
        }
        gemm = mGemm;
    }
    ScopedScratch ws(ctx, stof_gemm_workspace_size());
    // a node without a measured `algo` (stof tune) times cuBLASLt's first candidates at the first call of each
    // row-count bucket, like the attention nodes' first-use timing (off: the heuristic's first)
    int32_t const algo = mAlgo >= 0 ? static_cast<int32_t>(mAlgo) : mFirstUseTiming ? STOF_GEMM_ALGO_TIMED : -1;
    auto check = [](stof_epi_status_t s) { epiCheck(s, "stof_gemm_epilogue_run"); };
    auto const cs = reinterpret_cast<stof_epi_stream_t>(stream);
    void const* b = bias.present ? bias.data : nullptr;
    if (!prefix.present) {
        check(stof_gemm_epilogue_run_algo(gemm, epiDType(mType), M, N, K, x.data, w.data, b, mActivation, algo,
                                          yData, ws.data(), ws.bytes(), cs));
        return;
    }
    // rows [0, G) of each sequence from the prefix, rows [G, G+S) from X: each GEMM writes its slice of Y
    size_t const elem = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
    int64_t const stride = (slots + seq) * N;
    void const* const pw = prefixW.present ? prefixW.data : w.data;
    void const* const pb = prefixW.present ? (prefixBias.present ? prefixBias.data : nullptr) : b;
    if (slots > 0)
        check(stof_gemm_epilogue_run_strided(gemm, epiDType(mType), batch, slots, N, K, prefix.data, pw, pb,
                                             mActivation, algo, yData, stride, ws.data(), ws.bytes(), cs));
    if (seq > 0)
        check(stof_gemm_epilogue_run_strided(gemm, epiDType(mType), batch, seq, N, K, x.data, w.data, b,
                                             mActivation, algo, static_cast<char*>(yData) + slots * N * elem, stride,
                                             ws.data(), ws.bytes(), cs));
}

GemmEpilogueOp::GemmEpilogueOp(ONNXTensorElementDataType type, bool firstUseTiming)
    : mType(type), mFirstUseTiming(firstUseTiming) {
    OrtCustomOp::InferOutputShapeFn = [](OrtCustomOp const* op, OrtShapeInferContext* ctx) -> OrtStatusPtr {
        // with a prefix the sequence axis is G + S: left to the kernel rather than inferred wrong
        size_t count = 0;
        OrtStatusPtr s = Ort::GetApi().ShapeInferContext_GetInputCount(ctx, &count);
        if (s != nullptr) return s;
        if (count >= 4) {
            OrtTensorTypeAndShapeInfo* prefix = nullptr;
            OrtStatusPtr p = Ort::GetApi().ShapeInferContext_GetInputTypeShape(ctx, 3, &prefix);
            if (p != nullptr) Ort::GetApi().ReleaseStatus(p);
            else if (prefix != nullptr) return nullptr;
        }
        return inferShapeFromInput(ctx, 0, static_cast<GemmEpilogueOp const*>(op)->mType, 1, 1);
    };
}

OrtStatusPtr GemmEpilogueOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kGEMM_EPILOGUE_NAME, [&] { *kernel = new GemmEpilogueKernel(info, mType, mFirstUseTiming); });
}

}  // namespace stof_ort
