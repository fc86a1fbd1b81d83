// Argument checks shared by the optimizer CPU kernels and the CUDA binding: every message names the op and the
// argument. `device` is the call's device: the CPU for the CPU kernels, the first tensor's GPU for CUDA.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/registration.h"

// The family's ops, each registered from <family>_cpu.cpp and <family>_cuda.cpp (common/registration.h).
#define FUSED_OPTIM_OPS(X)       \
  X("grad_norm", grad_norm)      \
  X("scale_grads_", scale_grads) \
  X("sgd_step_", sgd_step)       \
  X("adam_step_", adam_step)     \
  X("accumulate_grads_", accumulate_grads)

namespace fused {

// A `Tensor[]?` argument of a schema; none reads as an empty list.
using OptionalTensorList = std::optional<at::TensorList>;
inline at::TensorList or_empty(const OptionalTensorList& ts) { return ts ? *ts : at::TensorList(); }

inline bool is_16bit(const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// The dtype of the norm grad_norm returns, as torch's clip_grad_norm_ returns it: the gradients' promoted dtype
// (float32 for none). The norm itself is accumulated in fp32 (fp64 for fp64 gradients) and added up in fp64.
inline at::ScalarType norm_dtype(at::TensorList grads) {
  at::ScalarType t = grads.empty() ? at::kFloat : grads[0].scalar_type();
  for (const auto& g : grads) t = c10::promoteTypes(t, g.scalar_type());
  return t;
}

// The kernels walk every tensor as flat memory: it must cover its elements exactly, in any dimension order (a
// strided view such as t[:, :5] has gaps, an expanded tensor overlaps itself). The optimizers and
// fused.clip_grad_norm_ pass other layouts through a dense copy.
inline void check_dense(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "fused.", op, ": ", name, " must be dense in memory (no gaps, no ",
              "overlap), got sizes ", t.sizes(), " and strides ", t.strides());
}

// One tensor of a call: strided (not sparse), on the call's device, dense in memory.
inline void check_on(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.layout() == at::kStrided, "fused.", op, ": sparse ", name, " are not supported");
  TORCH_CHECK(t.device() == device, "fused.", op, ": all tensors of one call must be on one device; ", name, " is on ",
              t.device(), ", not ", device);
  check_dense(op, name, t);
}

// Floating-point tensors of the call (the gradients of a norm, the parameters of an update).
inline void check_floating_list(const char* op, const char* name, at::TensorList ts, const at::Device& device) {
  for (const auto& t : ts) {
    check_on(op, name, t, device);
    check_floating(op, name, t);
  }
}

// A scalar argument: one element of `dtype` on the call's device (found_inf, grad_scale and steps are float32,
// clip_coef float64).
inline void check_scalar(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                         at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.numel() == 1, "fused.", op, ": ", name,
              " must be a ", dtype_name(dtype), " tensor with one element on ", device, ", got ", t.scalar_type(), " ",
              t.sizes(), " on ", t.device());
}

inline void check_steps(const char* op, at::TensorList steps, size_t n, const at::Device& device) {
  TORCH_CHECK(steps.size() == n, "fused.", op, ": steps has ", steps.size(), " tensors but params has ", n);
  for (const auto& s : steps) check_scalar(op, "steps", s, device);
}

// ts[i] alongside params[i] (gradients, state): on its device, with its shape and strides, and its dtype, or
// float32 for 16-bit params (accumulated gradients, fp32 state), or (low_bit) a dtype the caller has checked.
inline void check_alongside(const char* op, const char* name, size_t i, const at::Tensor& t, const at::Tensor& param,
                            bool low_bit = false) {
  check_on(op, name, t, param.device());
  TORCH_CHECK(low_bit || t.scalar_type() == param.scalar_type() || (is_16bit(param) && t.scalar_type() == at::kFloat),
              "fused.", op, ": ", name, "[", i, "] has dtype ", t.scalar_type(), " but params[", i, "] has ",
              param.scalar_type(), " (float32 is allowed only with 16-bit params)");
  TORCH_CHECK(t.sizes() == param.sizes() && t.strides() == param.strides(), "fused.", op, ": ", name, "[", i,
              "] must have the shape and strides of params[", i, "], got ", t.sizes(), " vs ", param.sizes());
}

inline void check_count(const char* op, const char* name, at::TensorList ts, at::TensorList params) {
  TORCH_CHECK(ts.size() == params.size(), "fused.", op, ": ", name, " has ", ts.size(), " tensors but params has ",
              params.size());
}

inline void check_list(const char* op, const char* name, at::TensorList ts, at::TensorList params) {
  check_count(op, name, ts, params);
  for (size_t i = 0; i < ts.size(); ++i) check_alongside(op, name, i, ts[i], params[i]);
}

// Adam's state tensors ts (alongside params) may also be low-bit (fused.optim state_dtype): bfloat16 for any
// param but a float64 one, or `code` (int8 for exp_avgs, uint8 for exp_avg_sqs) with float32 scales[i] of
// ceil(numel / 256) elements on its device.
inline void check_state_list(const char* op, const char* name, at::TensorList ts, at::TensorList params,
                             at::ScalarType code, at::TensorList scales) {
  check_count(op, name, ts, params);
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto dtype = ts[i].scalar_type();
    const bool low_bit = params[i].scalar_type() != at::kDouble && (dtype == at::kBFloat16 || dtype == code);
    check_alongside(op, name, i, ts[i], params[i], low_bit);
    if (dtype != code) continue;
    TORCH_CHECK(scales.size() == params.size(), "fused.", op, ": ", name, "[", i,
                "] holds 8-bit codes but the scales list has ", scales.size(), " tensors, not ", params.size());
    const int64_t blocks = (ts[i].numel() + 255) / 256;
    const auto& s = scales[i];
    TORCH_CHECK(
        s.device() == ts[i].device() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == blocks,
        "fused.", op, ": the scales of ", name, "[", i, "] must be a contiguous float32 tensor of ", blocks,
        " elements on ", ts[i].device(), ", got ", s.scalar_type(), " ", s.sizes(), " on ", s.device());
  }
}

// The gradients of an update: alongside params, or, with master weights (model given), params are the fp32
// masters and the gradients come alongside the 16-bit model params (in their dtype, or float32 accumulated).
inline void check_update_lists(const char* op, at::TensorList params, at::TensorList grads, at::TensorList model) {
  if (model.empty()) {
    check_list(op, "grads", grads, params);
    return;
  }
  for (const auto& p : params)
    TORCH_CHECK(p.scalar_type() == at::kFloat, "fused.", op,
                ": with model_params, params (the master weights) "
                "must be float32, got ",
                p.scalar_type());
  TORCH_CHECK(model.size() == params.size(), "fused.", op, ": model_params has ", model.size(),
              " tensors but params has ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_on(op, "model_params", model[i], params[i].device());
    TORCH_CHECK(model[i].sizes() == params[i].sizes() && model[i].strides() == params[i].strides(), "fused.", op,
                ": model_params[", i, "] must have the shape and strides of params[", i, "]");
  }
  check_list(op, "grads", grads, model);
}

// accumulate_grads_: accs (float32, float64 for float64 grads) alongside the grads, on the call's device.
inline void check_accumulate(const char* op, at::TensorList accs, at::TensorList grads, const at::Device& device) {
  TORCH_CHECK(accs.size() == grads.size(), "fused.", op, ": accs has ", accs.size(), " tensors but grads has ",
              grads.size());
  check_floating_list(op, "grads", grads, device);
  for (size_t i = 0; i < accs.size(); ++i) {
    check_on(op, "accs", accs[i], device);
    const auto want = grads[i].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    TORCH_CHECK(accs[i].scalar_type() == want, "fused.", op, ": accs[", i, "] must be ", want, " for ",
                grads[i].scalar_type(), " grads, got ", accs[i].scalar_type());
    TORCH_CHECK(accs[i].sizes() == grads[i].sizes() && accs[i].strides() == grads[i].strides(), "fused.", op, ": accs[",
                i, "] must have the shape and strides of grads[", i, "]");
  }
}

// The stochastic-rounding seed: an int64 CPU scalar, read on the host (no device sync); none without sr_seed.
inline std::optional<uint64_t> seed_value(const char* op, const std::optional<at::Tensor>& sr_seed,
                                          const char* name = "sr_seed") {
  if (!sr_seed) return std::nullopt;
  TORCH_CHECK(sr_seed->device().is_cpu() && sr_seed->scalar_type() == at::kLong && sr_seed->numel() == 1, "fused.", op,
              ": ", name, " must be an int64 tensor with one element on the CPU");
  return uint64_t(sr_seed->item<int64_t>());
}

// Per-tensor hyperparameters: row i of `hyper` (float64 [n, H] on the CPU: every param group in one call) where
// given, else the scalar arguments for every tensor.
template <size_t H>
std::vector<std::array<double, H>> hyper_rows(const char* op, const std::optional<at::Tensor>& hyper, size_t n,
                                              const std::array<double, H>& scalars) {
  std::vector<std::array<double, H>> rows(n, scalars);
  if (!hyper) return rows;
  TORCH_CHECK(hyper->device().is_cpu() && hyper->scalar_type() == at::kDouble && hyper->dim() == 2 &&
                  hyper->size(0) == int64_t(n) && hyper->size(1) == int64_t(H),
              "fused.", op, ": hyper must be a float64 CPU tensor of shape [", n, ", ", H, "], got ",
              hyper->scalar_type(), " ", hyper->sizes(), " on ", hyper->device());
  const auto table = hyper->contiguous();
  const double* h = table.const_data_ptr<double>();
  for (size_t i = 0; i < n; ++i) std::copy(h + i * H, h + (i + 1) * H, rows[i].begin());
  return rows;
}

inline void check_nonneg(const char* op, const char* name, double v) {
  TORCH_CHECK(v >= 0, "fused.", op, ": ", name, " must be >= 0, got ", v);
}

// grad_norm's numbers: norm_type > 0 (inf included), max_norm and clip_value >= 0.
inline void check_norm_args(const char* op, double norm_type, double max_norm, double clip_value) {
  TORCH_CHECK(norm_type > 0, "fused.", op, ": norm_type must be > 0 or inf, got ", norm_type);
  check_nonneg(op, "max_norm", max_norm);
  check_nonneg(op, "clip_value", clip_value);
}

// One tensor's SGD hyperparameters (its row of the per-tensor table: lr, momentum, dampening, weight_decay).
inline void check_sgd_hyper(const char* op, const std::array<double, 4>& h, bool nesterov, bool use_momentum) {
  const double momentum = h[1], dampening = h[2];
  check_nonneg(op, "lr", h[0]);
  check_nonneg(op, "momentum", momentum);
  check_nonneg(op, "weight_decay", h[3]);
  TORCH_CHECK((momentum != 0) == use_momentum, "fused.", op,
              ": momentum must be nonzero for every tensor of a call or for none");
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), "fused.", op,
              ": nesterov needs momentum > 0 and dampening == 0");
}

// One tensor's Adam hyperparameters (its row of the per-tensor table: lr, beta1, beta2, eps, weight_decay).
inline void check_adam_hyper(const char* op, const std::array<double, 5>& h) {
  const double beta1 = h[1], beta2 = h[2];
  check_nonneg(op, "lr", h[0]);
  check_nonneg(op, "eps", h[3]);
  check_nonneg(op, "weight_decay", h[4]);
  TORCH_CHECK(0 <= beta1 && beta1 < 1 && 0 <= beta2 && beta2 < 1, "fused.", op, ": betas must be in [0, 1), got (",
              beta1, ", ", beta2, ")");
}

}  // namespace fused
