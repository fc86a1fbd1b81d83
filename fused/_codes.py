"""Activation and unary_chain op codes; csrc/common/op_codes.h holds the same numbers for C++ and CUDA."""
ACT_CODES = {"identity": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "sigmoid": 5, "tanh": 6}

UNARY_CODES = {
    "neg": 0, "abs": 1, "square": 2, "sqrt": 3, "rsqrt": 4, "exp": 5, "log": 6, "sin": 7, "cos": 8, "tanh": 9,
    "sigmoid": 10, "relu": 11, "gelu": 12, "gelu_tanh": 13, "silu": 14, "reciprocal": 15,
    "add": 16, "mul": 17, "pow": 18, "clamp_min": 19, "clamp_max": 20,
}
SCALAR_OPS = ("add", "mul", "pow", "clamp_min", "clamp_max")


def parse_op(op, spec):
    """'name' or 'name:value' -> (name, code, value): the encoding of unary_chain's `ops` in the op schema."""
    name, _, value = spec.partition(":")
    if name not in UNARY_CODES:
        raise RuntimeError(f"fused.{op}: unknown op {name!r}; expected one of {' '.join(UNARY_CODES)}")
    if (name in SCALAR_OPS) != bool(value):
        need = "needs a scalar, as (name, value)" if name in SCALAR_OPS else "takes no scalar"
        raise RuntimeError(f"fused.{op}: op {name!r} {need}")
    return name, UNARY_CODES[name], float(value) if value else 0.0
