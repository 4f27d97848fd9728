// Microbenchmark (session 26): does a MUFU.EX2 whose guard predicate is false for the whole warp still take its
// 8 cycles of the SM sub-partition's MUFU pipe?  If not, a consumer can skip the exps of a 64-key sub-block it has
// no tile in with predicated instructions (one basic block, the same schedule) instead of a branch.
//
// One CTA per SM (132), 256 threads (two warps per sub-partition), each thread looping over 32 independent
// FFMA + MUFU.EX2 pairs per iteration, guarded by a warp-uniform predicate from a kernel argument (on / off), or
// by a uniform branch around them.  Printed: SM cycles per iteration (mean over warps, clock64).
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/mbp plugins_cu/tools/mb_pred_mufu.cu && /tmp/mbp
//
// H100 (session 26, docs/bench/session26.md): predicated on 524.9, predicated off 523.1, branch on 566.5, branch
// off 21.4, empty loop 2.6 cycles per iteration.  A predicated-off MUFU op costs its full pipe time: skipping exps
// takes a branch.
#include <cstdio>
#include <cuda_runtime.h>

enum : int { kPred = 0, kBranch = 1, kNone = 2 };

template <int kMode>
__global__ void __launch_bounds__(256, 1) mb_kernel(float* out, long long* cyc, int iters, int on, float m) {
    float v[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = -0.01f * (threadIdx.x + i);
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        if constexpr (kMode == kPred) {
#pragma unroll
            for (int i = 0; i < 32; i += 8) {
                asm volatile(
                    "{\n .reg .pred q;\n setp.ne.s32 q, %8, 0;\n"
                    " @q fma.rn.ftz.f32 %0, %0, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %0, %0;\n"
                    " @q fma.rn.ftz.f32 %1, %1, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %1, %1;\n"
                    " @q fma.rn.ftz.f32 %2, %2, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %2, %2;\n"
                    " @q fma.rn.ftz.f32 %3, %3, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %3, %3;\n"
                    " @q fma.rn.ftz.f32 %4, %4, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %4, %4;\n"
                    " @q fma.rn.ftz.f32 %5, %5, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %5, %5;\n"
                    " @q fma.rn.ftz.f32 %6, %6, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %6, %6;\n"
                    " @q fma.rn.ftz.f32 %7, %7, 0f3F000000, %9;\n @q ex2.approx.ftz.f32 %7, %7;\n}\n"
                    : "+f"(v[i]), "+f"(v[i + 1]), "+f"(v[i + 2]), "+f"(v[i + 3]), "+f"(v[i + 4]), "+f"(v[i + 5]),
                      "+f"(v[i + 6]), "+f"(v[i + 7])
                    : "r"(on), "f"(m));
            }
        } else if constexpr (kMode == kBranch) {
            if (on) {
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    float y;
                    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(v[i], 0.5f, m)));
                    v[i] = y;
                }
            }
        }
        __syncwarp();
    }
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s += v[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if ((threadIdx.x & 31) == 0) cyc[blockIdx.x * 8 + threadIdx.x / 32] = t1 - t0;
}

template <int kMode>
static double run(int on, int iters) {
    float* out;
    long long* cyc;
    cudaMalloc(&out, 132 * 256 * sizeof(float));
    cudaMalloc(&cyc, 132 * 8 * sizeof(long long));
    mb_kernel<kMode><<<132, 256>>>(out, cyc, iters, on, -0.25f);  // warm-up
    mb_kernel<kMode><<<132, 256>>>(out, cyc, iters, on, -0.25f);
    static long long h[132 * 8];
    cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);
    cudaFree(out);
    cudaFree(cyc);
    double sum = 0;
    for (long long c : h) sum += static_cast<double>(c);
    return sum / (132 * 8) / iters;
}

int main() {
    const int iters = 4096;
    std::printf("SM cycles per iteration (32 FFMA + MUFU.EX2 per thread, 2 warps per sub-partition)\n");
    std::printf("  predicated, on   %8.1f\n", run<kPred>(1, iters));
    std::printf("  predicated, off  %8.1f\n", run<kPred>(0, iters));
    std::printf("  branch, on       %8.1f\n", run<kBranch>(1, iters));
    std::printf("  branch, off      %8.1f\n", run<kBranch>(0, iters));
    std::printf("  empty loop       %8.1f\n", run<kNone>(1, iters));
    const cudaError_t e = cudaDeviceSynchronize();
    std::printf("%s\n", e == cudaSuccess ? "ok" : cudaGetErrorString(e));
    return e == cudaSuccess ? 0 : 1;
}
