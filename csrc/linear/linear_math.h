// The activation derivative from what linear_act saves, for the CPU kernels (Vectorized) and CUDA (scalars):
// relu, sigmoid and tanh get it from their output, as eager autograd does; every other act from the saved
// pre-activation (act_needs_pre in linear_checks.h). Include after common/vec_math.h or common/scalar_math.h.
#pragma once
#include "common/op_codes.h"

namespace fused {

template <Act A, typename V> FUSED_HD V act_grad_from_saved(V s) {
  if constexpr (A == Act::relu) return p_where_pos(s, V(1));  // relu(x) > 0 iff x > 0
  else if constexpr (A == Act::sigmoid) return s * (V(1) - s);
  else if constexpr (A == Act::tanh) return V(1) - s * s;
  else return act_grad<A>(s);  // identity: 1; the others: s is the pre-activation
}

// g * act' from what linear_act saves; relu selects, as act_backward (common/pointwise_math.h).
template <Act A, typename V> FUSED_HD V act_backward_from_saved(V g, V s) {
  return times_act_grad<A>(g, s, act_grad_from_saved<A>(s));
}

}  // namespace fused
