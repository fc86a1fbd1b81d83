// Schemas of the norm family: residual add + RMSNorm / LayerNorm. The public ops are composites (registered from
// Python, fused/norm/ops.py) over norm_fwd, which also returns what autograd saves, and norm_backward; those two
// have CUDA twins (csrc/common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  m.def("rms_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");
  m.def(
      "layer_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
      "float eps=1e-05) -> Tensor");
  // -> (norm(x + residual), x + residual); the sum in residual_dtype (default: residual's dtype), the norm in x's.
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None, "
      "*, ScalarType? residual_dtype=None) -> (Tensor, Tensor)");
  m.def(
      "add_layer_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-05, *, ScalarType? residual_dtype=None) -> (Tensor, Tensor)");

  // h = x (+ residual, rounded to residual's dtype); out = norm(h) * weight (+ bias) in x's dtype. sum: h when
  // residual is given, else empty. mean (LayerNorm; else empty) and rstd per row, in float32 (float64 for float64).
  // residual has x's dtype, or float32 for 16-bit x.
  fused::def_with_cuda_twin(m,
                            "norm_fwd(Tensor x, Tensor? residual, SymInt[] normalized_shape, Tensor? weight, "
                            "Tensor? bias, float eps, bool rms) -> (Tensor out, Tensor sum, Tensor mean, "
                            "Tensor rstd)");
  // grad_h = d out / d h applied to grad (x's dtype), plus grad_sum (h's dtype) when given, in h's dtype.
  // grad_weight / grad_bias (the sums over rows of grad * xhat / grad, deterministic) in float32 (float64 for
  // float64), of shape normalized_shape when asked for, else empty.
  fused::def_with_cuda_twin(m,
                            "norm_backward(Tensor grad, Tensor? grad_sum, Tensor h, Tensor mean, Tensor rstd, "
                            "Tensor? weight, SymInt[] normalized_shape, bool rms, bool weight_grad, "
                            "bool bias_grad) -> (Tensor grad_h, Tensor grad_weight, Tensor grad_bias)");
}
