// CUDA kernel of the loss family; see loss_kernels.h. One block per row: the first pass reads the row once,
// each thread keeping a running max m, sum of exp(z - m) and smoothing sum relative to m (rescaled whenever m
// grows); the threads' partials combine in a fixed tree (deterministic); the second pass writes the gradient.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/scalar_math.h"
#include "loss/loss_kernels.h"
#include "loss/loss_math.h"
#include "loss/rows_cuda.cuh"

namespace fused {
namespace cuda {
namespace loss {
namespace {

template <typename M> __device__ __forceinline__ M capped(M x, M cap) {
  return cap != M(0) ? cap * p_tanh(x / cap) : x;
}

// A thread's (or a group of threads') running statistics of a row.
template <typename M> struct Partial {
  M m, s, sm, w;  // max, sum exp(z - m), sum w (z - m), sum w
};

// p's smoothing sum re-based from p.m to m >= p.m. With nothing finite seen (p.m = -inf) p.sm holds its -inf terms
// as they are, as in the per-thread loop; with no weight (p.w = 0) there is nothing to shift (and 0 * inf is NaN).
template <typename M> __device__ __forceinline__ M rebased_smooth(const Partial<M>& p, M m) {
  return p.m == M(-INFINITY) || p.w == M(0) ? p.sm : p.sm + p.w * (p.m - m);
}

// b folded into a; m = -inf means nothing finite seen yet (its exp sum is 0, its smoothing terms still count).
template <typename M> __device__ __forceinline__ void combine(Partial<M>& a, const Partial<M>& b) {
  const M inf = M(INFINITY);
  const M m = a.m > b.m ? a.m : b.m;
  const M ea = a.m == -inf ? M(0) : p_exp(a.m - m), eb = b.m == -inf ? M(0) : p_exp(b.m - m);
  a.s = a.s * ea + b.s * eb;
  a.sm = rebased_smooth(a, m) + rebased_smooth(b, m);
  a.w += b.w;
  a.m = m;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_rows_kernel(RowsArgs a, typename MathType<T>::type ls, typename MathType<T>::type eps,
                              typename MathType<T>::type z_loss, typename MathType<T>::type cap) {
  using M = typename MathType<T>::type;
  __shared__ Partial<M> part[kRowThreads];
  __shared__ M shared[5];  // m, log_s, coef_p, coef_w, target gradient
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x, V = a.V;
  const auto [x, grad, t, ignored, bad] = block_row<T>(a);
  const M* weight = static_cast<const M*>(a.weight);
  const M* scale = static_cast<const M*>(a.scale) + row * a.scale_ld;
  M* loss = static_cast<M*>(a.loss);
  M* lse = static_cast<M*>(a.lse);
  if (skip_row(ignored, grad, V, row, loss, lse)) return;
  const bool smooth = ls != M(0);
  const M inf = M(INFINITY);
  Partial<M> p{-inf, M(0), M(0), M(0)};
  for (int64_t c = tid; c < V; c += kRowThreads) {
    const M z = capped(to_math(x[c]), cap);
    const M w = weight ? weight[c] : M(1);
    if (z > p.m) {  // a new max: rescale what was summed so far
      if (p.m != -inf) {
        p.s *= p_exp(p.m - z);
        if (smooth) p.sm += p.w * (p.m - z);
      }
      p.m = z;
    }
    if (z != -inf) p.s += p_exp(z - p.m);  // (a NaN z makes s NaN: the row's loss and gradient are NaN, as eager)
    if (smooth) {
      p.sm += z == -inf ? w * z : w * (z - p.m);  // a -inf logit makes the sum -inf (NaN at weight 0), as eager
      p.w += w;
    }
  }
  part[tid] = p;
  __syncthreads();
  for (int stride = kRowThreads / 2; stride > 0; stride /= 2) {
    if (tid < stride) combine(part[tid], part[tid + stride]);
    __syncthreads();
  }
  if (tid == 0) {
    const Partial<M> r = part[0];
    // a bad target's row reads nothing at t (V may be 0: no x[0] to read) and gets NaN
    const M log_s = bad ? M(NAN) : p_log(r.s), zt = bad ? M(NAN) : capped(to_math(x[t]), cap) - r.m;
    const M w_t = weight && !bad ? weight[t] : M(1);
    const fused::loss::Params<M> params{ls, eps, weight ? M(*a.weight_sum) : M(V), z_loss, cap};
    loss[row] = fused::loss::row_loss(log_s, zt, w_t, r.sm, params);
    lse[row] = r.m + log_s;
    if (grad) {
      const auto g = fused::loss::grad_coefs(r.m + log_s, w_t, scale[0], scale[1], params);
      const M log_pt = zt - log_s;
      shared[0] = r.m;
      shared[1] = log_s;
      shared[2] = g.coef_p;
      shared[3] = g.coef_w;
      shared[4] = fused::loss::target_grad(g, p_exp(log_pt), expm1_of(log_pt), w_t);
    }
  }
  if (!grad) return;
  __syncthreads();
  const M m = shared[0], log_s = shared[1], coef_p = shared[2], coef_w = shared[3], g_t = shared[4];
  for (int64_t c = tid; c < V; c += kRowThreads) {
    const M z = capped(to_math(x[c]), cap);
    M g = c == t ? g_t : coef_p * p_exp((z - m) - log_s) - coef_w * (weight ? weight[c] : M(1));
    if (cap != M(0)) {
      const M u = z / cap;
      g *= M(1) - u * u;
    }
    grad[c] = from_math<T>(g);
  }
}

}  // namespace

cudaError_t cross_entropy_rows(DType dtype, const RowsArgs& args, cudaStream_t stream) {
  return launch_rows(dtype, args.rows, [&](auto type, unsigned blocks) {
    using T = typename decltype(type)::type;
    using M = typename MathType<T>::type;
    FUSED_LAUNCH(blocks, kRowThreads, 0, stream, cross_entropy_rows_kernel<T>)(
        args, M(args.label_smoothing), M(args.label_smoothing / (args.V > 0 ? args.V : 1)), M(args.z_loss),
        M(args.softcap));
  });
}

}  // namespace loss
}  // namespace cuda
}  // namespace fused
