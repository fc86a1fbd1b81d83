// Per-row cross-entropy formulas shared by the CPU kernel (loss_cpu.cpp) and the CUDA kernel (loss_kernels.cu);
// fused/loss/triton_kernels.py writes the same ones. M is the math type: float (double for double inputs).
//
// A row of V logits x with target t becomes z = cap * tanh(x / cap) under a softcap (z = x without), and is
// summarised relative to its max m, so that a large common offset of the logits costs no precision:
//   log_s = log(sum_c exp(z_c - m)),  zt = z_t - m,  smooth = sum_c w_c (z_c - m)   (w_c = 1 without class weights)
// so lse = m + log_s. The row's loss, without the z-loss term (the caller adds z_loss * lse^2):
//   (1 - ls) w_t (lse - z_t) + ls / V * sum_c w_c (lse - z_c)                       (ls: label smoothing)
// and its gradient, with a scaling the cross-entropy part and b the z-loss part (1 / weight sum and 1 / count
// for a mean, 1 for a sum, grad_output[row] for reduction="none"), p = softmax(z):
//   d/dz_c = coef_p p_c - coef_w w_c - [c == t] coef_t,  times 1 - (z_c / cap)^2 under a softcap,
// where coef_t = a (1 - ls) w_t, coef_w = a ls / V, coef_p = coef_t + rest, rest = coef_w sum_c w_c + 2 b z_loss lse.
// The target's entry is coef_t (p_t - 1) + rest p_t - coef_w w_t with p_t - 1 = expm1(log p_t): exact in the
// math type for a confident prediction (p_t -> 1), where p_t - 1 would cancel.
#pragma once
#include "common/philox.h"  // FUSED_HD

namespace fused {
namespace loss {

template <typename M> struct Params {
  M label_smoothing;
  M smooth_coef;  // label_smoothing / V
  M weight_sum;   // sum of the class weights (V without)
  M z_loss;
  M softcap;      // 0: none
};

template <typename M> FUSED_HD M row_loss(M log_s, M zt, M w_t, M smooth, const Params<M>& p) {
  M loss = (M(1) - p.label_smoothing) * w_t * (log_s - zt);
  if (p.label_smoothing != M(0)) loss += p.smooth_coef * (p.weight_sum * log_s - smooth);
  return loss;
}

template <typename M> struct GradCoefs {
  M coef_p, coef_w, coef_t, rest;
};

template <typename M> FUSED_HD GradCoefs<M> grad_coefs(M lse, M w_t, M a, M b, const Params<M>& p) {
  GradCoefs<M> g;
  g.coef_t = a * (M(1) - p.label_smoothing) * w_t;
  g.coef_w = a * p.smooth_coef;
  g.rest = g.coef_w * p.weight_sum + M(2) * b * p.z_loss * lse;
  g.coef_p = g.coef_t + g.rest;
  return g;
}

// The target's gradient entry before the softcap factor; p_t = exp(log_pt), expm1_log_pt = p_t - 1.
template <typename M> FUSED_HD M target_grad(const GradCoefs<M>& g, M p_t, M expm1_log_pt, M w_t) {
  return g.coef_t * expm1_log_pt + g.rest * p_t - g.coef_w * w_t;
}

}  // namespace loss
}  // namespace fused
