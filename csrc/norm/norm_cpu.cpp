// CPU kernels of the norm family: residual add + RMSNorm / LayerNorm, one row per step, rows in parallel.
// A row comes from memory once; every later pass over it (the statistics, then the outputs) reads it from L1/L2,
// in blocks of kBlock elements, 16-bit elements converted to float in registers. RMSNorm takes the
// mean square; LayerNorm the mean, then the mean squared deviation (two passes over the cached row: no
// cancellation, unlike E[h^2] - E[h]^2, and simpler than a vectorised Welford merge). Sums run in four vector
// accumulators per block, the block sums added in double. The weight / bias gradients are per-chunk column sums in
// fixed slots, chunks fixed by (rows, C) alone, added in a fixed order: the same bits for any number of threads.
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common/cpu_utils.h"
#include "norm/norm_args.h"

namespace fused {
namespace norm {
namespace {

// Sums over [0, len) of f(i, m, s0, s1), which sets s0 and s1 to two Vec<T>s of elements i .. i + m (m < V::size()
// only at the tail, whose lanes past m are dropped here), in four vector accumulators each: one pass for two sums.
template <typename T, typename F> std::pair<double, double> block_sums(int64_t len, const F& f) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  V a[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))}, b[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))};
  int64_t i = 0;
  for (; i + 4 * W <= len; i += 4 * W)
    for (int u = 0; u < 4; ++u) {
      V s0, s1;
      f(i + u * W, W, s0, s1);
      a[u] += s0;
      b[u] += s1;
    }
  for (; i < len; i += W) {
    const int64_t m = std::min<int64_t>(W, len - i);
    V s0, s1;
    f(i, m, s0, s1);
    a[0] += m == W ? s0 : V::set(V(T(0)), s0, m);
    b[0] += m == W ? s1 : V::set(V(T(0)), s1, m);
  }
  auto total = [](const V* acc) {
    return static_cast<double>(
        at::vec::vec_reduce_all<T>([](V x, V y) { return x + y; }, (acc[0] + acc[1]) + (acc[2] + acc[3])));
  };
  return {total(a), total(b)};
}

// The sum over [0, len) of f(i, m), one Vec<T> of elements i .. i + m, as block_sums adds it.
template <typename T, typename F> double block_sum(int64_t len, const F& f) {
  return block_sums<T>(len,
                       [&](int64_t i, int64_t m, Vec<T>& s0, Vec<T>& s1) {
                         s0 = f(i, m);
                         s1 = Vec<T>(T(0));
                       })
      .first;
}

// The weight and bias as the math type (any floating dtype), or empty.
template <typename T> at::Tensor param_in_math(const std::optional<at::Tensor>& p, const at::Tensor& like) {
  if (!p) return at::Tensor();
  return p->to(like.options().dtype(c10::CppTypeToScalarType<T>::value)).contiguous();
}
template <typename T> T* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

// Dispatch over the x dtype S and the residual-stream dtype R (S, or float for 16-bit S).
template <typename F> void dispatch_norm(at::ScalarType x, at::ScalarType r, const F& f) {
  FUSED_DISPATCH_FLOATING(x, "norm", [&] {
    if constexpr (!std::is_same_v<scalar_t, float> && !std::is_same_v<scalar_t, double>) {
      if (r == at::kFloat) return f(scalar_t(), float());
    }
    return f(scalar_t(), scalar_t());
  });
}

// ---- forward ----

// out = norm(h) * w (+ b) for one row h (storage type U) of C elements; returns (mean, rstd). The row is read
// once per pass, from cache after the first.
template <typename T, typename U, typename S>
std::pair<T, T> norm_row(const U* h, S* out, const T* w, const T* b, int64_t C, double eps, bool rms) {
  using V = Vec<T>;
  // the row's blocks of kBlock elements (the block sums' grouping), 16-bit elements converted in registers
  auto for_row = [&](const auto& f) {
    for (int64_t c = 0; c < C; c += kBlock) f(c, std::min(kBlock, C - c));
  };
  T mean = T(0);
  double ms = 0;
  if (rms) {
    for_row([&](int64_t c, int64_t len) {
      ms += block_sum<T>(len, [&](int64_t i, int64_t m) {
        const V v = load_math<T>(h + c + i, m);
        return v * v;
      });
    });
  } else {
    double sum = 0;
    for_row([&](int64_t c, int64_t len) {
      sum += block_sum<T>(len, [&](int64_t i, int64_t m) { return load_math<T>(h + c + i, m); });
    });
    mean = static_cast<T>(sum / C);
    const V mv(mean);
    for_row([&](int64_t c, int64_t len) {
      ms += block_sum<T>(len, [&](int64_t i, int64_t m) {
        const V d = load_math<T>(h + c + i, m) - mv;
        return d * d;
      });
    });
  }
  const T rstd = static_cast<T>(1.0 / std::sqrt(ms / C + eps));
  const V mv(mean), rv(rstd);
  auto normed = [&](int64_t j, int64_t m) C10_ALWAYS_INLINE_ATTRIBUTE {  // elements j .. j + m, in the math type
    V v = (load_math<T>(h + j, m) - mv) * rv;  // mean is 0 for RMSNorm: h - 0 is h, bit for bit
    if (w) v = v * V::loadu(w + j, m);
    if (b) v = v + V::loadu(b + j, m);
    return v;
  };
  int64_t done = 0;
  if constexpr (!std::is_same_v<S, T>) {  // 16-bit output: two float vectors rounded into one, in registers
    constexpr int64_t W = V::size();
    for (; done + 2 * W <= C; done += 2 * W)
      at::vec::convert_from_float<S>(normed(done, W), normed(done + W, W)).store(out + done);
  }
  for (int64_t c = done; c < C; c += kBlock) {
    const int64_t len = std::min(kBlock, C - c);
    T local[kBlock];
    T* y = work_buffer(out + c, local);
    int64_t i = 0;
    for (; i + V::size() <= len; i += V::size()) normed(c + i, V::size()).store(y + i);
    if (i < len) normed(c + i, len - i).store(y + i, len - i);
    store_block(y, out + c, len);
  }
  return {mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cpu(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps, bool rms) {
  const char* op = op_name(rms, residual_in.has_value());
  const RowsShape s = check_fwd(op, x_in, residual_in, normalized_shape, weight, bias);
  Forward f = prepare_fwd(x_in, residual_in, s, rms);
  if (s.rows == 0 || s.C == 0) return {f.out, f.sum, f.mean, f.rstd};
  const int64_t C = s.C;
  const at::Tensor &x = f.x, &residual = f.residual;
  dispatch_norm(
      x.scalar_type(), residual.defined() ? residual.scalar_type() : x.scalar_type(), [&](auto s_tag, auto r_tag) {
        using S = decltype(s_tag);
        using R = decltype(r_tag);
        using T = at::opmath_type<S>;
        const at::Tensor w_t = param_in_math<T>(weight, x), b_t = param_in_math<T>(bias, x);
        const T *w = ptr_or_null<T>(w_t), *b = ptr_or_null<T>(b_t);
        const S* xp = x.data_ptr<S>();
        const R* rp = residual.defined() ? residual.data_ptr<R>() : nullptr;
        R* sp = residual.defined() ? f.sum.data_ptr<R>() : nullptr;
        S* outp = f.out.data_ptr<S>();
        T* mp = rms ? nullptr : f.mean.data_ptr<T>();
        T* rs = f.rstd.data_ptr<T>();
        at::parallel_for(0, s.rows, std::max<int64_t>(1, 16 * kBlock / C), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            std::pair<T, T> stats;
            if (rp) {  // h = x + residual, rounded to the residual stream's dtype; the norm reads what is returned
              R* h_row = sp + r * C;
              using V = Vec<T>;
              const S* x_row = xp + r * C;
              const R* r_row = rp + r * C;
              for (int64_t c = 0; c < C; c += kBlock) {
                const int64_t len = std::min(kBlock, C - c);
                T local[kBlock];
                T* hb = work_buffer(h_row + c, local);
                auto add = [&](int64_t i, int64_t m) C10_ALWAYS_INLINE_ATTRIBUTE {
                  (load_math<T>(x_row + c + i, m) + load_math<T>(r_row + c + i, m)).store(hb + i, m);
                };
                int64_t i = 0;
                for (; i + V::size() <= len; i += V::size()) add(i, V::size());
                if (i < len) add(i, len - i);
                store_block(hb, h_row + c, len);
              }
              stats = norm_row(static_cast<const R*>(h_row), outp + r * C, w, b, C, eps, rms);
            } else {
              stats = norm_row(xp + r * C, outp + r * C, w, b, C, eps, rms);
            }
            if (mp) mp[r] = stats.first;
            rs[r] = stats.second;
          }
        });
      });
  return {f.out, f.sum, f.mean, f.rstd};
}

// ---- backward ----

// Rows per chunk of the weight / bias gradient sums: at most kMaxChunks chunks and at least about 8K elements
// each, from (rows, C) alone so that the sums do not depend on the thread count.
constexpr int64_t kMaxChunks = 128;
int64_t rows_per_chunk(int64_t rows, int64_t C) {
  return std::max<int64_t>((rows + kMaxChunks - 1) / kMaxChunks, (8 * kBlock + C - 1) / std::max<int64_t>(C, 1));
}

// One row of the backward: dh = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) (+ grad_sum), xhat = (h - mean) *
// rstd, gw = grad * weight (RMSNorm: mean 0, no mean(gw) term), and the row's terms of the weight and bias gradients
// added into acc_w / acc_b (either may be null). The pointers are arguments, so the compiler keeps them in registers
// across the stores, and every loop runs whole vectors with one tail.
template <typename T, bool kWeight, typename S, typename R>
void grad_row(const S* g_row, const R* h_row, const R* gs_row, R* dh_row, const T* w, T mean, T rstd, bool rms,
              T* acc_w, T* acc_b, int64_t C) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  const V mv(mean), rv(rstd);
  double sum_gw_xhat = 0, sum_gw = 0;
  for (int64_t j = 0; j < C; j += kBlock) {  // block sums over kBlock elements, as the forward's
    const int64_t len = std::min(kBlock, C - j);
    auto gw_xhat = [&](int64_t i, int64_t m, V& s0, V& s1) C10_ALWAYS_INLINE_ATTRIBUTE {
      const V gv = load_math<T>(g_row + j + i, m);
      // rounded, as below: mean(gw) and gw then cancel exactly
      if constexpr (kWeight) s1 = rounded(gv * V::loadu(w + j + i, m));
      else s1 = gv;
      s0 = s1 * ((load_math<T>(h_row + j + i, m) - mv) * rv);
    };
    if (rms) {
      sum_gw_xhat += block_sum<T>(len, [&](int64_t i, int64_t m) C10_ALWAYS_INLINE_ATTRIBUTE {
        V s0, s1;
        gw_xhat(i, m, s0, s1);
        return s0;
      });
    } else {  // both sums in one pass
      const auto sums = block_sums<T>(len, gw_xhat);
      sum_gw_xhat += sums.first;
      sum_gw += sums.second;
    }
  }
  const V a(static_cast<T>(sum_gw_xhat / C)), b(static_cast<T>(sum_gw / C));
  for (int64_t j = 0; j < C; j += kBlock) {
    const int64_t len = std::min(kBlock, C - j);
    T out_local[kBlock];
    T* dh = work_buffer(dh_row + j, out_local);
    auto body = [&](int64_t i, int64_t m) C10_ALWAYS_INLINE_ATTRIBUTE {
      const V gv = load_math<T>(g_row + j + i, m), xh = (load_math<T>(h_row + j + i, m) - mv) * rv;
      V gw = gv;
      if constexpr (kWeight) gw = rounded(gv * V::loadu(w + j + i, m));
      V d = rv * ((gw - b) - xh * a);
      if (gs_row) d = d + load_math<T>(gs_row + j + i, m);
      d.store(dh + i, m);
      if (acc_w) (V::loadu(acc_w + j + i, m) + gv * xh).store(acc_w + j + i, m);
      if (acc_b) (V::loadu(acc_b + j + i, m) + gv).store(acc_b + j + i, m);
    };
    int64_t i = 0;
    for (; i + W <= len; i += W) body(i, W);
    if (i < len) body(i, len - i);
    store_block(dh, dh_row + j, len);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cpu(
    const at::Tensor& grad_in, const std::optional<at::Tensor>& grad_sum_in, const at::Tensor& h_in,
    const at::Tensor& mean_in, const at::Tensor& rstd_in, const std::optional<at::Tensor>& weight,
    at::IntArrayRef normalized_shape, bool rms, bool weight_grad, bool bias_grad) {
  const char* op = "norm_backward";
  const RowsShape s = check_backward(op, grad_in, grad_sum_in, h_in, mean_in, rstd_in, weight, normalized_shape, rms);
  Backward bw =
      prepare_backward(grad_in, grad_sum_in, h_in, mean_in, rstd_in, normalized_shape, weight_grad, bias_grad);
  if (s.rows == 0 || s.C == 0) return {bw.grad_h, bw.grad_w, bw.grad_b};
  const int64_t C = s.C, rows = s.rows;
  const int64_t per_chunk = rows_per_chunk(rows, C), chunks = (rows + per_chunk - 1) / per_chunk;
  at::Tensor partial_w = weight_grad ? at::empty({chunks, C}, bw.grad_w.options()) : at::Tensor();
  at::Tensor partial_b = bias_grad ? at::empty({chunks, C}, bw.grad_b.options()) : at::Tensor();
  dispatch_norm(bw.grad.scalar_type(), bw.h.scalar_type(), [&](auto s_tag, auto r_tag) {
    using S = decltype(s_tag);
    using R = decltype(r_tag);
    using T = at::opmath_type<S>;
    const at::Tensor w_t = param_in_math<T>(weight, bw.h);
    const T* w = ptr_or_null<T>(w_t);
    const S* gp = bw.grad.data_ptr<S>();
    const R* hp = bw.h.data_ptr<R>();
    const R* gsp = ptr_or_null<R>(bw.grad_sum);
    R* dhp = bw.grad_h.data_ptr<R>();
    const T* mp = rms ? nullptr : bw.mean.data_ptr<T>();
    const T* rs = bw.rstd.data_ptr<T>();
    T* pw = ptr_or_null<T>(partial_w);
    T* pb = ptr_or_null<T>(partial_b);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      PairwiseColumnSum<T> sum_w(pw ? C : 0), sum_b(pb ? C : 0);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t r0 = c * per_chunk, r1 = std::min(rows, (c + 1) * per_chunk);
        for (int64_t r = r0; r < r1; ++r) {
          T* acc_w = pw ? sum_w.group() : nullptr;
          T* acc_b = pb ? sum_b.group() : nullptr;
          const auto row = [&](auto has_weight) {
            grad_row<T, decltype(has_weight)::value>(gp + r * C, hp + r * C, gsp ? gsp + r * C : nullptr, dhp + r * C,
                                                     w, mp ? mp[r] : T(0), rs[r], rms, acc_w, acc_b, C);
          };
          if (w) row(std::true_type{});
          else row(std::false_type{});
          if ((r - r0 + 1) % kRowsPerGroup == 0 || r + 1 == r1) {  // a group of the pairwise sums ends
            if (pw) sum_w.push();
            if (pb) sum_b.push();
          }
        }
        if (pw) sum_w.total(pw + c * C);
        if (pb) sum_b.total(pb + c * C);
      }
    });
    if (pw) sum_chunks(pw, chunks, C, bw.grad_w.data_ptr<T>());
    if (pb) sum_chunks(pb, chunks, C, bw.grad_b.data_ptr<T>());
  });
  return {bw.grad_h, bw.grad_w, bw.grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) { FUSED_NORM_OPS(FUSED_IMPL_CPU) }

}  // namespace norm
}  // namespace fused
