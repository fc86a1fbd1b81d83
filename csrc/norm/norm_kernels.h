// CUDA kernels of the norm family, torch-free: launchers take raw pointers, sizes, dtypes and a stream, and return
// the launch's cudaError_t. Tensors are contiguous rows x C; math and statistics run in float (double for f64);
// the weight and bias come in the math type. Launchers return cudaSuccess without launching when rows or C is 0.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace fused {
namespace cuda {
namespace norm {

// One block per row. h = x (+ residual, rounded to `stream`'s dtype and stored in sum); out = (h - mean) * rstd *
// weight + bias in x's dtype (mean 0 for RMSNorm); mean (LayerNorm only) and rstd per row in the math type.
// x_dtype: x and out; stream: residual and sum (x's dtype, or f32 for 16-bit x). residual, sum, weight, bias,
// mean may be null when absent.
cudaError_t norm_fwd(DType x_dtype, DType stream, const void* x, const void* residual, const void* weight,
                     const void* bias, void* out, void* sum, void* mean, void* rstd, int64_t rows, int64_t C,
                     double eps, bool rms, cudaStream_t cuda_stream);

// The backward's rows are cut into chunks fixed by the row count alone; the weight and bias gradients take this
// many math-type elements of workspace each (chunks x C), which the caller allocates.
int64_t norm_backward_workspace(int64_t rows, int64_t C);

// grad_h = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) (+ grad_sum) with xhat = (h - mean) * rstd and
// gw = grad * weight, one block per chunk of rows; grad_weight = sum over rows of grad * xhat and grad_bias = sum
// of grad, as per-chunk partials in fixed workspace slots added in chunk order (deterministic, no atomics).
// grad_dtype: grad; stream: h, grad_sum, grad_h. grad_sum, weight, mean (RMSNorm), grad_weight / grad_bias (with
// their workspaces) may be null.
cudaError_t norm_backward(DType grad_dtype, DType stream, const void* grad, const void* grad_sum, const void* h,
                          const void* mean, const void* rstd, const void* weight, void* grad_h, void* grad_weight,
                          void* grad_bias, void* workspace_weight, void* workspace_bias, int64_t rows, int64_t C,
                          bool rms, cudaStream_t cuda_stream);

}  // namespace norm
}  // namespace cuda
}  // namespace fused
