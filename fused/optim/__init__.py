"""Fused clip-and-step optimizers: fused.optim.SGD, Adam, AdamW (drop-ins for torch.optim's, plus
max_grad_norm, clip_value and last_grad_norm), in two kernel passes with no host sync."""

from fused.optim.optimizer import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
