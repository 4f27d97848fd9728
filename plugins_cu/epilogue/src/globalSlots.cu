// StofGlobalSlots: a sequence's run-time global tokens gathered into a fixed number of slots, and the key padding
// words of the two attention nodes that read them (LongformerAttention's rewrite, docs/nodes.md): one small kernel
// instead of some twenty small ONNX ops.
//
// StofRowsScatter (stof_rows_scatter_run): rows computed elsewhere written over an attention output in place.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epilogueCommon.h"
#include "typeConvert.cuh"

namespace stof_epi {
namespace {

constexpr int kSlotThreads = 512;
constexpr int kSlotItems = 8;  // positions per thread and pass: one block scan covers 4096 positions
constexpr int kMaxSlots = 1024;

// v in every element of a vector V of T (V = T: v itself)
template <typename T, typename V>
__device__ __forceinline__ V filled(float v) {
    if constexpr (std::is_same<T, V>::value) {
        return fromFloat<T>(v);
    } else {
        T e[sizeof(V) / sizeof(T)];
#pragma unroll
        for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(T)); ++i) e[i] = fromFloat<T>(v);
        V vec;
        memcpy(&vec, e, sizeof(V));
        return vec;
    }
}

// kSlotCtas CTAs per sequence (fewer with fewer slots): each ranks the sequence's global tokens (slot j = the j-th
// kept global token, in position order) and gathers X's rows of its own slots (j = c, c + kSlotCtas, ...): X's row
// of a used slot, zeros for an unused one, NaN when the sequence has more kept global tokens than slots.  CTA 0
// also writes the key padding words and row_index.  One launch for both: at a batch of one (64 slots, 4096
// positions) a scan kernel and a gather kernel took 5.7 µs on an H200, this one 3.8.
constexpr int kSlotCtas = 8;

template <typename T, typename V>
__global__ void __launch_bounds__(kSlotThreads)
    globalSlotsKernel(T const* __restrict__ mask, int32_t const* __restrict__ global, V const* __restrict__ x,
                      int64_t seq, int64_t rowVecs, int32_t slots, int32_t* __restrict__ localKpm,
                      int32_t* __restrict__ globalKpm, int32_t* __restrict__ rowIndex, V* __restrict__ slotX) {
    using Scan = cub::BlockScan<int32_t, kSlotThreads>;
    __shared__ typename Scan::TempStorage sScan;
    __shared__ int32_t sPos[kMaxSlots];
    __shared__ __align__(8) uint8_t sGlobal[kSlotThreads * kSlotItems];
    int64_t const b = blockIdx.y;
    bool const writer = blockIdx.x == 0;
    T const* m = mask + b * seq;
    int32_t const* g = global + b * seq;
    int32_t* lk = localKpm + b * (slots + seq);
    int64_t before = 0;  // kept global tokens in earlier passes (the same in every thread)
    for (int64_t base = 0; base < seq; base += kSlotThreads * kSlotItems) {
        // striped (coalesced): the loads and both key padding words, which need no rank
#pragma unroll
        for (int i = 0; i < kSlotItems; ++i) {
            int64_t const pos = base + i * kSlotThreads + threadIdx.x;
            int64_t const at = pos < seq ? pos : 0;
            float const mv = toFloat(m[at]);
            int32_t const gv = g[at];  // loaded whatever mv holds: the two loads overlap
            bool const keep = pos < seq && !(mv < 0.f);  // NaN keeps, as Not(Less(mask, 0))
            bool const isGlobal = keep && gv != 0;
            if (writer && pos < seq) {
                globalKpm[b * seq + pos] = keep;
                lk[slots + pos] = keep && !isGlobal;  // a kept global key is in its slot, counted once
            }
            sGlobal[i * kSlotThreads + threadIdx.x] = isGlobal;
        }
        __syncthreads();
        // blocked (consecutive positions per thread): the scan ranks the global tokens in position order
        uint2 const packed = reinterpret_cast<uint2 const*>(sGlobal)[threadIdx.x];
        int32_t isGlobal[kSlotItems], rank[kSlotItems];
#pragma unroll
        for (int i = 0; i < kSlotItems; ++i) isGlobal[i] = ((i < 4 ? packed.x : packed.y) >> (8 * (i % 4))) & 0xff;
        int32_t total = 0;
        Scan(sScan).ExclusiveSum(isGlobal, rank, total);
        int64_t const first = base + static_cast<int64_t>(threadIdx.x) * kSlotItems;
#pragma unroll
        for (int i = 0; i < kSlotItems; ++i)
            if (isGlobal[i] && before + rank[i] < slots) sPos[before + rank[i]] = static_cast<int32_t>(first + i);
        before += total;
        __syncthreads();  // sScan and sGlobal are reused by the next pass; sPos is read below
    }
    bool const over = before > slots;  // not representable: NaN slots make every row of the sequence NaN
    if (writer) {
        for (int j = threadIdx.x; j < slots; j += kSlotThreads) {
            bool const used = j < before;
            lk[j] = used;
            rowIndex[b * slots + j] = used && !over ? sPos[j] : -1;
        }
    }
    // this CTA's slots, rowVecs vectors each
    int64_t const mine = (slots - blockIdx.x + gridDim.x - 1) / gridDim.x;
    for (int64_t e = threadIdx.x; e < mine * rowVecs; e += kSlotThreads) {
        int64_t const j = blockIdx.x + (e / rowVecs) * gridDim.x, c = e % rowVecs;
        bool const used = j < before;
        V* dst = slotX + (b * slots + j) * rowVecs + c;
        if (used && !over)
            *dst = x[(b * seq + sPos[j]) * rowVecs + c];
        else
            *dst = filled<T, V>(used ? NAN : 0.f);
    }
}

template <typename V>
__global__ void rowsScatterKernel(V const* __restrict__ values, int32_t const* __restrict__ index, int32_t rows,
                                  int32_t heads, int32_t vecPerHead, int64_t seqQ, int64_t strideB, int64_t strideH,
                                  int64_t strideS, V* __restrict__ out) {
    int64_t const b = blockIdx.y, r = blockIdx.x;
    int32_t const row = index[b * rows + r];
    if (row < 0 || row >= seqQ) return;
    V const* src = values + (b * rows + r) * heads * vecPerHead;
    V* dst = out + b * strideB + row * strideS;
    for (int e = threadIdx.x; e < heads * vecPerHead; e += blockDim.x) {
        int const h = e / vecPerHead, d = e % vecPerHead;
        dst[h * strideH + d] = src[e];
    }
}

bool aligned(void const* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <typename T>
cudaError_t launchSlots(void const* x, void const* mask, int32_t const* global, int64_t batch, int64_t seq,
                        int64_t hidden, int32_t slots, void* slotX, int32_t* localKpm, int32_t* globalKpm,
                        int32_t* rowIndex, cudaStream_t stream) {
    dim3 const grid(static_cast<unsigned>(std::min(slots, kSlotCtas)), static_cast<unsigned>(batch));
    auto const* m = static_cast<T const*>(mask);
    // 16-byte vectors when every row allows them, else element by element
    if ((hidden * sizeof(T)) % 16 == 0 && aligned(x, 16) && aligned(slotX, 16))
        globalSlotsKernel<T, uint4><<<grid, kSlotThreads, 0, stream>>>(
            m, global, static_cast<uint4 const*>(x), seq, hidden * static_cast<int64_t>(sizeof(T)) / 16, slots,
            localKpm, globalKpm, rowIndex, static_cast<uint4*>(slotX));
    else
        globalSlotsKernel<T, T><<<grid, kSlotThreads, 0, stream>>>(m, global, static_cast<T const*>(x), seq, hidden,
                                                                   slots, localKpm, globalKpm, rowIndex,
                                                                   static_cast<T*>(slotX));
    return cudaGetLastError();
}

}  // namespace
}  // namespace stof_epi

extern "C" int32_t stof_global_slots_max(void) { return stof_epi::kMaxSlots; }

extern "C" stof_epi_status_t stof_global_slots_run(int32_t dtype, int64_t batch, int64_t seq, int64_t hidden,
                                                   int32_t slots, const void* x, const void* mask,
                                                   const int32_t* global, void* slot_x, int32_t* local_kpm,
                                                   int32_t* global_kpm, int32_t* row_index,
                                                   stof_epi_stream_t stream) {
    using namespace stof_epi;
    STOF_EPI_CHECK(dtype == STOF_EPI_FP32 || dtype == STOF_EPI_FP16 || dtype == STOF_EPI_BF16,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "unknown dtype %d", dtype);
    STOF_EPI_CHECK(batch >= 0 && seq >= 0 && hidden >= 0 && batch <= 65535 && seq <= INT32_MAX,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "sizes B=%lld S=%lld N=%lld out of range",
                   static_cast<long long>(batch), static_cast<long long>(seq), static_cast<long long>(hidden));
    STOF_EPI_CHECK(slots >= 1 && slots <= kMaxSlots, STOF_EPI_ERROR_UNSUPPORTED, "slots %d outside [1, %d]", slots,
                   kMaxSlots);
    if (batch == 0) return STOF_EPI_SUCCESS;
    STOF_EPI_CHECK(x != nullptr && mask != nullptr && global != nullptr && slot_x != nullptr &&
                       local_kpm != nullptr && global_kpm != nullptr && row_index != nullptr,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "null tensor pointer");
    auto cs = reinterpret_cast<cudaStream_t>(stream);
    cudaError_t e = dtype == STOF_EPI_FP32   ? launchSlots<float>(x, mask, global, batch, seq, hidden, slots, slot_x,
                                                                  local_kpm, global_kpm, row_index, cs)
                    : dtype == STOF_EPI_FP16 ? launchSlots<__half>(x, mask, global, batch, seq, hidden, slots, slot_x,
                                                                   local_kpm, global_kpm, row_index, cs)
                                             : launchSlots<__nv_bfloat16>(x, mask, global, batch, seq, hidden, slots,
                                                                          slot_x, local_kpm, global_kpm, row_index,
                                                                          cs);
    STOF_EPI_CHECK(e == cudaSuccess, STOF_EPI_ERROR_CUDA, "global slots kernel: %s", cudaGetErrorString(e));
    return STOF_EPI_SUCCESS;
}

extern "C" stof_epi_status_t stof_rows_scatter_run(int32_t dtype, int64_t batch, int64_t rows, int64_t heads,
                                                   int64_t head_dim, const void* values, const int32_t* index,
                                                   int64_t seq_q, void* out, int64_t stride_b, int64_t stride_h,
                                                   int64_t stride_s, stof_epi_stream_t stream) {
    using namespace stof_epi;
    STOF_EPI_CHECK(dtype == STOF_EPI_FP32 || dtype == STOF_EPI_FP16 || dtype == STOF_EPI_BF16,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "unknown dtype %d", dtype);
    STOF_EPI_CHECK(batch >= 0 && rows >= 0 && heads >= 0 && head_dim >= 0 && batch <= 65535 && rows <= INT32_MAX &&
                       heads * head_dim <= INT32_MAX,
                   STOF_EPI_ERROR_INVALID_ARGUMENT, "sizes B=%lld R=%lld H=%lld D=%lld out of range",
                   static_cast<long long>(batch), static_cast<long long>(rows), static_cast<long long>(heads),
                   static_cast<long long>(head_dim));
    if (batch == 0 || rows == 0 || heads == 0 || head_dim == 0) return STOF_EPI_SUCCESS;
    STOF_EPI_CHECK(values != nullptr && index != nullptr && out != nullptr, STOF_EPI_ERROR_INVALID_ARGUMENT,
                   "null tensor pointer");
    int64_t const elem = dtype == STOF_EPI_FP32 ? 4 : 2;
    auto cs = reinterpret_cast<cudaStream_t>(stream);
    dim3 const grid(static_cast<unsigned>(rows), static_cast<unsigned>(batch));
    int64_t const rowBytes = head_dim * elem;
    // 16-byte vectors when every head row and stride allows them, else element by element
    bool const vec = rowBytes % 16 == 0 && aligned(values, 16) && aligned(out, 16) &&
                     (stride_b * elem) % 16 == 0 && (stride_h * elem) % 16 == 0 && (stride_s * elem) % 16 == 0;
    if (vec) {
        int64_t const w = 16 / elem;
        rowsScatterKernel<uint4><<<grid, 128, 0, cs>>>(
            static_cast<uint4 const*>(values), index, static_cast<int32_t>(rows), static_cast<int32_t>(heads),
            static_cast<int32_t>(rowBytes / 16), seq_q, stride_b / w, stride_h / w, stride_s / w,
            static_cast<uint4*>(out));
    } else if (elem == 4) {
        rowsScatterKernel<float><<<grid, 128, 0, cs>>>(
            static_cast<float const*>(values), index, static_cast<int32_t>(rows), static_cast<int32_t>(heads),
            static_cast<int32_t>(head_dim), seq_q, stride_b, stride_h, stride_s, static_cast<float*>(out));
    } else {
        rowsScatterKernel<uint16_t><<<grid, 128, 0, cs>>>(
            static_cast<uint16_t const*>(values), index, static_cast<int32_t>(rows), static_cast<int32_t>(heads),
            static_cast<int32_t>(head_dim), seq_q, stride_b, stride_h, stride_s, static_cast<uint16_t*>(out));
    }
    cudaError_t e = cudaGetLastError();
    STOF_EPI_CHECK(e == cudaSuccess, STOF_EPI_ERROR_CUDA, "rows scatter kernel: %s", cudaGetErrorString(e));
    return STOF_EPI_SUCCESS;
}
