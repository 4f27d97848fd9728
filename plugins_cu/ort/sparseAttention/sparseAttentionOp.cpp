// StofSparseAttention kernel for ONNX Runtime's CUDA EP.  Validates every input (ORT error status, never a
// crash), checks the tile-layout arrays once on the host (bounds the kernels rely on), picks a tactic from the
// tactic cache, and runs libstof_kernels' stof_attn_run or the general kernel.
#include "sparseAttentionOp.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "../common/sha1.h"
#include "genericAttention.h"
#include "stof/stof_attention.h"

namespace stof_ort {
namespace {

constexpr int64_t kMAX_DIM = std::numeric_limits<int32_t>::max();
constexpr int64_t kMAX_GRID_YZ = 65535;
constexpr int64_t kFORMAT_VERSION = STOF_FORMAT_VERSION;

#define STOF_CUDA_THROW(call)                                                                                \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        STOF_REQUIRE(e_ == cudaSuccess, ORT_RUNTIME_EXCEPTION, #call, ": ", cudaGetErrorString(e_));         \
    } while (0)

int64_t intAttr(Ort::ConstKernelInfo const& ki, char const* name) {
    try {
        return ki.GetAttribute<int64_t>(name);
    } catch (Ort::Exception const&) {
        throw StofOrtError(ORT_INVALID_ARGUMENT, strCat("missing INT attribute '", name, "'"));
    }
}

AttnDType attnType(ONNXTensorElementDataType t) {
    switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return AttnDType::kFP16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return AttnDType::kBF16;
    default: return AttnDType::kFP32;
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// SparseAttentionKernel
// ---------------------------------------------------------------------------------------------------------------
SparseAttentionKernel::SparseAttentionKernel(OrtKernelInfo const* info, ONNXTensorElementDataType type,
                                             std::shared_ptr<TacticCache const> cache)
    : mType(type), mCache(std::move(cache)) {
    Ort::ConstKernelInfo ki(info);
    mName = ki.GetNodeName();
    try {
        mScale = ki.GetAttribute<float>("scale");
    } catch (Ort::Exception const&) {
        throw StofOrtError(ORT_INVALID_ARGUMENT, "missing FLOAT attribute 'scale'");
    }
    mTileM = intAttr(ki, "tile_m");
    mTileN = intAttr(ki, "tile_n");
    mSeqQ = intAttr(ki, "seq_q");
    mSeqK = intAttr(ki, "seq_k");
    mNumLayouts = intAttr(ki, "num_layouts");
    int64_t const version = intAttr(ki, "format_version");
    try {
        mMaskSpec = ki.GetAttribute<std::string>("mask_spec");
    } catch (Ort::Exception const&) {
        mMaskSpec.clear();
    }
    std::string qkvFormat = "bhsd";
    try {
        qkvFormat = ki.GetAttribute<std::string>("qkv_format");
    } catch (Ort::Exception const&) {
        qkvFormat = "bhsd";
    }
    STOF_VALIDATE(qkvFormat == "bhsd" || qkvFormat == "bs3hd", "qkv_format '", qkvFormat,
                  "' (must be 'bhsd' or 'bs3hd')");
    mPacked = qkvFormat == "bs3hd";
    // version 1 (one bitmap per PARTIAL tile) is version 2 without shared bitmaps: read both
    STOF_VALIDATE(version >= 1 && version <= kFORMAT_VERSION, "format_version ", version,
                  " (this plugin reads 1 to ", kFORMAT_VERSION, ")");
    STOF_VALIDATE(std::isfinite(mScale), "scale is not finite");
    STOF_VALIDATE(mTileM >= 16 && mTileM <= 256 && mTileM % 16 == 0, "tile_m ", mTileM,
                  " (must be a multiple of 16 in [16, 256])");
    STOF_VALIDATE(mTileN >= 32 && mTileN <= 256 && mTileN % 32 == 0, "tile_n ", mTileN,
                  " (must be a multiple of 32 in [32, 256])");
    STOF_VALIDATE(mSeqQ >= 1 && mSeqQ <= kMAX_DIM && mSeqK >= 1 && mSeqK <= kMAX_DIM, "bad seq_q/seq_k ", mSeqQ,
                  "/", mSeqK);
    STOF_VALIDATE(mNumLayouts >= 1 && mNumLayouts <= 65535, "bad num_layouts ", mNumLayouts);
    bool allConstant = true;
    for (size_t i = kROW_PTR; i <= kBITMAPS; ++i) {
        int isConstant = 0;
        ki.GetTensorConstantInput(i, &isConstant);
        allConstant = allConstant && isConstant != 0;
    }
    mLayoutConstant = allConstant;
}

OrtStatusPtr SparseAttentionKernel::ComputeV2(OrtKernelContext* context) {
    return guarded(kSPARSE_ATTENTION_NAME, [&] {
        Ort::KernelContext ctx(context);
        try {
            compute(ctx);
        } catch (StofOrtError const& e) {
            throw StofOrtError(e.code(), strCat("node '", mName, "': ", e.what()));
        }
    });
}

SparseAttentionKernel::LayoutCheck::~LayoutCheck() {
    // cudaFree waits for the device's pending work, so a kernel still reading the buffer finishes first; a
    // destructor reports nothing (an error here would belong to an earlier asynchronous launch)
    if (rowOrderDevice != nullptr) static_cast<void>(cudaFree(rowOrderDevice));
}

std::shared_ptr<SparseAttentionKernel::LayoutCheck const> SparseAttentionKernel::checkLayout(TensorArg const* arrays,
                                                                                             cudaStream_t stream) {
    // caller holds mMutex
    if (mChecked && mLayoutConstant) {
        bool same = true;
        for (int i = 0; i < 4; ++i)
            same = same && mChecked->ptrs[i] == arrays[i].data && mChecked->sizes[i] == numel(arrays[i].shape);
        if (same) return mChecked;
    }
    auto check = std::make_shared<LayoutCheck>();
    auto& host = check->host;
    for (int i = 0; i < 4; ++i) {
        check->ptrs[i] = arrays[i].data;
        check->sizes[i] = numel(arrays[i].shape);
        host[i].resize(static_cast<size_t>(check->sizes[i]));
        STOF_CUDA_THROW(cudaMemcpyAsync(host[i].data(), arrays[i].data, host[i].size() * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, stream));
    }
    STOF_CUDA_THROW(cudaStreamSynchronize(stream));
    auto const& rowPtr = host[0];
    auto const& colIdx = host[1];
    auto const& tbi = host[2];
    int64_t const tilesK = (mSeqK + mTileN - 1) / mTileN;
    int64_t const nbBitmaps = arrays[3].shape[0];
    STOF_VALIDATE(rowPtr[0] == 0, "row_ptr[0] = ", rowPtr[0], " (must be 0)");
    int64_t const nnz = rowPtr.back();
    STOF_VALIDATE(nnz >= 0 && nnz <= static_cast<int64_t>(colIdx.size()), "row_ptr[-1] = ", nnz,
                  " but col_idx has ", colIdx.size(), " entries");
    for (size_t r = 0; r + 1 < rowPtr.size(); ++r) {
        STOF_VALIDATE(rowPtr[r] <= rowPtr[r + 1], "row_ptr decreases at ", r);
        for (int64_t e = rowPtr[r]; e < rowPtr[r + 1]; ++e) {
            STOF_VALIDATE(colIdx[e] >= 0 && colIdx[e] < tilesK, "col_idx[", e, "] = ", colIdx[e], " outside [0, ",
                          tilesK, ")");
            STOF_VALIDATE(e == rowPtr[r] || colIdx[e] > colIdx[e - 1], "col_idx not strictly ascending in tile row ",
                          r);
            STOF_VALIDATE(tbi[e] >= -1 && tbi[e] < nbBitmaps, "tile_bitmap_index[", e, "] = ", tbi[e],
                          " outside [-1, ", nbBitmaps, ")");
        }
    }
    Sha1 sha;
    int64_t const header[6] = {kFORMAT_VERSION, mSeqQ, mSeqK, mTileM, mTileN, mNumLayouts};
    sha.update(header, sizeof(header));
    for (auto const& h : host) sha.update(h.data(), h.size() * sizeof(int32_t));
    check->signature = sha.hexDigest();
    // the schedule of the tensor-core kernels (C ABI v2 row_order): computed and uploaded once per checked layout
    int64_t const tilesQ = (mSeqQ + mTileM - 1) / mTileM;
    int64_t const nRows = mNumLayouts * tilesQ;
    STOF_VALIDATE(static_cast<int64_t>(rowPtr.size()) == nRows + 1 && nRows <= kMAX_DIM, "row_ptr has ",
                  rowPtr.size(), " entries, expected num_layouts*ceil(seq_q/tile_m)+1 = ", nRows + 1);
    // and the pair order of the kernels whose work item covers two tile rows (ABI v4), after it in the same buffer
    int64_t const nPairs = mNumLayouts * ((tilesQ + 1) / 2);
    check->pairOrderOffset = nRows;
    // and the lane bitmaps (ABI v5), for the tile shapes that have them (tile_m % 16, tile_n % 64 == 0)
    int64_t const bitmapWords = mTileM * mTileN / 32;  // (the bitmaps' shape is checked with the inputs)
    bool const laneShape = mTileM % 16 == 0 && mTileN % 64 == 0 && nbBitmaps >= 1;
    check->laneOffset = nRows + nPairs;
    check->laneCount = laneShape ? 2 * nbBitmaps * bitmapWords : 0;
    check->rowOrderHost.resize(static_cast<size_t>(nRows + nPairs + check->laneCount));
    stof_status_t const ro = stof_layout_row_order(rowPtr.data(), static_cast<int32_t>(mNumLayouts),
                                                   static_cast<int32_t>(tilesQ), check->rowOrderHost.data());
    STOF_REQUIRE(ro == STOF_SUCCESS, ORT_FAIL, "stof_layout_row_order: ", stof_status_string(ro), ": ",
                 stof_last_error_message());
    stof_status_t const po = stof_layout_pair_order(rowPtr.data(), static_cast<int32_t>(mNumLayouts),
                                                    static_cast<int32_t>(tilesQ),
                                                    check->rowOrderHost.data() + check->pairOrderOffset);
    STOF_REQUIRE(po == STOF_SUCCESS, ORT_FAIL, "stof_layout_pair_order: ", stof_status_string(po), ": ",
                 stof_last_error_message());
    if (check->laneCount > 0) {
        stof_status_t const lb = stof_layout_lane_bitmaps(host[3].data(), static_cast<int32_t>(nbBitmaps),
                                                          static_cast<int32_t>(mTileM), static_cast<int32_t>(mTileN),
                                                          check->rowOrderHost.data() + check->laneOffset);
        STOF_REQUIRE(lb == STOF_SUCCESS, ORT_FAIL, "stof_layout_lane_bitmaps: ", stof_status_string(lb), ": ",
                     stof_last_error_message());
    }
    auto lastFirst = [&](int64_t off, int64_t n) {
        for (int64_t l = 0; l < mNumLayouts; ++l)
            for (int64_t i = 0; i < n; ++i)
                if (check->rowOrderHost[static_cast<size_t>(off + l * n + i)] != n - 1 - i) return false;
        return true;
    };
    check->rowOrderDefault = lastFirst(0, tilesQ);
    check->pairOrderDefault = lastFirst(check->pairOrderOffset, (tilesQ + 1) / 2);
    // and its (batch, head) interleaving (C ABI v2 sched_chunk), from the same host row_ptr
    stof_status_t const sc = stof_layout_sched_chunk(rowPtr.data(), static_cast<int32_t>(mNumLayouts),
                                                     static_cast<int32_t>(tilesQ), &check->schedChunk);
    STOF_REQUIRE(sc == STOF_SUCCESS, ORT_FAIL, "stof_layout_sched_chunk: ", stof_status_string(sc), ": ",
                 stof_last_error_message());
    // The device copy only for constant layouts (made once, kept with the cached check): for a layout fed at run
    // time it would cost an allocation, a synchronising copy and a free per call, for a scheduling hint --
    // row_order, pair_order and lane_bitmaps stay NULL there (the kernels' reversed order, their own packing),
    // sched_chunk still applies.
    if (mLayoutConstant) {
        size_t const roBytes = check->rowOrderHost.size() * sizeof(int32_t);
        void* roDevice = nullptr;
        STOF_CUDA_THROW(cudaMalloc(&roDevice, roBytes));
        check->rowOrderDevice = static_cast<int32_t*>(roDevice);  // owned from here on (freed if a check below throws)
        STOF_CUDA_THROW(cudaMemcpyAsync(check->rowOrderDevice, check->rowOrderHost.data(), roBytes,
                                        cudaMemcpyHostToDevice, stream));
        // complete before any stream (another thread's, for a cached constant layout) reads it
        STOF_CUDA_THROW(cudaStreamSynchronize(stream));
    }
    mChecked = std::move(check);
    return mChecked;
}

int32_t SparseAttentionKernel::presearchTactic(stof_attn_params_t const& p, std::string const& maskSig,
                                               std::string const& memoKey) {
    std::lock_guard<std::mutex> lock(mMutex);
    auto it = mPresearchMemo.find(memoKey);
    if (it != mPresearchMemo.end()) return it->second;
    int32_t choice = 0;
    char const* env = std::getenv("STOF_ORT_PRESEARCH");
    bool const enabled = env == nullptr || std::string(env) != "0";
    // the host copy of the layout this call checked (another thread may have replaced a non-constant one)
    if (enabled && mChecked && mChecked->signature == maskSig) {
        LayoutCheck const& layout = *mChecked;
        if (!mHavePresearchGpu) {
            int dev = 0;
            STOF_CUDA_THROW(cudaGetDevice(&dev));
            STOF_REQUIRE(stof_presearch_gpu_props(dev, &mPresearchGpu) == STOF_SUCCESS, ORT_FAIL,
                         "stof_presearch_gpu_props failed");
            mHavePresearchGpu = true;
        }
        stof_host_layout_t hl{};
        hl.row_ptr = layout.host[0].data();
        hl.col_idx = layout.host[1].data();
        hl.tile_bitmap_index = layout.host[2].data();
        hl.bitmaps = layout.host[3].data();
        hl.num_bitmaps = static_cast<int32_t>(layout.host[3].size() / static_cast<size_t>(mTileM * mTileN / 32));
        hl.tile_m = static_cast<int32_t>(mTileM), hl.tile_n = static_cast<int32_t>(mTileN);
        hl.num_layouts = static_cast<int32_t>(mNumLayouts);
        hl.layout_seq_q = static_cast<int32_t>(mSeqQ), hl.layout_seq_k = static_cast<int32_t>(mSeqK);
        int32_t ranked[64], n = 0, nValid = 0, valid[64];
        stof_status_t const s = stof_presearch_rank(&mPresearchGpu, &hl, p.batch, p.num_heads, p.head_dim, p.seq_q,
                                                    p.seq_k, ranked, nullptr, 64, &n);
        stof_status_t const v = stof_attn_list_tactics(&p, valid, 64, &nValid);
        if ((s == STOF_SUCCESS || s == STOF_ERROR_INSUFFICIENT_BUFFER) &&
            (v == STOF_SUCCESS || v == STOF_ERROR_INSUFFICIENT_BUFFER)) {
            for (int32_t i = 0; i < std::min<int32_t>(n, 64) && choice == 0; ++i)
                for (int32_t j = 0; j < std::min<int32_t>(nValid, 64); ++j)
                    if (valid[j] == ranked[i]) {
                        choice = ranked[i];
                        break;
                    }
        }
    }
    if (verboseEnabled()) {
        std::fprintf(stderr, "[stof] %s: no tactic-cache entry for %s -> %s %d\n", mName.c_str(), memoKey.c_str(),
                     choice ? "pre-search first choice" : "library default", choice);
    }
    mPresearchMemo[memoKey] = choice;
    return choice;
}

int32_t SparseAttentionKernel::chooseTactic(std::string const& nodeSig, std::string const& bucket,
                                            std::string const& mask, bool* fromCache) {
    // caller holds mMutex
    std::string const memoKey = bucket + "|" + mask;
    auto it = mTacticMemo.find(memoKey);
    if (it != mTacticMemo.end()) {
        *fromCache = it->second != 0;
        return it->second;
    }
    if (mGpuName.empty()) {
        int dev = 0;
        cudaDeviceProp prop{};
        STOF_CUDA_THROW(cudaGetDevice(&dev));
        STOF_CUDA_THROW(cudaGetDeviceProperties(&prop, dev));
        mGpuName = prop.name;
        mGpuCc = strCat(prop.major, ".", prop.minor);
    }
    int32_t tactic = mCache ? mCache->lookup(mGpuName, mGpuCc, nodeSig, bucket, mask) : 0;
    *fromCache = tactic != 0;
    if (verboseEnabled() && tactic != 0) {
        std::fprintf(stderr, "[stof] %s: %s %s mask %.12s -> tactic %d (%s)\n", mName.c_str(), nodeSig.c_str(),
                     bucket.c_str(), mask.c_str(), tactic, tactic ? "tactic cache" : "library default");
    }
    mTacticMemo[memoKey] = tactic;
    return tactic;
}

void SparseAttentionKernel::compute(Ort::KernelContext& ctx) {
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    TensorArg in[kSA_NUM_INPUTS];
    for (size_t i = 0; i < kSA_NUM_INPUTS; ++i) in[i] = getInput(ctx, i);
    static char const* kNames[kSA_NUM_INPUTS] = {"query", "key", "value", "row_ptr", "col_idx",
                                                 "tile_bitmap_index", "bitmaps", "key_padding_mask", "attn_bias"};
    for (size_t i = 0; i <= kBITMAPS; ++i) {
        if (mPacked && (i == kKEY || i == kVALUE)) {
            STOF_VALIDATE(!in[i].present, "qkv_format 'bs3hd' reads K and V from the packed query: input '",
                          kNames[i], "' must be absent");
            continue;
        }
        STOF_VALIDATE(in[i].present, "missing input '", kNames[i], "'");
    }
    for (size_t i : {kQUERY, kKEY, kVALUE}) {
        if (mPacked && i != kQUERY) continue;
        expectType(in[i], mType, kNames[i]);
        expectRank(in[i], mPacked ? 5 : 4, kNames[i]);
    }
    for (size_t i = kROW_PTR; i <= kKEY_PADDING_MASK; ++i)
        if (in[i].present) expectType(in[i], ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, kNames[i]);
    auto const& qs = in[kQUERY].shape;
    int64_t B, H, Sq, D, Sk;
    // element strides (batch, head, sequence) of q, k, v and o, and the K / V offsets in the query tensor
    int64_t qSt[3], kSt[3], vSt[3], oSt[3], kOff = 0, vOff = 0;
    std::vector<int64_t> outShape;
    if (mPacked) {
        STOF_VALIDATE(qs[2] == 3, "packed query shape ", shapeStr(qs), " is not [B,S,3,H,D]");
        B = qs[0], Sq = Sk = qs[1], H = qs[3], D = qs[4];
        int64_t const row = 3 * H * D;
        qSt[0] = kSt[0] = vSt[0] = Sq * row;
        qSt[1] = kSt[1] = vSt[1] = D;
        qSt[2] = kSt[2] = vSt[2] = row;
        kOff = H * D;
        vOff = 2 * H * D;
        oSt[0] = Sq * H * D, oSt[1] = D, oSt[2] = H * D;
        outShape = {B, Sq, H, D};
    } else {
        auto const& ks = in[kKEY].shape;
        B = qs[0], H = qs[1], Sq = qs[2], D = qs[3], Sk = ks[2];
        STOF_VALIDATE(ks[0] == B && ks[1] == H && ks[3] == D, "key shape ", shapeStr(ks), " does not match query ",
                      shapeStr(qs), " ([B,H,Sk,D] vs [B,H,Sq,D])");
        STOF_VALIDATE(in[kVALUE].shape == ks, "value shape ", shapeStr(in[kVALUE].shape), " != key shape ",
                      shapeStr(ks));
        qSt[0] = oSt[0] = H * Sq * D, qSt[1] = oSt[1] = Sq * D, qSt[2] = oSt[2] = D;
        kSt[0] = vSt[0] = H * Sk * D, kSt[1] = vSt[1] = Sk * D, kSt[2] = vSt[2] = D;
        outShape = qs;
    }
    STOF_VALIDATE(Sq <= mSeqQ && Sk <= mSeqK, "run-time Sq=", Sq, ", Sk=", Sk,
                  " exceed the compiled layout's seq_q=", mSeqQ, ", seq_k=", mSeqK);
    STOF_VALIDATE(B <= kMAX_GRID_YZ && H <= kMAX_GRID_YZ, "batch ", B, " or heads ", H, " above ", kMAX_GRID_YZ);
    STOF_VALIDATE(H % mNumLayouts == 0 || mNumLayouts == 1, "num_layouts ", mNumLayouts, " does not divide heads ",
                  H);
    // layout arrays (docs/format.md)
    int64_t const tilesQ = (mSeqQ + mTileM - 1) / mTileM;
    expectRank(in[kROW_PTR], 1, "row_ptr");
    STOF_VALIDATE(in[kROW_PTR].shape[0] == mNumLayouts * tilesQ + 1, "row_ptr has ", in[kROW_PTR].shape[0],
                  " entries, expected num_layouts*ceil(seq_q/tile_m)+1 = ", mNumLayouts * tilesQ + 1);
    expectRank(in[kCOL_IDX], 1, "col_idx");
    expectRank(in[kTILE_BITMAP_INDEX], 1, "tile_bitmap_index");
    STOF_VALIDATE(in[kCOL_IDX].shape[0] >= 1 && in[kTILE_BITMAP_INDEX].shape == in[kCOL_IDX].shape,
                  "col_idx ", shapeStr(in[kCOL_IDX].shape), " and tile_bitmap_index ",
                  shapeStr(in[kTILE_BITMAP_INDEX].shape), " must be equal non-empty vectors");
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

    Ort::UnownedValue out = ctx.GetOutput(0, outShape);
    void* o = out.GetTensorMutableRawData();
    if (B == 0 || H == 0 || Sq == 0 || D == 0) return;
    size_t const elemBytes = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
    if (Sk == 0) {  // no key at all: every row outputs 0
        STOF_CUDA_THROW(cudaMemsetAsync(o, 0, static_cast<size_t>(B * H * Sq * D) * elemBytes, stream));
        return;
    }
    STOF_VALIDATE(D <= kGENERIC_MAX_HEAD_DIM, "head dim ", D, " above ", kGENERIC_MAX_HEAD_DIM);

    std::string maskSig;
    std::shared_ptr<LayoutCheck const> layout;  // held until the kernel is enqueued (its device row order)
    int32_t tactic = 0;
    bool fromCache = false;
    size_t const elem = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
    char const* const qBase = static_cast<char const*>(in[kQUERY].data);
    void const* const kData = mPacked ? static_cast<void const*>(qBase + kOff * elem) : in[kKEY].data;
    void const* const vData = mPacked ? static_cast<void const*>(qBase + vOff * elem) : in[kVALUE].data;
    std::string const nodeSig = strCat(kSPARSE_ATTENTION_NAME, "|", typeName(mType), "|H", H, "|D", D, "|tile",
                                       mTileM, "x", mTileN, "|L", mNumLayouts, "|seq", mSeqQ, "x", mSeqK, "|kpm",
                                       kpm.present ? 1 : 0);
    {
        std::lock_guard<std::mutex> lock(mMutex);
        layout = checkLayout(&in[kROW_PTR], stream);
        maskSig = layout->signature;
        tactic = chooseTactic(nodeSig, shapeBucket(B, Sq, Sk), maskSig, &fromCache);
    }

    bool const tensorCore = mType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && (D == 64 || D == 128) && !bias.present;
    if (tensorCore) {
        stof_attn_params_t p;
        stof_attn_params_init(&p);
        p.dtype = mType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? STOF_DTYPE_FP16 : STOF_DTYPE_BF16;
        p.batch = static_cast<int32_t>(B);
        p.num_heads = static_cast<int32_t>(H);
        p.seq_q = static_cast<int32_t>(Sq);
        p.seq_k = static_cast<int32_t>(Sk);
        p.head_dim = static_cast<int32_t>(D);
        p.scale = mScale;
        p.q = in[kQUERY].data;
        p.k = kData;
        p.v = vData;
        p.o = o;
        p.q_stride_b = qSt[0], p.q_stride_h = qSt[1], p.q_stride_s = qSt[2];
        p.k_stride_b = kSt[0], p.k_stride_h = kSt[1], p.k_stride_s = kSt[2];
        p.v_stride_b = vSt[0], p.v_stride_h = vSt[1], p.v_stride_s = vSt[2];
        p.o_stride_b = oSt[0], p.o_stride_h = oSt[1], p.o_stride_s = oSt[2];
        p.row_ptr = static_cast<int32_t const*>(in[kROW_PTR].data);
        p.col_idx = static_cast<int32_t const*>(in[kCOL_IDX].data);
        p.tile_bitmap_index = static_cast<int32_t const*>(in[kTILE_BITMAP_INDEX].data);
        p.bitmaps = static_cast<int32_t const*>(in[kBITMAPS].data);
        // their row count (ABI v6): the wgmma tactics' 32-bit bitmap offsets are bounded by it, not by the whole
        // tile grid, which refused them on long sequences
        p.num_bitmaps = in[kBITMAPS].shape[0] <= std::numeric_limits<int32_t>::max()
                            ? static_cast<int32_t>(in[kBITMAPS].shape[0])
                            : 0;
        p.tile_m = static_cast<int32_t>(mTileM);
        p.tile_n = static_cast<int32_t>(mTileN);
        p.num_layouts = static_cast<int32_t>(mNumLayouts);
        p.layout_seq_q = static_cast<int32_t>(mSeqQ);
        p.layout_seq_k = static_cast<int32_t>(mSeqK);
        p.key_padding_mask = kpm.present ? static_cast<int32_t const*>(kpm.data) : nullptr;
        // tile rows longest first (ABI v2) and pairs of them (v4), uploaded with the layout check; not passed where
        // they are the kernels' own order
        if (layout->rowOrderDevice != nullptr) {
            p.row_order = layout->rowOrderDefault ? nullptr : layout->rowOrderDevice;
            p.pair_order = layout->pairOrderDefault ? nullptr : layout->rowOrderDevice + layout->pairOrderOffset;
            // the bitmaps in the kernels' thread order (ABI v5; same result without them)
            if (layout->laneCount > 0) p.lane_bitmaps = layout->rowOrderDevice + layout->laneOffset;
        }
        p.sched_chunk = layout->schedChunk;    // (batch, head) interleaving (ABI v2), computed with the layout check
        if (!fromCache) {  // no tactic-cache entry: the pre-search's first choice (memoised per shape bucket)
            // the layout check stays valid while the layout inputs are constant (it is re-made otherwise)
            tactic = presearchTactic(p, maskSig, shapeBucket(B, Sq, Sk) + "|" + maskSig);
        }
        // the work counter of the persistent (warp-specialised) tactics, ABI v3; without it they run one CTA
        // per work item
        size_t wsBytes = 0;  // tactic 0: the most any tactic uses (also covers the retry with tactic 0 below)
        if (stof_attn_workspace_size(&p, 0, &wsBytes) != STOF_SUCCESS) wsBytes = 0;
        ScopedScratch ws(ctx, wsBytes);
        p.workspace = ws.data();
        p.workspace_bytes = static_cast<int64_t>(ws.bytes());
        stof_status_t s = stof_attn_run(&p, tactic, reinterpret_cast<stof_stream_t>(stream));
        if (s == STOF_ERROR_INVALID_TACTIC && tactic != 0) {  // a stale cache entry or pre-search pick: the library's
            if (verboseEnabled())
                std::fprintf(stderr, "[stof] %s: %s tactic %d invalid here (%s); using the library default\n",
                             mName.c_str(), fromCache ? "cached" : "pre-search", tactic, stof_last_error_message());
            s = stof_attn_run(&p, 0, reinterpret_cast<stof_stream_t>(stream));
        }
        if (s == STOF_SUCCESS) return;
        STOF_REQUIRE(s == STOF_ERROR_UNSUPPORTED, s == STOF_ERROR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL,
                     "stof_attn_run: ", stof_status_string(s), ": ", stof_last_error_message());
        // UNSUPPORTED by the tensor-core kernels: fall through to the general kernel
    }
    GenericAttnParams g;
    g.dtype = attnType(mType);
    g.batch = static_cast<int32_t>(B);
    g.numHeads = static_cast<int32_t>(H);
    g.seqQ = static_cast<int32_t>(Sq);
    g.seqK = static_cast<int32_t>(Sk);
    g.headDim = static_cast<int32_t>(D);
    g.scale = mScale;
    g.q = in[kQUERY].data;
    g.k = kData;
    g.v = vData;
    g.o = o;
    for (int d = 0; d < 3; ++d) g.qStride[d] = qSt[d], g.kStride[d] = kSt[d], g.vStride[d] = vSt[d], g.oStride[d] = oSt[d];
    g.rowPtr = static_cast<int32_t const*>(in[kROW_PTR].data);
    g.colIdx = static_cast<int32_t const*>(in[kCOL_IDX].data);
    g.tileBitmapIndex = static_cast<int32_t const*>(in[kTILE_BITMAP_INDEX].data);
    g.bitmaps = static_cast<int32_t const*>(in[kBITMAPS].data);
    g.tileM = static_cast<int32_t>(mTileM);
    g.tileN = static_cast<int32_t>(mTileN);
    g.numLayouts = static_cast<int32_t>(mNumLayouts);
    g.layoutSeqQ = static_cast<int32_t>(mSeqQ);
    g.keyPaddingMask = kpm.present ? static_cast<int32_t const*>(kpm.data) : nullptr;
    g.bias = bias.present ? bias.data : nullptr;
    for (int d = 0; d < 4; ++d) g.biasStride[d] = biasStride[d];
    STOF_CUDA_THROW(launchGenericSparseAttention(g, stream));
}

// ---------------------------------------------------------------------------------------------------------------
// SparseAttentionOp
// ---------------------------------------------------------------------------------------------------------------
SparseAttentionOp::SparseAttentionOp(ONNXTensorElementDataType type, std::shared_ptr<TacticCache const> cache)
    : mType(type), mCache(std::move(cache)) {
    OrtCustomOp::InferOutputShapeFn = [](OrtCustomOp const* op, OrtShapeInferContext* ctx) -> OrtStatusPtr {
        // a rank-5 query is the packed [B,S,3,H,D] form: output [B,S,H,D]
        return inferShapeFromInput(ctx, kQUERY, static_cast<SparseAttentionOp const*>(op)->mType, -1, 0, 1, 5, 2);
    };
}

OrtStatusPtr SparseAttentionOp::CreateKernelV2(OrtApi const&, OrtKernelInfo const* info, void** kernel) const {
    return guarded(kSPARSE_ATTENTION_NAME, [&] { *kernel = new SparseAttentionKernel(info, mType, mCache); });
}

ONNXTensorElementDataType SparseAttentionOp::GetInputType(size_t index) const {
    switch (index) {
    case kQUERY:
    case kKEY:
    case kVALUE:
    case kATTN_BIAS: return mType;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    }
}

OrtCustomOpInputOutputCharacteristic SparseAttentionOp::GetInputCharacteristic(size_t index) const {
    // key and value are absent in the packed form (qkv_format "bs3hd")
    return index >= kKEY_PADDING_MASK || index == kKEY || index == kVALUE
               ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
}

}  // namespace stof_ort
