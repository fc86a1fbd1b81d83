// CPU kernels of the log-prob and distillation row ops (the formulas are in logprob_math.h): fused::log_prob_rows
// and fused::distillation_rows. As in loss_cpu.cpp, rows run in parallel, each in one thread from start to end
// (results independent of the thread count); a row is read once into a math-type buffer (divided by the
// temperature there), and every later pass runs over that buffer; sums run in vectors over blocks of kBlock
// elements and add the block totals in double.
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common/cpu_utils.h"
#include "common/vec_math.h"
#include "loss/loss_args.h"
#include "loss/logprob_math.h"
#include "loss/row_cpu.h"

namespace fused {
namespace {

// sum_c exp(z_c - m) and sum_c exp(z_c - m) (z_c - m).
template <typename M> void softmax_sums(const M* z, int64_t n, M m, double& sum_exp, double& sum_ez) {
  const Vec<M> vm(m);
  sum_exp = sum_ez = 0.0;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    sum_exp += at::vec::map_reduce_all<M>([&](Vec<M> v) { return (v - vm).exp(); }, loss::vadd<M>, z + i, len);
    sum_ez += at::vec::map_reduce_all<M>(
        [&](Vec<M> v) {
          const Vec<M> d = v - vm;
          return p_weight_mul(d.exp(), d);
        },
        loss::vadd<M>, z + i, len);
  }
}

// z (x / temperature) into log_softmax(z), in place.
template <typename M> void to_log_probs(M* z, int64_t n) {
  const M m = loss::row_max(z, n);
  double sum_exp, sum_ez;
  softmax_sums(z, n, m, sum_exp, sum_ez);
  const Vec<M> vm(m), vlog_s(static_cast<M>(std::log(sum_exp)));
  vec_map(z, n, [&](Vec<M> v) { return (v - vm) - vlog_s; });
}

template <typename scalar_t>
void log_prob_rows_kernel(const scalar_t* logits, int64_t ld, loss::RowGrad<scalar_t> grad, const int64_t* target,
                          const at::opmath_type<scalar_t>* scale, int64_t rows, int64_t V, int64_t ignore_index,
                          at::opmath_type<scalar_t> temperature, at::opmath_type<scalar_t>* logp_out,
                          at::opmath_type<scalar_t>* entropy_out) {
  using M = at::opmath_type<scalar_t>;
  loss::for_each_row<M>(rows, V, V, int64_t(1) << 15, [&](int64_t r, M* z, M* local) {
    const int64_t t = target[r];
    scalar_t* grow = grad.row(r);
    if (loss::ignored_row(t == ignore_index, grow, V, logp_out[r], entropy_out[r])) return;
    loss::load_row(logits + r * ld, z, V, temperature);
    const M m = loss::row_max(z, V);
    double sum_exp, sum_ez;
    softmax_sums(z, V, m, sum_exp, sum_ez);
    const M log_s = static_cast<M>(std::log(sum_exp));
    const M entropy = static_cast<M>(std::log(sum_exp) - sum_ez / sum_exp), logp_t = (z[t] - m) - log_s;
    logp_out[r] = logp_t;
    entropy_out[r] = entropy;
    if (!grow) return;
    const M g_l = scale[2 * r] / temperature, g_h = scale[2 * r + 1] / temperature;
    const Vec<M> vm(m), vlog_s(log_s), vg_l(g_l), vg_h(g_h), vh(entropy);
    for (int64_t i = 0; i < V; i += kBlock) {
      const int64_t len = std::min(kBlock, V - i);
      M* out = work_buffer(grow + i, local);
      vec_map_to(out, z + i, len, [&](Vec<M> v) { return loss::log_prob_grad((v - vm) - vlog_s, vg_l, vg_h, vh); });
      store_block(out, grow + i, len);
    }
    grow[t] = static_cast<scalar_t>(
        loss::log_prob_target_grad(logp_t, std::exp(logp_t), std::expm1(logp_t), g_l, g_h, entropy));
  });
}

template <loss::Divergence D, typename scalar_t>
void distillation_rows_kernel(const scalar_t* student, const scalar_t* teacher, int64_t ld, int64_t ldt,
                              loss::RowGrad<scalar_t> grad, const int64_t* target,
                              const at::opmath_type<scalar_t>* scale, int64_t scale_step, int64_t rows, int64_t V,
                              int64_t ignore_index, at::opmath_type<scalar_t> temperature,
                              const loss::JsdParams<at::opmath_type<scalar_t>>& j,
                              at::opmath_type<scalar_t>* loss_out) {
  using M = at::opmath_type<scalar_t>;
  // JSD with beta 0 or 1 compares a distribution with itself: 0, and no gradient.
  const bool trivial = D == loss::Divergence::JSD && (j.beta == M(0) || j.one_minus_beta == M(0));
  const Vec<M> vb(j.beta), vomb(j.one_minus_beta), vlb(j.log_beta), vlomb(j.log_one_minus_beta);
  const loss::JsdParams<Vec<M>> vj{vb, vomb, vlb, vlomb};
  loss::for_each_row<M>(rows, V, 2 * V, int64_t(1) << 14, [&](int64_t r, M* ls, M* local) {
    M* lt = ls + V;
    scalar_t* grow = grad.row(r);
    if (loss::ignored_row(trivial || (target && target[r] == ignore_index), grow, V, loss_out[r])) return;
    loss::load_row(student + r * ld, ls, V, temperature);
    loss::load_row(teacher + r * ldt, lt, V, temperature);
    to_log_probs(ls, V);
    to_log_probs(lt, V);
    double sum_t = 0.0, sum_s = 0.0;
    for (int64_t i = 0; i < V; i += kBlock) {
      const int64_t len = std::min(kBlock, V - i);
      auto point = [&](Vec<M> s, Vec<M> t) { return loss::divergence_point<D>(s, t, vj); };
      sum_t += at::vec::map2_reduce_all<M>([&](Vec<M> s, Vec<M> t) { return p_weight_mul(t.exp(), t - point(s, t)); },
                                           loss::vadd<M>, ls + i, lt + i, len);
      sum_s += at::vec::map2_reduce_all<M>([&](Vec<M> s, Vec<M> t) { return p_weight_mul(s.exp(), s - point(s, t)); },
                                           loss::vadd<M>, ls + i, lt + i, len);
    }
    loss_out[r] = loss::divergence_loss<D>(static_cast<M>(sum_t), static_cast<M>(sum_s), j);
    if (!grow) return;
    const Vec<M> coef(scale[r * scale_step] / temperature), vsum_s(static_cast<M>(sum_s));
    for (int64_t i = 0; i < V; i += kBlock) {
      const int64_t len = std::min(kBlock, V - i);
      M* out = work_buffer(grow + i, local);
      vec_map2_to(out, ls + i, lt + i, len, [&](Vec<M> s, Vec<M> t) {
        return coef * loss::divergence_grad<D>(s, t, loss::divergence_point<D>(s, t, vj), vsum_s, vj);
      });
      store_block(out, grow + i, len);
    }
  });
}

void log_prob_rows_cpu(const char* op, const LogProbRows& in, const at::Tensor& grad, int64_t ignore_index,
                       double temperature) {
  const int64_t rows = in.logits.size(0), V = in.logits.size(1);
  check_target_range(op, in.target, V, ignore_index);
  if (rows == 0) return;
  FUSED_DISPATCH_FLOATING(in.logits.scalar_type(), "log_prob_rows", [&] {
    using M = at::opmath_type<scalar_t>;
    log_prob_rows_kernel<scalar_t>(in.logits.data_ptr<scalar_t>(), in.logits.stride(0), loss::row_grad<scalar_t>(grad),
                                   in.target.data_ptr<int64_t>(), in.scale.data_ptr<M>(), rows, V, ignore_index,
                                   static_cast<M>(temperature), in.logp.data_ptr<M>(), in.entropy.data_ptr<M>());
  });
}

void distillation_rows_cpu(const char* op, const DistillationRows& in, const at::Tensor& grad, double beta,
                           double temperature, int64_t ignore_index) {
  const at::Tensor &logits = in.logits, &teacher = in.teacher, &scale = in.scale;
  const int64_t rows = logits.size(0), V = logits.size(1);
  if (rows == 0) return;
  FUSED_DISPATCH_FLOATING(logits.scalar_type(), "distillation_rows", [&] {
    using M = at::opmath_type<scalar_t>;
    const loss::JsdParams<M> j{static_cast<M>(beta), static_cast<M>(1.0 - beta), static_cast<M>(std::log(beta)),
                               static_cast<M>(std::log1p(-beta))};
    auto run = [&](auto tag) {
      distillation_rows_kernel<decltype(tag)::value, scalar_t>(
          logits.data_ptr<scalar_t>(), teacher.data_ptr<scalar_t>(), logits.stride(0), teacher.stride(0),
          loss::row_grad<scalar_t>(grad), in.target ? in.target->data_ptr<int64_t>() : nullptr, scale.data_ptr<M>(),
          scale.dim() == 1 ? 1 : 0, rows, V, ignore_index, static_cast<M>(temperature), j, in.loss.data_ptr<M>());
    };
    using loss::Divergence;
    if (in.divergence == Divergence::ForwardKL) run(std::integral_constant<Divergence, Divergence::ForwardKL>());
    else if (in.divergence == Divergence::ReverseKL) run(std::integral_constant<Divergence, Divergence::ReverseKL>());
    else run(std::integral_constant<Divergence, Divergence::JSD>());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("log_prob_rows", &log_prob_rows_op<log_prob_rows_cpu>);
  m.impl("distillation_rows", &distillation_rows_op<distillation_rows_cpu>);
}

}  // namespace fused
