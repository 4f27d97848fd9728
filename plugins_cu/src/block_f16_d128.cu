// Block-wise tactic instantiations for __half, head dim 128 (one file per (dtype, head dim): parallel builds).
#include "block_instantiate.cuh"

namespace stof {

#define STOF_X(id, bm, bn, w, s, mb, q, ks) block_launcher<128, bm, bn, w, s, mb, kQFrags_##q, ks, __half>(),
extern const LaunchFn kBlockLaunchersF16D128[kNumBlockTactics] = {STOF_BLOCK_TACTICS(STOF_X)};
#undef STOF_X

}  // namespace stof
