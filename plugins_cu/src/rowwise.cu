// Row-wise tactic instantiations (both dtypes, both head dims).
#include "rowwise.cuh"
#include "tactics.h"

namespace stof {

#define STOF_ROW(T, D) \
    {STOF_ROW_TACTICS(STOF_X_##D##_##T)}
#define STOF_X_64_F16(id, w) &launch_row<RowTraits<64, w, __half>>,
#define STOF_X_128_F16(id, w) &launch_row<RowTraits<128, w, __half>>,
#define STOF_X_64_BF16(id, w) &launch_row<RowTraits<64, w, __nv_bfloat16>>,
#define STOF_X_128_BF16(id, w) &launch_row<RowTraits<128, w, __nv_bfloat16>>,

extern const LaunchFn kRowLaunchers[2][2][kNumRowTactics] = {
    {STOF_ROW(F16, 64), STOF_ROW(F16, 128)},
    {STOF_ROW(BF16, 64), STOF_ROW(BF16, 128)},
};

}  // namespace stof
