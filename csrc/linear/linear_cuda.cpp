// CUDA binding of the fused linear family: the kernels of the CUDA twins (defined in linear_schema.cpp)
// fused::cuda_linear_act_fwd (the cuBLAS GEMM through ATen, then the bias + activation epilogue kernel) and
// fused::cuda_linear_act_grad_pre (derivative + bias reduction, one pass). fused/linear/ops.py routes CUDA tensors
// here or to the Triton kernels (fused.set_backend).
#include <torch/library.h>

#include "common/cuda_binding.h"
#include "linear/linear_checks.h"
#include "linear/linear_kernels.h"

namespace fused {
namespace {

std::tuple<at::Tensor, at::Tensor> cuda_linear_act_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias, c10::string_view act,
                                                       bool save_pre) {
  const Act a = parse_act("linear_act", act);
  check_linear("linear_act", x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t K = x.size(-1), N = weight.size(0);
  const at::Tensor x2 = x.reshape({c10::multiply_integers(x.sizes().slice(0, x.dim() - 1)), K});
  const int64_t M = x2.size(0);
  // 16-bit outputs take the bias inside the GEMM (rounded once, as nn.Linear does); fp32 / fp64 in the epilogue.
  const bool round_once = x.element_size() < 4;
  at::Tensor y = (bias && round_once ? at::addmm(*bias, x2, weight.t()) : at::mm(x2, weight.t())).contiguous();
  const bool keep_pre = save_pre && act_needs_pre(a);
  at::Tensor pre = keep_pre ? at::empty_like(y) : at::empty({0}, x.options());
  const bool add_bias = bias && !round_once;
  if (add_bias || keep_pre || a != Act::identity) {
    const at::Tensor b = add_bias ? bias->contiguous() : at::Tensor();
    check_launch("linear_act", linear::launch_bias_act_epilogue(y.data_ptr(), keep_pre ? pre.data_ptr() : nullptr,
                                                                add_bias ? b.data_ptr() : nullptr, M, N, a,
                                                                dtype_of("linear_act", "x", x), current_stream()));
  }
  const auto shape = linear_out_shape(x, weight);
  return {y.view(shape), keep_pre ? pre.view(shape) : pre};
}

std::tuple<at::Tensor, at::Tensor> cuda_linear_act_grad_pre(const at::Tensor& grad_in, const at::Tensor& saved_in,
                                                            c10::string_view act, bool bias_grad) {
  const char* op = "linear_act_grad_pre";
  const Act a = parse_act(op, act);
  check_grad_pre(op, grad_in, saved_in);
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous(), saved = saved_in.contiguous();
  const int64_t N = grad.size(-1), M = N ? grad.numel() / N : 0;
  at::Tensor grad_pre = at::empty_like(grad);
  at::Tensor grad_bias = at::zeros({bias_grad ? N : 0}, grad.options());
  if (M == 0 || N == 0) return {grad_pre, grad_bias};
  const DType dtype = dtype_of(op, "grad", grad);
  at::Tensor workspace;
  if (bias_grad)
    workspace = at::empty({static_cast<int64_t>(linear::act_grad_bias_workspace_bytes(M, N, dtype))},
                          grad.options().dtype(at::kByte));
  check_launch(
      op, linear::launch_act_grad_bias(grad.data_ptr(), saved.data_ptr(), grad_pre.data_ptr(),
                                       bias_grad ? grad_bias.data_ptr() : nullptr,
                                       bias_grad ? workspace.data_ptr() : nullptr, M, N, a, dtype, current_stream()));
  return {grad_pre, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("cuda_linear_act_fwd", &cuda_linear_act_fwd);
  m.impl("cuda_linear_act_grad_pre", &cuda_linear_act_grad_pre);
}

}  // namespace fused
