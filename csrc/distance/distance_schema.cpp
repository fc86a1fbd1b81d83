// Schemas of the fused distance family. Public ops first, then the backward ops autograd calls. Ops with a CUDA C++
// kernel are defined with their CUDA twin (common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  // [*B, N, D] x [*B, M, D] -> [*B, N, M], batch dims broadcast; p in [0, inf]; squared only with p = 2.
  def_with_cuda_twin(m, "pairwise_distances(Tensor a, Tensor b, float p=2.0, bool squared=False) -> Tensor");
  // The k nearest (or farthest) points of b for each row of a: values [*B, N, k] sorted, indices int64,
  // ties to the lower index; never builds the N x M matrix.
  m.def("pairwise_topk(Tensor a, Tensor b, int k, float p=2.0, bool squared=False, bool largest=False)"
        " -> (Tensor values, Tensor indices)");

  // dist: the forward output. Gradients come back in the shapes of a and b (summed over broadcast dims).
  def_with_cuda_twin(m, "pairwise_distances_backward(Tensor grad, Tensor a, Tensor b, Tensor dist, float p,"
                        " bool squared) -> (Tensor grad_a, Tensor grad_b)");
  m.def("pairwise_topk_backward(Tensor grad, Tensor a, Tensor b, Tensor values, Tensor indices, float p,"
        " bool squared) -> (Tensor grad_a, Tensor grad_b)");
}
