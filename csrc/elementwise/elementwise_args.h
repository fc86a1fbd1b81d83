// Argument handling shared by the CPU kernels and the CUDA binding of the elementwise family.
#pragma once
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/huge_pages.h"
#include "common/registration.h"

// The family's ops, each registered from <family>_cpu.cpp and <family>_cuda.cpp (common/registration.h).
#define FUSED_ELEMENTWISE_OPS(X)                        \
  X("bias_act", bias_act)                               \
  X("bias_act_backward", bias_act_backward)             \
  X("glu", glu)                                         \
  X("glu_backward", glu_backward)                       \
  X("bias_dropout_add_seeded", bias_dropout_add_seeded) \
  X("dropout_backward", dropout_backward)               \
  X("unary_chain", unary_chain)                         \
  X("unary_chain_backward", unary_chain_backward)

namespace fused {

inline void check_same_shape(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  TORCH_CHECK(t.sizes() == ref.sizes(), "fused.", op, ": ", name, " shape ", t.sizes(), " does not match ", ref_name,
              " shape ", ref.sizes());
}

// A 2-D view [rows, cols] of t with contiguous columns and one row stride, copying only when the strides do
// not allow it. This reads the two halves of a chunked [.., 2C] tensor in place.
struct Rows {
  at::Tensor t;
  int64_t rows, cols, stride;
};
inline Rows as_rows(const at::Tensor& t_in) {
  at::Tensor t = t_in;
  const int64_t cols = t.dim() ? t.size(-1) : 1;
  const int64_t rows = cols ? t.numel() / cols : 0;
  bool ok = t.dim() <= 1 || t.stride(-1) == 1;
  int64_t stride = t.dim() >= 2 ? t.stride(-2) : cols;
  int64_t expected = stride;
  for (int64_t d = t.dim() - 2; ok && d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) ok = false;
    expected *= t.size(d);
  }
  if (t.dim() == 1 && t.stride(0) != 1) ok = false;
  if (!ok || stride < cols) {
    t = t.contiguous();
    stride = cols;
  }
  return {t, rows, cols, stride};
}

// The gradient of an output shaped like `ref`: ref's dtype, device and shape.
inline void check_grad_like(const char* op, const at::Tensor& grad, const char* ref_name, const at::Tensor& ref) {
  check_like(op, "grad", grad, ref_name, ref);
  check_same_shape(op, "grad", grad, ref_name, ref);
}

// bias_act and bias_dropout_add: x and an optional bias [x.size(-1)].
inline void check_x_bias(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  check_floating(op, "x", x);
  if (bias) check_bias(op, x, *bias);
}

inline void check_bias_dropout_add(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                   const at::Tensor& residual) {
  check_x_bias(op, x, bias);
  check_like(op, "residual", residual, "x", x);
  check_same_shape(op, "residual", residual, "x", x);
}

// bias_act_backward's outputs: grad_x like x and grad_bias like bias ([0] without one), zeroed when x is empty.
inline std::tuple<at::Tensor, at::Tensor> bias_act_grads(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  at::Tensor grad_x = empty_output_like(x);
  at::Tensor grad_bias = bias ? at::empty_like(*bias) : at::empty({0}, x.options());
  if (x.numel() == 0) grad_bias.zero_();
  return {grad_x, grad_bias};
}

// dropout_backward's operands: grad made contiguous, grad_x like it, and grad_bias [C] zeroed, C = grad.size(-1)
// with bias_grad (0 without).
struct DropoutGrads {
  at::Tensor grad, grad_x, grad_bias;
  int64_t C;
};
inline DropoutGrads dropout_grads(const at::Tensor& grad_in, bool bias_grad) {
  at::Tensor grad = grad_in.contiguous();
  const int64_t C = bias_grad ? grad.size(-1) : 0;
  return {grad, empty_output_like(grad), at::zeros({C}, grad.options()), C};
}

inline void check_glu(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_floating(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  TORCH_CHECK(gate.sizes() == up.sizes(), "fused.", op, ": gate and up must have the same shape, got ", gate.sizes(),
              " and ", up.sizes());
}

inline void check_p(const char* op, double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "fused.", op, ": p must be in [0, 1], got ", p);
}

inline uint64_t seed_value(const char* op, const at::Tensor& seed) {
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1, "fused.", op,
              ": seed must be a CPU int64 tensor with one element");
  return static_cast<uint64_t>(seed.item<int64_t>());
}

// The dropout ops' p (checked) and seed: the Philox key.
inline uint64_t dropout_seed(const char* op, double p, const at::Tensor& seed) {
  check_p(op, p);
  return seed_value(op, seed);
}

inline std::vector<std::pair<UnaryOp, double>> parse_chain(const char* op, const std::vector<std::string>& ops) {
  std::vector<std::pair<UnaryOp, double>> chain;
  for (const auto& s : ops) chain.push_back(parse_unary(op, s));
  return chain;
}

}  // namespace fused
