"""Helpers shared by the benchmark cases: which of our GPU backends run here, and wrappers that select one."""

import torch

import fused


def our_labels(device, probe):
    """Our implementations on this device, label -> backend to select (None: the CPU kernels). `probe` is a
    zero-argument call of the op; a backend that raises on it (not compiled, no triton) is left out."""
    if device == "cpu":
        return {"fused": None}
    labels = {}
    for backend in ("cuda", "triton"):
        try:
            with_backend(backend, probe)()
            labels[f"fused[{backend}]"] = backend
        except RuntimeError:
            pass
    return labels


def with_backend(backend, fn):
    """fn(*args) run with fused.set_backend(backend); fn itself when backend is None."""
    if backend is None:
        return fn

    def run(*args):
        old = fused.get_backend()
        fused.set_backend(backend)
        try:
            return fn(*args)
        finally:
            fused.set_backend(old)

    return run


def forward_and_backward(fn, inputs, grad):
    """A zero-argument call of fn(*inputs) and its backward with `grad`."""

    def run():
        return torch.autograd.grad(fn(*inputs), inputs, grad)

    return run


def built(case):
    """The case with its implementations made. A case may hold "build", a call that returns its "impls" (and any
    key that goes with them) in place of "impls": its tensors are then made when it is timed, one case at a time,
    for families whose cases would not fit in memory together."""
    if "build" in case:
        case.update(case.pop("build")())
    return case
