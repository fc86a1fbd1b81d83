// CUDA kernels of the fused optimizer family: pass 1 (grad_norm: sum of |g|^p with the finite check, per-block
// partials in fixed slots, the last block finishing the norm and the clip coefficient) and pass 2 (the SGD / Adam
// update, skipped as a whole when found_inf is set; its last block advances the step counters). Deterministic:
// no float atomics, only integer tickets. Math in float (double for double tensors).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/philox.h"
#include "optim/optim_kernels.h"

namespace fused {
namespace optim_cuda {
namespace {

template <typename T> using Math = MathType<T>;

// Four consecutive elements: one vector access when the tensor is 16-byte aligned and the group is whole.
template <typename T> struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) Pack4 { T v[4]; };

template <typename T, typename M>
__device__ __forceinline__ void load4(const T* p, int64_t i, int64_t end, bool aligned, M out[4]) {
  if (aligned && i + 4 <= end) {
    const Pack4<T> pk = *reinterpret_cast<const Pack4<T>*>(p + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_math(pk.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = i + k < end ? M(to_math(p[i + k])) : M(0);
  }
}

template <typename T, typename M>
__device__ __forceinline__ void store4(T* p, int64_t i, int64_t end, bool aligned, const M in[4]) {
  auto cvt = [](M x) -> T {
    if constexpr (sizeof(T) == 8) return static_cast<double>(x);
    else return from_math<T>(x);
  };
  if (aligned && i + 4 <= end) {
    Pack4<T> pk;
#pragma unroll
    for (int k = 0; k < 4; ++k) pk.v[k] = cvt(in[k]);
    *reinterpret_cast<Pack4<T>*>(p + i) = pk;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k < end) p[i + k] = cvt(in[k]);
  }
}

// Runs f(T{}) with T the storage type of dtype code d.
template <typename F> __device__ __forceinline__ void dispatch(uint8_t d, F&& f) {
  switch (d & 0x0f) {
    case kF32: f(float{}); break;
    case kF16: f(__half{}); break;
    case kBF16: f(__nv_bfloat16{}); break;
    default: f(double{}); break;
  }
}

// This block's chunk c: tensor, first and one-past-last element.
struct ChunkRange {
  int t;
  int64_t start, end;
  bool aligned;
};
__device__ __forceinline__ ChunkRange chunk_range(const TensorLists& L, int c) {
  const int t = L.chunk_tensor[c];
  const int64_t start = L.chunk_start[c];
  const int64_t end = start + kChunk < L.numel[t] ? start + kChunk : L.numel[t];
  return {t, start, end, (L.dtype[t] & kAligned) != 0};
}

template <typename T> __device__ __forceinline__ T* list_ptr(const TensorLists& L, int k, int t) {
  return static_cast<T*>(L.ptrs[k * L.num_tensors + t]);
}

// One value per block, combined in a fixed order: sum, or max (NaN wins, like torch's max).
template <Norm N> __device__ __forceinline__ float combine(float a, float b) {
  if constexpr (N == Norm::Inf) return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
  else return a + b;
}
template <Norm N> __device__ float block_reduce(float v) {
  __shared__ float warp_vals[32];
  for (int o = 16; o > 0; o >>= 1) v = combine<N>(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? warp_vals[threadIdx.x] : 0.f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v = combine<N>(v, __shfl_down_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;  // valid in thread 0
}

// True in every thread of the block that is the last of the grid to get here (after its own writes are visible).
// atomicInc wraps the ticket back to 0 as the last block takes it: the reset is part of the same atomic, so no
// later launch or graph replay can see a stale count.
__device__ bool last_block(unsigned* ticket) {
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicInc(ticket, gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

__device__ __forceinline__ float inverse_scale(const float* grad_scale) {
  return grad_scale ? float(1.0 / double(*grad_scale)) : 1.f;
}

// ---- pass 1 ----
template <Norm N> __device__ __forceinline__ float norm_term(float x, float p) {
  if constexpr (N == Norm::L2) return x * x;
  else if constexpr (N == Norm::L1 || N == Norm::Inf) return fabsf(x);
  else return powf(fabsf(x), p);
}

template <Norm N>
__global__ void __launch_bounds__(kThreads) grad_norm_kernel(TensorLists L, Workspace ws, const float* found_in,
                                                             const float* grad_scale, float p, float max_norm,
                                                             float clip_value, bool finish, float* norm_out,
                                                             float* coef_out, float* found_out) {
  const float inv = inverse_scale(grad_scale);
  const bool clip = isfinite(clip_value);
  float acc = 0.f;
  bool bad = false;
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    dispatch(L.dtype[r.t], [&](auto tag) {
      using T = decltype(tag);
      using M = typename Math<T>::type;
      const T* g = list_ptr<T>(L, 0, r.t);
      for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
        M x[4];
        load4(g, i, r.end, r.aligned, x);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          bad |= !isfinite(x[k]);
          float v = float(x[k]) * inv;
          if (clip && v == v) v = fminf(fmaxf(v, -clip_value), clip_value);  // NaN stays NaN, as in torch
          const float term = norm_term<N>(v, p);
          acc = N == Norm::Inf ? combine<N>(acc, term) : acc + term;
        }
      }
    });
  }
  acc = block_reduce<N>(acc);
  if (bad) atomicOr(ws.nonfinite, 1);
  if (threadIdx.x == 0) ws.partials[blockIdx.x] = acc;
  if (!last_block(&ws.tickets[0])) return;
  if (threadIdx.x != 0) return;
  // The last block adds the partials in slot order: the same result whatever order the blocks ran in.
  const volatile float* partials = ws.partials;
  double total = 0;
  for (int b = 0; b < (int)gridDim.x; ++b)
    total = N == Norm::Inf ? double(combine<N>(float(total), partials[b])) : total + partials[b];
  const bool nonfinite = *(volatile int*)ws.nonfinite != 0 || (found_in && *found_in != 0.f);
  *found_out = nonfinite ? 1.f : 0.f;
  *ws.nonfinite = 0;
  if (!finish) {
    *norm_out = float(total);
    return;
  }
  const double norm = N == Norm::L2 ? sqrt(total) : N == Norm::P ? pow(total, 1.0 / p) : total;
  *norm_out = float(norm);
  // inf and NaN propagate as in torch's clip_grad_norm_: inf -> coefficient 0, NaN -> NaN.
  *coef_out = isinf(max_norm) ? 1.f : norm != norm ? float(norm) : float(fmin(1.0, max_norm / (norm + 1e-6)));
}

__global__ void __launch_bounds__(kThreads) scale_grads_kernel(TensorLists L, const float* coef_p) {
  const float coef = *coef_p;
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    dispatch(L.dtype[r.t], [&](auto tag) {
      using T = decltype(tag);
      using M = typename Math<T>::type;
      T* g = list_ptr<T>(L, 0, r.t);
      for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
        M x[4];
        load4(g, i, r.end, r.aligned, x);
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] *= M(coef);
        store4(g, i, r.end, r.aligned, x);
      }
    });
  }
}

// ---- pass 2 ----
// The gradient as the update sees it: unscaled, value-clipped, norm-clipped, negated under maximize.
template <typename M>
__device__ __forceinline__ M transform_grad(M g, float inv, float clip_value, float coef, bool maximize) {
  g *= M(inv);
  if (isfinite(clip_value)) g = g < M(-clip_value) ? M(-clip_value) : g > M(clip_value) ? M(clip_value) : g;
  g *= M(coef);
  return maximize ? -g : g;
}

// The last block advances every step counter, once every block has read them.
__device__ void advance_steps(const TensorLists& L, Workspace ws) {
  if (!last_block(&ws.tickets[1])) return;
  for (int t = threadIdx.x; t < L.num_tensors; t += blockDim.x) *L.steps[t] += 1.f;
}

// Runs f(TP{}, TG{}, TS{}, TM{}): the types of parameter, gradient, state and (master weights) model parameter.
template <typename F> __device__ __forceinline__ void dispatch_update(uint8_t d, F&& f) {
  dispatch(d, [&](auto tag) {
    using D = decltype(tag);
    auto with_grad = [&](auto p, auto s, auto m) {
      if (d & kF32Grad) f(p, float{}, s, m);
      else f(p, tag, s, m);
    };
    if (d & kMaster) with_grad(float{}, float{}, tag);
    else if (d & kF32State) with_grad(tag, float{}, tag);
    else with_grad(tag, tag, tag);
  });
}

// Stores four updated parameters: bf16 stochastically when asked (element i + k uses Philox word k of counter
// i / 4: i is a multiple of 4), else rounded to nearest.
template <typename T, typename M>
__device__ __forceinline__ void store_param4(T* p, int64_t i, int64_t end, bool aligned, const M in[4],
                                             bool stochastic, uint64_t key) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (stochastic) {
      const Philox4 w = philox4x32_10(uint64_t(i) / 4, key);
      float r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float x = float(in[k]);
        const unsigned bits = x != x ? 0x7FC00000u : __float_as_uint(x) + (w.v[k] >> 16);
        r[k] = __uint_as_float(bits & 0xFFFF0000u);  // exact in bf16: the conversion below keeps it
      }
      store4(p, i, end, aligned, r);
      return;
    }
  }
  store4(p, i, end, aligned, in);
}

// The hyperparameters of tensor t: its row of L.hyper where there is one (several param groups in one launch).
__device__ __forceinline__ SgdArgs args_for(SgdArgs a, const TensorLists& L, int t) {
  if (L.hyper) {
    const float* h = L.hyper + t * L.hyper_width;
    a.lr = h[0], a.momentum = h[1], a.dampening = h[2], a.weight_decay = h[3];
  }
  return a;
}
__device__ __forceinline__ AdamArgs args_for(AdamArgs a, const TensorLists& L, int t) {
  if (L.hyper) {
    const float* h = L.hyper + t * L.hyper_width;
    a.lr = h[0], a.beta1 = h[1], a.beta2 = h[2], a.eps = h[3], a.weight_decay = h[4];
  }
  return a;
}

__global__ void __launch_bounds__(kThreads) sgd_kernel(TensorLists L, Workspace ws, SgdArgs args,
                                                       const float* coef_p, const float* grad_scale,
                                                       const float* found_inf) {
  if (*found_inf != 0.f) return;  // every block sees the same flag: the whole step is skipped
  const float inv = inverse_scale(grad_scale), coef = *coef_p;
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    const SgdArgs a = args_for(args, L, r.t);
    const bool first = a.use_momentum && *L.steps[r.t] == 0.f;
    const bool master = (L.dtype[r.t] & kMaster) != 0;
    const uint64_t key = a.sr_seed + uint64_t(r.t) * kTensorKeyStep;
    dispatch_update(L.dtype[r.t], [&](auto param_tag, auto grad_tag, auto state_tag, auto model_tag) {
      using TP = decltype(param_tag);
      using TG = decltype(grad_tag);
      using TS = decltype(state_tag);
      using TM = decltype(model_tag);
      using M = typename Math<TP>::type;
      TP* param = list_ptr<TP>(L, 0, r.t);
      const TG* grad = list_ptr<TG>(L, 1, r.t);
      TS* buf = a.use_momentum ? list_ptr<TS>(L, 2, r.t) : nullptr;
      TM* model = master ? list_ptr<TM>(L, L.num_lists - 1, r.t) : nullptr;
      for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
        M p[4], g[4], b[4];
        load4(param, i, r.end, r.aligned, p);
        load4(grad, i, r.end, r.aligned, g);
        if (a.use_momentum && !first) load4(buf, i, r.end, r.aligned, b);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          M d = transform_grad(g[k], inv, a.clip_value, coef, a.maximize);
          if (a.weight_decay != 0.f) d += M(a.weight_decay) * p[k];
          if (a.use_momentum) {
            b[k] = first ? d : M(a.momentum) * b[k] + M(1.f - a.dampening) * d;
            d = a.nesterov ? d + M(a.momentum) * b[k] : b[k];
          }
          p[k] -= M(a.lr) * d;
        }
        store_param4(param, i, r.end, r.aligned, p, a.stochastic, key);
        if (master) store4(model, i, r.end, r.aligned, p);
        if (a.use_momentum) store4(buf, i, r.end, r.aligned, b);
      }
    });
  }
  if (args.use_momentum) advance_steps(L, ws);
}

__global__ void __launch_bounds__(kThreads) adam_kernel(TensorLists L, Workspace ws, AdamArgs args,
                                                        const float* coef_p, const float* grad_scale,
                                                        const float* found_inf) {
  if (*found_inf != 0.f) return;  // every block sees the same flag: the whole step is skipped
  const float inv = inverse_scale(grad_scale), coef = *coef_p;
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    const AdamArgs a = args_for(args, L, r.t);
    const double step = double(*L.steps[r.t]) + 1.0;  // this step's count (advanced after the grid is done)
    const double step_size = a.lr / (1.0 - pow(double(a.beta1), step));
    const double inv_bc2_sqrt = 1.0 / sqrt(1.0 - pow(double(a.beta2), step));
    const bool master = (L.dtype[r.t] & kMaster) != 0;
    const uint64_t key = a.sr_seed + uint64_t(r.t) * kTensorKeyStep;
    dispatch_update(L.dtype[r.t], [&](auto param_tag, auto grad_tag, auto state_tag, auto model_tag) {
      using TP = decltype(param_tag);
      using TG = decltype(grad_tag);
      using TS = decltype(state_tag);
      using TM = decltype(model_tag);
      using M = typename Math<TP>::type;
      TP* param = list_ptr<TP>(L, 0, r.t);
      const TG* grad = list_ptr<TG>(L, 1, r.t);
      TS* exp_avg = list_ptr<TS>(L, 2, r.t);
      TS* exp_avg_sq = list_ptr<TS>(L, 3, r.t);
      TS* max_sq = a.amsgrad ? list_ptr<TS>(L, 4, r.t) : nullptr;
      TM* model = master ? list_ptr<TM>(L, L.num_lists - 1, r.t) : nullptr;
      for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
        M p[4], g[4], m[4], v[4], vmax[4];
        load4(param, i, r.end, r.aligned, p);
        load4(grad, i, r.end, r.aligned, g);
        load4(exp_avg, i, r.end, r.aligned, m);
        load4(exp_avg_sq, i, r.end, r.aligned, v);
        if (a.amsgrad) load4(max_sq, i, r.end, r.aligned, vmax);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          M gk = transform_grad(g[k], inv, a.clip_value, coef, a.maximize);
          if (a.weight_decay != 0.f) {
            if (a.decoupled) p[k] *= M(1.f - a.lr * a.weight_decay);
            else gk += M(a.weight_decay) * p[k];
          }
          m[k] += (gk - m[k]) * M(1.f - a.beta1);
          v[k] = M(a.beta2) * v[k] + M(1.f - a.beta2) * gk * gk;
          M vv = v[k];
          if (a.amsgrad) vv = vmax[k] = vmax[k] > v[k] ? vmax[k] : v[k];
          const M denom = sqrt(vv) * M(inv_bc2_sqrt) + M(a.eps);
          p[k] -= M(step_size) * m[k] / denom;
        }
        store_param4(param, i, r.end, r.aligned, p, a.stochastic, key);
        if (master) store4(model, i, r.end, r.aligned, p);
        store4(exp_avg, i, r.end, r.aligned, m);
        store4(exp_avg_sq, i, r.end, r.aligned, v);
        if (a.amsgrad) store4(max_sq, i, r.end, r.aligned, vmax);
      }
    });
  }
  advance_steps(L, ws);
}

// accs (float32; float64 for float64 grads) += grads, or = grads.
__global__ void __launch_bounds__(kThreads) accumulate_kernel(TensorLists L, bool overwrite) {
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    dispatch(L.dtype[r.t], [&](auto tag) {
      using TG = decltype(tag);
      using M = typename Math<TG>::type;
      M* acc = list_ptr<M>(L, 0, r.t);
      const TG* grad = list_ptr<TG>(L, 1, r.t);
      for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
        M a[4], g[4];
        load4(grad, i, r.end, r.aligned, g);
        if (!overwrite) {
          load4(acc, i, r.end, r.aligned, a);
#pragma unroll
          for (int k = 0; k < 4; ++k) g[k] += a[k];
        }
        store4(acc, i, r.end, r.aligned, g);
      }
    });
  }
}

int grid_for(const TensorLists& L, int num_sms) {
  int g = 4 * num_sms;
  g = g < L.num_chunks ? g : L.num_chunks;
  g = g < kMaxBlocks ? g : kMaxBlocks;
  return g > 0 ? g : 1;
}

}  // namespace

cudaError_t launch_grad_norm(const TensorLists& grads, Workspace ws, const float* found_in, const float* grad_scale,
                             Norm norm, float p, float max_norm, float clip_value, bool finish, float* norm_out,
                             float* coef_out, float* found_out, int num_sms, cudaStream_t stream) {
  const int grid = grid_for(grads, num_sms);
  switch (norm) {
    case Norm::L2:
      FUSED_LAUNCH(grid, kThreads, 0, stream, grad_norm_kernel<Norm::L2>)(
          grads, ws, found_in, grad_scale, p, max_norm, clip_value, finish, norm_out, coef_out, found_out);
      break;
    case Norm::L1:
      FUSED_LAUNCH(grid, kThreads, 0, stream, grad_norm_kernel<Norm::L1>)(
          grads, ws, found_in, grad_scale, p, max_norm, clip_value, finish, norm_out, coef_out, found_out);
      break;
    case Norm::Inf:
      FUSED_LAUNCH(grid, kThreads, 0, stream, grad_norm_kernel<Norm::Inf>)(
          grads, ws, found_in, grad_scale, p, max_norm, clip_value, finish, norm_out, coef_out, found_out);
      break;
    case Norm::P:
      FUSED_LAUNCH(grid, kThreads, 0, stream, grad_norm_kernel<Norm::P>)(
          grads, ws, found_in, grad_scale, p, max_norm, clip_value, finish, norm_out, coef_out, found_out);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_scale_grads(const TensorLists& grads, const float* coef, int num_sms, cudaStream_t stream) {
  if (grads.num_chunks == 0) return cudaSuccess;
  FUSED_LAUNCH(grid_for(grads, num_sms), kThreads, 0, stream, scale_grads_kernel)(grads, coef);
  return cudaGetLastError();
}

cudaError_t launch_sgd_step(const TensorLists& lists, Workspace ws, SgdArgs args, const float* coef,
                            const float* grad_scale, const float* found_inf, int num_sms, cudaStream_t stream) {
  FUSED_LAUNCH(grid_for(lists, num_sms), kThreads, 0, stream, sgd_kernel)(lists, ws, args, coef, grad_scale,
                                                                        found_inf);
  return cudaGetLastError();
}

cudaError_t launch_adam_step(const TensorLists& lists, Workspace ws, AdamArgs args, const float* coef,
                             const float* grad_scale, const float* found_inf, int num_sms, cudaStream_t stream) {
  FUSED_LAUNCH(grid_for(lists, num_sms), kThreads, 0, stream, adam_kernel)(lists, ws, args, coef, grad_scale,
                                                                         found_inf);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_grads(const TensorLists& lists, bool overwrite, int num_sms, cudaStream_t stream) {
  if (lists.num_chunks == 0) return cudaSuccess;
  FUSED_LAUNCH(grid_for(lists, num_sms), kThreads, 0, stream, accumulate_kernel)(lists, overwrite);
  return cudaGetLastError();
}

}  // namespace optim_cuda
}  // namespace fused
