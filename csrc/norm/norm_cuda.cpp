// CUDA binding of the norm family: internal ops fused::cuda_norm_fwd and fused::cuda_norm_backward with the
// arguments and returns of norm_fwd / norm_backward (fused/norm/ops.py routes CUDA tensors to them), the same
// checks as the CPU kernels, and launches of the torch-free kernels in norm_kernels.cu on the current stream.
// Built only when torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "norm/norm_args.h"
#include "norm/norm_kernels.h"

namespace fused {
namespace norm {
namespace {

namespace kn = fused::cuda::norm;

kn::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return kn::DType::f16;
    case at::kBFloat16: return kn::DType::bf16;
    case at::kDouble: return kn::DType::f64;
    default: return kn::DType::f32;  // the checks admit float32, float64, float16 and bfloat16 only
  }
}

void check_cuda(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "fused.", op, ": x must be a CUDA tensor, got one on ", x.device());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16, "fused.", op,
              ": x has dtype ", dtype_name(t), "; expected float32, float64, float16 or bfloat16");
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "fused.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

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
  check_cuda(op, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  Forward f = prepare_fwd(x_in, residual_in, s, rms);
  const auto math = at::toOpMathType(f.x.scalar_type());
  const at::Tensor w = in_math(weight, math), b = in_math(bias, math);
  const at::Tensor& residual = f.residual;
  check_launch(op, kn::norm_fwd(dtype_of(f.x), dtype_of(residual.defined() ? residual : f.x), f.x.data_ptr(),
                                ptr(residual), ptr(w), ptr(b), f.out.data_ptr(),
                                residual.defined() ? f.sum.data_ptr() : nullptr,
                                rms ? nullptr : f.mean.data_ptr(), f.rstd.data_ptr(), s.rows, s.C, eps, rms,
                                c10::cuda::getCurrentCUDAStream()));
  return {f.out, f.sum, f.mean, f.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cuda(
    const at::Tensor& grad_in, const std::optional<at::Tensor>& grad_sum_in, const at::Tensor& h_in,
    const at::Tensor& mean_in, const at::Tensor& rstd_in, const std::optional<at::Tensor>& weight,
    at::IntArrayRef normalized_shape, bool rms, bool weight_grad, bool bias_grad) {
  const char* op = "norm_backward";
  const RowsShape s = check_backward(op, grad_in, grad_sum_in, h_in, mean_in, rstd_in, weight, normalized_shape, rms);
  check_cuda(op, grad_in);
  const c10::cuda::CUDAGuard guard(h_in.device());
  Backward bw = prepare_backward(grad_in, grad_sum_in, h_in, mean_in, rstd_in, normalized_shape, weight_grad,
                                 bias_grad);
  const at::Tensor w = in_math(weight, at::toOpMathType(bw.grad.scalar_type()));
  const int64_t workspace = kn::norm_backward_workspace(s.rows, s.C);
  at::Tensor ws_w = weight_grad ? at::empty({workspace}, bw.grad_w.options()) : at::Tensor();
  at::Tensor ws_b = bias_grad ? at::empty({workspace}, bw.grad_b.options()) : at::Tensor();
  check_launch(op, kn::norm_backward(dtype_of(bw.grad), dtype_of(bw.h), bw.grad.data_ptr(), ptr(bw.grad_sum),
                                     bw.h.data_ptr(), rms ? nullptr : bw.mean.data_ptr(), bw.rstd.data_ptr(), ptr(w),
                                     bw.grad_h.data_ptr(), weight_grad ? bw.grad_w.data_ptr() : nullptr,
                                     bias_grad ? bw.grad_b.data_ptr() : nullptr,
                                     weight_grad ? ws_w.data_ptr() : nullptr, bias_grad ? ws_b.data_ptr() : nullptr,
                                     s.rows, s.C, rms, c10::cuda::getCurrentCUDAStream()));
  return {bw.grad_h, bw.grad_w, bw.grad_b};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fused, m) {
  m.def("cuda_norm_fwd(Tensor x, Tensor? residual, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
        "float eps, bool rms) -> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  m.def("cuda_norm_backward(Tensor grad, Tensor? grad_sum, Tensor h, Tensor mean, Tensor rstd, Tensor? weight, "
        "SymInt[] normalized_shape, bool rms, bool weight_grad, bool bias_grad) "
        "-> (Tensor grad_h, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("cuda_norm_fwd", &norm_fwd_cuda);
  m.impl("cuda_norm_backward", &norm_backward_cuda);
}

}  // namespace norm
}  // namespace fused
