// CPU helpers of the loss family's row kernels (loss_cpu.cpp, logprob_cpu.cpp): a row's max and the loading of a
// row into a math-type buffer.
#pragma once
#include <algorithm>
#include <limits>

#include "common/cpu_utils.h"

namespace fused {
namespace loss {

template <typename M> inline Vec<M> vadd(Vec<M> a, Vec<M> b) { return a + b; }

// max with NaN propagation, as eager's max.
template <typename M> inline M nan_max(M a, M b) { return (a != a || a > b) ? a : b; }

template <typename M> M row_max(const M* z, int64_t n) {
  constexpr int64_t L = Vec<M>::size();
  Vec<M> acc(-std::numeric_limits<M>::infinity());
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = at::vec::maximum(acc, Vec<M>::loadu(z + i));
  M lanes[L];
  acc.store(lanes);
  M m = lanes[0];
  for (int64_t k = 1; k < L; ++k) m = nan_max(m, lanes[k]);
  for (; i < n; ++i) m = nan_max(m, z[i]);
  return m;
}

// x / temperature into the math-type buffer z (one read of the row).
template <typename scalar_t, typename M> void load_row(const scalar_t* x, M* z, int64_t n, M temperature) {
  const Vec<M> vt(temperature);
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    load_block(x + i, z + i, len);
    if (temperature != M(1)) vec_map(z + i, len, [&](Vec<M> v) { return v / vt; });
  }
}

}  // namespace loss
}  // namespace fused
