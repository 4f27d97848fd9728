// The analytical pre-search: ranks the attention tactics for a problem without running them (docs/kernels.md,
// "Pre-search").  The one implementation of the model: stof_trt.presearch calls it through the C ABI,
// stof_attn_select (host/select.cc) for problems the tactic cache has no entry for.  Pure host C++ (layout arrays
// in host memory, GPU properties as arguments; presearch_gpu.cu reads them from a device), so it builds into
// libstof_host without a CUDA compiler and runs without a GPU.
//
// The per-tactic rows (traits, requirements, ptxas registers, calibrated constants) come from presearch_table.inc,
// which scripts/gen_tactics.py generates from the catalogue plugins_cu/tactics.toml.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <vector>

#include "schedule_order.h"
#include "stof/stof_attention.h"


namespace {

constexpr int kFamilyBlock = 1, kFamilyRow = 2, kFamilyHopper = 3;

struct TacticRow {
    int id, family, blockM, blockN, warps, stages, minCtas, qInSmem, pipelined, deferPv, warpSpecialized, keyStep;
    int headDims, tileMMultiple, tileNMultiple, sm90a;  // requirements; headDims: bit 0 = 64, bit 1 = 128
    int regs[2];  // head dim 64, 128 (-1: no ptxas entry)
    int hasCoef[2];
    double coef[2][4];
    int kvSplit;  // the key walk split over kv_split_count() CTAs (schedule_order.h)
};

#define STOF_PRESEARCH_ROW(id, fam, bm, bn, w, st, mc, qs, pipe, dpv, ws, ks, hd, tmm, tnm, sm90a, r64, r128, h64, \
                           a64, b64, c64, d64, h128, a128, b128, c128, d128, kvs)                                \
    {id, fam, bm, bn, w, st, mc, qs, pipe, dpv, ws, ks, hd, tmm, tnm, sm90a, {r64, r128}, {h64, h128},          \
     {{a64, b64, c64, d64}, {a128, b128, c128, d128}}, kvs},
const TacticRow kRows[] = {
#include "presearch_table.inc"
};
constexpr double kUniformItemScale = STOF_PRESEARCH_UNIFORM_ITEM_SCALE;  // generated with the table
constexpr int64_t kSchedL2BytesOneItemPerSm = STOF_PRESEARCH_SCHED_L2_BYTES_ONE_ITEM_PER_SM;  // (common.cuh's)
constexpr int64_t kSchedL2BytesManyCtas = STOF_PRESEARCH_SCHED_L2_BYTES_MANY_CTAS;

#undef STOF_PRESEARCH_ROW
constexpr int kNumRows = static_cast<int>(sizeof(kRows) / sizeof(kRows[0]));

int dIndex(int headDim) { return headDim == 128 ? 1 : 0; }

// -- tile statistics ----------------------------------------------------------------------------------------------
struct Stats {
    int tileM, tileN, seqQ, seqK, L, Tq;
    std::vector<int64_t> rowNnz, rowPartial;     // [L*Tq]
    std::vector<std::vector<int32_t>> cols;      // [L*Tq] ascending tile columns
    std::vector<std::vector<int32_t>> pcols;     // [L*Tq] the partial ones
    double words{0}, allowed{0};
    int32_t schedChunk{0};                       // schedule_order.h: 1 for near-equal rows
    std::vector<int32_t> rowOrder, pairOrder;    // schedule_order.h: the kernels' start orders
    int64_t longestRow{0};                       // stored tiles of the longest tile row
};

int popcount32(uint32_t v) {
    int n = 0;
    while (v) {
        v &= v - 1;
        ++n;
    }
    return n;
}

Stats tileStats(stof_host_layout_t const& lay) {
    Stats s;
    s.tileM = lay.tile_m, s.tileN = lay.tile_n, s.seqQ = lay.layout_seq_q, s.seqK = lay.layout_seq_k;
    s.L = lay.num_layouts;
    s.Tq = (lay.layout_seq_q + lay.tile_m - 1) / lay.tile_m;
    size_t const R = static_cast<size_t>(s.L) * s.Tq;
    s.rowNnz.resize(R), s.rowPartial.resize(R), s.cols.resize(R), s.pcols.resize(R);
    int64_t nFull = 0, nPartial = 0;
    for (size_t r = 0; r < R; ++r) {
        for (int32_t e = lay.row_ptr[r]; e < lay.row_ptr[r + 1]; ++e) {
            s.cols[r].push_back(lay.col_idx[e]);
            if (lay.tile_bitmap_index[e] >= 0) {
                s.pcols[r].push_back(lay.col_idx[e]);
                ++nPartial;
            } else {
                ++nFull;
            }
        }
        s.rowNnz[r] = static_cast<int64_t>(s.cols[r].size());
        s.rowPartial[r] = static_cast<int64_t>(s.pcols[r].size());
    }
    // words / allowed per PARTIAL tile, from its bitmap (tiles may share one: format version 2)
    int64_t const wordsPerTile = static_cast<int64_t>(lay.tile_m) * lay.tile_n / 32;
    std::vector<int64_t> bmWords(static_cast<size_t>(std::max(lay.num_bitmaps, 0))),
        bmBits(static_cast<size_t>(std::max(lay.num_bitmaps, 0)));
    if (nPartial > 0) {
        for (int64_t b = 0; b < lay.num_bitmaps; ++b)
            for (int64_t i = 0; i < wordsPerTile; ++i) {
                uint32_t const w = static_cast<uint32_t>(lay.bitmaps[b * wordsPerTile + i]);
                bmWords[static_cast<size_t>(b)] += w != 0;
                bmBits[static_cast<size_t>(b)] += popcount32(w);
            }
    }
    int64_t wordsPartial = 0, bitsPartial = 0;
    for (size_t r = 0; r < R; ++r)
        for (int32_t e = lay.row_ptr[r]; e < lay.row_ptr[r + 1]; ++e) {
            int32_t const b = lay.tile_bitmap_index[e];
            if (b >= 0 && b < lay.num_bitmaps) {
                wordsPartial += bmWords[static_cast<size_t>(b)];
                bitsPartial += bmBits[static_cast<size_t>(b)];
            }
        }
    int64_t const wordsFull = nFull * lay.tile_m * (lay.tile_n / 32);
    s.schedChunk = stof::sched_chunk(lay.row_ptr, s.L, s.Tq);
    s.longestRow = stof::longest_row(lay.row_ptr, s.L, s.Tq);
    s.rowOrder.resize(R);
    s.pairOrder.resize(static_cast<size_t>(s.L) * ((s.Tq + 1) / 2));
    stof::row_order(lay.row_ptr, s.L, s.Tq, s.rowOrder.data());
    stof::pair_order(lay.row_ptr, s.L, s.Tq, s.pairOrder.data());
    s.words = static_cast<double>(wordsPartial + wordsFull);
    s.allowed = static_cast<double>(bitsPartial + nFull * lay.tile_m * lay.tile_n);
    return s;
}

// per layout, CTAs in launch order (reversed rows): (full, partial) sub-block iterations
void ctaWork(Stats const& s, TacticRow const& t, int seqQ, std::vector<std::vector<double>>& full,
             std::vector<std::vector<double>>& part) {
    int const nsub = s.tileN / t.blockN;
    int const nCta = (seqQ + t.blockM - 1) / t.blockM;
    int const step = t.family == kFamilyHopper ? 64 : t.blockM;
    full.assign(s.L, std::vector<double>(nCta, 0.0));
    part.assign(s.L, std::vector<double>(nCta, 0.0));
    for (int l = 0; l < s.L; ++l) {
        for (int c = 0; c < nCta; ++c) {
            int const q0 = (nCta - 1 - c) * t.blockM;
            std::vector<int> rows;
            for (int r = 0; r < t.blockM; r += step) {
                if (q0 + r >= seqQ) continue;
                int const row = (q0 + r) / s.tileM;
                if (std::find(rows.begin(), rows.end(), row) == rows.end()) rows.push_back(row);
            }
            std::sort(rows.begin(), rows.end());
            size_t nAll = 0, nP = 0;
            if (rows.size() == 1) {
                size_t const r = static_cast<size_t>(l) * s.Tq + rows[0];
                nAll = s.cols[r].size(), nP = s.pcols[r].size();
            } else if (rows.size() >= 2) {  // the union of the CTA's tile rows (2 or 3 warpgroups)
                std::vector<int32_t> all, part;
                for (int row : rows) {
                    size_t const r = static_cast<size_t>(l) * s.Tq + row;
                    all.insert(all.end(), s.cols[r].begin(), s.cols[r].end());
                    part.insert(part.end(), s.pcols[r].begin(), s.pcols[r].end());
                }
                std::sort(all.begin(), all.end());
                std::sort(part.begin(), part.end());
                nAll = static_cast<size_t>(std::unique(all.begin(), all.end()) - all.begin());
                nP = static_cast<size_t>(std::unique(part.begin(), part.end()) - part.begin());
            }
            full[l][c] = static_cast<double>((static_cast<int64_t>(nAll) - static_cast<int64_t>(nP)) * nsub);
            part[l][c] = static_cast<double>(static_cast<int64_t>(nP) * nsub);
        }
    }
}

int blockRegs(TacticRow const& t, int D) {
    int const reg = t.regs[dIndex(D)];
    if (reg >= 0) return reg;
    if (t.family == kFamilyHopper) return D == 64 ? 128 : (t.blockM == 128 ? 169 : 202);
    int const mi = t.blockM / t.warps / 16;
    if (t.minCtas > 1) {
        int const minCtas = D == 128 ? t.minCtas / 2 : t.minCtas;
        return std::min(255, 65536 / (minCtas * 32 * t.warps));
    }
    int const frag = mi * (D / 16) * 4 + mi * (D / 8) * 4 + mi * (t.blockN / 8) * 4;
    return std::min(255, static_cast<int>(frag * 1.15) + 48);
}

// Warpgroups that walk disjoint shares of one 64-row item's sub-blocks (the split-walk wgmma kernel: two, with a
// K/V ring each); 1 for every other tactic, whose warpgroups own different rows or are producers.
int walkers(TacticRow const& t) {
    return t.family == kFamilyHopper && !t.warpSpecialized ? std::max(1, t.warps / 4 / (t.blockM / 64)) : 1;
}

int64_t blockSmem(TacticRow const& t, int D) {
    int const step = t.family == kFamilyHopper ? t.keyStep : t.blockN;
    return static_cast<int64_t>(t.blockM) * D * 2 + 2LL * t.stages * step * D * 2 * walkers(t) +
           (t.family == kFamilyHopper ? 1024 : 0);
}

int occupancy(TacticRow const& t, int D, stof_gpu_props_t const& g) {
    int const threads = 32 * t.warps;
    int regs;
    int64_t smem;
    if (t.family == kFamilyRow) {
        int const r = t.regs[dIndex(D)];
        regs = r >= 0 ? r : (D == 64 ? 128 : 208);
        smem = 0;
    } else {
        regs = blockRegs(t, D);
        smem = blockSmem(t, D);
    }
    int64_t const byThreads = g.max_threads_per_sm / threads;
    int64_t const byRegs = g.regs_per_sm / (static_cast<int64_t>((regs + 7) / 8) * 8 * threads);
    int64_t const bySmem = smem ? g.smem_per_sm / (smem + 1024) : g.max_ctas_per_sm;
    int64_t const occ = std::min({byThreads, byRegs, bySmem, static_cast<int64_t>(g.max_ctas_per_sm)});
    return static_cast<int>(std::max<int64_t>(0, occ));
}

// the CTA durations (ctaWork's reversed-row order) in the order the library starts them
// (common.cuh block_work): (batch, head) pairs in chunks (1 for near-equal rows, else as many as fit the kernel's L2
// budget of K/V, kSchedL2Bytes*), position-major inside a chunk; positions follow the layout's row order (longest
// first, ties the higher row) when a CTA covers at most one tile row and Sq covers >= 3/4 of the layout's rows, its
// pair order (pairs of tile rows by their longer row, ties the higher pair) when a CTA covers exactly two and Sq
// covers >= 3/4 of the pairs, else the reversed rows.
std::vector<double> scheduleOrder(Stats const& s, TacticRow const& t, std::vector<std::vector<double>> const& dur,
                                  int batch, int heads, int D, int seqK) {
    int const L = s.L;
    int64_t const nCta = static_cast<int64_t>(dur[0].size());
    int64_t const nhb = static_cast<int64_t>(batch) * heads;
    int64_t const budget = t.warpSpecialized ? kSchedL2BytesOneItemPerSm : kSchedL2BytesManyCtas;
    int64_t const chunk =
        s.schedChunk == 1 ? 1 : std::max<int64_t>(1, std::min<int64_t>(nhb, budget / (4LL * seqK * D)));
    int const f = s.tileM % t.blockM == 0 ? s.tileM / t.blockM : 0;
    std::vector<std::vector<double>> ordered(L);
    for (int l = 0; l < L; ++l) {
        if (f >= 1 && 4 * nCta >= 3LL * s.Tq * f) {
            // the grid spans every tile row; positions past Sq exit at once (-1 here, dropped after the interleave,
            // which runs over the raw positions as the kernels' does)
            for (int i = 0; i < s.Tq; ++i)
                for (int j = 0; j < f; ++j) {
                    int64_t const r = s.rowOrder[static_cast<size_t>(l) * s.Tq + i];
                    int64_t const qb = r * f + (f - 1 - j);
                    ordered[l].push_back(qb < nCta ? dur[l][nCta - 1 - qb] : -1.0);
                }
        } else if (f == 0 && t.blockM == 2 * s.tileM && 4 * nCta >= 3LL * ((s.Tq + 1) / 2)) {
            int const tp = (s.Tq + 1) / 2;
            for (int i = 0; i < tp; ++i) {
                int64_t const qb = s.pairOrder[static_cast<size_t>(l) * tp + i];
                ordered[l].push_back(qb < nCta ? dur[l][nCta - 1 - qb] : -1.0);
            }
        } else {
            ordered[l] = dur[l];
        }
    }
    std::vector<double> out;
    out.reserve(static_cast<size_t>(nhb * nCta));
    for (int64_t c0 = 0; c0 < nhb; c0 += chunk) {
        int64_t const c1 = std::min(nhb, c0 + chunk);
        size_t const n = ordered[static_cast<size_t>((c0 % heads) % L)].size();
        for (size_t pos = 0; pos < n; ++pos)
            for (int64_t hb = c0; hb < c1; ++hb) {
                double const d = ordered[static_cast<size_t>((hb % heads) % L)][pos];
                if (d >= 0.0) out.push_back(d);
            }
    }
    return out;
}

double makespan(std::vector<double> const& d, int64_t slots) {
    if (static_cast<int64_t>(d.size()) <= slots) {
        double m = 0.0;
        for (double v : d) m = std::max(m, v);
        return m;
    }
    std::priority_queue<double, std::vector<double>, std::greater<double>> heap;
    for (int64_t i = 0; i < slots; ++i) heap.push(0.0);
    for (double v : d) {
        double const m = heap.top();
        heap.pop();
        heap.push(m + v);
    }
    double m = 0.0;
    while (!heap.empty()) {
        m = std::max(m, heap.top());
        heap.pop();
    }
    return m;
}

// the catalogue's requirements (the library's own check, stof_attn_list_tactics, may also drop a tactic)
bool valid(TacticRow const& t, int tileM, int tileN, int D, bool hopper) {
    if (D != 64 && D != 128) return false;
    if (!(t.headDims & (D == 64 ? 1 : 2))) return false;
    if (t.sm90a && !hopper) return false;
    return tileM % t.tileMMultiple == 0 && tileN % t.tileNMultiple == 0;
}

// the slices per work item a split tactic runs with (the library's rule, stof_attention.cu split_count); 1 otherwise
int splitCount(Stats const& s, TacticRow const& t, int batch, int heads, int seqQ, stof_gpu_props_t const& g) {
    if (!t.kvSplit) return 1;
    int64_t const items = static_cast<int64_t>((seqQ + t.blockM - 1) / t.blockM) * heads * batch;
    return stof::kv_split_count(items, s.longestRow * (s.tileN / t.blockN), g.sm_count);
}

double predict(Stats const& s, TacticRow const& t, int batch, int heads, int D, int seqQ, int seqK,
               stof_gpu_props_t const& g) {
    int const L = s.L;
    if (t.hasCoef[dIndex(D)] && t.family != kFamilyRow) {
        int const occ = occupancy(t, D, g);
        if (occ == 0) return std::numeric_limits<double>::infinity();
        double const* c = t.coef[dIndex(D)];
        // the scheduler-warp tactics' per-item constant on near-equal rows
        bool const schedulerWarp = t.family == kFamilyHopper && t.warpSpecialized && t.blockM == 128;
        double const cItem = schedulerWarp && s.schedChunk == 1 ? c[2] * kUniformItemScale : c[2];
        std::vector<std::vector<double>> full, part;
        ctaWork(s, t, seqQ, full, part);
        int const splits = splitCount(s, t, batch, heads, seqQ, g);
        if (splits > 1) {  // every item's slices, each a 1/splits share of its sub-blocks, in no row order
            std::vector<double> ctas;
            for (int b = 0; b < batch; ++b)
                for (int h = 0; h < heads; ++h)
                    for (size_t i = 0; i < full[h % L].size(); ++i)
                        for (int sp = 0; sp < splits; ++sp)
                            ctas.push_back((c[0] * full[h % L][i] + c[1] * part[h % L][i]) / splits + cItem);
            return (makespan(ctas, static_cast<int64_t>(g.sm_count) * occ) + c[3]) * 1e-6;
        }
        std::vector<std::vector<double>> dur(L);
        double const share = 1.0 / walkers(t);  // each walker's share of the item's sub-blocks
        for (int l = 0; l < L; ++l) {
            dur[l].resize(full[l].size());
            for (size_t i = 0; i < full[l].size(); ++i)
                dur[l][i] = (c[0] * full[l][i] + c[1] * part[l][i]) * share + cItem;
        }
        std::vector<double> const ctas = scheduleOrder(s, t, dur, batch, heads, D, seqK);
        return (makespan(ctas, static_cast<int64_t>(g.sm_count) * occ) + c[3]) * 1e-6;
    }
    double const bytesIo = static_cast<double>(2LL * D * batch * heads * (2LL * seqQ + 2LL * seqK));
    double const tDram = bytesIo / g.dram_bw;
    double const hPerL = static_cast<double>(heads) / L;
    if (t.family == kFamilyRow) {
        double const words = s.words * hPerL * batch;
        double const keys = s.allowed * hPerL * batch;
        double const instr = words * (1.6 * D + 12) + keys * (10 + D / 32.0);
        double const tRow = instr / (4.0 * g.sm_count * g.clock_hz * 0.35);
        return std::max(tRow, tDram) + 4e-6;
    }
    int const occ = occupancy(t, D, g);
    if (occ == 0) return std::numeric_limits<double>::infinity();
    if (t.blockM > s.tileM) {  // a CTA spans several tile rows and walks their union (wgmma kernels)
        std::vector<std::vector<double>> full, part;
        ctaWork(s, t, seqQ, full, part);
        double const flopsSub = 4.0 * t.blockM * 64 * D;
        double const slotRate = g.wgmma_tflops / g.sm_count * std::min(1.0, occ * t.warps / 16.0) / occ;
        std::vector<double> ctas;
        double iters = 0.0;
        for (int l = 0; l < L; ++l)
            for (size_t i = 0; i < full[l].size(); ++i) iters += full[l][i] + part[l][i];
        for (int b = 0; b < batch; ++b)
            for (int h = 0; h < heads; ++h)
                for (size_t i = 0; i < full[h % L].size(); ++i) {
                    double const work = (full[h % L][i] + part[h % L][i]) * flopsSub +
                                        part[h % L][i] * flopsSub * 0.25 + flopsSub;
                    ctas.push_back(work / slotRate);
                }
        double const kvBytes = iters * hPerL * batch * 64 * D * 2 * 2;
        return std::max({makespan(ctas, static_cast<int64_t>(g.sm_count) * occ), kvBytes / g.l2_bw, tDram}) + 4e-6;
    }
    int const subPerTile = s.tileN / t.blockN;
    int const rowsPerTile = s.tileM / t.blockM;
    double const flopsSub = 4.0 * t.blockM * t.blockN * D;
    int const tqUsed = std::min((seqQ + s.tileM - 1) / s.tileM, s.Tq);
    std::vector<std::vector<double>> perHead(L);
    int64_t nsubSum = 0;
    for (int l = 0; l < L; ++l) {
        for (int i = tqUsed - 1; i >= 0; --i) {  // launch order: reversed tile rows
            int64_t const nsub = s.rowNnz[static_cast<size_t>(l) * s.Tq + i] * subPerTile;
            int64_t const npart = s.rowPartial[static_cast<size_t>(l) * s.Tq + i] * subPerTile;
            double const work = nsub * flopsSub + npart * flopsSub * 0.25 + flopsSub * 1.0;
            for (int r = 0; r < rowsPerTile; ++r) perHead[l].push_back(work);
        }
        for (int i = 0; i < tqUsed; ++i) nsubSum += s.rowNnz[static_cast<size_t>(l) * s.Tq + i] * subPerTile;
    }
    int const warpsRes = occ * t.warps;
    double smRate;
    if (t.family == kFamilyHopper) {
        double const eff = std::min(1.0, warpsRes / 16.0);
        smRate = g.wgmma_tflops / g.sm_count * eff;
    } else {
        double const eff = std::min(1.0, warpsRes / 16.0) * (1.0 + 0.12 * (t.blockM / t.warps / 16 - 1));
        smRate = g.mma_tflops / g.sm_count * eff;
    }
    double const slotRate = smRate / occ;
    std::vector<double> ctas;
    for (int b = 0; b < batch; ++b)
        for (int h = 0; h < heads; ++h)
            for (double w : perHead[h % L]) ctas.push_back(w / slotRate);
    double const tComp = makespan(ctas, static_cast<int64_t>(g.sm_count) * occ);
    double const kvBytes = static_cast<double>(nsubSum) * hPerL * batch * rowsPerTile * t.blockN * D * 2 * 2;
    double const tL2 = kvBytes / g.l2_bw;
    return std::max({tComp, tL2, tDram}) + 4e-6;
}

// the rows with the caller's constants in place of (or in addition to) the catalogue's
bool rowsWith(stof_presearch_coef_t const* coef, int32_t numCoef, std::vector<TacticRow>& rows) {
    rows.assign(kRows, kRows + kNumRows);
    for (int32_t i = 0; i < numCoef; ++i) {
        auto it = std::find_if(rows.begin(), rows.end(), [&](TacticRow const& r) { return r.id == coef[i].tactic; });
        if (it == rows.end() || it->family == kFamilyRow || (coef[i].head_dim != 64 && coef[i].head_dim != 128))
            return false;
        double* c = it->coef[dIndex(coef[i].head_dim)];
        c[0] = coef[i].a, c[1] = coef[i].b, c[2] = coef[i].c, c[3] = coef[i].d;
        it->hasCoef[dIndex(coef[i].head_dim)] = 1;
    }
    return true;
}

bool layoutArgsOk(stof_gpu_props_t const* gpu, stof_host_layout_t const* layout, int32_t batch, int32_t heads) {
    return gpu != nullptr && layout != nullptr && layout->row_ptr != nullptr && layout->col_idx != nullptr &&
           layout->tile_bitmap_index != nullptr && layout->bitmaps != nullptr && batch >= 1 && heads >= 1 &&
           layout->num_layouts >= 1 && layout->tile_m >= 1 && layout->tile_n >= 32 && layout->layout_seq_q >= 1 &&
           layout->layout_seq_k >= 1 && gpu->sm_count >= 1;
}

}  // namespace

extern "C" {

STOF_API void stof_presearch_h100_props(stof_gpu_props_t* out) {
    if (out == nullptr) return;
    std::memset(out, 0, sizeof(*out));
    out->sm_count = 132;
    out->smem_per_sm = 228 * 1024;
    out->regs_per_sm = 65536;
    out->max_threads_per_sm = 2048;
    out->max_ctas_per_sm = 32;
    out->sm = 90;
    out->clock_hz = 1.755e9;
    out->mma_tflops = 400e12;
    out->dram_bw = 3.0e12;
    out->l2_bw = 6.0e12;
    out->wgmma_tflops = 700e12;
}

STOF_API stof_status_t stof_presearch_rank_coef(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                                int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                                int32_t seq_k, const stof_presearch_coef_t* coef, int32_t num_coef,
                                                int32_t* ids, double* seconds, int32_t cap, int32_t* n) {
    if (n == nullptr || !layoutArgsOk(gpu, layout, batch, heads) || num_coef < 0 || (num_coef > 0 && !coef))
        return STOF_ERROR_INVALID_ARGUMENT;
    int const sq = seq_q > 0 ? std::min(seq_q, layout->layout_seq_q) : layout->layout_seq_q;
    int const sk = seq_k > 0 ? std::min(seq_k, layout->layout_seq_k) : layout->layout_seq_k;
    try {
        std::vector<TacticRow> rows;
        if (!rowsWith(coef, num_coef, rows)) return STOF_ERROR_INVALID_ARGUMENT;
        Stats const s = tileStats(*layout);
        bool const hopper = gpu->wgmma_tflops > 0;
        std::vector<std::pair<int32_t, double>> ranked;
        for (TacticRow const& t : rows) {
            if (!valid(t, layout->tile_m, layout->tile_n, head_dim, hopper)) continue;
            ranked.emplace_back(t.id, predict(s, t, batch, heads, head_dim, sq, sk, *gpu));
        }
        std::stable_sort(ranked.begin(), ranked.end(),
                         [](auto const& a, auto const& b) { return a.second < b.second; });
        *n = static_cast<int32_t>(ranked.size());
        int32_t const m = std::min<int32_t>(*n, std::max<int32_t>(cap, 0));
        for (int32_t i = 0; i < m; ++i) {
            if (ids) ids[i] = ranked[i].first;
            if (seconds) seconds[i] = ranked[i].second;
        }
        return *n > cap ? STOF_ERROR_INSUFFICIENT_BUFFER : STOF_SUCCESS;
    } catch (...) {
        return STOF_ERROR_INVALID_ARGUMENT;
    }
}

STOF_API stof_status_t stof_presearch_rank(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                           int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                           int32_t seq_k, int32_t* ids, double* seconds, int32_t cap, int32_t* n) {
    return stof_presearch_rank_coef(gpu, layout, batch, heads, head_dim, seq_q, seq_k, nullptr, 0, ids, seconds, cap,
                                    n);
}

STOF_API stof_status_t stof_presearch_terms(const stof_gpu_props_t* gpu, const stof_host_layout_t* layout,
                                            int32_t batch, int32_t heads, int32_t head_dim, int32_t seq_q,
                                            int32_t tactic, double* terms) {
    if (terms == nullptr || !layoutArgsOk(gpu, layout, batch, heads) || (head_dim != 64 && head_dim != 128))
        return STOF_ERROR_INVALID_ARGUMENT;
    TacticRow const* t = std::find_if(kRows, kRows + kNumRows, [&](TacticRow const& r) { return r.id == tactic; });
    if (t == kRows + kNumRows) return STOF_ERROR_INVALID_TACTIC;
    if (t->family == kFamilyRow) return STOF_ERROR_UNSUPPORTED;  // the row-wise model has no constants
    int const occ = occupancy(*t, head_dim, *gpu);
    if (occ == 0) return STOF_ERROR_UNSUPPORTED;
    int const sq = seq_q > 0 ? std::min(seq_q, layout->layout_seq_q) : layout->layout_seq_q;
    try {
        Stats const s = tileStats(*layout);
        std::vector<std::vector<double>> full, part;
        ctaWork(s, *t, sq, full, part);
        double sumFull = 0.0, sumPart = 0.0, ctas = 0.0;  // integers: exact in any order
        for (int l = 0; l < s.L; ++l)
            for (size_t i = 0; i < full[l].size(); ++i) sumFull += full[l][i], sumPart += part[l][i], ctas += 1.0;
        double const reps = static_cast<double>(batch) * heads / s.L;
        double const slots = static_cast<double>(gpu->sm_count) * occ;
        terms[0] = sumFull * reps / slots;
        terms[1] = sumPart * reps / slots;
        terms[2] = ctas * splitCount(s, *t, batch, heads, sq, *gpu) * reps / slots;
        terms[3] = 1.0;
        return STOF_SUCCESS;
    } catch (...) {
        return STOF_ERROR_INVALID_ARGUMENT;
    }
}

}  // extern "C"
