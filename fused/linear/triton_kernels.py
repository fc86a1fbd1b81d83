"""Triton kernels of the fused linear family.

linear_act_fwd: a tiled GEMM (tl.dot, fp32 accumulation, tensor cores for fp16/bf16, tf32 for fp32 only when
torch.backends.cuda.matmul.allow_tf32 allows it) with bias + activation in its epilogue (the activations of
fused/triton_math.py: fused.bias_act's bits), autotuned over tile configurations suited to Hopper per
(power-of-two bucket of M, N, K). linear_act_grad_pre: grad * act'(saved) and the bias gradient's column sums in
one pass (per-row-chunk partial sums, added in a fixed order: deterministic).

Launchers take the op's own arguments and run on CPU tensors under TRITON_INTERPRET=1 (a small fixed tile then,
no autotuning)."""

import math

import torch
import triton
import triton.language as tl

from fused.linear.ops import NEEDS_PRE, check_grad_pre, check_linear
from fused.triton_math import act_fwd, act_grad
from fused.triton_utils import INTERPRET, KEEP_SUBNORMALS, on_device_of, program_2d


@triton.jit
def _act_grad_from_saved(s, ACT: tl.constexpr):
    """act' from what autograd saved (as csrc/linear/linear_math.h): the pre-activation for gelu, gelu_tanh and
    silu; the output for relu, sigmoid and tanh, as eager autograd does."""
    if ACT == "sigmoid":
        return s * (1.0 - s)
    elif ACT == "tanh":
        return 1.0 - s * s
    else:  # relu(x) > 0 iff x > 0, so relu' is the same from either
        return act_grad(s, ACT)


def _config(bm, bn, bk, stages, warps):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=stages, num_warps=warps
    )


# Hopper (228 KB shared memory per SM): large 16-bit tiles with 3-4 stages; BLOCK_K 32 keeps fp32 tiles in budget.
# Configurations that do not fit a given dtype fail to launch (out of shared memory) and the autotuner drops them.
HOPPER_CONFIGS = [
    _config(128, 256, 64, 3, 8),
    _config(256, 128, 64, 3, 8),
    _config(128, 128, 64, 4, 8),
    _config(128, 128, 64, 4, 4),
    _config(64, 256, 64, 4, 4),
    _config(128, 64, 64, 4, 4),
    _config(64, 128, 64, 4, 4),
    _config(128, 128, 32, 4, 4),
    _config(128, 256, 32, 3, 8),
]


@triton.jit
def _linear_act_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    pre_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    ACT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row-tiles share each column-tile of the weight while it is in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap around (always in bounds, never stored): no masks in the K loop.
    rows = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    # int64 row offsets: tensors past 2^31 elements stay addressable.
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]: W.T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (triton 3.9): exact products in fp32 instead
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue: bias and activation in fp32, one rounding to the output dtype.
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SAVE_PRE:
        tl.store(pre_ptr + out_offs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
    acc = act_fwd(acc, ACT)  # the elementwise kernels' activations: bias_act's bits, libdevice on a GPU
    tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
_linear_act_fixed = _even_k(_linear_act_kernel)
# Tuned per GEMM shape (and dtype, which the autotuner adds): the epilogue hardly moves the best tile, so each
# activation reuses it instead of re-tuning. M (batch x sequence) changes with every batch in serving, so the key
# is its bucket M_BUCKET (an argument the kernel never reads): one tuning per power of two, not per M.
_linear_act_tuned = triton.autotune(HOPPER_CONFIGS, key=["M_BUCKET", "N", "K"])(_even_k(_linear_act_kernel))


def m_bucket(M):
    """The autotuning key's M: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(M))


def _check_gpu_dtype(op, t):
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"fused.{op}: the Triton kernel takes float32, float16 or bfloat16, got {t.dtype}")


def dot_precision(dtype):
    """tl.dot's input precision: tf32 tensor cores for fp32 only where torch allows them for matmuls (the new
    fp32_precision setting where torch has it: reading allow_tf32 after it was used raises)."""
    if dtype != torch.float32:
        return "ieee"
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return "tf32" if matmul.allow_tf32 else "ieee"
    if precision == "none":  # inherits the global setting
        precision = torch.backends.fp32_precision
    return "tf32" if precision == "tf32" else "ieee"


@on_device_of
def linear_act_fwd(x, weight, bias, act, save_pre):
    """(act(x @ weight.T + bias), the pre-activation when save_pre and act needs it else an empty tensor)."""
    check_linear("linear_act", x, weight, bias, act)
    _check_gpu_dtype("linear_act", x)
    K, N = x.shape[-1], weight.shape[0]
    M = math.prod(x.shape[:-1])
    x2 = x.reshape(M, K)
    out_shape = (*x.shape[:-1], N)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    keep_pre = save_pre and act in NEEDS_PRE
    pre = torch.empty(M, N, dtype=x.dtype, device=x.device) if keep_pre else x.new_empty(0)
    if M and N:
        args = (
            x2,
            weight,
            bias.contiguous() if bias is not None else y,
            y,
            pre if keep_pre else y,
            M,
            N,
            K,
            m_bucket(M),
            x2.stride(0),
            x2.stride(1),
            weight.stride(0),
            weight.stride(1),
        )
        flags = {
            "HAS_BIAS": bias is not None,
            "SAVE_PRE": keep_pre,
            "ACT": act,
            "PRECISION": dot_precision(x.dtype),
            "UPCAST": bool(INTERPRET) and x.dtype == torch.bfloat16,
        }
        if INTERPRET:
            _linear_act_fixed[(triton.cdiv(M, 32) * triton.cdiv(N, 32),)](
                *args, **flags, BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, **KEEP_SUBNORMALS
            )
        else:
            grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
            _linear_act_tuned[grid](*args, **flags, **KEEP_SUBNORMALS)
    return y.view(out_shape), pre.view(out_shape) if keep_pre else pre


@triton.jit
def _grad_pre_kernel(
    grad_ptr,
    saved_ptr,
    grad_pre_ptr,
    partial_ptr,
    M,
    N,
    ROWS_PER_CHUNK,
    ACT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (chunk, column tile), folded into grid axis 0 (axis 1 would stop at 65535 column tiles): grad_pre
    # for ROWS_PER_CHUNK rows, and their column sums into partial[chunk].
    chunk, pid_n = program_2d(tl.cdiv(N, BLOCK_N))
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    sums = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row0 = chunk * ROWS_PER_CHUNK
    for r in range(row0, min(row0 + ROWS_PER_CHUNK, M), BLOCK_M):
        rows = r + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT != "identity":
            s = tl.load(saved_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if ACT == "relu":  # a select, as eager's threshold_backward
                g = tl.where(s <= 0.0, 0.0, g)
            else:
                g = g * _act_grad_from_saved(s, ACT)
        tl.store(grad_pre_ptr + offs, g.to(grad_pre_ptr.dtype.element_ty), mask=mask)
        if BIAS_GRAD:
            sums += tl.sum(tl.where(mask, g, 0.0), axis=0)
    if BIAS_GRAD:
        tl.store(partial_ptr + chunk * N + cols, sums, mask=col_ok)


@on_device_of
def linear_act_grad_pre(grad, saved, act, bias_grad):
    """(grad * act'(saved), its sum over every leading dim when bias_grad else an empty tensor)."""
    check_grad_pre("linear_act_grad_pre", grad, saved, act)
    _check_gpu_dtype("linear_act_grad_pre", grad)
    grad, saved = grad.contiguous(), saved.contiguous()
    N = grad.shape[-1]
    M = math.prod(grad.shape[:-1])
    grad_pre = torch.empty_like(grad)
    if not bias_grad:
        grad_bias = grad.new_empty(0)
    if M == 0 or N == 0:
        return grad_pre, grad.new_zeros(N) if bias_grad else grad_bias
    block_m, block_n = (16, 32) if INTERPRET else (32, 128)
    rows_per_chunk = 256  # fixed: the summation order depends on the shape only
    chunks = triton.cdiv(M, rows_per_chunk)
    partial = torch.empty(chunks, N, dtype=torch.float32, device=grad.device) if bias_grad else grad_pre
    _grad_pre_kernel[(chunks * triton.cdiv(N, block_n),)](
        grad,
        saved,
        grad_pre,
        partial,
        M,
        N,
        rows_per_chunk,
        ACT=act,
        BIAS_GRAD=bias_grad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
        **KEEP_SUBNORMALS,
    )
    if bias_grad:
        grad_bias = partial.sum(0).to(grad.dtype)
    return grad_pre, grad_bias
