"""Every public op (tests/op_registry.py's samples) and the fused.nn modules under the tooling a demanding user
runs, on the CPU: torch.export (strict and not, dynamic shapes, run_decompositions, backward through the exported
module), torch.compile(fullgraph=True, dynamic=True) over three sizes without a recompile, fake kernels' strides
under symbolic shapes, the same bits run to run and at 1 and 2 threads, and torch.func's transforms.

Other-sized inputs come from the exported program: its symbolic input shapes say which dims export kept dynamic
and which move together, and each input grows along those dims (repeated, then a little noise on floats), so that
index targets and lengths stay valid."""

import functools
import io
import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import fused
from tests.harness import make
from tests.op_registry import OPS

PUBLIC = [
    "bias_act",
    "glu",
    "bias_dropout_add",
    "unary_chain",
    "linear_act",
    "pairwise_distances",
    "pairwise_topk",
    "chamfer_distance",
    "radius_neighbors",
    "linear_cross_entropy",
    "cross_entropy",
    "rms_norm",
    "layer_norm",
    "add_rms_norm",
    "add_layer_norm",
    "rope",
    "linear_log_probs",
    "linear_distillation_loss",
]
CASES = [pytest.param(name, i, id=f"{name}-{i}") for name in PUBLIC for i in range(len(OPS[name].samples()))]


class OpModule(torch.nn.Module):
    """torch.ops.fused.<name> over a registry sample: its tensors are the inputs, the rest fixed."""

    def __init__(self, name, args):
        super().__init__()
        self.op = getattr(torch.ops.fused, name)
        self.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.tensor_at = [isinstance(a, torch.Tensor) for a in args]

    def forward(self, *tensors):
        it = iter(tensors)
        return self.op(*(next(it) if is_tensor else c for c, is_tensor in zip(self.constants, self.tensor_at)))


def sample(name, i):
    args = OPS[name].samples()[i]
    return OpModule(name, args), tuple(a for a in args if isinstance(a, torch.Tensor))


def auto_dims(tensors):
    return (tuple({d: Dim.AUTO for d in range(t.dim())} for t in tensors),)


@functools.cache
def symbolic_shapes(name, i):
    """The sample's input shapes as non-strict export sees them with every dim Dim.AUTO: sympy expressions for
    the dims it kept dynamic, ints for those it specialised."""
    module, tensors = sample(name, i)
    ep = torch.export.export(module, tensors, dynamic_shapes=auto_dims(tensors), strict=False)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [
        tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in placeholders[p].meta["val"].shape)
        for p in ep.graph_signature.user_inputs
    ]


def grow_along(t, shape, seed):
    """t repeated along each dim to `shape`, in t's memory layout; floats get noise so that rows differ."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # t.permute(order) is laid out contiguously
    out = t.detach().permute(order)
    for d, size in enumerate(shape[k] for k in order):
        reps = [1] * out.dim()
        reps[d] = math.ceil(size / max(out.shape[d], 1))
        out = out.repeat(*reps).narrow(d, 0, size)
    out = out.contiguous()
    if out.is_floating_point():
        out = out + make(tuple(out.shape), out.dtype, low=-0.1, high=0.1, seed=seed)
    return out.permute([order.index(d) for d in range(t.dim())]).requires_grad_(t.requires_grad)


def grown(name, i, tensors, size):
    """The sample's tensors with each dynamic dim's symbol set to size(its sample value)."""
    shapes = symbolic_shapes(name, i)
    values = {}
    for t, shape in zip(tensors, shapes):
        for d, expr in enumerate(shape):
            if not isinstance(expr, int) and expr.is_Symbol:
                values[expr] = size(t.shape[d])
    assert values, f"{name}: export kept no dim dynamic"
    new_shapes = [[s if isinstance(s, int) else int(s.subs(values)) for s in shape] for shape in shapes]
    return tuple(grow_along(t, shape, seed=7) for t, shape in zip(tensors, new_shapes))


def floats(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run_with_grads(fn, tensors):
    """fn's outputs, then the gradients of a weighted sum of its float outputs (inf and NaN taken as 0) with respect
    to the inputs that require grad."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*leaves)
    wanted = [t for t in leaves if t.requires_grad]
    outs = [o for o in floats(out) if o.requires_grad]
    if not (wanted and outs):
        return pytree.tree_leaves(out), []
    loss = sum((o.double().nan_to_num(0.0, 0.0, 0.0) * weights(o)).sum() for o in outs)
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    return pytree.tree_leaves(out), [g for g in grads if g is not None]


def weights(o):
    """1, 2, 3, 1, 2, ... over o: a gradient that is not the same everywhere."""
    return (1 + torch.arange(o.numel(), dtype=torch.float64) % 3).view(o.shape)


def assert_same(got, want):
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.nan_to_num(), w.nan_to_num()) if g.is_floating_point() else torch.equal(g, w)


# ---- torch.export ----
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("name, i", CASES)
def test_export_runs_as_eager_on_other_sizes(name, i, strict):
    """The exported program (Dim.AUTO on every dim) gives eager's bits on the sample and on inputs whose dynamic dims
    grew, forward and backward; so do run_decompositions' program and the program saved and loaded."""
    module, tensors = sample(name, i)
    ep = torch.export.export(module, tensors, dynamic_shapes=auto_dims(tensors), strict=strict)
    bigger = grown(name, i, tensors, lambda n: n + 2)  # even steps: rope's r stays even
    for inputs in (tensors, bigger):
        assert_same(run_with_grads(ep.module(), inputs), run_with_grads(module, inputs))
    if not strict:
        assert_same(ep.run_decompositions().module()(*bigger), module(*bigger))
        saved = io.BytesIO()
        torch.export.save(ep, saved)
        saved.seek(0)
        assert_same(torch.export.load(saved).module()(*bigger), module(*bigger))


def test_export_keeps_the_dims_users_mark_dynamic():
    """Named Dims (what a user writes) for the batch and sequence of a norm, the rows of a loss and the points of a
    k-NN search: export accepts them, and the program runs at new sizes. k-NN needs M >= k, as torch.topk."""
    batch, seq, rows, points = Dim("batch"), Dim("seq"), Dim("rows"), Dim("points", min=3)
    x, w = make((3, 5, 16), seed=1), make((16,), seed=2)
    ep = torch.export.export(
        OpModule("rms_norm", (x, [16], w, None)), (x, w), dynamic_shapes=(({0: batch, 1: seq}, None),)
    )
    x2 = make((4, 7, 16), seed=3)
    assert torch.equal(ep.module()(x2, w), fused.rms_norm(x2, 16, w))

    h, head, t = make((12, 8), seed=4), make((20, 8), seed=5), torch.randint(0, 20, (12,))
    ep = torch.export.export(
        fused.nn.FusedLinearCrossEntropyLoss(), (h, head, t), dynamic_shapes=({0: rows}, None, {0: rows})
    )
    h2, t2 = make((9, 8), seed=6), torch.randint(0, 20, (9,))
    assert torch.equal(ep.module()(h2, head, t2), fused.linear_cross_entropy(h2, head, t2))

    a, b = make((4, 3), seed=7), make((6, 3), seed=8)
    module = OpModule("pairwise_topk", (a, b, 3, 2.0, False, False))
    with pytest.raises(Exception, match="few"):  # min=1 would let M < k through
        torch.export.export(module, (a, b), dynamic_shapes=(({0: rows}, {0: Dim("few")}),))
    ep = torch.export.export(module, (a, b), dynamic_shapes=(({0: rows}, {0: points}),))
    b2 = make((11, 3), seed=9)
    for got, want in zip(ep.module()(a, b2), fused.pairwise_topk(a, b2, 3)):
        assert torch.equal(got, want)


# ---- torch.compile(dynamic=True) ----
@pytest.mark.parametrize("name, i", CASES)
def test_compile_dynamic_three_sizes_no_recompile(name, i):
    """fullgraph, dynamic=True (AOT autograd over the fake kernels at symbolic sizes; the eager backend, so that
    this stays fast: the Inductor run is test_nn_modules_compile_with_inductor): one graph for three sizes, forward
    and backward equal to eager's bits."""
    module, tensors = sample(name, i)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    sizes = [tensors, grown(name, i, tensors, lambda n: n + 2), grown(name, i, tensors, lambda n: 2 * n + 2)]
    assert_same(run_with_grads(compiled, sizes[0]), run_with_grads(module, sizes[0]))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for inputs in sizes[1:]:
            assert_same(run_with_grads(compiled, inputs), run_with_grads(module, inputs))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def noncontiguous_variants(args):
    """args, then args with one float tensor of 2+ dims at a time laid out column-major (same values)."""
    yield args
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.is_floating_point():
            t = a.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(a.requires_grad)
            yield (*args[:k], t, *args[k + 1 :])


def fake_and_real(op, args):
    """The op's outputs on fake tensors of symbolic sizes (duck-sized, as dynamic=True compiles) and on the real
    ones; None when the real op refuses the arguments (its fake kernel is then held to the same error elsewhere)."""
    try:
        real = op(*pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), args))
    except RuntimeError:
        return None
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
    fake_args = pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t.detach()), args)
    with mode:
        fake = op(*fake_args)
    return pytree.tree_leaves(fake), pytree.tree_leaves(real)


@pytest.mark.parametrize("name", sorted(OPS))
def test_fake_kernels_match_real_strides_at_symbolic_sizes(name):
    """Every op's fake kernel, on symbolic sizes, gives the real kernel's shapes, dtypes and strides (opcheck
    compares them at static sizes only), with contiguous and column-major inputs."""
    op = getattr(torch.ops.fused, name)
    for args in OPS[name].samples():
        for variant in noncontiguous_variants(tuple(args)):
            outputs = fake_and_real(op, variant)
            if outputs is None:
                continue
            for fake, real in zip(*outputs):
                if not isinstance(real, torch.Tensor):
                    continue
                assert (tuple(map(int, fake.shape)), fake.dtype) == (tuple(real.shape), real.dtype), name
                if real.numel() > 1:
                    assert tuple(map(int, fake.stride())) == real.stride(), (name, [a.stride() for a in variant])


def test_compiled_dropout_is_reproducible_and_consistent():
    """bias_dropout_add(training=True) under torch.compile draws its mask as torch's dropout does there: the same
    bits under torch.manual_seed run to run, forward and backward the same mask, and eager's bits with Inductor's
    fallback_random (without it Inductor's RNG differs from eager's, for torch's own dropout too)."""
    x, b, r = make((64, 48), seed=1, requires_grad=True), make((48,), seed=2), make((64, 48), seed=3)

    def f(x):
        return fused.bias_dropout_add(x, b, r, 0.3, True)

    def run(fn):
        torch.manual_seed(5)
        out = fn(x)
        return out, torch.autograd.grad(out.sum(), x)[0]

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    first, second = run(compiled), run(compiled)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    kept = first[1] != 0
    assert 0.2 < 1 - kept.float().mean().item() < 0.4
    torch.testing.assert_close(first[0], torch.where(kept, r + (x + b) / 0.7, r))
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        assert_same(run(torch.compile(f, fullgraph=True)), run(f))


# ---- determinism ----
@pytest.mark.parametrize("name, i", CASES)
def test_same_bits_run_to_run_and_at_one_and_two_threads(name, i):
    """At 8x the sample's dynamic sizes, at most 64 (tens of thousands of elements or more: at::parallel_for splits
    the work between threads; rope's five dynamic dims stay under a million elements), forward and backward
    give the same bits twice at 2 threads and at 1 thread."""
    module, tensors = sample(name, i)
    big = grown(name, i, tensors, lambda n: min(8 * n, 64))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (2, 2, 1):
            torch.set_num_threads(n)
            runs.append(run_with_grads(module, big))
    finally:
        torch.set_num_threads(threads)
    assert_same(runs[1], runs[0])
    assert_same(runs[2], runs[0])


def optimizer_run(make_optimizer, threads, clip):
    """Three steps over parameters large enough to be split between threads; every parameter, state tensor, and
    the norms."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)  # the low-bit states round stochastically from torch's generator
    shapes = [(300, 257), (70001,), (3, 5), (4097,)]
    params = [torch.nn.Parameter(make(s, seed=k)) for k, s in enumerate(shapes)]
    opt = make_optimizer(params)
    norms = []
    for step in range(3):
        for k, p in enumerate(params):
            p.grad = make(p.shape, seed=100 * step + k)
        if clip:
            norms.append(fused.clip_grad_norm_(params, 1.0))
        opt.step()
        norms.append(opt.last_grad_norm if opt.last_grad_norm is not None else torch.zeros(()))
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [p.detach().clone() for p in params] + norms + state


@pytest.mark.parametrize(
    "make_optimizer, clip",
    [
        (lambda ps: fused.optim.SGD(ps, lr=0.1, momentum=0.9, max_grad_norm=1.0), False),
        (lambda ps: fused.optim.Adam(ps, lr=0.1, max_grad_norm=1.0), False),
        (lambda ps: fused.optim.AdamW(ps, lr=0.1), True),
        (lambda ps: fused.optim.AdamW(ps, lr=0.1, max_grad_norm=1.0, state_dtype="int8"), False),
        (lambda ps: fused.optim.AdamW(ps, lr=0.1, state_dtype=torch.bfloat16), False),
    ],
    ids=["sgd", "adam", "adamw-clip_grad_norm_", "adamw-int8", "adamw-bf16"],
)
def test_optimizer_steps_same_bits_run_to_run_and_at_one_and_two_threads(make_optimizer, clip):
    threads = torch.get_num_threads()
    try:
        runs = [optimizer_run(make_optimizer, n, clip) for n in (2, 2, 1)]
    finally:
        torch.set_num_threads(threads)
    assert_same(runs[1], runs[0])
    assert_same(runs[2], runs[0])


# ---- torch.func ----
def sum_of_squares(module):
    """The sum of squares of the module's float outputs (inf and NaN as 0)."""

    def f(*tensors):
        return sum(o.double().nan_to_num(0.0, 0.0, 0.0).square().sum() for o in floats(module(*tensors)))

    return f


def autograd_grad(f, tensors, k):
    x = tensors[k].detach().clone().requires_grad_()
    return torch.autograd.grad(f(*tensors[:k], x, *tensors[k + 1 :]), x)[0]


@pytest.mark.parametrize("name, i", CASES)
def test_torch_func_transforms(name, i):
    """vmap (torch's per-sample fallback over the op), grad and vmap(grad) over every input (per-sample gradients,
    targets and lengths batched too) give the bits of plain autograd and a loop; jvp raises, naming the op,
    rather than return a zero tangent."""
    module, tensors = sample(name, i)
    tensors = tuple(t.detach() for t in tensors)
    k = next(j for j, t in enumerate(tensors) if t.is_floating_point())
    f = sum_of_squares(module)
    assert torch.equal(torch.func.grad(f, argnums=k)(*tensors), autograd_grad(f, tensors, k))

    other = grown(name, i, tensors, lambda n: n)  # the same shapes, other values
    stacked = [torch.stack([t, u]) for t, u in zip(tensors, other)]
    samples = [[s[j] for s in stacked] for j in range(2)]
    loop = [pytree.tree_leaves(module(*one)) for one in samples]
    assert_same(torch.func.vmap(module)(*stacked), [torch.stack(list(outs)) for outs in zip(*loop)])
    per_sample = torch.func.vmap(torch.func.grad(f, argnums=k))(*stacked)
    assert torch.equal(per_sample, torch.stack([autograd_grad(f, one, k) for one in samples]))

    with pytest.raises(NotImplementedError, match=r"fused\.\w+: forward-mode AD"):
        torch.func.jvp(lambda x: f(*tensors[:k], x, *tensors[k + 1 :]), (tensors[k],), (torch.ones_like(tensors[k]),))


def test_torch_func_second_derivatives_raise_naming_the_op():
    """grad of grad, jacrev of jacrev, and grad of tensors that require grad outside the transform (whose result a
    later backward could differentiate through the fused backward) raise rather than leave terms out."""
    x = make((5, 8), torch.float64, seed=1)

    def f(t):
        return fused.rms_norm(t, 8).square().sum()

    second = r"fused\.norm_fwd: second derivatives are not supported .*under torch\.func"
    with pytest.raises(RuntimeError, match=second):
        torch.func.grad(lambda t: torch.func.grad(f)(t).sum())(x)
    with pytest.raises(RuntimeError, match=second):
        torch.func.jacrev(torch.func.jacrev(lambda t: fused.rms_norm(t, 8).sum()))(x[0])
    with pytest.raises(RuntimeError, match=second):
        torch.func.grad(f)(x.clone().requires_grad_())
    with pytest.raises(NotImplementedError, match=r"fused\.norm_fwd: forward-mode AD"):
        torch.func.hessian(f)(x[0])
    jacobian = torch.func.jacrev(lambda t: fused.rms_norm(t, 8))(x)
    torch.testing.assert_close(jacobian, torch.func.jacrev(lambda t: torch.nn.functional.rms_norm(t, (8,)))(x))


def test_per_sample_gradients_of_fused_nn_modules():
    """The torch.func recipe for per-sample gradients (functional_call, vmap over grad) through FusedLinear,
    FusedRMSNorm and linear_cross_entropy gives each sample's autograd gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(fused.nn.FusedLinear(8, 16, act="gelu"), fused.nn.FusedRMSNorm(16))
    head = make((20, 16), seed=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, t = make((6, 8), seed=2), torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(0))

    def loss(p, x, t):
        h = torch.func.functional_call(model, p, (x.unsqueeze(0),))
        return fused.linear_cross_entropy(h, head, t.unsqueeze(0))

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, t)
    for j in range(x.shape[0]):
        ref = torch.nn.functional.cross_entropy(model(x[j : j + 1]) @ head.t(), t[j : j + 1])
        for (key, p), g in zip(model.named_parameters(), torch.autograd.grad(ref, list(model.parameters()))):
            torch.testing.assert_close(per_sample[key][j], g, rtol=1e-4, atol=1e-6)


# ---- fused.nn modules ----
def nn_cases():
    torch.manual_seed(0)
    batch = Dim("batch")
    x, r = make((3, 5, 16), seed=1), make((3, 5, 16), seed=2)
    h, head, t = make((12, 8), seed=3), make((20, 8), seed=4), torch.randint(0, 20, (12,))
    student = (h, head, make((12, 6), seed=5), make((20, 6), seed=6), t)
    return {
        "FusedLinear": (fused.nn.FusedLinear(16, 12, act="gelu"), (x,), ({0: batch},)),
        "FusedMLP": (fused.nn.FusedMLP([16, 32, 8], act="silu"), (x,), ({0: batch},)),
        "FusedRMSNorm": (fused.nn.FusedRMSNorm(16), (x,), ({0: batch},)),
        "FusedLayerNorm-residual": (fused.nn.FusedLayerNorm(16), (x, r), ({0: batch}, {0: batch})),
        "FusedLinearCrossEntropyLoss": (
            fused.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1),
            (h, head, t),
            ({0: batch}, None, {0: batch}),
        ),
        "FusedLinearLogProbs": (
            fused.nn.FusedLinearLogProbs(return_entropy=True),
            (h, head, t),
            ({0: batch}, None, {0: batch}),
        ),
        "FusedLinearDistillationLoss": (
            fused.nn.FusedLinearDistillationLoss("jsd"),
            student,
            ({0: batch}, None, {0: batch}, None, {0: batch}),
        ),
    }


def batch_grown(inputs, dims, n):
    return tuple(grow_along(t, (n, *t.shape[1:]), seed=n) if d else t for t, d in zip(inputs, dims))


def module_grads(module, inputs):
    """The module's outputs and the gradients of their float sum with respect to its float inputs and parameters."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = module(*leaves)
    wanted = [t for t in leaves if t.requires_grad] + list(module.parameters())
    grads = torch.autograd.grad(sum(o.sum() for o in floats(out)), wanted, allow_unused=True)
    return pytree.tree_leaves(out), [g for g in grads if g is not None]


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("name", list(nn_cases()))
def test_nn_modules_export_for_training(name, strict):
    """A module exported with a dynamic batch keeps fused ops in its graph and gives eager's outputs and gradients
    (inputs and the exported parameters) at another batch size."""
    module, inputs, dims = nn_cases()[name]
    ep = torch.export.export(module, inputs, dynamic_shapes=dims, strict=strict)
    assert any(str(n.target).startswith("fused.") for n in ep.graph.nodes)
    bigger = batch_grown(inputs, dims, inputs[0].shape[0] + 2)
    assert_same(module_grads(ep.module(), bigger), module_grads(module, bigger))


def test_nn_modules_compile_with_inductor():
    """A block of every fused.nn layer kind under Inductor, dynamic=True: one graph for three batch sizes, forward
    and backward within float32 rounding of eager (Inductor fuses the glue ops between the fused ones)."""
    torch.manual_seed(0)
    norm, mlp, out_norm = fused.nn.FusedRMSNorm(16), fused.nn.FusedMLP([16, 32, 16]), fused.nn.FusedLayerNorm(16)
    head, loss = make((20, 16), seed=1), fused.nn.FusedLinearCrossEntropyLoss(z_loss=1e-3)

    def block(x, t):
        normed, total = out_norm(mlp(norm(x)), x)
        return loss(normed.flatten(0, 1) + total.flatten(0, 1), head, t.flatten())

    params = [*norm.parameters(), *mlp.parameters(), *out_norm.parameters()]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for n in (3, 4, 7):
        x, t = make((n, 5, 16), seed=n, requires_grad=True), torch.randint(0, 20, (n, 5))
        got = [compiled(x, t)]
        got += torch.autograd.grad(got[0], [x, *params])
        want = [block(x, t)]
        want += torch.autograd.grad(want[0], [x, *params])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
