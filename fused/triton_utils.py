"""Launch and indexing helpers shared by the Triton kernels: math dtypes, [rows, cols] tiles, program ids folded
into grid axis 0, 64-bit offsets where a tensor needs them, float64 scalars as kernel arguments, rounding to the
output dtype, and running a launcher on its tensors' device."""

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Launch keywords of every kernel: libdevice's functions (exp, pow, division, sqrt) keep subnormal results, as eager's
# CUDA kernels and the CPU do; Triton's default (enable_reflect_ftz=True) flushes them to zero. The interpreter
# drops the keyword.
KEEP_SUBNORMALS = {"enable_reflect_ftz": False}

# ---- launch parameters of the memory-bound kernels ----
BLOCK = 2048  # elements per program of the flat kernels
NUM_WARPS = 8
TILE = 2048  # elements per program of the [rows, cols] kernels


def math_dtype(t):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def math_torch_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rows_cols(t):
    """t as [rows, cols] with cols its last dim (a 0-d tensor is one row of one)."""
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


def needs_i64(*sizes):
    return max(sizes) >= 2**31


def tile(cols):
    block_c = min(triton.next_power_of_2(max(cols, 1)), 1024)
    return TILE // block_c if block_c < TILE else 1, block_c


def tile_meta(t, cols, i64_size):
    """A [rows, cols] kernel's tile (block_r, block_c) and its launch keywords for tensor t: MATH, BLOCK_R,
    BLOCK_C, I64 (offsets up to i64_size) and num_warps."""
    block_r, block_c = tile(cols)
    meta = dict(MATH=math_dtype(t), BLOCK_R=block_r, BLOCK_C=block_c, I64=needs_i64(i64_size), num_warps=NUM_WARPS)
    return block_r, block_c, meta


def flat_meta(math, n):
    """A flat kernel's grid over n elements and its launch keywords: MATH, BLOCK, I64 and num_warps."""
    return (triton.cdiv(n, BLOCK),), dict(MATH=math, BLOCK=BLOCK, I64=needs_i64(n + BLOCK), num_warps=NUM_WARPS)


@triton.jit
def flat_offsets(I64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def flat_load(ptr, n, MATH: tl.constexpr, BLOCK: tl.constexpr, I64: tl.constexpr):
    """This program's block of a flat tensor of n elements: (offsets, mask, ptr's values there in MATH)."""
    offs = flat_offsets(I64, BLOCK)
    mask = offs < n
    return offs, mask, tl.load(ptr + offs, mask=mask).to(MATH)


@triton.jit
def program_2d(inner, I64: tl.constexpr = False):
    """(outer, inner) indices of this program in a grid folded into axis 0 (inner fastest). Grid axes 1 and 2
    stop at 65535 programs, which a long row or a large batch would pass; axis 0 goes to 2**31 - 1. With I64 both
    come back as int64, so that block index x block size (a row start, a column) cannot wrap past 2**31."""
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    return pid // inner, pid % inner


@triton.jit
def tile_index(R0, col_block, rows, BLOCK_R: tl.constexpr, cols, BLOCK_C: tl.constexpr, I64: tl.constexpr):
    """Row and column indices of a BLOCK_R x BLOCK_C tile and its mask; int64 throughout with I64."""
    if I64:
        R0 = R0.to(tl.int64)
        col_block = col_block.to(tl.int64)
    r = R0 + tl.arange(0, BLOCK_R)
    c = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    return r[:, None], c[None, :], (r[:, None] < rows) & (c[None, :] < cols)


@triton.jit
def program_tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, I64: tl.constexpr):
    """This program's BLOCK_R x BLOCK_C tile of a rows x cols tensor (tile_index's r, c, mask), one program per
    tile in a grid folded into axis 0 (program_2d), column tiles fastest."""
    row_block, col_block = program_2d(tl.cdiv(cols, BLOCK_C), I64)
    return tile_index(row_block * BLOCK_R, col_block, rows, BLOCK_R, cols, BLOCK_C, I64)


def on_device_of(launcher):
    """Runs the launcher with its first tensor's CUDA device current (a no-op for CPU tensors)."""

    @functools.wraps(launcher)
    def wrapper(first, *args, **kwargs):
        with torch.cuda.device_of(first):
            return launcher(first, *args, **kwargs)

    return wrapper


@triton.jit
def scalar_in(s, MATH: tl.constexpr):
    """A float64 kernel argument as a scalar of the math type (the interpreter passes it as a Python float)."""
    if INTERPRET:
        return tl.full((), s, MATH)
    else:
        return s.to(MATH)


@triton.jit
def to_out(v, DTYPE: tl.constexpr):
    """v converted to the output dtype, rounding to nearest even. The interpreter truncates float32 -> bfloat16,
    so there the rounding is done on the bits (what the GPU's conversion does)."""
    if v.dtype == DTYPE:
        return v
    elif INTERPRET and DTYPE == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(v != v, 0x7FC0, top).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)
