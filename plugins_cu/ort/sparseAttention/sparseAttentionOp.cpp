// StofSparseAttention kernel for ONNX Runtime's CUDA EP: reads the attributes and inputs, makes a layout handle of
// libstof_kernels from the layout inputs (once per node when they are constant), and runs the tactic that
// stof_attn_select picks (tactic cache, first-use timing, pre-search, default) or, for what the tensor-core
// kernels cannot run, the general kernel.  Checks, derived schedules and tactic choice live in the library.
#include "sparseAttentionOp.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "genericAttention.h"

namespace stof_ort {
namespace {

constexpr int64_t kMAX_DIM = std::numeric_limits<int32_t>::max();
constexpr int64_t kMAX_GRID_YZ = 65535;

#define STOF_CUDA_THROW(call)                                                                                \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        STOF_REQUIRE(e_ == cudaSuccess, ORT_RUNTIME_EXCEPTION, #call, ": ", cudaGetErrorString(e_));         \
    } while (0)

// A library status as an ORT error: bad input is the caller's, the rest a failure.
#define STOF_LIB_THROW(call)                                                                                 \
    do {                                                                                                     \
        stof_status_t s_ = (call);                                                                           \
        STOF_REQUIRE(s_ == STOF_SUCCESS, s_ == STOF_ERROR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL,   \
                     stof_status_string(s_), ": ", stof_last_error_message());                               \
    } while (0)

// The node's qkv_format during shape inference ("" when absent or unreadable: the default, "bhsd").
std::string qkvFormatAttr(OrtShapeInferContext* ctx) {
    OrtApi const& api = Ort::GetApi();
    OrtOpAttr const* attr = nullptr;
    OrtStatusPtr s = api.ShapeInferContext_GetAttribute(ctx, "qkv_format", &attr);
    if (s != nullptr || attr == nullptr) {
        if (s != nullptr) api.ReleaseStatus(s);
        return "";
    }
    char buf[16] = {};
    size_t len = 0;
    s = api.ReadOpAttr(attr, ORT_OP_ATTR_STRING, buf, sizeof(buf) - 1, &len);
    if (s != nullptr) {
        api.ReleaseStatus(s);
        return "";
    }
    return std::string(buf, std::min(len, sizeof(buf) - 1));
}

bool hasAttr(OrtShapeInferContext* ctx, char const* name) {
    OrtApi const& api = Ort::GetApi();
    OrtOpAttr const* attr = nullptr;
    OrtStatusPtr s = api.ShapeInferContext_GetAttribute(ctx, name, &attr);
    if (s != nullptr) api.ReleaseStatus(s);
    return s == nullptr && attr != nullptr;
}

char const* sourceName(int32_t source) {
    return source == STOF_TACTIC_FROM_CACHE       ? "tactic cache"
           : source == STOF_TACTIC_TIMED          ? "first-use timing"
           : source == STOF_TACTIC_FROM_PRESEARCH ? "pre-search first choice"
                                                  : "library default";
}

}  // namespace

SparseAttentionKernel::SparseAttentionKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type,
                                             std::string cachePath, bool firstUseTiming)
    : mType(type), mCachePath(std::move(cachePath)), mFirstUseTiming(firstUseTiming) {
    Ort::ConstKernelInfo ki(info);
    mName = ki.GetNodeName();
    try {
        mScale = ki.GetAttribute<float>("scale");
    } catch (Ort::Exception const&) {
        throw StofOrtError(ORT_INVALID_ARGUMENT, "missing FLOAT attribute 'scale'");
    }
    mTileM = intAttr(ki, "tile_m"), mTileN = intAttr(ki, "tile_n");
    mSeqQ = intAttr(ki, "seq_q"), mSeqK = intAttr(ki, "seq_k");
    mNumLayouts = intAttr(ki, "num_layouts"), mFormatVersion = intAttr(ki, "format_version");
    std::string qkvFormat = "bhsd";
    try {
        qkvFormat = ki.GetAttribute<std::string>("qkv_format");
    } catch (Ort::Exception const&) {  // absent: the default
    }
    STOF_VALIDATE(qkvFormat == "bhsd" || qkvFormat == "bs3hd" || qkvFormat == "t3hd" || qkvFormat == "bshd_kv",
                  "qkv_format '", qkvFormat, "' (must be 'bhsd', 'bs3hd', 't3hd' or 'bshd_kv')");
    try {
        mLayoutSpec = ki.GetAttribute<std::string>("layout_spec");
    } catch (Ort::Exception const&) {  // absent: the layout inputs are all there is
    }
    if (!mLayoutSpec.empty() && stof_mask_check(mLayoutSpec.c_str()) != STOF_SUCCESS)
        throw StofOrtError(ORT_INVALID_ARGUMENT,
                           strCat("layout_spec '", mLayoutSpec, "': ", stof_last_error_message()));
    mTokens = qkvFormat == "t3hd";
    mPacked = qkvFormat == "bs3hd" || mTokens;  // K and V come from the query tensor
    mKvPacked = qkvFormat == "bshd_kv";         // K and V come from the key tensor
    try {
        mNumHeads = ki.GetAttribute<int64_t>("num_heads");
    } catch (Ort::Exception const&) {  // absent: the query's shape has the heads
    }
    STOF_VALIDATE(mNumHeads >= 0, "num_heads ", mNumHeads, " is negative");
    for (auto [name, view] : {std::pair{"query_view", &mQueryView}, std::pair{"key_view", &mKeyView}}) {
        try {
            *view = ki.GetAttributes<int64_t>(name);
        } catch (Ort::Exception const&) {  // absent: the whole tensor
        }
        if (view->empty()) continue;
        STOF_VALIDATE(view->size() == 4 && (*view)[0] >= 0 && (*view)[1] >= -1 && (*view)[2] >= 0 && (*view)[3] >= 1,
                      name, " must be [row0 >= 0, rows >= -1, col0 >= 0, cols >= 1]");
    }
    STOF_VALIDATE(mQueryView.empty() == mKeyView.empty(), "query_view and key_view go together");
    STOF_VALIDATE(mQueryView.empty() || (mKvPacked && mNumHeads > 0),
                  "query_view / key_view need qkv_format 'bshd_kv' and num_heads");
    // version 1 (one bitmap per PARTIAL tile) is version 2 without shared bitmaps: read both
    STOF_VALIDATE(mFormatVersion >= 1 && mFormatVersion <= STOF_FORMAT_VERSION, "format_version ", mFormatVersion,
                  " (this plugin reads 1 to ", STOF_FORMAT_VERSION, ")");
    STOF_VALIDATE(std::isfinite(mScale), "scale is not finite");
    // the int32 range here; stof_layout_create checks the rest (tile shapes, sizes)
    for (int64_t v : {mTileM, mTileN, mSeqQ, mSeqK, mNumLayouts})
        STOF_VALIDATE(v >= 1 && v <= kMAX_DIM, "tile_m, tile_n, seq_q, seq_k, num_layouts: ", v, " outside [1, 2^31)");
    bool allConstant = true;
    for (size_t i = kROW_PTR; i <= kBITMAPS; ++i) {
        int isConstant = 0;
        ki.GetTensorConstantInput(i, &isConstant);
        allConstant = allConstant && isConstant != 0;
    }
    mLayoutConstant = allConstant;
}

OrtStatusPtr SparseAttentionKernel::ComputeV2(OrtKernelContext* context) {
    return computeNode(kSPARSE_ATTENTION_NAME, mName, context, [&](Ort::KernelContext& ctx) { compute(ctx); });
}

SparseAttentionKernel::Layout::~Layout() {
    stof_layout_destroy(handle);
    // cudaFree waits for the kernels that read it; a destructor has no one to report an error to
    if (owned != nullptr && cudaFree(owned) != cudaSuccess) cudaGetLastError();
}

namespace {

// The length a grown layout is built for: S rounded up to a quarter of its octave (S <= bucket < 1.25 S + 1), so a
// model run at many lengths builds few layouts and the kernels keep their row orders (the run-time rows stay
// above 3/4 of the layout's).
int64_t lengthBucket(int64_t S) {
    int64_t step = 1;
    while (step * 8 < S) step *= 2;
    return std::min(kMAX_DIM, (S + step - 1) / step * step);
}

}  // namespace

std::shared_ptr<SparseAttentionKernel::Layout const> SparseAttentionKernel::grownLayout(int64_t Sq, int64_t Sk,
                                                                                       cudaStream_t stream) {
    auto const key = std::make_pair(lengthBucket(std::max(Sq, mSeqQ)), lengthBucket(std::max(Sk, mSeqK)));
    std::lock_guard<std::mutex> lock(mMutex);
    for (size_t i = 0; i < mGrown.size(); ++i) {
        if (mGrown[i].first != key) continue;
        auto const at = mGrown.begin() + static_cast<std::ptrdiff_t>(i);
        std::rotate(at, at + 1, mGrown.end());  // most recently used last
        return mGrown.back().second;
    }
    stof_mask_layout_t compiled = nullptr;
    stof_status_t const st = stof_mask_compile(mLayoutSpec.c_str(), static_cast<int32_t>(key.first),
                                               static_cast<int32_t>(key.second), static_cast<int32_t>(mTileM),
                                               static_cast<int32_t>(mTileN), static_cast<int32_t>(mNumLayouts), 0,
                                               &compiled);
    STOF_REQUIRE(st == STOF_SUCCESS, ORT_INVALID_ARGUMENT, "run-time Sq=", Sq, ", Sk=", Sk,
                 " exceed the compiled layout's seq_q=", mSeqQ, ", seq_k=", mSeqK, " and its layout_spec '",
                 mLayoutSpec, "' cannot be built at ", key.first, "x", key.second, ": ", stof_last_error_message());
    std::unique_ptr<stof_mask_layout_st, void (*)(stof_mask_layout_t)> guard(compiled, stof_mask_layout_destroy);
    stof_layout_desc_t d{};
    STOF_LIB_THROW(stof_mask_layout_desc(compiled, &d));
    auto made = std::make_shared<Layout>();
    made->seqQ = key.first, made->seqK = key.second;
    STOF_LIB_THROW(stof_layout_create(&d, &made->handle));
    STOF_LIB_THROW(stof_layout_upload(made->handle, reinterpret_cast<stof_stream_t>(stream)));
    // the general kernel's copy of the four arrays, one allocation
    int32_t const* src[4] = {d.row_ptr, d.col_idx, d.tile_bitmap_index, d.bitmaps};
    int64_t const len[4] = {d.row_ptr_len, d.col_idx_len, d.tile_bitmap_index_len, d.bitmaps_len};
    int64_t total = 0;
    for (int i = 0; i < 4; ++i) total += (len[i] + 3) / 4 * 4;
    STOF_CUDA_THROW(cudaMalloc(&made->owned, static_cast<size_t>(total) * sizeof(int32_t)));
    int64_t off = 0;
    for (int i = 0; i < 4; ++i) {
        made->ptrs[i] = made->owned + off;
        made->sizes[i] = len[i];
        STOF_CUDA_THROW(cudaMemcpyAsync(made->owned + off, src[i], static_cast<size_t>(len[i]) * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, stream));
        off += (len[i] + 3) / 4 * 4;
    }
    STOF_CUDA_THROW(cudaStreamSynchronize(stream));  // the host arrays go with the guard
    if (mGrown.size() >= kGROWN_CACHE_SIZE) mGrown.erase(mGrown.begin());
    mGrown.emplace_back(key, made);
    if (verboseEnabled())
        std::fprintf(stderr, "[stof] %s: layout '%s' built for %lldx%lld (run-time Sq %lld, Sk %lld)\n", mName.c_str(),
                     mLayoutSpec.c_str(), static_cast<long long>(key.first), static_cast<long long>(key.second),
                     static_cast<long long>(Sq), static_cast<long long>(Sk));
    return made;
}

std::shared_ptr<SparseAttentionKernel::Layout const> SparseAttentionKernel::layout(TensorArg const* arrays,
                                                                                   cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mMutex);
    if (mLayout && mLayoutConstant) {
        bool same = true;
        for (int i = 0; i < 4; ++i)
            same = same && mLayout->ptrs[i] == arrays[i].data && mLayout->sizes[i] == numel(arrays[i].shape);
        if (same) return mLayout;
    }
    std::vector<int32_t> host[4];
    auto made = std::make_shared<Layout>();
    for (int i = 0; i < 4; ++i) {
        made->ptrs[i] = arrays[i].data;
        made->sizes[i] = numel(arrays[i].shape);
        host[i].resize(static_cast<size_t>(made->sizes[i]));
        STOF_CUDA_THROW(cudaMemcpyAsync(host[i].data(), arrays[i].data, host[i].size() * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, stream));
    }
    STOF_CUDA_THROW(cudaStreamSynchronize(stream));
    stof_layout_desc_t d{};
    d.row_ptr = host[0].data(), d.row_ptr_len = made->sizes[0];
    d.col_idx = host[1].data(), d.col_idx_len = made->sizes[1];
    d.tile_bitmap_index = host[2].data(), d.tile_bitmap_index_len = made->sizes[2];
    d.bitmaps = host[3].data(), d.bitmaps_len = made->sizes[3];
    d.tile_m = static_cast<int32_t>(mTileM), d.tile_n = static_cast<int32_t>(mTileN);
    d.num_layouts = static_cast<int32_t>(mNumLayouts);
    d.seq_q = static_cast<int32_t>(mSeqQ), d.seq_k = static_cast<int32_t>(mSeqK);
    d.format_version = static_cast<int32_t>(mFormatVersion);
    STOF_LIB_THROW(stof_layout_create(&d, &made->handle));
    // A constant layout is uploaded once with its derived schedules; one fed at run time runs on its own device
    // arrays (an upload per call would cost an allocation and a free for a scheduling hint).
    if (mLayoutConstant) {
        STOF_LIB_THROW(stof_layout_upload(made->handle, reinterpret_cast<stof_stream_t>(stream)));
    } else {
        auto arr = [&](int i) { return static_cast<int32_t const*>(made->ptrs[i]); };
        STOF_LIB_THROW(stof_layout_use_device_arrays(made->handle, arr(0), arr(1), arr(2), arr(3)));
    }
    mLayout = std::move(made);
    return mLayout;
}

void SparseAttentionKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    TensorArg in[kSA_NUM_INPUTS];
    for (size_t i = 0; i < kSA_NUM_INPUTS; ++i) in[i] = getInput(ctx, i);
    static char const* kNames[kSA_NUM_INPUTS] = {"query", "key", "value", "row_ptr", "col_idx",
                                                 "tile_bitmap_index", "bitmaps", "key_padding_mask", "attn_bias",
                                                 "seq_offsets", "row_values", "row_index"};
    for (size_t i = 0; i <= kBITMAPS; ++i) {
        if (mKvPacked && i == kVALUE) {
            STOF_VALIDATE(!in[i].present, "qkv_format 'bshd_kv' reads V from the packed key: input 'value' must be "
                          "absent");
            continue;
        }
        if (mPacked && (i == kKEY || i == kVALUE)) {
            STOF_VALIDATE(!in[i].present, "qkv_format '", mTokens ? "t3hd" : "bs3hd",
                          "' reads K and V from the packed query: input '", kNames[i], "' must be absent");
            continue;
        }
        STOF_VALIDATE(in[i].present, "missing input '", kNames[i], "'");
    }
    for (size_t i : {kQUERY, kKEY, kVALUE}) {
        if ((mPacked && i != kQUERY) || (mKvPacked && i == kVALUE)) continue;
        expectType(in[i], mType, kNames[i]);
        if ((mKvPacked && i == kQUERY && mNumHeads > 0) || !mKeyView.empty()) {  // rows of H*D, or views of rows
            expectRank(in[i], 3, kNames[i]);
            continue;
        }
        expectRank(in[i], (mPacked && !mTokens) || (mKvPacked && i == kKEY) ? 5 : 4, kNames[i]);
    }
    for (size_t i : {kROW_PTR, kCOL_IDX, kTILE_BITMAP_INDEX, kBITMAPS, kKEY_PADDING_MASK, kROW_INDEX})
        if (in[i].present) expectType(in[i], ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, kNames[i]);
    TensorArg const& offsets = in[kSEQ_OFFSETS];
    if (mTokens) {
        // packed sequences: the mask's shape gives B and the padded length S, seq_offsets the sequences
        STOF_VALIDATE(in[kKEY_PADDING_MASK].present && in[kKEY_PADDING_MASK].shape.size() == 2,
                      "qkv_format 't3hd' needs key_padding_mask [B, S] (its shape gives B and S)");
        STOF_VALIDATE(!in[kATTN_BIAS].present, "qkv_format 't3hd' takes no attn_bias");
        STOF_VALIDATE(offsets.present, "qkv_format 't3hd' needs input 'seq_offsets' (int32 [B+1])");
        expectType(offsets, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "seq_offsets");
        int64_t const nb = in[kKEY_PADDING_MASK].shape[0];
        STOF_VALIDATE(offsets.shape.size() == 1 && offsets.shape[0] == nb + 1, "seq_offsets shape ",
                      shapeStr(offsets.shape), ", expected [B+1] = [", nb + 1, "]");
    } else {
        STOF_VALIDATE(!offsets.present, "input 'seq_offsets' needs qkv_format 't3hd'");
    }
    auto const& qs = in[kQUERY].shape;
    int64_t B, H, Sq, D, Sk, Hkv;  // Hkv: K/V heads (grouped-query attention when below H)
    // element strides (batch, head, sequence) of q, k, v and o, and the K / V offsets in the query tensor
    int64_t qSt[3], kSt[3], vSt[3], oSt[3], kOff = 0, vOff = 0;
    int64_t qBaseOff = 0, keyBaseOff = 0;  // elements from the query / key tensor's start (query_view, key_view)
    std::vector<int64_t> outShape;
    if (mTokens) {
        STOF_VALIDATE(qs[1] == 3, "packed query shape ", shapeStr(qs), " is not [T,3,H,D]");
        auto const& ms = in[kKEY_PADDING_MASK].shape;
        B = ms[0], Sq = Sk = ms[1], H = Hkv = qs[2], D = qs[3];
        // T token slots for B sequences of at most S, the real tokens first: T <= B*S (seq_offsets stays on the
        // device; slots from seq_offsets[B] on are not written)
        STOF_VALIDATE(qs[0] <= B * Sq, "packed query has T=", qs[0], " tokens, more than B*S = ", B, "*", Sq,
                      " (key_padding_mask ", shapeStr(ms), ")");
        int64_t const row = 3 * H * D;
        qSt[0] = kSt[0] = vSt[0] = oSt[0] = 0;  // seq_offsets place every sequence
        qSt[1] = kSt[1] = vSt[1] = D;
        qSt[2] = kSt[2] = vSt[2] = row;
        kOff = H * D;
        vOff = 2 * H * D;
        oSt[1] = D, oSt[2] = H * D;
        outShape = {qs[0], H, D};
    } else if (mPacked) {
        STOF_VALIDATE(qs[2] == 3, "packed query shape ", shapeStr(qs), " is not [B,S,3,H,D]");
        B = qs[0], Sq = Sk = qs[1], H = Hkv = qs[3], D = qs[4];
        int64_t const row = 3 * H * D;
        qSt[0] = kSt[0] = vSt[0] = Sq * row;
        qSt[1] = kSt[1] = vSt[1] = D;
        qSt[2] = kSt[2] = vSt[2] = row;
        kOff = H * D;
        vOff = 2 * H * D;
        oSt[0] = Sq * H * D, oSt[1] = D, oSt[2] = H * D;
        outShape = {B, Sq, H, D};
    } else if (mKvPacked && !mQueryView.empty()) {
        // windows of row tensors: query [B,Rq,Cq] -> Q [B,Sq,H*D], key [B,Rk,Ck] -> [B,Sk,2,Hkv,D]; output [B,Sq,H*D]
        auto const& ks = in[kKEY].shape;
        auto window = [](std::vector<int64_t> const& v, std::vector<int64_t> const& shape, char const* name) {
            // compared as differences: the attribute values may be anything up to 2^63 - 1
            int64_t const rows = v[0] > shape[1] ? -1 : v[1] < 0 ? shape[1] - v[0] : v[1];
            STOF_VALIDATE(rows >= 0 && rows <= shape[1] - v[0] && v[2] <= shape[2] && v[3] <= shape[2] - v[2], name,
                          " [", v[0], ", ", v[1], ", ", v[2], ", ", v[3], "] does not fit its input of shape ",
                          shapeStr(shape));
            return rows;
        };
        STOF_VALIDATE(ks[0] == qs[0], "query shape ", shapeStr(qs), " and key shape ", shapeStr(ks),
                      " differ in the batch");
        B = qs[0], Sq = window(mQueryView, qs, "query_view"), Sk = window(mKeyView, ks, "key_view");
        H = mNumHeads;
        STOF_VALIDATE(mQueryView[3] % H == 0, "query_view's ", mQueryView[3], " columns are not num_heads = ", H,
                      " heads");
        D = mQueryView[3] / H;
        STOF_VALIDATE(mKeyView[3] % (2 * D) == 0 && H % (mKeyView[3] / (2 * D)) == 0, "key_view's ", mKeyView[3],
                      " columns are not K and V of Hkv heads of ", D, " (H a multiple of Hkv)");
        Hkv = mKeyView[3] / (2 * D);
        qSt[0] = qs[1] * qs[2], qSt[1] = D, qSt[2] = qs[2];
        oSt[0] = Sq * H * D, oSt[1] = D, oSt[2] = H * D;
        kSt[0] = vSt[0] = ks[1] * ks[2], kSt[1] = vSt[1] = D, kSt[2] = vSt[2] = ks[2];
        vOff = Hkv * D;
        qBaseOff = mQueryView[0] * qs[2] + mQueryView[2];
        keyBaseOff = mKeyView[0] * ks[2] + mKeyView[2];
        outShape = {B, Sq, H * D};
    } else if (mKvPacked) {
        // query [B,Sq,H,D] (or [B,Sq,H*D] with num_heads); key [B,Sk,2,Hkv,D]: K and V of one projection; output
        // the query's shape
        auto const& ks = in[kKEY].shape;
        B = qs[0], Sq = qs[1];
        if (qs.size() == 3) {
            STOF_VALIDATE(qs[2] % mNumHeads == 0, "query shape ", shapeStr(qs), ": the last dim is not num_heads = ",
                          mNumHeads, " times the head dim");
            H = mNumHeads, D = qs[2] / mNumHeads;
        } else {
            H = qs[2], D = qs[3];
        }
        STOF_VALIDATE(ks[0] == B && ks[2] == 2 && ks[3] >= 1 && H % ks[3] == 0 && ks[4] == D, "packed key shape ",
                      shapeStr(ks), " is not [B,Sk,2,Hkv,D] for query ", shapeStr(qs),
                      " ([B,Sq,H,D], H a multiple of Hkv)");
        Sk = ks[1], Hkv = ks[3];
        qSt[0] = oSt[0] = Sq * H * D, qSt[1] = oSt[1] = D, qSt[2] = oSt[2] = H * D;
        kSt[0] = vSt[0] = Sk * 2 * Hkv * D, kSt[1] = vSt[1] = D, kSt[2] = vSt[2] = 2 * Hkv * D;
        vOff = Hkv * D;
        outShape = qs;
    } else {
        auto const& ks = in[kKEY].shape;
        B = qs[0], H = qs[1], Sq = qs[2], D = qs[3], Sk = ks[2], Hkv = ks[1];
        // K/V with fewer heads than Q: query head h reads K/V head h / (H / Hkv)
        STOF_VALIDATE(ks[0] == B && Hkv >= 1 && H % Hkv == 0 && ks[3] == D, "key shape ", shapeStr(ks),
                      " does not match query ", shapeStr(qs), " ([B,Hkv,Sk,D] vs [B,H,Sq,D], H a multiple of Hkv)");
        STOF_VALIDATE(in[kVALUE].shape == ks, "value shape ", shapeStr(in[kVALUE].shape), " != key shape ",
                      shapeStr(ks));
        qSt[0] = oSt[0] = H * Sq * D, qSt[1] = oSt[1] = Sq * D, qSt[2] = oSt[2] = D;
        kSt[0] = vSt[0] = Hkv * Sk * D, kSt[1] = vSt[1] = Sk * D, kSt[2] = vSt[2] = D;
        outShape = qs;
    }
    // above the compiled length a node with a layout_spec builds the layout for the run-time one
    bool const grow = !mLayoutSpec.empty() && (Sq > mSeqQ || Sk > mSeqK);
    STOF_VALIDATE(grow || (Sq <= mSeqQ && Sk <= mSeqK), "run-time Sq=", Sq, ", Sk=", Sk,
                  " exceed the compiled layout's seq_q=", mSeqQ, ", seq_k=", mSeqK);
    STOF_VALIDATE(B <= kMAX_GRID_YZ && H <= kMAX_GRID_YZ, "batch ", B, " or heads ", H, " above ", kMAX_GRID_YZ);
    STOF_VALIDATE(H % mNumLayouts == 0 || mNumLayouts == 1, "num_layouts ", mNumLayouts, " does not divide heads ",
                  H);
    // layout arrays (docs/format.md): their ranks here, their contents in stof_layout_create
    expectRank(in[kROW_PTR], 1, "row_ptr");
    expectRank(in[kCOL_IDX], 1, "col_idx");
    expectRank(in[kTILE_BITMAP_INDEX], 1, "tile_bitmap_index");
    expectRank(in[kBITMAPS], 2, "bitmaps");
    STOF_VALIDATE(in[kBITMAPS].shape[0] >= 1 && in[kBITMAPS].shape[1] == mTileM * mTileN / 32, "bitmaps shape ",
                  shapeStr(in[kBITMAPS].shape), ", expected [max(P,1), tile_m*tile_n/32 = ", mTileM * mTileN / 32,
                  "]");
    TensorArg const& kpm = in[kKEY_PADDING_MASK];
    if (kpm.present) {
        STOF_VALIDATE(kpm.shape.size() == 2 && kpm.shape[0] == B && kpm.shape[1] == Sk, "key_padding_mask shape ",
                      shapeStr(kpm.shape), ", expected [B, Sk] = [", B, ",", Sk, "]");
    }
    TensorArg const& bias = in[kATTN_BIAS];
    int64_t biasStride[4] = {0, 0, 0, 0};
    if (bias.present) {
        expectType(bias, mType, "attn_bias");
        STOF_VALIDATE(bias.shape.size() <= 4, "attn_bias has rank ", bias.shape.size(), " (at most 4)");
        int64_t const target[4] = {B, H, Sq, Sk};
        size_t const off = 4 - bias.shape.size();
        int64_t stride = 1;
        for (int d = 3; d >= 0; --d) {
            int64_t const size = d >= static_cast<int>(off) ? bias.shape[d - off] : 1;
            STOF_VALIDATE(size == 1 || size == target[d], "attn_bias shape ", shapeStr(bias.shape),
                          " is not broadcastable to [B,H,Sq,Sk] = ", shapeStr({B, H, Sq, Sk}));
            biasStride[d] = size == 1 ? 0 : stride;
            stride *= size;
        }
    }

    // rows another node computed (LongformerAttention's global rows), written over the output after the attention
    TensorArg const& rowValues = in[kROW_VALUES];
    TensorArg const& rowIndex = in[kROW_INDEX];
    STOF_VALIDATE(rowValues.present == rowIndex.present, "row_values and row_index go together");
    if (rowValues.present) {
        STOF_VALIDATE(!mTokens, "qkv_format 't3hd' takes no row_values");
        expectType(rowValues, mType, "row_values");
        STOF_VALIDATE(rowValues.shape.size() == 4 && rowValues.shape[0] == B && rowValues.shape[2] == H &&
                          rowValues.shape[3] == D && rowIndex.shape == std::vector<int64_t>({B, rowValues.shape[1]}),
                      "row_values shape ", shapeStr(rowValues.shape), " and row_index shape ",
                      shapeStr(rowIndex.shape), ": expected [B, R, H, D] = [", B, ", R, ", H, ", ", D, "] and [B, R]");
    }

    Ort::UnownedValue out = ctx.GetOutput(0, outShape);
    void* o = out.GetTensorMutableRawData();
    if (B == 0 || H == 0 || Sq == 0 || D == 0 || (mTokens && qs[0] == 0)) return;
    size_t const elemBytes = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
    auto writeRows = [&] {
        if (!rowValues.present) return;
        epiCheck(stof_rows_scatter_run(epiDType(mType), B, rowValues.shape[1], H, D, rowValues.data,
                                       static_cast<int32_t const*>(rowIndex.data), Sq, o, oSt[0], oSt[1], oSt[2],
                                       reinterpret_cast<stof_epi_stream_t>(stream)),
                 "stof_rows_scatter_run");
    };
    if (Sk == 0) {  // no key at all: every row outputs 0
        STOF_CUDA_THROW(cudaMemsetAsync(o, 0, static_cast<size_t>(B * H * Sq * D) * elemBytes, stream));
        writeRows();
        return;
    }
    STOF_VALIDATE(D <= kGENERIC_MAX_HEAD_DIM, "head dim ", D, " above ", kGENERIC_MAX_HEAD_DIM);

    // held until the kernel is enqueued
    std::shared_ptr<Layout const> const lay = grow ? grownLayout(Sq, Sk, stream) : layout(&in[kROW_PTR], stream);
    char const* const qBase = static_cast<char const*>(in[kQUERY].data);
    void const* const qData = qBase + qBaseOff * elemBytes;
    char const* const keyBase = static_cast<char const*>(in[kKEY].data) + keyBaseOff * elemBytes;
    void const* const kData = mPacked     ? static_cast<void const*>(qBase + kOff * elemBytes)
                              : mKvPacked ? static_cast<void const*>(keyBase)
                                          : in[kKEY].data;
    void const* const vData = mPacked     ? static_cast<void const*>(qBase + vOff * elemBytes)
                              : mKvPacked ? static_cast<void const*>(keyBase + vOff * elemBytes)
                                          : in[kVALUE].data;
    // the tensor-core kernels take 16-byte rows (element offsets and strides in multiples of 8); views that cut
    // them elsewhere run on the general kernel
    bool const rows16 = (qBaseOff | keyBaseOff | qSt[2] | kSt[2]) % 8 == 0;

    if (mType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && (D == 64 || D == 128) && !bias.present && rows16) {
        stof_attn_params_t p;
        stof_attn_params_init(&p);
        p.dtype = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? STOF_DTYPE_FP16 : STOF_DTYPE_BF16;
        p.batch = static_cast<int32_t>(B), p.num_heads = static_cast<int32_t>(H);
        p.seq_q = static_cast<int32_t>(Sq), p.seq_k = static_cast<int32_t>(Sk), p.head_dim = static_cast<int32_t>(D);
        p.scale = mScale;
        p.q = qData, p.k = kData, p.v = vData, p.o = o;
        p.q_stride_b = qSt[0], p.q_stride_h = qSt[1], p.q_stride_s = qSt[2];
        p.k_stride_b = kSt[0], p.k_stride_h = kSt[1], p.k_stride_s = kSt[2];
        p.v_stride_b = vSt[0], p.v_stride_h = vSt[1], p.v_stride_s = vSt[2];
        p.o_stride_b = oSt[0], p.o_stride_h = oSt[1], p.o_stride_s = oSt[2];
        p.kv_heads = static_cast<int32_t>(Hkv);
        p.layout = lay->handle;
        // t3hd: the mask's values are not used (the packing dropped the padded tokens)
        p.key_padding_mask = kpm.present && !mTokens ? static_cast<int32_t const*>(kpm.data) : nullptr;
        p.seq_offsets = mTokens ? static_cast<int32_t const*>(offsets.data) : nullptr;
        char const* env = std::getenv("STOF_ORT_PRESEARCH");
        uint32_t const flags = (env != nullptr && std::string(env) == "0" ? STOF_SELECT_NO_PRESEARCH : 0u) |
                               (mFirstUseTiming ? STOF_SELECT_TIME : 0u);
        int32_t tactic = 0, source = 0;
        stof_status_t s = stof_attn_select_on_stream(&p, mCachePath.empty() ? nullptr : mCachePath.c_str(), nullptr,
                                                     flags, reinterpret_cast<stof_stream_t>(stream), &tactic, &source);
        if (s == STOF_SUCCESS) {
            if (verboseEnabled()) {
                std::lock_guard<std::mutex> lock(mMutex);
                std::string const what = strCat("B", B, " Sq", Sq, " Sk", Sk, " -> ", sourceName(source), " ",
                                                 tactic, " (", stof_attn_tactic_name(tactic), ")");
                if (mReported.insert(what).second) std::fprintf(stderr, "[stof] %s: %s\n", mName.c_str(), what.c_str());
            }
            size_t wsBytes = 0;  // the persistent tactics' work counter; without it they run one CTA per work item
            STOF_LIB_THROW(stof_attn_workspace_size(&p, tactic, &wsBytes));
            ScopedScratch ws(ctx, wsBytes);
            p.workspace = ws.data();
            p.workspace_bytes = static_cast<int64_t>(ws.bytes());
            s = stof_attn_run(&p, tactic, reinterpret_cast<stof_stream_t>(stream));
        }
        if (s == STOF_SUCCESS) {
            writeRows();
            return;
        }
        // UNSUPPORTED by the tensor-core kernels: the general kernel below
        STOF_REQUIRE(s == STOF_ERROR_UNSUPPORTED, s == STOF_ERROR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL,
                     "stof kernels: ", stof_status_string(s), ": ", stof_last_error_message());
    }
    GenericAttnParams g;
    g.dtype = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16    ? AttnDType::kFP16
              : mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 ? AttnDType::kBF16
                                                                : AttnDType::kFP32;
    g.batch = static_cast<int32_t>(B), g.numHeads = static_cast<int32_t>(H), g.headDim = static_cast<int32_t>(D);
    g.kvGroup = static_cast<int32_t>(H / Hkv);
    g.seqQ = static_cast<int32_t>(Sq), g.seqK = static_cast<int32_t>(Sk), g.scale = mScale;
    g.q = qData, g.k = kData, g.v = vData, g.o = o;
    for (int d = 0; d < 3; ++d) g.qStride[d] = qSt[d], g.kStride[d] = kSt[d], g.vStride[d] = vSt[d], g.oStride[d] = oSt[d];
    // a grown layout's arrays are its own; else the node's inputs
    void const* const* arrays = grow ? lay->ptrs : nullptr;
    g.rowPtr = static_cast<int32_t const*>(grow ? arrays[0] : in[kROW_PTR].data);
    g.colIdx = static_cast<int32_t const*>(grow ? arrays[1] : in[kCOL_IDX].data);
    g.tileBitmapIndex = static_cast<int32_t const*>(grow ? arrays[2] : in[kTILE_BITMAP_INDEX].data);
    g.bitmaps = static_cast<int32_t const*>(grow ? arrays[3] : in[kBITMAPS].data);
    g.tileM = static_cast<int32_t>(mTileM), g.tileN = static_cast<int32_t>(mTileN);
    g.numLayouts = static_cast<int32_t>(mNumLayouts);
    g.layoutSeqQ = static_cast<int32_t>(grow ? lay->seqQ : mSeqQ);
    g.keyPaddingMask = kpm.present && !mTokens ? static_cast<int32_t const*>(kpm.data) : nullptr;
    g.seqOffsets = mTokens ? static_cast<int32_t const*>(offsets.data) : nullptr;
    g.bias = bias.present ? bias.data : nullptr;
    for (int d = 0; d < 4; ++d) g.biasStride[d] = biasStride[d];
    STOF_CUDA_THROW(launchGenericSparseAttention(g, stream));
    writeRows();
}

SparseAttentionOp::SparseAttentionOp(ONNXTensorElementDataType type, std::string cachePath, bool firstUseTiming)
    : mType(type), mCachePath(std::move(cachePath)), mFirstUseTiming(firstUseTiming) {
    OrtCustomOp::InferOutputShapeFn = [](OrtCustomOp const* op, OrtShapeInferContext* ctx) -> OrtStatusPtr {
        auto const type = static_cast<SparseAttentionOp const*>(op)->mType;
        // a view's output [B, Sq, H*D] is no input's shape: left to the kernel rather than inferred wrong
        if (hasAttr(ctx, "query_view")) return nullptr;
        // qkv_format "t3hd": query [T,3,H,D], output [T,H,D] (a rank-4 query is [B,H,S,D] otherwise)
        if (qkvFormatAttr(ctx) == "t3hd") return inferShapeFromInput(ctx, kQUERY, type, -1, 0, 1, 4, 1);
        // a rank-5 query is the packed [B,S,3,H,D] form: output [B,S,H,D]
        return inferShapeFromInput(ctx, kQUERY, type, -1, 0, 1, 5, 2);
    };
}

OrtStatusPtr SparseAttentionOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kSPARSE_ATTENTION_NAME,
                   [&] { *kernel = new SparseAttentionKernel(info, mType, mCachePath, mFirstUseTiming); });
}

ONNXTensorElementDataType SparseAttentionOp::GetInputType(size_t index) const {
    switch (index) {
    case kQUERY:
    case kKEY:
    case kVALUE:
    case kATTN_BIAS:
    case kROW_VALUES: return mType;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    }
}

OrtCustomOpInputOutputCharacteristic SparseAttentionOp::GetInputCharacteristic(size_t index) const {
    // key and value are absent in the packed forms (qkv_format "bs3hd", "t3hd"), value in "bshd_kv"; seq_offsets is
    // t3hd's; row_values / row_index are a Longformer rewrite's global rows
    return index >= kKEY_PADDING_MASK || index == kKEY || index == kVALUE
               ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
}

}  // namespace stof_ort
