// Argument checks shared by the CPU kernels and the CUDA bindings: every message names the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "common/op_codes.h"

namespace fused {

// Dtype as Python spells it ("torch.float32"), so C++ and Python errors read alike.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_floating_point(), "fused.", op, ": ", name, " must be a floating-point tensor, got ",
              dtype_name(t.scalar_type()));
}
inline void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "fused.", op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "fused.", op, ": ", name, " has dtype ",
              dtype_name(t.scalar_type()), " but ", ref_name, " has dtype ", dtype_name(ref.scalar_type()));
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
