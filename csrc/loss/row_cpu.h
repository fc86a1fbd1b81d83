// CPU helpers of the loss family's row kernels (loss_cpu.cpp, logprob_cpu.cpp): the parallel loop over rows, the
// gradient's rows, a row's max and the loading of a row into a math-type buffer.
#pragma once
#include <algorithm>
#include <limits>
#include <vector>

#include "common/cpu_utils.h"

namespace fused {
namespace loss {

template <typename M> inline Vec<M> vadd(Vec<M> a, Vec<M> b) { return a + b; }

// Rows [0, rows) of V columns in parallel, each in one thread from start to end (results independent of the thread
// count), in tasks of about `task_elements` columns (one row at least): body(r, buf, local) with the thread's
// math-type buffer of `width` elements and a kBlock scratch block.
template <typename M, typename Body>
void for_each_row(int64_t rows, int64_t V, int64_t width, int64_t task_elements, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, task_elements / std::max<int64_t>(V, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<M> buf(width);
    M local[kBlock];
    for (int64_t r = r0; r < r1; ++r) body(r, buf.data(), local);
  });
}

// The gradient's rows (null when no gradient is asked for).
template <typename scalar_t> struct RowGrad {
  scalar_t* grad;
  int64_t ldg;
  scalar_t* row(int64_t r) const { return grad ? grad + r * ldg : nullptr; }
};

template <typename scalar_t> RowGrad<scalar_t> row_grad(const at::Tensor& grad) {
  return {grad.numel() ? grad.data_ptr<scalar_t>() : nullptr, grad.numel() ? grad.stride(0) : 0};
}

// When `ignored`: the row's outputs 0 and its gradient row (grow, null when none is asked for) zero.
template <typename scalar_t, typename... M> bool ignored_row(bool ignored, scalar_t* grow, int64_t V, M&... outputs) {
  if (!ignored) return false;
  ((outputs = M(0)), ...);
  if (grow) std::fill(grow, grow + V, scalar_t(0));
  return true;
}

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
