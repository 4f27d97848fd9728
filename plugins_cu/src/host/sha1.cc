// SHA-1 written from FIPS 180-4, section 6.1.
#include "host.h"

#include <cstring>

namespace stof {
namespace host {
namespace {
inline uint32_t rotl(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }
}  // namespace

Sha1::Sha1() : h_{0x67452301u, 0xEFCDAB89u, 0x98BADCFEu, 0x10325476u, 0xC3D2E1F0u}, buf_{} {}

void Sha1::block(uint8_t const* p) {
    uint32_t w[80];
    for (int t = 0; t < 16; ++t) {
        w[t] = (uint32_t(p[4 * t]) << 24) | (uint32_t(p[4 * t + 1]) << 16) | (uint32_t(p[4 * t + 2]) << 8) |
               uint32_t(p[4 * t + 3]);
    }
    for (int t = 16; t < 80; ++t) w[t] = rotl(w[t - 3] ^ w[t - 8] ^ w[t - 14] ^ w[t - 16], 1);
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4];
    for (int t = 0; t < 80; ++t) {
        uint32_t f, k;
        if (t < 20) {
            f = (b & c) | (~b & d);
            k = 0x5A827999u;
        } else if (t < 40) {
            f = b ^ c ^ d;
            k = 0x6ED9EBA1u;
        } else if (t < 60) {
            f = (b & c) | (b & d) | (c & d);
            k = 0x8F1BBCDCu;
        } else {
            f = b ^ c ^ d;
            k = 0xCA62C1D6u;
        }
        uint32_t tmp = rotl(a, 5) + f + e + k + w[t];
        e = d;
        d = c;
        c = rotl(b, 30);
        b = a;
        a = tmp;
    }
    h_[0] += a;
    h_[1] += b;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
}

void Sha1::update(void const* data, size_t bytes) {
    auto p = static_cast<uint8_t const*>(data);
    total_ += bytes;
    while (bytes > 0) {
        size_t take = 64 - buf_len_ < bytes ? 64 - buf_len_ : bytes;
        std::memcpy(buf_ + buf_len_, p, take);
        buf_len_ += take;
        p += take;
        bytes -= take;
        if (buf_len_ == 64) {
            block(buf_);
            buf_len_ = 0;
        }
    }
}

std::string Sha1::hex_digest() {
    uint64_t const bits = total_ * 8;
    uint8_t pad = 0x80;
    update(&pad, 1);
    uint8_t zero = 0;
    while (buf_len_ != 56) update(&zero, 1);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(bits >> (56 - 8 * i));
    update(len, 8);
    static char const* kHex = "0123456789abcdef";
    std::string out;
    for (uint32_t h : h_) {
        for (int i = 7; i >= 0; --i) out.push_back(kHex[(h >> (4 * i)) & 0xF]);
    }
    return out;
}

}  // namespace host
}  // namespace stof
