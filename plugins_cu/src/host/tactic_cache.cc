// Tactic caches (the JSON that stof_trt/tactic_cache.py writes, docs/ort.md): a small recursive-descent JSON
// parser and writer, the lookup table built from a file's "entries", the process's table of read files, and the
// writer that merges one entry into a file (flock on "<path>.lock", re-read, temp file, atomic rename: the
// protocol stof_trt.tactic_cache.TacticCache.merge_save follows too).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
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
constexpr const char* kProfileFormat = "stof-presearch-profile";
constexpr int kProfileVersion = 1;

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

void write_string(std::string& out, const std::string& s) {
    out.push_back('"');
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') {
            out.push_back('\\');
            out.push_back(char(c));
        } else if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
        } else {
            out.push_back(char(c));
        }
    }
    out.push_back('"');
}

// Shortest of %.15g / %.17g that reads back to the same double; non-finite numbers (not JSON) as null.
void write_number(std::string& out, double v) {
    if (!std::isfinite(v)) {
        out += "null";
        return;
    }
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%.15g", v);
    if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof(buf), "%.17g", v);
    out += buf;
}

void write_json(std::string& out, const Json& v, int indent) {
    const std::string pad(size_t(indent + 1), ' ');
    switch (v.kind) {
    case Json::kNull: out += "null"; break;
    case Json::kBool: out += v.b ? "true" : "false"; break;
    case Json::kNumber: write_number(out, v.num); break;
    case Json::kString: write_string(out, v.str); break;
    case Json::kArray:
        out.push_back('[');
        for (size_t i = 0; i < v.arr.size(); ++i) {
            out += i ? ",\n" : "\n";
            out += pad;
            write_json(out, v.arr[i], indent + 1);
        }
        if (!v.arr.empty()) out += "\n" + std::string(size_t(indent), ' ');
        out.push_back(']');
        break;
    case Json::kObject:
        out.push_back('{');
        for (size_t i = 0; i < v.obj.size(); ++i) {
            out += i ? ",\n" : "\n";
            out += pad;
            write_string(out, v.obj[i].first);
            out += ": ";
            write_json(out, v.obj[i].second, indent + 1);
        }
        if (!v.obj.empty()) out += "\n" + std::string(size_t(indent), ' ');
        out.push_back('}');
        break;
    }
}

Json json_string(const std::string& s) {
    Json j;
    j.kind = Json::kString;
    j.str = s;
    return j;
}

Json json_number(double v) {
    Json j;
    j.kind = Json::kNumber;
    j.num = v;
    return j;
}

using Key = std::string;  // gpu, cc, node, bucket, mask joined by '\n' (none of them holds one)

Key make_key(const std::string& gpu, const std::string& cc, const std::string& node, const std::string& bucket,
             const std::string& mask) {
    return gpu + '\n' + cc + '\n' + node + '\n' + bucket + '\n' + mask;
}

using Table = std::map<Key, int32_t>;

Json read_doc(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in.good()) throw std::runtime_error("tactic cache " + path + " cannot be read");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    return Parser(text, path).parseDocument();
}

std::shared_ptr<const Table> table_of(const Json& doc, const std::string& path) {
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

std::shared_ptr<const Table> parse_file(const std::string& path) { return table_of(read_doc(path), path); }

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

// An exclusive flock on "<path>.lock" for the scope: writers of one file (threads, processes, the Python writer)
// take turns; readers need none (the file is only ever replaced by a rename).
class FileLock {
public:
    explicit FileLock(const std::string& path) {
        fd_ = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd_ < 0) return;
        while (::flock(fd_, LOCK_EX) != 0)
            if (errno != EINTR) {
                ::close(fd_);
                fd_ = -1;
                return;
            }
    }
    ~FileLock() {
        if (fd_ >= 0) ::close(fd_);  // closing releases the lock
    }
    bool held() const { return fd_ >= 0; }

private:
    int fd_ = -1;
};

std::string dir_of(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : path.substr(0, slash);
}

// Write text to a temp file next to path, then rename it over path (readers see the old or the new file).
void write_atomic(const std::string& path, const std::string& text) {
    std::string tmpl = dir_of(path) + "/.stof-cache-XXXXXX";
    std::vector<char> name(tmpl.begin(), tmpl.end());
    name.push_back('\0');
    const int fd = ::mkstemp(name.data());
    if (fd < 0)
        throw std::runtime_error("tactic cache " + path + ": cannot create a temp file (" + std::strerror(errno) + ")");
    size_t done = 0;
    while (done < text.size()) {
        const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            const int e = errno;
            ::close(fd);
            ::unlink(name.data());
            throw std::runtime_error("tactic cache " + path + ": write failed (" + std::strerror(e) + ")");
        }
        done += size_t(w);
    }
    ::fchmod(fd, 0644);
    ::fsync(fd);
    ::close(fd);
    if (::rename(name.data(), path.c_str()) != 0) {
        const int e = errno;
        ::unlink(name.data());
        throw std::runtime_error("tactic cache " + path + ": rename failed (" + std::strerror(e) + ")");
    }
}

bool file_exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
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

std::string profile_path(const stof_device_desc_t& d) {
    const char* env = std::getenv("STOF_PRESEARCH_PROFILE");
    if (env != nullptr && *env != '\0') return env;
    std::string dir;
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    if (xdg != nullptr && *xdg == '/') dir = xdg;
    else if (home != nullptr && *home != '\0') dir = std::string(home) + "/.cache";
    else return "";
    std::string name;
    for (const char* c = d.name; *c; ++c)
        name.push_back((std::isalnum(static_cast<unsigned char>(*c)) || *c == '.' || *c == '-') ? *c : '_');
    return dir + "/stof-trt/profiles/" + name + "-" + std::to_string(d.props.sm_count) + "sm.json";
}

stof_status_t profile_coef(const std::string& path, const stof_device_desc_t& d, int32_t clock_mhz,
                           std::vector<stof_presearch_coef_t>* out, bool must_exist) {
    out->clear();
    if (!file_exists(path)) {
        if (must_exist) return fail(STOF_ERROR_INVALID_ARGUMENT, "pre-search profile %s cannot be read", path.c_str());
        return STOF_SUCCESS;
    }
    try {
        const Json doc = read_doc(path);
        auto bad = [&](const std::string& what) {
            return std::runtime_error("pre-search profile " + path + ": " + what);
        };
        if (doc.kind != Json::kObject) throw bad("not a JSON object");
        const Json* fmt = doc.get("format");
        if (!fmt || fmt->kind != Json::kString || fmt->str != kProfileFormat)
            throw bad(std::string("\"format\" is not \"") + kProfileFormat + "\"");
        const Json* ver = doc.get("version");
        if (!ver || ver->kind != Json::kNumber || ver->num != kProfileVersion)
            throw bad("unsupported version (this library reads version " + std::to_string(kProfileVersion) + ")");
        const Json* gpu = doc.get("gpu");
        if (!gpu || gpu->kind != Json::kObject) throw bad("no \"gpu\" object");
        const Json* name = gpu->get("name");
        const Json* sms = gpu->get("sm_count");
        const Json* clock = gpu->get("clock_mhz");
        if (!name || name->kind != Json::kString || !sms || sms->kind != Json::kNumber)
            throw bad("\"gpu\" needs \"name\" and \"sm_count\"");
        std::vector<stof_presearch_coef_t> coef;
        const Json* rows = doc.get("coef");
        if (!rows || rows->kind != Json::kArray) throw bad("no \"coef\" array");
        for (const Json& r : rows->arr) {
            if (r.kind != Json::kObject) throw bad("a \"coef\" entry is not an object");
            stof_presearch_coef_t c{};
            double v[6];
            const char* keys[6] = {"tactic", "head_dim", "a", "b", "c", "d"};
            for (int i = 0; i < 6; ++i) {
                const Json* x = r.get(keys[i]);
                if (!x || x->kind != Json::kNumber || !std::isfinite(x->num) || x->num < 0)
                    throw bad(std::string("a \"coef\" entry needs a non-negative number \"") + keys[i] + "\"");
                v[i] = x->num;
            }
            if (v[0] < 1 || v[0] > 1e6 || std::floor(v[0]) != v[0] || (v[1] != 64 && v[1] != 128))
                throw bad("a \"coef\" entry with a bad tactic or head_dim");
            c.tactic = int32_t(v[0]), c.head_dim = int32_t(v[1]), c.a = v[2], c.b = v[3], c.c = v[4], c.d = v[5];
            coef.push_back(c);
        }
        // the profile of another GPU (or of this one at other clocks) does not apply
        if (name->str != d.name || int32_t(sms->num) != d.props.sm_count) return STOF_SUCCESS;
        if (clock_mhz > 0 && clock && clock->kind == Json::kNumber && clock->num > 0 &&
            std::fabs(clock->num - clock_mhz) > 0.02 * clock_mhz)
            return STOF_SUCCESS;
        *out = std::move(coef);
    } catch (const std::exception& ex) {
        return fail(STOF_ERROR_INVALID_ARGUMENT, "%s", ex.what());
    }
    return STOF_SUCCESS;
}

bool cache_file_exists(const std::string& path) { return file_exists(path); }

stof_status_t cache_store(const std::string& path, const CacheEntry& e) {
    try {
        Json doc;
        {
            FileLock lock(path);
            if (!lock.held())
                return fail(STOF_ERROR_INVALID_ARGUMENT, "tactic cache %s: cannot lock %s.lock (%s)", path.c_str(),
                            path.c_str(), std::strerror(errno));
            // re-read under the lock: other writers' entries since this process's read are kept
            if (file_exists(path)) {
                doc = read_doc(path);
                table_of(doc, path);  // a malformed file is reported, never overwritten
            } else {
                doc.kind = Json::kObject;
                doc.obj.emplace_back("format", json_string(kCacheFormat));
                doc.obj.emplace_back("version", json_number(kCacheVersion));
                Json entries;
                entries.kind = Json::kArray;
                doc.obj.emplace_back("entries", entries);
            }
            Json row;
            row.kind = Json::kObject;
            row.obj.emplace_back("gpu", json_string(e.gpu));
            row.obj.emplace_back("cc", json_string(e.cc));
            row.obj.emplace_back("node", json_string(e.node));
            row.obj.emplace_back("bucket", json_string(e.bucket));
            row.obj.emplace_back("mask", json_string(e.mask));
            row.obj.emplace_back("tactic", json_number(e.tactic));
            row.obj.emplace_back("tactic_name", json_string(stof_attn_tactic_name(e.tactic)));
            if (e.time_ms > 0) row.obj.emplace_back("time_ms", json_number(e.time_ms));
            row.obj.emplace_back("source", json_string(e.source));
            if (e.presearch_tactic > 0) row.obj.emplace_back("presearch_tactic", json_number(e.presearch_tactic));
            if (e.presearch_time_ms > 0) row.obj.emplace_back("presearch_time_ms", json_number(e.presearch_time_ms));
            if (!e.candidates.empty()) {
                Json c;
                c.kind = Json::kObject;
                for (const auto& kv : e.candidates)
                    c.obj.emplace_back(std::to_string(kv.first), json_number(kv.second));
                row.obj.emplace_back("candidates", c);
            }
            const Key key = make_key(e.gpu, e.cc, e.node, e.bucket, e.mask);
            Json* entries = nullptr;
            for (auto& kv : doc.obj)
                if (kv.first == "entries") entries = &kv.second;
            std::vector<Json> kept;
            for (Json& r : entries->arr) {
                auto str = [&](const char* k) { return r.get(k)->str; };  // checked by table_of
                if (make_key(str("gpu"), str("cc"), str("node"), str("bucket"), str("mask")) != key)
                    kept.push_back(std::move(r));
            }
            kept.push_back(std::move(row));
            entries->arr = std::move(kept);
            std::string text;
            write_json(text, doc, 0);
            text.push_back('\n');
            write_atomic(path, text);
        }
        // the process's table of the file becomes the merged one (a new generation)
        auto t = table_of(doc, path);
        std::lock_guard<std::mutex> g(gMutex);
        files()[path] = Loaded{t, ++gGeneration};
    } catch (const std::exception& ex) {
        return fail(STOF_ERROR_INVALID_ARGUMENT, "%s", ex.what());
    }
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

stof_status_t stof_tactic_cache_store(const char* path, const char* gpu, const char* cc, const char* node,
                                      const char* bucket, const char* mask, int32_t tactic, double time_ms) {
    if (path == nullptr || *path == '\0') return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "tactic cache: no path");
    if (!gpu || !cc || !node || !bucket || !mask) return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "a key is NULL");
    if (tactic < 1) return stof::host::fail(STOF_ERROR_INVALID_ARGUMENT, "tactic ids are >= 1, got %d", tactic);
    stof::host::CacheEntry e;
    e.gpu = gpu, e.cc = cc, e.node = node, e.bucket = bucket, e.mask = mask;
    e.tactic = tactic, e.time_ms = time_ms, e.source = "measured";
    const stof_status_t s = stof::host::cache_store(path, e);
    if (s == STOF_SUCCESS) stof::host::clear_error();
    return s;
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
