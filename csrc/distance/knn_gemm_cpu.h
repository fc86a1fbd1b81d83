// pairwise_topk's and radius_neighbors' p=2 path at large D on the CPU (use_matmul): GEMM candidates, exact
// re-rank (knn_gemm_cpu.cpp).
#pragma once
#include <ATen/ATen.h>

#include "distance/distance_args.h"

namespace fused {
namespace distance {

// values, indices [B, N, width] (values in the output dtype): for each valid row of x.a, its width nearest (or
// farthest when largest) valid rows of x.b by p=2 distance (squared: its square), sorted, ties to the lower index,
// the same indices as a float64 search; missing neighbours and padded rows as write_missing writes them. With a
// radius (radius_neighbors; nearest only): only the rows of b whose returned value (the float64 distance rounded
// once to the output dtype) is <= radius.
// The GEMM of that search's filter for `rows` rows of a per batch, D columns (the answer is the same with any;
// python -m fused.info reports it), and the levels of int8 codes that torch's int8 GEMM sums exactly here (0: none).
enum class KnnFilter { kFloat32, kInt8 };
constexpr int64_t kCodeMinRows = 128, kCodeMaxD = 32768;
KnnFilter knn_filter(int64_t rows, int64_t D);
int int8_gemm_levels();

void knn_gemm_cpu(const Batched& x, const Lengths& la, const Lengths& lb, bool squared, bool largest,
                  const c10::optional<double>& radius, at::Tensor& values, at::Tensor& indices);

}  // namespace distance
}  // namespace fused
