// Schemas of the fused elementwise family. Public ops first, then the backward ops autograd calls. Ops with a CUDA
// C++ kernel are defined with their CUDA twin (common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  def_with_cuda_twin(m, "bias_act(Tensor x, Tensor? bias=None, str act=\"gelu\") -> Tensor");
  def_with_cuda_twin(m, "glu(Tensor gate, Tensor up, str act=\"silu\") -> Tensor");
  // seed: a CPU int64 scalar tensor; dropout draws the mask from it (see csrc/common/philox.h).
  def_with_cuda_twin(m,
                     "bias_dropout_add_seeded(Tensor x, Tensor? bias, Tensor residual, float p, Tensor seed)"
                     " -> Tensor");
  def_with_cuda_twin(m, "unary_chain(Tensor x, str[] ops) -> Tensor");
  // Composite (registered from Python): draws a seed from torch's CPU generator, calls the seeded op.
  m.def("bias_dropout_add(Tensor x, Tensor? bias, Tensor residual, float p=0.1, bool training=True) -> Tensor");

  // grad_bias is an empty tensor when bias is None.
  def_with_cuda_twin(m,
                     "bias_act_backward(Tensor grad, Tensor x, Tensor? bias, str act)"
                     " -> (Tensor grad_x, Tensor grad_bias)");
  def_with_cuda_twin(m,
                     "glu_backward(Tensor grad, Tensor gate, Tensor up, str act)"
                     " -> (Tensor grad_gate, Tensor grad_up)");
  def_with_cuda_twin(m,
                     "dropout_backward(Tensor grad, float p, Tensor seed, bool bias_grad)"
                     " -> (Tensor grad_x, Tensor grad_bias)");
  def_with_cuda_twin(m, "unary_chain_backward(Tensor grad, Tensor x, str[] ops) -> Tensor");
}
