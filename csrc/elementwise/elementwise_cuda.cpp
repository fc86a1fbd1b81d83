// CUDA binding of the fused elementwise family: the kernels of the CUDA twins fused::cuda_<op> (defined with the ops
// in elementwise_schema.cpp; fused/elementwise/ops.py routes CUDA tensors to them), the same argument checks as the
// CPU kernels, and launches of the torch-free kernels in elementwise_kernels.cu on the current stream. Built only
// when torch has CUDA.
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "common/cuda_binding.h"
#include "common/philox.h"
#include "elementwise/elementwise_args.h"
#include "elementwise/elementwise_kernels.h"

namespace fused {
namespace {

const void* data_or_null(const std::optional<at::Tensor>& t) { return t ? t->data_ptr() : nullptr; }

// Partial column sums of the bias gradients: float (double for double), chunks x C.
at::Tensor column_sum_workspace(const at::Tensor& like, int64_t rows, int64_t C) {
  const auto dtype = like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::empty({cuda::column_sum_workspace(rows, C)}, like.options().dtype(dtype));
}

// ---- bias_act ----

at::Tensor bias_act_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in, c10::string_view act) {
  const char* op = "bias_act";
  const Act a = parse_act(op, act);
  check_x_bias(op, x_in, bias_in);
  const CudaInput in = cuda_input(op, "x", x_in);
  at::Tensor x = x_in.contiguous();
  std::optional<at::Tensor> bias = bias_in ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  check_launch(op, cuda::bias_act(in.dtype, a, x.data_ptr(), data_or_null(bias), y.data_ptr(), n, bias ? x.size(-1) : 1,
                                  current_stream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_act_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                          const std::optional<at::Tensor>& bias_in,
                                                          c10::string_view act) {
  const char* op = "bias_act_backward";
  const Act a = parse_act(op, act);
  check_grad_like(op, grad_in, "x", x_in);
  if (bias_in) check_bias(op, x_in, *bias_in);
  const CudaInput in = cuda_input(op, "x", x_in);
  at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  std::optional<at::Tensor> bias = bias_in ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  at::Tensor grad_x, grad_bias;
  std::tie(grad_x, grad_bias) = bias_act_grads(x, bias_in);
  const int64_t n = x.numel();
  if (n == 0) return {grad_x, grad_bias};
  const int64_t C = bias ? x.size(-1) : 1;
  at::Tensor workspace = bias ? column_sum_workspace(x, n / C, C) : at::Tensor();
  check_launch(op, cuda::bias_act_backward(in.dtype, a, grad.data_ptr(), x.data_ptr(), data_or_null(bias),
                                           grad_x.data_ptr(), bias ? grad_bias.data_ptr() : nullptr,
                                           bias ? workspace.data_ptr() : nullptr, n, C, current_stream()));
  return {grad_x, grad_bias};
}

// ---- glu ----

at::Tensor glu_cuda(const at::Tensor& gate_in, const at::Tensor& up_in, c10::string_view act) {
  const char* op = "glu";
  const Act a = parse_act(op, act);
  check_glu(op, gate_in, up_in);
  const CudaInput in = cuda_input(op, "gate", gate_in);
  Rows g = as_rows(gate_in), u = as_rows(up_in);
  at::Tensor y = at::empty(gate_in.sizes(), gate_in.options());
  if (y.numel() == 0) return y;
  check_launch(op, cuda::glu(in.dtype, a, g.t.data_ptr(), g.stride, u.t.data_ptr(), u.stride, y.data_ptr(), g.rows,
                             g.cols, current_stream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> glu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                     const at::Tensor& up_in, c10::string_view act) {
  const char* op = "glu_backward";
  const Act a = parse_act(op, act);
  check_glu(op, gate_in, up_in);
  const CudaInput in = cuda_input(op, "gate", gate_in);
  check_grad_like(op, grad_in, "gate", gate_in);
  Rows g = as_rows(gate_in), u = as_rows(up_in);
  at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_gate = at::empty(gate_in.sizes(), gate_in.options());
  at::Tensor grad_up = at::empty(gate_in.sizes(), gate_in.options());
  if (grad.numel() == 0) return {grad_gate, grad_up};
  check_launch(op, cuda::glu_backward(in.dtype, a, grad.data_ptr(), g.t.data_ptr(), g.stride, u.t.data_ptr(), u.stride,
                                      grad_gate.data_ptr(), grad_up.data_ptr(), g.rows, g.cols, current_stream()));
  return {grad_gate, grad_up};
}

// ---- bias_dropout_add ----

cuda::Dropout dropout_params(const char* op, double p, const at::Tensor& seed) {
  return {dropout_seed(op, p, seed), dropout_threshold(p), p < 1.0 ? 1.0 / (1.0 - p) : 0.0};
}

at::Tensor bias_dropout_add_seeded_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in,
                                        const at::Tensor& residual_in, double p, const at::Tensor& seed) {
  const char* op = "bias_dropout_add";
  check_bias_dropout_add(op, x_in, bias_in, residual_in);
  const cuda::Dropout dropout = dropout_params(op, p, seed);
  const CudaInput in = cuda_input(op, "x", x_in);
  at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous();
  std::optional<at::Tensor> bias = bias_in ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  check_launch(op, cuda::bias_dropout_add(in.dtype, x.data_ptr(), data_or_null(bias), residual.data_ptr(), y.data_ptr(),
                                          n, bias ? x.size(-1) : 1, dropout, current_stream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> dropout_backward_cuda(const at::Tensor& grad_in, double p, const at::Tensor& seed,
                                                         bool bias_grad) {
  const char* op = "dropout_backward";
  check_floating(op, "grad", grad_in);
  const cuda::Dropout dropout = dropout_params(op, p, seed);
  const CudaInput in = cuda_input(op, "grad", grad_in);
  const DropoutGrads d = dropout_grads(grad_in, bias_grad);
  const int64_t n = d.grad.numel(), C = d.C;
  if (n == 0) return {d.grad_x, d.grad_bias};
  at::Tensor workspace = bias_grad ? column_sum_workspace(d.grad, n / C, C) : at::Tensor();
  check_launch(op, cuda::dropout_backward(
                       in.dtype, d.grad.data_ptr(), d.grad_x.data_ptr(), bias_grad ? d.grad_bias.data_ptr() : nullptr,
                       bias_grad ? workspace.data_ptr() : nullptr, n, bias_grad ? C : 1, dropout, current_stream()));
  return {d.grad_x, d.grad_bias};
}

// ---- unary_chain ----

// str[] arguments arrive as std::vector<std::string> (c10::string_view would not own the text).
cuda::UnaryChain chain_params(const char* op, const std::vector<std::string>& ops) {
  const auto parsed = parse_chain(op, ops);
  TORCH_CHECK(parsed.size() <= static_cast<size_t>(kMaxChain), "fused.", op, ": the CUDA kernel takes at most ",
              kMaxChain, " ops per call, got ", parsed.size(), "; split the chain");
  cuda::UnaryChain chain{};
  chain.len = static_cast<int32_t>(parsed.size());
  for (size_t j = 0; j < parsed.size(); ++j) std::tie(chain.ops[j], chain.scalars[j]) = parsed[j];
  return chain;
}

at::Tensor unary_chain_cuda(const at::Tensor& x_in, const std::vector<std::string>& ops) {
  const char* op = "unary_chain";
  const cuda::UnaryChain chain = chain_params(op, ops);
  check_floating(op, "x", x_in);
  const CudaInput in = cuda_input(op, "x", x_in);
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  check_launch(op, cuda::unary_chain(in.dtype, chain, x.data_ptr(), y.data_ptr(), x.numel(), current_stream()));
  return y;
}

at::Tensor unary_chain_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                     const std::vector<std::string>& ops) {
  const char* op = "unary_chain_backward";
  const cuda::UnaryChain chain = chain_params(op, ops);
  check_floating(op, "x", x_in);
  check_grad_like(op, grad_in, "x", x_in);
  const CudaInput in = cuda_input(op, "x", x_in);
  at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  at::Tensor grad_x = at::empty_like(x);
  if (x.numel() == 0) return grad_x;
  check_launch(op, cuda::unary_chain_backward(in.dtype, chain, grad.data_ptr(), x.data_ptr(), grad_x.data_ptr(),
                                              x.numel(), current_stream()));
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) { FUSED_ELEMENTWISE_OPS(FUSED_IMPL_CUDA) }

}  // namespace fused
