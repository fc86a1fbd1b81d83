// CUDA kernels of the log-prob and distillation row ops; see logprob_kernels.h. One block per row: the first pass
// reads the row (distillation: both rows) once, each thread keeping a running max m, sum of exp(z - m) and sum of
// exp(z - m) (z - m), rescaled whenever m grows; the threads' partials combine in a fixed tree (deterministic); the
// later passes read the row again (distillation: the loss's sums; then the gradient, only when one is asked for).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/scalar_math.h"
#include "loss/logprob_kernels.h"
#include "loss/logprob_math.h"
#include "loss/rows_cuda.cuh"

namespace fused {
namespace cuda {
namespace loss {
namespace {

using fused::loss::Divergence;
using fused::loss::JsdParams;

// A thread's (or a group of threads') running statistics of a row of z: max, sum exp(z - m), sum exp(z - m) (z - m).
template <typename M> struct Stats {
  M m, s, sez;
};

template <typename M> __device__ __forceinline__ void add(Stats<M>& p, M z) {
  const M inf = M(INFINITY);
  if (z > p.m) {  // a new max: rescale what was summed so far (nothing while m is -inf)
    if (p.m != -inf) {
      const M d = p.m - z, e = p_exp(d);
      p.sez = e * (p.sez + d * p.s);
      p.s *= e;
    }
    p.m = z;
  }
  const M d = z - p.m, e = p_exp(d);
  if (z != -inf) {  // a -inf logit adds nothing: p = 0, 0 log 0 = 0
    p.s += e;
    p.sez += p_weight_mul(e, d);
  }
}

// b folded into a; m = -inf means nothing finite seen yet (its exp sum is 0; its sez term stays as it is).
template <typename M> __device__ __forceinline__ void combine(Stats<M>& a, const Stats<M>& b) {
  const M inf = M(INFINITY), m = a.m > b.m ? a.m : b.m;
  M s = M(0), sez = M(0);
  auto fold = [&](const Stats<M>& p) {
    if (p.m == -inf) {
      sez += p.sez;
      return;
    }
    const M d = p.m - m, e = p_exp(d);
    s += e * p.s;
    sez += e * (p.sez + d * p.s);
  };
  fold(a);
  fold(b);
  a = {m, s, sez};
}

template <typename M> struct Sums {
  M t, s;  // sum_T and sum_S of logprob_math.h
};

template <typename M> __device__ __forceinline__ void combine(Sums<M>& a, const Sums<M>& b) {
  a.t += b.t;
  a.s += b.s;
}

// Every thread's p combined in a fixed tree over part[kRowThreads] (shared); every thread gets the result.
template <typename P> __device__ P block_reduce(P* part, const P& p) {
  const int tid = threadIdx.x;
  __syncthreads();  // (part may hold an earlier reduction that some thread still reads)
  part[tid] = p;
  __syncthreads();
  for (int stride = kRowThreads / 2; stride > 0; stride /= 2) {
    if (tid < stride) combine(part[tid], part[tid + stride]);
    __syncthreads();
  }
  return part[0];
}

template <typename T, typename M> __device__ __forceinline__ M scaled(const T* x, int64_t c, M temperature) {
  return to_math(x[c]) / temperature;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    log_prob_rows_kernel(LogProbArgs a, typename MathType<T>::type temperature) {
  using M = typename MathType<T>::type;
  __shared__ Stats<M> part[kRowThreads];
  __shared__ M shared[3];  // log_s, entropy, log p_t
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x, V = a.V;
  const auto [x, grad, t, ignored, bad] = block_row<T>(a);
  M* logp = static_cast<M*>(a.logp);
  M* entropy = static_cast<M*>(a.entropy);
  if (skip_row(ignored, grad, V, row, logp, entropy)) return;
  Stats<M> p{M(-INFINITY), M(0), M(0)};
  for (int64_t c = tid; c < V; c += kRowThreads) add(p, scaled(x, c, temperature));
  const Stats<M> r = block_reduce(part, p);
  if (tid == 0) {
    // a bad target's row reads nothing at t (V may be 0: no x[0] to read) and gets NaN
    const M log_s = bad ? M(NAN) : p_log(r.s), h = log_s - r.sez / r.s;
    const M logp_t = bad ? M(NAN) : (scaled(x, t, temperature) - r.m) - log_s;
    logp[row] = logp_t;
    entropy[row] = h;
    shared[0] = log_s;
    shared[1] = h;
    shared[2] = logp_t;
  }
  if (!grad) return;
  __syncthreads();  // (grad may be the logits: x[t] is read above before any thread writes)
  const M log_s = shared[0], h = shared[1], logp_t = shared[2];
  const M* scale = static_cast<const M*>(a.scale) + 2 * row;
  const M g_l = scale[0] / temperature, g_h = scale[1] / temperature;
  const M g_t = fused::loss::log_prob_target_grad(logp_t, p_exp(logp_t), expm1_of(logp_t), g_l, g_h, h);
  for (int64_t c = tid; c < V; c += kRowThreads) {
    const M lp = (scaled(x, c, temperature) - r.m) - log_s;
    grad[c] = from_math<T>(c == t ? g_t : fused::loss::log_prob_grad(lp, g_l, g_h, h));
  }
}

template <typename T, Divergence D>
__global__ void __launch_bounds__(kRowThreads)
    distillation_rows_kernel(DistillationArgs a, typename MathType<T>::type temperature,
                             JsdParams<typename MathType<T>::type> j) {
  using M = typename MathType<T>::type;
  __shared__ Stats<M> part[kRowThreads];
  __shared__ Sums<M> sums[kRowThreads];
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x, V = a.V;
  const BlockRow<T> r = block_row<T>(a);
  const T *x = r.x, *y = static_cast<const T*>(a.teacher) + row * a.ldt;
  T* grad = r.grad;
  // JSD with beta 0 or 1 compares a distribution with itself: 0, and no gradient.
  const bool trivial = D == Divergence::JSD && (j.beta == M(0) || j.one_minus_beta == M(0));
  if (skip_row(trivial || r.ignored, grad, V, row, static_cast<M*>(a.loss))) return;
  Stats<M> ps{M(-INFINITY), M(0), M(0)}, pt = ps;
  for (int64_t c = tid; c < V; c += kRowThreads) {
    add(ps, scaled(x, c, temperature));
    add(pt, scaled(y, c, temperature));
  }
  const Stats<M> rs = block_reduce(part, ps), rt = block_reduce(part, pt);
  const M log_ss = p_log(rs.s), log_st = p_log(rt.s);
  // log p of column c: (z - m) - log_s, as the CPU kernel's log_softmax
  auto log_ps = [&](int64_t c) { return (scaled(x, c, temperature) - rs.m) - log_ss; };
  auto log_pt = [&](int64_t c) { return (scaled(y, c, temperature) - rt.m) - log_st; };
  Sums<M> own{M(0), M(0)};
  for (int64_t c = tid; c < V; c += kRowThreads) {
    const M ls = log_ps(c), lt = log_pt(c), pnt = fused::loss::divergence_point<D>(ls, lt, j);
    own.t += p_weight_mul(p_exp(lt), lt - pnt);
    own.s += p_weight_mul(p_exp(ls), ls - pnt);
  }
  const Sums<M> sum = block_reduce(sums, own);
  if (tid == 0) static_cast<M*>(a.loss)[row] = fused::loss::divergence_loss<D>(sum.t, sum.s, j);
  if (!grad) return;
  const M coef = static_cast<const M*>(a.scale)[row * a.scale_step] / temperature;
  for (int64_t c = tid; c < V; c += kRowThreads) {  // (each thread reads and writes only its own columns)
    const M ls = log_ps(c), lt = log_pt(c);
    const M g = fused::loss::divergence_grad<D>(ls, lt, fused::loss::divergence_point<D>(ls, lt, j), sum.s, j);
    grad[c] = from_math<T>(coef * g);
  }
}

}  // namespace

cudaError_t log_prob_rows(DType dtype, const LogProbArgs& args, cudaStream_t stream) {
  return launch_rows(dtype, args.rows, [&](auto type, unsigned blocks) {
    using T = typename decltype(type)::type;
    using M = typename MathType<T>::type;
    FUSED_LAUNCH(blocks, kRowThreads, 0, stream, log_prob_rows_kernel<T>)(args, M(args.temperature));
  });
}

cudaError_t distillation_rows(DType dtype, const DistillationArgs& args, cudaStream_t stream) {
  return launch_rows(dtype, args.rows, [&](auto type, unsigned blocks) {
    using T = typename decltype(type)::type;
    using M = typename MathType<T>::type;
    const JsdParams<M> j{M(args.beta), M(1.0 - args.beta), M(std::log(args.beta)), M(std::log1p(-args.beta))};
    const M temperature(args.temperature);
    if (args.divergence == int(Divergence::ForwardKL))
      FUSED_LAUNCH(blocks, kRowThreads, 0, stream, distillation_rows_kernel<T, Divergence::ForwardKL>)(args,
                                                                                                       temperature, j);
    else if (args.divergence == int(Divergence::ReverseKL))
      FUSED_LAUNCH(blocks, kRowThreads, 0, stream, distillation_rows_kernel<T, Divergence::ReverseKL>)(args,
                                                                                                       temperature, j);
    else
      FUSED_LAUNCH(blocks, kRowThreads, 0, stream, distillation_rows_kernel<T, Divergence::JSD>)(args, temperature, j);
  });
}

}  // namespace loss
}  // namespace cuda
}  // namespace fused
