// The Philox keys of the optimizers' stochastic rounding (csrc/common/philox.h), the same on every backend (the
// Triton kernels' tensor_key and state_key spell them in int64): tensor t's parameter takes seed + t * kTensorKeyStep,
// its k-th state tensor (k = 1: exp_avg, 2: exp_avg_sq, 3: max_exp_avg_sq) state_seed + t * kTensorKeyStep +
// k * kStateKeyStep, all mod 2^64.
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace fused {

constexpr uint64_t kTensorKeyStep = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kStateKeyStep = 0xD1B54A32D192ED03ull;

FUSED_HD uint64_t rounding_key(uint64_t seed, int64_t tensor, int k = 0) {
  return seed + uint64_t(tensor) * kTensorKeyStep + uint64_t(k) * kStateKeyStep;
}

}  // namespace fused
