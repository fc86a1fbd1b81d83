// CUDA kernels of the fused linear family (torch-free; the binding is linear_cuda.cpp):
//   bias_act_epilogue: y = act(y + bias) in place after the cuBLAS GEMM, optionally keeping y + bias as `pre`;
//   act_grad_bias: grad_pre = grad * act'(saved) and the bias gradient (column sums of grad_pre) in one pass,
//   deterministic: per-row-chunk partial sums in a workspace, added in a fixed order by a second small kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/op_codes.h"

namespace fused {
namespace linear {

// y, pre: [M, N] row-major; pre and bias may be null.
cudaError_t launch_bias_act_epilogue(void* y, void* pre, const void* bias, int64_t M, int64_t N, Act act, DType dtype,
                                     cudaStream_t stream);

// Bytes of workspace act_grad_bias needs for a [M, N] gradient with a bias gradient (0 without).
size_t act_grad_bias_workspace_bytes(int64_t M, int64_t N, DType dtype);

// grad, saved, grad_pre: [M, N] row-major. saved: the pre-activation for gelu, gelu_tanh, silu, the output
// otherwise (unused for identity). grad_bias [N] and workspace: both null for no bias gradient.
cudaError_t launch_act_grad_bias(const void* grad, const void* saved, void* grad_pre, void* grad_bias, void* workspace,
                                 int64_t M, int64_t N, Act act, DType dtype, cudaStream_t stream);

}  // namespace linear
}  // namespace fused
