// Argument checks of the rope family, shared by the CPU kernel and the CUDA binding, and the [b, h, s, d] view of
// q and k that both walk by strides. Messages name the public op and the argument.
#pragma once
#include <ATen/ATen.h>

#include "common/checks.h"
#include "common/huge_pages.h"
#include "common/registration.h"

// The family's ops, each registered from <family>_cpu.cpp and <family>_cuda.cpp (common/registration.h).
#define FUSED_ROPE_OPS(X) X("rope", rope) X("rope_backward", rope_backward)

namespace fused {
namespace rope {

// unsqueeze_dim as transformers passes it (1: [b, h, s, d]; 2: [b, s, h, d]); -3 and -2 name the same dims.
inline int64_t layout_of(const char* op, int64_t unsqueeze_dim) {
  if (unsqueeze_dim == -3) return 1;
  if (unsqueeze_dim == -2) return 2;
  TORCH_CHECK(unsqueeze_dim == 1 || unsqueeze_dim == 2, "fused.", op,
              ": unsqueeze_dim must be 1 ([batch, heads, seq, head_dim]) or 2 ([batch, seq, heads, head_dim]), got ",
              unsqueeze_dim);
  return unsqueeze_dim;
}

// x seen as [b, h, s, d] (a view: no copy).
inline at::Tensor heads_view(const at::Tensor& x, int64_t layout) { return layout == 2 ? x.transpose(1, 2) : x; }

// The shapes of one call: batch, seq, head_dim, heads of q and k, rotary width r, cos / sin batch.
struct Shape {
  int64_t b, s, d, hq, hk, r, cos_b;
};

// first / second: the names of q and k (grad_q and grad_k in the backward).
inline Shape check_rope(const char* op, const char* first, const char* second, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  const int64_t layout = layout_of(op, unsqueeze_dim);
  check_floating(op, first, q);
  check_like(op, second, k, first, q);
  check_like(op, "cos", cos, first, q);
  check_like(op, "sin", sin, first, q);
  const char* dims = layout == 1 ? "[batch, heads, seq, head_dim]" : "[batch, seq, heads, head_dim]";
  TORCH_CHECK(q.dim() == 4, "fused.", op, ": ", first, " must be 4-D ", dims, " for unsqueeze_dim=", unsqueeze_dim,
              ", got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "fused.", op, ": ", second, " must be 4-D ", dims, " for unsqueeze_dim=", unsqueeze_dim,
              ", got shape ", k.sizes());
  const at::Tensor qv = heads_view(q, layout), kv = heads_view(k, layout);
  TORCH_CHECK(kv.size(0) == qv.size(0) && kv.size(2) == qv.size(2) && kv.size(3) == qv.size(3), "fused.", op, ": ",
              second, " of shape ", k.sizes(), " does not match ", first, " of shape ", q.sizes(),
              " in batch, seq and head_dim");
  TORCH_CHECK(cos.dim() == 3, "fused.", op, ": cos must be 3-D [batch or 1, seq, r], got shape ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), "fused.", op, ": sin shape ", sin.sizes(), " does not match cos shape ",
              cos.sizes());
  const Shape sh{qv.size(0), qv.size(2), qv.size(3), qv.size(1), kv.size(1), cos.size(2), cos.size(0)};
  TORCH_CHECK((sh.cos_b == 1 || sh.cos_b == sh.b) && cos.size(1) == sh.s, "fused.", op, ": cos of shape ", cos.sizes(),
              " must be [", sh.b, " or 1, ", sh.s, ", r] for ", first, " of shape ", q.sizes());
  TORCH_CHECK(sh.r % 2 == 0 && sh.r <= sh.d, "fused.", op, ": cos's last dim r = ", sh.r,
              " must be even and at most head_dim ", sh.d);
  return sh;
}

// An output laid out as its input (empty_like keeps a dense permuted layout, e.g. a transposed projection) where
// that layout has unit stride along head_dim, contiguous where not: the kernels write each row with unit stride.
inline at::Tensor output_like(const at::Tensor& x) {
  at::Tensor out = empty_output_like(x);
  return out.size(-1) > 1 && out.stride(-1) != 1 ? empty_output(x.sizes(), x.options()) : out;
}
struct Outputs {
  at::Tensor q, k;
};
inline Outputs alloc_outputs(const at::Tensor& q, const at::Tensor& k) { return {output_like(q), output_like(k)}; }

// x with unit stride along head_dim (a copy only when it has not: the kernels read rows by strides otherwise).
inline at::Tensor unit_last_stride(const at::Tensor& x) {
  return x.size(-1) > 1 && x.stride(-1) != 1 ? x.contiguous() : x;
}

}  // namespace rope
}  // namespace fused
