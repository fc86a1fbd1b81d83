// Argument checks of the norm family, shared by the CPU kernels and the CUDA binding; messages name the public op
// and the argument.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cmath>
#include <optional>

#include "common/checks.h"
#include "common/huge_pages.h"
#include "common/registration.h"

// The family's ops, each registered from <family>_cpu.cpp and <family>_cuda.cpp (common/registration.h).
#define FUSED_NORM_OPS(X) X("norm_fwd", norm_fwd) X("norm_backward", norm_backward)

namespace fused {
namespace norm {

inline const char* op_name(bool rms, bool add) {
  return rms ? (add ? "add_rms_norm" : "rms_norm") : (add ? "add_layer_norm" : "layer_norm");
}

// A tensor seen as rows x C, C the product of normalized_shape.
struct RowsShape {
  int64_t rows, C;
};

inline RowsShape rows_shape(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, "fused.", op, ": normalized_shape must have at least one dimension");
  TORCH_CHECK(x.dim() >= k && x.sizes().slice(x.dim() - k) == normalized_shape, "fused.", op, ": x of shape ",
              x.sizes(), " does not end with normalized_shape ", normalized_shape);
  int64_t rows = 1, C = 1;
  for (int64_t d = 0; d < x.dim(); ++d) (d < x.dim() - k ? rows : C) *= x.size(d);
  return {rows, C};
}

// weight / bias: floating, on x's device, of shape normalized_shape (any floating dtype: used in the math type).
inline void check_param(const char* op, const char* name, const at::Tensor& p, const at::Tensor& x,
                        at::IntArrayRef normalized_shape) {
  check_floating(op, name, p);
  TORCH_CHECK(p.device() == x.device(), "fused.", op, ": ", name, " is on ", p.device(), " but x is on ", x.device());
  TORCH_CHECK(p.sizes() == normalized_shape, "fused.", op, ": ", name, " must have shape normalized_shape ",
              normalized_shape, ", got ", p.sizes());
}

// The residual stream's dtype: x's, or float32 for 16-bit x.
inline bool residual_dtype_ok(at::ScalarType x, at::ScalarType r) {
  return r == x || (r == at::kFloat && (x == at::kHalf || x == at::kBFloat16));
}

inline RowsShape check_fwd(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                           at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias) {
  check_floating(op, "x", x);
  const RowsShape s = rows_shape(op, x, normalized_shape);
  if (residual) {
    TORCH_CHECK(residual->device() == x.device(), "fused.", op, ": residual is on ", residual->device(),
                " but x is on ", x.device());
    TORCH_CHECK(residual->sizes() == x.sizes(), "fused.", op, ": residual shape ", residual->sizes(),
                " does not match x shape ", x.sizes());
    TORCH_CHECK(residual_dtype_ok(x.scalar_type(), residual->scalar_type()), "fused.", op, ": residual has dtype ",
                dtype_name(residual->scalar_type()), " but x has dtype ", dtype_name(x.scalar_type()),
                " (the residual stream takes x's dtype, or float32 for 16-bit x)");
  }
  if (weight) check_param(op, "weight", *weight, x, normalized_shape);
  if (bias) check_param(op, "bias", *bias, x, normalized_shape);
  return s;
}

// grad (the output's dtype) and grad_sum (h's) like h; mean / rstd one per row in the math type.
inline RowsShape check_backward(const char* op, const at::Tensor& grad, const std::optional<at::Tensor>& grad_sum,
                                const at::Tensor& h, const at::Tensor& mean, const at::Tensor& rstd,
                                const std::optional<at::Tensor>& weight, at::IntArrayRef normalized_shape, bool rms) {
  check_floating(op, "grad", grad);
  const RowsShape s = rows_shape(op, h, normalized_shape);
  TORCH_CHECK(grad.device() == h.device() && grad.sizes() == h.sizes(), "fused.", op, ": grad (", grad.sizes(), " on ",
              grad.device(), ") must match h (", h.sizes(), " on ", h.device(), ")");
  TORCH_CHECK(residual_dtype_ok(grad.scalar_type(), h.scalar_type()), "fused.", op, ": h has dtype ",
              dtype_name(h.scalar_type()), " but grad has dtype ", dtype_name(grad.scalar_type()));
  if (grad_sum) {
    check_like(op, "grad_sum", *grad_sum, "h", h);
    TORCH_CHECK(grad_sum->sizes() == h.sizes(), "fused.", op, ": grad_sum shape ", grad_sum->sizes(),
                " does not match h shape ", h.sizes());
  }
  const auto math = at::toOpMathType(grad.scalar_type());
  for (const at::Tensor* t : {&rstd, &mean}) {
    if (t == &mean && rms) continue;
    TORCH_CHECK(t->scalar_type() == math && t->device() == h.device() && t->numel() == s.rows, "fused.", op,
                ": mean and rstd must hold one ", dtype_name(math), " per row on h's device");
  }
  if (weight) check_param(op, "weight", *weight, h, normalized_shape);
  return s;
}

// norm_fwd's inputs made contiguous and its outputs allocated: out like x, sum like residual (empty without one),
// mean (LayerNorm; else empty) and rstd per row in the math type, NaN for rows of no elements.
struct Forward {
  at::Tensor x, residual, out, sum, mean, rstd;
};
inline Forward prepare_fwd(const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, RowsShape s,
                           bool rms) {
  Forward f;
  f.x = x_in.contiguous();
  if (residual_in) f.residual = residual_in->contiguous();
  const auto math = at::toOpMathType(f.x.scalar_type());
  f.out = empty_output(f.x.sizes(), f.x.options());
  f.sum = f.residual.defined() ? empty_output(f.x.sizes(), f.residual.options()) : at::empty({0}, f.x.options());
  f.mean = at::empty({rms ? 0 : s.rows}, f.x.options().dtype(math));
  f.rstd = at::empty({s.rows}, f.x.options().dtype(math));
  if (s.rows > 0 && s.C == 0) {  // the statistics of an empty row are undefined
    f.mean.fill_(NAN);
    f.rstd.fill_(NAN);
  }
  return f;
}

// norm_backward's inputs made contiguous (grad_sum undefined when absent) and its outputs allocated: grad_h like
// h, grad_w / grad_b of shape normalized_shape in the math type when asked for, else empty.
struct Backward {
  at::Tensor grad, grad_sum, h, mean, rstd, grad_h, grad_w, grad_b;
};
inline Backward prepare_backward(const at::Tensor& grad, const std::optional<at::Tensor>& grad_sum, const at::Tensor& h,
                                 const at::Tensor& mean, const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                 bool weight_grad, bool bias_grad) {
  Backward b{grad.contiguous(), grad_sum ? grad_sum->contiguous() : at::Tensor(), h.contiguous(), mean.contiguous(),
             rstd.contiguous()};
  const auto options = h.options().dtype(at::toOpMathType(grad.scalar_type()));
  b.grad_h = empty_output(h.sizes(), h.options());
  b.grad_w = at::zeros(weight_grad ? normalized_shape : at::IntArrayRef{0}, options);
  b.grad_b = at::zeros(bias_grad ? normalized_shape : at::IntArrayRef{0}, options);
  return b;
}

}  // namespace norm
}  // namespace fused
