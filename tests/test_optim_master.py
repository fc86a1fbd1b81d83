"""master_weights=True: an fp32 master copy of each 16-bit parameter in state "master_param", fp32 moments, one
kernel reading the 16-bit gradient and writing the rounded 16-bit parameter; fp32 through state_dict save/load."""

import io
import math

import pytest
import torch

import fused

SHAPES = [(37, 5), (40000,), (3,)]


def params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def set_grads(groups, step, poison=False):
    g = torch.Generator().manual_seed(100 + step)
    for ps in zip(*groups):
        grad = torch.randn(ps[0].shape, generator=g).to(ps[0].dtype)  # the 16-bit gradient, seen by both
        for p in ps:
            p.grad = grad.to(p.dtype, copy=True)  # one tensor per param: steps write .grad
            if poison:
                p.grad.view(-1)[2] = math.nan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,hyper",
    [
        ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
        ("Adam", dict(lr=1e-2, amsgrad=True)),
        ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ],
)
def test_master_matches_fp32_training(dtype, name, hyper):
    low = params(dtype)
    fp32 = [p.detach().float().requires_grad_() for p in low]  # the same starting values, in fp32
    opt = getattr(fused.optim, name)(low, master_weights=True, max_grad_norm=1.0, **hyper)
    ref = getattr(fused.optim, name)(fp32, max_grad_norm=1.0, **hyper)
    for step in range(5):
        set_grads([low, fp32], step)
        opt.step()
        ref.step()
    for p, q in zip(low, fp32):
        state = opt.state[p]
        assert state["master_param"].dtype == torch.float32
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")
        torch.testing.assert_close(state["master_param"], q.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), state["master_param"].to(dtype))  # the param is the rounded master
        for k, v in ref.state[q].items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_master_state_dict_stays_fp32_and_resumes():
    a, b = params(torch.bfloat16), params(torch.bfloat16)
    opt_a = fused.optim.AdamW(a, master_weights=True)
    for step in range(3):
        set_grads([a], step)
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    opt_b = fused.optim.AdamW(b, master_weights=True)
    opt_b.load_state_dict(torch.load(buf))
    for p, q in zip(a, b):
        for k in ("master_param", "exp_avg", "exp_avg_sq"):
            assert opt_b.state[q][k].dtype == torch.float32
            assert torch.equal(opt_b.state[q][k], opt_a.state[p][k])
    for step in range(3, 5):
        set_grads([a, b], step)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q) and torch.equal(opt_a.state[p]["master_param"], opt_b.state[q]["master_param"])


def test_master_loads_a_torch_state_dict():
    a, b = params(torch.bfloat16), params(torch.bfloat16)
    torch_opt = torch.optim.AdamW(a, foreach=False)
    set_grads([a], 0)
    torch_opt.step()
    opt = fused.optim.AdamW(b, master_weights=True)
    opt.load_state_dict(torch_opt.state_dict())
    set_grads([b], 1)
    opt.step()
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in b)
    assert float(opt.state[b[0]]["step"]) == 2.0


def test_master_mixed_group_and_skip():
    ps = params(torch.bfloat16) + [torch.randn(11, requires_grad=True)]
    opt = fused.optim.AdamW(ps, master_weights=True, max_grad_norm=1.0)
    set_grads([ps], 0)
    opt.step()
    assert "master_param" not in opt.state[ps[-1]] and "master_param" in opt.state[ps[0]]
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in ps]
    set_grads([ps], 1, poison=True)
    opt.step()
    for p, (value, state) in zip(ps, before):
        assert torch.equal(p.detach(), value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
