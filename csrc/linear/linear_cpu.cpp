// CPU kernels of the fused linear family: the GEMM through ATen (BLAS / oneDNN), then bias + activation in one
// in-place pass over the output while it is still in cache; the backward's activation derivative and bias
// reduction in one pass. Math in float (double for double) on L1-sized blocks with at::vec.
#include <torch/library.h>

#include "common/cpu_utils.h"
#include "linear/linear_checks.h"
#include "linear/linear_math.h"

namespace fused {
namespace {

// y[i] = act(y[i] + bias[i % N]) in place over the n elements of row-major y [*, N]; pre (if not null) gets
// y + bias.
template <Act A, typename T, typename scalar_t>
void bias_act_inplace(scalar_t* y, scalar_t* pre, const T* bias, int64_t N, int64_t n) {
  parallel_blocks(n, [&](int64_t i, int64_t len) {
    T buf[kBlock];
    load_block(y + i, buf, len);
    if (bias) {
      for_row_segments(len, N, i % N, [&](int64_t k, int64_t j, int64_t seg) {
        vec_map2(buf + k, bias + j, seg, [](auto a, auto b) { return a + b; });
      });
    }
    if (pre) store_block(buf, pre + i, len);
    if constexpr (A != Act::identity) vec_map(buf, len, [&](auto v) { return act_fwd<A>(v); });
    store_block(buf, y + i, len);
  });
}

std::tuple<at::Tensor, at::Tensor> linear_act_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias_in, c10::string_view act,
                                                      bool save_pre) {
  const Act a = parse_act("linear_act", act);
  check_linear("linear_act", x, weight, bias_in);
  const int64_t K = x.size(-1), N = weight.size(0);
  const at::Tensor x2 = x.reshape({c10::multiply_integers(x.sizes().slice(0, x.dim() - 1)), K});
  const at::Tensor wt = weight.t();
  const int64_t M = x2.size(0);
  at::Tensor y = empty_output({M, N}, x.options());
  const bool keep_pre = save_pre && act_needs_pre(a);
  at::Tensor pre = keep_pre ? empty_output({M, N}, x.options()) : at::empty({0}, x.options());
  // 16-bit outputs take the bias inside the GEMM (rounded once, as nn.Linear does); fp32 / fp64 add it in the
  // activation pass, which saves addmm's extra pass over the output.
  const bool round_once = x.element_size() < 4;
  FUSED_DISPATCH_FLOATING(x.scalar_type(), "linear_act", [&] {
    using T = at::opmath_type<scalar_t>;
    std::vector<T> bias;
    if (bias_in) {
      bias.resize(N);
      load_block(bias_in->contiguous().data_ptr<scalar_t>(), bias.data(), N);
    }
    // One GEMM call over all rows: BLAS packs the weight once per call, so splitting the rows costs more than
    // the activation pass gains from reading a cache-resident slice.
    if (bias_in && round_once) at::addmm_out(y, *bias_in, x2, wt);
    else at::mm_out(y, x2, wt);
    const bool add_bias = bias_in && !round_once;
    visit_act(a, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      if (!add_bias && !keep_pre && A == Act::identity) return;
      bias_act_inplace<A, T>(y.data_ptr<scalar_t>(), keep_pre ? pre.data_ptr<scalar_t>() : nullptr,
                             add_bias ? bias.data() : nullptr, N, M * N);
    });
  });
  const auto shape = linear_out_shape(x, weight);
  return {y.view(shape), keep_pre ? pre.view(shape) : pre};
}

std::tuple<at::Tensor, at::Tensor> linear_act_grad_pre_cpu(const at::Tensor& grad_in, const at::Tensor& saved_in,
                                                           c10::string_view act, bool bias_grad) {
  const Act a = parse_act("linear_act_grad_pre", act);
  check_grad_pre("linear_act_grad_pre", grad_in, saved_in);
  const at::Tensor grad = grad_in.contiguous(), saved = saved_in.contiguous();
  const int64_t N = grad.size(-1), n = grad.numel();
  at::Tensor grad_pre = empty_output_like(grad);
  at::Tensor grad_bias = at::zeros({bias_grad ? N : 0}, grad.options());
  if (n == 0) return {grad_pre, grad_bias};
  FUSED_DISPATCH_FLOATING(grad.scalar_type(), "linear_act_grad_pre", [&] {
    using T = at::opmath_type<scalar_t>;
    const scalar_t *gp = grad.data_ptr<scalar_t>(), *sp = saved.data_ptr<scalar_t>();
    scalar_t* gpre = grad_pre.data_ptr<scalar_t>();
    visit_act(a, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      // grad_pre in buf (math type), left there for the bias reduction.
      auto body = [&](int64_t i, int64_t len, T* scratch) -> const T* {
        const T* gv = math_view(gp + i, scratch, len);
        T* out = work_buffer(gpre + i, scratch);
        if constexpr (A != Act::identity) {
          T sbuf[kBlock];
          const T* sv = math_view(sp + i, sbuf, len);
          vec_map2_to(out, gv, sv, len, [&](auto g, auto s) { return act_backward_from_saved<A>(g, s); });
        } else if (out != gv) {
          std::copy(gv, gv + len, out);
        }
        store_block(out, gpre + i, len);
        return out;
      };
      std::vector<T> sums(N);
      parallel_blocks_column_sum(n, N, bias_grad ? sums.data() : nullptr, body);
      if (bias_grad) store_block(sums.data(), grad_bias.data_ptr<scalar_t>(), N);
    });
  });
  return {grad_pre, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) {
  m.impl("linear_act_fwd", &linear_act_fwd_cpu);
  m.impl("linear_act_grad_pre", &linear_act_grad_pre_cpu);
}

}  // namespace fused
