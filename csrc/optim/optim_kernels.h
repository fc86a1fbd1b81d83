// CUDA kernels of the fused optimizer family (torch-free: the binding is optim_cuda.cpp). Multi-tensor apply:
// every list of tensors is described once in device memory (pointers, sizes, dtypes, a chunk table), so one launch
// covers any number of tensors with no 4 KB kernel-argument limit; the kernel argument is a few pointers.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "optim/rounding_keys.h"

namespace fused {
namespace optim_cuda {

// A tensor's dtype code, one byte packed into the device metadata: common/dtype.h's DType in the low two bits
// (kDTypeBits), the flags below or'ed in.
constexpr uint8_t kF32 = uint8_t(DType::f32), kF16 = uint8_t(DType::f16), kBF16 = uint8_t(DType::bf16),
                  kF64 = uint8_t(DType::f64);
constexpr uint8_t kDTypeBits = 0x03;
static_assert(uint8_t(DType::f64) <= kDTypeBits, "every DType fits in kDTypeBits");
// or'ed into an Adam tensor's dtype: bf16 state (fused.optim state_dtype=torch.bfloat16) whatever the parameter's
// dtype, rounded stochastically on every write when AdamArgs::state_stochastic (the CPU kernel's half-word scheme:
// store_state4 in optim_kernels.cu).
constexpr uint8_t kBF16State = 0x04;
// or'ed into an Adam tensor's dtype: 8-bit state (fused.optim state_dtype="int8"): exp_avg int8 codes, exp_avg_sq
// (and max_exp_avg_sq) uint8 codes, each with float32 scales per kQuantBlock elements in the scale lists (see
// launch_adam_step). The code maps are csrc/optim/quantize_cpu.h's; the kernel writes the CPU kernel's bits.
constexpr uint8_t kInt8State = 0x08;
constexpr int kQuantBlock = 256;
constexpr uint8_t kAligned = 0x10;  // or'ed into a dtype: every pointer of the tensor is 16-byte aligned
// or'ed into a dtype: master weights. The dtype is the gradient's and the model parameter's (the last list); the
// parameter (list 0, the fp32 master) and the state are float32.
constexpr uint8_t kMaster = 0x20;
constexpr uint8_t kF32State = 0x40;  // or'ed into a 16-bit parameter's dtype: its state is float32
constexpr uint8_t kF32Grad = 0x80;   // or'ed into a 16-bit dtype: the gradient is float32 (accumulated sums)
constexpr int64_t kChunk = 65536;    // elements per chunk (a block's unit of work)
constexpr int kMaxBlocks = 1024;     // grid size cap: the number of per-block partial slots
constexpr int kThreads = 512;

// Device-resident description of K parallel lists of n tensors (params, grads, state...), cut into chunks.
struct TensorLists {
  void* const* ptrs;            // [K][n]
  const int64_t* numel;         // [n]
  const uint8_t* dtype;         // [n]
  float* const* steps;          // [n] float32 step counters, or nullptr
  const int32_t* chunk_tensor;  // [chunks]
  const int64_t* chunk_start;   // [chunks]
  const double* hyper;          // [n][hyper_width] per-tensor hyperparameters (several param groups), or nullptr
  int num_lists, num_tensors, num_chunks, hyper_width;
};

// Scratch that persists across launches on one device: pass 1's per-block partials (fixed slots, fp64), a
// non-finite flag, and the two "last block" tickets. Zero it once; the kernels leave it zeroed.
struct Workspace {
  double* partials;   // [kMaxBlocks]
  int* nonfinite;     // [1]
  unsigned* tickets;  // [2]: grad_norm, update
};
constexpr size_t kWorkspaceBytes = kMaxBlocks * sizeof(double) + 4 * sizeof(int);

// ---- host-side packing of the metadata (one buffer, copied to the device once and cached by the binding) ----
struct ListsLayout {
  size_t ptrs, numel, dtype, steps, chunk_tensor, chunk_start, hyper, bytes;
  int num_lists, num_tensors, num_chunks, hyper_width;
};

inline int64_t count_chunks(const std::vector<int64_t>& numel) {
  int64_t c = 0;
  for (int64_t n : numel) c += (n + kChunk - 1) / kChunk;
  return c;
}

inline ListsLayout lists_layout(int num_lists, const std::vector<int64_t>& numel, bool with_steps,
                                int hyper_width = 0) {
  auto align = [](size_t x) { return (x + 15) / 16 * 16; };
  ListsLayout l{};
  l.num_lists = num_lists;
  l.num_tensors = (int)numel.size();
  l.num_chunks = (int)count_chunks(numel);
  l.hyper_width = hyper_width;
  size_t off = 0;
  l.ptrs = off;
  off = align(off + sizeof(void*) * num_lists * l.num_tensors);
  l.numel = off;
  off = align(off + sizeof(int64_t) * l.num_tensors);
  l.steps = off;
  off = align(off + (with_steps ? sizeof(float*) * l.num_tensors : 0));
  l.chunk_tensor = off;
  off = align(off + sizeof(int32_t) * l.num_chunks);
  l.chunk_start = off;
  off = align(off + sizeof(int64_t) * l.num_chunks);
  l.hyper = off;
  off = align(off + sizeof(double) * hyper_width * l.num_tensors);
  l.dtype = off;
  off = align(off + l.num_tensors);
  l.bytes = std::max<size_t>(off, 16);
  return l;
}

// ptrs[k][i]: list k, tensor i. dtype[i] already or'ed with kAligned where it applies. hyper: [n][hyper_width].
inline void pack_lists(uint8_t* host, const ListsLayout& l, const std::vector<std::vector<void*>>& ptrs,
                       const std::vector<int64_t>& numel, const std::vector<uint8_t>& dtype,
                       const std::vector<float*>& steps, const std::vector<double>& hyper = {}) {
  if (!hyper.empty()) std::memcpy(host + l.hyper, hyper.data(), sizeof(double) * hyper.size());
  auto* p = reinterpret_cast<void**>(host + l.ptrs);
  for (int k = 0; k < l.num_lists; ++k)
    for (int i = 0; i < l.num_tensors; ++i) p[k * l.num_tensors + i] = ptrs[k][i];
  std::memcpy(host + l.numel, numel.data(), sizeof(int64_t) * l.num_tensors);
  std::memcpy(host + l.dtype, dtype.data(), l.num_tensors);
  if (!steps.empty()) std::memcpy(host + l.steps, steps.data(), sizeof(float*) * l.num_tensors);
  auto* ct = reinterpret_cast<int32_t*>(host + l.chunk_tensor);
  auto* cs = reinterpret_cast<int64_t*>(host + l.chunk_start);
  int c = 0;
  for (int i = 0; i < l.num_tensors; ++i)
    for (int64_t s = 0; s < numel[i]; s += kChunk, ++c) {
      ct[c] = i;
      cs[c] = s;
    }
}

inline TensorLists lists_at(const uint8_t* device, const ListsLayout& l, bool with_steps) {
  return {reinterpret_cast<void* const*>(device + l.ptrs),
          reinterpret_cast<const int64_t*>(device + l.numel),
          device + l.dtype,
          with_steps ? reinterpret_cast<float* const*>(device + l.steps) : nullptr,
          reinterpret_cast<const int32_t*>(device + l.chunk_tensor),
          reinterpret_cast<const int64_t*>(device + l.chunk_start),
          l.hyper_width ? reinterpret_cast<const double*>(device + l.hyper) : nullptr,
          l.num_lists,
          l.num_tensors,
          l.num_chunks,
          l.hyper_width};
}

inline Workspace workspace_at(void* device) {
  auto* d = static_cast<double*>(device);
  auto* i = reinterpret_cast<int*>(d + kMaxBlocks);
  return {d, i, reinterpret_cast<unsigned*>(i + 1)};
}

// ---- launchers: every scalar that changes on the device (scale, found_inf, clip coefficient) is a pointer ----
enum class Norm { L2, L1, Inf, P };

// grads: K = 1. found_in, grad_scale may be null. fp64: accumulate in double (some gradient is float64), else in
// float; the partials are added in double either way. Writes norm_out (dtype code norm_dtype; the fp64 accumulator
// when !finish), coef_out (fp64, when finish), found_out (1 or 0).
cudaError_t launch_grad_norm(const TensorLists& grads, Workspace ws, const float* found_in, const float* grad_scale,
                             Norm norm, double p, double max_norm, double clip_value, bool fp64, bool finish,
                             void* norm_out, uint8_t norm_dtype, double* coef_out, float* found_out, int num_sms,
                             cudaStream_t stream);

cudaError_t launch_scale_grads(const TensorLists& grads, const double* coef, int num_sms, cudaStream_t stream);

// The device scalars an update reads: pass 1's clip coefficient (fp64), the scaler's scale (null: 1) and
// found_inf (set: the whole update is skipped).
struct StepScalars {
  const double* coef;
  const float* grad_scale;
  const float* found_inf;
};

// Hyperparameters in double: float64 parameters are updated with them exactly; other math types round them once.
struct SgdArgs {
  double lr, momentum, dampening, weight_decay, clip_value;
  bool nesterov, maximize, use_momentum;
  bool stochastic;  // bf16 params rounded stochastically with sr_seed
  uint64_t sr_seed;
  bool write_grads;  // store the unscaled, clipped gradient back into list 1
};
// lists: params, grads[, momentum buffers][, model params with kMaster]; steps when use_momentum.
// lists.hyper (width 4): per-tensor lr, momentum, dampening, weight_decay in place of args'.
cudaError_t launch_sgd_step(const TensorLists& lists, Workspace ws, SgdArgs args, StepScalars scalars, int num_sms,
                            cudaStream_t stream);

struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay, clip_value;
  bool amsgrad, decoupled, maximize;
  bool stochastic;
  uint64_t sr_seed;
  bool write_grads;
  bool codes;             // some tensor has kInt8State (then no bf16 moments, but for bf16 params without a seed)
  bool bf16_state;        // some tensor has kBF16State
  bool state_stochastic;  // bf16 moments, or exp_avg_sq's 8-bit codes, rounded stochastically with state_seed
  uint64_t state_seed;
};
// lists: params, grads, exp_avgs, exp_avg_sqs[, max_exp_avg_sqs][, their scales in the same order, where some
// tensor has kInt8State][, model params with kMaster]; steps always. The scales of a tensor without kInt8State
// are not read. lists.hyper (width 5): per-tensor lr, beta1, beta2, eps, weight_decay in place of args'.
cudaError_t launch_adam_step(const TensorLists& lists, Workspace ws, AdamArgs args, StepScalars scalars, int num_sms,
                             cudaStream_t stream);

// lists: accs (float32, float64 for float64 grads), grads (dtype code). accs += grads, or accs = grads.
cudaError_t launch_accumulate_grads(const TensorLists& lists, bool overwrite, int num_sms, cudaStream_t stream);

}  // namespace optim_cuda
}  // namespace fused
