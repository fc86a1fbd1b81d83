"""Fused clip-and-step optimizers: fused.optim.SGD, Adam, AdamW (drop-ins for torch.optim's, plus
max_grad_norm, clip_value, last_grad_norm and low-bit Adam state), in two kernel passes with no host sync
(one without clipping, a scaler or track_grad_norm)."""

from fused.optim.optimizer import SGD, Adam, AdamW
from fused.optim.quantize import dequantize_state

__all__ = ["SGD", "Adam", "AdamW", "dequantize_state"]
