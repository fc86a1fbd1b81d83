// Argument checks shared by the optimizer CPU kernels and CUDA binding: every message names the op and argument.
#pragma once
#include <ATen/ATen.h>

namespace fused {

// The dtype of the norm grad_norm returns, as torch's clip_grad_norm_ returns it: the gradients' promoted dtype
// (float32 for none). The norm itself is accumulated in fp32 (fp64 for fp64 gradients) and added up in fp64.
inline at::ScalarType norm_dtype(at::TensorList grads) {
  at::ScalarType t = grads.empty() ? at::kFloat : grads[0].scalar_type();
  for (const auto& g : grads) t = c10::promoteTypes(t, g.scalar_type());
  return t;
}

// The kernels walk every tensor as flat memory: it must cover its elements exactly, in any dimension order (a
// strided view such as t[:, :5] has gaps, an expanded tensor overlaps itself). The optimizers and
// fused.clip_grad_norm_ pass other layouts through a dense copy.
inline void check_dense(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "fused.", op, ": ", name, " must be dense in memory (no gaps, no ",
              "overlap), got sizes ", t.sizes(), " and strides ", t.strides());
}

inline void check_nonneg(const char* op, const char* name, double v) {
  TORCH_CHECK(v >= 0, "fused.", op, ": ", name, " must be >= 0, got ", v);
}

// One tensor's SGD hyperparameters (its row of the per-tensor table).
inline void check_sgd_hyper(const char* op, double lr, double momentum, double dampening, double weight_decay,
                            bool nesterov, bool use_momentum) {
  check_nonneg(op, "lr", lr);
  check_nonneg(op, "momentum", momentum);
  check_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK((momentum != 0) == use_momentum, "fused.", op,
              ": momentum must be nonzero for every tensor of a call or for none");
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), "fused.", op,
              ": nesterov needs momentum > 0 and dampening == 0");
}

// One tensor's Adam hyperparameters (its row of the per-tensor table).
inline void check_adam_hyper(const char* op, double lr, double beta1, double beta2, double eps, double weight_decay) {
  check_nonneg(op, "lr", lr);
  check_nonneg(op, "eps", eps);
  check_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK(0 <= beta1 && beta1 < 1 && 0 <= beta2 && beta2 < 1, "fused.", op, ": betas must be in [0, 1), got (",
              beta1, ", ", beta2, ")");
}

}  // namespace fused
