// StofAddLayerNorm: Y = LayerNorm(X + bias + residual) * gamma + beta.  Three kernels by the rows' shape: one CTA
// per row with one 16-byte vector per thread (few rows of 16-byte vectors), one warp per row (more rows of at most
// 4 vectors per lane), one CTA per row over shared memory (any other row).
//
// The general kernel: the row sum s = x + bias + residual is kept in shared memory as fp32 (n <= kMaxN), so the
// mean and the variance are two exact passes over on-chip data (no E[x^2] - E[x]^2 cancellation) and global memory
// is read once and written once: the kernel is bandwidth-bound, like the Add + LayerNorm it replaces.
#include <cstdint>

#include "epilogueCommon.h"
#include "typeConvert.cuh"

namespace stof_epi {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxN = 12288;  // 48 KiB of fp32 shared memory, the default dynamic limit

__device__ __forceinline__ float blockSum(float v, float* sRed) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // sRed may still be read by a previous reduction
    if (lane == 0) sRed[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) total += sRed[w];
    return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) addLayerNormKernel(T const* __restrict__ x, T const* __restrict__ res,
                                                               T const* __restrict__ bias,
                                                               T const* __restrict__ gamma,
                                                               T const* __restrict__ beta, float eps,
                                                               T* __restrict__ y, T* __restrict__ sum, int n) {
    extern __shared__ float sRow[];  // (n)
    __shared__ float sRed[kThreads / 32];
    int64_t const base = static_cast<int64_t>(blockIdx.x) * n;
    // Prologue: s = x + bias + residual
    float localSum = 0.f;
    for (int i = threadIdx.x; i < n; i += kThreads) {
        float s = toFloat(x[base + i]);
        if (bias != nullptr) s += toFloat(bias[i]);
        s += toFloat(res[base + i]);
        if (sum != nullptr) {  // the pre-norm sum in the model's precision, as the graph would hold it
            T const st = fromFloat<T>(s);
            sum[base + i] = st;
            s = toFloat(st);
        }
        sRow[i] = s;
        localSum += s;
    }
    float const mean = blockSum(localSum, sRed) / n;
    float localVar = 0.f;
    for (int i = threadIdx.x; i < n; i += kThreads) {
        float d = sRow[i] - mean;
        localVar += d * d;
    }
    float const rstd = rsqrtf(blockSum(localVar, sRed) / n + eps);
    // Epilogue: normalise, scale, shift
    for (int i = threadIdx.x; i < n; i += kThreads) {
        y[base + i] = fromFloat<T>((sRow[i] - mean) * rstd * toFloat(gamma[i]) + toFloat(beta[i]));
    }
}

// Rows of at most 32 lanes x kMaxVecs 16-byte vectors (fp16/bf16: n <= 1024, fp32: n <= 512) with n a multiple
// of the vector width: one warp per row, the row in registers, warp-shuffle reductions (no shared memory, no
// __syncthreads), 16-byte loads and stores.  Same arithmetic as addLayerNormKernel (fp32 sum, two exact passes).
constexpr int kWarpRowsPerCta = 4;
constexpr int kMaxVecs = 4;

__device__ __forceinline__ float warpSum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename T>
struct Vec {
    static constexpr int kN = 16 / sizeof(T);
    union {
        uint4 raw;
        T v[16 / sizeof(T)];
    };
};

template <typename T, int kVecs>
__global__ void __launch_bounds__(32 * kWarpRowsPerCta) addLayerNormWarpKernel(
    T const* __restrict__ x, T const* __restrict__ res, T const* __restrict__ bias, T const* __restrict__ gamma,
    T const* __restrict__ beta, float eps, T* __restrict__ y, T* __restrict__ sum, int64_t rows, int n) {
    constexpr int V = Vec<T>::kN;
    int const lane = threadIdx.x % 32;
    int64_t const row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerCta + threadIdx.x / 32;
    if (row >= rows) return;
    int64_t const base = row * n;
    float s[kVecs][V];
    float localSum = 0.f;
    // gamma and beta are loaded with the row, not after the reductions: at small row counts the kernel is latency
    // bound and this takes one global-memory round trip off its critical path
    Vec<T> gv[kVecs], btv[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
        int const col = (j * 32 + lane) * V;
        if (col < n) {
            gv[j].raw = *reinterpret_cast<uint4 const*>(gamma + col);
            btv[j].raw = *reinterpret_cast<uint4 const*>(beta + col);
        }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
        int const col = (j * 32 + lane) * V;
        if (col < n) {
            Vec<T> xv, rv, bv;
            xv.raw = *reinterpret_cast<uint4 const*>(x + base + col);
            rv.raw = *reinterpret_cast<uint4 const*>(res + base + col);
            if (bias != nullptr) bv.raw = *reinterpret_cast<uint4 const*>(bias + col);
            Vec<T> sv;
#pragma unroll
            for (int e = 0; e < V; ++e) {
                float t = toFloat(xv.v[e]);
                if (bias != nullptr) t += toFloat(bv.v[e]);
                t += toFloat(rv.v[e]);
                if (sum != nullptr) {
                    sv.v[e] = fromFloat<T>(t);
                    t = toFloat(sv.v[e]);
                }
                s[j][e] = t;
                localSum += t;
            }
            if (sum != nullptr) *reinterpret_cast<uint4*>(sum + base + col) = sv.raw;
        }
    }
    float const mean = warpSum(localSum) / n;
    float localVar = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
        if ((j * 32 + lane) * V < n) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
                float const d = s[j][e] - mean;
                localVar += d * d;
            }
        }
    }
    float const rstd = rsqrtf(warpSum(localVar) / n + eps);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
        int const col = (j * 32 + lane) * V;
        if (col < n) {
            Vec<T> yv;
#pragma unroll
            for (int e = 0; e < V; ++e)
                yv.v[e] = fromFloat<T>((s[j][e] - mean) * rstd * toFloat(gv[j].v[e]) + toFloat(btv[j].v[e]));
            *reinterpret_cast<uint4*>(y + base + col) = yv.raw;
        }
    }
}

// Rows of at most kMaxVecThreads 16-byte vectors at few rows: one CTA per row and one vector per thread, so each
// thread's chain (loads, sums, normalisation) is a third of the warp-per-row kernel's at BERT widths, which is what
// a few hundred rows (a batch of one) wait for.  The mean and the sum of squared deviations come from one
// reduction: each thread's own mean and squared deviations over its V elements, combined pairwise (Chan et al.),
// the same two exact passes over the row as the other kernels but without a second round of shuffles and barriers.
constexpr int kMaxVecThreads = 1024;

struct MeanM2 {
    float n, mean, m2;
};

__device__ __forceinline__ MeanM2 combine(MeanM2 a, MeanM2 b) {
    float const n = a.n + b.n;
    if (n == 0.f) return a;
    float const d = b.mean - a.mean, w = b.n / n;
    return {n, a.mean + d * w, a.m2 + b.m2 + d * d * a.n * w};
}

__device__ __forceinline__ MeanM2 shuffleCombine(MeanM2 v, int off) {
    MeanM2 o;
    o.n = __shfl_xor_sync(0xffffffffu, v.n, off);
    o.mean = __shfl_xor_sync(0xffffffffu, v.mean, off);
    o.m2 = __shfl_xor_sync(0xffffffffu, v.m2, off);
    return combine(v, o);
}

template <typename T>
__global__ void __launch_bounds__(kMaxVecThreads) addLayerNormRowKernel(
    T const* __restrict__ x, T const* __restrict__ res, T const* __restrict__ bias, T const* __restrict__ gamma,
    T const* __restrict__ beta, float eps, T* __restrict__ y, T* __restrict__ sum, int n) {
    constexpr int V = Vec<T>::kN;
    __shared__ MeanM2 sPart[kMaxVecThreads / 32];
    int const t = threadIdx.x, lane = t % 32, warp = t / 32;
    int64_t const base = static_cast<int64_t>(blockIdx.x) * n;
    int const col = t * V;
    bool const on = col < n;
    float s[V];
    Vec<T> gv, btv;
    MeanM2 part{0.f, 0.f, 0.f};
    if (on) {
        Vec<T> xv, rv, bv;
        xv.raw = *reinterpret_cast<uint4 const*>(x + base + col);
        rv.raw = *reinterpret_cast<uint4 const*>(res + base + col);
        if (bias != nullptr) bv.raw = *reinterpret_cast<uint4 const*>(bias + col);
        gv.raw = *reinterpret_cast<uint4 const*>(gamma + col);
        btv.raw = *reinterpret_cast<uint4 const*>(beta + col);
        Vec<T> sv;
        float total = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) {
            float v = toFloat(xv.v[e]);
            if (bias != nullptr) v += toFloat(bv.v[e]);
            v += toFloat(rv.v[e]);
            if (sum != nullptr) {
                sv.v[e] = fromFloat<T>(v);
                v = toFloat(sv.v[e]);
            }
            s[e] = v;
            total += v;
        }
        if (sum != nullptr) *reinterpret_cast<uint4*>(sum + base + col) = sv.raw;
        float const mean = total / V;
        float m2 = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) m2 += (s[e] - mean) * (s[e] - mean);
        part = {static_cast<float>(V), mean, m2};
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) part = shuffleCombine(part, off);
    if (lane == 0) sPart[warp] = part;
    __syncthreads();
    MeanM2 row = sPart[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) row = combine(row, sPart[w]);
    if (!on) return;
    float const rstd = rsqrtf(row.m2 / n + eps);
    Vec<T> yv;
#pragma unroll
    for (int e = 0; e < V; ++e)
        yv.v[e] = fromFloat<T>((s[e] - row.mean) * rstd * toFloat(gv.v[e]) + toFloat(btv.v[e]));
    *reinterpret_cast<uint4*>(y + base + col) = yv.raw;
}

bool aligned16(void const* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, int kVecs>
void launchWarp(int64_t rows, int64_t n, void const* x, void const* res, void const* bias, void const* gamma,
                void const* beta, float eps, void* y, void* sum, cudaStream_t stream) {
    auto const grid = static_cast<unsigned>((rows + kWarpRowsPerCta - 1) / kWarpRowsPerCta);
    addLayerNormWarpKernel<T, kVecs><<<grid, 32 * kWarpRowsPerCta, 0, stream>>>(
        static_cast<T const*>(x), static_cast<T const*>(res), static_cast<T const*>(bias),
        static_cast<T const*>(gamma), static_cast<T const*>(beta), eps, static_cast<T*>(y), static_cast<T*>(sum),
        rows, static_cast<int>(n));
}

// One CTA per row while the rows' vectors fill at most about a wave of small CTAs (512 rows of BERT-base's 768):
// measured on an H200 in CUDA graphs, 3.5-12 % faster than the warp kernel at 128-512 rows of 768 and 7-13 %
// slower at 1024.
constexpr int64_t kRowCtaMaxVecs = 512 * 96;

template <typename T>
stof_epi_status_t launch(int64_t rows, int64_t n, void const* x, void const* res, void const* bias,
                         void const* gamma, void const* beta, float eps, void* y, void* sum, cudaStream_t stream) {
    STOF_EPI_CHECK(rows <= 0x7fffffff, STOF_EPI_ERROR_UNSUPPORTED, "too many rows (%lld)",
                   static_cast<long long>(rows));
    constexpr int V = Vec<T>::kN;
    int64_t const vecs = (n + 32 * V - 1) / (32 * V);
    bool const vec16 = n % V == 0 && aligned16(x) && aligned16(res) && aligned16(bias) && aligned16(gamma) &&
                       aligned16(beta) && aligned16(y) && aligned16(sum);
    if (vec16 && n / V <= kMaxVecThreads && rows * (n / V) <= kRowCtaMaxVecs) {
        unsigned const threads = static_cast<unsigned>((n / V + 31) / 32 * 32);
        addLayerNormRowKernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
            static_cast<T const*>(x), static_cast<T const*>(res), static_cast<T const*>(bias),
            static_cast<T const*>(gamma), static_cast<T const*>(beta), eps, static_cast<T*>(y), static_cast<T*>(sum),
            static_cast<int>(n));
        STOF_EPI_CUDA(cudaGetLastError());
        return STOF_EPI_SUCCESS;
    }
    if (vec16 && vecs <= kMaxVecs) {
        switch (vecs) {
        case 1: launchWarp<T, 1>(rows, n, x, res, bias, gamma, beta, eps, y, sum, stream); break;
        case 2: launchWarp<T, 2>(rows, n, x, res, bias, gamma, beta, eps, y, sum, stream); break;
        case 3: launchWarp<T, 3>(rows, n, x, res, bias, gamma, beta, eps, y, sum, stream); break;
        default: launchWarp<T, 4>(rows, n, x, res, bias, gamma, beta, eps, y, sum, stream); break;
        }
        STOF_EPI_CUDA(cudaGetLastError());
        return STOF_EPI_SUCCESS;
    }
    addLayerNormKernel<T><<<static_cast<unsigned>(rows), kThreads, static_cast<size_t>(n) * sizeof(float), stream>>>(
        static_cast<T const*>(x), static_cast<T const*>(res), static_cast<T const*>(bias),
        static_cast<T const*>(gamma), static_cast<T const*>(beta), eps, static_cast<T*>(y), static_cast<T*>(sum), static_cast<int>(n));
    STOF_EPI_CUDA(cudaGetLastError());
    return STOF_EPI_SUCCESS;
}

}  // namespace
}  // namespace stof_epi

extern "C" int64_t stof_add_layernorm_max_n(void) { return stof_epi::kMaxN; }

extern "C" stof_epi_status_t stof_add_layernorm_run(int32_t dtype, int64_t rows, int64_t n, const void* x,
                                                    const void* residual, const void* bias, const void* gamma,
                                                    const void* beta, float epsilon, void* y, void* sum,
                                                    stof_epi_stream_t stream) {
    using namespace stof_epi;
    STOF_EPI_CHECK(x != nullptr && residual != nullptr && gamma != nullptr && beta != nullptr && y != nullptr,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "null tensor pointer");
    STOF_EPI_CHECK(rows > 0 && n > 0, STOF_EPI_ERROR_INVALID_ARGUMENT, "sizes must be positive");
    STOF_EPI_CHECK(n <= kMaxN, STOF_EPI_ERROR_UNSUPPORTED, "LayerNorm row of %lld elements (max %lld)",
                   static_cast<long long>(n), static_cast<long long>(kMaxN));
    STOF_EPI_CHECK(epsilon >= 0.f, STOF_EPI_ERROR_INVALID_ARGUMENT, "negative epsilon");
    auto cs = reinterpret_cast<cudaStream_t>(stream);
    switch (dtype) {
    case STOF_EPI_FP32: return launch<float>(rows, n, x, residual, bias, gamma, beta, epsilon, y, sum, cs);
    case STOF_EPI_FP16: return launch<__half>(rows, n, x, residual, bias, gamma, beta, epsilon, y, sum, cs);
    case STOF_EPI_BF16: return launch<__nv_bfloat16>(rows, n, x, residual, bias, gamma, beta, epsilon, y, sum, cs);
    }
    STOF_EPI_CHECK(false, STOF_EPI_ERROR_INVALID_ARGUMENT, "unknown dtype %d", dtype);
}
