// The keys of the optimizers' stochastic rounding, the same on every backend (the Triton kernels' tensor_key and
// state_key spell them in int64): tensor t's parameter takes seed + t * kTensorKeyStep, its k-th state tensor
// (k = 1: exp_avg, 2: exp_avg_sq, 3: max_exp_avg_sq) state_seed + t * kTensorKeyStep + k * kStateKeyStep, all mod
// 2^64. Parameters draw Philox words (csrc/common/philox.h) under their key; low-bit state (exp_avg_sq's 8-bit codes,
// bf16 moments) draws dither_word's.
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace fused {

constexpr uint64_t kTensorKeyStep = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kStateKeyStep = 0xD1B54A32D192ED03ull;

FUSED_HD uint64_t rounding_key(uint64_t seed, int64_t tensor, int k = 0) {
  return seed + uint64_t(tensor) * kTensorKeyStep + uint64_t(k) * kStateKeyStep;
}

// The dither of exp_avg_sq's 8-bit codes (quantize_cpu.h) under a tensor's key: word j serves elements 2j (its high
// half) and 2j + 1 (its low half). Wellons' lowbias32 hash of j plus the key's low half, the high half xored in
// midway: a bijection of that sum, so over random keys each element's word is uniform, and neighbours' words are
// unrelated. A few integer ops a word where Philox takes ten rounds of multiplies.
constexpr uint32_t kDitherHighStep = 0x9E3779B9u;
FUSED_HD uint32_t dither_word(uint64_t key, uint64_t j) {
  uint32_t x = uint32_t(j) + (uint32_t(key) + uint32_t(j >> 32) * kDitherHighStep);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x ^= uint32_t(key >> 32);
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

}  // namespace fused
