// 8-bit Adam state (fused.optim state_dtype="int8"): blocks of 256 elements in flat memory order, one float32
// scale each. Both codes are square maps, which give small values finer steps than a linear map and cost one
// multiply to decode (no table lookup):
//   exp_avg (int8, signed):      m = sign(q) * (q / 127)^2 * a,   a = max |m| of the block (the stored scale)
//   exp_avg_sq (uint8, on sqrt): sqrt(v) = (q / 255)^2 * u,       u = max sqrt(v) of the block (the stored scale)
// Coding sqrt(v) rather than v halves its exponent range (so a small v is not coded to 0 while its m is not, which
// would make the update m / eps), and the update needs sqrt(v) anyway. Encoding rounds q to nearest (even) in the
// square-root domain: |m' - m| <= a (2 r + 1/254) / 254 with r = sqrt(|m| / a), and the same for sqrt(v) with 255.
// A block whose scale is 0, inf or NaN stores codes 0 and that scale: all-zero blocks decode to 0, non-finite
// ones to NaN. fused/optim/quantize.py computes the same bits in torch (state dict loading, dequantize_state).
#pragma once
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace fused {

constexpr int64_t kQuantBlock = 256;

inline bool usable_scale(float a) { return a > 0.f && a <= std::numeric_limits<float>::max(); }

// x[i] -> codes of block-relative magnitudes r = sqrt(mag(x[i]) / max), for one block of n <= 256 elements.
// Signed (int8): mag = |x|, levels 127. Unsigned (uint8): mag = sqrt(x), levels 255.
template <typename code_t> inline void quantize_block(const float* x, code_t* q, float* scale, int64_t n) {
  using V = at::vec::Vectorized<float>;
  constexpr bool kSigned = std::is_signed_v<code_t>;
  alignas(64) float mag[kQuantBlock];
  V vmax(0.f);
  int64_t i = 0;
  for (; i < n; i += V::size()) {
    const int64_t cnt = std::min<int64_t>(V::size(), n - i);
    V v = cnt == V::size() ? V::loadu(x + i) : V::loadu(x + i, cnt);
    v = kSigned ? v.abs() : v.sqrt();
    v.store(mag + i, cnt);
    vmax = at::vec::maximum(vmax, v);  // keeps NaN
  }
  float lanes[V::size()];
  vmax.store(lanes);
  float a = 0.f;
  for (int64_t l = 0; l < V::size(); ++l) a = std::isnan(lanes[l]) || lanes[l] > a ? lanes[l] : a;
  *scale = a;
  if (!usable_scale(a)) {
    std::memset(q, 0, n * sizeof(code_t));
    return;
  }
  // mag / a as mag * (1 / a), but for a denormal a, whose inverse overflows
  const float inv = 1.f / a;
  const bool by_inverse = inv <= std::numeric_limits<float>::max();
  const V va(a), vinv(inv), levels(kSigned ? 127.f : 255.f);
  for (i = 0; i < n; i += V::size()) {
    const int64_t cnt = std::min<int64_t>(V::size(), n - i);
    const V x = V::loadu(mag + i, cnt);
    ((by_inverse ? x * vinv : x / va).sqrt() * levels).round().store(mag + i, cnt);
  }
  for (i = 0; i < n; ++i) {
    if constexpr (kSigned) q[i] = int8_t(x[i] < 0.f ? -mag[i] : mag[i]);
    else q[i] = uint8_t(mag[i]);
  }
}

template <typename code_t> inline void dequantize_block(const code_t* q, float scale, float* x, int64_t n) {
  if constexpr (std::is_signed_v<code_t>) {
    const float s = scale / 16129.f;
    for (int64_t i = 0; i < n; ++i) {
      const float c = float(q[i]);
      x[i] = c * std::abs(c) * s;
    }
  } else {
    const float s = scale / 65025.f;
    for (int64_t i = 0; i < n; ++i) {
      const float c = float(q[i]);
      const float w = c * c * s;
      x[i] = w * w;
    }
  }
}

// n elements from element `offset` (a multiple of 256) of a tensor's codes and scales.
template <typename code_t>
inline void dequantize(const code_t* codes, const float* scales, int64_t offset, float* x, int64_t n) {
  for (int64_t b = 0; b < n; b += kQuantBlock)
    dequantize_block(codes + offset + b, scales[(offset + b) / kQuantBlock], x + b, std::min(kQuantBlock, n - b));
}
template <typename code_t>
inline void quantize(const float* x, code_t* codes, float* scales, int64_t offset, int64_t n) {
  for (int64_t b = 0; b < n; b += kQuantBlock)
    quantize_block(x + b, codes + offset + b, scales + (offset + b) / kQuantBlock, std::min(kQuantBlock, n - b));
}

}  // namespace fused
