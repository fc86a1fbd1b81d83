// CUDA binding of the loss family: fused::cuda_cross_entropy_rows with the arguments and returns of
// fused::cross_entropy_rows (fused/loss/ops.py routes CUDA tensors to it or to the Triton kernel), the same checks
// as the CPU kernel, and a launch of the torch-free kernel in loss_kernels.cu on the current stream. Built only
// when torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "loss/loss_checks.h"
#include "loss/loss_kernels.h"

namespace fused {
namespace {

namespace kl = fused::cuda::loss;

kl::DType dtype_of(const char* op, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kl::DType::f32;
    case at::kHalf: return kl::DType::f16;
    case at::kBFloat16: return kl::DType::bf16;
    case at::kDouble: return kl::DType::f64;
    default:
      TORCH_CHECK(false, "fused.", op, ": logits has dtype ", dtype_name(t.scalar_type()),
                  "; expected float32, float16, bfloat16 or float64");
  }
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cuda(const at::Tensor& logits_in, const at::Tensor& target_in,
                                                           const std::optional<at::Tensor>& weight_in,
                                                           const at::Tensor& scale_in, const at::Tensor& grad,
                                                           int64_t ignore_index, double label_smoothing,
                                                           double z_loss, double softcap) {
  const char* op = "cross_entropy_rows";
  check_cross_entropy_rows(op, logits_in, target_in, weight_in, scale_in, grad, label_smoothing, softcap);
  TORCH_CHECK(logits_in.is_cuda(), "fused.", op, ": logits must be a CUDA tensor, got one on ", logits_in.device());
  const kl::DType dtype = dtype_of(op, logits_in);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const int64_t rows = logits_in.size(0), V = logits_in.size(1);
  const at::Tensor logits = V <= 1 || logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const at::Tensor target = target_in.contiguous(), scale = scale_in.contiguous();
  const std::optional<at::Tensor> weight =
      weight_in ? std::optional<at::Tensor>(weight_in->contiguous()) : std::nullopt;
  const at::Tensor weight_sum = weight ? weight->sum(at::kDouble) : at::Tensor();
  const auto math_opts = logits.options().dtype(loss_math_dtype(logits));
  at::Tensor loss = at::empty({rows}, math_opts), lse = at::empty({rows}, math_opts);
  kl::RowsArgs args{logits.data_ptr(), logits.stride(0), grad.numel() ? grad.data_ptr() : nullptr,
                    grad.numel() ? grad.stride(0) : 0, target.data_ptr<int64_t>(),
                    weight ? weight->data_ptr() : nullptr, weight ? weight_sum.data_ptr<double>() : nullptr,
                    scale.data_ptr(), scale.dim() == 2 ? 2 : 0, loss.data_ptr(), lse.data_ptr(), rows, V,
                    ignore_index, label_smoothing, z_loss, softcap};
  const cudaError_t err = kl::cross_entropy_rows(dtype, args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fused.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {loss, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fused, m) {
  m.def("cuda_cross_entropy_rows(Tensor logits, Tensor target, Tensor? weight, Tensor scale, Tensor(a!) grad, "
        "int ignore_index, float label_smoothing, float z_loss, float softcap) -> (Tensor loss, Tensor lse)");
}

TORCH_LIBRARY_IMPL(fused, CUDA, m) { m.impl("cuda_cross_entropy_rows", &cross_entropy_rows_cuda); }

}  // namespace fused
