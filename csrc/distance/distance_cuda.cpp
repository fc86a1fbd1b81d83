// CUDA binding of the fused distance family: the kernels of the CUDA twins fused::cuda_pairwise_distances,
// fused::cuda_pairwise_topk, fused::cuda_radius_neighbors and their backward ops (defined in distance_schema.cpp;
// fused/distance/ops.py routes CUDA tensors to them on the direct path), the same checks as the CPU kernels, and
// launches of the torch-free kernels in distance_kernels.cu on the current stream. Built only when torch has CUDA.
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common/cuda_binding.h"
#include "distance/distance_args.h"
#include "distance/distance_kernels.h"
#include "distance/distance_math.h"

namespace fused {
namespace distance {
namespace {

namespace kd = fused::cuda::distance;
using OptTensor = c10::optional<at::Tensor>;

// The device pointer of flattened lengths, null when not given.
const int64_t* lengths_ptr(const at::Tensor& flat) { return flat.defined() ? flat.data_ptr<int64_t>() : nullptr; }

at::Tensor pairwise_distances_cuda(const at::Tensor& a_in, const at::Tensor& b_in, double p, bool squared,
                                   const OptTensor& lengths_a, const OptTensor& lengths_b) {
  const char* op = "pairwise_distances";
  Batched x = check_pairwise_distances(op, a_in, b_in, p, squared, /*to_math=*/false);
  check_cuda(op, "a", a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  at::Tensor out = at::empty(out_shape(x, x.M), a_in.options());
  if (out.numel() == 0) return out;
  check_launch(op, kd::pairwise_distances_direct(dtype_of(op, "a", a_in), metric_of(p), p, squared, x.a.data_ptr(),
                                                 x.b.data_ptr(), lengths_ptr(lengths.a), lengths_ptr(lengths.b),
                                                 out.data_ptr(), x.B, x.N, x.M, x.D, current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> pairwise_distances_backward_cuda(const at::Tensor& grad_in, const at::Tensor& a_in,
                                                                    const at::Tensor& b_in, const at::Tensor& dist_in,
                                                                    double p, bool squared, const OptTensor& lengths_a,
                                                                    const OptTensor& lengths_b) {
  const char* op = "pairwise_distances_backward";
  Batched x = check_pairwise_distances_backward(op, grad_in, a_in, b_in, dist_in, p, squared, /*to_math=*/false);
  check_cuda(op, "a", a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  const int64_t *la = lengths_ptr(lengths.a), *lb = lengths_ptr(lengths.b);
  const auto math = at::toOpMathType(a_in.scalar_type());
  at::Tensor ga = at::zeros({x.B, x.N, x.D}, a_in.options().dtype(math));
  at::Tensor gb = at::zeros({x.B, x.M, x.D}, a_in.options().dtype(math));
  if (x.B * x.N * x.M * x.D > 0 && p != 0) {
    at::Tensor g = grad_in.contiguous(), dist = dist_in.contiguous();
    const DType dtype = dtype_of(op, "a", a_in);
    const auto stream = current_stream();
    check_launch(
        op, kd::pairwise_distances_grad(dtype, metric_of(p), p, squared, x.a.data_ptr(), x.b.data_ptr(), g.data_ptr(),
                                        dist.data_ptr(), la, lb, ga.data_ptr(), x.B, x.N, x.M, x.D, x.M, 1, stream));
    // grad_b: the same kernel with a and b swapped and grad, dist read transposed (phi is odd).
    check_launch(
        op, kd::pairwise_distances_grad(dtype, metric_of(p), p, squared, x.b.data_ptr(), x.a.data_ptr(), g.data_ptr(),
                                        dist.data_ptr(), lb, la, gb.data_ptr(), x.B, x.M, x.N, x.D, 1, x.M, stream));
  }
  return {reduce_to(ga, x, x.N, a_in), reduce_to(gb, x, x.M, b_in)};
}

// pairwise_topk and radius_neighbors (within: radius given): select_direct into `width` slots.
std::tuple<at::Tensor, at::Tensor> select_cuda(const char* op, const at::Tensor& a_in, const at::Tensor& b_in,
                                               const Batched& x, int64_t width, double p, bool squared, bool largest,
                                               bool within, double radius, const OptTensor& lengths_a,
                                               const OptTensor& lengths_b) {
  check_cuda(op, "a", a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  const int64_t keep = std::max<int64_t>(1, std::min(width, x.M));
  TORCH_CHECK(x.D * at::elementSize(at::toOpMathType(a_in.scalar_type())) <= kd::kSelectTileBytes, "fused.", op,
              ": the CUDA C++ kernel takes D up to ", kd::kSelectTileBytes / 4, " (float64: ", kd::kSelectTileBytes / 8,
              "), got ", x.D, "; the Triton backend takes any D");
  TORCH_CHECK(keep <= kMaxSelect, "fused.", op, ": the CUDA C++ kernel keeps at most ", kMaxSelect,
              " neighbours per row, got ", keep, "; the Triton backend takes any number");
  at::Tensor values = at::empty(out_shape(x, width), a_in.options());
  at::Tensor indices = at::empty(out_shape(x, width), a_in.options().dtype(at::kLong));
  if (values.numel() == 0) return {values, indices};
  check_launch(
      op, kd::select_direct(dtype_of(op, "a", a_in), metric_of(p), p, squared, largest, within, radius, x.a.data_ptr(),
                            x.b.data_ptr(), lengths_ptr(lengths.a), lengths_ptr(lengths.b), values.data_ptr(),
                            indices.data_ptr<int64_t>(), x.B, x.N, x.M, x.D, keep, width, current_stream()));
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> pairwise_topk_cuda(const at::Tensor& a_in, const at::Tensor& b_in, int64_t k,
                                                      double p, bool squared, bool largest, const OptTensor& lengths_a,
                                                      const OptTensor& lengths_b) {
  const char* op = "pairwise_topk";
  Batched x = check_pairwise_topk(op, a_in, b_in, k, p, squared, /*to_math=*/false);
  return select_cuda(op, a_in, b_in, x, k, p, squared, largest, false, 0.0, lengths_a, lengths_b);
}

std::tuple<at::Tensor, at::Tensor> radius_neighbors_cuda(const at::Tensor& a_in, const at::Tensor& b_in, double radius,
                                                         int64_t max_neighbors, const OptTensor& lengths_a,
                                                         const OptTensor& lengths_b, double p) {
  const char* op = "radius_neighbors";
  Batched x = check_radius_neighbors(op, a_in, b_in, radius, max_neighbors, p, /*to_math=*/false);
  return select_cuda(op, a_in, b_in, x, max_neighbors, p, false, false, true, radius, lengths_a, lengths_b);
}

// Gradient through the selected pairs: grad_a local to each row, grad_b over the pairs stably sorted by their point
// of b (deterministic).
std::tuple<at::Tensor, at::Tensor> pairwise_topk_backward_cuda(const at::Tensor& grad_in, const at::Tensor& a_in,
                                                               const at::Tensor& b_in, const at::Tensor& values_in,
                                                               const at::Tensor& indices_in, double p, bool squared) {
  const char* op = "pairwise_topk_backward";
  Batched x =
      check_pairwise_topk_backward(op, grad_in, a_in, b_in, values_in, indices_in, p, squared, /*to_math=*/false);
  check_cuda(op, "a", a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t k = values_in.size(-1);
  const auto math = at::toOpMathType(a_in.scalar_type());
  at::Tensor ga = at::zeros({x.B, x.N, x.D}, a_in.options().dtype(math));
  at::Tensor gb = at::zeros({x.B, x.M, x.D}, a_in.options().dtype(math));
  if (x.B * x.N * x.M * k * x.D > 0 && p != 0) {  // (M = 0: every index is -1, nothing to add)
    at::Tensor idx = indices_in.reshape({x.B, x.N, k}).contiguous();
    at::Tensor batch_start = at::arange(x.B, idx.options()).mul_(x.M).view({x.B, 1, 1});
    at::Tensor keys = at::where(idx < 0, at::full({}, x.B * x.M, idx.options()), idx + batch_start).reshape(-1);
    at::Tensor sorted, order;
    std::tie(sorted, order) = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    at::Tensor g = grad_in.contiguous(), v = values_in.contiguous();
    check_launch(op, kd::select_grad(dtype_of(op, "a", a_in), metric_of(p), p, squared, x.a.data_ptr(), x.b.data_ptr(),
                                     g.data_ptr(), v.data_ptr(), idx.data_ptr<int64_t>(), sorted.data_ptr<int64_t>(),
                                     order.data_ptr<int64_t>(), ga.data_ptr(), gb.data_ptr(), x.B, x.N, x.M, x.D, k,
                                     current_stream()));
  }
  return {reduce_to(ga, x, x.N, a_in), reduce_to(gb, x, x.M, b_in)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) { FUSED_DISTANCE_OPS(FUSED_IMPL_CUDA) }

}  // namespace distance
}  // namespace fused
