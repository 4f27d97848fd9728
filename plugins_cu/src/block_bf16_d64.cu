// Block-wise tactic instantiations for __nv_bfloat16, head dim 64 (one file per (dtype, head dim): parallel builds).
#include "blockwise.cuh"
#include "tactics.h"

namespace stof {

template <int D, int BM, int BN, int W, int S, int MB, bool QS, class T>
constexpr LaunchFn block_launcher() {
    if constexpr (D == 128 && BM / W > 16) {
        return nullptr;  // 32 rows per warp at head dim 128 would spill (rQ + rO > 190 registers)
    } else {
        // head dim 128 holds twice the O registers: halve the occupancy target so nothing spills
        constexpr int kMinBlocks = (D == 128 && MB > 1) ? MB / 2 : MB;
        return &launch_block<BlockTraits<D, BM, BN, W, S, kMinBlocks, QS, T>>;
    }
}

#define STOF_X(id, bm, bn, w, s, mb, q) block_launcher<64, bm, bn, w, s, mb, kQFrags_##q, __nv_bfloat16>(),
extern const LaunchFn kBlockLaunchersBF16D64[kNumBlockTactics] = {STOF_BLOCK_TACTICS(STOF_X)};
#undef STOF_X

}  // namespace stof
