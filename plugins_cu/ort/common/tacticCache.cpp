// Tactic-cache reader: a small recursive-descent JSON parser (objects, arrays, strings, numbers, literals) and
// the lookup table built from the cache's "entries".
#include "tacticCache.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "ortCommon.h"

namespace stof_ort {
namespace {

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
        throw StofOrtError(ORT_INVALID_ARGUMENT,
                           strCat("tactic cache ", mPath, ": malformed JSON at offset ", mPos, " (", what, ")"));
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

int64_t roundPow2(int64_t v, int64_t lo) {
    int64_t p = lo;
    while (p < v) p <<= 1;
    return p;
}

}  // namespace

std::string shapeBucket(int64_t batch, int64_t seqQ, int64_t seqK) {
    return strCat("B", roundPow2(batch, 1), "|Sq", roundPow2(seqQ, 64), "|Sk", roundPow2(seqK, 64));
}

std::shared_ptr<TacticCache const> TacticCache::load(std::string const& path) {
    std::ifstream in(path, std::ios::binary);
    STOF_VALIDATE(in.good(), "tactic cache ", path, " cannot be read (set by ", kCONFIG_TACTIC_CACHE, " or ",
                  kENV_TACTIC_CACHE, ")");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string const text = ss.str();
    Json doc = Parser(text, path).parseDocument();
    STOF_VALIDATE(doc.kind == Json::kObject, "tactic cache ", path, ": not a JSON object");
    Json const* fmt = doc.get("format");
    STOF_VALIDATE(fmt && fmt->kind == Json::kString && fmt->str == kCACHE_FORMAT, "tactic cache ", path,
                  ": \"format\" is not \"", kCACHE_FORMAT, "\"");
    Json const* ver = doc.get("version");
    STOF_VALIDATE(ver && ver->kind == Json::kNumber && int(ver->num) == kCACHE_VERSION, "tactic cache ", path,
                  ": unsupported version (this plugin reads version ", kCACHE_VERSION, ")");
    auto cache = std::make_shared<TacticCache>();
    cache->mPath = path;
    Json const* entries = doc.get("entries");
    STOF_VALIDATE(entries && entries->kind == Json::kArray, "tactic cache ", path, ": no \"entries\" array");
    for (Json const& e : entries->arr) {
        STOF_VALIDATE(e.kind == Json::kObject, "tactic cache ", path, ": an entry is not an object");
        auto str = [&](char const* k) -> std::string {
            Json const* v = e.get(k);
            STOF_VALIDATE(v && v->kind == Json::kString, "tactic cache ", path, ": entry without string \"", k,
                          "\"");
            return v->str;
        };
        Json const* t = e.get("tactic");
        STOF_VALIDATE(t && t->kind == Json::kNumber && t->num >= 1 && t->num < 1e6 && std::floor(t->num) == t->num,
                      "tactic cache ", path, ": entry with a bad \"tactic\"");
        cache->mEntries[Key{str("gpu"), str("cc"), str("node"), str("bucket"), str("mask")}] = int32_t(t->num);
    }
    return cache;
}

int32_t TacticCache::lookup(std::string const& gpu, std::string const& cc, std::string const& node,
                            std::string const& bucket, std::string const& mask) const {
    auto it = mEntries.find(Key{gpu, cc, node, bucket, mask});
    return it == mEntries.end() ? 0 : it->second;
}

}  // namespace stof_ort
