// Schemas of the fused distance family. Public ops first, then the backward ops autograd calls. Ops with a CUDA C++
// kernel are defined with their CUDA twin (common/registration.h). lengths_a / lengths_b: a padded batch's valid
// row counts (int64, the batch shape of a / b); rows past them take no part. (Not keyword-only as in the Python
// API: torch.library.register_autograd takes no keyword-only tensors.)
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  // [*B, N, D] x [*B, M, D] -> [*B, N, M], batch dims broadcast; p in [0, inf]; squared only with p = 2. Padded
  // pairs give 0.
  def_with_cuda_twin(m,
                     "pairwise_distances(Tensor a, Tensor b, float p=2.0, bool squared=False,"
                     " Tensor? lengths_a=None, Tensor? lengths_b=None) -> Tensor");
  // The k nearest (or farthest) points of b for each row of a: values [*B, N, k] sorted, indices int64,
  // ties to the lower index; never builds the N x M matrix. Missing neighbours: index -1, value inf (-inf when
  // largest).
  def_with_cuda_twin(m,
                     "pairwise_topk(Tensor a, Tensor b, int k, float p=2.0, bool squared=False,"
                     " bool largest=False, Tensor? lengths_a=None, Tensor? lengths_b=None)"
                     " -> (Tensor values, Tensor indices)");
  // The nearest up to max_neighbors points of b within radius (distance <= radius) for each row of a, as
  // pairwise_topk gives them, padded with index -1 and value inf.
  def_with_cuda_twin(m,
                     "radius_neighbors(Tensor a, Tensor b, float radius, int max_neighbors,"
                     " Tensor? lengths_a=None, Tensor? lengths_b=None, float p=2.0)"
                     " -> (Tensor values, Tensor indices)");
  // Composite (registered from Python: pairwise_topk with k = 1 each way and the per-cloud reduction): the loss and
  // the nearest point of b for each row of a (indices_a [*B, N]) and of a for each row of b (indices_b [*B, M];
  // [*B, 0] when single_directional), -1 for padded rows and empty clouds.
  m.def(
      "chamfer_distance(Tensor a, Tensor b, Tensor? lengths_a=None, Tensor? lengths_b=None, float p=2.0,"
      " bool squared=True, str reduction=\"mean\", bool single_directional=False)"
      " -> (Tensor loss, Tensor indices_a, Tensor indices_b)");

  // dist: the forward output. Gradients come back in the shapes of a and b (summed over broadcast dims).
  def_with_cuda_twin(m,
                     "pairwise_distances_backward(Tensor grad, Tensor a, Tensor b, Tensor dist, float p,"
                     " bool squared, Tensor? lengths_a=None, Tensor? lengths_b=None)"
                     " -> (Tensor grad_a, Tensor grad_b)");
  // Through the selected pairs of pairwise_topk or radius_neighbors (index -1: none).
  def_with_cuda_twin(m,
                     "pairwise_topk_backward(Tensor grad, Tensor a, Tensor b, Tensor values, Tensor indices,"
                     " float p, bool squared) -> (Tensor grad_a, Tensor grad_b)");
}
