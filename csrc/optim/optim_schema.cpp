// Schemas of the fused optimizer family: two passes over lists of tensors, whatever their number.
//   1. grad_norm: a sum of |g|^p (or max |g|) over every gradient with the finite check in the same pass;
//      finishes the norm and the clip coefficient min(1, max_norm / (norm + 1e-6)) on the device.
//   2. sgd_step_ / adam_step_: the update, reading the clip coefficient, the scaler's scale and
//      found_inf from tensors (no host sync) and skipping the whole update when found_inf is set.
// With write_grads the update writes the gradient it used back into grads (unscaled, value- and norm-clipped, before
// maximize and weight decay), as torch's fused optimizers leave .grad; a skipped step writes nothing.
// Every op has a CUDA C++ kernel: each is defined with its CUDA twin (common/registration.h).
#include <torch/library.h>

#include "common/registration.h"

TORCH_LIBRARY_FRAGMENT(fused, m) {
  using fused::def_with_cuda_twin;
  // g' = clamp(g / grad_scale, -clip_value, clip_value); acc = sum |g'|^p (max |g'| for p = inf) over all grads,
  // in fp32 (fp64 for fp64 grads), added up in fp64. Returns scalars (norm, clip_coef, found_inf): the norm in the
  // grads' promoted dtype (as torch's clip_grad_norm_; float32 for none), clip_coef float64 (from the fp64 norm),
  // found_inf float32, 1 where the found_inf argument is set or a gradient holds inf/NaN, else 0.
  // finish=False: (acc as float64, empty, found_inf), for an all-reduce before the finish.
  // max_norm = inf: no norm clipping (clip_coef = 1). grad_scale: the GradScaler's scale (None: 1).
  def_with_cuda_twin(m,
                     "grad_norm(Tensor[] grads, Tensor? found_inf, Tensor? grad_scale, float norm_type, "
                     "float max_norm, float clip_value, bool finish=True) -> (Tensor norm, Tensor clip_coef, "
                     "Tensor found_inf_out)");
  // grads *= clip_coef (float64 scalar tensor): the second pass of fused.clip_grad_norm_.
  def_with_cuda_twin(m, "scale_grads_(Tensor(a!)[] grads, Tensor clip_coef) -> ()");
  // momentum_buffers and steps are empty when momentum == 0. steps: float32 scalars, +1 unless skipped.
  def_with_cuda_twin(m,
                     "sgd_step_(Tensor(a!)[] params, Tensor(e!)[] grads, Tensor(b!)[] momentum_buffers, "
                     "Tensor(c!)[] steps, float lr, float momentum, float dampening, float weight_decay, "
                     "bool nesterov, bool maximize, Tensor clip_coef, Tensor? grad_scale, Tensor found_inf, "
                     "float clip_value, Tensor(d!)[] model_params, Tensor? sr_seed=None, Tensor? hyper=None, "
                     "bool write_grads=False) -> ()");
  // decoupled: AdamW's weight decay. max_exp_avg_sqs is empty unless amsgrad.
  // model_params (both steps): empty, or master weights: params and state are the fp32 masters, grads and
  // model_params 16-bit; the update reads the 16-bit grad and writes the rounded param into model_params.
  // Without them, 16-bit params may take float32 grads (accumulated) and float32 state. sr_seed (int64 CPU
  // scalar): bf16 params are rounded stochastically, element i of tensor t by Philox(seed + t * golden, i).
  // hyper (float64 CPU [n, H]): per-tensor hyperparameters in place of the scalars, so that every param group
  // updates in one call: SGD (lr, momentum, dampening, weight_decay), Adam (lr, beta1, beta2, eps, weight_decay).
  // Adam's low-bit state (fused.optim state_dtype; CPU kernel only): a state tensor of any param but a float64 one
  // may be bfloat16 (rounded stochastically on write when state_seed, an int64 CPU scalar, is given), or 8-bit:
  // exp_avg int8, exp_avg_sq and max_exp_avg_sq uint8, each with its float32 scales [ceil(numel / 256)] at index i
  // of the matching *_scales list (entries of other tensors are ignored). Codes: csrc/optim/quantize_cpu.h.
  def_with_cuda_twin(m,
                     "adam_step_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, "
                     "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, float lr, "
                     "float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool decoupled, "
                     "bool maximize, Tensor clip_coef, Tensor? grad_scale, Tensor found_inf, float clip_value, "
                     "Tensor(f!)[] model_params, Tensor? sr_seed=None, Tensor? hyper=None, "
                     "bool write_grads=False, Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None, "
                     "Tensor(j!)[]? max_exp_avg_sq_scales=None, Tensor? state_seed=None) -> ()");
  // accs += grads (accs = grads when overwrite): fp32 accumulation (fp64 for fp64 grads) of micro-batch gradients.
  def_with_cuda_twin(m, "accumulate_grads_(Tensor(a!)[] accs, Tensor[] grads, bool overwrite) -> ()");
}
