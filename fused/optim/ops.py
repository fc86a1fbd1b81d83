"""Registration of the fused optimizer ops: fake kernels (torch.compile, opcheck) and the CUDA-device routing.
The ops mutate their arguments in place (optimizer state, found_inf) and have no autograd."""

import torch

from fused._backend import register_gpu
from fused.optim.functional import norm_dtype


@torch.library.register_fake("fused::grad_norm")
def _(grads, found_inf, grad_scale, norm_type, max_norm, clip_value, finish=True):
    device = grads[0].device if grads else found_inf.device
    norm = torch.empty((), dtype=norm_dtype(grads) if finish else torch.float64, device=device)
    coef = torch.empty(() if finish else (0,), dtype=torch.float64, device=device)
    return norm, coef, torch.empty((), dtype=torch.float32, device=device)


def _mutates_only(*args, **kwargs):
    """The fake kernel of an op that only writes its arguments in place: it returns nothing."""
    return None


for _op in ("scale_grads_", "sgd_step_", "adam_step_", "accumulate_grads_"):
    torch.library.register_fake(f"fused::{_op}", _mutates_only)


# fused::cuda_<op> from csrc/optim/optim_cuda.cpp where it was built, and every op on Triton too.
TRITON = {
    "grad_norm": "fused.optim.triton_norm:grad_norm",
    "scale_grads_": "fused.optim.triton_norm:scale_grads_",
    "sgd_step_": "fused.optim.triton_sgd:sgd_step_",
    "adam_step_": "fused.optim.triton_kernels:adam_step_",
    "accumulate_grads_": "fused.optim.triton_accumulate:accumulate_grads_",
}
for _op, _launcher in TRITON.items():
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=_launcher)
