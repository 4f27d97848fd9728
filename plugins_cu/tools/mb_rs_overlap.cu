// Microbenchmark (session 23): what runs at the same time as a wgmma on an SM?  Inside one warpgroup, does the
// warps' own softmax-like work overlap their MMAs, and does it matter whether A comes from registers (RS, tactic
// 24's P V) or from shared memory (SS)?  Across two warpgroups, does one's work slow the other's MMAs?
//
// One CTA per SM (132), 1 or 2 warpgroups, each looping as tactic 24's consumers do: [a small SS wgmma "S", then
// 8 x wgmma m64n64k16 (RS or SS: "P V"), two commit groups] [wait for S] [64 exp2 (FFMA + MUFU) that depend on S,
// or 64 FFMA + FMNMX + FMUL] [wait for P V] (kLate: that wait at the next iteration's start); kHetero: warpgroup 0
// only the MMAs, warpgroup 1 only the work.  Printed: SM cycles per loop iteration (mean over warps, clock64).
// Results (H100): docs/bench/session23.md, calls 3-4.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -I plugins_cu/src -o /tmp/mb plugins_cu/tools/mb_rs_overlap.cu && /tmp/mb
#include <cstdio>
#include <cuda_runtime.h>

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma_ops.cuh"

using namespace stof;

enum : int { kMma = 1, kRS = 2, kWork = 4, kAlu = 8, kLate = 16, kHetero = 32 };

template <int kFlags>
__device__ __forceinline__ void mb_body(float* out, long long* cyc, int iters);

// kHetero: warpgroup 0 runs only the MMAs of kFlags, warpgroup 1 only the work: can one warpgroup's softmax run
// while the other's MMAs occupy the tensor cores (what FlashAttention-3's ping-pong relies on)?
template <int kFlags>
__global__ void __launch_bounds__(256, 1) mb_kernel(float* out, long long* cyc, int iters) {
    if constexpr (kFlags & kHetero) {
        if (threadIdx.x < 128)
            mb_body<kFlags & (kMma | kRS)>(out, cyc, iters);
        else
            mb_body<kFlags & (kWork | kAlu)>(out, cyc, iters);
    } else {
        mb_body<kFlags>(out, cyc, iters);
    }
}

template <int kFlags>
__device__ __forceinline__ void mb_body(float* out, long long* cyc, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t s0 = (smem_u32(smem) + 1023u) & ~1023u;
    for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(smem + (s0 - smem_u32(smem)))[i] = 0x3c003c00u * ((i & 7) == 0);  // 1.0 pairs
    asm volatile("bar.sync 15, %0;\n" ::"r"(static_cast<int>(blockDim.x)) : "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t sA = s0, sB = s0 + 16384;
    const uint64_t dA = gmma_desc(sA, 16, 1024), dB = gmma_desc(sB, 64 * 128, 1024);
    uint32_t rA[8][4];
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) rA[k][j] = 0x3c003c00u ^ ((threadIdx.x + k + j) & 1);
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    float x[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) x[i] = -0.01f * (i + (threadIdx.x & 7));
    const long long t0 = clock64();
    float sc[32];  // a small "S" MMA the work depends on (as the softmax depends on S), so it follows its wait
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.f;
    for (int it = 0; it < iters; ++it) {
        if constexpr (kFlags & kMma) {
            if constexpr (kFlags & kLate) {
                wgmma_wait<0>();  // the previous iteration's P V
                fence_regs(acc);
            }
            wgmma_fence();
            wgmma_ss<64, __half>(sc, dA, dB, 0);
            wgmma_commit();
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if constexpr (kFlags & kRS)
                    wgmma_rs<64, __half>(acc, rA[k], dB + ((k * 16 * 128) >> 4), 1);
                else
                    wgmma_ss<64, __half>(acc, dA + (((k >> 2) * 8192 + (k & 3) * 32) >> 4),
                                         dB + ((k * 16 * 128) >> 4), 1);
            }
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(sc);
        }
        if constexpr (kFlags & kWork) {
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                const float t = fmaf(sc[i & 31], 1e-20f, x[i]);
                if constexpr (kFlags & kAlu)
                    x[i] = fmaxf(fmaf(t, 0.999f, -0.001f), x[(i + 1) & 63] * 0.5f);
                else
                    x[i] = fast_exp2(fmaf(t, 0.999f, -0.5f));
            }
        }
        // ptxas hoists a wgmma wait above independent work (here after ~12 of the 64 exps; tactic 24's P V wait
        // sits before its exps that way).  kLate: the P V is waited for only at the next iteration's start, across
        // the loop's back edge, so the work really runs while it is in flight.
        if constexpr ((kFlags & kMma) && !(kFlags & kLate)) {
            wgmma_wait<0>();
            fence_regs(acc);
        }
    }
    if constexpr ((kFlags & kMma) && (kFlags & kLate)) {
        wgmma_wait<0>();
        fence_regs(acc);
    }
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s += acc[i] + sc[i];
#pragma unroll
    for (int i = 0; i < 64; ++i) s += x[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if ((threadIdx.x & 31) == 0) cyc[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t1 - t0;
#endif
}

template <int kFlags>
static void run(const char* name, int wgs, int iters, float* out, long long* cyc, long long* h) {
    auto k = mb_kernel<kFlags>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536 + 1024);
    const int threads = 128 * wgs, blocks = 132;
    k<<<blocks, threads, 65536 + 1024>>>(out, cyc, iters);  // warm-up
    k<<<blocks, threads, 65536 + 1024>>>(out, cyc, iters);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        printf("%s: %s\n", name, cudaGetErrorString(e));
        return;
    }
    const int n = blocks * threads / 32;
    cudaMemcpy(h, cyc, n * sizeof(long long), cudaMemcpyDeviceToHost);
    double sum = 0, wg0 = 0, wg1 = 0;
    for (int i = 0; i < n; ++i) {
        sum += static_cast<double>(h[i]);
        ((i % (threads / 32)) < 4 ? wg0 : wg1) += static_cast<double>(h[i]);
    }
    if (kFlags & kHetero)
        printf("%-34s %d WG  MMA warpgroup %8.1f, work warpgroup %8.1f cycles / iteration\n", name, wgs,
               wg0 / (n / 2) / iters, wg1 / (n / 2) / iters);
    else
        printf("%-34s %d WG  %8.1f cycles / iteration\n", name, wgs, sum / n / iters);
}

int main() {
    float* out;
    long long* cyc;
    cudaMalloc(&out, 132 * 256 * sizeof(float));
    cudaMalloc(&cyc, 132 * 8 * sizeof(long long));
    static long long h[132 * 8];
    const int iters = 4000;
    for (int wgs = 1; wgs <= 2; ++wgs) {
        run<kMma | kRS>("MMA RS (A from registers)", wgs, iters, out, cyc, h);
        run<kMma>("MMA SS (A from shared memory)", wgs, iters, out, cyc, h);
        run<kWork>("64 exp2 (FFMA + MUFU)", wgs, iters, out, cyc, h);
        run<kMma | kRS | kWork>("MMA RS + 64 exp2", wgs, iters, out, cyc, h);
        run<kMma | kWork>("MMA SS + 64 exp2", wgs, iters, out, cyc, h);
        run<kMma | kRS | kWork | kLate>("MMA RS + 64 exp2, P V wait late", wgs, iters, out, cyc, h);
        run<kMma | kWork | kLate>("MMA SS + 64 exp2, P V wait late", wgs, iters, out, cyc, h);
        run<kWork | kAlu>("64 FFMA + FMNMX + FMUL", wgs, iters, out, cyc, h);
        run<kMma | kRS | kWork | kAlu>("MMA RS + 64 FFMA + FMNMX + FMUL", wgs, iters, out, cyc, h);
        run<kMma | kWork | kAlu>("MMA SS + 64 FFMA + FMNMX + FMUL", wgs, iters, out, cyc, h);
        run<kMma | kRS | kWork | kAlu | kLate>("MMA RS + ALU work, wait late", wgs, iters, out, cyc, h);
        run<kMma | kWork | kAlu | kLate>("MMA SS + ALU work, wait late", wgs, iters, out, cyc, h);
    }
    run<kHetero | kMma | kRS | kWork>("hetero: RS MMAs | 64 exp2", 2, iters, out, cyc, h);
    run<kHetero | kMma | kWork>("hetero: SS MMAs | 64 exp2", 2, iters, out, cyc, h);
    run<kHetero | kMma | kRS | kWork | kAlu>("hetero: RS MMAs | ALU work", 2, iters, out, cyc, h);
    run<kHetero | kMma | kWork | kAlu>("hetero: SS MMAs | ALU work", 2, iters, out, cyc, h);
    return 0;
}
