"""Benchmark cases of the rope family: rotary embedding of q and k at a Llama-like shape (b=4, 32 query heads and 8
key/value heads, s=512, d=128; q and k strided views of their projections, as transformers makes them), float32 and
bfloat16, forward and forward+backward (gradients of q and k; the tables are constants, as in a model).
Alternatives: eager transformers' apply_rotary_pos_emb and torch.compile of it."""

import torch

import fused
from benchmarks.bench_norm import make_cases
from benchmarks.common import our_labels
from fused.rope import reference as ref


def tables(s, d, device, dtype):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    emb = torch.cat([torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq] * 2, dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Llama function (the reference computes the same on the first r features)."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf
    except ImportError:
        return ref.rope(q, k, cos, sin, unsqueeze_dim)
    return hf(q, k, cos, sin, unsqueeze_dim)


def cases(device, quick):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    b, hq, hk, s, d = (1, 4, 2, 64, 64) if quick else (4, 32, 8, 512, 128)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(b, s, hq * d, device=device, dtype=dtype).view(b, s, hq, d).transpose(1, 2)
        k = torch.randn(b, s, hk * d, device=device, dtype=dtype).view(b, s, hk, d).transpose(1, 2)
        cos, sin = tables(s, d, device, dtype)
        grads = [torch.randn_like(q), torch.randn_like(k)]
        # the tables are constants, as a model's rotary module makes them (no gradient); q and k get gradients
        compiled = torch.compile(apply_rotary_pos_emb)
        impls = {
            "eager": (lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), None),
            "torch.compile": (lambda q, k: compiled(q, k, cos, sin), None),
        }
        for label, backend in our_labels(device, lambda: fused.rope(q, k, cos, sin)).items():
            impls[label] = (lambda q, k: fused.rope(q, k, cos, sin), backend)
        # bytes that must move: q and k read and written (cos / sin once); backward: their gradients likewise
        n = (q.numel() + k.numel()) * q.element_size()
        tables_bytes = 2 * cos.numel() * cos.element_size()
        name = f"rope b{b} h{hq}/{hk} s{s} d{d} {str(dtype)[6:]}"
        out += make_cases(device, name, impls, [q, k], grads, 2 * n + tables_bytes, 2 * n + tables_bytes)
    return out
