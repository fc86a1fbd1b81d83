"""The 8-bit Adam state of fused.optim.Adam/AdamW(state_dtype="int8") in torch: the same bits as the CPU kernel's
codes (csrc/optim/quantize_cpu.h, where the code maps are explained), for loading float state into an 8-bit
optimizer and for reading 8-bit state back as float (dequantize_state).

Blocks of BLOCK elements in the tensor's memory order, one float32 scale each:
  exp_avg (int8):                    m = sign(q) * (q / 127)^2 * scale,   scale = max |m| of the block
  exp_avg_sq, max_exp_avg_sq (uint8): sqrt(v) = (q / 255)^2 * scale,     scale = max sqrt(v) of the block
Codes round to nearest here; the step rounds exp_avg_sq's codes stochastically, which encode_ also writes when
given the tensor's dither key (csrc/optim/quantize_cpu.h's dithered_code, rounding_keys.h's dither_word)."""

import math

import torch

from fused.optim.functional import local

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep fp32 state: their scales and codes would save little
CODES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8, "max_exp_avg_sq": torch.uint8}
LEVELS = {torch.int8: 127.0, torch.uint8: 255.0}


def _flat(t):
    """t's elements in memory order (t dense: no gaps, no overlap), as a 1-D view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def block_count(numel):
    """The scales of numel coded values: one per block of BLOCK, the last one partial."""
    return -(-numel // BLOCK)


def scales_like(codes):
    """The zero scales of a code tensor. For codes that are a DTensor (the moments of an FSDP2 parameter) each rank
    quantizes its own shard, so the scales are a DTensor too, sharded on the same mesh dimensions: each rank holds
    the scales of its shard, padded to the block count of the largest shard, so that every rank holds the same
    number and torch.distributed.checkpoint saves and restores each rank's scales (a plain tensor there would count
    as replicated: one rank's scales saved, loaded on every rank). local_scales gives the unpadded local ones.
    (Codes 0 and scale 0 decode to 0.)"""
    if local(codes) is codes:
        return torch.zeros(block_count(codes.numel()), dtype=torch.float32, device=codes.device)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, shape, ranks = codes.device_mesh, list(codes.shape), 1
    placements = []
    for dim, placement in enumerate(codes.placements):
        if placement.is_shard():  # torch.chunk's layout: the first shard is the largest
            shape[placement.dim] = -(-shape[placement.dim] // mesh.size(dim))
            ranks *= mesh.size(dim)
            placements.append(Shard(0))
        else:
            placements.append(Replicate())
    blocks = block_count(math.prod(shape))
    padded = torch.zeros(blocks, dtype=torch.float32, device=local(codes).device)
    return DTensor.from_local(
        padded, mesh, placements, run_check=False, shape=torch.Size([blocks * ranks]), stride=(1,)
    )


def local_scales(codes, scales):
    """The scales of this rank's codes (the kernels' [ceil(numel / 256)]): scales itself for plain codes."""
    shard = local(scales)
    return scales if shard is scales else shard[: block_count(local(codes).numel())]


def _sqrt(x):
    """The correctly rounded float32 square root, as the kernels take it: torch's CPU sqrt of float32 is not (it
    differs from IEEE in about 1 of 5 results), and a root of float input taken in float64 rounds right."""
    return x.double().sqrt().float()


M32 = 0xFFFFFFFF


def _mul32(x, c):
    """x * c mod 2^32 for x in [0, 2^32) (int64) and a 32-bit constant c, without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def dither_words(key, j):
    """rounding_keys.h's dither_word(key, j) for word indices j (int64 tensor), as int64 in [0, 2^32)."""
    x = ((j & M32) + (((key & M32) + _mul32(j >> 32, 0x9E3779B9)) & M32)) & M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15) ^ ((key >> 32) & M32), 0x846CA68B)
    return x ^ (x >> 16)


def _fma_f32(a, b, c):
    """fma(a, b, c) of float32 tensors rounded once: in float64 the products of these codes' floats (< 2^33, 24-bit
    significands) and the sum are exact."""
    return (a.double() * b.double() + c.double()).float()


def _dithered_codes(t, first, dither_key):
    """quantize_cpu.h's dithered_code of t (float32 [rows, BLOCK]; element index first + flat position)."""
    i = first + torch.arange(t.numel(), device=t.device).view(t.shape)
    word = dither_words(dither_key, i // 2)
    half = torch.where(i % 2 == 0, word >> 16, word & 0xFFFF)
    d = (2 * half + 1).float() * 2.0**-17
    c = t.floor()
    c4 = (c * c) * (c * c)
    nxt2 = (c + 1) * (c + 1)
    gap, above = _fma_f32(nxt2, nxt2, -c4), _fma_f32(t * t, t * t, -c4)
    d = torch.where(c == 0, 0.0625, d)
    return torch.where(d * gap < above, c + 1, c)


def encode_(codes, scales, values, rows_per_chunk=16384, dither_key=None):
    """Writes codes (int8 or uint8, as the kernel would) and scales of `values` (float, shaped like codes), in chunks
    of rows_per_chunk blocks (the float64 roots stay small). dither_key (uint8 codes: the step's exp_avg_sq key,
    rounding_key(state_seed, tensor, 2) mod 2^64): rounded stochastically as the step rounds them."""
    x = torch.empty_like(codes, dtype=torch.float32).copy_(values)
    n, blocks = codes.numel(), scales.numel()
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=codes.device)
    padded[:n] = _flat(x)
    padded = padded.view(blocks, BLOCK)
    q = torch.empty_like(padded)
    for r0 in range(0, blocks, rows_per_chunk):
        rows = padded[r0 : r0 + rows_per_chunk]
        q[r0 : r0 + rows_per_chunk], scales[r0 : r0 + rows_per_chunk] = _encode_rows(
            rows, codes.dtype, r0 * BLOCK, dither_key
        )
    _flat(codes).copy_(q.flatten()[:n].to(codes.dtype))


def _encode_rows(rows, dtype, first=0, dither_key=None):
    """The codes (as float) and scales of whole blocks, one a row (the first from element `first`)."""
    signed = dtype == torch.int8
    mag = rows.abs() if signed else _sqrt(rows)
    scale = mag.amax(dim=1)  # NaN propagates, as in the kernel
    usable = (scale > 0) & (scale <= torch.finfo(torch.float32).max)
    inv = 1.0 / scale[:, None]  # mag / scale as mag * (1 / scale), but for a denormal scale (inverse inf)
    ratio = torch.where(torch.isinf(inv), mag / scale[:, None], mag * inv)
    t = _sqrt(ratio) * LEVELS[dtype]
    q = torch.round(t) if dither_key is None else _dithered_codes(t, first, dither_key)
    q = torch.where(usable[:, None], q, 0.0)
    if signed:
        q = torch.where(rows < 0, -q, q)
    return q, scale


def decode(codes, scales):
    """The float32 values of codes and scales, shaped (and strided) like codes (a DTensor for DTensor codes: each
    rank decodes its shard with its own scales)."""
    if local(codes) is not codes:
        from torch.distributed.tensor import DTensor

        values = decode(local(codes), local_scales(codes, scales))
        return DTensor.from_local(
            values, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape, stride=codes.stride()
        )
    c = _flat(codes).float()
    s = scales.repeat_interleave(BLOCK)[: codes.numel()]
    if codes.dtype == torch.int8:
        x = c * c.abs() * (s / 16129.0)
    else:
        w = c * c * (s / 65025.0)
        x = w * w
    out = torch.empty_like(codes, dtype=torch.float32)
    _flat(out).copy_(x)
    return out


def dequantize_state(state_dict):
    """A state dict of fused.optim.Adam/AdamW with low-bit state (int8 or bf16) as a plain fp32 one, as
    torch.optim.Adam/AdamW saves it: 8-bit moments decoded (their "<key>_scale" entries dropped), bf16 moments
    widened (DTensors stay DTensors: FSDP2 state decodes shard by shard); everything else as it was. The
    argument is not modified."""
    state = {}
    for pid, entries in state_dict["state"].items():
        entries = dict(entries)
        for key in CODES:
            value = entries.get(key)
            if value is None:
                continue
            if value.dtype in LEVELS:
                entries[key] = decode(value, entries.pop(key + "_scale"))
            elif value.dtype == torch.bfloat16:
                entries[key] = value.float()
        state[pid] = entries
    return {**state_dict, "state": state}
