// Block-wise tactic instantiations for __nv_bfloat16, head dim 128 (one file per (dtype, head dim): parallel builds).
#include "blockwise.cuh"
#include "tactics.h"

namespace stof {

template <int D, int BM, int BN, int W, int S, class T>
constexpr LaunchFn block_launcher() {
    if constexpr (D == 128 && BM / W > 16) {
        return nullptr;  // 32 rows per warp at head dim 128 would spill (rQ + rO > 190 registers)
    } else {
        return &launch_block<BlockTraits<D, BM, BN, W, S, T>>;
    }
}

#define STOF_X(id, bm, bn, w, s) block_launcher<128, bm, bn, w, s, __nv_bfloat16>(),
extern const LaunchFn kBlockLaunchersBF16D128[kNumBlockTactics] = {STOF_BLOCK_TACTICS(STOF_X)};
#undef STOF_X

}  // namespace stof
