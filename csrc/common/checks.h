// Argument checks shared by the CPU kernels and the CUDA bindings: every message names the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include <utility>

#include "common/op_codes.h"

namespace fused {

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_floating_point(), "fused.", op, ": ", name, " must be a floating-point tensor, got ",
              t.scalar_type());
}
inline void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "fused.", op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "fused.", op, ": ", name, " has dtype ", t.scalar_type(),
              " but ", ref_name, " has dtype ", ref.scalar_type());
}
// bias must be 1-D with x.size(-1) entries.
inline void check_bias(const char* op, const at::Tensor& x, const at::Tensor& bias) {
  check_like(op, "bias", bias, "x", x);
  TORCH_CHECK(bias.dim() == 1 && x.dim() >= 1 && bias.size(0) == x.size(-1), "fused.", op,
              ": bias must be 1-D with x.size(-1) entries, got bias of shape ", bias.sizes(), " for x of shape ",
              x.sizes());
}

Act parse_act(const char* op, c10::string_view act);
// "name" or "name:scalar" (the scalar written as Python's repr of a float).
std::pair<UnaryOp, double> parse_unary(const char* op, c10::string_view spec);

}  // namespace fused
