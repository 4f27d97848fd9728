// Synchronisation and bulk-copy primitives of the sm_90a kernels: mbarriers, TMA tensor copies (and the host-side
// tensor-map encoders), bulk-store groups and named barriers.  Shared by the TMA and warp-specialised kernels.
#pragma once

#include <cuda.h>

#include "common.cuh"

namespace stof {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// (A suspend-time hint on the try_wait, CUTLASS's 10 ms, measured the same in tactics 24 and 29.)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"  // labels are scoped by the braces
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@!P1 bra LAB_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed (the count was set at init).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Box (64 keys x 64 elements) at coordinates (d0, n0, h, b) of a 4-d tensor map into shared memory at dst.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int d0, int n0, int h, int b,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(d0), "r"(n0), "r"(h), "r"(b), "r"(bar)
        : "memory");
}

// Box (64 rows x 64 elements) from shared memory at src to coordinates (d0, n0, h, b) of a 4-d tensor map (rows past
// the tensor's end are not written), in this thread's bulk group; tma_store_commit() closes the group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int d0, int n0, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(src), "r"(d0), "r"(n0), "r"(h), "r"(b)
        : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// until this thread's bulk stores have read their shared memory (kRead) or are complete
template <bool kRead>
__device__ __forceinline__ void tma_store_wait() {
    if constexpr (kRead)
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Host: K and V (encode_kv_maps), Q (encode_q_map) or O (encode_o_map) tensor maps; false when the driver entry
// point or an encoding is unavailable (the caller falls back).
bool encode_kv_maps(KernelParams& p, int head_dim, bool bf16);
bool encode_q_map(KernelParams& p, int head_dim, bool bf16);
bool encode_o_map(KernelParams& p, int head_dim, bool bf16);

}  // namespace stof
