// CUDA binding of the norm family: the kernels of the CUDA twins fused::cuda_norm_fwd and fused::cuda_norm_backward
// (defined with their ops in norm_schema.cpp; fused/norm/ops.py routes CUDA tensors to them), the same checks as
// the CPU kernels, and launches of the torch-free kernels in norm_kernels.cu on the current stream. Built only when
// torch has CUDA.
#include <torch/library.h>

#include <tuple>

#include "common/cuda_binding.h"
#include "norm/norm_args.h"
#include "norm/norm_kernels.h"

namespace fused {
namespace norm {
namespace {

namespace kn = fused::cuda::norm;

// weight / bias in the math type, contiguous (a copy only when they are not already).
at::Tensor in_math(const std::optional<at::Tensor>& p, at::ScalarType math) {
  return p ? p->to(math).contiguous() : at::Tensor();
}
const void* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cuda(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps, bool rms) {
  const char* op = op_name(rms, residual_in.has_value());
  const RowsShape s = check_fwd(op, x_in, residual_in, normalized_shape, weight, bias);
  check_cuda(op, "x", x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  Forward f = prepare_fwd(x_in, residual_in, s, rms);
  const auto math = at::toOpMathType(f.x.scalar_type());
  const at::Tensor w = in_math(weight, math), b = in_math(bias, math);
  const at::Tensor& residual = f.residual;
  const DType stream = dtype_of(op, "residual", residual.defined() ? residual : f.x);
  check_launch(
      op, kn::norm_fwd(dtype_of(op, "x", f.x), stream, f.x.data_ptr(), ptr(residual), ptr(w), ptr(b), f.out.data_ptr(),
                       residual.defined() ? f.sum.data_ptr() : nullptr, rms ? nullptr : f.mean.data_ptr(),
                       f.rstd.data_ptr(), s.rows, s.C, eps, rms, current_stream()));
  return {f.out, f.sum, f.mean, f.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cuda(
    const at::Tensor& grad_in, const std::optional<at::Tensor>& grad_sum_in, const at::Tensor& h_in,
    const at::Tensor& mean_in, const at::Tensor& rstd_in, const std::optional<at::Tensor>& weight,
    at::IntArrayRef normalized_shape, bool rms, bool weight_grad, bool bias_grad) {
  const char* op = "norm_backward";
  const RowsShape s = check_backward(op, grad_in, grad_sum_in, h_in, mean_in, rstd_in, weight, normalized_shape, rms);
  check_cuda(op, "grad", grad_in);
  const c10::cuda::CUDAGuard guard(h_in.device());
  Backward bw =
      prepare_backward(grad_in, grad_sum_in, h_in, mean_in, rstd_in, normalized_shape, weight_grad, bias_grad);
  const at::Tensor w = in_math(weight, at::toOpMathType(bw.grad.scalar_type()));
  const int64_t workspace = kn::norm_backward_workspace(s.rows, s.C);
  at::Tensor ws_w = weight_grad ? at::empty({workspace}, bw.grad_w.options()) : at::Tensor();
  at::Tensor ws_b = bias_grad ? at::empty({workspace}, bw.grad_b.options()) : at::Tensor();
  check_launch(
      op, kn::norm_backward(dtype_of(op, "grad", bw.grad), dtype_of(op, "h", bw.h), bw.grad.data_ptr(),
                            ptr(bw.grad_sum), bw.h.data_ptr(), rms ? nullptr : bw.mean.data_ptr(), bw.rstd.data_ptr(),
                            ptr(w), bw.grad_h.data_ptr(), weight_grad ? bw.grad_w.data_ptr() : nullptr,
                            bias_grad ? bw.grad_b.data_ptr() : nullptr, weight_grad ? ws_w.data_ptr() : nullptr,
                            bias_grad ? ws_b.data_ptr() : nullptr, s.rows, s.C, rms, current_stream()));
  return {bw.grad_h, bw.grad_w, bw.grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) { FUSED_NORM_OPS(FUSED_IMPL_CUDA) }

}  // namespace norm
}  // namespace fused
