// CUDA binding of the loss family: the kernel of the CUDA twin fused::cuda_cross_entropy_rows (defined in
// loss_schema.cpp) with fused::cross_entropy_rows' arguments and returns (fused/loss/ops.py routes CUDA tensors to
// it or to the Triton kernel), the CPU kernel's checks, and a launch of the torch-free kernel in loss_kernels.cu on
// the current stream. Built only when torch has CUDA.
#include <torch/library.h>

#include "common/cuda_binding.h"
#include "loss/loss_args.h"
#include "loss/loss_kernels.h"

namespace fused {
namespace {

void cuda_cross_entropy_rows(const char* op, const CrossEntropyRows& in, const at::Tensor& grad, int64_t ignore_index,
                             double label_smoothing, double z_loss, double softcap) {
  check_cuda(op, "logits", in.logits);
  const DType dtype = dtype_of(op, "logits", in.logits);
  const c10::cuda::CUDAGuard guard(in.logits.device());
  const at::Tensor &logits = in.logits, &target = in.target, &scale = in.scale, &loss = in.loss, &lse = in.lse;
  const std::optional<at::Tensor>& weight = in.weight;
  const int64_t rows = logits.size(0), V = logits.size(1);
  const at::Tensor weight_sum = weight ? weight->sum(at::kDouble) : at::Tensor();
  const cuda::loss::RowsArgs args{logits.data_ptr(),
                                  logits.stride(0),
                                  grad.numel() ? grad.data_ptr() : nullptr,
                                  grad.numel() ? grad.stride(0) : 0,
                                  target.data_ptr<int64_t>(),
                                  weight ? weight->data_ptr() : nullptr,
                                  weight ? weight_sum.data_ptr<double>() : nullptr,
                                  scale.data_ptr(),
                                  scale.dim() == 2 ? 2 : 0,
                                  loss.data_ptr(),
                                  lse.data_ptr(),
                                  rows,
                                  V,
                                  ignore_index,
                                  label_smoothing,
                                  z_loss,
                                  softcap};
  check_launch(op, cuda::loss::cross_entropy_rows(dtype, args, current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("cuda_cross_entropy_rows", &cross_entropy_rows_op<cuda_cross_entropy_rows>);
}

}  // namespace fused
