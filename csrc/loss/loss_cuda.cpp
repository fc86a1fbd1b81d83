// CUDA binding of the loss family: the kernels of the CUDA twins fused::cuda_cross_entropy_rows,
// cuda_log_prob_rows and cuda_distillation_rows (defined in loss_schema.cpp) with the row ops' arguments and returns
// (fused/loss routes CUDA tensors to them or to the Triton kernels), the CPU kernels' checks (loss_args.h), and a
// launch of the torch-free kernels in loss_kernels.cu and logprob_kernels.cu on the current stream. Built only when
// torch has CUDA.
#include <torch/library.h>

#include "common/cuda_binding.h"
#include "loss/logprob_kernels.h"
#include "loss/loss_args.h"
#include "loss/loss_kernels.h"

namespace fused {
namespace {

// What every row kernel's launch needs first: the logits on a CUDA device, their dtype, that device current.
struct RowLaunch {
  DType dtype;
  c10::cuda::CUDAGuard guard;
};

RowLaunch row_launch(const char* op, const at::Tensor& logits) {
  check_cuda(op, "logits", logits);
  return {dtype_of(op, "logits", logits), c10::cuda::CUDAGuard(logits.device())};
}

// The rows of a launch: logits, the gradient (empty: none), the targets (null where every row counts).
cuda::loss::Rows rows_of(const at::Tensor& logits, const at::Tensor& grad, const int64_t* target,
                         int64_t ignore_index) {
  return {logits.data_ptr(),
          logits.stride(0),
          grad.numel() ? grad.data_ptr() : nullptr,
          grad.numel() ? grad.stride(0) : 0,
          target,
          logits.size(0),
          logits.size(1),
          ignore_index};
}

void cuda_cross_entropy_rows(const char* op, const CrossEntropyRows& in, const at::Tensor& grad, int64_t ignore_index,
                             double label_smoothing, double z_loss, double softcap) {
  const RowLaunch launch = row_launch(op, in.logits);
  const std::optional<at::Tensor>& weight = in.weight;
  const at::Tensor weight_sum = weight ? weight->sum(at::kDouble) : at::Tensor();
  const cuda::loss::RowsArgs args{rows_of(in.logits, grad, in.target.data_ptr<int64_t>(), ignore_index),
                                  weight ? weight->data_ptr() : nullptr,
                                  weight ? weight_sum.data_ptr<double>() : nullptr,
                                  in.scale.data_ptr(),
                                  in.scale.dim() == 2 ? 2 : 0,
                                  in.loss.data_ptr(),
                                  in.lse.data_ptr(),
                                  label_smoothing,
                                  z_loss,
                                  softcap};
  check_launch(op, cuda::loss::cross_entropy_rows(launch.dtype, args, current_stream()));
}

void cuda_log_prob_rows(const char* op, const LogProbRows& in, const at::Tensor& grad, int64_t ignore_index,
                        double temperature) {
  const RowLaunch launch = row_launch(op, in.logits);
  const cuda::loss::LogProbArgs args{rows_of(in.logits, grad, in.target.data_ptr<int64_t>(), ignore_index),
                                     in.scale.data_ptr(), in.logp.data_ptr(), in.entropy.data_ptr(), temperature};
  check_launch(op, cuda::loss::log_prob_rows(launch.dtype, args, current_stream()));
}

void cuda_distillation_rows(const char* op, const DistillationRows& in, const at::Tensor& grad, double beta,
                            double temperature, int64_t ignore_index) {
  const RowLaunch launch = row_launch(op, in.logits);
  const int64_t* target = in.target ? in.target->data_ptr<int64_t>() : nullptr;
  const cuda::loss::DistillationArgs args{rows_of(in.logits, grad, target, ignore_index),
                                          in.teacher.data_ptr(),
                                          in.teacher.stride(0),
                                          in.scale.data_ptr(),
                                          in.scale.dim() == 1 ? 1 : 0,
                                          in.loss.data_ptr(),
                                          static_cast<int>(in.divergence),
                                          beta,
                                          temperature};
  check_launch(op, cuda::loss::distillation_rows(launch.dtype, args, current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) {
  m.impl("cuda_cross_entropy_rows", &cross_entropy_rows_op<cuda_cross_entropy_rows>);
  m.impl("cuda_log_prob_rows", &log_prob_rows_op<cuda_log_prob_rows>);
  m.impl("cuda_distillation_rows", &distillation_rows_op<cuda_distillation_rows>);
}

}  // namespace fused
