// CUDA kernels of the rope family, torch-free: the launcher takes raw pointers, strides, sizes, a dtype and a stream,
// and returns the launch's cudaError_t. q, k and their outputs are [b, heads, s, d] by strides (unit stride along
// d); cos / sin are contiguous [b or 1, s, r] in the same dtype. Math in float (double for f64).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"

namespace fused {
namespace cuda {
namespace rope {

// One of q and k: input and output pointers, their batch / head / position strides (elements), its head count.
struct Heads {
  const void* x;
  void* out;
  int64_t x_strides[3], out_strides[3];
  int64_t heads;
};

// One block per position (b, s) rotates every head of q and of k with that position's cos / sin row: out1 = x1 c1 -
// x2 s1, out2 = x2 c2 + x1 s2 over the halves of the first r features (the pairs (x[2i], x[2i+1]) when interleaved),
// features past r copied. backward: the transpose (sin halves swapped and negated; -sin when interleaved).
// cos_batch_stride: s * r, or 0 for a table shared by the batch. Returns cudaSuccess without launching when there is
// no position or d is 0.
cudaError_t rope(DType dtype, const Heads& q, const Heads& k, const void* cos, const void* sin, int64_t b, int64_t s,
                 int64_t d, int64_t r, int64_t cos_batch_stride, bool interleaved, bool backward, cudaStream_t stream);

}  // namespace rope
}  // namespace cuda
}  // namespace fused
