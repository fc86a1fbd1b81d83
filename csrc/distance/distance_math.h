// The distance metrics' math, written once over a value type V, as common/pointwise_math.h does for the
// activations: V is a scalar (CUDA device code and host code; include common/scalar_math.h first) or
// at::vec::Vectorized<T> (CPU; common/vec_math.h first). fused/distance/triton_kernels.py mirrors it for Triton.
#pragma once
#include <cmath>

#include "common/op_codes.h"

namespace fused {

inline Metric metric_of(double p) {
  if (p == 0) return Metric::P0;
  if (p == 1) return Metric::P1;
  if (p == 2) return Metric::P2;
  if (std::isinf(p)) return Metric::PInf;
  return Metric::PGen;
}

// What the math needs of p, in V: p, 1 / p, p - 1, and squared (p = 2: no root).
template <typename V> struct MetricParams {
  V p, inv_p, p_minus_1;
  bool squared;
};

// acc (+) |diff|^p: the sum (the max for PInf) over coordinates, NaN-propagating like eager.
template <Metric M, typename V> FUSED_HD V metric_accumulate(V acc, V diff, const MetricParams<V>& prm) {
  if constexpr (M == Metric::P0) return acc + p_nonzero(diff);
  else if constexpr (M == Metric::P1) return acc + p_abs(diff);
  else if constexpr (M == Metric::P2) return p_fma(diff, diff, acc);
  else if constexpr (M == Metric::PInf) return p_max_nan(acc, p_abs(diff));
  else return acc + p_pow(p_abs(diff), prm.p);
}

// The distance from the accumulated value: the root for P2 (unless squared) and PGen.
template <Metric M, typename V> FUSED_HD V metric_finish(V acc, const MetricParams<V>& prm) {
  if constexpr (M == Metric::P2) return prm.squared ? acc : p_sqrt(acc);
  else if constexpr (M == Metric::PGen) return p_pow(acc, prm.inv_p);
  else return acc;
}

// Gradient of one pair's distance with respect to a, per coordinate: grad_term(diff, w, dist) with the pair's
// weight w = pair_weight(g, dist), g the pair's incoming gradient. The term is odd in diff, so the gradient for b
// is the same with a and b swapped. Zero by convention where the gradient is undefined: at zero distance, at a
// zero coordinate difference for p != 2, and everywhere for p = 0.
template <Metric M, typename V> FUSED_HD V pair_weight(V g, V dist, const MetricParams<V>& prm) {
  if constexpr (M == Metric::P0) return V(0);
  else if constexpr (M == Metric::P2) return prm.squared ? g * V(2) : p_zero_at(dist, g / dist);
  else if constexpr (M == Metric::PGen) return p_zero_at(dist, g / p_pow(dist, prm.p_minus_1));
  else return g;
}

template <Metric M, typename V> FUSED_HD V grad_term(V diff, V w, V dist, const MetricParams<V>& prm) {
  if constexpr (M == Metric::P0) return V(0);
  else if constexpr (M == Metric::P1) return w * p_sign(diff);
  else if constexpr (M == Metric::P2) return diff * w;
  else if constexpr (M == Metric::PInf) return p_where_eq(p_abs(diff), dist, w * p_sign(diff));
  else return p_zero_at(diff, w * (p_sign(diff) * p_pow(p_abs(diff), prm.p_minus_1)));  // sign(d) |d|^(p-1)
}

}  // namespace fused
