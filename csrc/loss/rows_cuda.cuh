// Device pieces the loss family's CUDA row kernels share (loss_kernels.cu, logprob_kernels.cu): one block of
// kRowThreads threads per row of logits.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/cuda_convert.cuh"
#include "common/dtype.h"
#include "loss/loss_kernels.h"

namespace fused {
namespace cuda {
namespace loss {

constexpr int kRowThreads = 512;

__device__ __forceinline__ float expm1_of(float x) { return expm1f(x); }
__device__ __forceinline__ double expm1_of(double x) { return ::expm1(x); }

// This block's row: its logits, its gradient (null for none), its target (read as 0 where out of range: bad), and
// whether it is left out (its target is ignore_index).
template <typename T> struct BlockRow {
  const T* x;
  T* grad;
  int64_t t;
  bool ignored, bad;
};

template <typename T> __device__ __forceinline__ BlockRow<T> block_row(const Rows& a) {
  const int64_t row = blockIdx.x, t = a.target ? a.target[row] : 0;
  const bool ignored = a.target && t == a.ignore_index, bad = !ignored && (t < 0 || t >= a.V);
  return {static_cast<const T*>(a.logits) + row * a.ld, a.grad ? static_cast<T*>(a.grad) + row * a.ldg : nullptr,
          bad ? 0 : t, ignored, bad};
}

// When `skip`: the row's outputs (at index row) 0 and its gradient (by the block's threads; none when grad is null)
// zero.
template <typename T, typename... M>
__device__ __forceinline__ bool skip_row(bool skip, T* grad, int64_t V, int64_t row, M*... outputs) {
  if (!skip) return false;
  if (threadIdx.x == 0) ((outputs[row] = M(0)), ...);
  if (grad)
    for (int64_t c = threadIdx.x; c < V; c += kRowThreads) grad[c] = from_math<T>(typename MathType<T>::type(0));
  return true;
}

// launch(Type<T>{}, blocks) for the dtype, one block per row, then the launch's error: nothing for no rows, and a
// grid past 2^31 - 1 blocks refused.
template <typename F> cudaError_t launch_rows(DType dtype, int64_t rows, const F& launch) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return visit_dtype(dtype, [&](auto type) {
    launch(type, static_cast<unsigned>(rows));
    return cudaGetLastError();
  });
}

}  // namespace loss
}  // namespace cuda
}  // namespace fused
