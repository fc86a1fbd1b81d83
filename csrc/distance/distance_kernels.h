// CUDA kernels of the fused distance family, torch-free: launchers take raw pointers, sizes, a dtype, the
// metric and a stream, and return the launch's cudaError_t. Tensors are contiguous, batched [B, rows, D];
// math runs in float (double for f64); launchers return cudaSuccess without launching when there is no work.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/op_codes.h"

namespace fused {
namespace cuda {
namespace distance {


// out[b, i, j] = ||a[b, i] - b[b, j]||_p (the sum of squares when squared) by direct differences: tiles of b in
// shared memory, each thread 8 x 4 outputs, stores coalesced along j. a [B, N, D], b [B, M, D], out [B, N, M].
cudaError_t pairwise_distances_direct(DType dtype, Metric metric, double p, bool squared, const void* a,
                                      const void* b, void* out, int64_t B, int64_t N, int64_t M, int64_t D,
                                      cudaStream_t stream);

// grad_x[b, r, d] = sum_c w(grad, dist)[b, r, c] * phi(x[b, r, d] - y[b, c, d]), with grad and dist of pair
// (r, c) at b * R * C + r * s_r + c * s_c: (s_r, s_c) = (C, 1) for grad_a, (1, R) for grad_b with x = b,
// y = a (phi is odd). One thread per output, fixed summation order: deterministic. grad_x in the math type.
cudaError_t pairwise_distances_grad(DType dtype, Metric metric, double p, bool squared, const void* x,
                                    const void* y, const void* grad, const void* dist, void* grad_x, int64_t B,
                                    int64_t R, int64_t C, int64_t D, int64_t s_r, int64_t s_c,
                                    cudaStream_t stream);

}  // namespace distance
}  // namespace cuda
}  // namespace fused
