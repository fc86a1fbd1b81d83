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


TENSOR_KEY_STEP = 0x9E3779B97F4A7C15  # Philox key of tensor t in a step call: seed + t * this (mod 2**64)


def stochastic_round_bf16(x, seed, tensor_index=0):
    """The bf16 rounding of float32 x that the fused step does with stochastic_rounding=True: add the top 16 bits
    of Philox4x32-10 word i (csrc/common/philox.h, key seed + tensor_index * TENSOR_KEY_STEP) to the float32 bits of
    element i and truncate to bf16. Unbiased: E[round(x)] = x. NaN becomes bf16's quiet NaN."""
    from fused.elementwise.reference import philox_words

    key = (seed + tensor_index * TENSOR_KEY_STEP) & ((1 << 64) - 1)
    flat = x.detach().float().contiguous().view(-1)
    words = torch.from_numpy((philox_words(key, flat.numel()) >> 16).astype("int64"))
    bits = (flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + words
    top = ((bits >> 16) & 0xFFFF).where(~flat.isnan(), 0x7FC0)
    signed = top - ((top >= 0x8000).to(torch.int64) << 16)  # the same 16 bits as an int16
    return signed.to(torch.int16).view(torch.bfloat16).view(x.shape)
