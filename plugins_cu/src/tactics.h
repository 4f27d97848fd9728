// The tactic catalogue: one row per tactic, ids >= 1 (TensorRT reserves 0).  docs/kernels.md explains each row.
#pragma once

#include "common.cuh"

// X(id, block_m, block_n, warps, stages, min_ctas_per_sm, q_frags)  -- block-wise family (tensor cores, mma.sync)
// q_frags: reg = Q fragments loaded once into registers; smem = re-read from shared memory every tile (fewer
// registers, so min_ctas_per_sm > 1 fits without spills).
//  1: the baseline, one 64-row tile row per CTA, 16 rows per warp, double-buffered K/V.
//  2: as 1 with a 3-deep K/V ring: hides more load latency when tiles of a row are scattered.
//  3: 32 rows per CTA (2 CTAs per 64-row tile row): twice the CTAs for short sequences / few rows.
//  4: 64 rows with 2 warps of 32 rows: each K/V fragment feeds 2 m-tiles (half the ldmatrix traffic);
//     head dim 64 only (registers).
//  5: 128-row CTAs, 8 warps: needs layouts compiled with tile_m % 128 == 0.
//  6: 128-row CTAs, 4 warps of 32 rows (FlashAttention-2's hdim-64 shape); tile_m % 128 == 0, head dim 64.
//  7, 8: as 1 and 2 with <= 128 registers (4 CTAs = 16 warps per SM): latency hiding for rows of few tiles.
//  9: as 5 with 2 CTAs per SM guaranteed.
// 10: as 3 with 8 CTAs per SM.
#define STOF_BLOCK_TACTICS(X)      \
    X(1, 64, 64, 4, 2, 1, reg)     \
    X(2, 64, 64, 4, 3, 1, reg)     \
    X(3, 32, 64, 2, 2, 1, reg)     \
    X(4, 64, 64, 2, 2, 1, reg)     \
    X(5, 128, 64, 8, 2, 1, reg)    \
    X(6, 128, 64, 4, 2, 1, reg)    \
    X(7, 64, 64, 4, 2, 4, smem)    \
    X(8, 64, 64, 4, 3, 4, smem)    \
    X(9, 128, 64, 8, 2, 2, smem)   \
    X(10, 32, 64, 2, 2, 8, smem)

// X(id, warps)  -- row-wise family (one warp per query row, CUDA cores)
#define STOF_ROW_TACTICS(X) \
    X(11, 4)                \
    X(12, 8)

// block-wise family on Hopper tensor cores (wgmma, sm_90a builds on sm_90 GPUs)
// All need tile_m % 64 == 0 (64 rows per warpgroup inside one tile row).
// 13: one warpgroup = 64 rows per CTA, double-buffered K/V (several CTAs per SM overlap each other).
// 14: as 13 with a 3-deep K/V ring.
// 15: two warpgroups = 128 rows per CTA walking the union of their tile rows' columns: every K/V sub-block is
//     loaded once for 128 rows (half the L2->SM traffic of 13, which measured L2-bound on causal S=4096).
// 16: as 15 with a 3-deep K/V ring.
// 17, 18: one warpgroup, pipelined: S_{i+1} on the tensor cores while the softmax of S_i runs (two S tiles in
//     registers); K/V ring 3 (17) or 4 (18, head dim 64 only: 4 x 32 KB at 128 would leave 1 CTA per SM).
// 19, 20: as 13 and 14, with the P V MMA's completion awaited together with the next S MMA (back to back on the
//     tensor cores) instead of at the end of each step.
// 21-24: warp-specialised (hopper_ws.cuh, FlashAttention-3's structure): a producer (one thread issuing TMA
//     boxes; 128 cp.async threads with key_lengths) streams K/V and step descriptors into an mbarrier ring, two
//     consumer warpgroups (128 rows per work item, one CTA per SM) each overlap their softmax with their own P V
//     MMA and with the other consumer's MMAs; persistent (work counter in the C ABI workspace) when given one.
//     21/22: 64-key steps, 2/4 stages; 23/24: 128-key steps (two 64-key sub-blocks of the walk per step), 2/4 stages
//     (4 rather than 3: -1 to -7 % on causal for 22/24, session 7).
// 25, 26: as 13 and 14 with K/V loaded by the TMA (hopper_tma.cuh): one thread issues the copies, mbarriers
//     instead of a CTA barrier per step, no per-thread address arithmetic.
// 27: as 25 with 128-key steps (two 64-key sub-blocks of the walk per step, S as one m64n128 MMA), head dim 64,
//     3 CTAs per SM.
// 28, 29: as 23 / 24 with three consumer warpgroups (192-row work items, 512 threads: FlashAttention-3's D=64
//     shape; consumers at 160 registers), TMA producer only (key_lengths: 23 / 24's cp.async form), head dim 64.
// X(id, warpgroups (consumers for 21+), stages, variant: 0 plain, 1 pipelined, 2 deferred P V wait,
//   3 warp-specialised with 64-key steps, 4 warp-specialised with 128-key steps, 5 TMA K/V loads, 6 TMA with 128-key steps)
#define STOF_HOPPER_TACTICS(X) \
    X(13, 1, 2, 0)             \
    X(14, 1, 3, 0)             \
    X(15, 2, 2, 0)             \
    X(16, 2, 3, 0)             \
    X(17, 1, 3, 1)             \
    X(18, 1, 4, 1)             \
    X(19, 1, 2, 2)             \
    X(20, 1, 3, 2)             \
    X(21, 2, 2, 3)             \
    X(22, 2, 4, 3)             \
    X(23, 2, 2, 4)             \
    X(24, 2, 4, 4)             \
    X(25, 1, 2, 5)             \
    X(26, 1, 3, 5)             \
    X(27, 1, 2, 6)             \
    X(28, 3, 2, 4)             \
    X(29, 3, 4, 4)

namespace stof {

constexpr int kNumBlockTactics = 10;
constexpr bool kQFrags_reg = false, kQFrags_smem = true;
constexpr int kNumRowTactics = 2;
constexpr int kNumHopperTactics = 17;
// first id of each family (ids are consecutive inside a family; the offset indexes the launcher tables)
constexpr int kFirstBlockId = 1, kFirstRowId = 11, kFirstHopperId = 13;

extern const LaunchFn kBlockLaunchersF16D64[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersF16D128[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersBF16D64[kNumBlockTactics];
extern const LaunchFn kBlockLaunchersBF16D128[kNumBlockTactics];
// [dtype][head dim 64/128][row tactic]
extern const LaunchFn kRowLaunchers[2][2][kNumRowTactics];
extern const LaunchFn kHopperLaunchersF16D64[kNumHopperTactics];
extern const LaunchFn kHopperLaunchersF16D128[kNumHopperTactics];
extern const LaunchFn kHopperLaunchersBF16D64[kNumHopperTactics];
extern const LaunchFn kHopperLaunchersBF16D128[kNumHopperTactics];
// true when this library holds sm_90a code for the Hopper tactics
extern const bool kHopperCompiled;

}  // namespace stof
