// CPU primitives for pointwise_math.h and distance/distance_math.h over at::vec::Vectorized<T> (AVX2 / AVX-512 /
// scalar fallback).
#pragma once
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include "common/host_device.h"

namespace fused {
template <typename T> using Vec = at::vec::Vectorized<T>;

template <typename T> inline Vec<T> p_exp(Vec<T> x) { return x.exp(); }
template <typename T> inline Vec<T> p_log(Vec<T> x) { return x.log(); }
template <typename T> inline Vec<T> p_erf(Vec<T> x) { return x.erf(); }
template <typename T> inline Vec<T> p_tanh(Vec<T> x) { return x.tanh(); }
template <typename T> inline Vec<T> p_sin(Vec<T> x) { return x.sin(); }
template <typename T> inline Vec<T> p_cos(Vec<T> x) { return x.cos(); }
template <typename T> inline Vec<T> p_sqrt(Vec<T> x) { return x.sqrt(); }
template <typename T> inline Vec<T> p_rsqrt(Vec<T> x) { return Vec<T>(1) / x.sqrt(); }
template <typename T> inline Vec<T> p_recip(Vec<T> x) { return Vec<T>(1) / x; }
template <typename T> inline Vec<T> p_abs(Vec<T> x) { return x.abs(); }
template <typename T> inline Vec<T> p_pow(Vec<T> x, Vec<T> s) { return x.pow(s); }
// NaN-propagating max(x, 0), like eager relu.
template <typename T> inline Vec<T> p_relu(Vec<T> x) { return Vec<T>::blendv(x, Vec<T>(0), x < Vec<T>(0)); }
template <typename T> inline Vec<T> p_where_pos(Vec<T> x, Vec<T> v) {
  return Vec<T>::blendv(v, Vec<T>(0), x <= Vec<T>(0));
}
template <typename T> inline Vec<T> p_where_ge(Vec<T> x, Vec<T> s, Vec<T> v) { return v & (x >= s); }
template <typename T> inline Vec<T> p_sign(Vec<T> x) {
  return (Vec<T>(1) & (x > Vec<T>(0))) - (Vec<T>(1) & (x < Vec<T>(0)));
}
// As the scalar ones (common/scalar_math.h): NaN in x or the bound gives NaN; pow as eager's pow op. s is one
// scalar broadcast.
template <typename T> inline Vec<T> p_clamp_min(Vec<T> x, Vec<T> s) { return Vec<T>::blendv(x, s, (x < s) | (s != s)); }
template <typename T> inline Vec<T> p_clamp_max(Vec<T> x, Vec<T> s) { return Vec<T>::blendv(x, s, (x > s) | (s != s)); }
template <typename T> inline Vec<T> p_pow_op(Vec<T> x, Vec<T> s) {
  T e;
  s.store(&e, 1);
  return e == T(0.5) ? x.sqrt() : e == T(-0.5) ? p_rsqrt(x) : x.pow(s);
}
// a * b + c (fma_once) and a * b - c (fms_once) rounded once on every build, as CUDA's fmaf and Triton's tl.fma:
// at::vec's generic fmadd and fmsub (the default build, without AVX2) round the product first.
template <typename T> inline Vec<T> fma_once(Vec<T> a, Vec<T> b, Vec<T> c) {
#if defined(CPU_CAPABILITY_DEFAULT)
  alignas(64) T x[Vec<T>::size()], y[Vec<T>::size()], z[Vec<T>::size()];
  a.store(x);
  b.store(y);
  c.store(z);
  for (int64_t l = 0; l < Vec<T>::size(); ++l) x[l] = std::fma(x[l], y[l], z[l]);
  return Vec<T>::loadu(x);
#else
  return at::vec::fmadd(a, b, c);
#endif
}
template <typename T> inline Vec<T> fms_once(Vec<T> a, Vec<T> b, Vec<T> c) {
#if defined(CPU_CAPABILITY_DEFAULT)
  return fma_once(a, b, c.neg());
#else
  return at::vec::fmsub(a, b, c);
#endif
}
// as scalar_math.h's p_fma (fmaf): the vector body and the scalar tail round alike
template <typename T> inline Vec<T> p_fma(Vec<T> a, Vec<T> b, Vec<T> c) { return fma_once(a, b, c); }
// v as computed, rounded: the empty asm keeps the compiler from fusing the product that made v into a later add or
// subtract (an fma would use it unrounded), as __fmul_rn does in CUDA.
template <typename V> inline V rounded(V v) {
  __asm__("" : "+m"(v));
  return v;
}
template <typename T> inline Vec<T> p_where_eq(Vec<T> x, Vec<T> s, Vec<T> v) { return v & (x == s); }
template <typename T> inline Vec<T> p_zero_at(Vec<T> x, Vec<T> v) {
  return Vec<T>::blendv(v, Vec<T>(0), x == Vec<T>(0));
}
// 0 or 1 (x != 0), NaN stays; and the max, NaN in either stays.
template <typename T> inline Vec<T> p_nonzero(Vec<T> x) { return at::vec::minimum(x.abs().ceil(), Vec<T>(1)); }
template <typename T> inline Vec<T> p_max_nan(Vec<T> a, Vec<T> b) { return at::vec::maximum(a, b); }
template <typename T> inline Vec<T> p_select(Vec<T> mask, Vec<T> a, Vec<T> b) { return Vec<T>::blendv(b, a, mask); }
template <typename T> inline Vec<T> p_weight_mul(Vec<T> w, Vec<T> d) {
  return Vec<T>::blendv(w * d, Vec<T>(0), w == Vec<T>(0));
}
}  // namespace fused

#include "common/pointwise_math.h"
