"""How fused's linear-layer ops take torch.autocast: as F.linear does (custom ops get no autocast of their own)."""

import torch


def autocast_linear(*tensors):
    """The linear layer's tensors in autocast's dtype when autocast is on, as F.linear would run (float64 and None
    pass through)."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )
