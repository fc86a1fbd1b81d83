// Philox4x32-10 counter-based RNG, shared by the CPU, CUDA and Triton dropout kernels so that every backend
// draws the same mask for the same seed: element i uses counter (i / 4, 0, 0, 0) and key (seed_lo, seed_hi),
// output word i % 4, and is kept iff that word >= threshold (an integer compare, so no backend rounds differently).
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace fused {

struct Philox4 {
  uint32_t v[4];
};

FUSED_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

FUSED_HD Philox4 philox4x32_10(uint64_t counter, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t p0 = c0, p2 = c2;
    c0 = mulhi32(0xCD9E8D57u, p2) ^ c1 ^ k0;
    c2 = mulhi32(0xD2511F53u, p0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * p2;
    c3 = 0xD2511F53u * p0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Words below this are dropped: P(drop) = threshold / 2^32 = p, rounded to the nearest 2^-32.
inline uint64_t dropout_threshold(double p) {
  if (p <= 0.0) return 0;
  if (p >= 1.0) return uint64_t(1) << 32;
  return static_cast<uint64_t>(p * 4294967296.0 + 0.5);
}

}  // namespace fused
