// The tactic catalogue: one row per tactic, ids >= 1 (TensorRT reserves 0).  docs/kernels.md explains each row.
#pragma once

#include "common.cuh"

// X(id, block_m, block_n, warps, stages)  -- block-wise family (tensor cores, mma.sync)
//  1: the baseline, one 64-row tile row per CTA, 16 rows per warp, double-buffered K/V.
//  2: as 1 with a 3-deep K/V ring: hides more load latency when tiles of a row are scattered.
//  3: 32 rows per CTA (2 CTAs per 64-row tile row): twice the CTAs for short sequences / few rows.
//  4: 64 rows with 2 warps of 32 rows: each K/V fragment feeds 2 m-tiles (half the ldmatrix traffic);
//     head dim 64 only (registers).
//  5: 128-row CTAs, 8 warps: needs layouts compiled with tile_m % 128 == 0.
//  6: 128-row CTAs, 4 warps of 32 rows (FlashAttention-2's hdim-64 shape); tile_m % 128 == 0, head dim 64.
#define STOF_BLOCK_TACTICS(X) \
    X(1, 64, 64, 4, 2)        \
    X(2, 64, 64, 4, 3)        \
    X(3, 32, 64, 2, 2)        \
    X(4, 64, 64, 2, 2)        \
    X(5, 128, 64, 8, 2)       \
    X(6, 128, 64, 4, 2)

// X(id, warps)  -- row-wise family (one warp per query row, CUDA cores)
#define STOF_ROW_TACTICS(X) \
    X(7, 4)                 \
    X(8, 8)

namespace stof {

constexpr int kNumBlockTactics = 6;
constexpr int kNumRowTactics = 2;

extern const LaunchFn kBlockLaunchersF16D64[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersF16D128[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersBF16D64[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersBF16D128[kNumBlockTactics];
// [dtype][head dim 64/128][row tactic]
extern const LaunchFn kRowLaunchers[2][2][kNumRowTactics];

}  // namespace stof
