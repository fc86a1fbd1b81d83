// What a family's CUDA binding (<family>_cuda.cpp) wraps around its torch-free launchers: the device check, the
// dtype code, the current stream and the launch check. Messages name the op and the argument, as the CPU
// kernels' checks do. Included by *_cuda.cpp only (torch's CUDA headers).
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/dtype.h"

namespace fused {

inline void check_cuda(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "fused.", op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
}

// The kernels' dtype code of t; the kernels take float32, float16, bfloat16 and float64.
inline DType dtype_of(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kDouble: return DType::f64;
    default:
      TORCH_CHECK(false, "fused.", op, ": ", name, " has dtype ", dtype_name(t.scalar_type()),
                  "; expected float32, float16, bfloat16 or float64");
  }
}

// Fails with the op's name when a launcher (or the CUDA call before it) returned an error.
inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "fused.", op, ": CUDA error: ", cudaGetErrorString(err));
}

// What a binding does before it launches on t's device: t must be a CUDA tensor with a kernel dtype; `guard`
// keeps t's device current until the binding returns.
struct CudaInput {
  DType dtype;
  c10::cuda::CUDAGuard guard;
};
inline CudaInput cuda_input(const char* op, const char* name, const at::Tensor& t) {
  check_cuda(op, name, t);
  return {dtype_of(op, name, t), c10::cuda::CUDAGuard(t.device())};
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace fused
