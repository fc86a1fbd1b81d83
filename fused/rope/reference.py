"""Plain-PyTorch reference of the rope family: the spec the kernels are tested against. transformers'
apply_rotary_pos_emb (x * cos + rotate_half(x) * sin) on the first r = cos.shape[-1] features, the rest passed
through; interleaved: the pairs (x[2i], x[2i+1]) rotate by angle i (cos[..., i], sin[..., i], i < r/2) in place."""

import torch


def rotate_half(x):
    """(-x2, x1) for the halves x1, x2 of the last dim, as transformers' rotate_half."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x, cos, sin, interleaved=False):
    """x rotated by the tables cos / sin, already broadcastable to x[..., :r]."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        out = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1)


def rope(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rotate(q, cos, sin, interleaved), rotate(k, cos, sin, interleaved)


def table_grads(grad_q, grad_k, q, k, cos, sin, unsqueeze_dim, interleaved):
    """The gradients of cos and sin (shape [b or 1, s, r]), summed over heads (and batch where cos broadcasts), in
    the math type (float32 for 16-bit inputs), returned in cos's dtype. out = x c + partner(x) s feature by feature,
    so d cos = sum grad * x and d sin = sum grad * partner(x); interleaved tables are read in their first half only."""
    math = torch.float64 if cos.dtype == torch.float64 else torch.float32
    r = cos.shape[-1]
    dims = (unsqueeze_dim,) if cos.shape[0] == q.shape[0] else (0, unsqueeze_dim)
    grad_cos = grad_sin = 0
    for g, x in ((grad_q, q), (grad_k, k)):
        g, x = g[..., :r].to(math), x[..., :r].to(math)
        if interleaved:
            g1, g2, x1, x2 = g[..., 0::2], g[..., 1::2], x[..., 0::2], x[..., 1::2]
            zero = torch.zeros_like(g1)
            dc = torch.cat((g1 * x1 + g2 * x2, zero), dim=-1)
            ds = torch.cat((g2 * x1 - g1 * x2, zero), dim=-1)
        else:
            dc, ds = g * x, g * rotate_half(x)
        grad_cos = grad_cos + dc.sum(dims)
        grad_sin = grad_sin + ds.sum(dims)
    shape = cos.shape
    return grad_cos.reshape(shape).to(cos.dtype), grad_sin.reshape(shape).to(sin.dtype)


def rope_backward(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved):
    """The transpose of rope's rotation applied to the gradients of q_embed and k_embed."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    if interleaved:
        sin_t = -sin
    else:
        sin_t = -torch.cat((sin[..., r // 2 :], sin[..., : r // 2]), dim=-1)
    return rotate(grad_q, cos, sin_t, interleaved), rotate(grad_k, cos, sin_t, interleaved)
