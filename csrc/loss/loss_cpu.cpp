// CPU kernel of the loss family: fused::cross_entropy_rows, the softmax + loss + gradient pass over rows of
// logits (the formulas are in loss_math.h). Rows run in parallel, each row in one thread from start to end, so
// the result does not depend on the thread count. A row is read from memory once, into a math-type buffer
// (converted and softcapped there); its max, its sums and its gradient are then passes over that buffer, which
// stays in cache. Sums run in vectors over blocks of kBlock elements and add the block totals in double, so
// their error does not grow with the vocabulary.
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/cpu_utils.h"
#include "loss/loss_args.h"
#include "loss/loss_math.h"
#include "loss/row_cpu.h"

namespace fused {
namespace {

// sum_c exp(z_c - m), and sum_c w_c (z_c - m) when `smooth` (w null: all ones).
template <typename M>
void row_sums(const M* z, const M* w, int64_t n, M m, bool smooth, double& sum_exp, double& sum_smooth) {
  const Vec<M> vm(m);
  sum_exp = sum_smooth = 0.0;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    sum_exp += at::vec::map_reduce_all<M>([&](Vec<M> v) { return (v - vm).exp(); }, loss::vadd<M>, z + i, len);
    if (!smooth) continue;
    if (w) {
      sum_smooth += at::vec::map2_reduce_all<M>([&](Vec<M> v, Vec<M> wv) { return wv * (v - vm); }, loss::vadd<M>,
                                                z + i, w + i, len);
    } else {
      sum_smooth += at::vec::map_reduce_all<M>([&](Vec<M> v) { return v - vm; }, loss::vadd<M>, z + i, len);
    }
  }
}

template <typename scalar_t>
void cross_entropy_rows_kernel(const scalar_t* logits, int64_t ld, loss::RowGrad<scalar_t> grad, const int64_t* target,
                               const at::opmath_type<scalar_t>* weight, const at::opmath_type<scalar_t>* scale,
                               int64_t scale_ld, int64_t rows, int64_t V, int64_t ignore_index,
                               const loss::Params<at::opmath_type<scalar_t>>& p, at::opmath_type<scalar_t>* loss_out,
                               at::opmath_type<scalar_t>* lse_out) {
  using M = at::opmath_type<scalar_t>;
  const bool smooth = p.label_smoothing != M(0);
  const Vec<M> cap(p.softcap);
  loss::for_each_row<M>(rows, V, V, int64_t(1) << 15, [&](int64_t r, M* z, M* local) {
    const int64_t t = target[r];
    scalar_t* grow = grad.row(r);
    if (loss::ignored_row(t == ignore_index, grow, V, loss_out[r], lse_out[r])) return;
    const scalar_t* xrow = logits + r * ld;
    for (int64_t i = 0; i < V; i += kBlock) {
      const int64_t len = std::min(kBlock, V - i);
      load_block(xrow + i, z + i, len);
      if (p.softcap != M(0)) vec_map(z + i, len, [&](Vec<M> v) { return cap * (v / cap).tanh(); });
    }
    const M m = loss::row_max(z, V);
    double sum_exp, sum_smooth;
    row_sums(z, weight, V, m, smooth, sum_exp, sum_smooth);
    const M log_s = std::log(static_cast<M>(sum_exp)), lse = m + log_s, zt = z[t] - m;
    const M w_t = weight ? weight[t] : M(1);
    loss_out[r] = loss::row_loss(log_s, zt, w_t, static_cast<M>(sum_smooth), p);
    lse_out[r] = lse;
    if (!grow) return;
    const auto g = loss::grad_coefs(lse, w_t, scale[r * scale_ld], scale[r * scale_ld + 1], p);
    const Vec<M> vm(m), vlog_s(log_s), coef_p(g.coef_p), coef_w(g.coef_w);
    for (int64_t i = 0; i < V; i += kBlock) {
      const int64_t len = std::min(kBlock, V - i);
      M* out = work_buffer(grow + i, local);
      auto grad_of = [&](Vec<M> v, Vec<M> wv) {
        Vec<M> d = coef_p * ((v - vm) - vlog_s).exp() - coef_w * wv;
        if (p.softcap != M(0)) {
          const Vec<M> u = v / cap;
          d = d * (Vec<M>(1) - u * u);
        }
        return d;
      };
      if (weight) vec_map2_to(out, z + i, weight + i, len, grad_of);
      else vec_map_to(out, z + i, len, [&](Vec<M> v) { return grad_of(v, Vec<M>(1)); });
      store_block(out, grow + i, len);
    }
    // The target's entry, computed on its own (loss_math.h): never from a rounded p_t.
    const M log_pt = zt - log_s;
    M gt = loss::target_grad(g, std::exp(log_pt), std::expm1(log_pt), w_t);
    if (p.softcap != M(0)) {
      const M u = z[t] / p.softcap;
      gt *= M(1) - u * u;
    }
    grow[t] = static_cast<scalar_t>(gt);
  });
}

void cross_entropy_rows_cpu(const char* op, const CrossEntropyRows& in, const at::Tensor& grad, int64_t ignore_index,
                            double label_smoothing, double z_loss, double softcap) {
  const at::Tensor &logits = in.logits, &scale = in.scale;
  const std::optional<at::Tensor>& weight = in.weight;
  const int64_t rows = logits.size(0), V = logits.size(1);
  check_target_range(op, in.target, V, ignore_index);
  if (rows == 0) return;
  FUSED_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy_rows", [&] {
    using M = at::opmath_type<scalar_t>;
    const M* w = weight ? weight->data_ptr<M>() : nullptr;
    M weight_sum = static_cast<M>(V);
    if (w) {
      double total = 0.0;  // fixed order
      for (int64_t c = 0; c < V; ++c) total += w[c];
      weight_sum = static_cast<M>(total);
    }
    const loss::Params<M> p{static_cast<M>(label_smoothing), static_cast<M>(label_smoothing / std::max<int64_t>(V, 1)),
                            weight_sum, static_cast<M>(z_loss), static_cast<M>(softcap)};
    cross_entropy_rows_kernel<scalar_t>(logits.data_ptr<scalar_t>(), logits.stride(0), loss::row_grad<scalar_t>(grad),
                                        in.target.data_ptr<int64_t>(), w, scale.data_ptr<M>(), scale.dim() == 2 ? 2 : 0,
                                        rows, V, ignore_index, p, in.loss.data_ptr<M>(), in.lse.data_ptr<M>());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) { m.impl("cross_entropy_rows", &cross_entropy_rows_op<cross_entropy_rows_cpu>); }

}  // namespace fused
