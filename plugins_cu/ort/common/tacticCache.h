// The tactic cache as the plugin reads it: the JSON written by `stof tune` (stof_trt/tactic_cache.py), reduced
// to a map (GPU name, compute capability, node signature, shape bucket, mask signature) -> tactic id.
#ifndef STOF_ORT_TACTIC_CACHE_H
#define STOF_ORT_TACTIC_CACHE_H

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace stof_ort {

constexpr char const* kCACHE_FORMAT = "stof-tactic-cache";
constexpr int kCACHE_VERSION = 1;

class TacticCache {
public:
    using Key = std::tuple<std::string, std::string, std::string, std::string, std::string>;

    // Parse a cache file; throws StofOrtError (INVALID_ARGUMENT) on a missing or malformed file.
    static std::shared_ptr<TacticCache const> load(std::string const& path);

    // Tactic id for the key, or 0 when the cache has no entry.
    int32_t lookup(std::string const& gpu, std::string const& cc, std::string const& node, std::string const& bucket,
                   std::string const& mask) const;

    std::string const& path() const { return mPath; }
    size_t size() const { return mEntries.size(); }

private:
    std::string mPath;
    std::map<Key, int32_t> mEntries;
};

// Shape bucket: B, Sq and Sk each rounded up to a power of two (Sq, Sk at least 64).  Must match
// stof_trt.tactic_cache.shape_bucket.
std::string shapeBucket(int64_t batch, int64_t seqQ, int64_t seqK);

}  // namespace stof_ort

#endif  // STOF_ORT_TACTIC_CACHE_H
