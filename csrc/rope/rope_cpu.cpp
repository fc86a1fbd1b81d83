// CPU kernel of the rope family: the rotation of q and k (and its transpose, the backward) in one parallel loop over
// (batch, position). Each step converts the position's cos / sin row to the math type once (float, double for
// double) and rotates every head of q and of k with it; rows are read and written where they lie, by strides.
// Non-interleaved rows rotate their two halves of the first r features as vectors; interleaved rows rotate the
// pairs (x[2i], x[2i+1]); features past r are copied.
#include <torch/library.h>

#include <vector>

#include "common/cpu_convert.h"
#include "common/cpu_utils.h"
#include "rope/rope_args.h"

namespace fused {
namespace rope {
namespace {

// The rotation of one row is out[:r] = x[:r] * c + partner(x)[:r] * s with tables c, s of r entries (the first r/2
// used when interleaved). The forward takes cos and sin as they are; the backward, the transpose, takes
// s' = -swap_halves(sin) (rotate_half's transpose; -sin when interleaved).
template <typename T, typename S>
void fill_tables(const S* cos, const S* sin, int64_t r, bool interleaved, bool backward, T* c, T* s) {
  widen_block(cos, c, r);
  widen_block(sin, s, r);
  if (!backward) return;
  const int64_t half = r / 2;
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) s[i] = -s[i];
  } else {
    for (int64_t i = 0; i < half; ++i) std::swap(s[i], s[half + i]);
    for (int64_t i = 0; i < r; ++i) s[i] = -s[i];
  }
}

// out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 over the halves x1 = x[:r/2], x2 = x[r/2:r] of one row.
template <typename T, typename S> void rotate_halves(const S* x, S* out, const T* c, const T* s, int64_t r) {
  using V = Vec<T>;
  const int64_t half = r / 2;
  constexpr int64_t L = kBlock / 2;
  for (int64_t i0 = 0; i0 < half; i0 += L) {
    const int64_t len = std::min(L, half - i0);
    T b1[L], b2[L], w1[L], w2[L];
    const T *x1 = math_view(x + i0, b1, len), *x2 = math_view(x + half + i0, b2, len);
    T *o1 = work_buffer(out + i0, w1), *o2 = work_buffer(out + half + i0, w2);
    const T *c1 = c + i0, *c2 = c + half + i0, *s1 = s + i0, *s2 = s + half + i0;
    for (int64_t i = 0; i < len; i += V::size()) {
      const int64_t m = std::min<int64_t>(V::size(), len - i);
      const V a = V::loadu(x1 + i, m), b = V::loadu(x2 + i, m);
      (a * V::loadu(c1 + i, m) - b * V::loadu(s1 + i, m)).store(o1 + i, m);
      (b * V::loadu(c2 + i, m) + a * V::loadu(s2 + i, m)).store(o2 + i, m);
    }
    store_block(o1, out + i0, len);
    store_block(o2, out + half + i0, len);
  }
}

// out[2i] = x[2i] c_i - x[2i+1] s_i, out[2i+1] = x[2i+1] c_i + x[2i] s_i for i < r/2.
template <typename T, typename S> void rotate_pairs(const S* x, S* out, const T* c, const T* s, int64_t r) {
  for (int64_t j0 = 0; j0 < r; j0 += kBlock) {
    const int64_t len = std::min(kBlock, r - j0);
    T b[kBlock], w[kBlock];
    const T* xb = math_view(x + j0, b, len);
    T* o = work_buffer(out + j0, w);
    const T *cb = c + j0 / 2, *sb = s + j0 / 2;
    for (int64_t i = 0; i < len / 2; ++i) {
      const T a = xb[2 * i], e = xb[2 * i + 1];
      o[2 * i] = a * cb[i] - e * sb[i];
      o[2 * i + 1] = e * cb[i] + a * sb[i];
    }
    store_block(o, out + j0, len);
  }
}

// Every head of x ([b, h, s, d] by strides) at position (bi, si) into out (the same view of the output).
template <typename T, typename S>
void rotate_heads(const at::Tensor& x, const at::Tensor& out, int64_t bi, int64_t si, const T* c, const T* s, int64_t r,
                  bool interleaved) {
  const S* xp = x.data_ptr<S>() + bi * x.stride(0) + si * x.stride(2);
  S* op = out.data_ptr<S>() + bi * out.stride(0) + si * out.stride(2);
  const int64_t d = x.size(3);
  for (int64_t h = 0; h < x.size(1); ++h) {
    const S* row = xp + h * x.stride(1);
    S* out_row = op + h * out.stride(1);
    if (interleaved) rotate_pairs(row, out_row, c, s, r);
    else rotate_halves(row, out_row, c, s, r);
    std::copy(row + r, row + d, out_row + r);
  }
}

std::tuple<at::Tensor, at::Tensor> rope_apply(const char* op, const char* first, const char* second,
                                              const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                              const at::Tensor& sin_in, int64_t unsqueeze_dim, bool interleaved,
                                              bool backward) {
  const Shape sh = check_rope(op, first, second, q_in, k_in, cos_in, sin_in, unsqueeze_dim);
  const int64_t layout = layout_of(op, unsqueeze_dim);
  Outputs o = alloc_outputs(q_in, k_in);
  if (sh.b * sh.s == 0 || sh.d == 0) return {o.q, o.k};
  const at::Tensor q = heads_view(unit_last_stride(q_in), layout), k = heads_view(unit_last_stride(k_in), layout);
  const at::Tensor oq = heads_view(o.q, layout), ok = heads_view(o.k, layout);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t per_position = std::max<int64_t>(1, (sh.hq + sh.hk) * sh.d);
  FUSED_DISPATCH_FLOATING(q.scalar_type(), "rope", [&] {
    using S = scalar_t;
    using T = at::opmath_type<S>;
    const S *cp = cos.data_ptr<S>(), *sp = sin.data_ptr<S>();
    at::parallel_for(0, sh.b * sh.s, std::max<int64_t>(1, 16 * kBlock / per_position), [&](int64_t p0, int64_t p1) {
      std::vector<T> c(sh.r), s(sh.r);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t bi = p / sh.s, si = p % sh.s;
        const int64_t table = ((sh.cos_b == 1 ? 0 : bi) * sh.s + si) * sh.r;
        fill_tables(cp + table, sp + table, sh.r, interleaved, backward, c.data(), s.data());
        rotate_heads<T, S>(q, oq, bi, si, c.data(), s.data(), sh.r, interleaved);
        rotate_heads<T, S>(k, ok, bi, si, c.data(), s.data(), sh.r, interleaved);
      }
    });
  });
  return {o.q, o.k};
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  return rope_apply("rope", "q", "k", q, k, cos, sin, unsqueeze_dim, interleaved, false);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_cpu(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                     const at::Tensor& cos, const at::Tensor& sin,
                                                     int64_t unsqueeze_dim, bool interleaved) {
  return rope_apply("rope_backward", "grad_q", "grad_k", grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) { FUSED_ROPE_OPS(FUSED_IMPL_CPU) }

}  // namespace rope
}  // namespace fused
