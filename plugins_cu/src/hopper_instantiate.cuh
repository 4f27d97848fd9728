// The wgmma tactic -> kernel map: hopper_launcher<D, WG, S, PIPE, T>() is the launcher of the tactic row
// X(id, WG, S, PIPE) of STOF_HOPPER_TACTICS (tactics.h) for head dim D and element type T, or nullptr where that
// tactic does not exist.  hopper_<dtype>_d<D>.cu build the library's tables from it, one translation unit per
// (dtype, head dim) so they compile in parallel; tests/test_kernel_codegen.py checks ptxas's report on the fp16 ones
// (no serialised wgmma, no spills).
#pragma once

#include "hopper_split.cuh"
#include "hopper_tma.cuh"
#include "hopper_ws.cuh"
#include "tactics.h"

namespace stof {

template <int D, int WG, int S, int PIPE, class T>
constexpr LaunchFn hopper_launcher() {
    if constexpr (PIPE == 4 && D == 128 && (S > 2 || WG > 2)) {
        return nullptr;  // 128-key stages of K and V at head dim 128: 64 KB each, two fit beside two Q buffers
    } else if constexpr (PIPE == 3 || PIPE == 4) {
        return &launch_hopper_ws<WsTraits<D, S, PIPE == 4 ? 2 : 1, T, true, WG>>;  // TMA (cp.async for key_lengths)
    } else if constexpr (PIPE == 5) {
        return &launch_hopper_tma<TmaTraits<D, S, 64, T>, &launch_hopper<HopperTraits<D, 1, S, T>>>;
    } else if constexpr (PIPE == 6 && D == 128) {
        return nullptr;  // S, P and O of a 128-key step at head dim 128: registers for one CTA per SM only
    } else if constexpr (PIPE == 6) {
        return &launch_hopper_tma<TmaTraits<D, S, 128, T>, &launch_hopper<HopperTraits<D, 1, S, T>>>;
    } else if constexpr (PIPE == 7) {
        return &launch_hopper_split<HopperTraits<D, 1, S, T>>;
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

}  // namespace stof
