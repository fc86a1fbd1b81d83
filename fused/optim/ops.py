"""Registration of the fused optimizer ops: fake kernels (torch.compile, opcheck) and the CUDA-device routing.
The ops mutate their arguments in place (optimizer state, found_inf) and have no autograd."""
import torch

from fused._backend import register_gpu


@torch.library.register_fake("fused::grad_norm_")
def _(grads, found_inf, inv_scale, norm_type, max_norm, clip_value, finish=True):
    new = found_inf.new_empty
    return new((), dtype=torch.float32), new(() if finish else (0,), dtype=torch.float32)


@torch.library.register_fake("fused::scale_grads_")
def _(grads, clip_coef):
    return None


@torch.library.register_fake("fused::sgd_step_")
def _(params, grads, momentum_buffers, steps, lr, momentum, dampening, weight_decay, nesterov, maximize,
      clip_coef, inv_scale, found_inf, clip_value):
    return None


@torch.library.register_fake("fused::adam_step_")
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, amsgrad,
      decoupled, maximize, clip_coef, inv_scale, found_inf, clip_value):
    return None


# CUDA C++ only (no Triton versions): fused::cuda_<op> from csrc/optim/optim_cuda.cpp where it was built.
for _op in ("grad_norm_", "scale_grads_", "sgd_step_", "adam_step_"):
    register_gpu(_op, cuda_op=f"cuda_{_op}")
