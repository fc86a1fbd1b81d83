"""Registration of the fused elementwise ops: fake kernels (torch.compile), autograd (backward made of
fused ops), and the CUDA-device routing between the CUDA C++ and Triton kernels."""

import torch

from fused import _checks
from fused._autograd import public, register_autograd
from fused._backend import register_gpu
from fused._codes import MAX_CHAIN, parse_op

TRITON = "fused.elementwise.triton_kernels"


# ---- checks shared by the fake kernels and the public wrappers ----
def check_bias_act(op, x, bias, act):
    _checks.check_act(op, act)
    _checks.check_floating(op, "x", x)
    if bias is not None:
        _checks.check_bias(op, x, bias)


def check_glu(op, gate, up, act):
    _checks.check_act(op, act)
    _checks.check_floating(op, "gate", gate)
    _checks.check_like(op, "up", up, "gate", gate)
    _checks.check_same_shape(op, "up", up, "gate", gate)


def check_bias_dropout_add(op, x, bias, residual, p):
    _checks.check_floating(op, "x", x)
    if bias is not None:
        _checks.check_bias(op, x, bias)
    _checks.check_like(op, "residual", residual, "x", x)
    _checks.check_same_shape(op, "residual", residual, "x", x)
    if not 0.0 <= p <= 1.0:
        raise RuntimeError(f"fused.{op}: p must be in [0, 1], got {p}")


def check_unary_chain(op, x, ops):
    _checks.check_floating(op, "x", x)
    for spec in ops:
        parse_op(op, spec)


def _empty_like(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


# ---- fake kernels ----
@torch.library.register_fake("fused::bias_act")
def _(x, bias=None, act="gelu"):
    check_bias_act("bias_act", x, bias, act)
    return _empty_like(x)


@torch.library.register_fake("fused::bias_act_backward")
def _(grad, x, bias, act):
    check_bias_act("bias_act_backward", x, bias, act)
    return _empty_like(x), _empty_like(bias) if bias is not None else x.new_empty(0)


@torch.library.register_fake("fused::glu")
def _(gate, up, act="silu"):
    check_glu("glu", gate, up, act)
    return _empty_like(gate)


@torch.library.register_fake("fused::glu_backward")
def _(grad, gate, up, act):
    check_glu("glu_backward", gate, up, act)
    return _empty_like(gate), _empty_like(gate)


@torch.library.register_fake("fused::bias_dropout_add_seeded")
def _(x, bias, residual, p, seed):
    check_bias_dropout_add("bias_dropout_add", x, bias, residual, p)
    return _empty_like(x)


@torch.library.register_fake("fused::dropout_backward")
def _(grad, p, seed, bias_grad):
    return _empty_like(grad), grad.new_empty(grad.shape[-1] if bias_grad else 0)


@torch.library.register_fake("fused::unary_chain")
def _(x, ops):
    check_unary_chain("unary_chain", x, ops)
    return _empty_like(x)


@torch.library.register_fake("fused::unary_chain_backward")
def _(grad, x, ops):
    check_unary_chain("unary_chain_backward", x, ops)
    return _empty_like(x)


# ---- autograd ----
def _tensors_and_act_setup(ctx, inputs, output):
    """setup_context of bias_act(x, bias, act) and glu(gate, up, act): both tensors saved, act kept."""
    *tensors, act = inputs
    ctx.save_for_backward(*tensors)
    ctx.act = act


def _bias_act_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x, grad_bias = torch.ops.fused.bias_act_backward(grad, x, bias, ctx.act)
    return grad_x, grad_bias if bias is not None else None, None


bias_act = register_autograd("bias_act", _bias_act_backward, _tensors_and_act_setup)


def _glu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = torch.ops.fused.glu_backward(grad, gate, up, ctx.act)
    return grad_gate, grad_up, None


glu = register_autograd("glu", _glu_backward, _tensors_and_act_setup)


def _dropout_setup(ctx, inputs, output):
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(seed)
    ctx.p = p
    ctx.has_bias = bias is not None


def _dropout_backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    grad_x, grad_bias = torch.ops.fused.dropout_backward(grad, ctx.p, seed, ctx.has_bias)
    return grad_x, grad_bias if ctx.has_bias else None, grad, None, None


bias_dropout_add_seeded = register_autograd("bias_dropout_add_seeded", _dropout_backward, _dropout_setup)


def _unary_chain_setup(ctx, inputs, output):
    x, ops = inputs
    ctx.save_for_backward(x)
    ctx.ops = ops


def _unary_chain_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.fused.unary_chain_backward(grad, x, ctx.ops), None


unary_chain = register_autograd("unary_chain", _unary_chain_backward, _unary_chain_setup)


# ---- bias_dropout_add: a composite that draws the seed, so the seeded op stays a pure function ----
def _bias_dropout_add(x, bias, residual, p=0.1, training=True):
    check_bias_dropout_add("bias_dropout_add", x, bias, residual, p)
    if training and p > 0 and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # The seed is drawn on the host: a captured graph would replay one mask forever, silently.
        raise RuntimeError(
            "fused.bias_dropout_add: training=True with p > 0 cannot be captured in a CUDA graph (the "
            "dropout seed is drawn on the host at capture, so every replay would drop the same "
            "elements); capture with training=False, or run the dropout outside the graph"
        )
    if training and p > 0:
        seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)  # torch's default CPU generator
    else:
        p, seed = 0.0, torch.zeros((), dtype=torch.int64)
    return bias_dropout_add_seeded(x, bias, residual, p, seed)


_lib = torch.library.Library("fused", "IMPL")
_lib.impl("bias_dropout_add", _bias_dropout_add, "CompositeImplicitAutograd")
bias_dropout_add = public("bias_dropout_add", _bias_dropout_add)


# ---- CUDA tensors: CUDA C++ (fused::cuda_<op>, when compiled) or Triton ----
def chain_in_pieces(chain_op, chain_backward_op, max_ops):
    """unary_chain and unary_chain_backward for a kernel that takes at most max_ops ops per launch: longer chains
    run in pieces, kept in float32 between pieces for 16-bit inputs (as one launch keeps them in registers), and
    the backward recomputes each piece's input, then runs the pieces' backwards last to first."""

    def pieces(ops):
        return [ops[i : i + max_ops] for i in range(0, len(ops), max_ops)]

    def forward(x, ops):
        if len(ops) <= max_ops:
            return chain_op(x, ops)
        h = x.float() if x.element_size() < 4 else x
        for piece in pieces(ops):
            h = chain_op(h, piece)
        return h.to(x.dtype)

    def backward(grad, x, ops):
        if len(ops) <= max_ops:
            return chain_backward_op(grad, x, ops)
        parts = pieces(ops)
        inputs = [x.float() if x.element_size() < 4 else x]
        for piece in parts[:-1]:
            inputs.append(chain_op(inputs[-1], piece))
        g = grad.to(inputs[0].dtype)
        for piece, h in zip(reversed(parts), reversed(inputs)):
            g = chain_backward_op(g, h, piece)
        return g.to(x.dtype)

    return forward, backward


for _op in ("bias_act", "bias_act_backward", "glu", "glu_backward", "bias_dropout_add_seeded", "dropout_backward"):
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}")
_cuda_chain = chain_in_pieces(
    lambda x, ops: torch.ops.fused.cuda_unary_chain(x, ops),
    lambda g, x, ops: torch.ops.fused.cuda_unary_chain_backward(g, x, ops),
    MAX_CHAIN,
)
for _op, _call in zip(("unary_chain", "unary_chain_backward"), _cuda_chain):
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}", cuda_call=_call)
