// The kernels' start orders from a layout's host row_ptr (pure host C++): the row order and pair order the
// persistent and grid schedules follow, the sched_chunk rule and the split tactics' slice count.  The layout handle
// (host/layout.cc), the library (stof_attention.cu) and the pre-search (presearch.cc) share them, so the model
// ranks tactics on the schedule the library runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace stof {

// Per layout, the n positions by decreasing len(rp, i) (rp: the layout's row pointers), ties the higher position
// first, into out[l * n ..).
template <class Len>
void longest_first(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, int32_t n, int32_t* out, Len&& len) {
    std::vector<int32_t> idx(static_cast<size_t>(n));
    std::vector<int64_t> key(static_cast<size_t>(n));
    for (int32_t l = 0; l < num_layouts; ++l) {
        const int32_t* rp = row_ptr + static_cast<int64_t>(l) * tiles_q;
        for (int32_t i = 0; i < n; ++i) {
            idx[i] = n - 1 - i;  // ties: higher position first
            key[i] = len(rp, i);
        }
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
        std::copy(idx.begin(), idx.end(), out + static_cast<int64_t>(l) * n);
    }
}

// out: [num_layouts * tiles_q], per layout its tile rows longest first
inline void row_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, int32_t* out) {
    longest_first(row_ptr, num_layouts, tiles_q, tiles_q, out,
                  [](const int32_t* rp, int32_t i) -> int64_t { return rp[i + 1] - rp[i]; });
}

// out: [num_layouts * ceil(tiles_q / 2)], per layout its pairs of tile rows by the pair's longer row
inline void pair_order(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q, int32_t* out) {
    longest_first(row_ptr, num_layouts, tiles_q, tiles_q / 2 + tiles_q % 2, out,
                  [tiles_q](const int32_t* rp, int32_t i) -> int64_t {
                      const int64_t first = rp[2 * i + 1] - rp[2 * i];
                      return 2 * i + 1 < tiles_q ? std::max<int64_t>(first, rp[2 * i + 2] - rp[2 * i + 1]) : first;
                  });
}

// 1 when every layout's longest tile row is <= 5/4 of its mean (near-equal rows: one (batch, head) pair at a time),
// else 0 (the kernel picks the chunk from its L2 budget)
inline int32_t sched_chunk(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q) {
    for (int32_t l = 0; l < num_layouts; ++l) {
        const int32_t* rp = row_ptr + static_cast<int64_t>(l) * tiles_q;
        int64_t longest = 0;
        for (int32_t i = 0; i < tiles_q; ++i) longest = std::max<int64_t>(longest, rp[i + 1] - rp[i]);
        // longest <= 5/4 mean  <=>  4 * tiles_q * longest <= 5 * total (integers: no rounding)
        if (4 * static_cast<int64_t>(tiles_q) * longest > 5 * static_cast<int64_t>(rp[tiles_q] - rp[0])) return 0;
    }
    return 1;
}

// The split tactics (kv_split in the catalogue): how many CTAs share each work item's key walk.  Few items with long
// walks (a Longformer layer's global rows: 12 items of 64 key tiles at B=1) leave most SMs idle; split into P slices,
// each CTA walks 1/P of its row's sub-blocks and a merge kernel combines the slices by their log-sum-exp.  P fills
// at most two CTAs per SM (one wave of tactic 30's CTAs), keeps >= kKvSplitMinSubBlocks sub-blocks per slice of the
// longest row and is <= kKvSplitMax (one merge lane per slice); 1 (no split) when the items alone fill one CTA per
// SM.
constexpr int kKvSplitMax = 32;
constexpr int kKvSplitMinSubBlocks = 4;
inline int kv_split_count(int64_t items, int64_t longest_row_sub_blocks, int sm_count) {
    const int64_t target = 2 * static_cast<int64_t>(std::max(sm_count, 1));
    if (items < 1 || 2 * items > target) return 1;
    const int64_t p = std::min<int64_t>({target / items, longest_row_sub_blocks / kKvSplitMinSubBlocks,
                                         static_cast<int64_t>(kKvSplitMax)});
    return p >= 2 ? static_cast<int>(p) : 1;
}

// The largest tile-row length (stored tiles) over the layouts.
inline int64_t longest_row(const int32_t* row_ptr, int32_t num_layouts, int32_t tiles_q) {
    int64_t longest = 0;
    for (int64_t r = 0; r < static_cast<int64_t>(num_layouts) * tiles_q; ++r)
        longest = std::max<int64_t>(longest, row_ptr[r + 1] - row_ptr[r]);
    return longest;
}

}  // namespace stof
