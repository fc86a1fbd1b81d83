// CPU building blocks of the distance family: the metrics' math (distance_math.h) over at::vec vectors and
// scalars, b packed in column panels, the direct register-blocked tile kernel (R rows of a x W columns of b, any D,
// vectorised along the columns so that it stays fast when D < 8), and the p=2 matmul path with its exact
// recompute of small distances.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <utility>

#include "common/checks.h"
#include "common/cpu_utils.h"
#include "common/scalar_math.h"
#include "distance/distance_math.h"

namespace fused {
namespace distance {

// The path rule: the tensor-core/BLAS matmul only for p=2 with D >= kMatmulMinD (any N, M).
constexpr int64_t kMatmulMinD = 32;
inline bool use_matmul(Metric m, int64_t D) { return m == Metric::P2 && D >= kMatmulMinD; }
// The matmul path recomputes directly every d^2 below this fraction of |a|^2 + |b|^2 (after centering): there
// the cancellation in |a|^2 + |b|^2 - 2 a.b would cost more than a few bits.
constexpr double kRecompute = 1.0 / 16;

// The metric's params in the math type T, for the vector kernels (V = Vec<T>) or scalar code (V = T).
template <typename T, typename V = Vec<T>> MetricParams<V> metric_params(double p, bool squared) {
  return {V(T(p)), V(T(1.0 / p)), V(T(p - 1)), squared};
}

// ---- b packed in panels of W columns: panel[d][l] = b[j0 + l][d], zero-padded past M ----
template <typename T> constexpr int64_t kPanel = 2 * Vec<T>::size();

template <typename T> inline int64_t num_panels(int64_t M) { return (M + kPanel<T> - 1) / kPanel<T>; }

template <typename T> void pack_panels(const T* b, int64_t M, int64_t D, T* dst) {
  constexpr int64_t W = kPanel<T>;
  at::parallel_for(0, num_panels<T>(M), 16, [&](int64_t p0, int64_t p1) {
    for (int64_t pj = p0; pj < p1; ++pj) {
      T* panel = dst + pj * D * W;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t l = 0; l < W; ++l) {
          const int64_t j = pj * W + l;
          panel[d * W + l] = j < M ? b[j * D + d] : T(0);
        }
    }
  });
}

// Distances of R rows of a (row-major, stride D) against one panel: out[r][0..W).
template <Metric Mt, int R, typename T>
inline void direct_tile(const T* a, int64_t D, const T* panel, const MetricParams<Vec<T>>& prm, T (*out)[kPanel<T>]) {
  using V = Vec<T>;
  constexpr int64_t L = V::size();
  V acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V(0);
  for (int64_t d = 0; d < D; ++d) {
    const V b0 = V::loadu(panel + d * 2 * L), b1 = V::loadu(panel + d * 2 * L + L);
    for (int r = 0; r < R; ++r) {
      const V av(a[r * D + d]);
      acc[r][0] = metric_accumulate<Mt>(acc[r][0], av - b0, prm);
      acc[r][1] = metric_accumulate<Mt>(acc[r][1], av - b1, prm);
    }
  }
  for (int r = 0; r < R; ++r) {
    metric_finish<Mt>(acc[r][0], prm).store(out[r]);
    metric_finish<Mt>(acc[r][1], prm).store(out[r] + L);
  }
}

// Calls consume(r, j0, len, values) for every tile of rows [0, rows) of a against all M columns of b (packed);
// values holds `len` finished distances of row r from column j0 on.
template <Metric Mt, typename T, typename Consume>
void direct_rows(const T* a, int64_t rows, int64_t D, const T* panels, int64_t M, const MetricParams<Vec<T>>& prm,
                 const Consume& consume) {
  constexpr int64_t W = kPanel<T>;
  constexpr int R = 4;
  alignas(64) T tile[R][W];
  const int64_t P = num_panels<T>(M);
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    for (int64_t pj = 0; pj < P; ++pj) {
      direct_tile<Mt, R>(a + r * D, D, panels + pj * D * W, prm, tile);
      for (int i = 0; i < R; ++i) consume(r + i, pj * W, std::min(W, M - pj * W), tile[i]);
    }
  for (; r < rows; ++r)
    for (int64_t pj = 0; pj < P; ++pj) {
      direct_tile<Mt, 1>(a + r * D, D, panels + pj * D * W, prm, tile);
      consume(r, pj * W, std::min(W, M - pj * W), tile[0]);
    }
}

// |x - y|^2 over D elements from the differences (each rounded once), summed in vector lanes: within
// (D + 2) u d^2 of the exact value whatever the summation order, with no cancellation (unlike
// |x|^2 + |y|^2 - 2 x.y, its error is relative to d^2, not to the norms).
template <typename T> inline T squared_distance(const T* x, const T* y, int64_t D) {
  using V = Vec<T>;
  constexpr int64_t L = V::size();
  V acc0(T(0)), acc1(T(0));
  int64_t d = 0;
  for (; d + 2 * L <= D; d += 2 * L) {
    const V p = V::loadu(x + d) - V::loadu(y + d), q = V::loadu(x + d + L) - V::loadu(y + d + L);
    acc0 = fma_once(p, p, acc0);
    acc1 = fma_once(q, q, acc1);
  }
  for (; d < D; d += L) {
    const int64_t cnt = std::min(L, D - d);
    const V p = V::loadu(x + d, cnt) - V::loadu(y + d, cnt);  // lanes past D: 0
    acc0 = fma_once(p, p, acc0);
  }
  return at::vec::vec_reduce_all<T>([](V a, V b) { return a + b; }, acc0 + acc1);
}

// One pair's p=2 distance by direct differences (the matmul path's recompute).
template <typename T> inline T direct_pair_p2(const T* a, const T* b, int64_t D, const MetricParams<T>& prm) {
  return metric_finish<Metric::P2>(squared_distance(a, b, D), prm);
}

// ---- the p=2 matmul path for one batch ----
// a, b: [N, D], [M, D] in the math type. Centering both at the mean of b (distances are translation invariant)
// keeps |a|^2 + |b|^2 - 2 a.b small for point clouds far from the origin. Where that mean is small against b's rows
// (|mean|^2 <= mean |row|^2 / 9), centering would change the norms by little and the operands are used as they are,
// with no copy of b.
template <typename T> struct MatmulOperands {
  at::Tensor a, b;    // uncentered, for the direct recompute
  at::Tensor ac, bc;  // the GEMM's operands: centered, or a and b themselves
  at::Tensor na, nb;  // squared norms of their rows
  MatmulOperands(const at::Tensor& a_, const at::Tensor& b_) : a(a_.contiguous()), b(b_.contiguous()) {
    std::tie(bc, nb) = centered(b, {});
    const int64_t M = b.size(0);
    const double spread = M ? nb.sum(at::kDouble).template item<double>() / M : 0.0;
    at::Tensor center = M ? b.mean(0) : at::zeros({b.size(1)}, b.options());
    const double offset = center.square().sum(at::kDouble).template item<double>();
    if (!std::isfinite(offset) || 9 * offset <= spread) {  // inf/NaN rows: the recompute handles them
      std::tie(ac, na) = centered(a, {});
      return;
    }
    std::tie(ac, na) = centered(a, center);
    std::tie(bc, nb) = centered(b, center);
  }
  // x - center row by row (x itself when center is undefined) and the squared norms of the results, in one pass
  // over x (no temporaries the size of x).
  static std::pair<at::Tensor, at::Tensor> centered(const at::Tensor& x, const at::Tensor& center) {
    using V = Vec<T>;
    const int64_t rows = x.size(0), D = x.size(1);
    const bool shift = center.defined();
    // detach: the GEMM may run on a worker thread, outside the caller's no-autograd guard, and refuses out=
    // arguments that require grad
    at::Tensor xc = shift ? empty_output_like(x) : x.detach(), n = at::empty({rows}, x.options());
    const T *src = x.template data_ptr<T>(), *c = shift ? center.template data_ptr<T>() : nullptr;
    T *dst = xc.template data_ptr<T>(), *np = n.template data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        V acc(T(0));
        for (int64_t d = 0; d < D; d += V::size()) {
          const int64_t cnt = std::min<int64_t>(V::size(), D - d);
          V v = V::loadu(src + r * D + d, cnt);  // lanes past D: 0
          if (shift) {
            v = v - V::loadu(c + d, cnt);
            v.store(dst + r * D + d, cnt);
          }
          acc = fma_once(v, v, acc);
        }
        np[r] = at::vec::vec_reduce_all<T>([](V p, V q) { return p + q; }, acc);
      }
    });
    return {xc, n};
  }
};

// dst (row stride ld) = distances of rows [r0, r0 + nr) of a to rows [c0, c0 + nc) of b: one BLAS call (at::mm)
// writes a.b into dst, then one vectorised pass over the tile while it is still in L2 adds the norms, takes the
// root, and checks for entries to recompute directly. Single-threaded: callers run it on L2-sized tiles, in
// parallel.
template <typename T>
void matmul_tile(const MatmulOperands<T>& op, int64_t r0, int64_t nr, int64_t c0, int64_t nc, bool squared, T* dst,
                 int64_t ld) {
  using V = Vec<T>;
  const int64_t D = op.b.size(1);
  at::Tensor tile = at::from_blob(dst, {nr, nc}, {ld, 1}, op.a.options());
  at::mm_out(tile, op.ac.narrow(0, r0, nr), op.bc.narrow(0, c0, nc).t());
  const T *na = op.na.template data_ptr<T>() + r0, *nb = op.nb.template data_ptr<T>() + c0;
  const T *a = op.a.template data_ptr<T>(), *b = op.b.template data_ptr<T>() + c0 * D;
  const V c = V(T(kRecompute)), two = V(T(2)), inf = V(std::numeric_limits<T>::infinity());
  const MetricParams<T> exact = metric_params<T, T>(2.0, squared);
  for (int64_t i = 0; i < nr; ++i) {
    T* row = dst + i * ld;
    const V nai(na[i]);
    // d^2 = |a|^2 + |b|^2 - 2 a.b. Entries not above c (|a|^2 + |b|^2) (cancellation), inf or NaN are
    // recomputed below; every other d^2 is positive, so no clamp is needed here.
    const V all_set = V(T(0)) == V(T(0));
    V ok = all_set;
    auto step = [&](int64_t j, int64_t n, V pad) {
      const V s = nai + V::loadu(nb + j, n);
      const V d2 = at::vec::fnmadd(two, V::loadu(row + j, n), s);
      ok = ok & (((d2 > c * s) & (d2 < inf)) | pad);
      (squared ? d2 : d2.sqrt()).store(row + j, n);
    };
    int64_t j = 0;
    for (; j + V::size() <= nc; j += V::size()) step(j, V::size(), V(T(0)));
    if (j < nc) step(j, nc - j, V::arange(T(0), T(1)) >= V(T(nc - j)));  // lanes past the end pass
    if (ok.zero_mask() == 0) continue;
    // Rare (duplicates, near neighbours, inf/NaN): recompute every entry whose stored value could come from a
    // flagged d^2 (a superset: the root is monotone, NaN for negative d^2; the slack covers its rounding).
    for (int64_t j = 0; j < nc; ++j) {
      const T y = row[j], y2 = squared ? y : y * y;
      if (!(y2 > T(kRecompute) * (na[i] + nb[j]) * T(1.0001)) || std::isinf(y))
        row[j] = direct_pair_p2(a + (r0 + i) * D, b + j * D, D, exact);
    }
  }
}

}  // namespace distance
}  // namespace fused
