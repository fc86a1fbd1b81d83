// Conversion of CPU storage types into the math type, vectorised where at::vec::convert is not (it widens 16-bit
// types one element at a time). The CPU counterpart of cuda_convert.cuh.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "common/cpu_utils.h"

namespace fused {

// n elements of src into dst; 16-bit into float with at::vec's vector conversion.
template <typename scalar_t, typename T> inline void widen_block(const scalar_t* src, T* dst, int64_t n) {
  constexpr bool is_16bit = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
  if constexpr (std::is_same_v<T, float> && is_16bit) {
    using VL = Vec<scalar_t>;
    int64_t i = 0;
    for (; i + VL::size() <= n; i += VL::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VL::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec<float>::size());
    }
    for (; i < n; ++i) dst[i] = float(src[i]);
  } else {
    load_block(src, dst, n);
  }
}

}  // namespace fused
