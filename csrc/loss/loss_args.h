// Argument checks of the row kernels (fused::cross_entropy_rows, log_prob_rows, distillation_rows), shared by the CPU
// kernel and the CUDA binding; every message names the op and the argument. The public ops check their own arguments in
// Python (fused/loss/ops.py) and call this op with 2-D logits, int64 targets and class weights already in the math
// type.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "common/checks.h"
#include "loss/logprob_math.h"

namespace fused {

// The math dtype of the loss kernels: float32 for 16-bit and float32 logits, float64 for float64.
inline at::ScalarType loss_math_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_cross_entropy_rows(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                     const std::optional<at::Tensor>& weight, const at::Tensor& scale,
                                     const at::Tensor& grad, double label_smoothing, double softcap) {
  check_floating(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2, "fused.", op, ": logits must be 2-D [rows, classes], got shape ", logits.sizes());
  const int64_t rows = logits.size(0), classes = logits.size(1);
  TORCH_CHECK(target.scalar_type() == at::kLong, "fused.", op, ": target must be int64 class indices, got ",
              dtype_name(target.scalar_type()));
  TORCH_CHECK(target.dim() == 1 && target.size(0) == rows, "fused.", op, ": target must be 1-D with ", rows,
              " entries (one per row of logits), got shape ", target.sizes());
  TORCH_CHECK(target.device() == logits.device(), "fused.", op, ": target is on ", target.device(),
              " but logits is on ", logits.device());
  const at::ScalarType math = loss_math_dtype(logits);
  if (weight) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == classes, "fused.", op, ": weight must be 1-D with ", classes,
                " entries (one per class), got shape ", weight->sizes());
    TORCH_CHECK(weight->scalar_type() == math && weight->device() == logits.device(), "fused.", op, ": weight must be ",
                dtype_name(math), " on ", logits.device(), ", got ", dtype_name(weight->scalar_type()), " on ",
                weight->device());
  }
  TORCH_CHECK(scale.scalar_type() == math && scale.device() == logits.device(), "fused.", op, ": scale must be ",
              dtype_name(math), " on ", logits.device());
  TORCH_CHECK(
      (scale.dim() == 1 && scale.size(0) == 2) || (scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == 2),
      "fused.", op, ": scale must have shape [2] or [rows, 2], got ", scale.sizes());
  if (grad.numel()) {
    check_like(op, "grad", grad, "logits", logits);
    TORCH_CHECK(grad.sizes() == logits.sizes() && (grad.size(1) <= 1 || grad.stride(1) == 1), "fused.", op,
                ": grad must be empty (no gradient) or have the shape of logits with unit column stride, got shape ",
                grad.sizes(), " and strides ", grad.strides());
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "fused.", op,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
  TORCH_CHECK(softcap >= 0.0, "fused.", op, ": softcap must be > 0 (0 here: none), got ", softcap);
}

// fused::cross_entropy_rows' tensors as both kernels read them (checked): logits with unit column stride (a copy
// otherwise: never the case for the in-place use), target, scale and weight contiguous, and the outputs.
struct CrossEntropyRows {
  at::Tensor logits, target, scale;
  std::optional<at::Tensor> weight;
  at::Tensor loss, lse;
};

inline CrossEntropyRows cross_entropy_rows_inputs(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                                  const std::optional<at::Tensor>& weight, const at::Tensor& scale,
                                                  const at::Tensor& grad, double label_smoothing, double softcap) {
  check_cross_entropy_rows(op, logits, target, weight, scale, grad, label_smoothing, softcap);
  const int64_t rows = logits.size(0), V = logits.size(1);
  const auto math_opts = logits.options().dtype(loss_math_dtype(logits));
  return {V <= 1 || logits.stride(1) == 1 ? logits : logits.contiguous(),
          target.contiguous(),
          scale.contiguous(),
          weight ? std::optional<at::Tensor>(weight->contiguous()) : std::nullopt,
          at::empty({rows}, math_opts),
          at::empty({rows}, math_opts)};
}

// A backend of fused::cross_entropy_rows: fills in.loss and in.lse (and grad when it is not empty).
using CrossEntropyRowsRun = void (*)(const char* op, const CrossEntropyRows& in, const at::Tensor& grad,
                                     int64_t ignore_index, double label_smoothing, double z_loss, double softcap);

// fused::cross_entropy_rows with the schema's arguments on the backend Run (the CPU kernel, the CUDA binding): the
// checks and inputs of cross_entropy_rows_inputs first, on every backend.
template <CrossEntropyRowsRun Run>
std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_op(const at::Tensor& logits, const at::Tensor& target,
                                                         const std::optional<at::Tensor>& weight,
                                                         const at::Tensor& scale, const at::Tensor& grad,
                                                         int64_t ignore_index, double label_smoothing, double z_loss,
                                                         double softcap) {
  const char* op = "cross_entropy_rows";
  const CrossEntropyRows in =
      cross_entropy_rows_inputs(op, logits, target, weight, scale, grad, label_smoothing, softcap);
  Run(op, in, grad, ignore_index, label_smoothing, z_loss, softcap);
  return {in.loss, in.lse};
}

// target: int64 of shape [rows] on logits' device (every row kernel's).
inline void check_row_target(const char* op, const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(target.scalar_type() == at::kLong, "fused.", op, ": target must be int64 class indices, got ",
              dtype_name(target.scalar_type()));
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "fused.", op, ": target must be 1-D with ",
              logits.size(0), " entries (one per row of logits), got shape ", target.sizes());
  TORCH_CHECK(target.device() == logits.device(), "fused.", op, ": target is on ", target.device(),
              " but logits is on ", logits.device());
}

// An out-of-range target is an IndexError naming the op, as in torch (CPU: the GPU kernels give that row NaN).
inline void check_target_range(const char* op, const at::Tensor& target, int64_t classes, int64_t ignore_index) {
  const int64_t* t = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < target.numel(); ++r) {
    TORCH_CHECK_INDEX(t[r] == ignore_index || (t[r] >= 0 && t[r] < classes), "fused.", op, ": target ", t[r],
                      " is out of bounds for ", classes, " classes (ignore_index is ", ignore_index, ")");
  }
}

// grad: empty (no gradient) or logits' shape, dtype and device with unit column stride (it may be logits itself).
inline void check_row_grad(const char* op, const at::Tensor& logits, const at::Tensor& grad) {
  if (!grad.numel()) return;
  check_like(op, "grad", grad, "logits", logits);
  TORCH_CHECK(grad.sizes() == logits.sizes() && (grad.size(1) <= 1 || grad.stride(1) == 1), "fused.", op,
              ": grad must be empty (no gradient) or have the shape of logits with unit column stride, got shape ",
              grad.sizes(), " and strides ", grad.strides());
}

inline void check_temperature(const char* op, double temperature) {
  TORCH_CHECK(temperature > 0.0, "fused.", op, ": temperature must be > 0, got ", temperature);
}

// fused::log_prob_rows: logits [rows, V], target [rows], scale [rows, 2] (per row: d/d log p_t, d/d entropy).
inline void check_log_prob_rows(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                const at::Tensor& scale, const at::Tensor& grad, double temperature) {
  check_floating(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2, "fused.", op, ": logits must be 2-D [rows, classes], got shape ", logits.sizes());
  check_row_target(op, logits, target);
  const at::ScalarType math = loss_math_dtype(logits);
  TORCH_CHECK(scale.scalar_type() == math && scale.device() == logits.device() && scale.dim() == 2 &&
                  scale.size(0) == logits.size(0) && scale.size(1) == 2,
              "fused.", op, ": scale must be ", dtype_name(math), " of shape [", logits.size(0), ", 2] on ",
              logits.device(), ", got shape ", scale.sizes());
  check_row_grad(op, logits, grad);
  check_temperature(op, temperature);
}

inline loss::Divergence parse_divergence(const char* op, c10::string_view divergence) {
  if (divergence == "forward_kl") return loss::Divergence::ForwardKL;
  if (divergence == "reverse_kl") return loss::Divergence::ReverseKL;
  TORCH_CHECK(divergence == "jsd", "fused.", op, ": divergence must be 'forward_kl', 'reverse_kl' or 'jsd', got '",
              std::string(divergence), "'");
  return loss::Divergence::JSD;
}

// fused::distillation_rows: student and teacher logits [rows, V] of one dtype, target [rows] or none, scale 0-d
// (every row) or [rows].
inline loss::Divergence check_distillation_rows(const char* op, const at::Tensor& logits, const at::Tensor& teacher,
                                                const std::optional<at::Tensor>& target, const at::Tensor& scale,
                                                const at::Tensor& grad, c10::string_view divergence, double beta,
                                                double temperature) {
  check_floating(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2, "fused.", op, ": logits must be 2-D [rows, classes], got shape ", logits.sizes());
  check_like(op, "teacher_logits", teacher, "logits", logits);
  TORCH_CHECK(teacher.sizes() == logits.sizes(), "fused.", op, ": teacher_logits must have the shape of logits ",
              logits.sizes(), ", got ", teacher.sizes());
  if (target) check_row_target(op, logits, *target);
  const at::ScalarType math = loss_math_dtype(logits);
  TORCH_CHECK(scale.scalar_type() == math && scale.device() == logits.device() &&
                  (scale.dim() == 0 || (scale.dim() == 1 && scale.size(0) == logits.size(0))),
              "fused.", op, ": scale must be ", dtype_name(math), " of shape [] or [", logits.size(0), "] on ",
              logits.device(), ", got shape ", scale.sizes());
  check_row_grad(op, logits, grad);
  TORCH_CHECK(beta >= 0.0 && beta <= 1.0, "fused.", op, ": beta must be in [0, 1], got ", beta);
  check_temperature(op, temperature);
  return parse_divergence(op, divergence);
}

// logits with unit column stride (a copy otherwise: never the case for the in-place use).
inline at::Tensor columns_contiguous(const at::Tensor& t) {
  return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
}

inline at::Tensor row_output(const at::Tensor& logits) {
  return at::empty({logits.size(0)}, logits.options().dtype(loss_math_dtype(logits)));
}

// fused::log_prob_rows' tensors as both kernels read them (checked), and the outputs.
struct LogProbRows {
  at::Tensor logits, target, scale, logp, entropy;
};

// A backend of fused::log_prob_rows: fills in.logp and in.entropy (and grad when it is not empty).
using LogProbRowsRun = void (*)(const char* op, const LogProbRows& in, const at::Tensor& grad, int64_t ignore_index,
                                double temperature);

// fused::log_prob_rows with the schema's arguments on the backend Run, after the checks.
template <LogProbRowsRun Run>
std::tuple<at::Tensor, at::Tensor> log_prob_rows_op(const at::Tensor& logits, const at::Tensor& target,
                                                    const at::Tensor& scale, const at::Tensor& grad,
                                                    int64_t ignore_index, double temperature) {
  const char* op = "log_prob_rows";
  check_log_prob_rows(op, logits, target, scale, grad, temperature);
  const LogProbRows in{columns_contiguous(logits), target.contiguous(), scale.contiguous(), row_output(logits),
                       row_output(logits)};
  Run(op, in, grad, ignore_index, temperature);
  return {in.logp, in.entropy};
}

// fused::distillation_rows' tensors as both kernels read them (checked), the divergence, and the output.
struct DistillationRows {
  at::Tensor logits, teacher, scale;
  std::optional<at::Tensor> target;
  loss::Divergence divergence;
  at::Tensor loss;
};

// A backend of fused::distillation_rows: fills in.loss (and grad when it is not empty).
using DistillationRowsRun = void (*)(const char* op, const DistillationRows& in, const at::Tensor& grad, double beta,
                                     double temperature, int64_t ignore_index);

// fused::distillation_rows with the schema's arguments on the backend Run, after the checks.
template <DistillationRowsRun Run>
at::Tensor distillation_rows_op(const at::Tensor& logits, const at::Tensor& teacher,
                                const std::optional<at::Tensor>& target, const at::Tensor& scale,
                                const at::Tensor& grad, c10::string_view divergence, double beta, double temperature,
                                int64_t ignore_index) {
  const char* op = "distillation_rows";
  const loss::Divergence d =
      check_distillation_rows(op, logits, teacher, target, scale, grad, divergence, beta, temperature);
  const DistillationRows in{columns_contiguous(logits),
                            columns_contiguous(teacher),
                            scale.contiguous(),
                            target ? std::optional<at::Tensor>(target->contiguous()) : std::nullopt,
                            d,
                            row_output(logits)};
  Run(op, in, grad, beta, temperature, ignore_index);
  return in.loss;
}

}  // namespace fused
