// Scalar primitives for pointwise_math.h and distance/distance_math.h (CUDA device code and host code), float and
// double.
#pragma once
#include <cmath>
#include "common/host_device.h"

namespace fused {
FUSED_HD float p_exp(float x) { return expf(x); }
FUSED_HD float p_log(float x) { return logf(x); }
FUSED_HD float p_erf(float x) { return erff(x); }
FUSED_HD float p_tanh(float x) { return tanhf(x); }
FUSED_HD float p_sin(float x) { return sinf(x); }
FUSED_HD float p_cos(float x) { return cosf(x); }
FUSED_HD float p_sqrt(float x) { return sqrtf(x); }
FUSED_HD float p_rsqrt(float x) { return 1.0f / sqrtf(x); }
FUSED_HD float p_recip(float x) { return 1.0f / x; }
FUSED_HD float p_abs(float x) { return fabsf(x); }
FUSED_HD float p_pow(float x, float s) { return powf(x, s); }
FUSED_HD float p_fma(float a, float b, float c) { return fmaf(a, b, c); }
FUSED_HD double p_exp(double x) { return ::exp(x); }
FUSED_HD double p_log(double x) { return ::log(x); }
FUSED_HD double p_erf(double x) { return ::erf(x); }
FUSED_HD double p_tanh(double x) { return ::tanh(x); }
FUSED_HD double p_sin(double x) { return ::sin(x); }
FUSED_HD double p_cos(double x) { return ::cos(x); }
FUSED_HD double p_sqrt(double x) { return ::sqrt(x); }
FUSED_HD double p_rsqrt(double x) { return 1.0 / ::sqrt(x); }
FUSED_HD double p_recip(double x) { return 1.0 / x; }
FUSED_HD double p_abs(double x) { return ::fabs(x); }
FUSED_HD double p_pow(double x, double s) { return ::pow(x, s); }
FUSED_HD double p_fma(double a, double b, double c) { return ::fma(a, b, c); }

template <typename T> FUSED_HD T p_relu(T x) { return x < T(0) ? T(0) : x; }
// v where x > 0 or x is NaN, else 0: relu's derivative as eager's threshold_backward takes it (a NaN input passes
// the gradient on)
template <typename T> FUSED_HD T p_where_pos(T x, T v) { return x <= T(0) ? T(0) : v; }
template <typename T> FUSED_HD T p_where_ge(T x, T s, T v) { return x >= s ? v : T(0); }
template <typename T> FUSED_HD T p_sign(T x) { return T(x > T(0)) - T(x < T(0)); }
// clamp to a bound as eager's clamp_min / clamp_max: a NaN in x or in the bound gives NaN
template <typename T> FUSED_HD T p_clamp_min(T x, T s) { return x < s || s != s ? s : x; }
template <typename T> FUSED_HD T p_clamp_max(T x, T s) { return x > s || s != s ? s : x; }
// x^s as eager's pow(Tensor, Scalar), which takes exponent 0.5 as sqrt and -0.5 as rsqrt (at -0 and -inf they differ
// from C's pow: sqrt(-0) = -0, rsqrt(-0) = -inf, both NaN at -inf)
template <typename T> FUSED_HD T p_pow_op(T x, T s) {
  return s == T(0.5) ? p_sqrt(x) : s == T(-0.5) ? p_rsqrt(x) : p_pow(x, s);
}
template <typename T> FUSED_HD T p_where_eq(T x, T s, T v) { return x == s ? v : T(0); }
template <typename T> FUSED_HD T p_zero_at(T x, T v) { return x == T(0) ? T(0) : v; }  // v, 0 where x == 0
template <typename T> FUSED_HD T p_nonzero(T x) { return x != x ? x : T(x != T(0)); }  // 0 or 1, NaN stays
// c ? a : b (a mask for vectors: common/vec_math.h), and w * d with 0 where the weight w is 0 (0 log 0 = 0: a
// probability of a masked, -inf, logit times its log).
template <typename T> FUSED_HD T p_select(bool c, T a, T b) { return c ? a : b; }
template <typename T> FUSED_HD T p_weight_mul(T w, T d) { return w == T(0) ? T(0) : w * d; }
template <typename T> FUSED_HD T p_max_nan(T a, T b) { return b != b || b > a ? b : a; }  // NaN in either stays
}  // namespace fused

#include "common/pointwise_math.h"
