// Activation and pointwise-op codes shared by the C++ and CUDA kernels. fused/_codes.py mirrors them for Triton.
#pragma once
#include <cstdint>

namespace fused {

enum class Act : int32_t { identity = 0, relu, gelu, gelu_tanh, silu, sigmoid, tanh };

// Ops of unary_chain; those from kAdd on take a scalar.
enum class UnaryOp : int32_t {
  neg = 0, abs, square, sqrt, rsqrt, exp, log, sin, cos, tanh, sigmoid, relu, gelu, gelu_tanh, silu, reciprocal,
  add, mul, pow, clamp_min, clamp_max
};

constexpr int kMaxChain = 64;  // ops per unary_chain call handled by one CUDA launch

}  // namespace fused
