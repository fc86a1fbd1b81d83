"""A correctly rounded tl.fma for Triton interpreters that round it twice.

On a GPU, tl.fma(x, y, z) rounds once, and the Triton optimizer kernels are held to the CPU kernels' bits with
that fma. Triton's interpreter before 3.9 (3.8 is what torch 2.14 installs) computes it as x * y + z in the
operands' dtype, rounded twice, so those same-bits checks would fail there for the interpreter's sake, not the
kernels'. exact_fma_in_interpreter() finds out by running one fma, and gives such an interpreter a correctly
rounded one: the suite then checks the kernels as a GPU runs them, under any Triton it supports.
"""

from fractions import Fraction

import numpy as np
import torch

# x * y + z = 2^-24 exactly, which float32 holds; rounding x * y first (a tie, to even: 1 + 2^-11) gives 0
PROBE = (1 + 2.0**-12, 1 + 2.0**-12, -(1 + 2.0**-11))


def fma_float32(x, y, z):
    """fma of float32 arrays, rounded once: the product is exact in float64, the sum is rounded to odd there (a
    float64 with 29 more bits than float32, so rounding it to float32 rounds the exact sum correctly)."""
    p, c = np.asarray(x, np.float64) * np.asarray(y, np.float64), np.asarray(z, np.float64)
    s = np.asarray(p + c)
    t = s - c
    err = (p - t) + (c - (s - t))  # TwoSum: s + err = p + c exactly (no overflow here)
    to_odd = (err != 0) & np.isfinite(s) & (s.view(np.int64) % 2 == 0)
    s = np.where(to_odd, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return np.asarray(s, np.float32)


def _fma_scalar64(x, y, z):
    if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(z)):
        return x * y + z
    return float(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))  # float() rounds to nearest even


def fma_float64(x, y, z):
    """fma of float64 arrays, rounded once (exact rational arithmetic: slow, but float64 kernels here are small)."""
    return np.vectorize(_fma_scalar64, otypes=[np.float64])(x, y, z)


def fma_rounded_once(x, y, z):
    """fma of numpy arrays (broadcast) in z's dtype, rounded once; 16-bit dtypes through float64, whose sum rounds
    at 53 bits, far below theirs, as triton 3.9's interpreter takes them."""
    x, y, z = np.broadcast_arrays(x, y, z)
    if z.dtype == np.float32:
        return fma_float32(x, y, z)
    if z.dtype == np.float64:
        return fma_float64(x, y, z)
    return (x.astype(np.float64) * y.astype(np.float64) + z.astype(np.float64)).astype(z.dtype)


def _probe():
    """The interpreter's tl.fma of PROBE (float32)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_probe(xyz, out):
        tl.store(out, tl.fma(tl.load(xyz), tl.load(xyz + 1), tl.load(xyz + 2)))

    out = torch.zeros(1)
    fma_probe[(1,)](torch.tensor(PROBE, dtype=torch.float32), out)
    return out.item()


def exact_fma_in_interpreter():
    """Under TRITON_INTERPRET=1 with triton installed: makes the interpreter's tl.fma round once if it does not.
    Raises if it still rounds twice after (an interpreter whose builder this does not know)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    exact = 2.0**-24
    if _probe() == exact:
        return

    def create_fma(self, x, y, z):
        return interpreter.TensorHandle(fma_rounded_once(x.data, y.data, z.data), z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = create_fma
    got = _probe()
    if got != exact:
        raise RuntimeError(f"tests/triton_interpreter.py: this Triton interpreter's tl.fma gives {got}, not {exact}")
