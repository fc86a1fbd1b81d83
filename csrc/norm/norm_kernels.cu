// CUDA kernels of the norm family (launchers declared in norm_kernels.h), torch-free. A block takes a whole row
// (forward) or a chunk of rows (backward); its threads stride over the row's columns with coalesced accesses and
// re-read the row from L1/L2 for each pass (the statistics, then the outputs). Block sums: a warp butterfly, then
// the warps' sums added in warp order by every thread, so every run adds in the same order. Each thread reads back
// only elements it wrote itself.
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

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sum of v over the block, the same value in every thread; `shared` holds one T per warp.
template <typename T> __device__ T block_sum(T v, T* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += shared[w];
  __syncthreads();  // shared is reused by the next call
  return total;
}

template <typename T> __device__ __forceinline__ T rsqrt_rn(T v) { return T(1) / sqrt(v); }  // as the CPU kernel

// grad * weight rounded on its own, as in the row's sum of them: nvcc would contract gw - mean(gw) into one fma with
// the product unrounded, and the two would no longer cancel (a row of one element, whose exact gradient is 0, would
// get the product's rounding error times rstd).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename S, typename R>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd_kernel(const S* __restrict__ x, const R* __restrict__ residual, const Math<S>* __restrict__ weight,
                    const Math<S>* __restrict__ bias, S* __restrict__ out, R* __restrict__ sum,
                    Math<S>* __restrict__ mean_out, Math<S>* __restrict__ rstd_out, int64_t C, double eps, bool rms) {
  using T = Math<S>;
  __shared__ T shared[kMaxThreads / 32];
  const int64_t row = blockIdx.x;
  const S* xr = x + row * C;
  // h as the norm reads it: x, or x + residual rounded to the stream's dtype (written by this thread in pass 1)
  auto h_at = [&](int64_t j) -> T { return residual ? to_math(sum[row * C + j]) : to_math(xr[j]); };
  T acc = T(0);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    T h;
    if (residual) {
      const R rounded = from_math<R>(to_math(xr[j]) + to_math(residual[row * C + j]));
      sum[row * C + j] = rounded;
      h = to_math(rounded);
    } else {
      h = to_math(xr[j]);
    }
    acc += rms ? h * h : h;
  }
  const T n = static_cast<T>(C);
  T mean = T(0), ms;
  if (rms) {
    ms = block_sum(acc, shared) / n;
  } else {
    mean = block_sum(acc, shared) / n;
    T dev = T(0);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T d = h_at(j) - mean;
      dev += d * d;
    }
    ms = block_sum(dev, shared) / n;
  }
  const T rstd = rsqrt_rn(ms + static_cast<T>(eps));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    T y = (h_at(j) - mean) * rstd;
    if (weight) y *= weight[j];
    if (bias) y += bias[j];
    out[row * C + j] = from_math<S>(y);
  }
}

template <typename S, typename R>
__global__ void __launch_bounds__(kMaxThreads)
    norm_backward_kernel(const S* __restrict__ grad, const R* __restrict__ grad_sum, const R* __restrict__ h,
                         const Math<S>* __restrict__ mean, const Math<S>* __restrict__ rstd,
                         const Math<S>* __restrict__ weight, R* __restrict__ grad_h, Math<S>* __restrict__ partial_w,
                         Math<S>* __restrict__ partial_b, int64_t rows, int64_t C, int64_t rows_per_chunk) {
  using T = Math<S>;
  __shared__ T shared[kMaxThreads / 32];
  const int64_t chunk = blockIdx.x;
  T* acc_w = partial_w ? partial_w + chunk * C : nullptr;
  T* acc_b = partial_b ? partial_b + chunk * C : nullptr;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    if (acc_w) acc_w[j] = T(0);
    if (acc_b) acc_b[j] = T(0);
  }
  const int64_t end = rows < (chunk + 1) * rows_per_chunk ? rows : (chunk + 1) * rows_per_chunk;
  const T n = static_cast<T>(C);
  for (int64_t row = chunk * rows_per_chunk; row < end; ++row) {
    const T mu = mean ? mean[row] : T(0), rs = rstd[row];
    auto xhat_at = [&](int64_t j) { return (to_math(h[row * C + j]) - mu) * rs; };
    auto gw_at = [&](int64_t j) {
      const T g = to_math(grad[row * C + j]);
      return weight ? mul_rn(g, weight[j]) : g;
    };
    T sum_gw_xhat = T(0), sum_gw = T(0);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T gw = gw_at(j);
      sum_gw_xhat += gw * xhat_at(j);
      sum_gw += gw;
    }
    const T a = block_sum(sum_gw_xhat, shared) / n;
    const T b = mean ? block_sum(sum_gw, shared) / n : T(0);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const T xh = xhat_at(j), g = to_math(grad[row * C + j]);
      T d = rs * ((gw_at(j) - b) - xh * a);
      if (grad_sum) d += to_math(grad_sum[row * C + j]);
      grad_h[row * C + j] = from_math<R>(d);
      if (acc_w) acc_w[j] += g * xh;
      if (acc_b) acc_b[j] += g;
    }
  }
}

// out[j] = sum over chunks of partial[chunk * C + j], in chunk order.
template <typename T>
__global__ void __launch_bounds__(256)
    chunk_sum_kernel(const T* __restrict__ partial, T* __restrict__ out, int64_t chunks, int64_t C) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < C; j += int64_t(gridDim.x) * blockDim.x) {
    T s = T(0);
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * C + j];
    out[j] = s;
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

// Threads per block: a power of two from 32 to kMaxThreads, about 8 elements of the row each.
int threads_for(int64_t C) {
  int t = 32;
  while (t < kMaxThreads && t * 8 < C) t *= 2;
  return t;
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
    FUSED_LAUNCH(unsigned(rows), threads_for(C), 0, cuda_stream, norm_fwd_kernel<S, R>)(
        static_cast<const S*>(x), static_cast<const R*>(residual), static_cast<const T*>(weight),
        static_cast<const T*>(bias), static_cast<S*>(out), static_cast<R*>(sum), static_cast<T*>(mean),
        static_cast<T*>(rstd), C, eps, rms);
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
    FUSED_LAUNCH(unsigned(chunks.count), threads_for(C), 0, cuda_stream, norm_backward_kernel<S, R>)(
        static_cast<const S*>(grad), static_cast<const R*>(grad_sum), static_cast<const R*>(h),
        rms ? nullptr : static_cast<const T*>(mean), static_cast<const T*>(rstd), static_cast<const T*>(weight),
        static_cast<R*>(grad_h), pw, pb, rows, C, chunks.rows);
    cudaError_t err = cudaGetLastError();
    const unsigned finish_blocks = unsigned(ceil_div(C, 256) < 65535 ? ceil_div(C, 256) : 65535);
    for (auto [partial, result] : {std::pair<T*, void*>{pw, grad_weight}, std::pair<T*, void*>{pb, grad_bias}}) {
      if (err != cudaSuccess || partial == nullptr) continue;
      FUSED_LAUNCH(finish_blocks, 256, 0, cuda_stream, chunk_sum_kernel<T>)(partial, static_cast<T*>(result),
                                                                            chunks.count, C);
      err = cudaGetLastError();
    }
    return err;
  });
}

}  // namespace norm
}  // namespace cuda
}  // namespace fused
