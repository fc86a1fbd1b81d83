"""The fused elementwise family: bias + activation, gated units, bias-dropout-residual, pointwise chains.

bias_dropout_add runs the composite that torch.ops.fused.bias_dropout_add runs, without the dispatcher's round trip
into Python (about 4 us a call; fused._autograd.public)."""

from typing import Optional, Sequence, Tuple, Union

import torch

from fused.elementwise import ops as _ops  # the family's ops, registered on import; their eager entry points

Op = Union[str, Tuple[str, float]]


def bias_act(x: torch.Tensor, bias: Optional[torch.Tensor] = None, act: str = "gelu") -> torch.Tensor:
    """act(x + bias) in one pass; bias (1-D) broadcasts over the last dim. act: identity, relu, gelu (erf),
    gelu_tanh, silu, sigmoid, tanh. Backward gives grad_x and grad_bias (reduced deterministically)."""
    return _ops.bias_act(x, bias, act)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up: SwiGLU (silu), GeGLU (gelu, gelu_tanh), ReGLU (relu). gate and up may be the two
    halves of one chunked tensor: rows with a stride are read in place, not copied."""
    return _ops.glu(gate, up, act)


def bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float = 0.1, training: bool = True
) -> torch.Tensor:
    """residual + dropout(x + bias, p) in one pass. The mask comes from a counter-based RNG seeded from torch's
    default generator (reproducible under torch.manual_seed) and is regenerated in backward, never stored."""
    return _ops.bias_dropout_add(x, bias, residual, p, training)


def encode_ops(ops: Sequence[Op]) -> list:
    """fused.unary_chain's ops as the op schema takes them: "name" or "name:value" (value as repr(float))."""
    if isinstance(ops, str):
        raise TypeError(
            f"fused.unary_chain: ops must be a sequence of op names or (name, scalar) pairs, got the string {ops!r}"
        )
    encoded = []
    for op in ops:
        if isinstance(op, str):
            encoded.append(op)
        elif isinstance(op, (tuple, list)) and len(op) == 2 and isinstance(op[0], str):
            encoded.append(f"{op[0]}:{float(op[1])!r}")
        else:
            raise TypeError(f"fused.unary_chain: each op must be a name or a (name, scalar) pair, got {op!r}")
    return encoded


def unary_chain(x: torch.Tensor, ops: Sequence[Op]) -> torch.Tensor:
    """A chain of pointwise ops in one pass over memory, e.g. ["square"] * 10, ["cos", "cos"],
    [("mul", 0.5), "tanh", ("add", 1.0)]. The backward recomputes the chain in the same pass."""
    return _ops.unary_chain(x, encode_ops(ops))


__all__ = ["bias_act", "glu", "bias_dropout_add", "unary_chain", "encode_ops"]
