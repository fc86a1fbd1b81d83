// Schemas of the fused linear family. The public op linear_act is a composite (registered from Python, see
// fused/linear/ops.py) over linear_act_fwd, which can also return the pre-activation that autograd saves. Ops with
// a CUDA C++ kernel are defined with their CUDA twin (common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  m.def("linear_act(Tensor x, Tensor weight, Tensor? bias=None, str act=\"identity\") -> Tensor");

  // out = act(x @ weight.T + bias). pre = x @ weight.T + bias when save_pre and act's derivative needs it
  // (gelu, gelu_tanh, silu), else an empty tensor: relu, sigmoid and tanh take their derivative from out.
  def_with_cuda_twin(m,
                     "linear_act_fwd(Tensor x, Tensor weight, Tensor? bias, str act, bool save_pre)"
                     " -> (Tensor out, Tensor pre)");
  // grad_pre = grad * act'(saved) and, when bias_grad, grad_bias = grad_pre summed over every leading dim
  // (deterministic), in one pass. saved: the pre-activation for gelu, gelu_tanh, silu; the output otherwise.
  // grad_bias is an empty tensor when not bias_grad.
  def_with_cuda_twin(m,
                     "linear_act_grad_pre(Tensor grad, Tensor saved, str act, bool bias_grad)"
                     " -> (Tensor grad_pre, Tensor grad_bias)");
}
