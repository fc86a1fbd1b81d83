// Per-row formulas of the log-prob and distillation row kernels, written once over a value type V: a scalar (CUDA
// device code and host code; include common/scalar_math.h first) or at::vec::Vectorized<T> (CPU; common/vec_math.h
// first). fused/loss/triton_logprob.py writes the same ones for Triton.
//
// A row of logits x becomes z = x / temperature; with m its max and log_s = log(sum_c exp(z_c - m)), the log-probs
// are log p_c = (z_c - m) - log_s and the entropy H = log_s - sum_c exp(z_c - m) (z_c - m) / sum_c exp(z_c - m).
// A class whose logit is -inf (a vocabulary masked through the bias) has p = 0 and adds 0 to every sum and gradient
// (0 log 0 = 0, as torch's Categorical.entropy and F.kl_div take it): products with a probability go through
// p_weight_mul.
//
// Log-probs: with per-row upstream gradients g_l (of log p_t) and g_h (of H), since dH/dz_c = -p_c (log p_c + H):
//   d/dz_c = [c == t] g_l - p_c (g_l + g_h (log p_c + H));  the target's entry uses 1 - p_t = -expm1(log p_t).
// Distillation, with ls = log p_S, lt = log p_T of a row and a reference point x per element:
//   sum_T = sum_c p_T (lt - x), sum_S = sum_c p_S (ls - x), x = ls (forward KL: loss sum_T), lt (reverse KL: loss
//   sum_S) or log m (JSD, m = beta p_T + (1 - beta) p_S: loss beta sum_T + (1 - beta) sum_S). Gradients with
//   respect to the student's z: p_S - p_T (forward KL), p_S (ls - lt - sum_S) (reverse KL), (1 - beta) p_S
//   (ls - log m - sum_S) (JSD: the terms through m cancel). Every gradient is then divided by the temperature.
#pragma once
#include <cmath>

#include "common/host_device.h"

namespace fused {
namespace loss {

// - p_c (g_l + g_h (log p_c + H)): a log-prob row's gradient at a class other than the target.
template <typename V> FUSED_HD V log_prob_grad(V logp, V g_logp, V g_entropy, V entropy) {
  return V(0) - p_weight_mul(p_exp(logp), g_logp + g_entropy * (logp + entropy));
}

// The target's entry, from expm1(log p_t) (exact for a confident prediction, where 1 - p_t would cancel).
template <typename M>
FUSED_HD M log_prob_target_grad(M logp_t, M p_t, M expm1_logp_t, M g_logp, M g_entropy, M entropy) {
  return M(0) - g_logp * expm1_logp_t - g_entropy * p_t * (logp_t + entropy);
}

enum class Divergence : int { ForwardKL = 0, ReverseKL = 1, JSD = 2 };

template <typename V> struct JsdParams {
  V beta, one_minus_beta, log_beta, log_one_minus_beta;
};

// log m = log(beta p_T + (1 - beta) p_S) from the logs: never log 0 while the logs are finite (0 < beta < 1).
template <typename V> FUSED_HD V log_mixture(V ls, V lt, const JsdParams<V>& j) {
  const V a = lt + j.log_beta, b = ls + j.log_one_minus_beta, hi = p_max_nan(a, b);
  return p_select(hi == V(-INFINITY), hi, hi + p_log(V(1) + p_exp(V(0) - p_abs(a - b))));  // both -inf: -inf
}

// The reference point x of the sums sum_T and sum_S.
template <Divergence D, typename V> FUSED_HD V divergence_point(V ls, V lt, const JsdParams<V>& j) {
  if constexpr (D == Divergence::ForwardKL) return ls;
  else if constexpr (D == Divergence::ReverseKL) return lt;
  else return log_mixture(ls, lt, j);
}

template <Divergence D, typename M> FUSED_HD M divergence_loss(M sum_t, M sum_s, const JsdParams<M>& j) {
  if constexpr (D == Divergence::ForwardKL) return sum_t;
  else if constexpr (D == Divergence::ReverseKL) return sum_s;
  else return j.beta * sum_t + j.one_minus_beta * sum_s;
}

// The row loss's gradient with respect to the student's z (before the row's scale and 1 / temperature).
template <Divergence D, typename V> FUSED_HD V divergence_grad(V ls, V lt, V x, V sum_s, const JsdParams<V>& j) {
  if constexpr (D == Divergence::ForwardKL) return p_exp(ls) - p_exp(lt);
  else if constexpr (D == Divergence::ReverseKL) return p_weight_mul(p_exp(ls), ls - lt - sum_s);
  else return j.one_minus_beta * p_weight_mul(p_exp(ls), ls - x - sum_s);
}

}  // namespace loss
}  // namespace fused
