// libstof_ort.so entry point: RegisterCustomOps adds domain `stof` with StofSparseAttention, StofGemmEpilogue,
// StofAddLayerNorm and StofGlobalSlots for float, float16 and bfloat16, and StofPackTokens (int32), on the CUDA EP.  Each node keeps its model-local
// ONNX function, which ORT inlines wherever these kernels do not claim the node (e.g. on the CPU EP).
//
// Options (session config entry, else environment variable):
//   stof.tactic_cache / STOF_TACTIC_CACHE   path of a tactic cache written by `stof tune` (and by first-use
//                                           timing, which creates it when missing)
//   stof.first_use_timing / STOF_FIRST_USE_TIMING   "0": no first-use timing (attention: cache, pre-search,
//                                           default only; GEMMs without an `algo`: the heuristic's first)
//   stof.verbose      / STOF_ORT_VERBOSE    "1": print each attention node's tactic choice to stderr
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "addLayerNorm/addLayerNormOp.h"
#include "common/ortCommon.h"
#include "gemmEpilogue/gemmEpilogueOp.h"
#include "globalSlots/globalSlotsOp.h"
#include "packTokens/packTokensOp.h"
#include "sparseAttention/sparseAttentionOp.h"

namespace stof_ort {
namespace {

constexpr ONNXTensorElementDataType kTYPES[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                                ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16};

// ORT keeps raw pointers to the ops and the domain for the sessions' lifetime: they live as long as the library.
struct Registry {
    std::mutex mutex;
    std::vector<std::unique_ptr<SparseAttentionOp>> attention;
    std::vector<std::unique_ptr<GemmEpilogueOp>> gemm;
    std::vector<std::unique_ptr<AddLayerNormOp>> layerNorm;
    std::vector<std::unique_ptr<GlobalSlotsOp>> globalSlots;
    std::vector<std::unique_ptr<PackTokensOp>> packTokens;
    std::vector<Ort::CustomOpDomain> domains;
};

Registry& registry() {
    static Registry* r = new Registry();  // never destroyed: sessions may outlive static destructors
    return *r;
}

std::string configEntry(OrtApi const& api, OrtSessionOptions const* options, char const* key, char const* env) {
    int has = 0;
    if (options != nullptr) {
        Ort::ThrowOnError(api.HasSessionConfigEntry(options, key, &has));
        if (has) {
            size_t size = 0;
            Ort::ThrowOnError(api.GetSessionConfigEntry(options, key, nullptr, &size));
            std::string value(size, '\0');
            Ort::ThrowOnError(api.GetSessionConfigEntry(options, key, value.data(), &size));
            value.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
            return value;
        }
    }
    char const* v = std::getenv(env);
    return v ? std::string(v) : std::string();
}

}  // namespace
}  // namespace stof_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, OrtApiBase const* apiBase) {
    using namespace stof_ort;
    OrtApi const* api = apiBase ? apiBase->GetApi(ORT_API_VERSION) : nullptr;
    if (api == nullptr) return nullptr;  // an ORT older than the headers: nothing we can report through
    Ort::InitApi(api);
    return guarded("RegisterCustomOps", [&] {
        std::string const verbose = configEntry(*api, options, kCONFIG_VERBOSE, kENV_VERBOSE);
        setVerbose(!verbose.empty() && verbose != "0");
        std::string const timingOpt = configEntry(*api, options, kCONFIG_FIRST_USE_TIMING, kENV_FIRST_USE_TIMING);
        bool const timing = timingOpt != "0" && timingOpt != "off" && timingOpt != "false";
        std::string const cachePath = configEntry(*api, options, kCONFIG_TACTIC_CACHE, kENV_TACTIC_CACHE);
        std::FILE* const existing = cachePath.empty() ? nullptr : std::fopen(cachePath.c_str(), "rb");
        if (existing != nullptr) std::fclose(existing);
        if (!cachePath.empty() && (existing != nullptr || !timing)) {  // with timing a missing file is created later  // read now, so that a bad file fails the registration, not a later run
            int32_t entries = 0;
            STOF_VALIDATE(stof_tactic_cache_load(cachePath.c_str(), &entries) == STOF_SUCCESS,
                          stof_last_error_message(), " (set by ", kCONFIG_TACTIC_CACHE, " or ", kENV_TACTIC_CACHE, ")");
            if (verboseEnabled()) std::fprintf(stderr, "[stof] tactic cache %s: %d entries\n", cachePath.c_str(), entries);
        }

        Registry& reg = registry();
        std::lock_guard<std::mutex> lock(reg.mutex);
        Ort::CustomOpDomain domain(kDOMAIN);
        for (auto t : kTYPES) {
            reg.attention.push_back(std::make_unique<SparseAttentionOp>(t, cachePath, timing));
            domain.Add(reg.attention.back().get());
            if (stof_gemm_available()) {  // else the GEMM nodes run as their ONNX function
                reg.gemm.push_back(std::make_unique<GemmEpilogueOp>(t, timing));
                domain.Add(reg.gemm.back().get());
            }
            reg.layerNorm.push_back(std::make_unique<AddLayerNormOp>(t));
            domain.Add(reg.layerNorm.back().get());
            reg.globalSlots.push_back(std::make_unique<GlobalSlotsOp>(t));
            domain.Add(reg.globalSlots.back().get());
        }
        reg.packTokens.push_back(std::make_unique<PackTokensOp>());  // int32 only: one per registration
        domain.Add(reg.packTokens.back().get());
        Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
        reg.domains.push_back(std::move(domain));
    });
}
