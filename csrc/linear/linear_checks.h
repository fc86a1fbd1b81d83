// Argument checks of linear_act shared by the CPU kernel and the CUDA binding; messages name op and argument.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "common/checks.h"

namespace fused {

// Whether act's derivative needs the pre-activation: relu, sigmoid and tanh take it from their output
// (act_grad_from_saved in linear_math.h), identity needs nothing, every other act the pre-activation.
constexpr bool act_needs_pre(Act a) {
  return a != Act::identity && a != Act::relu && a != Act::sigmoid && a != Act::tanh;
}

// x [..., K], weight [N, K], bias [N].
inline void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_floating(op, "x", x);
  check_like(op, "weight", weight, "x", x);
  TORCH_CHECK(x.dim() >= 1, "fused.", op, ": x must have at least 1 dimension, got a scalar");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "fused.", op,
              ": weight must be 2-D [out_features, in_features] with in_features == x.size(-1), got weight of "
              "shape ",
              weight.sizes(), " for x of shape ", x.sizes());
  if (bias) {
    check_like(op, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "fused.", op,
                ": bias must be 1-D with out_features = weight.size(0) entries, got bias of shape ", bias->sizes(),
                " for weight of shape ", weight.sizes());
  }
}

inline void check_grad_pre(const char* op, const at::Tensor& grad, const at::Tensor& saved) {
  check_floating(op, "grad", grad);
  check_like(op, "saved", saved, "grad", grad);
  TORCH_CHECK(grad.sizes() == saved.sizes(), "fused.", op, ": grad shape ", grad.sizes(),
              " does not match saved shape ", saved.sizes());
  TORCH_CHECK(grad.dim() >= 1, "fused.", op, ": grad must have at least 1 dimension");
}

inline std::vector<int64_t> linear_out_shape(const at::Tensor& x, const at::Tensor& weight) {
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return shape;
}

}  // namespace fused
