// Shared pieces of the STOF ONNX Runtime custom-op library: the error type every kernel throws, the validation
// macro, the try/catch shell that turns exceptions into OrtStatus at each C entry point, and small tensor helpers.
#ifndef STOF_ORT_COMMON_H
#define STOF_ORT_COMMON_H

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <cuda_runtime.h>

#include "stof/stof_epilogue.h"

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace stof_ort {

constexpr char const* kDOMAIN = "stof";
constexpr char const* kCUDA_EP = "CUDAExecutionProvider";
constexpr int kOP_VERSION = 1;
// Session config keys (SessionOptions.add_session_config_entry) and their environment-variable twins.
constexpr char const* kCONFIG_TACTIC_CACHE = "stof.tactic_cache";
constexpr char const* kENV_TACTIC_CACHE = "STOF_TACTIC_CACHE";
constexpr char const* kCONFIG_FIRST_USE_TIMING = "stof.first_use_timing";
constexpr char const* kENV_FIRST_USE_TIMING = "STOF_FIRST_USE_TIMING";
constexpr char const* kCONFIG_VERBOSE = "stof.verbose";
constexpr char const* kENV_VERBOSE = "STOF_ORT_VERBOSE";

// An error with the OrtErrorCode it maps to.
class StofOrtError : public std::runtime_error {
public:
    StofOrtError(OrtErrorCode code, std::string const& msg) : std::runtime_error(msg), mCode(code) {}
    OrtErrorCode code() const noexcept { return mCode; }

private:
    OrtErrorCode mCode;
};

template <typename... Args>
std::string strCat(Args const&... args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}

// Throw INVALID_ARGUMENT (or `code`) with a message when `cond` is false.
#define STOF_VALIDATE(cond, ...)                                                                             \
    do {                                                                                                     \
        if (!(cond)) throw ::stof_ort::StofOrtError(ORT_INVALID_ARGUMENT, ::stof_ort::strCat(__VA_ARGS__));  \
    } while (0)
#define STOF_REQUIRE(cond, code, ...)                                                                        \
    do {                                                                                                     \
        if (!(cond)) throw ::stof_ort::StofOrtError((code), ::stof_ort::strCat(__VA_ARGS__));                \
    } while (0)

// Run `fn` and convert any exception into an OrtStatus (nullptr on success).  Used at every C entry point.
template <typename Fn>
OrtStatusPtr guarded(char const* where, Fn&& fn) noexcept {
    try {
        fn();
        return nullptr;
    } catch (StofOrtError const& e) {
        return Ort::GetApi().CreateStatus(e.code(), strCat(where, ": ", e.what()).c_str());
    } catch (Ort::Exception const& e) {
        return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), strCat(where, ": ", e.what()).c_str());
    } catch (std::exception const& e) {
        return Ort::GetApi().CreateStatus(ORT_FAIL, strCat(where, ": ", e.what()).c_str());
    } catch (...) {
        return Ort::GetApi().CreateStatus(ORT_FAIL, strCat(where, ": unknown exception").c_str());
    }
}

// A required INT attribute of a node (its absence: INVALID_ARGUMENT).
inline int64_t intAttr(Ort::ConstKernelInfo const& ki, char const* name) {
    try {
        return ki.GetAttribute<int64_t>(name);
    } catch (Ort::Exception const&) {
        throw StofOrtError(ORT_INVALID_ARGUMENT, strCat("missing INT attribute '", name, "'"));
    }
}

// libstof_epilogue's dtype of an ORT element type (float, float16, bfloat16).
inline int32_t epiDType(ONNXTensorElementDataType t) {
    switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return STOF_EPI_FP16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return STOF_EPI_BF16;
    default: return STOF_EPI_FP32;
    }
}

// A libstof_epilogue call's status as an exception naming the call: bad arguments INVALID_ARGUMENT, the rest FAIL.
inline void epiCheck(stof_epi_status_t s, char const* call) {
    STOF_REQUIRE(s == STOF_EPI_SUCCESS, s == STOF_EPI_ERROR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL, call,
                 ": ", stof_epi_status_string(s), ": ", stof_epi_last_error_message());
}

// A kernel's ComputeV2: `compute(ctx)` guarded, its errors prefixed with the node's name.
template <typename Fn>
OrtStatusPtr computeNode(char const* op, std::string const& node, OrtKernelContext* context, Fn&& compute) noexcept {
    return guarded(op, [&] {
        Ort::KernelContext ctx(context);
        try {
            compute(ctx);
        } catch (StofOrtError const& e) {
            throw StofOrtError(e.code(), strCat("node '", node, "': ", e.what()));
        }
    });
}

inline char const* typeName(ONNXTensorElementDataType t) {
    switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    default: return "other";
    }
}

inline std::string shapeStr(std::vector<int64_t> const& s) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
    os << "]";
    return os.str();
}

inline int64_t numel(std::vector<int64_t> const& s) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    return n;
}

// One input of a kernel call: present?, dtype, shape, device pointer.
struct TensorArg {
    bool present{false};
    ONNXTensorElementDataType type{ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED};
    std::vector<int64_t> shape;
    void const* data{nullptr};
};

inline TensorArg getInput(Ort::KernelContext& ctx, size_t index) {
    TensorArg a;
    if (index >= ctx.GetInputCount()) return a;
    Ort::ConstValue v = ctx.GetInput(index);
    if (!v) return a;
    auto info = v.GetTensorTypeAndShapeInfo();
    a.present = true;
    a.type = info.GetElementType();
    a.shape = info.GetShape();
    a.data = v.GetTensorRawData();
    return a;
}

inline void expectType(TensorArg const& a, ONNXTensorElementDataType t, char const* name) {
    STOF_VALIDATE(a.type == t, "input '", name, "' has dtype ", typeName(a.type), ", expected ", typeName(t));
}

inline void expectRank(TensorArg const& a, size_t rank, char const* name) {
    STOF_VALIDATE(a.shape.size() == rank, "input '", name, "' has shape ", shapeStr(a.shape), ", expected rank ",
                  rank);
}

bool verboseEnabled();
void setVerbose(bool on);

// Output shape = a copy of one input's (symbolic) shape, optionally with the last dim replaced, and with axis
// `dropAxis` removed when the input has rank `dropAxisForRank` (packed [B,S,3,H,D] query -> [B,S,H,D] output);
// used by the InferOutputShapeFn of every op (written against the C API so that no exception crosses into ORT).
OrtStatusPtr inferShapeFromInput(OrtShapeInferContext* ctx, size_t input, ONNXTensorElementDataType outType,
                                 int64_t lastDimFromInput, int lastDimInputAxis, size_t nbOutputs = 1,
                                 size_t dropAxisForRank = 0, size_t dropAxis = 0) noexcept;

// Scratch memory from the EP's allocator, returned when the kernel call ends.  Freed before the launched work
// completes: this assumes the session's kernels run on one compute stream, in order (a plain Alloc carries no
// stream; concurrent Run() calls on separate streams of one arena could reuse the block early -- the same holds for
// the GEMM-epilogue workspace).  No allocator, or a failing Alloc, leaves data() NULL: callers run without scratch.
class ScopedScratch {
public:
    ScopedScratch(Ort::KernelContext& ctx, size_t bytes) {
        int dev = 0;
        if (bytes == 0 || cudaGetDevice(&dev) != cudaSuccess) return;
        try {
            Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, dev, OrtMemTypeDefault);
            mAlloc = ctx.GetAllocator(*info);
        } catch (Ort::Exception const&) {
            mAlloc = nullptr;
        }
        if (mAlloc == nullptr) return;
        try {
            mPtr = mAlloc->Alloc(mAlloc, bytes);
        } catch (...) {  // ORT's arena throws when out of memory
            mPtr = nullptr;
        }
        if (mPtr != nullptr) mBytes = bytes;
    }
    ~ScopedScratch() {
        if (mAlloc == nullptr) return;
        if (mPtr != nullptr) mAlloc->Free(mAlloc, mPtr);
        Ort::GetApi().ReleaseAllocator(mAlloc);  // GetAllocator hands out a wrapper object per call
    }
    ScopedScratch(ScopedScratch const&) = delete;
    ScopedScratch& operator=(ScopedScratch const&) = delete;
    void* data() const { return mPtr; }
    size_t bytes() const { return mBytes; }

private:
    OrtAllocator* mAlloc{nullptr};
    void* mPtr{nullptr};
    size_t mBytes{0};
};

}  // namespace stof_ort

#endif  // STOF_ORT_COMMON_H
