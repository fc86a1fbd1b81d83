// The code tables shared by the C++ and CUDA kernels: activations, unary_chain ops, distance metrics. Each table is
// one list below; the enum, the names (parse.cpp; fused._C exports them, and fused/_codes.py builds Python's
// codes from them) and the visitor that turns a runtime code into a compile-time one all come from it. A new
// entry goes at the end of its list (Triton kernels take the codes by name from fused/_codes.py).
#pragma once
#include <cstdint>

#include "common/host_device.h"

// Activations of bias_act, glu, linear_act (formulas: pointwise_math.h act_fwd / act_grad).
#define FUSED_ACTS(X) X(identity) X(relu) X(gelu) X(gelu_tanh) X(silu) X(sigmoid) X(tanh)
// Ops of unary_chain without a scalar, then those with one (formulas: pointwise_math.h unary_fwd / unary_grad).
// clang-format off
#define FUSED_UNARY_OPS(X) \
  X(neg) X(abs) X(square) X(sqrt) X(rsqrt) X(exp) X(log) X(sin) X(cos) X(tanh) X(sigmoid) X(relu) X(gelu) \
  X(gelu_tanh) X(silu) X(reciprocal)
// clang-format on
#define FUSED_SCALAR_OPS(X) X(add) X(mul) X(pow) X(clamp_min) X(clamp_max)
#define FUSED_CHAIN_OPS(X) FUSED_UNARY_OPS(X) FUSED_SCALAR_OPS(X)
// Distance metrics by p: 0, 1, 2, inf specialised, any other p >= 0 general (distance/distance_math.h).
#define FUSED_METRICS(X) X(P0) X(P1) X(P2) X(PInf) X(PGen)

namespace fused {

// The compile-time code a visitor hands to its callback: decltype(tag)::value.
template <typename T, T v> struct Tag {
  static constexpr T value = v;
};

#define FUSED_CODE_ENTRY(name) name,
#define FUSED_CODE_NAME(name) #name,
#define FUSED_CODE_CASE(name) \
  case Code::name: return fn(Tag<Code, Code::name>{});

// enum class Enum from TABLE, its names k<Enum>Names, and visit(code, fn) -> fn(Tag<Enum, code>{}) (a code out of
// range visits the first entry).
#define FUSED_CODE_TABLE(Enum, visit, TABLE)                             \
  enum class Enum : int32_t { TABLE(FUSED_CODE_ENTRY) };                 \
  constexpr const char* k##Enum##Names[] = {TABLE(FUSED_CODE_NAME)};     \
  constexpr int k##Enum##Count = sizeof(k##Enum##Names) / sizeof(char*); \
  template <typename Fn> FUSED_HD auto visit(Enum code, Fn&& fn) {       \
    using Code = Enum;                                                   \
    switch (code) {                                                      \
      default: TABLE(FUSED_CODE_CASE)                                    \
    }                                                                    \
  }

FUSED_CODE_TABLE(Act, visit_act, FUSED_ACTS)
FUSED_CODE_TABLE(UnaryOp, visit_unary, FUSED_CHAIN_OPS)
FUSED_CODE_TABLE(Metric, visit_metric, FUSED_METRICS)

// unary_chain ops from kFirstScalarOp on take a scalar.
#define FUSED_COUNT(name) +1
constexpr int kFirstScalarOp = 0 FUSED_UNARY_OPS(FUSED_COUNT);
#undef FUSED_COUNT

constexpr int kMaxChain = 64;    // ops per unary_chain call handled by one CUDA launch
constexpr int kMaxSelect = 256;  // neighbours per row the CUDA C++ select kernel (pairwise_topk) keeps

}  // namespace fused
