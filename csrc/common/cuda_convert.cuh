// Conversions between storage types and the math type in CUDA kernels: float for fp32/fp16/bf16 storage,
// double for double. Rounding back to 16 bits is round-to-nearest-even.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fused {

template <typename T> struct MathType { using type = float; };
template <> struct MathType<double> { using type = double; };

__device__ __forceinline__ float to_math(float v) { return v; }
__device__ __forceinline__ double to_math(double v) { return v; }
__device__ __forceinline__ float to_math(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_math(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_math(float v);
template <> __device__ __forceinline__ float from_math<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_math<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_math<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_math(double v) { return static_cast<T>(v); }

}  // namespace fused
