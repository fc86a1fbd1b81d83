// CUDA binding of the fused distance family: the kernels of the CUDA twins fused::cuda_pairwise_distances and
// fused::cuda_pairwise_distances_backward (defined in distance_schema.cpp; fused/distance/ops.py routes CUDA tensors
// to them on the direct path), the same checks as the CPU kernels, and launches of the torch-free kernels in
// distance_kernels.cu on the current stream. Built only when torch has CUDA.
#include <torch/library.h>

#include <tuple>

#include "common/cuda_binding.h"
#include "distance/distance_args.h"
#include "distance/distance_kernels.h"
#include "distance/distance_math.h"

namespace fused {
namespace distance {
namespace {

namespace kd = fused::cuda::distance;

at::Tensor pairwise_distances_cuda(const at::Tensor& a_in, const at::Tensor& b_in, double p, bool squared) {
  const char* op = "pairwise_distances";
  check_p(op, p, squared);
  Batched x = batched(op, a_in, b_in, /*to_math=*/false);
  check_cuda(op, "a", a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor out = at::empty(out_shape(x, x.M), a_in.options());
  if (out.numel() == 0) return out;
  check_launch(op, kd::pairwise_distances_direct(dtype_of(op, "a", a_in), metric_of(p), p, squared, x.a.data_ptr(),
                                                 x.b.data_ptr(), out.data_ptr(), x.B, x.N, x.M, x.D,
                                                 current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> pairwise_distances_backward_cuda(const at::Tensor& grad_in, const at::Tensor& a_in,
                                                                    const at::Tensor& b_in, const at::Tensor& dist_in,
                                                                    double p, bool squared) {
  const char* op = "pairwise_distances_backward";
  check_p(op, p, squared);
  Batched x = batched(op, a_in, b_in, /*to_math=*/false);
  check_cuda(op, "a", a_in);
  check_like(op, "grad", grad_in, "a", a_in);
  check_like(op, "dist", dist_in, "a", a_in);
  TORCH_CHECK(grad_in.sizes() == at::IntArrayRef(out_shape(x, x.M)) && dist_in.sizes() == grad_in.sizes(), "fused.",
              op, ": grad ", grad_in.sizes(), " and dist ", dist_in.sizes(), " must have the distances' shape");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const auto math = at::toOpMathType(a_in.scalar_type());
  at::Tensor ga = at::zeros({x.B, x.N, x.D}, a_in.options().dtype(math));
  at::Tensor gb = at::zeros({x.B, x.M, x.D}, a_in.options().dtype(math));
  if (x.B * x.N * x.M * x.D > 0 && p != 0) {
    at::Tensor g = grad_in.contiguous(), dist = dist_in.contiguous();
    const DType dtype = dtype_of(op, "a", a_in);
    const auto stream = current_stream();
    check_launch(op, kd::pairwise_distances_grad(dtype, metric_of(p), p, squared, x.a.data_ptr(), x.b.data_ptr(),
                                                 g.data_ptr(), dist.data_ptr(), ga.data_ptr(), x.B, x.N, x.M, x.D,
                                                 x.M, 1, stream));
    // grad_b: the same kernel with a and b swapped and grad, dist read transposed (phi is odd).
    check_launch(op, kd::pairwise_distances_grad(dtype, metric_of(p), p, squared, x.b.data_ptr(), x.a.data_ptr(),
                                                 g.data_ptr(), dist.data_ptr(), gb.data_ptr(), x.B, x.M, x.N, x.D,
                                                 1, x.M, stream));
  }
  return {reduce_to(ga, x, x.N, a_in), reduce_to(gb, x, x.M, b_in)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("cuda_pairwise_distances", &pairwise_distances_cuda);
  m.impl("cuda_pairwise_distances_backward", &pairwise_distances_backward_cuda);
}

}  // namespace distance
}  // namespace fused
