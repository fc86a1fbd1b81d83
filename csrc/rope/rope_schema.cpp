// Schemas of the rope family: rotary position embedding of q and k in one launch (transformers'
// apply_rotary_pos_emb), and its backward, the rotation by -angle. Both have CUDA twins (csrc/common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  // q [b, hq, s, d] (unsqueeze_dim=1) or [b, s, hq, d] (2), k likewise with its own head count, cos / sin
  // [b or 1, s, r] in q's dtype; outputs laid out as q and k (empty_like).
  fused::def_with_cuda_twin(
      m,
      "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, *, bool interleaved=False) -> "
      "(Tensor, Tensor)");
  // The transpose of rope's rotation applied to grad_q and grad_k (the rotation by -angle for transformers' tables).
  fused::def_with_cuda_twin(m,
                            "rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int unsqueeze_dim, "
                            "bool interleaved) -> (Tensor, Tensor)");
}
