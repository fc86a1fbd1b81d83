// CUDA kernel of the loss family, torch-free (the binding is loss_cuda.cpp): fused::cross_entropy_rows, one block
// per row of logits, with the formulas of loss_math.h; and the rows every row kernel takes (logprob_kernels.h).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace fused {
namespace cuda {
namespace loss {

// What every row kernel reads and writes by row: logits [rows, V] (row stride ld), grad [rows, V] (row stride ldg,
// the logits' dtype; null for no gradient, may equal logits), target [rows] (null where every row counts; a row whose
// target is ignore_index is left out).
struct Rows {
  const void* logits;
  int64_t ld;
  void* grad;
  int64_t ldg;
  const int64_t* target;
  int64_t rows, V, ignore_index;
};

// Pointers of the math type (float; double for f64) unless said otherwise; weight and weight_sum null without
// class weights. scale: [2] (scale_ld 0) or [rows, 2] (scale_ld 2). An out-of-range target gives that row a NaN
// loss and gradient (no host sync).
struct RowsArgs : Rows {
  const void* weight;
  const double* weight_sum;  // sum of the class weights
  const void* scale;
  int64_t scale_ld;
  void* loss;
  void* lse;
  double label_smoothing, z_loss, softcap;  // softcap 0: none
};

cudaError_t cross_entropy_rows(DType dtype, const RowsArgs& args, cudaStream_t stream);

}  // namespace loss
}  // namespace cuda
}  // namespace fused
