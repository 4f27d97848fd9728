// StofGemmEpilogue on cuBLASLt: Y = act(X . W + bias), row-major, with the bias (and tanh-GELU) fused into the
// GEMM's epilogue; exact (erf) GELU runs as one extra element-wise pass (activationKernels.cu).
//
// Row-major Y[M,N] = X[M,K] . W[K,N] is column-major Y^T[N,M] = W^T[N,K] . X^T[K,M]: cuBLASLt's A is W
// (N x K, ld N), B is X (K x M, ld K), C = D is Y (N x M, ld N), no transposes; the bias runs along C's rows (N).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "epilogueCommon.h"

namespace stof_epi {
cudaError_t launchGeluErfInPlace(int32_t dtype, void* y, int64_t count, cudaStream_t stream);
cudaError_t launchHold(int64_t nanoseconds, cudaStream_t stream);  // holdStream.cu
}  // namespace stof_epi

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's advice for Hopper
constexpr int kMaxHeuristics = 16;               // heuristic results asked for; `algo` indexes them

#define STOF_EPI_CUBLAS(call)                                                                                 \
    do {                                                                                                     \
        cublasStatus_t s_ = (call);                                                                          \
        STOF_EPI_CHECK(s_ == CUBLAS_STATUS_SUCCESS, STOF_EPI_ERROR_CUBLAS, "%s: cuBLAS status %d", #call,   \
                       static_cast<int>(s_));                                                                \
    } while (0)

// dtype, M (bucketed when batch == 1), N, K, activation, bias, alignment, workspace, algo, batch, Y's batch stride
using PlanKey =
    std::tuple<int32_t, int64_t, int64_t, int64_t, int32_t, bool, uint32_t, size_t, int32_t, int64_t, int64_t>;

// Plans are per row-count bucket, not per M: with padding removal M is the batch's real token count, new on almost
// every call, and a heuristic query per call costs more than the GEMM.  A plan's algorithm comes from the bucket's
// upper end; each call sets its layouts to the actual M.
int64_t rowBucket(int64_t m) {
    if (m <= 128) return m;
    int64_t octave = 128;
    while (octave * 2 <= m) octave *= 2;
    const int64_t step = octave / 8;  // eight buckets per octave: the algorithm fits within 12.5 % of M
    return (m + step - 1) / step * step;
}

struct Plan {
    cublasLtMatmulDesc_t mOp{nullptr};
    cublasLtMatrixLayout_t mA{nullptr}, mB{nullptr}, mC{nullptr};
    cublasLtMatmulAlgo_t mAlgo{};
    std::vector<cublasLtMatmulAlgo_t> mCandidates;  // STOF_GEMM_ALGO_TIMED: the heuristic's first results
    bool mTimed{true};                               // false until the candidates are timed
    int64_t mRows{0};  // the M the layouts describe now
    ~Plan() {
        if (mA) cublasLtMatrixLayoutDestroy(mA);
        if (mB) cublasLtMatrixLayoutDestroy(mB);
        if (mC) cublasLtMatrixLayoutDestroy(mC);
        if (mOp) cublasLtMatmulDescDestroy(mOp);
    }
};

uint32_t alignmentOf(uintptr_t v) {
    uint32_t a = 256;
    while (a > 1 && (v % a) != 0) a >>= 1;
    return a;
}

}  // namespace

struct stof_gemm_context {
    cublasLtHandle_t mHandle{nullptr};
    std::mutex mMutex;
    std::map<PlanKey, std::unique_ptr<Plan>> mPlans;
    cudaEvent_t mStart{nullptr}, mStop{nullptr};  // created on the first timing
    cudaStream_t mCaptureStream{nullptr};          // the timing's graph captures (created on the first timing)
};

namespace {

stof_epi_status_t buildPlan(stof_gemm_context* ctx, PlanKey const& key, Plan& plan) {
    auto [dtype, m, n, k, act, hasBias, align, wsBytes, algo, batch, yStride] = key;
    cudaDataType_t dt = dtype == STOF_EPI_FP32 ? CUDA_R_32F : dtype == STOF_EPI_FP16 ? CUDA_R_16F : CUDA_R_16BF;
    STOF_EPI_CUBLAS(cublasLtMatmulDescCreate(&plan.mOp, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t opN = CUBLAS_OP_N;
    STOF_EPI_CUBLAS(cublasLtMatmulDescSetAttribute(plan.mOp, CUBLASLT_MATMUL_DESC_TRANSA, &opN, sizeof(opN)));
    STOF_EPI_CUBLAS(cublasLtMatmulDescSetAttribute(plan.mOp, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    if (act == STOF_ACT_GELU_TANH) {
        epi = hasBias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    } else if (hasBias) {
        epi = CUBLASLT_EPILOGUE_BIAS;
    }
    STOF_EPI_CUBLAS(cublasLtMatmulDescSetAttribute(plan.mOp, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    if (hasBias) {
        STOF_EPI_CUBLAS(
            cublasLtMatmulDescSetAttribute(plan.mOp, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &dt, sizeof(dt)));
    }
    STOF_EPI_CUBLAS(cublasLtMatrixLayoutCreate(&plan.mA, dt, n, k, n));
    STOF_EPI_CUBLAS(cublasLtMatrixLayoutCreate(&plan.mB, dt, k, m, k));
    STOF_EPI_CUBLAS(cublasLtMatrixLayoutCreate(&plan.mC, dt, n, m, n));
    if (batch > 1) {  // W broadcast (stride 0), X contiguous, Y at its batch stride; the bias is broadcast too
        const int32_t count = static_cast<int32_t>(batch);
        const int64_t strides[3] = {0, m * k, yStride};
        cublasLtMatrixLayout_t layouts[3] = {plan.mA, plan.mB, plan.mC};
        for (int i = 0; i < 3; ++i) {
            STOF_EPI_CUBLAS(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                             sizeof(count)));
            STOF_EPI_CUBLAS(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                             &strides[i], sizeof(strides[i])));
        }
    }

    cublasLtMatmulPreference_t pref = nullptr;
    STOF_EPI_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> prefGuard(
        pref, cublasLtMatmulPreferenceDestroy);
    STOF_EPI_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsBytes,
                                                         sizeof(wsBytes)));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        STOF_EPI_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    }
    cublasLtMatmulHeuristicResult_t results[kMaxHeuristics] = {};
    int found = 0;
    STOF_EPI_CUBLAS(cublasLtMatmulAlgoGetHeuristic(ctx->mHandle, plan.mOp, plan.mA, plan.mB, plan.mC, plan.mC, pref,
                                                   kMaxHeuristics, results, &found));
    STOF_EPI_CHECK(found > 0, STOF_EPI_ERROR_CUBLAS,
                   "cuBLASLt found no algorithm for GEMM M=%lld N=%lld K=%lld dtype %d epilogue %d",
                   static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), dtype,
                   static_cast<int>(epi));
    // an index past the heuristic's list (it varies with the shape) runs the first result, like -1
    plan.mAlgo = results[algo >= 0 && algo < found ? algo : 0].algo;
    if (algo == STOF_GEMM_ALGO_TIMED) {
        for (int i = 0; i < std::min(found, STOF_GEMM_TIMED_CANDIDATES); ++i) plan.mCandidates.push_back(results[i].algo);
        plan.mTimed = plan.mCandidates.size() < 2;
    }
    plan.mRows = m;
    return STOF_EPI_SUCCESS;
}

}  // namespace

extern "C" stof_epi_status_t stof_gemm_context_create(stof_gemm_context_t* out) {
    try {
        STOF_EPI_CHECK(out != nullptr, STOF_EPI_ERROR_INVALID_ARGUMENT, "ctx is NULL");
        auto ctx = std::make_unique<stof_gemm_context>();
        STOF_EPI_CUBLAS(cublasLtCreate(&ctx->mHandle));
        *out = ctx.release();
        return STOF_EPI_SUCCESS;
    } catch (std::exception const& e) {
        stof_epi::setLastError(e.what());
    } catch (...) {
        stof_epi::setLastError("unknown exception");
    }
    return STOF_EPI_ERROR_CUBLAS;
}

extern "C" void stof_gemm_context_destroy(stof_gemm_context_t ctx) {
    if (ctx == nullptr) return;
    try {
        ctx->mPlans.clear();
        if (ctx->mStart) cudaEventDestroy(ctx->mStart);
        if (ctx->mStop) cudaEventDestroy(ctx->mStop);
        if (ctx->mCaptureStream) cudaStreamDestroy(ctx->mCaptureStream);
        if (ctx->mHandle) cublasLtDestroy(ctx->mHandle);
        delete ctx;
    } catch (...) {
    }
}

extern "C" int32_t stof_gemm_available(void) { return 1; }

extern "C" size_t stof_gemm_workspace_size(void) { return kWorkspaceBytes; }

extern "C" stof_epi_status_t stof_gemm_epilogue_run(stof_gemm_context_t ctx, int32_t dtype, int64_t m, int64_t n,
                                                    int64_t k, const void* x, const void* w, const void* bias,
                                                    int32_t activation, void* y, void* workspace,
                                                    size_t workspaceBytes, stof_epi_stream_t stream) {
    return stof_gemm_epilogue_run_algo(ctx, dtype, m, n, k, x, w, bias, activation, -1, y, workspace, workspaceBytes,
                                       stream);
}

namespace {

// Y rows of batch i at y + i * yStride elements; batch == 1 is the plain row-major GEMM.
stof_epi_status_t runGemm(stof_gemm_context_t ctx, int32_t dtype, int64_t batch, int64_t m, int64_t n, int64_t k,
                          const void* x, const void* w, const void* bias, int32_t activation, int32_t algo, void* y,
                          int64_t yStride, void* workspace, size_t workspaceBytes, stof_epi_stream_t stream) {
    try {
        STOF_EPI_CHECK(ctx != nullptr && x != nullptr && w != nullptr && y != nullptr,
                       STOF_EPI_ERROR_INVALID_ARGUMENT, "null context or tensor pointer");
        STOF_EPI_CHECK(dtype == STOF_EPI_FP32 || dtype == STOF_EPI_FP16 || dtype == STOF_EPI_BF16,
                       STOF_EPI_ERROR_INVALID_ARGUMENT, "unknown dtype %d", dtype);
        STOF_EPI_CHECK(activation >= STOF_ACT_NONE && activation <= STOF_ACT_GELU_TANH,
                       STOF_EPI_ERROR_INVALID_ARGUMENT, "unknown activation %d", activation);
        STOF_EPI_CHECK(m > 0 && n > 0 && k > 0, STOF_EPI_ERROR_INVALID_ARGUMENT, "GEMM sizes must be positive");
        STOF_EPI_CHECK(algo >= -1 || algo == STOF_GEMM_ALGO_TIMED, STOF_EPI_ERROR_INVALID_ARGUMENT,
                       "algo must be >= -1 or STOF_GEMM_ALGO_TIMED, got %d", algo);
        STOF_EPI_CHECK(workspace != nullptr || workspaceBytes == 0, STOF_EPI_ERROR_INVALID_ARGUMENT,
                       "workspace NULL with %zu bytes", workspaceBytes);
        STOF_EPI_CHECK(batch >= 1 && yStride >= m * n, STOF_EPI_ERROR_INVALID_ARGUMENT,
                       "batch %lld, Y batch stride %lld: expected batch >= 1 and a stride >= M*N",
                       static_cast<long long>(batch), static_cast<long long>(yStride));
        const uintptr_t elem = dtype == STOF_EPI_FP32 ? 4 : 2;
        uint32_t align = alignmentOf(reinterpret_cast<uintptr_t>(x));
        for (void const* p : {static_cast<void const*>(w), static_cast<void const*>(y), bias}) {
            if (p != nullptr) align = std::min(align, alignmentOf(reinterpret_cast<uintptr_t>(p)));
        }
        if (batch > 1) {  // every batch's X and Y start at these strides from the first
            align = std::min(align, alignmentOf(static_cast<uintptr_t>(m * k) * elem));
            align = std::min(align, alignmentOf(static_cast<uintptr_t>(yStride) * elem));
        }
        // a batched plan's strides follow M, so it keeps its exact M; yStride is in the key for batch > 1 only
        PlanKey key{dtype, batch > 1 ? m : rowBucket(m), n, k, activation, bias != nullptr, align, workspaceBytes,
                    algo == -1 ? 0 : algo, batch, batch > 1 ? yStride : 0};
        std::lock_guard<std::mutex> lock(ctx->mMutex);
        // the context's plan of a key, built on first use
        auto planOf = [&](PlanKey const& pk, Plan*& out) -> stof_epi_status_t {
            auto found = ctx->mPlans.find(pk);
            if (found == ctx->mPlans.end()) {
                auto plan = std::make_unique<Plan>();
                stof_epi_status_t s = buildPlan(ctx, pk, *plan);
                if (s != STOF_EPI_SUCCESS) return s;
                found = ctx->mPlans.emplace(pk, std::move(plan)).first;
            }
            out = found->second.get();
            return STOF_EPI_SUCCESS;
        };
        Plan* bucketPlan = nullptr;
        if (stof_epi_status_t s = planOf(key, bucketPlan); s != STOF_EPI_SUCCESS) return s;
        float const alpha = 1.f, beta = 0.f;
        auto cs = reinterpret_cast<cudaStream_t>(stream);
        // a failed attribute call's status, else cublasLtMatmul's (checked below, after the exact-M fallback)
        auto run = [&](Plan& plan, cudaStream_t on) -> cublasStatus_t {
            if (plan.mRows != m) {  // B = X^T is K x M, C = Y^T is N x M
                const uint64_t cols = static_cast<uint64_t>(m);
                for (cublasLtMatrixLayout_t l : {plan.mB, plan.mC}) {
                    const cublasStatus_t a =
                        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols));
                    if (a != CUBLAS_STATUS_SUCCESS) return a;
                }
                plan.mRows = m;
            }
            if (bias != nullptr) {
                const cublasStatus_t a = cublasLtMatmulDescSetAttribute(plan.mOp, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                        &bias, sizeof(bias));
                if (a != CUBLAS_STATUS_SUCCESS) return a;
            }
            return cublasLtMatmul(ctx->mHandle, plan.mOp, &alpha, w, plan.mA, x, plan.mB, &beta, y, plan.mC, y,
                                  plan.mC, &plan.mAlgo, workspace, workspaceBytes, on);
        };
        // STOF_GEMM_ALGO_TIMED: each candidate once to warm up (and to see that it takes this M), then kTimedRuns
        // runs as one CUDA graph (captured on the context's own stream, never launched there) queued behind a hold
        // kernel on the call's stream, so that the events time the GPU's work: at small M a GEMM takes a few
        // microseconds, about what the host spends launching it.  In a graph an algorithm that clears part of its
        // workspace first pays that memset node's dependency (about 4 us on an H200, twice a small GEMM) which
        // back-to-back stream launches hide, so graphs are compared with graphs: a candidate that cannot be
        // captured competes (timed on the stream) only when none can.  The fastest stays the plan's algorithm.
        // Not while the call's stream captures a CUDA graph.
        constexpr int kTimedRuns = 10;
        constexpr int64_t kHoldNs = 400 * 1000;  // well above kTimedRuns host launches
        using GraphExec = std::unique_ptr<CUgraphExec_st, decltype(&cudaGraphExecDestroy)>;
        auto captured = [&](Plan& plan) -> GraphExec {
            GraphExec none(nullptr, cudaGraphExecDestroy);
            if (cudaStreamBeginCapture(ctx->mCaptureStream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
                cudaGetLastError();  // a failed capture is this candidate's, not the call's
                return none;
            }
            bool ok = true;
            for (int r = 0; r < kTimedRuns && ok; ++r) ok = run(plan, ctx->mCaptureStream) == CUBLAS_STATUS_SUCCESS;
            cudaGraph_t graph = nullptr;
            ok = cudaStreamEndCapture(ctx->mCaptureStream, &graph) == cudaSuccess && ok && graph != nullptr;
            cudaGraphExec_t exec = nullptr;
            ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
            if (graph != nullptr) cudaGraphDestroy(graph);
            GraphExec out(exec, cudaGraphExecDestroy);
            if (!ok) {
                cudaGetLastError();
                out.reset();
            }
            return out;
        };
        auto timeCandidates = [&](Plan& plan) -> stof_epi_status_t {
            cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
            if (plan.mTimed || cudaStreamIsCapturing(cs, &capture) != cudaSuccess ||
                capture != cudaStreamCaptureStatusNone)
                return STOF_EPI_SUCCESS;
            if (ctx->mStart == nullptr) {
                STOF_EPI_CUDA(cudaEventCreate(&ctx->mStart));
                STOF_EPI_CUDA(cudaEventCreate(&ctx->mStop));
            }
            if (ctx->mCaptureStream == nullptr)
                STOF_EPI_CUDA(cudaStreamCreateWithFlags(&ctx->mCaptureStream, cudaStreamNonBlocking));
            std::vector<std::pair<cublasLtMatmulAlgo_t, GraphExec>> runnable;  // (graph null: not captured)
            for (cublasLtMatmulAlgo_t const& cand : plan.mCandidates) {
                plan.mAlgo = cand;
                if (run(plan, cs) != CUBLAS_STATUS_SUCCESS) continue;
                runnable.emplace_back(cand, captured(plan));
            }
            const bool graphs = std::any_of(runnable.begin(), runnable.end(),
                                            [](auto const& r) { return r.second != nullptr; });
            cublasLtMatmulAlgo_t best = plan.mCandidates.front();
            float bestMs = 0.f;
            bool any = false;
            for (auto const& [cand, exec] : runnable) {
                if (graphs && exec == nullptr) continue;
                plan.mAlgo = cand;
                // the graph's upload before the hold, so that the events time its launch only
                if (exec != nullptr && cudaGraphUpload(exec.get(), cs) != cudaSuccess) {
                    cudaGetLastError();
                    continue;
                }
                STOF_EPI_CUDA(stof_epi::launchHold(kHoldNs, cs));
                STOF_EPI_CUDA(cudaEventRecord(ctx->mStart, cs));
                bool ok = true;
                if (exec != nullptr) {
                    ok = cudaGraphLaunch(exec.get(), cs) == cudaSuccess;
                    if (!ok) cudaGetLastError();
                } else {
                    for (int r = 0; r < kTimedRuns && ok; ++r) ok = run(plan, cs) == CUBLAS_STATUS_SUCCESS;
                }
                STOF_EPI_CUDA(cudaEventRecord(ctx->mStop, cs));
                STOF_EPI_CUDA(cudaEventSynchronize(ctx->mStop));
                float ms = 0.f;
                STOF_EPI_CUDA(cudaEventElapsedTime(&ms, ctx->mStart, ctx->mStop));
                if (ok && (!any || ms < bestMs)) best = cand, bestMs = ms, any = true;
            }
            plan.mAlgo = best;
            plan.mTimed = true;
            return STOF_EPI_SUCCESS;
        };
        if (stof_epi_status_t s = timeCandidates(*bucketPlan); s != STOF_EPI_SUCCESS) return s;
        cublasStatus_t st = run(*bucketPlan, cs);
        if ((st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) && std::get<1>(key) != m) {
            // the bucket's algorithm does not take this M: a plan of this exact M, kept beside the bucket's
            PlanKey exactKey = key;
            std::get<1>(exactKey) = m;
            Plan* exactPlan = nullptr;
            if (stof_epi_status_t s = planOf(exactKey, exactPlan); s != STOF_EPI_SUCCESS) return s;
            if (stof_epi_status_t s = timeCandidates(*exactPlan); s != STOF_EPI_SUCCESS) return s;
            st = run(*exactPlan, cs);
        }
        STOF_EPI_CHECK(st == CUBLAS_STATUS_SUCCESS, STOF_EPI_ERROR_CUBLAS, "cublasLtMatmul: cuBLAS status %d",
                       static_cast<int>(st));
        if (activation == STOF_ACT_GELU_ERF) {
            if (batch == 1 || yStride == m * n) {
                STOF_EPI_CUDA(stof_epi::launchGeluErfInPlace(dtype, y, batch * m * n, cs));
            } else {
                for (int64_t i = 0; i < batch; ++i) {
                    STOF_EPI_CUDA(stof_epi::launchGeluErfInPlace(
                        dtype, static_cast<char*>(y) + static_cast<uintptr_t>(i * yStride) * elem, m * n, cs));
                }
            }
        }
        return STOF_EPI_SUCCESS;
    } catch (std::exception const& e) {
        stof_epi::setLastError(e.what());
    } catch (...) {
        stof_epi::setLastError("unknown exception");
    }
    return STOF_EPI_ERROR_CUBLAS;
}

}  // namespace

extern "C" stof_epi_status_t stof_gemm_epilogue_run_algo(stof_gemm_context_t ctx, int32_t dtype, int64_t m,
                                                         int64_t n, int64_t k, const void* x, const void* w,
                                                         const void* bias, int32_t activation, int32_t algo, void* y,
                                                         void* workspace, size_t workspaceBytes,
                                                         stof_epi_stream_t stream) {
    return runGemm(ctx, dtype, 1, m, n, k, x, w, bias, activation, algo, y, m * n, workspace, workspaceBytes, stream);
}

extern "C" stof_epi_status_t stof_gemm_epilogue_run_strided(stof_gemm_context_t ctx, int32_t dtype, int64_t batch,
                                                            int64_t m, int64_t n, int64_t k, const void* x,
                                                            const void* w, const void* bias, int32_t activation,
                                                            int32_t algo, void* y, int64_t y_batch_stride,
                                                            void* workspace, size_t workspaceBytes,
                                                            stof_epi_stream_t stream) {
    return runGemm(ctx, dtype, batch, m, n, k, x, w, bias, activation, algo, y, y_batch_stride, workspace,
                   workspaceBytes, stream);
}
