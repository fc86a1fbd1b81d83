"""How fused's ops take torch.autocast: as the torch ops they replace do (custom ops get no autocast of their own):
the linear-layer ops as F.linear, the distances and norms in float32 where torch runs cdist and the norms so."""

import torch


def autocast_enabled(device_type):
    """torch.is_autocast_enabled(device_type), False on devices autocast has no mode for (meta: shape inference),
    where torch.is_autocast_enabled raises."""
    available = device_type in ("cpu", "cuda") or torch.amp.is_autocast_available(device_type)  # no call for these two
    return available and torch.is_autocast_enabled(device_type)


def autocast_linear(*tensors):
    """The linear layer's tensors in autocast's dtype when autocast is on, as F.linear would run (float64 and None
    pass through)."""
    device = next(t for t in tensors if t is not None).device.type
    if not autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )


# The devices where torch's autocast runs a family's torch counterpart in float32 (aten/src/ATen/autocast_mode.cpp):
# torch.cdist on CPU and CUDA, F.layer_norm and F.rms_norm on CUDA. Custom ops get no autocast policy of their own.
FLOAT32_DEVICES = {"distance": ("cpu", "cuda"), "norm": ("cuda",)}


def autocast_float32(family, *tensors):
    """The tensors in float32 where autocast is on for the first one's device and runs the family's counterpart in
    float32 there, as torch casts them (float64, integer tensors and None pass through)."""
    if not isinstance(tensors[0], torch.Tensor):
        return tensors  # the op's own checks name the argument
    first = tensors[0]
    device = "cpu" if first.is_cpu else "cuda" if first.is_cuda else first.device.type  # a tenth of .device's cost
    if device not in FLOAT32_DEVICES[family] or not torch.is_autocast_enabled(device):
        return tensors
    return tuple(
        t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def register_autocast_float32(family, *ops):
    """The same cast for calls of torch.ops.fused.<op> (the public functions cast before they call)."""
    for op in ops:
        for device in FLOAT32_DEVICES[family]:
            torch.library.register_autocast(f"fused::{op}", device, torch.float32)
