"""fused.nn's modules under torch's generic module tests, ported from pytorch v2.13: test/test_modules.py (TestModule,
TestModuleCPUOnly) over torch/testing/_internal/common_modules.py's module_db samples (constructor and forward
inputs) of nn.Linear (for FusedLinear, and FusedMLP built from the same sizes), nn.RMSNorm, nn.LayerNorm and
nn.CrossEntropyLoss (for FusedLinearCrossEntropyLoss). torch's module with the same parameters is the reference;
16-bit and float32 results are judged against a float64 run (our error no worse than torch's x2).

torch's test -> here:
- test_forward -> test_forward_and_backward_as_torch (also .float() / .double() and the params' dtype after)
- test_factory_kwargs -> test_factory_kwargs
- test_to_empty, test_device_ctx_init -> test_meta_construction (+ reset_parameters() after to_empty(), forward on
  the meta device)
- test_repr -> test_repr; test_save_load -> test_save_load (+ pickle, deepcopy)
- test_non_contiguous_tensors -> test_non_contiguous_tensors
- test_grad -> test_gradcheck; test_gradgrad -> test_second_derivative_refused (a contract choice: the fused
  ops' autograd is first order, and a second derivative raises naming the op)
- test_to (swap, set_grad) -> test_to
- test_if_train_and_eval_modes_differ -> test_train_and_eval_do_not_differ
- test_errors (CrossEntropyLoss's module_error_inputs) -> test_cross_entropy_errors
- test_forward over nn.CrossEntropyLoss's samples -> test_cross_entropy_module_inputs; its generic checks ->
  test_cross_entropy_module_generic
Added for drop-in use: state_dict round trips with torch's module (strict, strict=False with missing keys,
unexpected keys), parameters with requires_grad=False, torch.nn.utils.parametrize / weight_norm / spectral_norm,
unbatched norm inputs, the keyword argument of nn.Linear.forward (m(input=x)).
Not ported: test_memory_format (nn.RMSNorm keeps a channels_last input's layout in its output; fused's norms return
contiguous outputs, the values equal: a layout difference, as F.layer_norm's), test_cpu_gpu_parity and
test_multiple_device_transfer (they need a GPU; the device parity of the ops is tested in each family's tests).
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fused
from tests.harness import assert_accuracy

pytest.importorskip("expecttest")  # torch.testing._internal imports it (make setup installs it)
from torch.testing._internal.common_modules import module_db  # noqa: E402

INFOS = {info.module_cls: info for info in module_db}
SOURCES = {"linear": nn.Linear, "mlp": nn.Linear, "rms": nn.RMSNorm, "layer": nn.LayerNorm}
LOW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def torch_samples(kind, dtype=torch.float64, requires_grad=False):
    """module_db's samples of the kind's torch module: (constructor args, kwargs, forward args, forward kwargs,
    desc); for the norms also unbatched inputs (normalized_shape the whole input), which module_db has not."""
    info = INFOS[SOURCES[kind]]
    torch.manual_seed(0)  # module_db's samples draw from the global generator
    samples = [
        (s.constructor_input.args, s.constructor_input.kwargs, s.forward_input.args, s.forward_input.kwargs, s.desc)
        for s in info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=requires_grad, training=True)
    ]
    if kind in ("rms", "layer"):
        for shape in ([5], [2, 2, 5]):
            x = torch.randn(shape, dtype=dtype).requires_grad_(requires_grad)
            samples.append(((shape, 1e-3), {}, (x,), {}, f"no_batch_dim_{len(shape)}d"))
    return samples


def fused_mlp(in_features, out_features, bias=True, **factory):
    """FusedMLP [in, 6, out] with gelu between, from nn.Linear's constructor arguments."""
    return fused.nn.FusedMLP([in_features, 6, out_features], act="gelu", bias=bias, **factory)


def torch_mlp(in_features, out_features, bias=True, **factory):
    """The nn.Sequential computing what fused_mlp does, its parameters in the same order."""
    return nn.Sequential(
        nn.Linear(in_features, 6, bias, **factory), nn.GELU(), nn.Linear(6, out_features, bias, **factory)
    )


OURS = {
    "linear": fused.nn.FusedLinear,
    "mlp": fused_mlp,
    "rms": fused.nn.FusedRMSNorm,
    "layer": fused.nn.FusedLayerNorm,
}
THEIRS = {
    "linear": nn.Linear,
    "mlp": torch_mlp,
    "rms": nn.RMSNorm,
    "layer": nn.LayerNorm,
}
CASES = [
    pytest.param(kind, i, id=f"{kind}-{sample[-1] or 'default'}")
    for kind in SOURCES
    for i, sample in enumerate(torch_samples(kind))
]


def sample(kind, i, dtype=torch.float64, requires_grad=False):
    return torch_samples(kind, dtype, requires_grad)[i]


def first_input(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()))


def pair(kind, args, kwargs, dtype=torch.float64):
    """Our module and torch's with the same parameters (norm weights drawn away from their initial ones), in dtype."""
    theirs = THEIRS[kind](*args, **kwargs).to(dtype)
    ours = OURS[kind](*args, **kwargs).to(dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            if kind in ("rms", "layer"):
                p.uniform_(0.5, 1.5)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(q)
    return ours, theirs


def forward_and_grads(module, args, kwargs, grad_out):
    """The module's output, and the gradients of <output, grad_out> to its input and each parameter."""
    x = first_input(args, kwargs)
    out = module(*args, **kwargs)
    wrt = [x] + list(module.parameters())
    grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    return out, grads


def fresh(args, kwargs, dtype=None, requires_grad=True):
    """Detached copies of the forward inputs (in dtype) that require grad."""

    def copy_(t):
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        return t.requires_grad_(requires_grad)

    return [copy_(a) for a in args], {k: copy_(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("kind,i", CASES)
def test_forward_and_backward_as_torch(kind, i):
    """test_forward: the output of each module_db sample, here with torch's module beside ours (same parameters)
    as the reference, and the gradients to the input and every parameter: equal in float64; in float32, bf16 and
    fp16 our error against the float64 run no worse than torch's x2. Then .float() / .double() convert every
    parameter (test_forward's method calls)."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i)
    ours, theirs = pair(kind, args, kwargs)
    x = first_input(fwd_args, fwd_kwargs)
    grad_out = torch.randn(theirs(x).shape, dtype=torch.float64)
    out64, grads64 = forward_and_grads(theirs, *fresh(fwd_args, fwd_kwargs), grad_out)
    out, grads = forward_and_grads(ours, *fresh(fwd_args, fwd_kwargs), grad_out)
    torch.testing.assert_close(out, out64)
    for g, e in zip(grads, grads64, strict=True):
        torch.testing.assert_close(g, e)
    for dtype in LOW_DTYPES:
        # float64 of what both see: the inputs and parameters rounded to dtype
        ours_low, theirs_low = copy.deepcopy(ours).to(dtype), copy.deepcopy(theirs).to(dtype)
        exact = copy.deepcopy(theirs_low).double()
        low_args, low_kwargs = fresh(fwd_args, fwd_kwargs, dtype)
        ref_args, ref_kwargs = fresh(low_args, low_kwargs, torch.float64)
        ref, ref_grads = forward_and_grads(exact, ref_args, ref_kwargs, grad_out)
        got, got_grads = forward_and_grads(ours_low, low_args, low_kwargs, grad_out.to(dtype))
        want, want_grads = forward_and_grads(theirs_low, *fresh(low_args, low_kwargs), grad_out.to(dtype))
        assert got.dtype == want.dtype == dtype
        assert_accuracy(got, want, ref, what=f"{dtype} output")
        for n, (g, w, r) in enumerate(zip(got_grads, want_grads, ref_grads, strict=True)):
            assert g.dtype == w.dtype
            assert_accuracy(g, w, r, what=f"{dtype} gradient {n}")
    for method, dtype in (("float", torch.float32), ("double", torch.float64)):
        getattr(ours, method)()
        converted_args, converted_kwargs = fresh(fwd_args, fwd_kwargs, dtype)
        ours(*converted_args, **converted_kwargs)
        assert all(p.dtype == dtype for p in ours.parameters())


@pytest.mark.parametrize("kind,i", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_factory_kwargs(kind, i, dtype):
    """test_factory_kwargs: device= and dtype= reach every parameter and buffer created."""
    args, kwargs = sample(kind, i)[:2]
    for device in ("cpu", "meta"):
        m = OURS[kind](*args, **kwargs, device=device, dtype=dtype)
        for t in list(m.parameters()) + list(m.buffers()):
            assert t.device.type == device and t.dtype == dtype


@pytest.mark.parametrize("kind,i", CASES)
@pytest.mark.parametrize("swap", [True, False])
def test_meta_construction(kind, i, swap):
    """test_device_ctx_init: built under torch.device("meta"), the parameters have the CPU module's metadata.
    test_to_empty: to_empty() moves them to the CPU (swapped in place or new Parameters, as the swap setting
    says). Added: reset_parameters() there initialises them as torch's module does under the same seed, and
    forward on meta inputs gives torch's output shape and dtype (shape inference, as accelerate's empty init)."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i, torch.float32)
    cpu = OURS[kind](*args, **kwargs)
    with torch.device("meta"):
        m = OURS[kind](*args, **kwargs)
    for p, q in zip(m.parameters(), cpu.parameters(), strict=True):
        assert p.is_meta and (p.shape, p.dtype, p.stride(), p.requires_grad) == (q.shape, q.dtype, q.stride(), True)
    x = first_input(fwd_args, fwd_kwargs)
    expected = THEIRS[kind](*args, **kwargs)(x)
    meta_args, meta_kwargs = [a.to("meta") for a in fwd_args], {k: v.to("meta") for k, v in fwd_kwargs.items()}
    out = OURS[kind](*args, **kwargs, device="meta")(*meta_args, **meta_kwargs)
    assert out.is_meta and out.shape == expected.shape and out.dtype == expected.dtype
    ids = [id(p) for p in m.parameters()]
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        m.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" for p in m.parameters())
    if ids:
        assert ([id(p) for p in m.parameters()] == ids) == swap
    torch.manual_seed(7)
    for module in m.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    torch.manual_seed(7)
    theirs = THEIRS[kind](*args, **kwargs)
    for p, q in zip(m.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind,i", CASES)
def test_repr(kind, i):
    """test_repr: repr() and str() work; the torch module's repr with "Fused" before it (FusedLinear adds act)."""
    args, kwargs = sample(kind, i)[:2]
    ours, theirs = OURS[kind](*args, **kwargs), THEIRS[kind](*args, **kwargs)
    assert str(ours) == repr(ours)
    if kind != "mlp":
        assert repr(ours).startswith("Fused" + repr(theirs).rstrip(")"))


@pytest.mark.parametrize("kind,i", CASES)
def test_save_load(kind, i):
    """test_save_load: torch.save of the module loads back with the same output; its state dict loads back equal,
    with weights_only=True too. Added: pickle and deepcopy give the same output, with parameters of their own."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i)
    m, _ = pair(kind, args, kwargs)
    out = m(*fwd_args, **fwd_kwargs)
    f = io.BytesIO()
    torch.save(m, f)
    f.seek(0)
    copies = [torch.load(f, weights_only=False), pickle.loads(pickle.dumps(m)), copy.deepcopy(m)]
    for c in copies:
        assert type(c) is type(m)
        torch.testing.assert_close(c(*fwd_args, **fwd_kwargs), out, rtol=0, atol=0)
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(c.parameters(), m.parameters()))
    for weights_only in (False, True):
        f = io.BytesIO()
        torch.save(m.state_dict(), f)
        f.seek(0)
        torch.testing.assert_close(torch.load(f, weights_only=weights_only), m.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("kind,i", [c for c in CASES if c.values[0] != "mlp"])
def test_state_dict_round_trip_with_torch(kind, i):
    """torch's module's state dict loads into ours strictly and ours's into torch's; the same keys and the same
    registered parameters (nn.Linear's bias=False registers bias as None, so assigning a plain tensor to it is
    refused as there); strict=False reports the same missing and unexpected keys, strict=True refuses them."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i)
    ours, theirs = OURS[kind](*args, **kwargs).double(), THEIRS[kind](*args, **kwargs).double()
    ours.load_state_dict(theirs.state_dict())
    back = THEIRS[kind](*args, **kwargs).double()
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(*fwd_args, **fwd_kwargs), theirs(*fwd_args, **fwd_kwargs), rtol=0, atol=0)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours._parameters) == list(theirs._parameters)
    partial = dict(list(theirs.state_dict().items())[:-1], extra=torch.zeros(1))
    assert ours.load_state_dict(partial, strict=False) == theirs.load_state_dict(partial, strict=False)
    for m in (ours, theirs):
        with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
            m.load_state_dict(partial)
    for name, value in ours._parameters.items():
        if value is None:
            with pytest.raises(TypeError, match="cannot assign"):
                setattr(ours, name, torch.zeros(3))
            setattr(ours, name, nn.Parameter(torch.zeros(3)))
            assert name in dict(ours.named_parameters())


def non_contiguous(t):
    """torch's _make_non_contiguous: the same values, every other element of a doubled last dimension."""
    if t.dim() == 0:
        return t
    out = torch.repeat_interleave(t.detach(), 2, dim=-1)[..., ::2]
    return out.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("kind,i", CASES)
def test_non_contiguous_tensors(kind, i):
    """test_non_contiguous_tensors: contiguous and non-contiguous inputs and output gradients, in every pairing,
    give the same output and the same gradients to the input and every parameter (float32)."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i, torch.float32)
    m, _ = pair(kind, args, kwargs, torch.float32)
    x = first_input(fwd_args, fwd_kwargs).detach()
    grad = torch.randn(m(x).shape)
    default, default_grads = forward_and_grads(m, [x.clone().requires_grad_()], {}, grad)
    for xi in (x, non_contiguous(x)):
        for gi in (grad, non_contiguous(grad)):
            xi = xi.detach().requires_grad_()
            out, grads = forward_and_grads(m, [xi], {}, gi)
            torch.testing.assert_close(out, default)
            torch.testing.assert_close(grads[0], default_grads[0], atol=1e-4, rtol=0)
            for g, d in zip(grads[1:], default_grads[1:], strict=True):
                torch.testing.assert_close(g, d)


@pytest.mark.parametrize("kind,i", CASES)
def test_gradcheck(kind, i):
    """test_grad: gradcheck in float64 of the total derivative (input and every parameter), then of each parameter
    alone, as torch's _test_gradients_helper does."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i, torch.float64, requires_grad=True)
    m, _ = pair(kind, args, kwargs)
    names = [n for n, _ in m.named_parameters()]
    x = first_input(fwd_args, fwd_kwargs)

    def fn(x, *params):
        return torch.func.functional_call(m, dict(zip(names, params)), (x,))

    params = [p.detach().clone() for p in m.parameters()]
    assert torch.autograd.gradcheck(fn, (x, *[p.requires_grad_() for p in params]))
    x.requires_grad_(False)
    for k in range(len(params)):
        alone = [p.detach().requires_grad_(j == k) for j, p in enumerate(params)]
        assert torch.autograd.gradcheck(fn, (x, *alone))


@pytest.mark.parametrize("kind", list(SOURCES))
def test_second_derivative_refused(kind):
    """test_gradgrad: a contract choice (CONTRIBUTING: first-order autograd). The gradient of a gradient raises,
    naming the fused op, rather than returning a wrong number."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, 0, torch.float64, requires_grad=True)
    m, _ = pair(kind, args, kwargs)
    x = first_input(fwd_args, fwd_kwargs)
    (g,) = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="fused\\.[a-z_]+: second derivatives are not supported"):
        g.sum().backward()


@pytest.mark.parametrize("kind,i", CASES)
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("set_grad", [True, False])
def test_to(kind, i, swap, set_grad):
    """test_to: .to(dtype) keeps every parameter an nn.Parameter of the new dtype, its .grad converted along, the
    same objects (their data swapped in, or set, as the swap setting says); with swap, .to() after a forward and
    backward. Added: the converted module computes as torch's converted one."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i, torch.float32)
    m, theirs = pair(kind, args, kwargs, torch.float32)
    x = first_input(fwd_args, fwd_kwargs)
    if set_grad:
        for p in m.parameters():
            p.grad = torch.randn_like(p)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        if swap and not set_grad and list(m.parameters()):
            m(x).sum().backward()
            m.to(dtype=torch.half)
            m.to(dtype=torch.float32)
            theirs.half().float()  # the same rounding
        for dtype in INFOS[SOURCES[kind]].dtypes:
            ids = [id(p) for p in m.parameters()]
            cdatas = [p._cdata for p in m.parameters()]
            m.to(device="cpu", dtype=dtype)
            assert all(isinstance(p, nn.Parameter) and p.dtype == dtype for p in m.parameters())
            assert [id(p) for p in m.parameters()] == ids
            changed = [p._cdata != c for p, c in zip(m.parameters(), cdatas)]
            assert all(changed) if swap else not any(changed)  # swapped: new data, even for the same dtype
            if set_grad:
                assert all(p.grad.dtype == dtype for p in m.parameters())
            torch.testing.assert_close(m(x.to(dtype)), theirs.to(dtype)(x.to(dtype)))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.parametrize("kind,i", CASES)
def test_train_and_eval_do_not_differ(kind, i):
    """test_if_train_and_eval_modes_differ: the forward never reads .training (train_and_eval_differ=False for
    these modules); eval() gives the training output."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i)
    m, _ = pair(kind, args, kwargs)
    out = m(*fwd_args, **fwd_kwargs)
    torch.testing.assert_close(m.eval()(*fwd_args, **fwd_kwargs), out, rtol=0, atol=0)
    for module in m.modules():
        del module.training
    torch.testing.assert_close(m(*fwd_args, **fwd_kwargs), out, rtol=0, atol=0)


@pytest.mark.parametrize("kind,i", CASES)
def test_frozen_parameters(kind, i):
    """Each parameter in turn with requires_grad=False: it gets no .grad, and the input and the other parameters
    get torch's gradients."""
    args, kwargs, fwd_args, fwd_kwargs, _ = sample(kind, i)
    for k in range(len(list(THEIRS[kind](*args, **kwargs).parameters()))):
        ours, theirs = pair(kind, args, kwargs)
        results = []
        for m in (ours, theirs):
            list(m.parameters())[k].requires_grad_(False)
            x = first_input(fwd_args, fwd_kwargs).detach().requires_grad_()
            m(x).pow(2).sum().backward()
            results.append([x.grad] + [p.grad for p in m.parameters()])
        assert results[0][k + 1] is None
        for g, e in zip(*results, strict=True):
            torch.testing.assert_close(g, e)


class Square(nn.Module):
    def forward(self, w):
        return w * w


PARAMETRIZATIONS = {
    "weight_norm": lambda m: torch.nn.utils.parametrizations.weight_norm(m),
    "spectral_norm": lambda m: torch.nn.utils.parametrizations.spectral_norm(m),
    "orthogonal": lambda m: torch.nn.utils.parametrizations.orthogonal(m),
    "square": lambda m: torch.nn.utils.parametrize.register_parametrization(m, "weight", Square()),
}


# the matrix parametrizations on the linear layer's weight; the norms' weight is a vector
PARAMETRIZED = [("linear", how) for how in PARAMETRIZATIONS] + [("rms", "square"), ("layer", "square")]


@pytest.mark.parametrize("kind,how", PARAMETRIZED)
def test_parametrizations(kind, how):
    """torch.nn.utils.parametrize on the weight (weight_norm, spectral_norm, orthogonal for the linear layer; a
    custom one everywhere): the same output and gradients to the original parameters as torch's module with the
    same parametrization, and a state dict torch's loads."""
    args, kwargs, fwd_args, _, _ = sample(kind, 0)
    ours, theirs = pair(kind, args, kwargs)
    for m in (ours, theirs):
        torch.manual_seed(0)  # spectral_norm draws its power-iteration vectors
        PARAMETRIZATIONS[how](m)
    ours.load_state_dict(theirs.state_dict())
    x = fwd_args[0] if fwd_args else torch.randn(4, args[0], dtype=torch.float64)
    # the output's shape from a third module: spectral_norm steps its power iteration in every forward
    grad_out = torch.ones(THEIRS[kind](*args, **kwargs).double()(x).shape, dtype=torch.float64)
    out, grads = forward_and_grads(ours, [x.detach().requires_grad_()], {}, grad_out)
    want, want_grads = forward_and_grads(theirs, [x.detach().requires_grad_()], {}, grad_out)
    torch.testing.assert_close(out, want)
    for g, e in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, e)
    assert list(ours.state_dict()) == list(theirs.state_dict())


# ---- nn.CrossEntropyLoss's module_db samples, through FusedLinearCrossEntropyLoss ----
CE_INFO = INFOS[nn.CrossEntropyLoss]
HIDDEN = 4


def ce_samples(dtype=torch.float64):
    torch.manual_seed(0)  # module_db's samples draw from the global generator
    return CE_INFO.module_inputs_func(CE_INFO, device="cpu", dtype=dtype, requires_grad=False, training=True)


CE_CASES = [pytest.param(i, id=s.desc) for i, s in enumerate(ce_samples())]


def ce_case(i, dtype):
    """Sample i as FusedLinearCrossEntropyLoss takes it: its constructor kwargs, hidden states [..., 4] and a
    linear weight [C, 4] whose logits have the sample input's shape (classes last), and its target (class
    probabilities classes last). Returns (kwargs, hidden, linear_weight, target, reference loss function of the
    logits, as torch's module computes it with classes in dim 1)."""
    s = ce_samples(dtype)[i]
    kwargs = dict(s.constructor_input.kwargs)
    input, target = s.forward_input.args
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    g = torch.Generator().manual_seed(i)
    logits_shape = input.movedim(1, -1).shape if input.dim() > 1 else input.shape
    hidden = torch.randn(*logits_shape[:-1], HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    linear_weight = torch.randn(classes, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    if target.is_floating_point() and target.dim() > 1:
        target = target.movedim(1, -1)
    theirs = nn.CrossEntropyLoss(**kwargs)

    def reference(logits, target=target):
        if target.is_floating_point():
            target = target.to(logits.dtype).movedim(-1, 1) if logits.dim() > 1 else target.to(logits.dtype)
        return theirs.to(logits.dtype)(logits.movedim(-1, 1) if logits.dim() > 1 else logits, target)

    return kwargs, hidden, linear_weight, target, reference


def ce_loss_and_grads(loss_fn, hidden, linear_weight):
    hidden, linear_weight = (t.detach().requires_grad_() for t in (hidden, linear_weight))
    loss = loss_fn(hidden, linear_weight)
    grads = torch.autograd.grad(loss, (hidden, linear_weight), torch.ones_like(loss))
    return loss, grads


@pytest.mark.parametrize("i", CE_CASES)
def test_cross_entropy_module_inputs(i):
    """test_forward over nn.CrossEntropyLoss's module_db samples (class weights as the `weight` keyword, a buffer
    as there; ignore_index, label smoothing, the three reductions; class-index and class-probability targets; 2-D
    to 6-D and unbatched inputs): FusedLinearCrossEntropyLoss's loss and gradients to hidden states and linear
    weight equal torch's module's on the same logits in float64; in float32 and fp16 (module_db's dtypes) our
    error against float64 is no worse than torch's x2."""
    kwargs, hidden, linear_weight, target, reference = ce_case(i, torch.float64)
    ours = fused.nn.FusedLinearCrossEntropyLoss(**kwargs)
    exact, exact_grads = ce_loss_and_grads(lambda h, w: reference(h @ w.T), hidden, linear_weight)
    loss, grads = ce_loss_and_grads(lambda h, w: ours(h, w, target), hidden, linear_weight)
    torch.testing.assert_close(loss, exact, equal_nan=True)  # nan: every target ignored, as torch
    for g, e in zip(grads, exact_grads, strict=True):
        torch.testing.assert_close(g, e)
    for dtype in (torch.float32, torch.float16):
        kwargs, h, w, t, ref_fn = ce_case(i, dtype)  # the sample drawn in dtype
        low = fused.nn.FusedLinearCrossEntropyLoss(**kwargs)
        ref, ref_grads = ce_loss_and_grads(lambda a, b: ref_fn(a @ b.T), h.double(), w.double())
        got, got_grads = ce_loss_and_grads(lambda a, b: low(a, b, t), h, w)
        want, want_grads = ce_loss_and_grads(lambda a, b: ref_fn(a @ b.T), h, w)
        assert got.dtype == want.dtype == dtype
        assert_accuracy(got, want, ref, what=f"{dtype} loss")
        for g, e, r in zip(got_grads, want_grads, ref_grads, strict=True):
            assert_accuracy(g, e, r, what=f"{dtype} gradient")


def test_cross_entropy_module_generic():
    """The generic checks on the loss module: no parameters; the class weights a buffer that .to() / .half()
    convert and state_dict carries under nn.CrossEntropyLoss's key (and loads into it); repr names the options;
    pickle, deepcopy and torch.save keep the output; built on the meta device, it moves with to_empty()."""
    w = torch.rand(3, dtype=torch.float64) + 0.5
    ours = fused.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, weight=w)
    assert not list(ours.parameters()) and ours.weight is w
    assert list(ours.state_dict()) == list(nn.CrossEntropyLoss(weight=w).state_dict()) == ["weight"]
    theirs = nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64))
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(theirs.weight, w)
    assert repr(ours).startswith("FusedLinearCrossEntropyLoss(reduction='mean'")
    h, lw, t = (
        torch.randn(5, 4, dtype=torch.float64),
        torch.randn(3, 4, dtype=torch.float64),
        torch.tensor([0, 2, 1, 1, 0]),
    )
    out = ours(h, lw, t)
    torch.testing.assert_close(out, nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)(h @ lw.T, t))
    f = io.BytesIO()
    torch.save(ours, f)
    f.seek(0)
    for c in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours), torch.load(f, weights_only=False)):
        torch.testing.assert_close(c(h, lw, t), out, rtol=0, atol=0)
    assert ours.half().weight.dtype == torch.float16 and ours.double().weight.dtype == torch.float64
    with torch.device("meta"):
        meta = fused.nn.FusedLinearCrossEntropyLoss(weight=torch.ones(3))
    meta_loss = meta(h.float().to("meta"), lw.float().to("meta"), t.to("meta"))  # shape inference
    assert meta_loss.is_meta and meta_loss.shape == () and meta_loss.dtype == torch.float32
    assert meta.weight.is_meta and meta.to_empty(device="cpu").weight.device.type == "cpu"
    unweighted = fused.nn.FusedLinearCrossEntropyLoss()
    assert unweighted.weight is None and unweighted.state_dict() == {}


def test_cross_entropy_errors():
    """test_errors over nn.CrossEntropyLoss's module_error_inputs (a long target shaped like the logits, a float
    target of another shape, batch mismatches, class weights of the wrong length, ignore_index with probability
    targets, label_smoothing out of [0, 1]): each refused, naming our function and the argument. torch refuses all
    at forward; ours refuses a bad label_smoothing already at construction."""
    inputs = CE_INFO.module_error_inputs_func(
        CE_INFO, device="cpu", dtype=torch.float32, requires_grad=False, training=True
    )
    assert len(inputs) >= 7
    names = "fused.(nn.FusedLinearCrossEntropyLoss|linear_cross_entropy): (a class-probability )?"
    for error_input in inputs:
        s = error_input.module_error_input
        input, target = s.forward_input.args
        logits_last = input.movedim(1, -1) if input.dim() > 2 else input
        with pytest.raises((RuntimeError, ValueError), match=names + "(target|weight|ignore_index|label_smoothing)"):
            loss_fn = fused.nn.FusedLinearCrossEntropyLoss(**s.constructor_input.kwargs)
            loss_fn(logits_last, torch.eye(logits_last.shape[-1]), target)
