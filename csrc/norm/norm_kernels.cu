// CUDA kernels of the norm family (launchers declared in norm_kernels.h), torch-free. A block takes a whole row
// (forward) or a chunk of rows (backward); its threads stride over the row's columns with coalesced accesses and
// hold their elements in registers between the passes (the statistics, then the outputs), or re-read them from
// L1/L2 when the row is wider than kHeld * kMaxThreads. Block sums: a warp butterfly, then the warps' sums added
// in warp order by every thread, so every run adds in the same order. Each thread reads back only elements it wrote
// itself.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "norm/norm_kernels.h"

namespace fused {
namespace cuda {
namespace norm {
namespace {

template <typename S> using Math = typename MathType<S>::type;

constexpr int kMaxThreads = 1024;
constexpr int64_t kBackwardChunks = 512;  // about how many blocks the backward launches (fixed: deterministic)
// Row elements a thread holds in registers between the passes over its row: rows of up to kHeld * kMaxThreads
// columns are read from memory once; wider rows (kHeld = 0 instantiations) are re-read on each pass.
constexpr int kHeld = 8;
constexpr int kSumLanes = 32;  // chunk_sum_kernel: threads (blockDim.y) that share one column's chunks

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sums of v[0..N) over the block, the same values in every thread; `shared` holds N T per warp.
template <int N, typename T> __device__ void block_sums(T (&v)[N], T* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) shared[N * (threadIdx.x / 32) + i] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[i] = T(0);
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) v[i] += shared[N * w + i];
  }
  __syncthreads();  // shared is reused by the next call
}

// How many of the row's elements this thread visits (j = threadIdx.x + k * blockDim.x for k below it): kHeld, or
// as many as the row needs when nothing is held. The loops stop at j >= C.
template <int kPer> __device__ __forceinline__ int per_thread(int64_t C) {
  return kPer > 0 ? kPer : static_cast<int>(ceil_div(C, blockDim.x));
}

template <typename T> __device__ __forceinline__ T rsqrt_rn(T v) { return T(1) / sqrt(v); }  // as the CPU kernel

// grad * weight rounded on its own, as in the row's sum of them: nvcc would contract gw - mean(gw) into one fma with
// the product unrounded, and the two would no longer cancel (a row of one element, whose exact gradient is 0, would
// get the product's rounding error times rstd).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename S, typename R, int kPer>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd_kernel(const S* __restrict__ x, const R* __restrict__ residual, const Math<S>* __restrict__ weight,
                    const Math<S>* __restrict__ bias, S* __restrict__ out, R* __restrict__ sum,
                    Math<S>* __restrict__ mean_out, Math<S>* __restrict__ rstd_out, int64_t C, double eps, bool rms) {
  using T = Math<S>;
  __shared__ T shared[kMaxThreads / 32];
  const int64_t row = blockIdx.x;
  const S* xr = x + row * C;
  const int per = per_thread<kPer>(C);
  T held[kPer > 0 ? kPer : 1] = {};
  // h as the norm reads it: x, or x + residual rounded to the stream's dtype (written by this thread in pass 1)
  auto h_at = [&](int k, int64_t j) -> T {
    if constexpr (kPer > 0) return held[k];
    return residual ? to_math(sum[row * C + j]) : to_math(xr[j]);
  };
  T acc[1] = {T(0)};
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j >= C) break;
    T h;
    if (residual) {
      const R rounded = from_math<R>(to_math(xr[j]) + to_math(residual[row * C + j]));
      sum[row * C + j] = rounded;
      h = to_math(rounded);
    } else {
      h = to_math(xr[j]);
    }
    if constexpr (kPer > 0) held[k] = h;
    acc[0] += rms ? h * h : h;
  }
  const T n = static_cast<T>(C);
  T mean = T(0), ms;
  block_sums(acc, shared);
  if (rms) {
    ms = acc[0] / n;
  } else {
    mean = acc[0] / n;
    T dev[1] = {T(0)};
#pragma unroll
    for (int k = 0; k < per; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j >= C) break;
      const T d = h_at(k, j) - mean;
      dev[0] += d * d;
    }
    block_sums(dev, shared);
    ms = dev[0] / n;
  }
  const T rstd = rsqrt_rn(ms + static_cast<T>(eps));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j >= C) break;
    T y = (h_at(k, j) - mean) * rstd;
    if (weight) y *= weight[j];
    if (bias) y += bias[j];
    out[row * C + j] = from_math<S>(y);
  }
}

// A block per chunk of rows_per_chunk rows, in row order. Its weight and bias gradient partials (this chunk's
// sums of grad * xhat and grad over its rows) are kept in registers when the row is held, else in the workspace.
template <typename S, typename R, int kPer>
__global__ void __launch_bounds__(kMaxThreads)
    norm_backward_kernel(const S* __restrict__ grad, const R* __restrict__ grad_sum, const R* __restrict__ h,
                         const Math<S>* __restrict__ mean, const Math<S>* __restrict__ rstd,
                         const Math<S>* __restrict__ weight, R* __restrict__ grad_h, Math<S>* __restrict__ partial_w,
                         Math<S>* __restrict__ partial_b, int64_t rows, int64_t C, int64_t rows_per_chunk) {
  using T = Math<S>;
  constexpr int kSlots = kPer > 0 ? kPer : 1;
  __shared__ T shared[2 * (kMaxThreads / 32)];
  const int64_t chunk = blockIdx.x;
  T* acc_w = partial_w ? partial_w + chunk * C : nullptr;
  T* acc_b = partial_b ? partial_b + chunk * C : nullptr;
  const int per = per_thread<kPer>(C);
  T held_weight[kSlots] = {}, held_w[kSlots] = {}, held_b[kSlots] = {}, held_g[kSlots] = {}, held_xhat[kSlots] = {};
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j >= C) break;
    if constexpr (kPer > 0) {
      held_weight[k] = weight ? weight[j] : T(1);
      held_w[k] = held_b[k] = T(0);
    } else {
      if (acc_w) acc_w[j] = T(0);
      if (acc_b) acc_b[j] = T(0);
    }
  }
  auto gw_of = [&](int k, int64_t j, T g) {
    if constexpr (kPer > 0) return weight ? mul_rn(g, held_weight[k]) : g;
    return weight ? mul_rn(g, weight[j]) : g;
  };
  const int64_t end = rows < (chunk + 1) * rows_per_chunk ? rows : (chunk + 1) * rows_per_chunk;
  const T n = static_cast<T>(C);
  for (int64_t row = chunk * rows_per_chunk; row < end; ++row) {
    const T mu = mean ? mean[row] : T(0), rs = rstd[row];
    auto g_at = [&](int k, int64_t j) -> T {
      if constexpr (kPer > 0) return held_g[k];
      return to_math(grad[row * C + j]);
    };
    auto xhat_at = [&](int k, int64_t j) -> T {
      if constexpr (kPer > 0) return held_xhat[k];
      return (to_math(h[row * C + j]) - mu) * rs;
    };
    T sums[2] = {T(0), T(0)};  // of grad * weight * xhat, of grad * weight
#pragma unroll
    for (int k = 0; k < per; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j >= C) break;
      const T g = to_math(grad[row * C + j]), xh = (to_math(h[row * C + j]) - mu) * rs;
      if constexpr (kPer > 0) held_g[k] = g, held_xhat[k] = xh;
      const T gw = gw_of(k, j, g);
      sums[0] += gw * xh;
      sums[1] += gw;
    }
    block_sums(sums, shared);
    const T a = sums[0] / n;
    const T b = mean ? sums[1] / n : T(0);
#pragma unroll
    for (int k = 0; k < per; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j >= C) break;
      const T xh = xhat_at(k, j), g = g_at(k, j);
      T d = rs * ((gw_of(k, j, g) - b) - xh * a);
      if (grad_sum) d += to_math(grad_sum[row * C + j]);
      grad_h[row * C + j] = from_math<R>(d);
      if constexpr (kPer > 0) {
        held_w[k] += g * xh;
        held_b[k] += g;
      } else {
        if (acc_w) acc_w[j] += g * xh;
        if (acc_b) acc_b[j] += g;
      }
    }
  }
  if constexpr (kPer > 0) {
#pragma unroll
    for (int k = 0; k < per; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j >= C) break;
      if (acc_w) acc_w[j] = held_w[k];
      if (acc_b) acc_b[j] = held_b[k];
    }
  }
}

// out[j] = sum over chunks of partial[chunk * C + j]. A block takes 32 columns (threadIdx.x); its kSumLanes rows
// of threads (threadIdx.y = y) each add the chunks y, y + kSumLanes, ... in order, then thread y = 0 adds those
// kSumLanes sums in y order: a fixed order, so every run gives the same bits.
template <typename T>
__global__ void __launch_bounds__(32 * kSumLanes)
    chunk_sum_kernel(const T* __restrict__ partial, T* __restrict__ out, int64_t chunks, int64_t C) {
  __shared__ T lane_sums[kSumLanes][33];
  const int64_t j = int64_t(blockIdx.x) * 32 + threadIdx.x;
  T s = T(0);
  if (j < C) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < chunks; k += kSumLanes) s += partial[k * C + j];
  }
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < C) {
    T total = T(0);
    for (int y = 0; y < kSumLanes; ++y) total += lane_sums[y][threadIdx.x];
    out[j] = total;
  }
}

// f(Type<S>{}, Type<R>{}) for the x dtype S and the stream dtype R (S, or float for 16-bit S).
template <typename F> cudaError_t visit_norm_dtypes(DType x, DType stream, F&& f) {
  return visit_dtype(x, [&](auto s_type) {
    using S = typename decltype(s_type)::type;
    if constexpr (std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>) {
      if (stream == DType::f32) return f(s_type, Type<float>{});
    }
    return f(s_type, s_type);
  });
}

// Threads per block: a power of two from 32 to kMaxThreads, up to kHeld elements of the row each.
int threads_for(int64_t C) {
  int t = 32;
  while (t < kMaxThreads && t * kHeld < C) t *= 2;
  return t;
}

// launch(std::integral_constant<int, kPer>) with kPer = kHeld where threads_for(C) threads hold the whole row,
// else 0 (the row re-read on each pass).
template <typename F> void with_held(int64_t C, F&& launch) {
  if (C <= int64_t(kHeld) * threads_for(C)) launch(std::integral_constant<int, kHeld>{});
  else launch(std::integral_constant<int, 0>{});
}

struct Chunks {
  int64_t count, rows;
};
Chunks backward_chunks(int64_t rows) {
  const int64_t per = ceil_div(rows, kBackwardChunks);
  return {ceil_div(rows, per), per};
}

}  // namespace

cudaError_t norm_fwd(DType x_dtype, DType stream, const void* x, const void* residual, const void* weight,
                     const void* bias, void* out, void* sum, void* mean, void* rstd, int64_t rows, int64_t C,
                     double eps, bool rms, cudaStream_t cuda_stream) {
  if (rows <= 0 || C <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return visit_norm_dtypes(x_dtype, stream, [&](auto s_type, auto r_type) {
    using S = typename decltype(s_type)::type;
    using R = typename decltype(r_type)::type;
    using T = Math<S>;
    with_held(C, [&](auto held) {
      FUSED_LAUNCH(unsigned(rows), threads_for(C), 0, cuda_stream, norm_fwd_kernel<S, R, decltype(held)::value>)(
          static_cast<const S*>(x), static_cast<const R*>(residual), static_cast<const T*>(weight),
          static_cast<const T*>(bias), static_cast<S*>(out), static_cast<R*>(sum), static_cast<T*>(mean),
          static_cast<T*>(rstd), C, eps, rms);
    });
    return cudaGetLastError();
  });
}

int64_t norm_backward_workspace(int64_t rows, int64_t C) {
  if (rows <= 0 || C <= 0) return 0;
  return backward_chunks(rows).count * C;
}

cudaError_t norm_backward(DType grad_dtype, DType stream, const void* grad, const void* grad_sum, const void* h,
                          const void* mean, const void* rstd, const void* weight, void* grad_h, void* grad_weight,
                          void* grad_bias, void* workspace_weight, void* workspace_bias, int64_t rows, int64_t C,
                          bool rms, cudaStream_t cuda_stream) {
  if (rows <= 0 || C <= 0) return cudaSuccess;
  const Chunks chunks = backward_chunks(rows);
  return visit_norm_dtypes(grad_dtype, stream, [&](auto s_type, auto r_type) {
    using S = typename decltype(s_type)::type;
    using R = typename decltype(r_type)::type;
    using T = Math<S>;
    T* pw = grad_weight ? static_cast<T*>(workspace_weight) : nullptr;
    T* pb = grad_bias ? static_cast<T*>(workspace_bias) : nullptr;
    with_held(C, [&](auto held) {
      FUSED_LAUNCH(unsigned(chunks.count), threads_for(C), 0, cuda_stream,
                   norm_backward_kernel<S, R, decltype(held)::value>)(
          static_cast<const S*>(grad), static_cast<const R*>(grad_sum), static_cast<const R*>(h),
          rms ? nullptr : static_cast<const T*>(mean), static_cast<const T*>(rstd), static_cast<const T*>(weight),
          static_cast<R*>(grad_h), pw, pb, rows, C, chunks.rows);
    });
    cudaError_t err = cudaGetLastError();
    const dim3 finish_grid(unsigned(ceil_div(C, 32))), finish_block(32, kSumLanes);
    for (auto [partial, result] : {std::pair<T*, void*>{pw, grad_weight}, std::pair<T*, void*>{pb, grad_bias}}) {
      if (err != cudaSuccess || partial == nullptr) continue;
      FUSED_LAUNCH(finish_grid, finish_block, 0, cuda_stream, chunk_sum_kernel<T>)(partial, static_cast<T*>(result),
                                                                                   chunks.count, C);
      err = cudaGetLastError();
    }
    return err;
  });
}

}  // namespace norm
}  // namespace cuda
}  // namespace fused
