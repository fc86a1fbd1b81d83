// Forward and derivative of every activation and unary_chain op, written once over a value type V.
// V is a scalar (float/double, CUDA and host) or at::vec::Vectorized<T> (CPU); the primitives p_* are
// declared for both before this header is included (scalar_math.h, vec_math.h).
#pragma once
#include "common/op_codes.h"

namespace fused {

template <typename V> FUSED_HD V p_sigmoid(V x) { return p_recip(V(1) + p_exp(-x)); }

// ---- activations: y = f(x) and f'(x) ----
template <Act A, typename V> FUSED_HD V act_fwd(V x) {
  if constexpr (A == Act::identity) return x;
  if constexpr (A == Act::relu) return p_relu(x);
  if constexpr (A == Act::gelu) return V(0.5) * x * (V(1) + p_erf(x * V(0.70710678118654752440)));
  if constexpr (A == Act::gelu_tanh) {
    V inner = V(0.79788456080286535588) * (x + V(0.044715) * x * x * x);
    return V(0.5) * x * (V(1) + p_tanh(inner));
  }
  if constexpr (A == Act::silu) return x / (V(1) + p_exp(-x));  // one rounding less than x * sigmoid(x), as torch
  if constexpr (A == Act::sigmoid) return p_sigmoid(x);
  if constexpr (A == Act::tanh) return p_tanh(x);
}

template <Act A, typename V> FUSED_HD V act_grad(V x) {
  if constexpr (A == Act::identity) return V(1);
  if constexpr (A == Act::relu) return p_where_pos(x, V(1));
  if constexpr (A == Act::gelu) {
    V cdf = V(0.5) * (V(1) + p_erf(x * V(0.70710678118654752440)));
    V pdf = p_exp(V(-0.5) * x * x) * V(0.39894228040143267794);
    return cdf + x * pdf;
  }
  if constexpr (A == Act::gelu_tanh) {
    V x2 = x * x;
    V t = p_tanh(V(0.79788456080286535588) * (x + V(0.044715) * x2 * x));
    V dinner = V(0.79788456080286535588) * (V(1) + V(3 * 0.044715) * x2);
    return V(0.5) * (V(1) + t) + V(0.5) * x * (V(1) - t * t) * dinner;
  }
  if constexpr (A == Act::silu) {
    V s = p_sigmoid(x);
    return s * (V(1) + x * (V(1) - s));
  }
  if constexpr (A == Act::sigmoid) {
    V s = p_sigmoid(x);
    return s * (V(1) - s);
  }
  if constexpr (A == Act::tanh) {
    V t = p_tanh(x);
    return V(1) - t * t;
  }
}

// g * f'(x) from dy = f'(x), as eager's backward forms it: relu passes or blocks g (threshold_backward selects, so an
// inf or NaN g where x <= 0 gives 0, not NaN); the others multiply.
template <Act A, typename V> FUSED_HD V times_act_grad(V g, V x, V dy) {
  if constexpr (A == Act::relu) return p_where_pos(x, g);
  else return g * dy;
}
template <Act A, typename V> FUSED_HD V act_backward(V g, V x) { return times_act_grad<A>(g, x, act_grad<A>(x)); }

// f(x) and f'(x) together, sharing the special function they both need (glu's backward wants both).
template <Act A, typename V> FUSED_HD void act_fwd_and_grad(V x, V& y, V& dy) {
  if constexpr (A == Act::gelu) {
    V e = p_erf(x * V(0.70710678118654752440));
    y = V(0.5) * x * (V(1) + e);
    dy = V(0.5) * (V(1) + e) + x * (p_exp(V(-0.5) * x * x) * V(0.39894228040143267794));
  } else if constexpr (A == Act::silu) {
    V d = V(1) + p_exp(-x);
    y = x / d;         // act_fwd's silu, bit for bit
    V s = p_recip(d);  // p_sigmoid(x), bit for bit
    dy = s * (V(1) + x * (V(1) - s));
  } else if constexpr (A == Act::sigmoid) {
    y = p_sigmoid(x);
    dy = y * (V(1) - y);
  } else if constexpr (A == Act::tanh) {
    y = p_tanh(x);
    dy = V(1) - y * y;
  } else {
    y = act_fwd<A>(x);
    dy = act_grad<A>(x);
  }
}

// ---- unary_chain ops: y = f(x; s) and df/dx ----
template <UnaryOp O, typename V> FUSED_HD V unary_fwd(V x, V s) {
  if constexpr (O == UnaryOp::neg) return -x;
  if constexpr (O == UnaryOp::abs) return p_abs(x);
  if constexpr (O == UnaryOp::square) return x * x;
  if constexpr (O == UnaryOp::sqrt) return p_sqrt(x);
  if constexpr (O == UnaryOp::rsqrt) return p_rsqrt(x);
  if constexpr (O == UnaryOp::exp) return p_exp(x);
  if constexpr (O == UnaryOp::log) return p_log(x);
  if constexpr (O == UnaryOp::sin) return p_sin(x);
  if constexpr (O == UnaryOp::cos) return p_cos(x);
  if constexpr (O == UnaryOp::tanh) return p_tanh(x);
  if constexpr (O == UnaryOp::sigmoid) return p_sigmoid(x);
  if constexpr (O == UnaryOp::relu) return p_relu(x);
  if constexpr (O == UnaryOp::gelu) return act_fwd<Act::gelu>(x);
  if constexpr (O == UnaryOp::gelu_tanh) return act_fwd<Act::gelu_tanh>(x);
  if constexpr (O == UnaryOp::silu) return act_fwd<Act::silu>(x);
  if constexpr (O == UnaryOp::reciprocal) return p_recip(x);
  if constexpr (O == UnaryOp::add) return x + s;
  if constexpr (O == UnaryOp::mul) return x * s;
  if constexpr (O == UnaryOp::pow) return p_pow_op(x, s);
  if constexpr (O == UnaryOp::clamp_min) return p_clamp_min(x, s);
  if constexpr (O == UnaryOp::clamp_max) return p_clamp_max(x, s);
}

// Derivatives follow eager's backward formulas (abs: sign, 0 at 0; clamp passes the gradient at the bound;
// pow with exponent 0: gradient 0; pow's x^(s - 1) is the pow op's, sqrt or rsqrt where eager's is).
template <UnaryOp O, typename V> FUSED_HD V unary_grad(V x, V s) {
  if constexpr (O == UnaryOp::neg) return V(-1);
  if constexpr (O == UnaryOp::abs) return p_sign(x);
  if constexpr (O == UnaryOp::square) return V(2) * x;
  if constexpr (O == UnaryOp::sqrt) return V(0.5) * p_rsqrt(x);
  if constexpr (O == UnaryOp::rsqrt) {  // -0.5 rsqrt(x)^3, as eager (+inf at -0)
    V r = p_rsqrt(x);
    return V(-0.5) * r * r * r;
  }
  if constexpr (O == UnaryOp::exp) return p_exp(x);
  if constexpr (O == UnaryOp::log) return p_recip(x);
  if constexpr (O == UnaryOp::sin) return p_cos(x);
  if constexpr (O == UnaryOp::cos) return -p_sin(x);
  if constexpr (O == UnaryOp::tanh) return act_grad<Act::tanh>(x);
  if constexpr (O == UnaryOp::sigmoid) return act_grad<Act::sigmoid>(x);
  if constexpr (O == UnaryOp::relu) return act_grad<Act::relu>(x);
  if constexpr (O == UnaryOp::gelu) return act_grad<Act::gelu>(x);
  if constexpr (O == UnaryOp::gelu_tanh) return act_grad<Act::gelu_tanh>(x);
  if constexpr (O == UnaryOp::silu) return act_grad<Act::silu>(x);
  if constexpr (O == UnaryOp::reciprocal) {
    V r = p_recip(x);
    return -(r * r);
  }
  if constexpr (O == UnaryOp::add) return V(1);
  if constexpr (O == UnaryOp::mul) return s;
  if constexpr (O == UnaryOp::pow) return s * p_pow_op(x, s - V(1));  // callers zero it when s == 0
  if constexpr (O == UnaryOp::clamp_min) return p_where_ge(x, s, V(1));
  if constexpr (O == UnaryOp::clamp_max) return p_where_ge(s, x, V(1));
}

// g * df/dx: relu and the clamps pass or block g (eager selects there, as for act_backward); the others multiply.
template <UnaryOp O, typename V> FUSED_HD V unary_backward(V g, V x, V s) {
  if constexpr (O == UnaryOp::relu) return p_where_pos(x, g);
  else if constexpr (O == UnaryOp::clamp_min) return p_where_ge(x, s, g);
  else if constexpr (O == UnaryOp::clamp_max) return p_where_ge(s, x, g);
  else return g * unary_grad<O>(x, s);
}

}  // namespace fused
