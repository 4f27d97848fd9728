// The kernels' start orders from a layout's host row_ptr (pure host C++): the row order and pair order the
// persistent and grid schedules follow, and the sched_chunk rule.  The layout handle (host/layout.cc) and the
// pre-search (presearch.cc) share them, so the model ranks tactics on the
// schedule the library runs.
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

}  // namespace stof
