// CUDA kernels of the fused distance family, torch-free: launchers take raw pointers, sizes, a dtype, the
// metric and a stream, and return the launch's cudaError_t. Tensors are contiguous, batched [B, rows, D];
// math runs in float (double for f64); launchers return cudaSuccess without launching when there is no work.
// la, lb (device, [B] int64, or null: every row valid): a padded batch's valid row counts of a and b.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/op_codes.h"

namespace fused {
namespace cuda {
namespace distance {

// out[b, i, j] = ||a[b, i] - b[b, j]||_p (the sum of squares when squared) by direct differences, 0 for a padded
// pair: tiles of b in shared memory, each thread 8 x 4 outputs, stores coalesced along j. a [B, N, D],
// b [B, M, D], out [B, N, M].
cudaError_t pairwise_distances_direct(DType dtype, Metric metric, double p, bool squared, const void* a, const void* b,
                                      const int64_t* la, const int64_t* lb, void* out, int64_t B, int64_t N, int64_t M,
                                      int64_t D, cudaStream_t stream);

// grad_x[b, r, d] = sum_c w(grad, dist)[b, r, c] * phi(x[b, r, d] - y[b, c, d]) over the valid c (lr, lc: the
// valid counts of x and y; 0 for a padded r), with grad and dist of pair (r, c) at b * R * C + r * s_r + c * s_c:
// (s_r, s_c) = (C, 1) for grad_a, (1, R) for grad_b with x = b, y = a (phi is odd). One thread per output, fixed
// summation order: deterministic. grad_x in the math type.
cudaError_t pairwise_distances_grad(DType dtype, Metric metric, double p, bool squared, const void* x, const void* y,
                                    const void* grad, const void* dist, const int64_t* lr, const int64_t* lc,
                                    void* grad_x, int64_t B, int64_t R, int64_t C, int64_t D, int64_t s_r, int64_t s_c,
                                    cudaStream_t stream);

// pairwise_topk and radius_neighbors: for each valid row of a, its k best valid rows of b (nearest, or farthest when
// largest; within `radius` when within: distance <= radius, NaN never), sorted, ties to the lower index, as
// values [B, N, width] (the storage type) and indices [B, N, width]; slots past the candidates found, and padded
// rows of a, get index -1 and value inf (-inf when largest). Candidates are ranked by their value rounded to the
// storage type. One thread per row of a, its k best in a sorted list, tiles of b in shared memory. k (the
// candidates kept: pairwise_topk's k, radius_neighbors' max_neighbors, at most M) <= kMaxSelect (op_codes.h),
// else cudaErrorInvalidValue.
constexpr int kSelectTileBytes = 32768;  // select_direct's tile of b in shared memory: D * sizeof(math type) at most
cudaError_t select_direct(DType dtype, Metric metric, double p, bool squared, bool largest, bool within, double radius,
                          const void* a, const void* b, const int64_t* la, const int64_t* lb, void* values,
                          int64_t* indices, int64_t B, int64_t N, int64_t M, int64_t D, int64_t k, int64_t width,
                          cudaStream_t stream);

// Gradient through the selected pairs of select_direct (grad, values, indices [B, N, k]; index -1: no pair), in
// the math type. grad_a: one thread per output, local to its row. grad_b: over the pairs sorted by their point of
// b (keys [pairs] ascending: batch * M + index, or B * M for a missing pair; order: each sorted pair's position in
// [B, N, k]), the thread at the start of each run sums the run's terms in sorted order: deterministic, no atomics.
// grad_b must be zero-initialized (points no pair selected keep 0).
cudaError_t select_grad(DType dtype, Metric metric, double p, bool squared, const void* a, const void* b,
                        const void* grad, const void* values, const int64_t* indices, const int64_t* keys,
                        const int64_t* order, void* grad_a, void* grad_b, int64_t B, int64_t N, int64_t M, int64_t D,
                        int64_t k, cudaStream_t stream);

}  // namespace distance
}  // namespace cuda
}  // namespace fused
