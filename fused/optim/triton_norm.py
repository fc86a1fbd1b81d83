"""Triton kernels of fused::grad_norm and fused::scale_grads_ (pass 1 of an optimizer step and the two passes of
fused.clip_grad_norm_): one launch per gradient dtype (fused/optim/triton_lists.py).

grad_norm is deterministic: each program of a grid stride (8 an SM) adds the partials of its tiles in float64 in a
fixed order (|g|^p summed in float32 a tile, float64 for float64 gradients, as the CPU kernel's chunks) and leaves
that in a fixed slot with its finite flag; the last program to finish (triton_lists.last_program) adds the slots in
a fixed order and writes the norm, the clip coefficient min(1, max_norm / (norm + 1e-6)) and found_inf on the
device: one launch per gradient dtype, no float atomics, no host sync. The sum's order is not the CPU kernel's, so
the norm agrees with it to rounding, not in bits (and is the same from run to run on one GPU model: the stride
depends on its SM count). scale_grads_ multiplies in the CPU kernel's order: its bits."""

import math

import torch
import triton
import triton.language as tl

from fused.optim.functional import norm_dtype
from fused.optim.triton_kernels import clip_value_of, inverse_scale
from fused.optim.triton_lists import (
    TL_DTYPES,
    groups,
    last_program,
    list_ptr,
    norm_ticket,
    program_tensor,
    stride_programs,
    tile_tensor,
)
from fused.triton_math import div, pow, sqrt
from fused.triton_utils import KEEP_SUBNORMALS, scalar_in, to_out

BLOCK = 2048  # elements a program
FINISH_BLOCK = 1024  # slots the finishing program reads at a time
L2, L1, LINF, LP = 0, 1, 2, 3


@triton.jit
def nan_max(x, axis=None):
    """The max of x, NaN if any element is NaN (as torch's inf-norm, and the CPU kernel's nan_max)."""
    nan = x != x
    top = tl.max(tl.where(nan, float("-inf"), x), axis=axis)
    return tl.where(tl.max(nan.to(tl.int32), axis=axis) > 0, float("nan"), top)


@triton.jit
def _finish(partial_ptr, flag_ptr, slots, found_in_ptr, norm_ptr, coef_ptr, found_ptr, inv_p, max_norm,
            NORM: tl.constexpr, HAS_FOUND: tl.constexpr, FINISH: tl.constexpr, NO_CLIP: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    """The norm from every program's slot: lane j combines slots j, j + BLOCK, ... in order, then the lanes are
    combined (a fixed tree). The slots are read past the L1 cache (.cg): other programs wrote them."""
    acc = tl.zeros((BLOCK,), tl.float64)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < slots
        v = tl.load(partial_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        if NORM == 2:
            acc = tl.where(v != v, v, tl.where(acc != acc, acc, tl.maximum(acc, v)))
        else:
            acc = acc + v
        bad = tl.maximum(bad, tl.load(flag_ptr + offs, mask=m, other=0, cache_modifier=".cg"))
    if NORM == 2:
        total = nan_max(acc)
    else:
        total = tl.sum(acc)
    found = tl.max(bad) > 0
    if HAS_FOUND:
        found = found | (tl.load(found_in_ptr) != 0.0)
    tl.store(found_ptr, tl.where(found, 1.0, 0.0).to(tl.float32))
    if FINISH:
        if NORM == 0:
            norm = sqrt(total)
        elif NORM == 3:
            norm = pow(total, scalar_in(inv_p, tl.float64))
        else:
            norm = total
        if NO_CLIP:
            coef = tl.full((), 1.0, tl.float64)
        else:
            # inf and NaN propagate as in torch's clip_grad_norm_: inf -> coefficient 0, NaN -> NaN
            coef = tl.minimum(div(scalar_in(max_norm, tl.float64), norm + 1e-6), 1.0)
            coef = tl.where(norm != norm, norm, coef)
        tl.store(coef_ptr, coef)
        out = norm_ptr.dtype.element_ty
        if out == tl.float64:
            tl.store(norm_ptr, norm)
        else:  # 16-bit through float32, as the CUDA C++ kernel
            tl.store(norm_ptr, to_out(norm.to(tl.float32), out))
    else:
        tl.store(norm_ptr, total)


@triton.jit(do_not_specialize=["n", "tiles", "first_slot", "slots"])
def _norm_kernel(
    table, tensor_of, n, tiles, first_slot, slots, partial_ptr, flag_ptr, scale_ptr, ticket_ptr, found_in_ptr,
    norm_ptr, coef_ptr, found_ptr, p: tl.float64, inv_p: tl.float64, max_norm: tl.float64, clip_value: tl.float64,
    G: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr, CLIP: tl.constexpr, MATH: tl.constexpr,
    HAS_FOUND: tl.constexpr, FINISH: tl.constexpr, NO_CLIP: tl.constexpr, BLOCK: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
):  # fmt: skip
    """The partial (|g|^p summed, or max |g|) and finite flag of tiles pid, pid + programs, ... of the group (a
    grid stride: slots as few as programs, so the finish reads few) into this program's slot; the last of the
    `slots` programs of all the gradient groups' launches then finishes (_finish)."""
    acc = tl.full((), 0.0, tl.float64)
    bad = tl.full((), 0, tl.int32)
    for j in range(tl.program_id(0), tiles, tl.num_programs(0)):
        i, tile, numel, _ = tile_tensor(table, tensor_of, n, 1, j)
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(list_ptr(table, n, i, 0, G) + offs, mask=mask, other=0.0).to(MATH)
        bad = tl.maximum(bad, tl.max(((x - x) != 0.0).to(tl.int32)))  # x - x is NaN exactly for inf and NaN
        x = x * inverse_scale(scale_ptr, HAS_SCALE).to(MATH)
        if CLIP:
            x = clip_value_of(x, clip_value, MATH)
        a = tl.abs(x)
        if NORM == 0:
            part = tl.sum(x * x).to(tl.float64)
        elif NORM == 1:
            part = tl.sum(a).to(tl.float64)
        elif NORM == 2:
            part = nan_max(a).to(tl.float64)
        else:
            part = tl.sum(tl.where(mask, pow(a, scalar_in(p, MATH)), 0.0)).to(tl.float64)
        if NORM == 2:
            acc = tl.where(part != part, part, tl.where(acc != acc, acc, tl.maximum(acc, part)))
        else:
            acc = acc + part
    slot = first_slot + tl.program_id(0)
    tl.store(partial_ptr + slot, acc)
    tl.store(flag_ptr + slot, bad)
    if last_program(ticket_ptr, slots):
        _finish(partial_ptr, flag_ptr, slots, found_in_ptr, norm_ptr, coef_ptr, found_ptr, inv_p, max_norm, NORM,
                HAS_FOUND, FINISH, NO_CLIP, FINISH_BLOCK)  # fmt: skip


@triton.jit
def _finish_kernel(partial_ptr, flag_ptr, found_in_ptr, norm_ptr, coef_ptr, found_ptr, inv_p: tl.float64,
                   max_norm: tl.float64, NORM: tl.constexpr, HAS_FOUND: tl.constexpr, FINISH: tl.constexpr,
                   NO_CLIP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The finish alone, for a call with no gradient elements (no program to finish it)."""
    _finish(partial_ptr, flag_ptr, 0, found_in_ptr, norm_ptr, coef_ptr, found_ptr, inv_p, max_norm, NORM, HAS_FOUND,
            FINISH, NO_CLIP, BLOCK)  # fmt: skip


def _check_norm_args(norm_type, max_norm, clip_value):
    """csrc/optim/optim_args.h's check_norm_args."""
    if not norm_type > 0:
        raise RuntimeError(f"fused.grad_norm: norm_type must be > 0 or inf, got {norm_type}")
    for name, v in (("max_norm", max_norm), ("clip_value", clip_value)):
        if not v >= 0:
            raise RuntimeError(f"fused.grad_norm: {name} must be >= 0, got {v}")


def grad_norm(grads, found_inf, grad_scale, norm_type, max_norm, clip_value, finish=True):
    """fused::grad_norm on Triton: (norm, clip_coef, found_inf), device scalars as the CPU op returns them
    (finish=False: the float64 sum of |g|^p, or max |g|, for an all-reduce before the finish)."""
    _check_norm_args(norm_type, max_norm, clip_value)
    device = grads[0].device if grads else (found_inf if found_inf is not None else grad_scale).device
    kind = L2 if norm_type == 2 else L1 if norm_type == 1 else LINF if math.isinf(norm_type) else LP
    f64 = dict(dtype=torch.float64, device=device)
    norm = torch.empty((), **(f64 if not finish else dict(f64, dtype=norm_dtype(grads))))
    coef = torch.empty(() if finish else (0,), **f64)
    found = torch.empty((), dtype=torch.float32, device=device)
    with torch.cuda.device_of(found):
        grps = groups([list(grads)], BLOCK) if grads else []
        programs = [stride_programs(g.programs, device) for g in grps]
        slots = sum(programs)
        partials = torch.empty(max(slots, 1), **f64)
        flags = torch.empty(max(slots, 1), dtype=torch.int32, device=device)
        ends = dict(
            found_in_ptr=found_inf if found_inf is not None else found, norm_ptr=norm,
            coef_ptr=coef if finish else partials, found_ptr=found, inv_p=1.0 / float(norm_type),
            max_norm=float(max_norm), NORM=kind, HAS_FOUND=found_inf is not None, FINISH=bool(finish),
            NO_CLIP=math.isinf(max_norm),
        )  # fmt: skip
        if not slots:
            _finish_kernel[(1,)](partials, flags, **ends, BLOCK=FINISH_BLOCK, **KEEP_SUBNORMALS)
        first = 0
        for grp, launched in zip(grps, programs):
            (g_t,) = grp.dtypes
            _norm_kernel[(launched,)](
                grp.table, grp.tensor_of, len(grp.indices), grp.programs, first, slots, partials, flags,
                grad_scale if grad_scale is not None else partials, norm_ticket(device), p=float(norm_type),
                clip_value=float(clip_value), G=TL_DTYPES[g_t], HAS_SCALE=grad_scale is not None,
                CLIP=not math.isinf(clip_value), MATH=tl.float64 if g_t == torch.float64 else tl.float32,
                BLOCK=BLOCK, FINISH_BLOCK=FINISH_BLOCK, **ends, **KEEP_SUBNORMALS
            )  # fmt: skip
            first += launched
    return norm, coef, found


@triton.jit
def _scale_grads_kernel(table, tensor_of, n, coef_ptr, G: tl.constexpr, MATH: tl.constexpr, BLOCK: tl.constexpr):
    i, tile, numel, _ = program_tensor(table, tensor_of, n, 1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g_ptr = list_ptr(table, n, i, 0, G)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(MATH) * tl.load(coef_ptr).to(MATH)
    tl.store(g_ptr + offs, to_out(g, G), mask=mask)


def scale_grads_(grads, clip_coef):
    """fused::scale_grads_ on Triton: grads *= clip_coef (a float64 device scalar) in the math type."""
    if not grads:
        return
    with torch.cuda.device_of(grads[0]):
        for grp in groups([list(grads)], BLOCK):
            (g_t,) = grp.dtypes
            _scale_grads_kernel[(grp.programs,)](
                grp.table, grp.tensor_of, len(grp.indices), clip_coef, G=TL_DTYPES[g_t],
                MATH=tl.float64 if g_t == torch.float64 else tl.float32, BLOCK=BLOCK, **KEEP_SUBNORMALS
            )  # fmt: skip
