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
// Whether that search runs its filter's GEMM in bfloat16 for `rows` rows of a per batch (the answer is the same
// either way; python -m fused.info reports it).
constexpr int64_t kBf16MinRows = 128;
bool knn_bf16_gemm(int64_t rows);

void knn_gemm_cpu(const Batched& x, const Lengths& la, const Lengths& lb, bool squared, bool largest,
                  const c10::optional<double>& radius, at::Tensor& values, at::Tensor& indices);

}  // namespace distance
}  // namespace fused
