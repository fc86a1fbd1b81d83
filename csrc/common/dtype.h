// The storage dtype of a CUDA kernel's tensors, torch-free: a binding maps at::ScalarType to it (dtype_of in
// common/cuda_binding.h), a kernel maps it to a C++ type (visit_dtype in common/cuda_convert.cuh).
#pragma once
#include <cstdint>

namespace fused {

enum class DType : int32_t { f32, f16, bf16, f64 };

}  // namespace fused
