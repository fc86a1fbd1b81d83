"""Plain-PyTorch references for the fused elementwise family: the spec the kernels are tested against."""

import numpy as np
import torch
import torch.nn.functional as F

ACT_FNS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

UNARY_FNS = {
    "neg": torch.neg,
    "abs": torch.abs,
    "square": torch.square,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "exp": torch.exp,
    "log": torch.log,
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "reciprocal": torch.reciprocal,
    "add": torch.add,
    "mul": torch.mul,
    "pow": torch.pow,
    "clamp_min": torch.clamp_min,
    "clamp_max": torch.clamp_max,
}


def bias_act(x, bias=None, act="gelu"):
    return ACT_FNS[act](x if bias is None else x + bias)


def glu(gate, up, act="silu"):
    return ACT_FNS[act](gate) * up


def unary_chain(x, ops):
    """ops as fused.unary_chain takes them: names or (name, scalar) pairs."""
    for op in ops:
        name, *scalar = (op,) if isinstance(op, str) else op
        x = UNARY_FNS[name](x, *scalar)
    return x


def _mulhi(a, b):
    return ((a.astype(np.uint64) * b.astype(np.uint64)) >> np.uint64(32)).astype(np.uint32)


def philox_words(seed: int, n: int) -> np.ndarray:
    """The uint32 word that dropout draws for each of n elements (csrc/common/philox.h): Philox4x32-10 with
    key (seed_lo, seed_hi), counter (i // 4, 0, 0, 0), word i % 4."""
    seed &= (1 << 64) - 1
    groups = np.arange((n + 3) // 4, dtype=np.uint64)
    c0 = (groups & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    c1 = (groups >> np.uint64(32)).astype(np.uint32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0, p2 = c0, c2
            c0 = _mulhi(np.full_like(p2, 0xCD9E8D57), p2) ^ c1 ^ k0
            c2 = _mulhi(np.full_like(p0, 0xD2511F53), p0) ^ c3 ^ k1
            c1 = (p2.astype(np.uint64) * 0xCD9E8D57).astype(np.uint32)
            c3 = (p0.astype(np.uint64) * 0xD2511F53).astype(np.uint32)
            k0 = np.uint32((int(k0) + 0x9E3779B9) & 0xFFFFFFFF)
            k1 = np.uint32((int(k1) + 0xBB67AE85) & 0xFFFFFFFF)
    return np.stack([c0, c1, c2, c3], axis=1).reshape(-1)[:n]


def dropout_keep_mask(seed: int, shape, p: float) -> torch.Tensor:
    """The boolean keep-mask bias_dropout_add draws for `seed` (an element is dropped with probability p)."""
    n = int(np.prod(shape)) if len(shape) else 1
    threshold = 0 if p <= 0 else (1 << 32) if p >= 1 else int(p * 4294967296.0 + 0.5)
    keep = (
        philox_words(seed, n).astype(np.uint64) >= np.uint64(threshold)
        if threshold < (1 << 32)
        else np.zeros(n, dtype=bool)
    )
    return torch.from_numpy(keep).reshape(shape)


def bias_dropout_add(x, bias, residual, p=0.1, training=True, seed=None):
    """residual + dropout(x + bias). With `seed`, uses the same mask as the kernels; without, torch's dropout."""
    h = x if bias is None else x + bias
    if not training or p == 0:
        return residual + h
    if seed is None:
        return residual + F.dropout(h, p, training=True)
    keep = dropout_keep_mask(seed, h.shape, p).to(h.device)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return residual + torch.where(keep, h * scale, torch.zeros_like(h))
