"""fused.nn.FusedLinear and FusedMLP: nn.Linear compatibility, parity with nn.Sequential (forward and backward),
and FusedMLP.fold()."""

import pytest
import torch
from torch import nn

import fused
from fused.elementwise.reference import ACT_FNS
from tests.harness import assert_close, make, raises


class Act(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return ACT_FNS[self.act](x)


def sequential_like(mlp):
    """The nn.Sequential of Linear + activation with the same weights as `mlp`."""
    mods = []
    for layer in mlp.layers:
        lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)
        lin.load_state_dict(layer.state_dict())
        mods += [lin, Act(layer.act)]
    return nn.Sequential(*mods)


def test_fused_linear_loads_nn_linear_state_dict():
    torch.manual_seed(0)
    lin = nn.Linear(20, 12)
    fl = fused.nn.FusedLinear(20, 12, act="silu")
    fl.load_state_dict(lin.state_dict())
    assert fl.weight.shape == (12, 20) and fl.bias.shape == (12,)
    x = make((3, 7, 20))
    assert_close(fl(x), torch.nn.functional.silu(lin(x)), scale=10)
    back = nn.Linear(20, 12)
    back.load_state_dict(fl.state_dict())  # and back
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    no_bias = fused.nn.FusedLinear(20, 12, bias=False)
    assert no_bias.bias is None and set(no_bias.state_dict()) == {"weight"}
    assert "act='silu'" in repr(fl)


def test_fused_linear_init_like_nn_linear():
    torch.manual_seed(1)
    lin = nn.Linear(64, 32)
    torch.manual_seed(1)
    fl = fused.nn.FusedLinear(64, 32)
    assert torch.equal(lin.weight, fl.weight) and torch.equal(lin.bias, fl.bias)
    half = fused.nn.FusedLinear(8, 4, dtype=torch.float16)
    assert half.weight.dtype == torch.float16


@pytest.mark.parametrize("act,final_act", [("gelu", "identity"), ("relu", "tanh"), ("silu", "sigmoid")])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_sequential_forward_and_backward(act, final_act, bias):
    torch.manual_seed(2)
    mlp = fused.nn.FusedMLP([24, 48, 40, 16], act=act, bias=bias, final_act=final_act)
    assert isinstance(mlp.layers, nn.ModuleList) and len(mlp.layers) == 3
    assert [layer.act for layer in mlp.layers] == [act, act, final_act]
    seq = sequential_like(mlp)
    x = make((5, 3, 24), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = mlp(x), seq(x2)
    assert_close(out, ref, scale=10)
    g = make(out.shape, seed=3)
    out.backward(g)
    ref.backward(g)
    assert_close(x.grad, x2.grad, scale=10)
    fused_params = list(mlp.parameters())
    ref_params = [p for m in seq if isinstance(m, nn.Linear) for p in m.parameters()]
    assert len(fused_params) == len(ref_params) == (6 if bias else 3)
    for p, q in zip(fused_params, ref_params):
        assert_close(p.grad, q.grad, scale=20)


def _linear_mlp(sizes, **kw):
    torch.manual_seed(4)
    return fused.nn.FusedMLP(sizes, act="identity", dtype=torch.float64, **kw)


def test_fold_collapses_expansion_exactly_in_float64():
    mlp = _linear_mlp([32, 128, 16])  # 32*16 < 128*(32+16): folds into one 32 -> 16 linear
    folded = mlp.fold()
    assert len(folded.layers) == 1 and folded.sizes == [32, 16]
    w = folded.layers[0].weight
    assert w.shape == (16, 32)
    torch.testing.assert_close(w, mlp.layers[1].weight @ mlp.layers[0].weight, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(
        folded.layers[0].bias, mlp.layers[1].weight @ mlp.layers[0].bias + mlp.layers[1].bias, rtol=1e-13, atol=1e-13
    )
    x = make((9, 32), torch.float64)
    torch.testing.assert_close(folded(x), mlp(x), rtol=1e-12, atol=1e-12)
    assert not folded.training and not any(p.requires_grad for p in folded.parameters())


def test_fold_leaves_training_model_untouched():
    mlp = _linear_mlp([32, 128, 16])
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    folded = mlp.fold()
    assert len(mlp.layers) == 2 and mlp.training and mlp.sizes == [32, 128, 16]
    assert all(p.requires_grad for p in mlp.parameters())
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, before[k])
    folded.layers[0].weight.zero_()
    assert torch.equal(mlp.layers[0].weight, before["layers.0.weight"])


def test_fold_keeps_bottleneck():
    mlp = _linear_mlp([64, 8, 64])  # 64*64 > 8*(64+64): two thin linears are cheaper
    folded = mlp.fold()
    assert folded.sizes == [64, 8, 64] and len(folded.layers) == 2
    x = make((5, 64), torch.float64)
    torch.testing.assert_close(folded(x), mlp(x), rtol=0, atol=0)


def test_fold_keeps_nonlinear_joins():
    torch.manual_seed(5)
    mlp = fused.nn.FusedMLP([16, 64, 64, 8], act="relu", final_act="identity", dtype=torch.float64)
    folded = mlp.fold()
    assert folded.sizes == [16, 64, 64, 8]
    x = make((4, 16), torch.float64)
    torch.testing.assert_close(folded(x), mlp(x), rtol=0, atol=0)


def test_fold_chain_without_bias_and_final_act():
    mlp = _linear_mlp([8, 32, 64, 4], bias=False, final_act="tanh")
    folded = mlp.fold()  # 8 -> 32 -> 64 folds to 8 -> 64, then 8 -> 64 -> 4 to 8 -> 4 with the final tanh
    assert folded.sizes == [8, 4] and folded.layers[0].bias is None and folded.layers[0].act == "tanh"
    x = make((6, 8), torch.float64)
    torch.testing.assert_close(folded(x), mlp(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("no_bias", [0, 2])
def test_fold_layers_with_and_without_bias(no_bias):
    """Layers whose bias was set to None among layers with one: each folded layer's bias follows its own pair (a
    first layer without bias once crashed fold(); a later one kept a fresh random bias)."""
    mlp = _linear_mlp([8, 32, 64, 4], bias=True, final_act="tanh")
    mlp.act = "relu"
    for layer in mlp.layers:
        layer.act = "relu"
    mlp.layers[-1].act = "tanh"
    mlp.layers[no_bias].bias = None
    folded = mlp.fold()  # relu joins: nothing folds
    assert [layer.bias is None for layer in folded.layers] == [layer.bias is None for layer in mlp.layers]
    x = make((6, 8), torch.float64)
    torch.testing.assert_close(folded(x), mlp(x), rtol=1e-12, atol=1e-12)
    mlp = _linear_mlp([8, 32, 64, 4], bias=True)  # identity joins: all three fold into one 8 -> 4 linear
    mlp.layers[no_bias].bias = None
    folded = mlp.fold()
    assert folded.sizes == [8, 4] and folded.layers[0].bias is not None
    torch.testing.assert_close(folded(x), mlp(x), rtol=1e-12, atol=1e-12)


def test_fold_float32_within_rounding():
    torch.manual_seed(6)
    mlp = fused.nn.FusedMLP([64, 256, 32], act="identity", final_act="gelu")
    folded = mlp.fold()
    assert folded.sizes == [64, 32] and folded.layers[0].weight.dtype == torch.float32
    x = make((10, 64))
    assert_close(folded(x), mlp(x), scale=10)


def test_mlp_errors():
    with raises("fused.nn.FusedMLP: sizes must list at least 2"):
        fused.nn.FusedMLP([16])
    with raises("fused.nn.FusedMLP: unknown act 'swish'"):
        fused.nn.FusedMLP([4, 4], act="swish")
    with raises("fused.nn.FusedLinear: unknown act 'nope'"):
        fused.nn.FusedLinear(4, 4, act="nope")
    with raises("fused.linear_act: weight must be 2-D .* for x of shape \\(2, 5\\)"):
        fused.nn.FusedLinear(4, 3)(make((2, 5)))
