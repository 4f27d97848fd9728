// StofPackTokens: the index arrays of padding removal into a fixed token capacity (docs/nodes.md) -- the packed
// order, the sequences' offsets and the restore rows -- in two small kernels instead of some thirty ONNX ops.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "epilogueCommon.h"

namespace stof_epi {
namespace {

constexpr int kPackThreads = 256;
constexpr int kPackItems = 8;  // consecutive positions per thread: one block scan covers 2048 positions

// lengths[b] = the kept positions of row b.
__global__ void __launch_bounds__(kPackThreads)
    packLengthsKernel(int32_t const* __restrict__ mask, int64_t seq, int32_t* __restrict__ lengths) {
    using Reduce = cub::BlockReduce<int32_t, kPackThreads>;
    __shared__ typename Reduce::TempStorage sReduce;
    int32_t const* m = mask + blockIdx.x * seq;
    int32_t count = 0;
    for (int64_t p = threadIdx.x; p < seq; p += kPackThreads) count += m[p] != 0;
    count = Reduce(sReduce).Sum(count);
    if (threadIdx.x == 0) lengths[blockIdx.x] = count;
}

// One CTA per row: the row's offset and T from the lengths, then each position's slot -- a kept one at its rank
// among the kept tokens, a padded one after all T kept ones in position order -- and its restore row.
__global__ void __launch_bounds__(kPackThreads)
    packSlotsKernel(int32_t const* __restrict__ mask, int32_t const* __restrict__ lengths, int32_t batch,
                    int64_t seq, int64_t capacity, int32_t* __restrict__ idx, int32_t* __restrict__ offsets,
                    int32_t* __restrict__ sourceRow) {
    using Reduce = cub::BlockReduce<int64_t, kPackThreads>;
    using Scan = cub::BlockScan<int32_t, kPackThreads>;
    __shared__ union {
        typename Reduce::TempStorage reduce;
        typename Scan::TempStorage scan;
    } sTemp;
    __shared__ int64_t sBefore, sTotal;
    int const b = blockIdx.x;
    int64_t before = 0, total = 0;
    for (int i = threadIdx.x; i < batch; i += kPackThreads) {
        int64_t const len = lengths[i];
        total += len;
        if (i < b) before += len;
    }
    int64_t const t0 = Reduce(sTemp.reduce).Sum(before);
    __syncthreads();
    int64_t const t1 = Reduce(sTemp.reduce).Sum(total);
    if (threadIdx.x == 0) sBefore = t0, sTotal = t1;
    __syncthreads();
    int64_t const rowStart = sBefore, tokens = sTotal;
    bool const overflow = tokens > capacity;
    if (threadIdx.x == 0) {
        offsets[b] = static_cast<int32_t>(rowStart < capacity ? rowStart : capacity);
        if (b == batch - 1) offsets[batch] = static_cast<int32_t>(tokens < capacity ? tokens : capacity);
    }
    int32_t const* m = mask + b * seq;
    int64_t keptBefore = rowStart;  // kept positions of the whole batch before this pass (the same in every thread)
    for (int64_t base = 0; base < seq; base += kPackThreads * kPackItems) {
        int64_t const first = base + static_cast<int64_t>(threadIdx.x) * kPackItems;
        int32_t keep[kPackItems], rank[kPackItems];
#pragma unroll
        for (int i = 0; i < kPackItems; ++i) keep[i] = first + i < seq && m[first + i < seq ? first + i : 0] != 0;
        int32_t passKept = 0;
        Scan(sTemp.scan).ExclusiveSum(keep, rank, passKept);
#pragma unroll
        for (int i = 0; i < kPackItems; ++i) {
            int64_t const p = first + i;
            if (p >= seq) continue;
            int64_t const flat = b * seq + p;
            int64_t const kept = keptBefore + rank[i];  // kept positions before p
            // a padded position's slot: T + the padded positions before it
            int64_t const slot = keep[i] ? kept : tokens + flat - kept;
            if (slot < capacity) idx[slot] = static_cast<int32_t>(flat);
            sourceRow[flat] = static_cast<int32_t>(overflow ? capacity + 1 : keep[i] ? kept : capacity);
        }
        keptBefore += passKept;
        __syncthreads();  // sTemp is reused by the next pass
    }
}

}  // namespace
}  // namespace stof_epi

extern "C" stof_epi_status_t stof_pack_tokens_run(int64_t batch, int64_t seq, int64_t capacity, const int32_t* mask,
                                                  int32_t* idx, int32_t* seq_offsets, int32_t* source_row,
                                                  int32_t* scratch, stof_epi_stream_t stream) {
    using namespace stof_epi;
    STOF_EPI_CHECK(batch >= 0 && seq >= 0 && batch <= 65535 && batch * seq <= INT32_MAX - 2, STOF_EPI_ERROR_INVALID_ARGUMENT,
                   "sizes B=%lld S=%lld out of range", static_cast<long long>(batch), static_cast<long long>(seq));
    STOF_EPI_CHECK(capacity >= 0 && capacity <= batch * seq, STOF_EPI_ERROR_INVALID_ARGUMENT,
                   "capacity %lld outside [0, B*S = %lld]", static_cast<long long>(capacity),
                   static_cast<long long>(batch * seq));
    auto cs = reinterpret_cast<cudaStream_t>(stream);
    if (batch == 0) {
        STOF_EPI_CHECK(seq_offsets != nullptr, STOF_EPI_ERROR_INVALID_ARGUMENT, "null tensor pointer");
        STOF_EPI_CUDA(cudaMemsetAsync(seq_offsets, 0, sizeof(int32_t), cs));
        return STOF_EPI_SUCCESS;
    }
    STOF_EPI_CHECK(mask != nullptr && idx != nullptr && seq_offsets != nullptr && source_row != nullptr &&
                       scratch != nullptr,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "null tensor pointer");
    packLengthsKernel<<<static_cast<unsigned>(batch), kPackThreads, 0, cs>>>(mask, seq, scratch);
    packSlotsKernel<<<static_cast<unsigned>(batch), kPackThreads, 0, cs>>>(
        mask, scratch, static_cast<int32_t>(batch), seq, capacity, idx, seq_offsets, source_row);
    cudaError_t e = cudaGetLastError();
    STOF_EPI_CHECK(e == cudaSuccess, STOF_EPI_ERROR_CUDA, "pack tokens kernels: %s", cudaGetErrorString(e));
    return STOF_EPI_SUCCESS;
}
