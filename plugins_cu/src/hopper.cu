// Hopper (wgmma) tactic instantiations, both dtypes and head dims.  The kernels have bodies only in the sm_90a
// compilation pass (STOF_HAS_SM90A is defined by CMake when CMAKE_CUDA_ARCHITECTURES holds 90a).
#include "hopper_ws.cuh"
#include "tactics.h"

namespace stof {

#define STOF_HOPPER_ROW(T, D) {STOF_HOPPER_TACTICS(STOF_HX_##D##_##T)}
template <int D, int WG, int S, int PIPE, class T>
constexpr LaunchFn hopper_launcher() {
    if constexpr (PIPE == 4 && D == 128) {
        return nullptr;  // S, P and O of a 128-key step at head dim 128 exceed the consumers' 216 registers
    } else if constexpr (PIPE == 3 || PIPE == 4) {
        return &launch_hopper_ws<WsTraits<D, S, PIPE == 4 ? 2 : 1, T>>;
    } else if constexpr (PIPE == 2) {
        return &launch_hopper<HopperTraits<D, WG, S, T, true>>;
    } else if constexpr (PIPE == 1) {
        if constexpr (D == 128 && S > 3) {
            return nullptr;  // 16 KB Q + 4 x 32 KB K/V: one CTA per SM
        } else {
            return &launch_hopper_pipe<HopperTraits<D, WG, S, T>>;
        }
    } else {
        return &launch_hopper<HopperTraits<D, WG, S, T>>;
    }
}

#define STOF_HX_64_F16(id, wg, s, pipe) hopper_launcher<64, wg, s, pipe, __half>(),
#define STOF_HX_128_F16(id, wg, s, pipe) hopper_launcher<128, wg, s, pipe, __half>(),
#define STOF_HX_64_BF16(id, wg, s, pipe) hopper_launcher<64, wg, s, pipe, __nv_bfloat16>(),
#define STOF_HX_128_BF16(id, wg, s, pipe) hopper_launcher<128, wg, s, pipe, __nv_bfloat16>(),

extern const LaunchFn kHopperLaunchers[2][2][kNumHopperTactics] = {
    {STOF_HOPPER_ROW(F16, 64), STOF_HOPPER_ROW(F16, 128)},
    {STOF_HOPPER_ROW(BF16, 64), STOF_HOPPER_ROW(BF16, 128)},
};

#if defined(STOF_HAS_SM90A)
extern const bool kHopperCompiled = true;
#else
extern const bool kHopperCompiled = false;
#endif

}  // namespace stof
