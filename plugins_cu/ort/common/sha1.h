// SHA-1 (FIPS 180-4), only to reproduce TileLayout.signature() for tactic-cache keys; not for security.
#ifndef STOF_ORT_SHA1_H
#define STOF_ORT_SHA1_H

#include <cstddef>
#include <cstdint>
#include <string>

namespace stof_ort {

class Sha1 {
public:
    Sha1();
    void update(void const* data, size_t bytes);
    std::string hexDigest();  // finalises; call once

private:
    void block(uint8_t const* p);
    uint32_t mH[5];
    uint8_t mBuf[64];
    size_t mBufLen{0};
    uint64_t mTotal{0};
};

}  // namespace stof_ort

#endif  // STOF_ORT_SHA1_H
