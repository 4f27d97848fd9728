// Shared helpers of the STOF ONNX Runtime custom-op library (see ortCommon.h).
#include "ortCommon.h"

#include <atomic>

namespace stof_ort {
namespace {
std::atomic<bool> gVerbose{false};
}  // namespace

bool verboseEnabled() { return gVerbose.load(); }
void setVerbose(bool on) { gVerbose.store(on); }

OrtStatusPtr inferShapeFromInput(OrtShapeInferContext* ctx, size_t input, ONNXTensorElementDataType outType,
                                 int64_t lastDimFromInput, int lastDimInputAxis, size_t nbOutputs,
                                 size_t dropAxisForRank, size_t dropAxis) noexcept {
    OrtApi const& api = Ort::GetApi();
    OrtTensorTypeAndShapeInfo* in = nullptr;
    OrtTensorTypeAndShapeInfo* other = nullptr;
    OrtTensorTypeAndShapeInfo* out = nullptr;
    // `in` and `other` stay owned by ORT (ShapeInferContext_GetInputTypeShape lends them); `out` is ours.
    auto cleanup = [&]() {
        if (out) api.ReleaseTensorTypeAndShapeInfo(out);
    };
#define STOF_TRY_API(call)            \
    do {                              \
        OrtStatusPtr s_ = (call);     \
        if (s_ != nullptr) {          \
            cleanup();                \
            return s_;                \
        }                             \
    } while (0)
    try {
        STOF_TRY_API(api.ShapeInferContext_GetInputTypeShape(ctx, input, &in));
        // One schema serves the float/float16/bfloat16 kernels of an op (ORT builds it from the first registered),
        // so the output type follows the input's, never the op object's.
        ONNXTensorElementDataType inType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
        STOF_TRY_API(api.GetTensorElementType(in, &inType));
        if (inType != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED) outType = inType;
        size_t rank = 0;
        STOF_TRY_API(api.GetDimensionsCount(in, &rank));
        if (rank == 0) {  // unknown rank (or scalar): leave the output to ORT's type inference
            cleanup();
            return nullptr;
        }
        std::vector<int64_t> dims(rank);
        std::vector<char const*> sym(rank, nullptr);
        STOF_TRY_API(api.GetDimensions(in, dims.data(), rank));
        STOF_TRY_API(api.GetSymbolicDimensions(in, sym.data(), rank));
        std::vector<std::string> symStore(rank);
        for (size_t i = 0; i < rank; ++i) symStore[i] = sym[i] ? sym[i] : "";
        if (dropAxisForRank != 0 && rank == dropAxisForRank && dropAxis < rank) {
            dims.erase(dims.begin() + static_cast<std::ptrdiff_t>(dropAxis));
            symStore.erase(symStore.begin() + static_cast<std::ptrdiff_t>(dropAxis));
            --rank;
        }
        if (lastDimFromInput >= 0) {
            STOF_TRY_API(api.ShapeInferContext_GetInputTypeShape(ctx, static_cast<size_t>(lastDimFromInput), &other));
            size_t orank = 0;
            STOF_TRY_API(api.GetDimensionsCount(other, &orank));
            int64_t d = -1;
            std::string dsym;
            if (orank > static_cast<size_t>(lastDimInputAxis)) {
                std::vector<int64_t> od(orank);
                std::vector<char const*> osym(orank, nullptr);
                STOF_TRY_API(api.GetDimensions(other, od.data(), orank));
                STOF_TRY_API(api.GetSymbolicDimensions(other, osym.data(), orank));
                d = od[lastDimInputAxis];
                dsym = osym[lastDimInputAxis] ? osym[lastDimInputAxis] : "";
            }
            dims[rank - 1] = d;
            symStore[rank - 1] = dsym;
        }
        // ORT turns an unnamed unknown dim into a *static* -1 (dim_value), which constant folding of a later
        // Shape node then bakes into Reshape targets: leave such shapes unknown rather than wrong.
        for (size_t i = 0; i < rank; ++i) {
            if (dims[i] < 0 && symStore[i].empty()) {
                cleanup();
                return nullptr;
            }
        }
        std::vector<char const*> symOut(rank);
        for (size_t i = 0; i < rank; ++i) symOut[i] = symStore[i].c_str();
        STOF_TRY_API(api.CreateTensorTypeAndShapeInfo(&out));
        STOF_TRY_API(api.SetTensorElementType(out, outType));
        STOF_TRY_API(api.SetDimensions(out, dims.data(), rank));
        STOF_TRY_API(api.SetSymbolicDimensions(out, symOut.data(), rank));
        STOF_TRY_API(api.ShapeInferContext_SetOutputTypeShape(ctx, 0, out));
        for (size_t i = 1; i < nbOutputs; ++i) {  // optional outputs the node may not have: ignore failures
            OrtStatusPtr s = api.ShapeInferContext_SetOutputTypeShape(ctx, i, out);
            if (s != nullptr) api.ReleaseStatus(s);
        }
        cleanup();
        return nullptr;
    } catch (std::exception const& e) {
        cleanup();
        return api.CreateStatus(ORT_FAIL, strCat("stof shape inference: ", e.what()).c_str());
    } catch (...) {
        cleanup();
        return api.CreateStatus(ORT_FAIL, "stof shape inference: unknown exception");
    }
#undef STOF_TRY_API
}

}  // namespace stof_ort
