"""The 8-bit Adam state of fused.optim.Adam/AdamW(state_dtype="int8") in torch: the same bits as the CPU kernel's
codes (csrc/optim/quantize_cpu.h, where the code maps are explained), for loading float state into an 8-bit
optimizer and for reading 8-bit state back as float (dequantize_state).

Blocks of BLOCK elements in the tensor's memory order, one float32 scale each:
  exp_avg (int8):                    m = sign(q) * (q / 127)^2 * scale,   scale = max |m| of the block
  exp_avg_sq, max_exp_avg_sq (uint8): sqrt(v) = (q / 255)^2 * scale,     scale = max sqrt(v) of the block"""

import torch

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep fp32 state: their scales and codes would save little
CODES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8, "max_exp_avg_sq": torch.uint8}
LEVELS = {torch.int8: 127.0, torch.uint8: 255.0}


def _flat(t):
    """t's elements in memory order (t dense: no gaps, no overlap), as a 1-D view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def zero_scales(codes):
    """The scales of a code tensor, all zero (codes 0 and scale 0 decode to 0)."""
    return torch.zeros(-(-codes.numel() // BLOCK), dtype=torch.float32, device=codes.device)


def _sqrt(x):
    """The correctly rounded float32 square root, as the kernels take it: torch's CPU sqrt of float32 is not (it
    differs from IEEE in about 1 of 5 results), and a root of float input taken in float64 rounds right."""
    return x.double().sqrt().float()


def encode_(codes, scales, values, rows_per_chunk=16384):
    """Writes codes (int8 or uint8, as the kernel would) and scales of `values` (float, shaped like codes), in chunks
    of rows_per_chunk blocks (the float64 roots stay small)."""
    x = torch.empty_like(codes, dtype=torch.float32).copy_(values)
    n, blocks = codes.numel(), scales.numel()
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=codes.device)
    padded[:n] = _flat(x)
    padded = padded.view(blocks, BLOCK)
    q = torch.empty_like(padded)
    for r0 in range(0, blocks, rows_per_chunk):
        rows = padded[r0 : r0 + rows_per_chunk]
        q[r0 : r0 + rows_per_chunk], scales[r0 : r0 + rows_per_chunk] = _encode_rows(rows, codes.dtype)
    _flat(codes).copy_(q.flatten()[:n].to(codes.dtype))


def _encode_rows(rows, dtype):
    """The codes (as float) and scales of whole blocks, one a row."""
    signed = dtype == torch.int8
    mag = rows.abs() if signed else _sqrt(rows)
    scale = mag.amax(dim=1)  # NaN propagates, as in the kernel
    usable = (scale > 0) & (scale <= torch.finfo(torch.float32).max)
    inv = 1.0 / scale[:, None]  # mag / scale as mag * (1 / scale), but for a denormal scale (inverse inf)
    ratio = torch.where(torch.isinf(inv), mag / scale[:, None], mag * inv)
    q = torch.round(_sqrt(ratio) * LEVELS[dtype])
    q = torch.where(usable[:, None], q, 0.0)
    if signed:
        q = torch.where(rows < 0, -q, q)
    return q, scale


def decode(codes, scales):
    """The float32 values of codes and scales, shaped (and strided) like codes."""
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
    widened; everything else as it was. The argument is not modified."""
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
