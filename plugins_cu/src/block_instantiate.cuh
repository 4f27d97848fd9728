// The block-wise launcher table of one (dtype, head dim): included by block_<dtype>_d<D>.cu, one translation
// unit per pair so the four tables compile in parallel.
#pragma once

#include "blockwise.cuh"
#include "tactics.h"

namespace stof {

template <int D, int BM, int BN, int W, int S, int MB, bool QS, bool KS, class T>
constexpr LaunchFn block_launcher() {
    if constexpr (D == 128 && BM / W > 16) {
        return nullptr;  // 32 rows per warp at head dim 128 would spill (rQ + rO > 190 registers)
    } else {
        // head dim 128 holds twice the O registers: halve the occupancy target so nothing spills
        constexpr int kMinBlocks = (D == 128 && MB > 1) ? MB / 2 : MB;
        using KT = BlockTraits<D, BM, BN, W, S, kMinBlocks, QS, T>;
        if constexpr (KS) return &launch_block_split<KT>;
        else return &launch_block<KT>;
    }
}

}  // namespace stof
