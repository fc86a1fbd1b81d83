// Schemas of the fused elementwise family. Public ops first, then the backward ops autograd calls.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fused, m) {
  m.def("bias_act(Tensor x, Tensor? bias=None, str act=\"gelu\") -> Tensor");
  m.def("glu(Tensor gate, Tensor up, str act=\"silu\") -> Tensor");
  // seed: a CPU int64 scalar tensor; dropout draws the mask from it (see csrc/common/philox.h).
  m.def("bias_dropout_add_seeded(Tensor x, Tensor? bias, Tensor residual, float p, Tensor seed) -> Tensor");
  m.def("unary_chain(Tensor x, str[] ops) -> Tensor");
  // Composite (registered from Python): draws a seed from torch's CPU generator, calls the seeded op.
  m.def("bias_dropout_add(Tensor x, Tensor? bias, Tensor residual, float p=0.1, bool training=True) -> Tensor");

  // grad_bias is an empty tensor when bias is None.
  m.def("bias_act_backward(Tensor grad, Tensor x, Tensor? bias, str act) -> (Tensor grad_x, Tensor grad_bias)");
  m.def("glu_backward(Tensor grad, Tensor gate, Tensor up, str act) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("dropout_backward(Tensor grad, float p, Tensor seed, bool bias_grad) -> (Tensor grad_x, Tensor grad_bias)");
  m.def("unary_chain_backward(Tensor grad, Tensor x, str[] ops) -> Tensor");
}
