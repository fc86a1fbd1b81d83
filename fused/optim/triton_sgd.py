"""Triton kernel of fused::sgd_step_: one launch per combination of dtypes (fused/optim/triton_lists.py), the CPU
kernel's formulas (csrc/optim/optim_cpu.cpp, sgd_step_cpu) with its fmas, so its bits from the same inputs. The
device scalars (clip coefficient, loss scale, found_inf) and the step counters (a momentum buffer's first step)
are read by the kernel: a step skipped on found_inf stores nothing, and nothing syncs with the host; the last
program of a launch advances the group's step counters (triton_lists.advance_steps): a step is its launches."""

import math

import torch
import triton
import triton.language as tl

from fused.optim import triton_lists
from fused.optim.triton_kernels import advance_empty_steps, seed_of, store_param, tensor_key, update_end, update_grad
from fused.optim.triton_lists import TL_DTYPES, groups, list_ptr, per_tensor, program_tensor, tl_dtype
from fused.triton_utils import BLOCK, KEEP_SUBNORMALS, to_out


@triton.jit(do_not_specialize=["n", "seed"])
def _sgd_kernel(
    table, tensor_of, n, hyper_ptr, coef_ptr, scale_ptr, found_ptr, ticket_ptr, seed, clip_value: tl.float64,
    P: tl.constexpr, G: tl.constexpr, B: tl.constexpr, MODEL: tl.constexpr, MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_SCALE: tl.constexpr, CLIP: tl.constexpr,
    STOCHASTIC: tl.constexpr, MASTER: tl.constexpr, WRITE_GRADS: tl.constexpr, MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One tile of BLOCK elements of one tensor of the group (table: the lists params, grads, momentum_buffers,
    steps, model_params; B: the momentum buffers' dtype)."""
    i, tile, numel, t = program_tensor(table, tensor_of, n, 5)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    end = update_end(found_ptr, numel)
    mask = offs < end
    h = hyper_ptr + t * 4  # lr, momentum, dampening, weight_decay
    lr, momentum, dampening, wd = tl.load(h), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3)
    p_ptr = list_ptr(table, n, i, 0, P)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(MATH)
    d = update_grad(list_ptr(table, n, i, 1, G), offs, mask, end, coef_ptr, scale_ptr, clip_value, MATH, HAS_SCALE,
                    CLIP, WRITE_GRADS)  # fmt: skip
    if MAXIMIZE:
        d = 0.0 - d  # the CPU kernel's 0 - g: a zero gradient stays +0
    d = tl.where(wd != 0.0, tl.fma(p, wd.to(MATH), d), d)
    if MOMENTUM:
        b_ptr = list_ptr(table, n, i, 2, B)
        first = tl.load(list_ptr(table, n, i, 3, tl.float32)) == 0.0  # the buffer's first step: it is d
        mom = momentum.to(MATH)
        old = tl.load(b_ptr + offs, mask=mask, other=0.0).to(MATH)
        buf = tl.where(first, d, tl.fma(old, mom, d * (1.0 - dampening).to(MATH)))
        tl.store(b_ptr + offs, to_out(buf, B), mask=mask)
        if NESTEROV:
            d = tl.fma(buf, mom, d)
        else:
            d = buf
    p = tl.fma(d, (-lr).to(MATH), p)
    store_param(p, p_ptr, offs, mask, tensor_key(seed, t), STOCHASTIC)
    if MASTER:
        tl.store(list_ptr(table, n, i, 4, MODEL) + offs, to_out(p, MODEL), mask=mask)
    if MOMENTUM:
        triton_lists.advance_steps(ticket_ptr, table, n, 3, found_ptr)


def sgd_step_(
    params, grads, momentum_buffers, steps, lr, momentum, dampening, weight_decay, nesterov, maximize, clip_coef,
    grad_scale, found_inf, clip_value, model_params, sr_seed=None, hyper=None, write_grads=False,
):  # fmt: skip
    """fused::sgd_step_ on Triton: the op's arguments (csrc/optim/optim_schema.cpp); the CPU kernel's checks of
    the lists are not repeated here (the optimizers build them)."""
    if clip_value < 0:
        raise RuntimeError(f"fused.sgd_step_: clip_value must be >= 0, got {clip_value}")
    if not params:
        return
    use_momentum = momentum != 0
    with torch.cuda.device_of(params[0]):
        n = len(params)
        rows = hyper.tolist() if hyper is not None else [[lr, momentum, dampening, weight_decay]] * n
        table = per_tensor(rows, params[0].device)
        seed = seed_of(sr_seed)
        bufs, counts = (momentum_buffers, steps) if use_momentum else (None, None)
        grps = groups([params, grads, bufs, counts, model_params or None], BLOCK, keep_empty=use_momentum)
        for grp in grps:
            if not grp.programs:
                continue
            p_t, g_t, b_t = grp.dtypes[:3]
            _sgd_kernel[(grp.programs,)](
                grp.table, grp.tensor_of, len(grp.indices), table, clip_coef,
                grad_scale if grad_scale is not None else found_inf, found_inf,
                triton_lists.step_ticket(params[0].device), 0 if seed is None else seed, float(clip_value),
                P=TL_DTYPES[p_t], G=TL_DTYPES[g_t], B=tl_dtype(b_t, p_t), MODEL=tl_dtype(grp.dtypes[4], p_t),
                MOMENTUM=use_momentum, NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
                HAS_SCALE=grad_scale is not None, CLIP=not math.isinf(clip_value),
                STOCHASTIC=seed is not None and p_t == torch.bfloat16, MASTER=bool(model_params),
                WRITE_GRADS=bool(write_grads), MATH=tl.float64 if p_t == torch.float64 else tl.float32, BLOCK=BLOCK,
                enable_fp_fusion=False,  # only the CPU kernel's fmas (tl.fma): no other product left unrounded
                **KEEP_SUBNORMALS,
            )  # fmt: skip
        if use_momentum:
            advance_empty_steps(grps, steps, found_inf)
