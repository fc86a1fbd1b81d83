"""The shared test harness: devices, dtypes and backends to parametrise over, float64 accuracy checks that
compare our error with eager PyTorch's, and helpers for opcheck, torch.compile and bad-input checks.
Every op family's tests use it."""

import contextlib
import math
import os
import statistics
import subprocess
import sys
import zlib

import pytest
import torch

import fused
from fused._backend import GPU_KERNELS, triton_available

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = triton_available()
# A transformers decoder small enough for CPU tests (fused.patch, optimizer training runs): two layers, 64 wide.
TINY_DECODER = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
# Where the Triton launchers' own tests run: the GPU when there is one, else CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ALL_DTYPES = FLOAT_DTYPES + [torch.float64]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
# torch.jit.trace / script / save / load warn that TorchScript is deprecated (a DeprecationWarning before torch 2.15, a
# FutureWarning from 2.15): tests that use torch.jit on purpose ignore these warnings and no others.
ignore_torch_jit_deprecation = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is ")

# Property tests: `if given is not None:` around them, as a GPU machine without hypothesis runs the rest.
try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    given = settings = st = None


def compile_for_sm90(*family_groups):
    """tests/triton_sm90.py over each group of families (one process per group, in parallel), outside the
    interpreter: the launchers' Triton kernels built for sm_90 against a stand-in driver. Returns the joined
    stdout (one "compiled <kernel>: ..." line per kernel with its PTX instruction counts); fails on any error."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    script = os.path.join(root, "tests", "triton_sm90.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, *group],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
            env=env,
        )
        for group in family_groups
    ]
    stdout = ""
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        stdout += out
    return stdout


def device_backends(op=None):
    """The params of the `dev` fixture (tests/conftest.py), (device, GPU backend) pairs: the CPU kernels always; on
    a GPU each GPU backend (given `op`, those it has: fused._backend.GPU_KERNELS). A test of an op that lacks a
    backend narrows the fixture: @pytest.mark.parametrize("dev", device_backends("op"), indirect=True)."""
    kernels = GPU_KERNELS[op] if op else {"cuda": True, "triton": True}
    # FUSED_TEST_CPU=0 (tools/gpu_suite.sh): the GPU backends only, where CI has run the CPU cases.
    pairs = [pytest.param(("cpu", None), id="cpu")] if os.environ.get("FUSED_TEST_CPU", "1") != "0" else []
    if HAS_CUDA:
        if kernels["cuda"]:
            pairs.append(pytest.param(("cuda", "cuda"), id="cuda-cuda"))
        if kernels["triton"] and HAS_TRITON:
            pairs.append(pytest.param(("cuda", "triton"), id="cuda-triton"))
    return pairs


@contextlib.contextmanager
def backend(name):
    """Runs the block with fused.set_backend(name) (None: leave as is)."""
    old = fused.get_backend()
    if name is not None:
        fused.set_backend(name)
    try:
        yield
    finally:
        fused.set_backend(old)


# Tolerances for parity with the reference in the same dtype (rtol, atol).
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def same_values(ours, eager):
    """NaN where eager has NaN; zeros and infinities equal to eager's, sign included; finite non-zero values within a
    few ulps (another CPU's vector math, or the Triton interpreter's numpy, may round a log, sin or pow differently)."""

    def same(o, e):
        if math.isnan(o) or math.isnan(e):
            return math.isnan(o) and math.isnan(e)
        if o == 0 or e == 0 or math.isinf(o) or math.isinf(e):
            return o == e and math.copysign(1, o) == math.copysign(1, e)
        return abs(o - e) <= 1e-6 * abs(e)

    return all(same(o, e) for o, e in zip(ours.flatten().tolist(), eager.flatten().tolist()))


def assert_close(actual, expected, dtype=None, scale=1.0):
    """Parity in the dtype of `actual` (or `dtype`). In 16-bit, eager and a kernel that computes in fp32 round
    at different points, so each may be an ulp of the largest output away: atol grows with that ulp."""
    dtype = dtype or actual.dtype
    rtol, atol = TOLERANCES[dtype]
    if dtype in (torch.float16, torch.bfloat16) and expected.numel():
        finite = expected[torch.isfinite(expected)]
        if finite.numel():
            atol = max(atol, 2 * torch.finfo(dtype).eps * finite.abs().max().item())
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol * scale, atol=atol * scale, equal_nan=True)


def rel_error(out, ref64):
    """||out - ref|| / ||ref|| in float64 over the finite entries of ref; non-finite entries must match."""
    out = out.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isnan(out[~finite]), torch.isnan(ref64[~finite])), "NaN pattern differs"
    assert torch.equal(out[~finite & ~torch.isnan(ref64)], ref64[~finite & ~torch.isnan(ref64)]), "inf differs"
    diff = (out[finite] - ref64[finite]).norm()
    return (diff / ref64[finite].norm().clamp_min(1e-300)).item()


def assert_accuracy(ours, eager, ref64, slack=2.0, floor=None, what="error"):
    """Our error against float64 is no worse than eager PyTorch's error on the same inputs, times `slack`.
    `floor`: an absolute error allowed regardless (default: a few ulps of the dtype), for when eager is exact;
    `what` names the output in the message."""
    if floor is None:
        floor = 4 * torch.finfo(ours.dtype).eps if ours.dtype != torch.float64 else 1e-14
    ours_err, eager_err = rel_error(ours, ref64), rel_error(eager, ref64)
    assert ours_err <= slack * eager_err + floor, (
        f"{what} vs float64 {ours_err:.3e} exceeds {slack} x eager's {eager_err:.3e} (+{floor:.1e})"
    )


SEEDS = 8  # seeds of a chaotic run judged together (assert_accuracy_over_seeds)


def assert_accuracy_over_seeds(samples, slack=2.0, worst=4.0, floor=None):
    """assert_accuracy for a chaotic run (training steps at a large lr), one (ours, eager, ref64) per seed: there a
    rounding difference grows step by step, so one seed's error moves with the machine's GEMM and summation order
    (eager's too) and one sample cannot judge. Over the seeds: our median error is no worse than eager's median x
    `slack`, and no seed's error exceeds `worst` x eager's worst seed, a bound a wrong formula crosses by far."""
    if floor is None:
        dtype = samples[0][0].dtype
        floor = 4 * torch.finfo(dtype).eps if dtype != torch.float64 else 1e-14
    ours = sorted(rel_error(o, r) for o, _, r in samples)
    eager = sorted(rel_error(e, r) for _, e, r in samples)
    assert statistics.median(ours) <= slack * statistics.median(eager) + floor, (
        f"median error vs float64 over {len(samples)} seeds {statistics.median(ours):.3e} exceeds {slack} x eager's "
        f"{statistics.median(eager):.3e} (+{floor:.1e})"
    )
    assert ours[-1] <= worst * eager[-1] + floor, (
        f"worst error vs float64 over {len(samples)} seeds {ours[-1]:.3e} exceeds {worst} x eager's worst "
        f"{eager[-1]:.3e} (+{floor:.1e})"
    )


def make(shape, dtype=torch.float32, device="cpu", low=-3.0, high=3.0, requires_grad=False, seed=None):
    """Random values in [low, high) drawn in float64, then cast (so all dtypes see the same numbers)."""
    # seed None: one from the shape, the same in every process (hash() of a tuple holding None is not, before
    # Python 3.12: None's hash was its address)
    g = torch.Generator().manual_seed(zlib.crc32(repr(tuple(shape)).encode()) if seed is None else seed)
    t = (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype).to(device)
    return t.requires_grad_(requires_grad)


def noncontiguous(t):
    """The same values as t, in a non-contiguous (strided) tensor."""
    big = torch.empty(t.shape + (2,), dtype=t.dtype, device=t.device)
    big[..., 0] = t.detach()
    return big[..., 0].requires_grad_(t.requires_grad)


def raises(match):
    """pytest.raises for the errors our ops give (RuntimeError, TypeError or ValueError), matching `match`."""
    return pytest.raises((RuntimeError, TypeError, ValueError), match=match)


def check_compile(fn, *args):
    """torch.compile(fullgraph=True) of fn gives the same result as eager fn."""
    torch._dynamo.reset()
    expected = fn(*args)
    got = torch.compile(fn, fullgraph=True)(*args)
    for e, g in zip(
        expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)
    ):
        torch.testing.assert_close(g, e, equal_nan=True)


def check_compile_grads(fn, *inputs):
    """The gradients of fn(*inputs) (a scalar) through torch.compile(fullgraph=True): the backward that aot
    autograd traces equals eager's."""
    torch._dynamo.reset()
    grads = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        f(*leaves).backward()
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(grads[1], grads[0])


def int8_moments(params, keys, seed, quantized=True):
    """Adam moments of a run in progress as fused.optim holds them with state_dtype="int8": codes and scales
    (fused.optim.quantize.encode_) for tensors of 4096 elements or more, float32 for the others (their scales an
    empty stand-in). {key: (states, scales)} for each moment key ("exp_avg", "exp_avg_sq", "max_exp_avg_sq").
    quantized=False: plain state instead, in each param's dtype."""
    from fused.optim import quantize

    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in keys:
        states, scales = [], []
        for p in params:
            x = torch.randn(p.shape, generator=g) * 0.1
            x = x if key == "exp_avg" else x * x
            if not quantized:
                states.append(x.to(p.dtype))
                scales.append(torch.empty(0))
            elif p.numel() >= quantize.MIN_NUMEL:
                codes = torch.empty(p.shape, dtype=quantize.CODES[key])
                scales.append(quantize.scales_like(codes))
                quantize.encode_(codes, scales[-1], x)
                states.append(codes)
            else:
                states.append(x)
                scales.append(torch.empty(0))
        out[key] = (states, scales)
    return out


def adam_step_args(params, grads, exp_avgs, exp_avg_sqs):
    """torch.ops.fused.adam_step_'s positional arguments for one plain AdamW step over these lists (lr 1e-3,
    betas (0.9, 0.999), eps 1e-8, no weight decay, amsgrad, clipping or scaler): for tests of its checks."""
    steps = [torch.zeros(()) for _ in params]
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0)
    flags = (False, True, False, torch.ones((), dtype=torch.float64), None, torch.zeros(()), math.inf, [])
    return (params, grads, exp_avgs, exp_avg_sqs, [], steps, *hyper, *flags)
