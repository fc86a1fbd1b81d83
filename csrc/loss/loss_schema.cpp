// Schemas of the loss family. The public ops linear_cross_entropy and cross_entropy are composites registered
// from Python (fused/loss/ops.py) over the internal ops below; cross_entropy_rows is the kernel they share (the
// others run ATen's GEMMs around it, on every device).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  m.def(
      "linear_cross_entropy(Tensor input, Tensor linear_weight, Tensor target, *, Tensor? linear_bias=None, "
      "Tensor? weight=None, str reduction=\"mean\", int? ignore_index=-100, float label_smoothing=0.0, "
      "float z_loss=0.0, float? softcap=None) -> Tensor");
  m.def(
      "cross_entropy(Tensor logits, Tensor target, *, Tensor? weight=None, str reduction=\"mean\", "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None) -> Tensor");

  // The softmax + loss + gradient pass over rows of logits [R, V] (csrc/loss/loss_math.h has the formulas):
  // loss[r] = the row's loss without the z-loss term, lse[r] = its logsumexp (both 0 for ignored rows), in
  // float32 (float64 for float64 logits). When grad is not empty it gets the gradient of
  // sum_r (scale[r, 0] loss[r] + scale[r, 1] z_loss lse[r]^2) with respect to the logits, in the logits' dtype;
  // grad may be logits itself (the gradient overwrites them). scale: [2] (every row) or [R, 2]. weight: class
  // weights in the math dtype. softcap 0: none. Its CUDA twin: common/registration.h.
  def_with_cuda_twin(
      m,
      "cross_entropy_rows(Tensor logits, Tensor target, Tensor? weight, Tensor scale, Tensor(a!) grad, "
      "int ignore_index, float label_smoothing, float z_loss, float softcap) -> (Tensor loss, Tensor lse)");

  // input [N, D], target [N]. loss: reduced as `reduction` says, in float32 (float64 for float64 input; the
  // composite casts it). For "mean" and "sum" the gradients asked for come back too (of the loss, for a
  // grad_output of 1), else empty tensors.
  m.def(
      "linear_cross_entropy_fwd(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, "
      "Tensor? weight, str reduction, int ignore_index, float label_smoothing, float z_loss, float softcap, "
      "bool grad_input, bool grad_weight, bool grad_bias) "
      "-> (Tensor loss, Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // The backward that recomputes the logits chunk by chunk: reduction="none" (grad_loss [N]), and a "mean" or
  // "sum" whose gradients forward did not compute or a previous backward consumed.
  m.def(
      "linear_cross_entropy_bwd(Tensor grad_loss, Tensor input, Tensor linear_weight, Tensor target, "
      "Tensor? linear_bias, Tensor? weight, str reduction, int ignore_index, float label_smoothing, float z_loss, "
      "float softcap, bool grad_input, bool grad_weight, bool grad_bias) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // logits [N, V], target [N]; as linear_cross_entropy_fwd, with the logits' gradient when `grad`.
  m.def(
      "cross_entropy_fwd(Tensor logits, Tensor target, Tensor? weight, str reduction, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, bool grad) -> (Tensor loss, Tensor grad_logits)");
  m.def(
      "cross_entropy_bwd(Tensor grad_loss, Tensor logits, Tensor target, Tensor? weight, str reduction, "
      "int ignore_index, float label_smoothing, float z_loss, float softcap) -> Tensor");

  // Post-training losses over the same chunked machinery (fused/loss/log_probs.py, distillation.py).
  m.def(
      "linear_log_probs(Tensor input, Tensor linear_weight, Tensor target, *, Tensor? linear_bias=None, "
      "float temperature=1.0, int ignore_index=-100, bool return_entropy=False) -> (Tensor logp, Tensor entropy)");
  m.def(
      "linear_distillation_loss(Tensor student_input, Tensor student_weight, Tensor teacher_input, "
      "Tensor teacher_weight, Tensor? target=None, *, Tensor? student_bias=None, Tensor? teacher_bias=None, "
      "str divergence=\"forward_kl\", float beta=0.5, float temperature=1.0, int ignore_index=-100, "
      "str reduction=\"mean\") -> Tensor");
  // Rows of logits [R, V] divided by temperature: logp[r] = log_softmax(z_r)[target[r]] and entropy[r], in the
  // math dtype (0 for ignored rows). When grad is not empty it gets the gradient of
  // sum_r (scale[r, 0] logp[r] + scale[r, 1] entropy[r]) with respect to the logits (grad may be logits itself).
  def_with_cuda_twin(m,
                     "log_prob_rows(Tensor logits, Tensor target, Tensor scale, Tensor(a!) grad, int ignore_index, "
                     "float temperature) -> (Tensor logp, Tensor entropy)");
  // Student and teacher logits [R, V] of one dtype, divided by temperature: the divergence per row (0 where the
  // target is ignore_index), and into grad, when not empty, the gradient of sum_r scale[r] loss[r] with respect to
  // the student's logits. scale: [] (every row) or [R].
  def_with_cuda_twin(m,
                     "distillation_rows(Tensor logits, Tensor teacher_logits, Tensor? target, Tensor scale, "
                     "Tensor(a!) grad, str divergence, float beta, float temperature, int ignore_index) -> Tensor");
  // input [N, D], target [N]: (logp, entropy) per row; the backward recomputes the logits chunk by chunk with the
  // per-row upstream gradients.
  m.def(
      "linear_log_probs_fwd(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, "
      "float temperature, int ignore_index) -> (Tensor logp, Tensor entropy)");
  m.def(
      "linear_log_probs_bwd(Tensor grad_logp, Tensor grad_entropy, Tensor input, Tensor linear_weight, "
      "Tensor target, Tensor? linear_bias, float temperature, int ignore_index, bool grad_input, bool grad_weight, "
      "bool grad_bias) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // As linear_cross_entropy_fwd / _bwd: for "mean" and "sum" the student's gradients come back from forward.
  m.def(
      "linear_distillation_fwd(Tensor student_input, Tensor student_weight, Tensor teacher_input, "
      "Tensor teacher_weight, Tensor? target, Tensor? student_bias, Tensor? teacher_bias, str reduction, "
      "str divergence, float beta, float temperature, int ignore_index, bool grad_input, bool grad_weight, "
      "bool grad_bias) -> (Tensor loss, Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "linear_distillation_bwd(Tensor grad_loss, Tensor student_input, Tensor student_weight, Tensor teacher_input, "
      "Tensor teacher_weight, Tensor? target, Tensor? student_bias, Tensor? teacher_bias, str reduction, "
      "str divergence, float beta, float temperature, int ignore_index, bool grad_input, bool grad_weight, "
      "bool grad_bias) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}
