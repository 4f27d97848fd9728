// General sparse attention: one warp per query row, flash-style online softmax in fp32, walking only the
// non-empty tiles of the row's tile row (docs/format.md).
//
// Per 32-key chunk of a tile: lane j scores key j (q . k_j with q pre-scaled in shared memory), the warp takes
// the chunk max and the new running max m, rescales l and the accumulator, then accumulates p_j * v_j with each
// lane owning head-dim columns lane, lane+32, ... (coalesced V reads).  Masked keys (bitmap bit 0, tail,
// key padding, -inf bias) contribute exactly 0; a row with no allowed key writes 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "genericAttention.h"

namespace stof_ort {
namespace {

constexpr int kWARPS = 4;  // query rows per CTA
constexpr unsigned kFULL = 0xffffffffu;

__device__ __forceinline__ float toF(float v) { return v; }
__device__ __forceinline__ float toF(__half v) { return __half2float(v); }
__device__ __forceinline__ float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T fromF(float v);
template <>
__device__ __forceinline__ float fromF<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half fromF<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 fromF<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warpMax(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFULL, v, off));
    return v;
}
__device__ __forceinline__ float warpSum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFULL, v, off);
    return v;
}

template <typename T, int kCOLS>  // kCOLS = head-dim columns per lane = ceil(D / 32)
__global__ void __launch_bounds__(kWARPS * 32) genericSparseAttentionKernel(GenericAttnParams p) {
    __shared__ float sQ[kWARPS][kCOLS * 32];  // (kWARPS, D): scaled query rows
    int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int const qi = blockIdx.x * kWARPS + warp;
    int const h = blockIdx.y, b = blockIdx.z;
    // packed sequences: this batch's first row and its length bound the queries and keys
    int seqQ = p.seqQ, seqK = p.seqK;
    int64_t row0 = 0, bOff = b;
    if (p.seqOffsets) {
        row0 = p.seqOffsets[b];
        int const n = max(p.seqOffsets[b + 1] - p.seqOffsets[b], 0);
        seqQ = min(seqQ, n), seqK = min(seqK, n), bOff = 0;
    }
    if (qi >= seqQ) return;  // warp-uniform; no CTA-wide barrier below
    int const D = p.headDim;
    T const* gQ = static_cast<T const*>(p.q) + bOff * p.qStride[0] + h * p.qStride[1] + (row0 + qi) * p.qStride[2];
    int const hk = h / p.kvGroup;  // the K/V head
    // (Sk, D) rows kStride[2] / vStride[2]
    T const* gK = static_cast<T const*>(p.k) + bOff * p.kStride[0] + hk * p.kStride[1] + row0 * p.kStride[2];
    T const* gV = static_cast<T const*>(p.v) + bOff * p.vStride[0] + hk * p.vStride[1] + row0 * p.vStride[2];
    T* gO = static_cast<T*>(p.o) + bOff * p.oStride[0] + h * p.oStride[1] + (row0 + qi) * p.oStride[2];  // (D)
    T const* gBias = static_cast<T const*>(p.bias);
    int64_t const biasRow = gBias ? b * p.biasStride[0] + h * p.biasStride[1] + qi * p.biasStride[2] : 0;
    int32_t const* gPad = p.keyPaddingMask ? p.keyPaddingMask + static_cast<int64_t>(b) * p.seqK : nullptr;

    // Prologue: stage the scaled query row
    for (int d = lane; d < D; d += 32) sQ[warp][d] = toF(gQ[d]) * p.scale;
    __syncwarp();

    int const tilesQ = (p.layoutSeqQ + p.tileM - 1) / p.tileM;
    int const r = (h % p.numLayouts) * tilesQ + qi / p.tileM;
    int const a = qi % p.tileM;  // row inside the tile
    int const wordsPerRow = p.tileN / 32;
    int64_t const wordsPerTile = static_cast<int64_t>(p.tileM) * wordsPerRow;
    int const e0 = p.rowPtr[r], e1 = p.rowPtr[r + 1];

    float m = -INFINITY, l = 0.f;
    float acc[kCOLS];
#pragma unroll
    for (int c = 0; c < kCOLS; ++c) acc[c] = 0.f;

    // Main loop: non-empty tiles of this tile row, 32 keys at a time
    for (int e = e0; e < e1; ++e) {
        int const kStart = p.colIdx[e] * p.tileN;
        if (kStart >= seqK) break;  // col_idx ascends: the rest lie past the run-time Sk
        int const bm = p.tileBitmapIndex[e];
        for (int w = 0; w < wordsPerRow; ++w) {
            int const k0 = kStart + w * 32;
            if (k0 >= seqK) break;
            int const key = k0 + lane;
            bool allowed = key < seqK;
            if (bm >= 0) {
                uint32_t const word = static_cast<uint32_t>(p.bitmaps[bm * wordsPerTile + a * wordsPerRow + w]);
                allowed = allowed && ((word >> lane) & 1u);
            }
            if (allowed && gPad) allowed = gPad[key] != 0;
            float s = -INFINITY;
            if (allowed) {
                T const* kRow = gK + static_cast<int64_t>(key) * p.kStride[2];
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot += sQ[warp][d] * toF(kRow[d]);
                s = dot;
                if (gBias) s += toF(gBias[biasRow + key * p.biasStride[3]]);
            }
            float const chunkMax = warpMax(s);
            if (chunkMax == -INFINITY) continue;  // warp-uniform: nothing allowed in this chunk
            float const mNew = fmaxf(m, chunkMax);
            float const corr = (m == -INFINITY) ? 0.f : expf(m - mNew);
            float const prob = (s == -INFINITY) ? 0.f : expf(s - mNew);
            l = l * corr + warpSum(prob);
            m = mNew;
#pragma unroll
            for (int c = 0; c < kCOLS; ++c) acc[c] *= corr;
            for (int j = 0; j < 32; ++j) {
                float const pj = __shfl_sync(kFULL, prob, j);
                if (pj == 0.f) continue;  // warp-uniform (broadcast value)
                T const* vRow = gV + static_cast<int64_t>(k0 + j) * p.vStride[2];
#pragma unroll
                for (int c = 0; c < kCOLS; ++c) {
                    int const d = lane + 32 * c;
                    if (d < D) acc[c] += pj * toF(vRow[d]);
                }
            }
        }
    }

    // Epilogue: normalise (a row with no allowed key writes zeros)
    float const inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int c = 0; c < kCOLS; ++c) {
        int const d = lane + 32 * c;
        if (d < D) gO[d] = fromF<T>(acc[c] * inv);
    }
}

template <typename T, int kCOLS>
cudaError_t launchT(GenericAttnParams const& p, cudaStream_t stream) {
    dim3 grid((p.seqQ + kWARPS - 1) / kWARPS, p.numHeads, p.batch);
    genericSparseAttentionKernel<T, kCOLS><<<grid, kWARPS * 32, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchCols(GenericAttnParams const& p, cudaStream_t stream) {
    switch ((p.headDim + 31) / 32) {
    case 1: return launchT<T, 1>(p, stream);
    case 2: return launchT<T, 2>(p, stream);
    case 3: return launchT<T, 3>(p, stream);
    case 4: return launchT<T, 4>(p, stream);
    case 5: return launchT<T, 5>(p, stream);
    case 6: return launchT<T, 6>(p, stream);
    case 7: return launchT<T, 7>(p, stream);
    case 8: return launchT<T, 8>(p, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launchGenericSparseAttention(GenericAttnParams const& params, cudaStream_t stream) {
    GenericAttnParams p = params;
    if (p.kvGroup < 1 || p.numHeads % p.kvGroup != 0) return cudaErrorInvalidValue;
    auto contiguous = [&](int64_t* st, int64_t seq, int64_t heads) {
        if (st[0] == 0 && st[1] == 0 && st[2] == 0) {
            st[2] = p.headDim;
            st[1] = seq * p.headDim;
            st[0] = heads * st[1];
        }
    };
    contiguous(p.qStride, p.seqQ, p.numHeads);
    contiguous(p.kStride, p.seqK, p.numHeads / p.kvGroup);
    contiguous(p.vStride, p.seqK, p.numHeads / p.kvGroup);
    contiguous(p.oStride, p.seqQ, p.numHeads);
    if (p.headDim < 1 || p.headDim > kGENERIC_MAX_HEAD_DIM || p.batch < 1 || p.numHeads < 1 || p.seqQ < 1 ||
        p.seqK < 1 || p.batch > 65535 || p.numHeads > 65535)
        return cudaErrorInvalidValue;
    switch (p.dtype) {
    case AttnDType::kFP32: return launchCols<float>(p, stream);
    case AttnDType::kFP16: return launchCols<__half>(p, stream);
    case AttnDType::kBF16: return launchCols<__nv_bfloat16>(p, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace stof_ort
