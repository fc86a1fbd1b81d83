"""The codes of csrc/common/op_codes.h (activations, unary_chain ops, distance metrics), built from the name tables
that fused._C carries, so the C++, CUDA and Triton kernels and Python agree by construction."""

import math

from fused._ext import _C

ACT_CODES = {name: code for code, name in enumerate(_C.ACTS)}
UNARY_CODES = {name: code for code, name in enumerate(_C.UNARY_OPS + _C.SCALAR_OPS)}
SCALAR_OPS = _C.SCALAR_OPS
METRIC_CODES = {name: code for code, name in enumerate(_C.METRICS)}
MAX_CHAIN = _C.MAX_CHAIN  # ops per launch of the CUDA C++ chain kernel
MAX_SELECT = _C.MAX_SELECT  # neighbours per row the CUDA C++ select kernel keeps


def parse_op(op, spec):
    """'name' or 'name:value' -> (name, code, value): the encoding of unary_chain's `ops` in the op schema."""
    name, _, value = spec.partition(":")
    if name not in UNARY_CODES:
        raise RuntimeError(f"fused.{op}: unknown op {name!r}; expected one of {' '.join(UNARY_CODES)}")
    if (name in SCALAR_OPS) != bool(value):
        need = "needs a scalar, as (name, value)" if name in SCALAR_OPS else "takes no scalar"
        raise RuntimeError(f"fused.{op}: op {name!r} {need}")
    return name, UNARY_CODES[name], float(value) if value else 0.0


def metric_of(p):
    """The metric code of a distance's p (as metric_of in csrc/distance/distance_math.h)."""
    if p == 0:
        return METRIC_CODES["P0"]
    if p == 1:
        return METRIC_CODES["P1"]
    if p == 2:
        return METRIC_CODES["P2"]
    if math.isinf(p):
        return METRIC_CODES["PInf"]
    return METRIC_CODES["PGen"]
