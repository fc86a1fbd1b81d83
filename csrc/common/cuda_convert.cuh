// Storage types in CUDA kernels: the dtype code to its C++ type (visit_dtype), conversions to and from the math
// type (float for fp32/fp16/bf16 storage, double for double; rounding back to 16 bits is round-to-nearest-even),
// and the launch-limit helpers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_host.h"  // __fmul_rn and the rest on the host
#include "common/dtype.h"

namespace fused {

template <typename S> struct Type {
  using type = S;
};

// fn(Type<S>{}) with S the storage type of `dtype` (float, __half, __nv_bfloat16, double).
template <typename F> cudaError_t visit_dtype(DType dtype, F&& fn) {
  switch (dtype) {
    case DType::f32: return fn(Type<float>{});
    case DType::f16: return fn(Type<__half>{});
    case DType::bf16: return fn(Type<__nv_bfloat16>{});
    case DType::f64: return fn(Type<double>{});
  }
  return cudaErrorInvalidValue;
}

template <typename T> struct MathType {
  using type = float;
};
template <> struct MathType<double> {
  using type = double;
};

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

// a * b rounded on its own, where nvcc would otherwise fuse it with a following add into one FMA (for results
// that must have the CPU kernels' bits).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// Grid dimensions y and z stop at 65535 blocks: launches over more run in slices.
constexpr int64_t kMaxGridYZ = 65535;

// launch(first, count) -> cudaError_t over [0, total) in slices of at most kMaxGridYZ; stops at the first error,
// returned by launch or left by the kernels it launched.
template <typename F> cudaError_t for_grid_slices(int64_t total, const F& launch) {
  for (int64_t first = 0; first < total; first += kMaxGridYZ) {
    cudaError_t err = launch(first, total - first < kMaxGridYZ ? total - first : kMaxGridYZ);
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace fused
