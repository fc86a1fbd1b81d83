"""fused/_autograd.py: an eager call with a gradient runs the op's registered setup_context and backward through a
plain torch.autograd.Function (not torch.library's wrapper); a call without one runs the kernel alone; traced calls
(torch.compile, dispatch modes, tensor subclasses, functorch) go through the op. Both paths give the same bits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused
from fused import _autograd
from tests.harness import ignore_torch_jit_deprecation, make

EAGER = "_eagerBackward"  # the Function's grad_fn: fused_<op>_eager


def rms(x, w):
    return fused.rms_norm(x, (x.shape[-1],), w)


def grads_by_op(x, w):
    """The same call through torch.ops.fused.norm_fwd: torch.library's autograd."""
    out = torch.ops.fused.norm_fwd(x, None, [x.shape[-1]], w, None, torch.finfo(torch.float32).eps, True)[0]
    return out, torch.autograd.grad(out, (x, w), torch.ones_like(out))


def test_eager_call_takes_the_function_and_matches_the_op():
    x = make((6, 33), torch.float32, seed=1, requires_grad=True)
    w = torch.nn.Parameter(make((33,), torch.float32, seed=2))  # a Parameter is a plain tensor here
    out = rms(x, w)
    assert type(out.grad_fn).__name__ == "fused_norm_fwd" + EAGER
    got = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    want_out, want = grads_by_op(x, w)
    assert type(want_out.grad_fn).__name__.startswith("GeneratedBackwardFor_fused_norm_fwd")
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_no_gradient_runs_the_kernel_alone():
    x = make((6, 33), torch.float32, seed=1)
    assert rms(x, None).grad_fn is None
    with torch.no_grad():
        assert rms(x.requires_grad_(), None).grad_fn is None


def test_keyword_only_arguments_and_their_gradients():
    """rope's interleaved is keyword-only: the Function passes it on and gives it no gradient slot."""
    q = make((2, 3, 5, 8), torch.float32, seed=3, requires_grad=True)
    k = make((2, 1, 5, 8), torch.float32, seed=4, requires_grad=True)
    cos = make((1, 5, 8), torch.float32, seed=5, requires_grad=True)
    sin = make((1, 5, 8), torch.float32, seed=6, requires_grad=True)
    for interleaved in (False, True):
        out = fused.rope(q, k, cos, sin, interleaved=interleaved)
        assert type(out[0].grad_fn).__name__ == "fused_rope" + EAGER
        got = torch.autograd.grad(out, (q, k, cos, sin), [torch.ones_like(o) for o in out])
        ref = torch.ops.fused.rope(q, k, cos, sin, 1, interleaved=interleaved)
        want = torch.autograd.grad(ref, (q, k, cos, sin), [torch.ones_like(o) for o in ref])
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_default_arguments_filled_for_setup_context():
    """pairwise_distances called with its positional defaults left out: setup_context sees them filled in."""
    a = make((7, 4), torch.float32, seed=7, requires_grad=True)
    b = make((5, 4), torch.float32, seed=8, requires_grad=True)
    out = fused.pairwise_distances(a, b)
    assert type(out.grad_fn).__name__ == "fused_pairwise_distances" + EAGER
    got = torch.autograd.grad(out, (a, b), torch.ones_like(out))
    ref = torch.ops.fused.pairwise_distances(a, b)
    want = torch.autograd.grad(ref, (a, b), torch.ones_like(ref))
    assert all(torch.equal(g, h) for g, h in zip(got, want))


class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_traced_calls_go_through_the_op():
    """Under a dispatch mode, torch.compile or a functorch transform the op runs with torch.library's autograd."""
    x = make((6, 33), torch.float32, seed=1, requires_grad=True)
    with Recording() as mode:
        out = rms(x, None)
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor_fused_norm_fwd")
    assert "fused.norm_fwd.default" in mode.ops
    seen = []

    @torch.compile(backend=lambda gm, inputs: seen.append(str(gm.graph)) or gm.forward, fullgraph=True)
    def compiled(t):
        return rms(t, None)

    assert torch.equal(compiled(x.detach()), rms(x.detach(), None))
    assert "torch.ops.fused." in seen[0]  # one custom op in the graph (the composite rms_norm)
    # under a torch.func transform the call is traced too (vmap runs the op; grad, vjp and jacrev the Function:
    # tests/test_tooling_export.py)
    seen.clear()
    torch.func.vmap(lambda t: seen.append(_autograd.traced([t])) or t)(x.detach())
    assert seen == [True] and not _autograd.traced([x, torch.nn.Parameter(x.detach())])


@pytest.mark.parametrize("retain", [False, True])
def test_backward_twice_and_retained_graph(retain):
    """retain_graph: a second backward through the Function gives the same gradients (the forward-computed
    gradients of the loss ops are consumed once, then recomputed)."""
    x = make((9, 16), torch.float32, seed=11, requires_grad=True)
    w = make((40, 16), torch.float32, seed=12, requires_grad=True)
    t = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(0))
    loss = fused.linear_cross_entropy(x, w, t)
    first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    if retain:
        second = torch.autograd.grad(loss, (x, w))
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    ref = torch.nn.functional.cross_entropy(x.double() @ w.double().t(), t)
    want = torch.autograd.grad(ref, (x, w))  # float64 math, float32 gradients
    for g, h in zip(first, want):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def _second_order_cases():
    """A scalar of each family's public op in float64, from x (and a weight w), both requiring grad."""
    cos, sin = torch.ones(1, 5, 8, dtype=torch.float64), torch.zeros(1, 5, 8, dtype=torch.float64)
    t = torch.tensor([0, 3, 1, 2, 3])
    return {
        "rms_norm": lambda x, w: fused.rms_norm(x, 8, w[0]).square().sum(),
        "layer_norm": lambda x, w: fused.layer_norm(x, 8, w[0], w[1]).square().sum(),
        "bias_act": lambda x, w: fused.bias_act(x, w[0], "gelu").square().sum(),
        "glu": lambda x, w: fused.glu(x, x.cos(), "silu").square().sum(),  # up depends on x too
        "unary_chain": lambda x, w: fused.unary_chain(x, ["sin", "square"]).sum(),
        "linear_act": lambda x, w: fused.linear_act(x, w, None, "tanh").square().sum(),
        "pairwise_distances": lambda x, w: fused.pairwise_distances(x, w).sum(),
        "pairwise_topk": lambda x, w: fused.pairwise_topk(x, w, 2)[0].sum(),
        "rope": lambda x, w: fused.rope(x.view(1, 1, 5, 8), x.view(1, 1, 5, 8), cos, sin)[0].square().sum(),
        "linear_cross_entropy": lambda x, w: fused.linear_cross_entropy(x, w, t),
        "linear_log_probs": lambda x, w: fused.linear_log_probs(x, w, t).sum(),
    }


@pytest.mark.parametrize("op", list(_second_order_cases()))
def test_second_derivatives_raise_naming_the_op(op):
    """The fused backward ops have no derivatives: under create_graph=True the first gradient is still right, and
    asking for a second one through it raises (autograd.grad to x, and .backward() to every leaf) rather than
    leaving the second-order terms out, which is what torch's fallback did (a gradient penalty off by 10x)."""
    fn = _second_order_cases()[op]
    x = make((5, 8), torch.float64, seed=21, requires_grad=True)
    w = make((4, 8), torch.float64, seed=22, requires_grad=True)
    plain = torch.autograd.grad(fn(x, w), x)[0]
    first = torch.autograd.grad(fn(x, w), x, create_graph=True)[0]
    assert torch.equal(first.detach(), plain)
    with pytest.raises(RuntimeError, match=r"fused\.\w+: second derivatives are not supported"):
        torch.autograd.grad(first.square().sum(), x)
    first = torch.autograd.grad(fn(x, w), x, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        (fn(x, w) + first.square().sum()).backward()


@ignore_torch_jit_deprecation  # torch.func.jvp scripts torch's own decompositions
# no batching rules: vmap runs the ops through torch's per-sample fallback, which torch 2.15 reports as a UserWarning
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_forward_mode_ad_raises_naming_the_op():
    """jvp and dual tensors would otherwise come back with a zero (jvp) or missing (dual) tangent, through the public
    functions and through torch.ops.fused.<op> alike."""
    import torch.autograd.forward_ad as fwad

    x, v = make((4, 8), torch.float64, seed=23), make((4, 8), torch.float64, seed=24)
    q, cos, sin = (
        x.view(1, 1, 4, 8),
        torch.ones(1, 4, 8, dtype=torch.float64),
        torch.zeros(1, 4, 8, dtype=torch.float64),
    )
    with pytest.raises(NotImplementedError, match=r"fused\.norm_fwd: forward-mode AD"):
        torch.func.jvp(lambda a: fused.rms_norm(a, 8), (x,), (v,))
    with pytest.raises(NotImplementedError, match=r"fused\.bias_act: forward-mode AD"):
        torch.func.vmap(lambda a: torch.func.jvp(lambda b: fused.bias_act(b, None, "gelu"), (a,), (a,))[1])(x)
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match=r"fused\.cross_entropy_fwd: forward-mode AD"):
            fused.cross_entropy(fwad.make_dual(x, v), torch.tensor([0, 1, 2, 3]))
        assert torch.equal(fused.rms_norm(x, 8), fused.rms_norm(x, 8))  # no tangent: runs
        with pytest.raises(NotImplementedError, match=r"fused\.bias_act: forward-mode AD"):  # the op itself
            torch.ops.fused.bias_act(fwad.make_dual(x, v), None, "gelu")
    with pytest.raises(NotImplementedError, match=r"fused\.rope: forward-mode AD"):
        torch.func.jvp(lambda a: torch.ops.fused.rope(a, a, cos, sin)[0], (q,), (q,))
    assert torch.func.vmap(lambda a: fused.bias_act(a, None, "gelu"))(x).shape == x.shape


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_as_without(use_reentrant):
    """torch.utils.checkpoint recomputes the forward in backward; the non-reentrant kind lets each saved tensor be
    unpacked once, so a backward that read ctx.saved_tensors twice failed there (transformers' gradient
    checkpointing)."""
    torch.manual_seed(0)
    gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)

    def block(g, u):
        return fused.rms_norm(fused.glu(g, u, act="silu"), (6,)).square().sum()

    block(gate, up).backward()
    expected = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    torch.utils.checkpoint.checkpoint(block, gate, up, use_reentrant=use_reentrant).backward()
    assert torch.equal(gate.grad, expected[0]) and torch.equal(up.grad, expected[1])
