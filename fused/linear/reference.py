"""Plain-PyTorch reference for the fused linear family: the spec the kernels are tested against."""

import torch.nn.functional as F

from fused.elementwise.reference import ACT_FNS


def linear_act(x, weight, bias=None, act="identity"):
    return ACT_FNS[act](F.linear(x, weight, bias))
