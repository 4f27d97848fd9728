// The mask-spec compiler of the host layer: parses the closed-form part of the spec grammar of stof_trt/masks.py
// (full, causal, sliding, dilated, global, longformer, bigbird without random blocks; '|', '&', parentheses) and
// compiles a spec for any (seq_q, seq_k, tile_m, tile_n) into exactly the arrays stof_trt.format.compile_mask
// produces (docs/format.md: same stored tiles, same order, same bits, bitmaps numbered in order of first use).  What
// lets a node carrying its spec run at any length: the layout is built for the run-time length here.
//
// Work follows the stored tiles, never the Tq x Tk grid: each tile row gets the column intervals the spec may
// store (a band's few tiles, a global token's row), each such tile is classified from its index ranges, and of the
// tiles left undecided one per key (the facts that fix its bits: a band's diagonal offset, the global rows and
// columns it holds, its extent at the matrix edge) is evaluated element by element.  Every closed-form pattern
// is a function of (query, key) alone, not of the sizes, which is what makes those keys exact at the edges too.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "host.h"

namespace {

using stof::host::fail;

constexpr int64_t kIntMax = 2147483647;  // the tile format and the kernels index with int32
constexpr int kMaxNesting = 64;          // masks.MAX_NESTING
constexpr int8_t kEmpty = 0, kFull = 1, kUnknown = -1;

// A parse or compile error carrying its status and one-line message.
struct SpecError {
    stof_status_t status;
    std::string message;
};

[[noreturn]] void bad(const std::string& msg) { throw SpecError{STOF_ERROR_INVALID_ARGUMENT, msg}; }
[[noreturn]] void unsupported(const std::string& msg) { throw SpecError{STOF_ERROR_UNSUPPORTED, msg}; }

// Sorted disjoint closed intervals of tile columns.
using Intervals = std::vector<std::pair<int64_t, int64_t>>;

Intervals unite(const Intervals& a, const Intervals& b) {
    Intervals all(a);
    all.insert(all.end(), b.begin(), b.end());
    std::sort(all.begin(), all.end());
    Intervals out;
    for (const auto& iv : all) {
        if (!out.empty() && iv.first <= out.back().second + 1)
            out.back().second = std::max(out.back().second, iv.second);
        else
            out.push_back(iv);
    }
    return out;
}

Intervals intersect(const Intervals& a, const Intervals& b) {
    Intervals out;
    size_t i = 0, j = 0;
    while (i < a.size() && j < b.size()) {
        const int64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
        if (lo <= hi) out.emplace_back(lo, hi);
        (a[i].second < b[j].second) ? ++i : ++j;
    }
    return out;
}

// The sizes a spec is compiled for.
struct Grid {
    int64_t seq_q, seq_k, tile_m, tile_n, tq, tk;
};

// A tile: rows [r0, r1), columns [c0, c1) clipped to the matrix (r0 + tile_m, c0 + tile_n unclipped).
struct Tile {
    int64_t r0, r1, c0, c1;
};

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); }

class Spec {
public:
    virtual ~Spec() = default;
    // The tile columns of tile row i that may hold an allowed element (a superset).
    virtual Intervals candidates(const Grid& g, int64_t i) const = 0;
    // kFull / kEmpty (exact) or kUnknown; for kUnknown appends the key that, with the tile's clipped extent, fixes
    // its bits (a fixed number of entries per node, so keys of one spec never collide across shapes).
    virtual int8_t classify(const Grid& g, const Tile& t, std::vector<int64_t>& key) const = 0;
    virtual bool allowed(int64_t q, int64_t k) const = 0;
};

// lo <= k - q <= hi (a side of kNone is unbounded); with a dilation, only every dilation-th diagonal.
class Band : public Spec {
public:
    static constexpr int64_t kNone = INT64_MIN;
    Band(int64_t lo, int64_t hi, int64_t dilation) : lo_(lo), hi_(hi), dil_(dilation) {}

    Intervals candidates(const Grid& g, int64_t i) const override {
        const int64_t r0 = i * g.tile_m, r1 = std::min(r0 + g.tile_m, g.seq_q) - 1;
        const int64_t k0 = lo_ == kNone ? 0 : std::max<int64_t>(0, r0 + lo_);
        const int64_t k1 = std::min(g.seq_k - 1, r1 + hi_);
        if (k0 > k1) return {};
        return {{k0 / g.tile_n, k1 / g.tile_n}};
    }
    int8_t classify(const Grid& g, const Tile& t, std::vector<int64_t>& key) const override {
        const int64_t dmin = t.c0 - (t.r1 - 1), dmax = (t.c1 - 1) - t.r0;
        if ((lo_ != kNone && dmax < lo_) || dmin > hi_) return kEmpty;
        const bool inside = (lo_ == kNone || dmin >= lo_) && dmax <= hi_;
        if (inside && dil_ == 1) return kFull;
        // the bits depend on the diagonal offset of the tile's corner alone; inside the band, on that offset
        // modulo the dilation
        key.push_back(inside);
        key.push_back(inside ? (t.c0 - t.r0) % dil_ : t.c0 - t.r0);
        (void)g;
        return kUnknown;
    }
    bool allowed(int64_t q, int64_t k) const override {
        const int64_t d = k - q;
        return (lo_ == kNone || d >= lo_) && d <= hi_ && d % dil_ == 0;
    }

private:
    int64_t lo_, hi_, dil_;
};

// Global tokens: a pair is allowed when its query or its key is one; the first n tokens or a sorted list.
class Global : public Spec {
public:
    explicit Global(int64_t n) : prefix_(true), n_(std::max<int64_t>(n, 0)) {}
    explicit Global(std::vector<int64_t> tokens) : prefix_(false), n_(0), tokens_(std::move(tokens)) {
        std::sort(tokens_.begin(), tokens_.end());
        tokens_.erase(std::unique(tokens_.begin(), tokens_.end()), tokens_.end());
    }

    Intervals candidates(const Grid& g, int64_t i) const override {
        const int64_t r0 = i * g.tile_m, r1 = std::min(r0 + g.tile_m, g.seq_q);
        if (count(r0, r1) > 0) return {{0, g.tk - 1}};
        if (prefix_) {
            const int64_t n = std::min(n_, g.seq_k);
            if (n == 0) return {};
            return {{0, (n - 1) / g.tile_n}};
        }
        Intervals out;
        for (int64_t tok : tokens_) {
            if (tok >= g.seq_k) break;
            const int64_t c = tok / g.tile_n;
            if (!out.empty() && out.back().second + 1 >= c)
                out.back().second = std::max(out.back().second, c);
            else
                out.emplace_back(c, c);
        }
        return out;
    }
    int8_t classify(const Grid& g, const Tile& t, std::vector<int64_t>& key) const override {
        const int64_t nr = count(t.r0, t.r1), nc = count(t.c0, t.c1);
        if (nr == t.r1 - t.r0 || nc == t.c1 - t.c0) return kFull;
        if (nr == 0 && nc == 0) return kEmpty;
        if (prefix_) {
            // the global rows and columns are a prefix of the tile's: their counts fix the bits
            key.push_back(clamp64(n_ - t.r0, 0, g.tile_m));
            key.push_back(clamp64(n_ - t.c0, 0, g.tile_n));
        } else {
            key.push_back(count(t.r0, t.r0 + g.tile_m) ? t.r0 : -1);
            key.push_back(count(t.c0, t.c0 + g.tile_n) ? t.c0 : -1);
        }
        return kUnknown;
    }
    bool allowed(int64_t q, int64_t k) const override { return member(q) || member(k); }

private:
    // Global tokens in [a, b).
    int64_t count(int64_t a, int64_t b) const {
        if (prefix_) return std::max<int64_t>(0, std::min(b, n_) - a);
        const auto lo = std::lower_bound(tokens_.begin(), tokens_.end(), a);
        return std::lower_bound(lo, tokens_.end(), b) - lo;
    }
    bool member(int64_t x) const {
        return prefix_ ? x < n_ : std::binary_search(tokens_.begin(), tokens_.end(), x);
    }
    bool prefix_;
    int64_t n_;
    std::vector<int64_t> tokens_;
};

// BigBird without random blocks, on a grid of block x block squares: |kb - qb| <= window, or qb or kb < global.
class BigBird : public Spec {
public:
    BigBird(int64_t block, int64_t window, int64_t global) : b_(block), w_(window), gtok_(global * block) {}

    Intervals candidates(const Grid& g, int64_t i) const override {
        const int64_t r0 = i * g.tile_m, r1 = std::min(r0 + g.tile_m, g.seq_q);
        if (r0 < gtok_) return {{0, g.tk - 1}};
        const int64_t qb0 = r0 / b_, qb1 = (r1 - 1) / b_;
        Intervals out;
        const int64_t k0 = std::max<int64_t>(0, (qb0 - w_) * b_);
        const int64_t k1 = std::min(g.seq_k - 1, (qb1 + w_ + 1) * b_ - 1);  // qb1 + w_ + 1 <= 2^32: no overflow
        if (k0 <= k1) out.emplace_back(k0 / g.tile_n, k1 / g.tile_n);
        const int64_t gk = std::min(gtok_, g.seq_k);
        if (gk > 0) out = unite(out, {{0, (gk - 1) / g.tile_n}});
        return out;
    }
    int8_t classify(const Grid& g, const Tile& t, std::vector<int64_t>& key) const override {
        if (t.r1 <= gtok_ || t.c1 <= gtok_) return kFull;
        const int64_t qb0 = t.r0 / b_, qb1 = (t.r1 - 1) / b_, kb0 = t.c0 / b_, kb1 = (t.c1 - 1) / b_;
        const int64_t dmin = kb0 - qb1, dmax = kb1 - qb0;
        if (dmin >= -w_ && dmax <= w_) return kFull;
        if ((dmax < -w_ || dmin > w_) && t.r0 >= gtok_ && t.c0 >= gtok_) return kEmpty;
        // the corner's place in its block, the block offset and the global rows and columns fix the bits
        key.push_back(t.r0 % b_);
        key.push_back(t.c0 % b_);
        key.push_back(t.c0 / b_ - t.r0 / b_);
        key.push_back(clamp64(gtok_ - t.r0, 0, g.tile_m));
        key.push_back(clamp64(gtok_ - t.c0, 0, g.tile_n));
        return kUnknown;
    }
    bool allowed(int64_t q, int64_t k) const override {
        const int64_t d = k / b_ - q / b_;
        return (d >= -w_ && d <= w_) || q < gtok_ || k < gtok_;
    }

private:
    int64_t b_, w_, gtok_;
};

class Combine : public Spec {
public:
    Combine(bool is_union, std::vector<std::unique_ptr<Spec>> parts) : union_(is_union), parts_(std::move(parts)) {}

    Intervals candidates(const Grid& g, int64_t i) const override {
        Intervals out = parts_[0]->candidates(g, i);
        for (size_t p = 1; p < parts_.size(); ++p)
            out = union_ ? unite(out, parts_[p]->candidates(g, i)) : intersect(out, parts_[p]->candidates(g, i));
        return out;
    }
    int8_t classify(const Grid& g, const Tile& t, std::vector<int64_t>& key) const override {
        const size_t mark = key.size();
        bool all_decisive = true;  // union: every part EMPTY; intersection: every part FULL
        for (const auto& p : parts_) {
            const size_t at = key.size();
            key.push_back(0);  // the part's class, then its key when unknown
            const int8_t c = p->classify(g, t, key);
            key[at] = c;
            if (union_ ? c == kFull : c == kEmpty) {
                key.resize(mark);
                return union_ ? kFull : kEmpty;
            }
            all_decisive = all_decisive && (union_ ? c == kEmpty : c == kFull);
        }
        if (all_decisive) {
            key.resize(mark);
            return union_ ? kEmpty : kFull;
        }
        return kUnknown;
    }
    bool allowed(int64_t q, int64_t k) const override {
        for (const auto& p : parts_)
            if (p->allowed(q, k) == union_) return union_;
        return !union_;
    }

private:
    bool union_;
    std::vector<std::unique_ptr<Spec>> parts_;
};

// --- parsing (stof_trt/masks.py _parse) -------------------------------------------------------------------------

std::string strip(const std::string& s) {
    size_t a = 0, b = s.size();
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    return s.substr(a, b - a);
}

std::vector<std::string> split_top(const std::string& text, char sep) {
    std::vector<std::string> parts;
    int depth = 0;
    size_t start = 0;
    char quote = 0;
    for (size_t i = 0; i < text.size(); ++i) {
        const char ch = text[i];
        if (quote) {  // a quoted path: separators inside are part of it
            if (ch == quote) quote = 0;
            continue;
        }
        if (ch == '\'' || ch == '"') {
            quote = ch;
        } else if (ch == '(') {
            ++depth;
        } else if (ch == ')') {
            if (--depth < 0) bad("unbalanced ')' in mask spec '" + text + "'");
        } else if (ch == sep && depth == 0) {
            parts.push_back(text.substr(start, i - start));
            start = i + 1;
        }
    }
    if (quote) bad(std::string("unclosed quote ") + quote + " in mask spec '" + text + "'");
    if (depth) bad("unbalanced '(' in mask spec '" + text + "'");
    parts.push_back(text.substr(start));
    return parts;
}

// An integer as Python's int() of masks._args reads it: [-]digits; at most 2^31 - 1 in magnitude.
bool parse_int(const std::string& s, bool allow_plus, int64_t* out) {
    size_t i = 0;
    bool neg = false;
    if (i < s.size() && (s[i] == '-' || (allow_plus && s[i] == '+'))) neg = s[i++] == '-';
    if (i == s.size()) return false;
    int64_t v = 0;
    for (; i < s.size(); ++i) {
        if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
        v = std::min<int64_t>(v * 10 + (s[i] - '0'), int64_t{1} << 40);  // saturate: the range check follows
    }
    *out = neg ? -v : v;
    return true;
}

enum class ArgType { kInt, kFloat, kBool, kTokens, kStr };

struct Arg {
    bool given = false;
    int64_t i = 0;
    double f = 0;
    std::string s;
    std::vector<int64_t> tokens;
};

using Args = std::vector<std::pair<std::string, Arg>>;

Arg* find(Args& a, const char* key) {
    for (auto& kv : a)
        if (kv.first == key) return &kv.second;
    return nullptr;
}

bool has(Args& a, const char* key) {
    Arg* x = find(a, key);
    return x != nullptr && x->given;
}

const char* type_name(ArgType t) {
    return t == ArgType::kInt ? "int" : t == ArgType::kFloat ? "float" : t == ArgType::kBool ? "bool"
           : t == ArgType::kTokens ? "tuple" : "str";
}

Args parse_args(const std::string& name, const std::string& text,
                const std::vector<std::pair<const char*, ArgType>>& allowed) {
    Args out;
    for (const auto& a : allowed) out.emplace_back(a.first, Arg{});
    if (text.empty()) return out;
    size_t start = 0;
    while (true) {
        const size_t comma = text.find(',', start);
        const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        const size_t eq = item.find('=');
        if (eq == std::string::npos) bad("mask '" + name + "': expected key=value, got '" + item + "'");
        const std::string key = strip(item.substr(0, eq)), val = strip(item.substr(eq + 1));
        size_t idx = allowed.size();
        for (size_t k = 0; k < allowed.size(); ++k)
            if (key == allowed[k].first) idx = k;
        if (idx == allowed.size()) {
            std::string names;
            for (const auto& a : allowed) names += (names.empty() ? "" : ", ") + std::string(a.first);
            bad("mask '" + name + "': unknown argument '" + key + "' (" +
                (names.empty() ? std::string("it takes none") : "expected one of " + names) + ")");
        }
        const ArgType type = allowed[idx].second;
        Arg& arg = out[idx].second;
        if (arg.given) bad("mask '" + name + "': '" + key + "' given twice");
        arg = Arg{};
        arg.given = true;
        bool ok = true;
        if (type == ArgType::kInt) {
            ok = parse_int(val, false, &arg.i);
            if (ok && (arg.i > kIntMax || arg.i < -kIntMax))
                bad("mask '" + name + "': " + key + "=" + val + " is out of range (at most 2147483647)");
        } else if (type == ArgType::kFloat) {
            char* end = nullptr;
            errno = 0;
            arg.f = val.empty() ? 0 : std::strtod(val.c_str(), &end);
            ok = !val.empty() && end != nullptr && *end == '\0';
        } else if (type == ArgType::kBool) {
            ok = val == "0" || val == "1" || val == "true" || val == "false";
            arg.i = val == "1" || val == "true";
        } else if (type == ArgType::kTokens) {
            size_t s = 0;
            while (ok) {
                const size_t semi = val.find(';', s);
                const std::string tok = val.substr(s, semi == std::string::npos ? std::string::npos : semi - s);
                if (!tok.empty()) {
                    int64_t v = 0;
                    ok = parse_int(strip(tok), true, &v);
                    if (ok && (v > kIntMax || v < -kIntMax))
                        bad("mask '" + name + "': a token of " + key + "= is out of range (at most 2147483647)");
                    arg.tokens.push_back(v);
                }
                if (semi == std::string::npos) break;
                s = semi + 1;
            }
        } else {
            arg.s = val;
        }
        if (!ok)
            bad("mask '" + name + "': bad value '" + val + "' for '" + key + "' (expected " + type_name(type) + ")");
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

// (left, right) of masks._window_sides.
std::pair<int64_t, int64_t> window_sides(const std::string& name, Args& a) {
    if (has(a, "window")) {
        if (has(a, "left") || has(a, "right")) bad("mask '" + name + "': give window= or left=/right=, not both");
        const int64_t w = find(a, "window")->i;
        return {w, has(a, "causal") && find(a, "causal")->i ? 0 : w};
    }
    if (has(a, "left") || has(a, "right"))
        return {has(a, "left") ? find(a, "left")->i : 0, has(a, "right") ? find(a, "right")->i : 0};
    bad("mask '" + name + "' needs 'window=...' (or left=/right=)");
}

std::unique_ptr<Spec> global_tokens(std::vector<int64_t> tokens) {
    for (int64_t t : tokens)
        if (t < 0) bad("global token positions must be >= 0");
    return std::make_unique<Global>(std::move(tokens));
}

std::unique_ptr<Spec> atom(const std::string& name, const std::string& text) {
    using T = ArgType;
    if (name == "full") {
        parse_args(name, text, {});
        return std::make_unique<Band>(Band::kNone, kIntMax, 1);  // every k - q <= 2^31 - 1
    }
    if (name == "causal") {
        Args a = parse_args(name, text, {{"offset", T::kInt}});
        return std::make_unique<Band>(Band::kNone, find(a, "offset")->i, 1);
    }
    if (name == "sliding" || name == "dilated") {
        const bool dil = name == "dilated";
        std::vector<std::pair<const char*, ArgType>> allowed = {
            {"window", T::kInt}, {"left", T::kInt}, {"right", T::kInt}, {"causal", T::kBool}};
        if (dil) allowed.emplace_back("dilation", T::kInt);
        Args a = parse_args(name, text, allowed);
        const auto lr = window_sides(name, a);
        const int64_t dilation = dil ? (has(a, "dilation") ? find(a, "dilation")->i : 2) : 1;
        if (dil && dilation < 1) bad("dilation must be >= 1, got " + std::to_string(dilation));
        if (lr.first < 0 || lr.second < 0) {
            if (dil) bad("dilated window sides must be >= 0");
            bad("sliding window sides must be >= 0, got left=" + std::to_string(lr.first) +
                ", right=" + std::to_string(lr.second));
        }
        return std::make_unique<Band>(-lr.first, lr.second, dilation);
    }
    if (name == "global") {
        Args a = parse_args(name, text, {{"n", T::kInt}, {"tokens", T::kTokens}});
        if (has(a, "n") == has(a, "tokens")) bad("mask 'global' needs exactly one of n= or tokens=");
        if (has(a, "n") && find(a, "n")->i < 0)
            bad("mask 'global': n=" + std::to_string(find(a, "n")->i) +
                " is negative (the number of leading global tokens)");
        if (has(a, "n")) return std::make_unique<Global>(find(a, "n")->i);
        return global_tokens(find(a, "tokens")->tokens);
    }
    if (name == "longformer") {
        Args a = parse_args(name, text, {{"window", T::kInt}, {"global", T::kInt}, {"tokens", T::kTokens}});
        if (!has(a, "window")) bad("mask 'longformer' needs 'window=...'");
        if (has(a, "global") && has(a, "tokens")) bad("mask 'longformer': give global= or tokens=, not both");
        if (has(a, "global") && find(a, "global")->i < 0)
            bad("mask 'longformer': global=" + std::to_string(find(a, "global")->i) +
                " is negative (the number of leading global tokens)");
        const int64_t w = find(a, "window")->i;
        if (w < 0)
            bad("sliding window sides must be >= 0, got left=" + std::to_string(w) + ", right=" + std::to_string(w));
        std::vector<std::unique_ptr<Spec>> parts;
        parts.push_back(std::make_unique<Band>(-w, w, 1));
        if (has(a, "tokens"))
            parts.push_back(global_tokens(find(a, "tokens")->tokens));
        else
            parts.push_back(std::make_unique<Global>(has(a, "global") ? find(a, "global")->i : 0));
        return std::make_unique<Combine>(true, std::move(parts));
    }
    if (name == "bigbird") {
        Args a = parse_args(name, text, {{"block", T::kInt}, {"window", T::kInt}, {"global", T::kInt},
                                         {"random", T::kFloat}, {"seed", T::kInt}, {"per_head", T::kBool},
                                         {"draw", T::kStr}});
        const int64_t block = has(a, "block") ? find(a, "block")->i : 64;
        const int64_t window = has(a, "window") ? find(a, "window")->i : 1;
        const int64_t global = has(a, "global") ? find(a, "global")->i : 1;
        const double random = has(a, "random") ? find(a, "random")->f : 0.0;
        const int64_t seed = has(a, "seed") ? find(a, "seed")->i : 0;
        if (block < 1) bad("block must be >= 1, got " + std::to_string(block));
        if (has(a, "draw") && find(a, "draw")->s != "row" && find(a, "draw")->s != "grid")
            bad("bigbird draw must be 'row' or 'grid', got '" + find(a, "draw")->s + "'");
        if (window < 0 || global < 0 || !(random >= 0.0 && random <= 1.0) || seed < 0)
            bad("bigbird needs window >= 0, global >= 0, 0 <= random <= 1 and seed >= 0");
        // random blocks are drawn per block row from numpy's generator: not reproduced here
        if (random > 0) {
            char r[32];
            std::snprintf(r, sizeof(r), "%g", random);
            unsupported(std::string("mask 'bigbird' with random blocks (random=") + r +
                        ") is drawn in Python: its layout is not built per length");
        }
        // per_head=1 without random blocks: every head has the same layout (num_layouts copies)
        return std::make_unique<BigBird>(block, window, global);
    }
    if (name == "blocks" || name == "npy")
        unsupported("mask '" + name + "' is a fixed-size array: its layout is not built per length");
    bad("unknown mask '" + name +
        "' (expected one of full, causal, sliding, dilated, global, longformer, bigbird, blocks, npy)");
}

std::unique_ptr<Spec> parse(const std::string& raw, int depth) {
    const std::string text = strip(raw);
    if (text.empty()) bad("empty mask spec");
    if (depth > kMaxNesting) bad("mask spec nests parentheses deeper than 64 levels");
    for (char sep : {'|', '&'}) {
        std::vector<std::string> parts = split_top(text, sep);
        if (parts.size() > 1) {
            std::vector<std::unique_ptr<Spec>> specs;
            for (const auto& p : parts) specs.push_back(parse(p, depth + 1));
            return std::make_unique<Combine>(sep == '|', std::move(specs));
        }
    }
    if (text.front() == '(' && text.back() == ')') return parse(text.substr(1, text.size() - 2), depth + 1);
    const size_t colon = text.find(':');
    std::string name = strip(text.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return atom(name, colon == std::string::npos ? "" : strip(text.substr(colon + 1)));
}

// --- compiling (stof_trt/format.py compile_mask) ----------------------------------------------------------------

struct KeyHash {
    size_t operator()(const std::vector<int64_t>& v) const {
        uint64_t h = 1469598103934665603ull;
        for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
        return static_cast<size_t>(h ^ (h >> 29));
    }
};

}  // namespace

struct stof_mask_layout_st {
    int32_t seq_q = 0, seq_k = 0, tile_m = 0, tile_n = 0, num_layouts = 0;
    std::vector<int32_t> row_ptr, col_idx, tile_bitmap_index, bitmaps;
};

namespace {

void compile(const Spec& spec, const Grid& g, int32_t num_layouts, int64_t max_tiles, stof_mask_layout_st& out) {
    // Refuse before allocating: the candidates bound the stored tiles (O(Tq) intervals).
    const int64_t most = max_tiles / num_layouts;
    int64_t bound = 0;
    for (int64_t i = 0; i < g.tq && bound <= most; ++i)
        for (const auto& iv : spec.candidates(g, i)) bound += iv.second - iv.first + 1;
    if (bound > most)
        bad("mask at " + std::to_string(g.seq_q) + "x" + std::to_string(g.seq_k) + " in " + std::to_string(g.tile_m) +
            "x" + std::to_string(g.tile_n) + " tiles may store more than " + std::to_string(max_tiles) +
            " tiles (the most compiled): use a sparser mask, larger tiles or a shorter sequence");
    const int64_t words = g.tile_m * g.tile_n / 32;
    out.row_ptr.assign(static_cast<size_t>(num_layouts * g.tq + 1), 0);
    std::unordered_map<std::vector<int64_t>, int32_t, KeyHash> by_key;  // -2 EMPTY, -1 FULL, else the bitmap
    std::unordered_map<std::string, int32_t> by_bits;                  // distinct bitmaps, numbered by first use
    std::vector<int64_t> key;
    std::vector<uint32_t> bits(static_cast<size_t>(words));
    for (int64_t i = 0; i < g.tq; ++i) {
        Tile t;
        t.r0 = i * g.tile_m, t.r1 = std::min(t.r0 + g.tile_m, g.seq_q);
        for (const auto& iv : spec.candidates(g, i)) {
            for (int64_t j = iv.first; j <= iv.second; ++j) {
                t.c0 = j * g.tile_n, t.c1 = std::min(t.c0 + g.tile_n, g.seq_k);
                key.clear();
                const int8_t cls = spec.classify(g, t, key);
                int32_t res = cls == kFull ? -1 : -2;
                if (cls == kUnknown) {
                    key.push_back(t.r1 - t.r0);  // the clipped extent: the bits outside the matrix are 0
                    key.push_back(t.c1 - t.c0);
                    auto it = by_key.find(key);
                    if (it != by_key.end()) {
                        res = it->second;
                    } else {
                        std::fill(bits.begin(), bits.end(), 0u);
                        int64_t count = 0;
                        for (int64_t a = 0; a < t.r1 - t.r0; ++a)
                            for (int64_t b = 0; b < t.c1 - t.c0; ++b)
                                if (spec.allowed(t.r0 + a, t.c0 + b)) {
                                    const int64_t e = a * g.tile_n + b;
                                    bits[static_cast<size_t>(e / 32)] |= 1u << (e % 32);
                                    ++count;
                                }
                        if (count == (t.r1 - t.r0) * (t.c1 - t.c0)) {
                            res = -1;
                        } else if (count > 0) {
                            std::string content(reinterpret_cast<const char*>(bits.data()), bits.size() * 4);
                            auto b = by_bits.emplace(std::move(content), static_cast<int32_t>(by_bits.size()));
                            if (b.second) out.bitmaps.insert(out.bitmaps.end(), bits.begin(), bits.end());
                            res = b.first->second;
                        }
                        by_key.emplace(key, res);
                    }
                }
                if (res == -2) continue;
                out.col_idx.push_back(static_cast<int32_t>(j));
                out.tile_bitmap_index.push_back(res);
            }
        }
        out.row_ptr[static_cast<size_t>(i + 1)] = static_cast<int32_t>(out.col_idx.size());
    }
    // Every head the same pattern: the other layouts repeat the first (its bitmaps are all first used there).
    const int64_t nnz = static_cast<int64_t>(out.col_idx.size());
    for (int32_t l = 1; l < num_layouts; ++l) {
        for (int64_t i = 0; i < g.tq; ++i)
            out.row_ptr[static_cast<size_t>(l * g.tq + i + 1)] = static_cast<int32_t>(l * nnz + out.row_ptr[i + 1]);
        out.col_idx.insert(out.col_idx.end(), out.col_idx.begin(), out.col_idx.begin() + nnz);
        out.tile_bitmap_index.insert(out.tile_bitmap_index.end(), out.tile_bitmap_index.begin(),
                                     out.tile_bitmap_index.begin() + nnz);
    }
    if (out.col_idx.empty()) {  // padding entries keep every array non-empty
        out.col_idx.push_back(0);
        out.tile_bitmap_index.push_back(-1);
    }
    if (out.bitmaps.empty()) out.bitmaps.assign(static_cast<size_t>(words), 0);
}

}  // namespace

extern "C" {

STOF_API stof_status_t stof_mask_check(const char* spec) {
    if (spec == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "mask spec is NULL");
    try {
        parse(spec, 0);
    } catch (const SpecError& e) {
        return fail(e.status, "%s", e.message.c_str());
    } catch (const std::bad_alloc&) {
        return fail(STOF_ERROR_INVALID_ARGUMENT, "mask spec: out of host memory");
    }
    stof::host::clear_error();
    return STOF_SUCCESS;
}

STOF_API stof_status_t stof_mask_compile(const char* spec, int32_t seq_q, int32_t seq_k, int32_t tile_m,
                                         int32_t tile_n, int32_t num_layouts, int64_t max_tiles,
                                         stof_mask_layout_t* out) {
    if (out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "mask compile: out is NULL");
    *out = nullptr;
    if (spec == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "mask spec is NULL");
    if (tile_m < 16 || tile_m > 256 || tile_m % 16 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "tile_m must be a multiple of 16 in [16, 256], got %d", tile_m);
    if (tile_n < 32 || tile_n > 256 || tile_n % 32 != 0)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "tile_n must be a multiple of 32 in [32, 256], got %d", tile_n);
    if (seq_q < 1 || seq_k < 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "sequence lengths must be positive integers, got %dx%d", seq_q,
                    seq_k);
    if (num_layouts < 1 || num_layouts > 65535)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_layouts %d must be in [1, 65535]", num_layouts);
    if (max_tiles <= 0) max_tiles = STOF_MASK_MAX_TILES;
    max_tiles = std::min<int64_t>(max_tiles, INT32_MAX);  // row_ptr is int32
    const Grid g{seq_q, seq_k, tile_m, tile_n, (seq_q + int64_t{tile_m} - 1) / tile_m,
                 (seq_k + int64_t{tile_n} - 1) / tile_n};
    if (num_layouts * g.tq > INT32_MAX - 1)
        return fail(STOF_ERROR_INVALID_ARGUMENT, "num_layouts * Tq = %lld tile rows (at most 2^31 - 2)",
                    static_cast<long long>(num_layouts * g.tq));
    stof_mask_layout_st* m = nullptr;
    try {
        std::unique_ptr<Spec> s = parse(spec, 0);
        m = new stof_mask_layout_st();
        m->seq_q = seq_q, m->seq_k = seq_k, m->tile_m = tile_m, m->tile_n = tile_n, m->num_layouts = num_layouts;
        compile(*s, g, num_layouts, max_tiles, *m);
    } catch (const SpecError& e) {
        delete m;
        return fail(e.status, "%s", e.message.c_str());
    } catch (const std::bad_alloc&) {
        delete m;
        return fail(STOF_ERROR_INVALID_ARGUMENT, "mask compile: out of host memory");
    }
    *out = m;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

STOF_API stof_status_t stof_mask_layout_desc(stof_mask_layout_t m, stof_layout_desc_t* out) {
    if (m == nullptr || out == nullptr) return fail(STOF_ERROR_INVALID_ARGUMENT, "mask layout or out is NULL");
    std::memset(out, 0, sizeof(*out));
    out->row_ptr = m->row_ptr.data(), out->row_ptr_len = static_cast<int64_t>(m->row_ptr.size());
    out->col_idx = m->col_idx.data(), out->col_idx_len = static_cast<int64_t>(m->col_idx.size());
    out->tile_bitmap_index = m->tile_bitmap_index.data();
    out->tile_bitmap_index_len = static_cast<int64_t>(m->tile_bitmap_index.size());
    out->bitmaps = m->bitmaps.data(), out->bitmaps_len = static_cast<int64_t>(m->bitmaps.size());
    out->tile_m = m->tile_m, out->tile_n = m->tile_n, out->num_layouts = m->num_layouts;
    out->seq_q = m->seq_q, out->seq_k = m->seq_k;
    out->format_version = STOF_FORMAT_VERSION;
    stof::host::clear_error();
    return STOF_SUCCESS;
}

STOF_API void stof_mask_layout_destroy(stof_mask_layout_t m) { delete m; }

}  // extern "C"
