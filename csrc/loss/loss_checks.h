// Argument checks of fused::cross_entropy_rows, shared by the CPU kernel and the CUDA binding; every message
// names the op and the argument. The public ops check their own arguments in Python (fused/loss/ops.py) and
// call this op with 2-D logits, int64 targets and class weights already in the math type.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "common/checks.h"

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
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == classes, "fused.", op, ": weight must be 1-D with ",
                classes, " entries (one per class), got shape ", weight->sizes());
    TORCH_CHECK(weight->scalar_type() == math && weight->device() == logits.device(), "fused.", op,
                ": weight must be ", dtype_name(math), " on ", logits.device(), ", got ",
                dtype_name(weight->scalar_type()), " on ", weight->device());
  }
  TORCH_CHECK(scale.scalar_type() == math && scale.device() == logits.device(), "fused.", op, ": scale must be ",
              dtype_name(math), " on ", logits.device());
  TORCH_CHECK((scale.dim() == 1 && scale.size(0) == 2) || (scale.dim() == 2 && scale.size(0) == rows &&
                                                           scale.size(1) == 2),
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

}  // namespace fused
