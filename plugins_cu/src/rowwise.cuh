// Row-wise sparse attention forward: one warp per query row, CUDA cores, fp32 throughout.
//
// For short sequences and very sparse rows (dilated, random, narrow bands): the warp walks the non-empty tiles
// of its row's tile row and, inside each tile, the 32-key words of its own bitmap row; a word with no allowed
// key costs one load and one ballot.  Lane i scores key (word base + i) against the whole q row (kept in
// registers, pre-scaled); the warp then does an online-softmax step and accumulates P V with every lane owning
// kHeadDim/32 output dims (coalesced V reads).  Exact for any mask, tails and padding.
#pragma once

#include "common.cuh"

namespace stof {

template <int kHeadDim_, int kNWarps_, typename Elem_>
struct RowTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kDL = kHeadDim / 32;  // output dims per lane
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim");
};

template <class RT>
__global__ void __launch_bounds__(RT::kThreads) row_attn_fwd(const KernelParams p) {
    using Elem = typename RT::Elem;
    constexpr int D = RT::kHeadDim, kDL = RT::kDL;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qrow = blockIdx.x * RT::kNWarps + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (qrow >= p.seq_q) return;  // no block-level barriers below

    const Elem* gQ = static_cast<const Elem*>(p.q) + b * p.q_sb + h * p.q_sh + static_cast<int64_t>(qrow) * p.q_ss;
    const int hk = kv_head(p, h);  // the K/V head: once per work item, never per step
    const Elem* gK = static_cast<const Elem*>(p.k) + b * p.k_sb + hk * p.k_sh;
    const Elem* gV = static_cast<const Elem*>(p.v) + b * p.v_sb + hk * p.v_sh;
    Elem* gO = static_cast<Elem*>(p.o) + b * p.o_sb + h * p.o_sh + static_cast<int64_t>(qrow) * p.o_ss;
    int n_packed = INT_MAX;
    if (p.seq_offsets != nullptr) {  // packed sequences: rows from seq_offsets[b], n_b of them
        n_packed = packed_len(p, b);
        if (qrow >= n_packed) return;
        const int64_t r0 = packed_row0(p, b);
        gQ += r0 * p.q_ss, gK += r0 * p.k_ss, gV += r0 * p.v_ss, gO += r0 * p.o_ss;
    }
    const int32_t* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.seq_k : nullptr;
    const int kv_len = min(effective_kv_len(p, b), n_packed);

    // q row in registers, pre-multiplied by scale*log2(e).
    float q[D];
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(gQ) + c);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = ElemTraits<Elem>::unpack(w[j]);
            q[c * 8 + 2 * j] = f.x * p.scale_log2;
            q[c * 8 + 2 * j + 1] = f.y * p.scale_log2;
        }
    }

    const int trow = qrow / p.tile_m;
    const int a = qrow - trow * p.tile_m;
    const int r = (h % p.num_layouts) * p.tq + trow;
    const int e_begin = __ldg(p.row_ptr + r), e_end = __ldg(p.row_ptr + r + 1);
    const int words_per_row = p.tile_n / 32;
    const int words_per_tile = p.tile_m * words_per_row;

    float m = -INFINITY, l_part = 0.f;
    float acc[kDL];
#pragma unroll
    for (int j = 0; j < kDL; ++j) acc[j] = 0.f;

    for (int e = e_begin; e < e_end; ++e) {
        const int n0 = __ldg(p.col_idx + e) * p.tile_n;
        if (n0 >= kv_len) break;  // columns ascend
        const int bm_idx = __ldg(p.tile_bitmap_index + e);
        for (int w = 0; w < words_per_row; ++w) {
            const int key0 = n0 + w * 32;
            if (key0 >= kv_len) break;
            const uint32_t bits =
                bm_idx < 0 ? 0xffffffffu
                           : static_cast<uint32_t>(__ldg(p.bitmaps + static_cast<int64_t>(bm_idx) * words_per_tile +
                                                          a * words_per_row + w));
            const int key = key0 + lane;
            bool ok = ((bits >> lane) & 1u) && key < kv_len;
            if (ok && kpm != nullptr) ok = __ldg(kpm + key) != 0;
            unsigned ball = __ballot_sync(0xffffffffu, ok);
            if (ball == 0u) continue;

            float s = -INFINITY;
            if (ok) {
                const uint4* kr = reinterpret_cast<const uint4*>(gK + static_cast<int64_t>(key) * p.k_ss);
                float dot = 0.f;
#pragma unroll
                for (int c = 0; c < D / 8; ++c) {
                    const uint4 raw = __ldg(kr + c);
                    const uint32_t wv[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float2 f = ElemTraits<Elem>::unpack(wv[j]);
                        dot = fmaf(q[c * 8 + 2 * j], f.x, dot);
                        dot = fmaf(q[c * 8 + 2 * j + 1], f.y, dot);
                    }
                }
                s = dot;
            }
            float mx = s;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m, mx);  // finite: at least one lane is ok
            const float alpha = fast_exp2(m - m_new);
            const float pr = ok ? fast_exp2(s - m_new) : 0.f;
            m = m_new;
            l_part = l_part * alpha + pr;
#pragma unroll
            for (int j = 0; j < kDL; ++j) acc[j] *= alpha;
            while (ball != 0u) {
                const int src = __ffs(ball) - 1;
                ball &= ball - 1u;
                const float pk = __shfl_sync(0xffffffffu, pr, src);
                const Elem* vr = gV + static_cast<int64_t>(key0 + src) * p.v_ss + lane * kDL;
                if constexpr (kDL == 2) {
                    const float2 f = ElemTraits<Elem>::unpack(__ldg(reinterpret_cast<const uint32_t*>(vr)));
                    acc[0] = fmaf(pk, f.x, acc[0]);
                    acc[1] = fmaf(pk, f.y, acc[1]);
                } else {
                    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(vr));
                    const float2 f0 = ElemTraits<Elem>::unpack(raw.x), f1 = ElemTraits<Elem>::unpack(raw.y);
                    acc[0] = fmaf(pk, f0.x, acc[0]);
                    acc[1] = fmaf(pk, f0.y, acc[1]);
                    acc[2] = fmaf(pk, f1.x, acc[2]);
                    acc[3] = fmaf(pk, f1.y, acc[3]);
                }
            }
        }
    }

    float l = l_part;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if constexpr (kDL == 2) {
        *reinterpret_cast<uint32_t*>(gO + lane * 2) = ElemTraits<Elem>::pack(acc[0] * inv, acc[1] * inv);
    } else {
        uint2 out;
        out.x = ElemTraits<Elem>::pack(acc[0] * inv, acc[1] * inv);
        out.y = ElemTraits<Elem>::pack(acc[2] * inv, acc[3] * inv);
        *reinterpret_cast<uint2*>(gO + lane * 4) = out;
    }
}

template <class RT>
cudaError_t launch_row(const KernelParams& p, cudaStream_t stream) {
    dim3 grid((p.seq_q + RT::kNWarps - 1) / RT::kNWarps, p.heads, p.batch);
    row_attn_fwd<RT><<<grid, RT::kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace stof
