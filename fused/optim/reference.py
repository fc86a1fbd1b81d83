"""The plain-PyTorch reference (the spec) of a fused clip-and-step: torch.nn.utils.clip_grad_value_ and
clip_grad_norm_, then torch.optim's step, skipped entirely when a gradient is inf/NaN."""
import math

import torch


class ReferenceOptimizer:
    """torch.optim.<name>(params, **hyper) with the fused optimizers' max_grad_norm / clip_value / skip-on-inf."""

    def __init__(self, name, params, max_grad_norm=None, clip_value=None, **hyper):
        self.params = [p for p in params]
        self.opt = getattr(torch.optim, name)(self.params, foreach=False, **hyper)
        self.max_grad_norm, self.clip_value = max_grad_norm, clip_value
        self.last_grad_norm = None

    @torch.no_grad()
    def step(self, inv_scale=1.0):
        grads = [p.grad for p in self.params if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            self.last_grad_norm = torch.tensor(math.nan)
            return False
        for g in grads:
            g.mul_(inv_scale)
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.params, self.clip_value)
        max_norm = math.inf if self.max_grad_norm is None else self.max_grad_norm
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        self.opt.step()
        return True


def clip_grad_norm_(parameters, max_norm, norm_type=2.0):
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
