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
template <typename T> struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) Pack4 {
  T v[4];
};

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
  switch (d & kDTypeBits) {
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

// Runs body(r, tag) over this block's chunks: r the chunk, tag's type the storage type of its tensor.
template <typename F> __device__ __forceinline__ void for_chunks(const TensorLists& L, F&& body) {
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    dispatch(L.dtype[r.t], [&](auto tag) { body(r, tag); });
  }
}

// One value per block, combined in a fixed order: sum, or max (NaN wins, like torch's max).
template <Norm N, typename A> __device__ __forceinline__ A combine(A a, A b) {
  if constexpr (N == Norm::Inf) return a != a ? a : b != b ? b : a > b ? a : b;
  else return a + b;
}
template <Norm N, typename A> __device__ A block_reduce(A v) {
  __shared__ A warp_vals[32];
  for (int o = 16; o > 0; o >>= 1) v = combine<N>(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? warp_vals[threadIdx.x] : A(0);
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

// The gradient as the update sees it, before maximize negates it: unscaled, value-clipped (NaN stays NaN, as in
// torch), norm-clipped. Pass 1 takes it with coef = 1; pass 2 stores it back under write_grads, as torch's recipe
// unscale_ + clip_grad_value_ + clip_grad_norm_ leaves .grad.
template <typename M> __device__ __forceinline__ M clipped_grad(M g, float inv, double clip_value, double coef) {
  g *= M(inv);
  if (isfinite(clip_value)) g = g < M(-clip_value) ? M(-clip_value) : g > M(clip_value) ? M(clip_value) : g;
  return g * M(coef);
}

// ---- pass 1 ----
template <Norm N, typename A> __device__ __forceinline__ A norm_term(A x, A p) {
  if constexpr (N == Norm::L2) return x * x;
  else if constexpr (N == Norm::L1 || N == Norm::Inf) return fabs(x);
  else if constexpr (sizeof(A) == 4) return powf(fabsf(x), p);
  else return pow(fabs(x), p);
}

// Stores a finished scalar into memory of dtype code d (16-bit through float, as the CPU's at::scalar_tensor).
__device__ __forceinline__ void store_scalar(void* out, uint8_t d, double v) {
  dispatch(d, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 8) *static_cast<double*>(out) = v;
    else *static_cast<T*>(out) = from_math<T>(float(v));
  });
}

// A: the accumulator, float unless some gradient is float64. Per-block partials are added up in double.
template <Norm N, typename A>
__global__ void __launch_bounds__(kThreads)
    grad_norm_kernel(TensorLists L, Workspace ws, const float* found_in, const float* grad_scale, double p,
                     double max_norm, double clip_value, bool finish, void* norm_out, uint8_t norm_dtype,
                     double* coef_out, float* found_out) {
  const float inv = inverse_scale(grad_scale);
  A acc = 0;
  bool bad = false;
  for_chunks(L, [&](const ChunkRange& r, auto tag) {
    using T = decltype(tag);
    using M = typename Math<T>::type;
    const T* g = list_ptr<T>(L, 0, r.t);
    for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
      M x[4];
      load4(g, i, r.end, r.aligned, x);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        bad |= !isfinite(x[k]);
        const A term = norm_term<N>(A(clipped_grad(x[k], inv, clip_value, 1.0)), A(p));
        acc = N == Norm::Inf ? combine<N>(acc, term) : acc + term;
      }
    }
  });
  acc = block_reduce<N>(acc);
  if (bad) atomicOr(ws.nonfinite, 1);
  if (threadIdx.x == 0) ws.partials[blockIdx.x] = acc;
  if (!last_block(&ws.tickets[0])) return;
  if (threadIdx.x != 0) return;
  // The last block adds the partials in slot order: the same result whatever order the blocks ran in.
  const volatile double* partials = ws.partials;
  double total = 0;
  for (int b = 0; b < (int)gridDim.x; ++b) total = combine<N>(total, double(partials[b]));
  const bool nonfinite = *(volatile int*)ws.nonfinite != 0 || (found_in && *found_in != 0.f);
  *found_out = nonfinite ? 1.f : 0.f;
  *ws.nonfinite = 0;
  if (!finish) {
    *static_cast<double*>(norm_out) = total;
    return;
  }
  const double norm = N == Norm::L2 ? sqrt(total) : N == Norm::P ? pow(total, 1.0 / p) : total;
  store_scalar(norm_out, norm_dtype, norm);
  // inf and NaN propagate as in torch's clip_grad_norm_: inf -> coefficient 0, NaN -> NaN.
  *coef_out = isinf(max_norm) ? 1.0 : norm != norm ? norm : fmin(1.0, max_norm / (norm + 1e-6));
}

__global__ void __launch_bounds__(kThreads) scale_grads_kernel(TensorLists L, const double* coef_p) {
  const double coef = *coef_p;
  for_chunks(L, [&](const ChunkRange& r, auto tag) {
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

// ---- pass 2 ----
// write_grads stores the gradient back only where the step changes it (a loss scale, value or norm clipping):
// the same answer in every block (a uniform branch).
__device__ __forceinline__ bool writes_back(bool write_grads, float inv, double clip_value, double coef) {
  return write_grads && (inv != 1.f || isfinite(clip_value) || coef != 1.0);
}

// The last block advances every step counter, once every block has read them.
__device__ void advance_steps(const TensorLists& L, Workspace ws) {
  if (!last_block(&ws.tickets[1])) return;
  for (int t = threadIdx.x; t < L.num_tensors; t += blockDim.x) *L.steps[t] += 1.f;
}

// The low-bit state forms a kernel instance takes besides plain state (Adam's kInt8State or kBF16State tensors).
// An instance is launched only where some tensor has its form: the code and registers of these paths would
// otherwise weigh on every step.
enum class LowState { none, int8, bf16 };

// Runs f(TP{}, TG{}, TS{}, TM{}): the types of parameter, gradient, state and (master weights) model parameter.
// TS is int8_t for 8-bit state and __nv_bfloat16 for kBF16State (where kLow allows them; never with float64
// parameters).
template <LowState kLow, typename F> __device__ __forceinline__ void dispatch_update(uint8_t d, F&& f) {
  dispatch(d, [&](auto tag) {
    using D = decltype(tag);
    auto with_grad = [&](auto p, auto s, auto m) {
      if (d & kF32Grad) f(p, float{}, s, m);
      else f(p, tag, s, m);
    };
    auto with_state = [&](auto p, auto m) {
      if constexpr (!std::is_same_v<D, double> && kLow == LowState::int8) {
        if (d & kInt8State) return with_grad(p, int8_t{}, m);
      }
      if constexpr (!std::is_same_v<D, double> && kLow == LowState::bf16) {
        if (d & kBF16State) return with_grad(p, __nv_bfloat16{}, m);
      }
      if (d & (kMaster | kF32State)) with_grad(p, float{}, m);
      else with_grad(p, tag, m);
    };
    if (d & kMaster) with_state(float{}, tag);
    else with_state(tag, tag);
  });
}

// Stores four updated parameters: bf16 stochastically when asked (element i + k uses Philox word k of counter
// i / 4: i is a multiple of 4), else rounded to nearest.
template <typename T, typename M>
__device__ __forceinline__ void store_param4(T* p, int64_t i, int64_t end, bool aligned, const M in[4], bool stochastic,
                                             uint64_t key) {
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

// The dither halves of elements i..i + 3 (i a multiple of 4) under key: element i + k takes half k % 2 of
// dither_word(key, i / 2 + k / 2), the high half for even k (quantize_cpu.h's half_word).
__device__ __forceinline__ void dither_halves4(uint64_t key, int64_t i, uint32_t h[4]) {
  const uint32_t words[2] = {dither_word(key, uint64_t(i) / 2), dither_word(key, uint64_t(i) / 2 + 1)};
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = k % 2 == 0 ? words[k / 2] >> 16 : words[k / 2] & 0xFFFFu;
}

// Stores four updated moments: bf16 stochastically where kRounding and asked (the addends dither_halves4; i is a
// multiple of 4), else rounded to nearest. kRounding: only the kernel for bf16 state carries the rounding code.
template <bool kRounding, typename T, typename M>
__device__ __forceinline__ void store_state4(T* p, int64_t i, int64_t end, bool aligned, const M in[4], bool stochastic,
                                             uint64_t key) {
  if constexpr (kRounding && std::is_same_v<T, __nv_bfloat16>) {
    if (stochastic) {
      uint32_t half[4];
      dither_halves4(key, i, half);
      float r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float x = float(in[k]);
        const unsigned bits = x != x ? 0x7FC00000u : __float_as_uint(x) + half[k];
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
    const double* h = L.hyper + t * L.hyper_width;
    a.lr = h[0], a.momentum = h[1], a.dampening = h[2], a.weight_decay = h[3];
  }
  return a;
}
__device__ __forceinline__ AdamArgs args_for(AdamArgs a, const TensorLists& L, int t) {
  if (L.hyper) {
    const double* h = L.hyper + t * L.hyper_width;
    a.lr = h[0], a.beta1 = h[1], a.beta2 = h[2], a.eps = h[3], a.weight_decay = h[4];
  }
  return a;
}

// What an update reads besides its lists: the inverse loss scale, the clip coefficient, and whether the gradient
// is written back.
struct UpdateScalars {
  float inv;
  double coef;
  bool write_back;
};

// One tensor of an update in this block: its typed parameter, gradient and (master weights) model parameter, and
// its stochastic-rounding key. M: the math type; TS: the state's storage type (state(k): state list k).
template <typename TP, typename TG, typename TS, typename TM> struct UpdateTensor {
  using M = typename Math<TP>::type;
  const TensorLists& L;
  int t;
  TP* param;
  TG* grad;
  TM* model;  // null without master weights
  uint64_t key;
  // Stores four updated parameters, and their rounded copy into the model parameter with master weights.
  __device__ __forceinline__ void store_params(int64_t i, int64_t end, bool aligned, const M p[4],
                                               bool stochastic) const {
    store_param4(param, i, end, aligned, p, stochastic, key);
    if (model) store4(model, i, end, aligned, p);
  }
  __device__ __forceinline__ TS* state(int k) const { return list_ptr<TS>(L, k, t); }
};

// What the SGD and Adam kernels share around their arithmetic: the whole step skipped on found_inf (false), the
// scalars, the loop over this block's chunks with each tensor's hyperparameters, and the dispatch on its types.
// body(r, a, s, tensor) runs one chunk.
// kLow: the low-bit state tensors that may come (Adam's kernels).
template <LowState kLow = LowState::none, typename Args, typename F>
__device__ __forceinline__ bool for_update_chunks(const TensorLists& L, const Args& args, StepScalars in, F&& body) {
  if (*in.found_inf != 0.f) return false;  // every block sees the same flag
  const float inv = inverse_scale(in.grad_scale);
  const double coef = *in.coef;
  const UpdateScalars s{inv, coef, writes_back(args.write_grads, inv, args.clip_value, coef)};
  for (int c = blockIdx.x; c < L.num_chunks; c += gridDim.x) {
    const ChunkRange r = chunk_range(L, c);
    const Args a = args_for(args, L, r.t);
    const bool master = (L.dtype[r.t] & kMaster) != 0;
    dispatch_update<kLow>(L.dtype[r.t], [&](auto param_tag, auto grad_tag, auto state_tag, auto model_tag) {
      using TP = decltype(param_tag);
      using TG = decltype(grad_tag);
      using TM = decltype(model_tag);
      const UpdateTensor<TP, TG, decltype(state_tag), TM> u{L,
                                                            r.t,
                                                            list_ptr<TP>(L, 0, r.t),
                                                            list_ptr<TG>(L, 1, r.t),
                                                            master ? list_ptr<TM>(L, L.num_lists - 1, r.t) : nullptr,
                                                            rounding_key(a.sr_seed, r.t)};
      body(r, a, s, u);
    });
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) sgd_kernel(TensorLists L, Workspace ws, SgdArgs args, StepScalars in) {
  const bool stepped =
      for_update_chunks(L, args, in, [&](const ChunkRange& r, const SgdArgs& a, const UpdateScalars& s, const auto& u) {
        using M = typename std::decay_t<decltype(u)>::M;
        const bool first = a.use_momentum && *L.steps[r.t] == 0.f;
        auto* buf = a.use_momentum ? u.state(2) : nullptr;
        for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
          M p[4], g[4], b[4];
          load4(u.param, i, r.end, r.aligned, p);
          load4(u.grad, i, r.end, r.aligned, g);
          if (a.use_momentum && !first) load4(buf, i, r.end, r.aligned, b);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            g[k] = clipped_grad(g[k], s.inv, a.clip_value, s.coef);
            M d = a.maximize ? -g[k] : g[k];
            if (a.weight_decay != 0.0) d += M(a.weight_decay) * p[k];
            if (a.use_momentum) {
              b[k] = first ? d : M(a.momentum) * b[k] + M(1.0 - a.dampening) * d;
              d = a.nesterov ? d + M(a.momentum) * b[k] : b[k];
            }
            p[k] -= M(a.lr) * d;
          }
          u.store_params(i, r.end, r.aligned, p, a.stochastic);
          if (a.use_momentum) store4(buf, i, r.end, r.aligned, b);
          if (s.write_back) store4(u.grad, i, r.end, r.aligned, g);
        }
      });
  if (stepped && args.use_momentum) advance_steps(L, ws);
}

// Adam's per-tensor constants in the math type, as the CPU kernel rounds them (bias corrections in double).
template <typename M> struct AdamCoefs {
  M b1c, b2, b2c, eps, wd, decay, neg_step, inv_bc2;
};
template <typename M> __device__ __forceinline__ AdamCoefs<M> adam_coefs(const AdamArgs& a, double step) {
  const double step_size = a.lr / (1.0 - pow(a.beta1, step));
  const double inv_bc2_sqrt = 1.0 / sqrt(1.0 - pow(a.beta2, step));
  return {M(1.0 - a.beta1), M(a.beta2),        M(1.0 - a.beta2),
          M(a.eps),         M(a.weight_decay), M(1.0 - a.lr * a.weight_decay),
          M(-step_size),    M(inv_bc2_sqrt)};
}

// One element of Adam's update from the clipped gradient g, with the CPU kernel's operations (the same fmas, so the
// same bits from the same inputs). vmax is read and written under amsgrad only.
template <typename M>
__device__ __forceinline__ void adam_element(const AdamArgs& a, const AdamCoefs<M>& c, M g, M& p, M& m, M& v, M& vmax) {
  M gk = a.maximize ? -g : g;
  if (a.weight_decay != 0.0) {
    if (a.decoupled) p *= c.decay;
    else gk = fma(p, c.wd, gk);
  }
  m = fma(gk - m, c.b1c, m);
  v = fma(gk * gk, c.b2c, v * c.b2);
  M vv = v;
  if (a.amsgrad) vv = vmax = vmax > v ? vmax : v;
  p = fma(c.neg_step, m / fma(sqrt(vv), c.inv_bc2, c.eps), p);
}

// ---- 8-bit state (kInt8State): quantize_cpu.h's code maps and arithmetic, so its bits ----
// exp_avg: int8 codes, m = sign(q) (q / 127)^2 a; exp_avg_sq: uint8 codes on sqrt(v) = (q / 255)^2 u; a, u the
// block's max |m| and max sqrt(v) (its float32 scale). Each thread holds 4 consecutive elements, as in the plain
// path (the same registers), so a block of kQuantBlock elements is two warps: the scale is a shuffle reduction in
// each and one exchange through shared memory, and the codes never leave registers.
constexpr int kWarpsPerQuantBlock = kQuantBlock / (4 * 32);
static_assert(kWarpsPerQuantBlock == 2 && kThreads % (32 * kWarpsPerQuantBlock) == 0);
template <typename C> struct alignas(4) Codes4 {
  C v[4];
};
template <typename C> constexpr float kLevels = std::is_signed_v<C> ? 127.f : 255.f;

// Element i..i+3's values decoded from their codes and the block's scale (zeros past end).
template <typename C>
__device__ __forceinline__ void decode4(const C* q, float scale, int64_t i, int64_t end, bool aligned, float out[4]) {
  Codes4<C> c{};
  if (aligned && i + 4 <= end) c = *reinterpret_cast<const Codes4<C>*>(q + i);
  else
#pragma unroll
    for (int k = 0; k < 4; ++k) c.v[k] = i + k < end ? q[i + k] : C(0);
  const float s = scale / (kLevels<C> * kLevels<C>);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float f = float(c.v[k]);
    if constexpr (std::is_signed_v<C>) out[k] = f * fabsf(f) * s;
    else {
      const float w = f * f * s;
      out[k] = w * w;
    }
  }
}

// max that keeps NaN, as at::vec::maximum in quantize_cpu.h's block max
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : b != b ? b : a > b ? a : b; }

// quantize_cpu.h's dithered_code: the uint8 code of t = sqrt(sqrt(v) / u) * 255 for a dither d in (0, 1), rounded
// up with the probability that keeps the decoded v unbiased (to nearest below 1). The same steps, no contraction.
__device__ __forceinline__ float dithered_code(float t, float d) {
  const float c = floorf(t), c2 = c * c, c4 = c2 * c2, next = c + 1.f, next2 = next * next, t2 = t * t;
  const float gap = fmaf(next2, next2, -c4), above = fmaf(t2, t2, -c4);
  const float dither = c == 0.f ? 0.0625f : d;
  return dither * gap < above ? next : c;
}

// Encodes element i..i+3 (x; those past end are not part of the block) into their codes; the first thread of the
// block's two warps stores its scale. Every thread of the CUDA block calls it (it has barriers); exchange: shared
// scratch of one float per warp. dither (uint8 codes only): rounded stochastically with dither_halves4 (the CPU
// kernel's DitherWords and dither_lanes).
template <typename C>
__device__ __forceinline__ void encode4(const float x[4], C* q, float* scale, int64_t i, int64_t end, bool aligned,
                                        float* exchange, bool dither = false, uint64_t key = 0) {
  float mag[4], a = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    mag[k] = i + k >= end ? 0.f : std::is_signed_v<C> ? fabsf(x[k]) : sqrtf(x[k]);
    a = nan_max(a, mag[k]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) exchange[warp] = a;
  __syncthreads();
  a = nan_max(a, exchange[warp ^ 1]);  // the same in both warps but for a NaN's payload (codes 0 either way)
  __syncthreads();                     // read before the next exchange
  if ((threadIdx.x & 63) == 0 && i < end) *scale = a;
  const bool usable = a > 0.f && a <= __FLT_MAX__;  // else codes 0: zero blocks decode to 0, non-finite to NaN
  // mag / a as mag * (1 / a), but for a denormal a, whose inverse overflows
  const float inv = 1.f / a;
  const bool by_inverse = inv <= __FLT_MAX__;
  uint32_t h[4] = {0, 0, 0, 0};
  if (!std::is_signed_v<C> && dither) dither_halves4(key, i, h);
  Codes4<C> c;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float t = sqrtf(by_inverse ? mag[k] * inv : mag[k] / a) * kLevels<C>;
    float r;
    if (!std::is_signed_v<C> && dither) {
      r = dithered_code(t, float(2 * h[k] + 1) * 0x1p-17f);
    } else {
      r = rintf(t);
    }
    const float code = usable ? r : 0.f;
    c.v[k] = C(std::is_signed_v<C> && x[k] < 0.f ? -code : code);
  }
  if (aligned && i + 4 <= end) *reinterpret_cast<Codes4<C>*>(q + i) = c;
  else
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k < end) q[i + k] = c.v[k];
}

// One chunk of a tensor with 8-bit state, 4 elements a thread as the plain path (chunks and the block's stride
// are multiples of kQuantBlock, so warps 2w and 2w + 1 hold one quantization block): decode, update, encode.
template <typename U>
__device__ __forceinline__ void adam_codes_chunk(const TensorLists& L, const ChunkRange& r, const AdamArgs& a,
                                                 const UpdateScalars& s, const U& u, const AdamCoefs<float>& c) {
  __shared__ float exchange[kThreads / 32];
  const int scales = a.amsgrad ? 5 : 4;  // the first scale list
  int8_t* qm = list_ptr<int8_t>(L, 2, r.t);
  uint8_t *qv = list_ptr<uint8_t>(L, 3, r.t), *qx = a.amsgrad ? list_ptr<uint8_t>(L, 4, r.t) : nullptr;
  float *sm = list_ptr<float>(L, scales, r.t), *sv = list_ptr<float>(L, scales + 1, r.t);
  float* sx = a.amsgrad ? list_ptr<float>(L, scales + 2, r.t) : nullptr;
  for (int64_t base = r.start; base < r.end; base += 4 * blockDim.x) {  // the same trips in every thread
    const int64_t i = base + 4 * threadIdx.x, blk = i / kQuantBlock;
    const bool inside = i < r.end;
    float p[4], g[4], m[4], v[4], vmax[4];
    load4(u.param, i, r.end, r.aligned, p);
    load4(u.grad, i, r.end, r.aligned, g);
    decode4(qm, inside ? sm[blk] : 0.f, i, r.end, r.aligned, m);
    decode4(qv, inside ? sv[blk] : 0.f, i, r.end, r.aligned, v);
    if (a.amsgrad) decode4(qx, inside ? sx[blk] : 0.f, i, r.end, r.aligned, vmax);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      g[k] = clipped_grad(g[k], s.inv, a.clip_value, s.coef);
      adam_element(a, c, g[k], p[k], m[k], v[k], vmax[k]);
    }
    u.store_params(i, r.end, r.aligned, p, a.stochastic);
    if (s.write_back) store4(u.grad, i, r.end, r.aligned, g);
    encode4(m, qm, sm + blk, i, r.end, r.aligned, exchange);
    // exp_avg_sq's codes rounded stochastically where a state seed is given (quantize_cpu.h), the others to nearest
    encode4(v, qv, sv + blk, i, r.end, r.aligned, exchange, a.state_stochastic, rounding_key(a.state_seed, r.t, 2));
    if (a.amsgrad) encode4(vmax, qx, sx + blk, i, r.end, r.aligned, exchange);
  }
}

// kLow: LowState::int8, the kernel with the 8-bit state path; LowState::bf16, the one with kBF16State tensors and
// stochastically rounded bf16 state.
template <LowState kLow>
__global__ void __launch_bounds__(kThreads) adam_kernel(TensorLists L, Workspace ws, AdamArgs args, StepScalars in) {
  const bool stepped = for_update_chunks<kLow>(
      L, args, in, [&](const ChunkRange& r, const AdamArgs& a, const UpdateScalars& s, const auto& u) {
        using UT = std::decay_t<decltype(u)>;
        using M = typename UT::M;
        // this step's count (advanced after the grid is done)
        const AdamCoefs<M> c = adam_coefs<M>(a, double(*L.steps[r.t]) + 1.0);
        if constexpr (std::is_same_v<std::remove_pointer_t<decltype(u.state(2))>, int8_t>) {
          adam_codes_chunk(L, r, a, s, u, c);
          return;
        } else {
          auto *exp_avg = u.state(2), *exp_avg_sq = u.state(3), *max_sq = a.amsgrad ? u.state(4) : nullptr;
          for (int64_t i = r.start + 4 * threadIdx.x; i < r.end; i += 4 * blockDim.x) {
            M p[4], g[4], m[4], v[4], vmax[4];
            load4(u.param, i, r.end, r.aligned, p);
            load4(u.grad, i, r.end, r.aligned, g);
            load4(exp_avg, i, r.end, r.aligned, m);
            load4(exp_avg_sq, i, r.end, r.aligned, v);
            if (a.amsgrad) load4(max_sq, i, r.end, r.aligned, vmax);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              g[k] = clipped_grad(g[k], s.inv, a.clip_value, s.coef);
              adam_element(a, c, g[k], p[k], m[k], v[k], vmax[k]);
            }
            u.store_params(i, r.end, r.aligned, p, a.stochastic);
            const bool sr = a.state_stochastic;
            constexpr bool kRounding = kLow == LowState::bf16;
            store_state4<kRounding>(exp_avg, i, r.end, r.aligned, m, sr, rounding_key(a.state_seed, r.t, 1));
            store_state4<kRounding>(exp_avg_sq, i, r.end, r.aligned, v, sr, rounding_key(a.state_seed, r.t, 2));
            if (a.amsgrad)
              store_state4<kRounding>(max_sq, i, r.end, r.aligned, vmax, sr, rounding_key(a.state_seed, r.t, 3));
            if (s.write_back) store4(u.grad, i, r.end, r.aligned, g);
          }
        }
      });
  if (stepped) advance_steps(L, ws);
}

// accs (float32; float64 for float64 grads) += grads, or = grads.
__global__ void __launch_bounds__(kThreads) accumulate_kernel(TensorLists L, bool overwrite) {
  for_chunks(L, [&](const ChunkRange& r, auto tag) {
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

int grid_for(const TensorLists& L, int num_sms) {
  int g = 4 * num_sms;
  g = g < L.num_chunks ? g : L.num_chunks;
  g = g < kMaxBlocks ? g : kMaxBlocks;
  return g > 0 ? g : 1;
}

}  // namespace

cudaError_t launch_grad_norm(const TensorLists& grads, Workspace ws, const float* found_in, const float* grad_scale,
                             Norm norm, double p, double max_norm, double clip_value, bool fp64, bool finish,
                             void* norm_out, uint8_t norm_dtype, double* coef_out, float* found_out, int num_sms,
                             cudaStream_t stream) {
  const int grid = grid_for(grads, num_sms);
  auto launch = [&](auto norm_tag, auto acc_tag) {
    FUSED_LAUNCH(grid, kThreads, 0, stream, grad_norm_kernel<decltype(norm_tag)::value, decltype(acc_tag)>)(
        grads, ws, found_in, grad_scale, p, max_norm, clip_value, finish, norm_out, norm_dtype, coef_out, found_out);
  };
  auto with_acc = [&](auto norm_tag) { fp64 ? launch(norm_tag, double{}) : launch(norm_tag, float{}); };
  switch (norm) {
    case Norm::L2: with_acc(std::integral_constant<Norm, Norm::L2>{}); break;
    case Norm::L1: with_acc(std::integral_constant<Norm, Norm::L1>{}); break;
    case Norm::Inf: with_acc(std::integral_constant<Norm, Norm::Inf>{}); break;
    case Norm::P: with_acc(std::integral_constant<Norm, Norm::P>{}); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_scale_grads(const TensorLists& grads, const double* coef, int num_sms, cudaStream_t stream) {
  if (grads.num_chunks == 0) return cudaSuccess;
  FUSED_LAUNCH(grid_for(grads, num_sms), kThreads, 0, stream, scale_grads_kernel)(grads, coef);
  return cudaGetLastError();
}

cudaError_t launch_sgd_step(const TensorLists& lists, Workspace ws, SgdArgs args, StepScalars scalars, int num_sms,
                            cudaStream_t stream) {
  FUSED_LAUNCH(grid_for(lists, num_sms), kThreads, 0, stream, sgd_kernel)(lists, ws, args, scalars);
  return cudaGetLastError();
}

cudaError_t launch_adam_step(const TensorLists& lists, Workspace ws, AdamArgs args, StepScalars scalars, int num_sms,
                             cudaStream_t stream) {
  const int grid = grid_for(lists, num_sms);
  if (args.codes) FUSED_LAUNCH(grid, kThreads, 0, stream, adam_kernel<LowState::int8>)(lists, ws, args, scalars);
  else if (args.bf16_state || args.state_stochastic)
    FUSED_LAUNCH(grid, kThreads, 0, stream, adam_kernel<LowState::bf16>)(lists, ws, args, scalars);
  else FUSED_LAUNCH(grid, kThreads, 0, stream, adam_kernel<LowState::none>)(lists, ws, args, scalars);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_grads(const TensorLists& lists, bool overwrite, int num_sms, cudaStream_t stream) {
  if (lists.num_chunks == 0) return cudaSuccess;
  FUSED_LAUNCH(grid_for(lists, num_sms), kThreads, 0, stream, accumulate_kernel)(lists, overwrite);
  return cudaGetLastError();
}

}  // namespace optim_cuda
}  // namespace fused
