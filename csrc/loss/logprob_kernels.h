// CUDA kernels of the log-prob and distillation row ops, torch-free (the binding is loss_cuda.cpp):
// fused::log_prob_rows and fused::distillation_rows, one block per row of logits, with the formulas of
// logprob_math.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "loss/loss_kernels.h"

namespace fused {
namespace cuda {
namespace loss {

// Pointers of the math type (float; double for f64) unless said otherwise. scale [rows, 2]: the upstream gradients
// of logp and entropy. An out-of-range target gives that row NaN log-prob, entropy and gradient (no host sync).
struct LogProbArgs : Rows {
  const void* scale;
  void* logp;
  void* entropy;
  double temperature;
};

cudaError_t log_prob_rows(DType dtype, const LogProbArgs& args, cudaStream_t stream);

// As LogProbArgs, with the student's logits and gradient in Rows and the teacher's logits of their dtype (row
// stride ldt); scale [] (scale_step 0) or [rows] (scale_step 1); divergence: 0 forward KL, 1 reverse KL, 2 JSD
// (logprob_math.h's Divergence).
struct DistillationArgs : Rows {
  const void* teacher;
  int64_t ldt;
  const void* scale;
  int64_t scale_step;
  void* loss;
  int divergence;
  double beta, temperature;
};

cudaError_t distillation_rows(DType dtype, const DistillationArgs& args, cudaStream_t stream);

}  // namespace loss
}  // namespace cuda
}  // namespace fused
