"""The Triton launchers of the norm family, called directly. Without a GPU they run on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small; on a GPU the same tests run on CUDA tensors.
Each launcher is held against the CPU C++ op (torch.ops.fused.*) and against float64."""

import pytest
import torch

pytest.importorskip("triton")

from fused.norm import triton_kernels as tk  # noqa: E402
from tests.harness import ALL_DTYPES, assert_close, compile_for_sm90, make, noncontiguous, raises  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow notes under the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F = torch.ops.fused


def dev(t):
    return t.to(DEVICE) if t is not None else None


def cpu(*ts):
    return [t.cpu() if t is not None else None for t in ts]


def fwd_inputs(shape, C, dtype, residual_dtype, affine, rms):
    x = make(shape, dtype, seed=0)
    r = make(shape, residual_dtype, seed=1) if residual_dtype else None
    w = make((C,), torch.float32 if affine == "fp32" else dtype, low=0.5, high=1.5, seed=2) if affine else None
    b = make((C,), w.dtype, seed=3) if affine and not rms else None
    return x, r, w, b


# (x dtype, residual stream dtype): no residual, the same dtype, a float32 stream for 16-bit x
CASES = [(d, r) for d in ALL_DTYPES for r in (None, d)] + [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("dtype,residual_dtype", CASES)
def test_forward_and_backward_match_cpu_and_float64(rms, dtype, residual_dtype):
    x, r, w, b = fwd_inputs((3, 5, 40), 40, dtype, residual_dtype, "same", rms)
    out, h, mean, rstd = tk.norm_fwd(dev(x), dev(r), [40], dev(w), dev(b), 1e-5, rms)
    cpu_out = F.norm_fwd(x, r, [40], w, b, 1e-5, rms)
    assert out.dtype == dtype and (h.dtype == residual_dtype if r is not None else h.numel() == 0)
    assert_close(out.cpu(), cpu_out[0])
    if r is not None:
        assert torch.equal(h.cpu(), cpu_out[1])  # the sum rounds once, as the CPU kernel's
    for ours, theirs in zip((mean, rstd), cpu_out[2:]):
        assert ours.dtype == theirs.dtype
        assert_close(ours.cpu(), theirs, scale=4)
    hh = h if r is not None else dev(x)
    g, gs = make(x.shape, dtype, seed=4), make(x.shape, hh.dtype, seed=5) if r is not None else None
    grads = tk.norm_backward(dev(g), dev(gs), hh, mean, rstd, dev(w), [40], rms, True, not rms)
    cpu_grads = F.norm_backward(g, gs, hh.cpu(), *cpu(mean, rstd, w), [40], rms, True, not rms)
    for ours, theirs in zip(grads, cpu_grads):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert_close(ours.cpu(), theirs, theirs.dtype, scale=8)
    # against float64 autograd of the reference formula, from the same (rounded) h
    h64 = hh.cpu().double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    norm = (
        torch.nn.functional.rms_norm(h64, (40,), w64, 1e-5)
        if rms
        else torch.nn.functional.layer_norm(h64, (40,), w64, b64, 1e-5)
    )
    assert_close(out.cpu(), norm.detach(), dtype)
    expected = torch.autograd.grad(norm, [t for t in (h64, w64, b64) if t is not None], g.double())
    gh = expected[0] + (gs.double() if gs is not None else 0)
    assert_close(grads[0].cpu(), gh, grads[0].dtype, scale=4)
    assert_close(grads[1].cpu(), expected[1], dtype, scale=8)


@pytest.mark.parametrize("rms", [True, False])
def test_chunks_layouts_and_determinism(rms):
    """260 rows: two rows per backward program; a non-contiguous x and grad; float32 weight with bf16 x;
    the same bits on a second run; no weight."""
    x, r, w, b = fwd_inputs((260, 19), 19, torch.bfloat16, torch.bfloat16, "fp32", rms)
    xs = noncontiguous(x)
    out, h, mean, rstd = tk.norm_fwd(dev(xs), dev(r), [19], dev(w), dev(b), 1e-6, rms)
    cpu_out = F.norm_fwd(x, r, [19], w, b, 1e-6, rms)
    assert_close(out.cpu(), cpu_out[0])
    g = noncontiguous(make(x.shape, torch.bfloat16, seed=6))
    first = tk.norm_backward(dev(g), None, h, mean, rstd, dev(w), [19], rms, True, not rms)
    again = tk.norm_backward(dev(g), None, h, mean, rstd, dev(w), [19], rms, True, not rms)
    for a, c, e in zip(first, again, F.norm_backward(g, None, cpu_out[1], *cpu_out[2:], w, [19], rms, True, not rms)):
        assert torch.equal(a.cpu(), c.cpu())
        assert_close(a.cpu(), e, e.dtype, scale=8)
    no_w = tk.norm_fwd(dev(x), None, [19], None, None, 1e-6, rms)[0]
    assert_close(no_w.cpu(), F.norm_fwd(x, None, [19], None, None, 1e-6, rms)[0])


def test_tiny_empty_and_multi_dim_rows():
    x = make((4, 1), seed=0)
    for rms in (True, False):
        assert_close(
            tk.norm_fwd(dev(x), None, [1], None, None, 1e-5, rms)[0].cpu(),
            F.norm_fwd(x, None, [1], None, None, 1e-5, rms)[0],
        )
    e = torch.empty(0, 8, device=DEVICE)
    out, _, _, rstd = tk.norm_fwd(e, e, [8], None, None, 1e-5, True)
    assert out.shape == (0, 8) and rstd.shape == (0,)
    gh, gw, _ = tk.norm_backward(e, None, e, rstd, rstd, torch.ones(8, device=DEVICE), [8], True, True, False)
    assert gh.shape == (0, 8) and torch.equal(gw.cpu(), torch.zeros(8))
    x3 = make((2, 3, 7), seed=1)
    assert_close(
        tk.norm_fwd(dev(x3), None, [3, 7], None, None, 1e-5, False)[0].cpu(),
        F.norm_fwd(x3, None, [3, 7], None, None, 1e-5, False)[0],
    )


def test_nan_inf_like_the_cpu_kernel():
    x = make((3, 8), seed=0)
    x[0, 1], x[1, 2], x[2, 0] = float("nan"), float("inf"), 1e30
    for rms in (True, False):
        torch.testing.assert_close(
            tk.norm_fwd(dev(x), None, [8], None, None, 1e-5, rms)[0].cpu(),
            F.norm_fwd(x, None, [8], None, None, 1e-5, rms)[0],
            equal_nan=True,
        )


def test_errors():
    x = make((2, 8))
    with raises(r"fused\.add_layer_norm: residual shape \(2, 7\) does not match x shape \(2, 8\)"):
        tk.norm_fwd(dev(x), dev(make((2, 7))), [8], None, None, 1e-5, False)
    with raises(r"fused\.rms_norm: weight must have shape normalized_shape \(8,\), got \(4,\)"):
        tk.norm_fwd(dev(x), None, [8], dev(make((4,))), None, 1e-5, True)
    with raises(r"fused\.rms_norm: the Triton kernel takes rows of at most 65536 elements"):
        tk.norm_fwd(torch.empty(1, 65537, device=DEVICE), None, [65537], None, None, 1e-5, True)


@pytest.mark.parametrize("rms", [True, False])
def test_backward_takes_strided_statistics(rms):
    """mean and rstd as strided views (what a caller's slice of saved statistics gives): the CPU op's gradients,
    as the CUDA binding makes them contiguous too."""
    x, _, w, b = fwd_inputs((6, 24), 24, torch.float32, None, "same", rms)
    _, _, mean, rstd = F.norm_fwd(x, None, [24], w, b, 1e-5, rms)
    g = make(x.shape, seed=4)
    want = F.norm_backward(g, None, x, mean, rstd, w, [24], rms, True, False)
    strided = [noncontiguous(t) if t.numel() else t for t in (mean, rstd)]
    got = tk.norm_backward(dev(g), None, dev(x), *map(dev, strided), dev(w), [24], rms, True, False)
    for ours, theirs in zip(got, want):
        assert_close(ours.cpu(), theirs, scale=4)


def test_kernels_compile_for_sm90_through_their_launchers():
    """The norm launchers' kernels build for sm_90 (tests/triton_sm90.py: a stand-in sm_90 driver, compile only),
    for float32, bfloat16 with a bf16 or float32 residual stream, and float64, with and without residual,
    weight, bias and grad_sum; their divisions and square roots are the correctly rounded ones; the float64
    kernels take eps and C as float64 parameters (the script fails on a float32 scalar parameter there: an fp32
    eps would be 9.99999974738e-06 for 1e-5, and 0 below fp32's range)."""
    import re

    stdout = compile_for_sm90(["norm"])
    stats = {
        m[0]: [int(v) for v in m[1:]]
        for m in re.findall(
            r"compiled (\w+): \d+ variants, sqrt.approx (\d+), fma.rn.f32 \d+, div.rn.f32 (\d+)", stdout
        )
    }
    assert set(stats) == {"_norm_fwd_kernel", "_norm_backward_kernel"}, stdout
    float64_variants = dict(re.findall(r"compiled (\w+): .*, float64 variants (\d+)", stdout))
    assert all(int(float64_variants[name]) > 0 for name in stats), stdout
    for name, (sqrt_approx, div_rn) in stats.items():
        assert sqrt_approx == 0 and div_rn > 0, name
