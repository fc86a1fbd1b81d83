// CUDA binding of the rope family: the kernels of the CUDA twins fused::cuda_rope and fused::cuda_rope_backward
// (defined with their ops in rope_schema.cpp; fused/rope/ops.py routes CUDA tensors to them), the same checks as
// the CPU kernel, and a launch of the torch-free kernel in rope_kernels.cu on the current stream. Built only when
// torch has CUDA.
#include <torch/library.h>

#include <tuple>

#include "common/cuda_binding.h"
#include "rope/rope_args.h"
#include "rope/rope_kernels.h"

namespace fused {
namespace rope {
namespace {

namespace kr = fused::cuda::rope;

kr::Heads heads_of(const at::Tensor& x, const at::Tensor& out) {  // both [b, h, s, d] views
  return {x.data_ptr(),
          out.data_ptr(),
          {x.stride(0), x.stride(1), x.stride(2)},
          {out.stride(0), out.stride(1), out.stride(2)},
          x.size(1)};
}

std::tuple<at::Tensor, at::Tensor> rope_apply_cuda(const char* op, const char* first, const char* second,
                                                   const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const at::Tensor& cos_in, const at::Tensor& sin_in,
                                                   int64_t unsqueeze_dim, bool interleaved, bool backward) {
  const Shape sh = check_rope(op, first, second, q_in, k_in, cos_in, sin_in, unsqueeze_dim);
  check_cuda(op, first, q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t layout = layout_of(op, unsqueeze_dim);
  Outputs o = alloc_outputs(q_in, k_in);
  if (sh.b * sh.s == 0 || sh.d == 0) return {o.q, o.k};
  const at::Tensor q = heads_view(unit_last_stride(q_in), layout), k = heads_view(unit_last_stride(k_in), layout);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  check_launch(op, kr::rope(dtype_of(op, first, q), heads_of(q, heads_view(o.q, layout)),
                            heads_of(k, heads_view(o.k, layout)), cos.data_ptr(), sin.data_ptr(), sh.b, sh.s, sh.d,
                            sh.r, sh.cos_b == 1 ? 0 : sh.s * sh.r, interleaved, backward, current_stream()));
  return {o.q, o.k};
}

std::tuple<at::Tensor, at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  return rope_apply_cuda("rope", "q", "k", q, k, cos, sin, unsqueeze_dim, interleaved, false);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_cuda(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      int64_t unsqueeze_dim, bool interleaved) {
  return rope_apply_cuda("rope_backward", "grad_q", "grad_k", grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved,
                         true);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) { FUSED_ROPE_OPS(FUSED_IMPL_CUDA) }

}  // namespace rope
}  // namespace fused
