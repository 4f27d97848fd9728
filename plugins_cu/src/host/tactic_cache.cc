// Tactic caches (the JSON that stof_trt/tactic_cache.py writes, docs/ort.md): a small recursive-descent JSON
// parser, the lookup table built from a file's "entries", and the process's table of read files.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "host.h"

namespace {

constexpr const char* kCacheFormat = "stof-tactic-cache";
constexpr int kCacheVersion = 1;

constexpr int kMAX_DEPTH = 64;

struct Json {
    enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind{kNull};
    bool b{false};
    double num{0};
    std::string str;
    std::vector<Json> arr;
    std::vector<std::pair<std::string, Json>> obj;

    Json const* get(std::string const& key) const {
        for (auto const& kv : obj)
            if (kv.first == key) return &kv.second;
        return nullptr;
    }
};

class Parser {
public:
    Parser(std::string const& text, std::string const& path) : mText(text), mPath(path) {}

    Json parseDocument() {
        Json v = parseValue(0);
        skipSpace();
        if (mPos != mText.size()) fail("trailing characters");
        return v;
    }

private:
    [[noreturn]] void fail(char const* what) {
        throw std::runtime_error("tactic cache " + mPath + ": malformed JSON at offset " + std::to_string(mPos) +
                                 " (" + what + ")");
    }
    void skipSpace() {
        while (mPos < mText.size() && (mText[mPos] == ' ' || mText[mPos] == '\n' || mText[mPos] == '\r' ||
                                       mText[mPos] == '\t'))
            ++mPos;
    }
    bool consume(char c) {
        skipSpace();
        if (mPos < mText.size() && mText[mPos] == c) {
            ++mPos;
            return true;
        }
        return false;
    }
    void expect(char c) {
        if (!consume(c)) fail("unexpected character");
    }
    void appendUtf8(std::string& s, uint32_t cp) {
        if (cp < 0x80) {
            s.push_back(char(cp));
        } else if (cp < 0x800) {
            s.push_back(char(0xC0 | (cp >> 6)));
            s.push_back(char(0x80 | (cp & 0x3F)));
        } else {
            s.push_back(char(0xE0 | (cp >> 12)));
            s.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
            s.push_back(char(0x80 | (cp & 0x3F)));
        }
    }
    std::string parseString() {
        skipSpace();
        if (mPos >= mText.size() || mText[mPos] != '"') fail("expected a string");
        ++mPos;
        std::string s;
        while (true) {
            if (mPos >= mText.size()) fail("unterminated string");
            char c = mText[mPos++];
            if (c == '"') break;
            if (c != '\\') {
                s.push_back(c);
                continue;
            }
            if (mPos >= mText.size()) fail("bad escape");
            char e = mText[mPos++];
            switch (e) {
            case '"': s.push_back('"'); break;
            case '\\': s.push_back('\\'); break;
            case '/': s.push_back('/'); break;
            case 'b': s.push_back('\b'); break;
            case 'f': s.push_back('\f'); break;
            case 'n': s.push_back('\n'); break;
            case 'r': s.push_back('\r'); break;
            case 't': s.push_back('\t'); break;
            case 'u': {
                if (mPos + 4 > mText.size()) fail("bad \\u escape");
                uint32_t cp = 0;
                for (int i = 0; i < 4; ++i) {
                    char h = mText[mPos++];
                    cp <<= 4;
                    if (h >= '0' && h <= '9') cp |= uint32_t(h - '0');
                    else if (h >= 'a' && h <= 'f') cp |= uint32_t(h - 'a' + 10);
                    else if (h >= 'A' && h <= 'F') cp |= uint32_t(h - 'A' + 10);
                    else fail("bad \\u escape");
                }
                appendUtf8(s, cp);
                break;
            }
            default: fail("bad escape");
            }
        }
        return s;
    }
    Json parseValue(int depth) {
        if (depth > kMAX_DEPTH) fail("nested too deeply");
        skipSpace();
        if (mPos >= mText.size()) fail("unexpected end");
        Json v;
        char c = mText[mPos];
        if (c == '{') {
            ++mPos;
            v.kind = Json::kObject;
            if (consume('}')) return v;
            do {
                std::string key = parseString();
                expect(':');
                v.obj.emplace_back(std::move(key), parseValue(depth + 1));
            } while (consume(','));
            expect('}');
        } else if (c == '[') {
            ++mPos;
            v.kind = Json::kArray;
            if (consume(']')) return v;
            do {
                v.arr.push_back(parseValue(depth + 1));
            } while (consume(','));
            expect(']');
        } else if (c == '"') {
            v.kind = Json::kString;
            v.str = parseString();
        } else if (mText.compare(mPos, 4, "true") == 0) {
            mPos += 4;
            v.kind = Json::kBool;
            v.b = true;
        } else if (mText.compare(mPos, 5, "false") == 0) {
            mPos += 5;
            v.kind = Json::kBool;
        } else if (mText.compare(mPos, 4, "null") == 0) {
            mPos += 4;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            char const* start = mText.c_str() + mPos;
            char* end = nullptr;
            v.kind = Json::kNumber;
            v.num = std::strtod(start, &end);
            if (end == start) fail("bad number");
            mPos += size_t(end - start);
        } else {
            fail("unexpected character");
        }
        return v;
    }

    std::string const& mText;
    std::string const& mPath;
    size_t mPos{0};
};

using Key = std::string;  // gpu, cc, node, bucket, mask joined by '\n' (none of them holds one)

Key make_key(const std::string& gpu, const std::string& cc, const std::string& node, const std::string& bucket,
             const std::string& mask) {
    return gpu + '\n' + cc + '\n' + node + '\n' + bucket + '\n' + mask;
}

using Table = std::map<Key, int32_t>;

std::shared_ptr<const Table> parse_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in.good()) throw std::runtime_error("tactic cache " + path + " cannot be read");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    Json doc = Parser(text, path).parseDocument();
    auto bad = [&](const std::string& what) { return std::runtime_error("tactic cache " + path + ": " + what); };
    if (doc.kind != Json::kObject) throw bad("not a JSON object");
    const Json* fmt = doc.get("format");
    if (!fmt || fmt->kind != Json::kString || fmt->str != kCacheFormat)
        throw bad(std::string("\"format\" is not \"") + kCacheFormat + "\"");
    const Json* ver = doc.get("version");
    if (!ver || ver->kind != Json::kNumber || ver->num != kCacheVersion)
        throw bad("unsupported version (this library reads version " + std::to_string(kCacheVersion) + ")");
    const Json* entries = doc.get("entries");
    if (!entries || entries->kind != Json::kArray) throw bad("no \"entries\" array");
    auto table = std::make_shared<Table>();
    for (const Json& e : entries->arr) {
        if (e.kind != Json::kObject) throw bad("an entry is not an object");
        auto str = [&](const char* k) -> std::string {
            const Json* v = e.get(k);
            if (!v || v->kind != Json::kString) throw bad(std::string("entry without string \"") + k + "\"");
            return v->str;
        };
        const Json* t = e.get("tactic");
        if (!t || t->kind != Json::kNumber || !(t->num >= 1 && t->num < 1e6) || std::floor(t->num) != t->num)
            throw bad("entry with a bad \"tactic\"");
        (*table)[make_key(str("gpu"), str("cc"), str("node"), str("bucket"), str("mask"))] = int32_t(t->num);
    }
    return table;
}

// Files read so far, by path, each with the generation of its read; never freed (handles may be in use on other
// threads).
struct Loaded {
    std::shared_ptr<const Table> table;
    uint64_t generation;
};
std::mutex gMutex;
uint64_t gGeneration = 0;
std::map<std::string, Loaded>& files() {
    static auto* m = new std::map<std::string, Loaded>();
    return *m;
}

stof_status_t load(const std::string& path, bool reload, Loaded* out) {
    {
        std::lock_guard<std::mutex> lock(gMutex);
        auto it = files().find(path);
        if (!reload && it != files().end()) {
            *out = it->second;
            return STOF_SUCCESS;
        }
    }
    std::shared_ptr<const Table> t;
    try {
        t = parse_file(path);
    } catch (const std::exception& e) {
        return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "%s", e.what());
    }
    std::lock_guard<std::mutex> lock(gMutex);
    *out = Loaded{t, ++gGeneration};
    files()[path] = *out;
    return STOF_SUCCESS;
}

int64_t round_pow2(int64_t v, int64_t lo) {
    int64_t p = lo;
    while (p < v) p <<= 1;
    return p;
}

}  // namespace

namespace stof {
namespace host {

stof_status_t cache_generation(const std::string& path, uint64_t* generation) {
    Loaded l;
    const stof_status_t s = load(path, false, &l);
    if (s == STOF_SUCCESS) *generation = l.generation;
    return s;
}

stof_status_t cache_lookup(const std::string& path, const std::string& gpu, const std::string& cc,
                           const std::string& node, const std::string& bucket, const std::string& mask,
                           int32_t* tactic) {
    Loaded l;
    const stof_status_t s = load(path, false, &l);
    if (s != STOF_SUCCESS) return s;
    auto it = l.table->find(make_key(gpu, cc, node, bucket, mask));
    *tactic = it == l.table->end() ? 0 : it->second;
    return STOF_SUCCESS;
}

std::string shape_bucket(int64_t batch, int64_t seq_q, int64_t seq_k) {
    return "B" + std::to_string(round_pow2(batch, 1)) + "|Sq" + std::to_string(round_pow2(seq_q, 64)) + "|Sk" +
           std::to_string(round_pow2(seq_k, 64));
}

}  // namespace host
}  // namespace stof

extern "C" {

stof_status_t stof_tactic_cache_load(const char* path, int32_t* entries) {
    if (path == nullptr || *path == '\0') return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "tactic cache: no path");
    Loaded l;
    const stof_status_t s = load(path, true, &l);
    if (s != STOF_SUCCESS) return s;
    if (entries) *entries = static_cast<int32_t>(l.table->size());
    stof::host::clear_error();
    return STOF_SUCCESS;
}

stof_status_t stof_shape_bucket(int64_t batch, int64_t seq_q, int64_t seq_k, char* out, size_t cap) {
    if (out == nullptr || cap == 0) return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "out is NULL");
    if (batch < 1 || seq_q < 1 || seq_k < 1 || batch > (int64_t(1) << 40) || seq_q > (int64_t(1) << 40) ||
        seq_k > (int64_t(1) << 40))
        return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "sizes must be in [1, 2^40]");
    const std::string b = stof::host::shape_bucket(batch, seq_q, seq_k);
    if (b.size() + 1 > cap)
        return stof::host::fail(STOF_ERROR_INSUFFICIENT_BUFFER, "bucket needs %zu bytes", b.size() + 1);
    std::snprintf(out, cap, "%s", b.c_str());
    stof::host::clear_error();
    return STOF_SUCCESS;
}

}  // extern "C"
