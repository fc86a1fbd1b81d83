// CUDA kernels of the fused elementwise family, torch-free: launchers take raw pointers, sizes, a dtype and
// a stream, and return the launch's cudaError_t. Tensors are contiguous unless a row stride is given.
// Math runs in float (double for f64); every launcher returns cudaSuccess without launching when n == 0.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/op_codes.h"

namespace fused {
namespace cuda {

// unary_chain's ops, passed by value as a kernel argument.
struct UnaryChain {
  int32_t len;
  UnaryOp ops[kMaxChain];
  double scalars[kMaxChain];
};

// Dropout parameters: element i is kept (and multiplied by scale) iff Philox word i % 4 of counter i / 4
// under `seed` is >= threshold (csrc/common/philox.h).
struct Dropout {
  uint64_t seed;
  uint64_t threshold;
  double scale;
};

// The bias gradients sum rows x C values per column in fixed chunks of rows: this many math-type
// (float, double for f64) elements of workspace, chunks x C, which the caller allocates.
int64_t column_sum_workspace(int64_t rows, int64_t C);

// y = act(x + bias[i % C]); bias may be null.
cudaError_t bias_act(DType dtype, Act act, const void* x, const void* bias, void* y, int64_t n, int64_t C,
                     cudaStream_t stream);

// grad_x = grad * act'(x + bias); with bias, grad_bias[c] = sum over rows of grad_x[:, c] (deterministic),
// using `workspace` (column_sum_workspace(n / C, C) elements). Without bias, grad_bias and workspace are unused.
cudaError_t bias_act_backward(DType dtype, Act act, const void* grad, const void* x, const void* bias, void* grad_x,
                              void* grad_bias, void* workspace, int64_t n, int64_t C, cudaStream_t stream);

// y[r, c] = act(gate[r * gate_stride + c]) * up[r * up_stride + c]; y is contiguous [rows, cols].
cudaError_t glu(DType dtype, Act act, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* y,
                int64_t rows, int64_t cols, cudaStream_t stream);

// grad_gate = grad * up * act'(gate), grad_up = grad * act(gate); grad, grad_gate, grad_up contiguous.
cudaError_t glu_backward(DType dtype, Act act, const void* grad, const void* gate, int64_t gate_stride, const void* up,
                         int64_t up_stride, void* grad_gate, void* grad_up, int64_t rows, int64_t cols,
                         cudaStream_t stream);

// y = residual + keep(i) * (x + bias[i % C]); bias may be null.
cudaError_t bias_dropout_add(DType dtype, const void* x, const void* bias, const void* residual, void* y, int64_t n,
                             int64_t C, Dropout dropout, cudaStream_t stream);

// grad_x = keep(i) * grad; when grad_bias is not null, also its column sums over rows of width C,
// using `workspace` (column_sum_workspace(n / C, C) elements).
cudaError_t dropout_backward(DType dtype, const void* grad, void* grad_x, void* grad_bias, void* workspace, int64_t n,
                             int64_t C, Dropout dropout, cudaStream_t stream);

// y = ops[len-1](... ops[0](x)); chain.len <= kMaxChain.
cudaError_t unary_chain(DType dtype, const UnaryChain& chain, const void* x, void* y, int64_t n, cudaStream_t stream);

// grad_x = grad * product of each op's derivative at its input (the chain recomputed in the same pass).
cudaError_t unary_chain_backward(DType dtype, const UnaryChain& chain, const void* grad, const void* x, void* grad_x,
                                 int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace fused
