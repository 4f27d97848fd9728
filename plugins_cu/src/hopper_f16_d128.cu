// Hopper (wgmma) tactic instantiations for __half, head dim 128 (one file per (dtype, head dim): parallel builds).
// The kernels have bodies only in the sm_90a compilation pass (STOF_HAS_SM90A, set by CMake with 90a).
#include "hopper_instantiate.cuh"

namespace stof {

#define STOF_X(id, wg, s, pipe) hopper_launcher<128, wg, s, pipe, __half>(),
extern const LaunchFn kHopperLaunchersF16D128[kNumHopperTactics] = {STOF_HOPPER_TACTICS(STOF_X)};
#undef STOF_X

}  // namespace stof
