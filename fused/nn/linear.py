"""FusedLinear and FusedMLP: nn.Linear-compatible layers whose bias and activation run inside the GEMM."""

import math
from typing import Sequence

import torch
from torch import nn

from fused._checks import check_act
from fused.linear import linear_act


class FusedLinear(nn.Module):
    """act(x @ weight.T + bias) with nn.Linear's parameters (weight [out, in], bias [out]), initialisation and
    state_dict keys, so an nn.Linear state_dict loads into it and back."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, act: str = "identity", device=None, dtype=None
    ):
        super().__init__()
        check_act("nn.FusedLinear", act)
        self.in_features, self.out_features, self.act = in_features, out_features, act
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        # registered as nn.Linear's, None included: a tensor assigned later must be a Parameter, as there
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, **factory)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name: m(input=x) works too
        return linear_act(input, self.weight, self.bias, self.act)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, act={self.act!r}"
        )


class FusedMLP(nn.Module):
    """sizes = [in, hidden..., out]: FusedLinear layers in .layers, `act` between them, `final_act` after the
    last one."""

    def __init__(
        self,
        sizes: Sequence[int],
        act: str = "gelu",
        bias: bool = True,
        final_act: str = "identity",
        device=None,
        dtype=None,
    ):
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2 or any(not isinstance(s, int) or s < 0 for s in sizes):
            raise ValueError(
                f"fused.nn.FusedMLP: sizes must list at least 2 non-negative ints [in, ..., out], got {sizes!r}"
            )
        check_act("nn.FusedMLP", act)
        check_act("nn.FusedMLP", final_act)
        self.sizes, self.act, self.final_act = sizes, act, final_act
        last = len(sizes) - 2
        self.layers = nn.ModuleList(
            FusedLinear(sizes[i], sizes[i + 1], bias, final_act if i == last else act, device=device, dtype=dtype)
            for i in range(len(sizes) - 1)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Sequential's argument name
        for layer in self.layers:
            input = layer(input)
        return input

    @torch.no_grad()
    def fold(self) -> "FusedMLP":
        """An inference copy (eval mode, no grad) in which each pair of neighbours joined by an identity
        activation becomes one linear (W2 W1, W2 b1 + b2) wherever that lowers the FLOPs: in*out < hidden*(in+out).
        Bottlenecks and non-linear joins stay as they are; this model is untouched. Products are taken in
        float64 and rounded once."""
        folded = []  # (weight, bias or None, act), weights in float64
        for layer in self.layers:
            w = layer.weight.detach().to(torch.float64)
            b = None if layer.bias is None else layer.bias.detach().to(torch.float64)
            if folded and folded[-1][2] == "identity":
                w1, b1, _ = folded[-1]
                n_in, hidden, n_out = w1.shape[1], w1.shape[0], w.shape[0]
                if n_in * n_out < hidden * (n_in + n_out):
                    b1w = None if b1 is None else w @ b1
                    bias = b if b1w is None else b1w if b is None else b1w + b
                    folded[-1] = (w @ w1, bias, layer.act)
                    continue
            folded.append((w, b, layer.act))
        # Joins that stay are those of the original: `act` between layers, `final_act` after the last.
        first = self.layers[0].weight
        out = FusedMLP(
            [folded[0][0].shape[1]] + [w.shape[0] for w, _, _ in folded],
            self.act,
            self.layers[0].bias is not None,
            self.final_act,
            device=first.device,
            dtype=first.dtype,
        )
        for layer, (w, b, _) in zip(out.layers, folded):
            layer.weight.copy_(w)
            if b is None:  # each layer's bias follows its folded pair (layers may differ: bias set to None)
                layer.bias = None
            elif layer.bias is None:
                layer.bias = torch.nn.Parameter(b.to(device=first.device, dtype=first.dtype))
            else:
                layer.bias.copy_(b)
        return out.eval().requires_grad_(False)
