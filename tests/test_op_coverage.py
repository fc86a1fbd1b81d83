"""Every registered fused:: op has what CONTRIBUTING.md's definition of done asks of it: a CPU kernel (or is a
composite), a fake kernel, autograd where it is differentiable, opcheck coverage and a reference. The ops come from
the dispatcher, not from a list kept by hand: an op that is registered but missing from tests/op_registry.py, or
that lacks any of these, fails here (test_coverage_catches_a_forgetful_op shows each check failing)."""

import pytest
import torch

from fused._backend import GPU_KERNELS
from fused._codes import ACT_CODES, UNARY_CODES
from fused.elementwise.reference import ACT_FNS, UNARY_FNS
from tests.op_registry import OPS, Op, reference_of

has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def registered(namespace="fused"):
    """The ops of `namespace` the dispatcher knows, CUDA twins (cuda_<op>) apart."""
    prefix = f"{namespace}::"
    names = sorted(n[len(prefix) :] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))
    return [n for n in names if not n.startswith("cuda_")]


def schema(qualname):
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default._schema


def coverage_problems(qualname, op, ops=OPS):
    """What the op lacks, as readable lines (empty when it has everything)."""
    if op is None:
        return [f"{qualname} is not in tests/op_registry.py"]
    problems = []
    composite = has_kernel(qualname, "CompositeImplicitAutograd")
    if not (composite or has_kernel(qualname, "CPU") or has_kernel(qualname, "CompositeExplicitAutograd")):
        problems.append(f"{qualname} has no CPU kernel")
    if not composite and not has_kernel(qualname, "Meta"):
        problems.append(f"{qualname} has no fake kernel (torch.library.register_fake)")
    if op.backward_of is not None:
        forward = ops.get(op.backward_of)
        if forward is None or forward.backward_of is not None or not forward.differentiable:
            problems.append(f"{qualname}: backward_of={op.backward_of!r} is not a differentiable op of the registry")
    elif op.differentiable:
        if schema(qualname).is_mutable:
            problems.append(f"{qualname} mutates its arguments: say differentiable=False")
        elif not (composite or has_kernel(qualname, "Autograd")):
            problems.append(f"{qualname} has no autograd (torch.library.register_autograd)")
    reference = op.reference if op.backward_of is None else None
    if op.backward_of is None and not (
        callable(reference)
        and getattr(reference, "__module__", "").startswith("fused.")
        and reference.__module__.endswith(".reference")
    ):
        problems.append(f"{qualname} has no reference (a function of a fused.<family>.reference module)")
    if op.backward_of is not None and op.reference is not None:
        problems.append(f"{qualname}: a backward op's reference is its forward's; leave reference out")
    if not op.samples():
        problems.append(f"{qualname} has no opcheck samples")
    return problems


def test_the_registry_lists_exactly_the_registered_ops():
    ops = registered()
    assert len(ops) >= len(OPS) > 0
    assert [n for n in ops if n not in OPS] == [], "registered ops missing from tests/op_registry.py"
    assert [n for n in OPS if n not in ops] == [], "tests/op_registry.py lists ops that are not registered"


@pytest.mark.parametrize("name", registered())
def test_op_coverage(name):
    assert coverage_problems(f"fused::{name}", OPS.get(name)) == []


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name):
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch) on every sample."""
    op = getattr(torch.ops.fused, name)
    for args in OPS[name].samples():
        torch.library.opcheck(op, args)


def test_every_activation_and_chain_op_has_a_reference():
    assert list(ACT_FNS) == list(ACT_CODES)
    assert list(UNARY_FNS) == list(UNARY_CODES)


def test_cuda_twins_match_their_ops():
    """fused::cuda_<op> (csrc/common/registration.h) has its op's arguments and returns; every CUDA C++ kernel the
    GPU router names is such a twin."""
    names = sorted(n[len("fused::") :] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused::"))
    twins = [n for n in names if n.startswith("cuda_")]
    assert twins
    for twin in twins:
        op = twin[len("cuda_") :]
        assert op in names, twin
        assert str(schema(f"fused::{twin}")) == str(schema(f"fused::{op}")).replace(f"fused::{op}(", f"fused::{twin}(")
    for op, kernels in GPU_KERNELS.items():
        assert kernels["cuda"] in (None, f"cuda_{op}"), op
        if kernels["cuda"]:
            assert kernels["cuda"] in twins, f"{op}: define it with def_with_cuda_twin in its schema file"


def test_auto_preference_names_gpu_ops_with_both_backends():
    """Each AUTO_PREFERENCE entry is an op the GPU router knows, with the backend it names among the op's kernels."""
    from fused._backend import AUTO_PREFERENCE

    for op, backend in AUTO_PREFERENCE.items():
        assert op in GPU_KERNELS, op
        assert GPU_KERNELS[op][backend], (op, backend)


def test_gpu_router_passes_keyword_only_arguments(monkeypatch):
    """The dispatcher calls a CUDA kernel with the keyword-only arguments that differ from their defaults as
    keywords (fused::rope's interleaved=True): the router hands them on to the CUDA C++ twin and to Triton."""
    from fused import _backend

    seen = []
    monkeypatch.setattr(_backend, "triton_launcher", lambda path: lambda *a, **kw: seen.append(("triton", a, kw)))
    monkeypatch.setattr(_backend, "triton_available", lambda: True)
    for backend in ("cuda", "triton"):
        monkeypatch.setattr(_backend, "choose", lambda op, b=backend: b)
        router = _backend.gpu_router("rope", cuda_call=lambda *a, **kw: seen.append(("cuda", a, kw)), triton="m:f")
        router(1, 2, interleaved=True)
    assert seen == [("cuda", (1, 2), {"interleaved": True}), ("triton", (1, 2), {"interleaved": True})]


def test_coverage_catches_a_forgetful_op():
    """A new op registered step by step: each missing piece is reported until it has them all."""
    lib = torch.library.Library("fused_probe", "DEF")  # a namespace of its own: fused:: stays as it is
    lib.define("scale(Tensor x) -> Tensor")
    qualname = "fused_probe::scale"
    assert registered("fused_probe") == ["scale"]
    assert coverage_problems(qualname, None) == [f"{qualname} is not in tests/op_registry.py"]
    bare = Op(samples=lambda: [], reference=lambda x: 2 * x)
    assert coverage_problems(qualname, bare) == [
        f"{qualname} has no CPU kernel",
        f"{qualname} has no fake kernel (torch.library.register_fake)",
        f"{qualname} has no autograd (torch.library.register_autograd)",
        f"{qualname} has no reference (a function of a fused.<family>.reference module)",
        f"{qualname} has no opcheck samples",
    ]
    lib.impl("scale", lambda x: 2 * x, "CPU")
    torch.library.register_fake(qualname, lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_autograd(qualname, lambda ctx, g: 2 * g, lib=lib)
    done = Op(samples=lambda: [(torch.ones(3),)], reference=reference_of("bias_act"))  # any reference function
    assert coverage_problems(qualname, done) == []
    lib.define("scale_backward(Tensor g) -> Tensor")
    lib.impl("scale_backward", lambda g: 2 * g, "CPU")
    backward = f"{qualname}_backward"
    ops = {"scale": done}
    assert coverage_problems(backward, Op(samples=lambda: [(torch.ones(3),)], backward_of="scale"), ops) == [
        f"{backward} has no fake kernel (torch.library.register_fake)"
    ]
    assert coverage_problems(backward, Op(samples=lambda: [(torch.ones(3),)], backward_of="nothing"), ops)[-1] == (
        f"{backward}: backward_of='nothing' is not a differentiable op of the registry"
    )
    lib.define("step_(Tensor(a!) x) -> ()")
    lib.impl("step_", lambda x: x.mul_(2), "CPU")
    torch.library.register_fake("fused_probe::step_", lambda x: None, lib=lib)
    assert coverage_problems("fused_probe::step_", done) == [
        "fused_probe::step_ mutates its arguments: say differentiable=False"
    ]
    lib._destroy()
