"""The Triton launchers of the elementwise family, called directly. Without a GPU they run on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small; on a GPU the same tests run on CUDA tensors.
Each launcher is held against the CPU C++ op (torch.ops.fused.*) and the plain-PyTorch reference."""

import math
import re

import pytest
import torch

pytest.importorskip("triton")

from harness import (  # noqa: E402
    ALL_DTYPES,
    FLOAT_DTYPES,
    assert_accuracy,
    assert_close,
    compile_for_sm90,
    make,
    noncontiguous,
    raises,
    same_values,
)

from fused.elementwise import encode_ops, reference  # noqa: E402
from fused.elementwise import triton_kernels as tk  # noqa: E402
from fused.elementwise.triton_kernels import _as_rows  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow notes under the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTS = list(reference.ACT_FNS)
F = torch.ops.fused


def cpu_op(name, *args):
    """The CPU C++ op on CPU copies of the tensor arguments."""
    moved = [a.cpu() if isinstance(a, torch.Tensor) and a.dim() >= 0 and a is not None else a for a in args]
    return getattr(F, name)(*moved)


def dev(t):
    return t.to(DEVICE)


def equal(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


# ---- bias_act ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_bias_act_forward_backward(act, dtype):
    x, bias, grad = make((3, 5, 131), dtype, seed=0), make((131,), dtype, seed=1), make((3, 5, 131), dtype, seed=2)
    y = tk.bias_act(dev(x), dev(bias), act)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y.cpu(), cpu_op("bias_act", x, bias, act))
    assert_close(y.cpu(), reference.bias_act(x, bias, act))
    assert_close(tk.bias_act(dev(x), None, act).cpu(), reference.bias_act(x, None, act))

    grad_x, grad_bias = tk.bias_act_backward(dev(grad), dev(x), dev(bias), act)
    cpu_gx, cpu_gb = cpu_op("bias_act_backward", grad, x, bias, act)
    # gelu_tanh' cancels where tanh rounds next to -1: a one-ulp tanh difference moves it by ~1e-6
    assert_close(grad_x.cpu(), cpu_gx, scale=4)
    assert_close(grad_bias.cpu(), cpu_gb, scale=8)
    x64, b64 = x.double().requires_grad_(), bias.double().requires_grad_()
    ref_gx, ref_gb = torch.autograd.grad(reference.bias_act(x64, b64, act), (x64, b64), grad.double())
    assert_close(grad_x.cpu(), ref_gx, dtype, scale=2)
    assert_close(grad_bias.cpu(), ref_gb, dtype, scale=8)
    gx_nobias, gb_nobias = tk.bias_act_backward(dev(grad), dev(x), None, act)
    assert_close(gx_nobias.cpu(), cpu_op("bias_act_backward", grad, x, None, act)[0])
    assert gb_nobias.numel() == 0


@pytest.mark.parametrize("shape", [(64, 33), (5, 1100), (2, 3, 4, 7)])
def test_bias_act_backward_bias_grad_shapes_and_determinism(shape):
    """Several row chunks and column blocks of the bias-gradient partial sums; the same bits every run."""
    x, grad = make(shape, seed=0), make(shape, seed=3)
    bias = make(shape[-1:], seed=4)
    grad_x, grad_bias = tk.bias_act_backward(dev(grad), dev(x), dev(bias), "silu")
    cpu_gx, cpu_gb = cpu_op("bias_act_backward", grad, x, bias, "silu")
    assert_close(grad_x.cpu(), cpu_gx)
    assert_close(grad_bias.cpu(), cpu_gb, scale=4)
    equal(tk.bias_act_backward(dev(grad), dev(x), dev(bias), "silu")[1], grad_bias)


def test_bias_act_noncontiguous():
    x, bias = noncontiguous(make((3, 5, 131), seed=0)), make((131,), seed=1)
    grad = noncontiguous(make((3, 5, 131), seed=2))
    assert not x.is_contiguous()
    assert_close(tk.bias_act(dev(x), dev(bias), "gelu").cpu(), reference.bias_act(x, bias, "gelu"))
    grad_x, grad_bias = tk.bias_act_backward(dev(grad), dev(x), dev(bias), "gelu")
    cpu_gx, cpu_gb = cpu_op("bias_act_backward", grad, x, bias, "gelu")
    assert_close(grad_x.cpu(), cpu_gx)
    assert_close(grad_bias.cpu(), cpu_gb, scale=4)


# ---- glu ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "sigmoid"])
def test_glu_chunked_halves(act, dtype):
    """gate and up as the two halves of a [.., 2C] tensor: read in place (row stride 2C), no copy."""
    both = make((3, 5, 2 * 131), dtype, seed=0)
    gate, up = both.chunk(2, dim=-1)
    assert _as_rows(gate)[0].data_ptr() == gate.data_ptr() and _as_rows(gate)[3] == 2 * 131
    grad = make((3, 5, 131), dtype, seed=5)
    y = tk.glu(dev(gate), dev(up), act)
    assert_close(y.cpu(), cpu_op("glu", gate, up, act))
    assert_close(y.cpu(), reference.glu(gate, up, act))
    grad_gate, grad_up = tk.glu_backward(dev(grad), dev(gate), dev(up), act)
    cpu_gg, cpu_gu = cpu_op("glu_backward", grad, gate, up, act)
    assert_close(grad_gate.cpu(), cpu_gg)
    assert_close(grad_up.cpu(), cpu_gu)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    ref_gg, ref_gu = torch.autograd.grad(reference.glu(g64, u64, act), (g64, u64), grad.double())
    assert_close(grad_gate.cpu(), ref_gg, dtype, scale=2)
    assert_close(grad_up.cpu(), ref_gu, dtype, scale=2)


def test_glu_noncontiguous_and_broadcast_layouts():
    """A transposed gate (copied: no unit column stride), an expanded up (stride-0 rows: copied), 1-D inputs."""
    gate = make((131, 15), seed=0).t()
    up = make((1, 131), seed=6).expand(15, 131)
    assert_close(tk.glu(dev(gate), dev(up)).cpu(), reference.glu(gate, up, "silu"))
    grad = noncontiguous(make((15, 131), seed=7))
    for got, want in zip(
        tk.glu_backward(dev(grad), dev(gate), dev(up), "silu"), cpu_op("glu_backward", grad, gate, up, "silu")
    ):
        assert_close(got.cpu(), want)
    g1, u1 = make((131,), seed=0), make((131,), seed=8)
    assert_close(tk.glu(dev(g1), dev(u1), "gelu").cpu(), reference.glu(g1, u1, "gelu"))


# ---- bias_dropout_add ----
SEEDS = [0, 1, -1, 123456789, 2**40 + 3, -(2**62) + 11]


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 131), (2, 3, 13)])
def test_dropout_mask_bit_identical_to_cpu(shape, p):
    """Element counts 7, 1965, 78: none a multiple of 4, so the last Philox group is partial."""
    x, residual, grad = make(shape, seed=0), make(shape, seed=9), make(shape, seed=10)
    bias = make(shape[-1:], seed=11)
    for s in SEEDS:
        seed = torch.tensor(s, dtype=torch.int64)
        y = tk.bias_dropout_add_seeded(dev(x), dev(bias), dev(residual), p, seed)
        equal(y, cpu_op("bias_dropout_add_seeded", x, bias, residual, p, seed))
        keep = reference.dropout_keep_mask(s, shape, p)
        assert_close(y.cpu(), reference.bias_dropout_add(x, bias, residual, p, seed=s))
        grad_x, grad_bias = tk.dropout_backward(dev(grad), p, seed, True)
        cpu_gx, cpu_gb = cpu_op("dropout_backward", grad, p, seed, True)
        equal(grad_x, cpu_gx)
        assert torch.equal(grad_x.cpu() != 0, keep)
        assert_close(grad_bias.cpu(), cpu_gb, scale=4)
        grad_x2, no_bias = tk.dropout_backward(dev(grad), p, seed, False)
        equal(grad_x2, cpu_gx)
        assert no_bias.numel() == 0
    if p == 0.5 and x.numel() > 1000:
        assert 0.4 < keep.float().mean().item() < 0.6


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dropout_dtypes_and_noncontiguous(dtype):
    x, residual, grad = (
        noncontiguous(make((3, 5, 131), dtype, seed=0)),
        make((3, 5, 131), dtype, seed=12),
        make((3, 5, 131), dtype, seed=13),
    )
    bias = make((131,), dtype, seed=14)
    seed = torch.tensor(987654321987, dtype=torch.int64)
    equal(
        tk.bias_dropout_add_seeded(dev(x), dev(bias), dev(residual), 0.25, seed),
        cpu_op("bias_dropout_add_seeded", x, bias, residual, 0.25, seed),
    )
    equal(
        tk.bias_dropout_add_seeded(dev(x), None, dev(residual), 0.25, seed),
        cpu_op("bias_dropout_add_seeded", x, None, residual, 0.25, seed),
    )
    grad_x, grad_bias = tk.dropout_backward(dev(grad), 0.25, seed, True)
    cpu_gx, cpu_gb = cpu_op("dropout_backward", grad, 0.25, seed, True)
    equal(grad_x, cpu_gx)
    assert_close(grad_bias.cpu(), cpu_gb, scale=4)


# ---- unary_chain ----
# Stays in each op's domain for inputs in [0.5, 1.5]; every op appears; 41 ops = 3 passes of 16 slots.
LONG_CHAIN = [
    "sigmoid",
    ("add", 0.5),
    "sqrt",
    "exp",
    "log",
    ("mul", 1.3),
    "tanh",
    ("add", 1.0),
    "rsqrt",
    "square",
    "reciprocal",
    "sin",
    "cos",
    ("pow", 1.5),
    ("clamp_min", 0.6),
    ("clamp_max", 0.9),
    "gelu",
    "gelu_tanh",
    "silu",
    "relu",
    "abs",
    "neg",
    ("add", 2.0),
    ("pow", 3.0),
    "log",
    "exp",
    ("mul", -0.7),
    "abs",
    "sqrt",
    "cos",
    "sin",
    "tanh",
    "sigmoid",
    ("clamp_max", 0.68),
    "reciprocal",
    "square",
    "rsqrt",
    ("pow", 0.5),
    "silu",
    "gelu",
    "neg",
]


@pytest.mark.parametrize("length", [0, 1, 16, 17, len(LONG_CHAIN)])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_unary_chain_lengths(dtype, length):
    ops = LONG_CHAIN[:length]
    x, grad = make((3, 5, 131), dtype, low=0.5, high=1.5, seed=0), make((3, 5, 131), dtype, seed=15)
    y = tk.unary_chain(dev(x), encode_ops(ops))
    assert torch.isfinite(y).all()
    assert_close(y.cpu(), cpu_op("unary_chain", x, encode_ops(ops)))
    ref64 = reference.unary_chain(x.double(), ops)
    assert_accuracy(y.cpu(), reference.unary_chain(x, ops), ref64)
    grad_x = tk.unary_chain_backward(dev(grad), dev(x), encode_ops(ops))
    assert_close(grad_x.cpu(), cpu_op("unary_chain_backward", grad, x, encode_ops(ops)), scale=4)
    x64, xd = x.double().requires_grad_(), x.clone().requires_grad_()
    (ref_gx,) = torch.autograd.grad(reference.unary_chain(x64, ops), x64, grad.double())
    (eager_gx,) = torch.autograd.grad(reference.unary_chain(xd, ops), xd, grad) if ops else (grad,)
    assert_accuracy(grad_x.cpu(), eager_gx, ref_gx)


@pytest.mark.parametrize("exponent", [0.0, 2.0, 3.0, -1.0, 0.5, 2.5])
def test_unary_chain_pow_edge_cases(exponent):
    """Negative bases with integer and fractional exponents, zero, inf and NaN; exponent 0 gives gradient 0."""
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0, float("inf"), float("-inf"), float("nan")])
    for dtype in (torch.float32, torch.float64):
        xd, ops = x.to(dtype), [f"pow:{exponent!r}"]
        assert_close(tk.unary_chain(dev(xd), ops).cpu(), cpu_op("unary_chain", xd, ops))
        assert_close(
            tk.unary_chain_backward(dev(torch.ones_like(xd)), dev(xd), ops).cpu(),
            cpu_op("unary_chain_backward", torch.ones_like(xd), xd, ops),
        )


def test_unary_chain_noncontiguous():
    x, grad = noncontiguous(make((3, 5, 131), low=0.5, high=1.5, seed=0)), noncontiguous(make((3, 5, 131), seed=16))
    ops = encode_ops(["exp", ("mul", 0.5), "tanh"])
    assert_close(tk.unary_chain(dev(x), ops).cpu(), cpu_op("unary_chain", x, ops))
    assert_close(tk.unary_chain_backward(dev(grad), dev(x), ops).cpu(), cpu_op("unary_chain_backward", grad, x, ops))


# ---- every launcher: empty tensors, NaN / inf, errors ----
@pytest.mark.parametrize("shape", [(0,), (0, 131), (3, 0)])
def test_empty(shape):
    x = dev(torch.empty(shape))
    bias = dev(torch.randn(shape[-1]))
    seed = torch.tensor(5)
    assert tk.bias_act(x, bias).shape == shape
    grad_x, grad_bias = tk.bias_act_backward(x, x, bias, "gelu")
    assert grad_x.shape == shape and torch.equal(grad_bias.cpu(), torch.zeros(shape[-1]))
    assert tk.glu(x, x).shape == shape and all(t.shape == shape for t in tk.glu_backward(x, x, x, "silu"))
    assert tk.bias_dropout_add_seeded(x, bias, x, 0.5, seed).shape == shape
    grad_x, grad_bias = tk.dropout_backward(x, 0.5, seed, True)
    assert grad_x.shape == shape and torch.equal(grad_bias.cpu(), torch.zeros(shape[-1]))
    assert tk.unary_chain(x, ["exp"]).shape == shape and tk.unary_chain_backward(x, x, ["exp"]).shape == shape


SPECIALS = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 1e30, -1e30, 3.0, -3.0])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nan_inf_propagate_as_cpu(dtype):
    x = SPECIALS.to(dtype).reshape(1, -1).repeat(3, 1)
    up = x.flip(-1)
    bias = torch.zeros(x.shape[-1], dtype=dtype)
    seed = torch.tensor(77)
    for act in ACTS:
        assert_close(tk.bias_act(dev(x), dev(bias), act).cpu(), cpu_op("bias_act", x, bias, act))
        assert_close(
            tk.bias_act_backward(dev(up), dev(x), None, act)[0].cpu(), cpu_op("bias_act_backward", up, x, None, act)[0]
        )
        assert_close(tk.glu(dev(x), dev(up), act).cpu(), cpu_op("glu", x, up, act))
        for got, want in zip(tk.glu_backward(dev(up), dev(x), dev(up), act), cpu_op("glu_backward", up, x, up, act)):
            assert_close(got.cpu(), want)
    equal(
        tk.bias_dropout_add_seeded(dev(x), dev(bias), dev(up), 0.3, seed),
        cpu_op("bias_dropout_add_seeded", x, bias, up, 0.3, seed),
    )
    ops = ["exp", "tanh", "sigmoid", "relu", "abs", "sqrt", "rsqrt", "log", "reciprocal", "clamp_min:0.5"]
    ops += ["clamp_max:2.0", "clamp_min:nan", "clamp_max:nan", "pow:0.5", "pow:-0.5"]
    for op in ops:
        assert_close(tk.unary_chain(dev(x), [op]).cpu(), cpu_op("unary_chain", x, [op]))
        assert_close(tk.unary_chain_backward(dev(up), dev(x), [op]).cpu(), cpu_op("unary_chain_backward", up, x, [op]))


# Triton 3.6 (the GPU machine's) lowers a float's unary minus to 0 - x, +0 at +0; later versions negate. Under the
# interpreter the older lowering is put back for the "zero_minus" case, so the kernels' signs of zero are checked
# against both here; on a GPU the installed Triton's own lowering is the one there is.
MINUS_LOWERINGS = ["installed"] + (["zero_minus"] if DEVICE == "cpu" else [])


@pytest.mark.parametrize("minus", MINUS_LOWERINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_signed_zeros_as_cpu(dtype, minus, monkeypatch):
    """neg(+-0), and the derivatives that are 0 with a sign: cos' -sin(+-0), reciprocal's -(1/+-inf)^2 (eager: -0 at
    +-inf), pow at -0 and at a tiny negative x (odd, even and fractional exponents); the CPU op gives eager's signs."""
    if minus == "zero_minus":
        from triton.language.semantic import TritonSemantic

        def zero_minus(self, x):
            zero = self.make_tensor(self.builder.get_null_value(x.type.scalar.to_ir(self.builder)), x.type.scalar)
            return self.sub(zero, x, True)

        monkeypatch.setattr(TritonSemantic, "minus", zero_minus)
    x = torch.tensor([-0.0, 0.0, -math.inf, math.inf, -1.0, 4.0, math.nan, 1e-30, -1e-300, -2.0], dtype=dtype)
    up = torch.ones_like(x)
    ops = ["neg", "cos", "sin", "reciprocal", "abs", "sqrt", "rsqrt"]
    ops += ["pow:3.0", "pow:-3.0", "pow:1.5", "pow:-1.5", "pow:2.0"]
    for op in ops:
        assert same_values(tk.unary_chain(dev(x), [op]), cpu_op("unary_chain", x, [op])), op
        backward = tk.unary_chain_backward(dev(up), dev(x), [op])
        assert same_values(backward, cpu_op("unary_chain_backward", up, x, [op])), op


def test_bad_input_names_op_and_argument():
    x = dev(make((3, 4), seed=0))
    with raises("fused.bias_act: unknown act 'swish'"):
        tk.bias_act(x, None, "swish")
    with raises("fused.bias_act: bias must be 1-D"):
        tk.bias_act(x, dev(make((3,), seed=0)))
    with raises("fused.glu: up shape"):
        tk.glu(x, dev(make((3, 5), seed=0)))
    with raises("fused.bias_dropout_add: seed must be a CPU int64 tensor"):
        tk.bias_dropout_add_seeded(x, None, x, 0.1, torch.tensor(1.0))
    with raises("fused.dropout_backward: p must be in"):
        tk.dropout_backward(x, 1.5, torch.tensor(1), False)
    with raises("fused.unary_chain: unknown op 'cube'"):
        tk.unary_chain(x, ["cube"])
    with raises("fused.unary_chain_backward: op 'pow' needs a scalar"):
        tk.unary_chain_backward(x, x, ["pow"])


def test_triton_kernels_compile_for_sm90_through_their_launchers():
    """Every elementwise, distance and linear launcher's kernels build for sm_90 (tests/triton_sm90.py: a stand-in
    sm_90 driver, compile only; every distance variant; the autotuned GEMM compiles every config). The script fails
    on approximate float32 division (eager divides correctly rounded); here: the distance kernels take the correctly
    rounded sqrt, the dropout kernel no fused multiply-add (its output must have the CPU kernel's bits), and the
    16-bit and tf32 GEMMs run on Hopper's tensor cores (wgmma) fed by a cp.async pipeline, every config within the
    227 KB of shared memory a block may use."""
    # two processes: the GEMM configs take as long to build as all the other kernels together
    stdout = compile_for_sm90(["elementwise", "distance"], ["linear"])
    stats = {
        m[0]: [int(v) for v in m[1:]]
        for m in re.findall(
            r"compiled (\w+): \d+ variants, sqrt.approx (\d+), fma.rn.f32 (\d+), div.rn.f32 (\d+)", stdout
        )
    }
    expected = {
        "_bias_act_kernel",
        "_bias_act_backward_kernel",
        "_glu_kernel",
        "_dropout_kernel",
        "_dropout_bias_grad_kernel",
        "_chain_kernel",
        "_distances_kernel",
        "_topk_kernel",
        "_grad_kernel",
        "_linear_act_kernel",
        "_grad_pre_kernel",
    }
    assert expected <= set(stats), stdout
    variants = {m[0]: int(m[1]) for m in re.findall(r"compiled (\w+): (\d+) variants", stdout)}
    # Every distance variant: 4 dtypes x 5 metrics, + the tensor-core path of 3 dtypes; topk smallest and largest;
    # the gradient for every metric but p = 0 (p = 2 at two tile widths).
    assert variants["_distances_kernel"] >= 23 and variants["_topk_kernel"] >= 46, stdout
    assert variants["_grad_kernel"] >= 19, stdout
    assert stats["_distances_kernel"][0] == stats["_topk_kernel"][0] == 0
    assert stats["_dropout_kernel"][1] == 0
    for name in ("_bias_act_kernel", "_chain_kernel", "_grad_kernel", "_linear_act_kernel", "_grad_pre_kernel"):
        assert stats[name][2] > 0, name  # their divisions are there, correctly rounded
    gemm = {
        m[0]: [int(v) for v in m[1:]]
        for m in re.findall(
            r"gemm torch.(\w+ \w+): (\d+) configs, (\d+) on wgmma, (\d+) within shared memory, (\d+) with a "
            r"cp.async pipeline",
            stdout,
        )
    }
    from fused.linear.triton_kernels import HOPPER_CONFIGS

    assert gemm["bfloat16 ieee"][0] == len(HOPPER_CONFIGS), stdout  # the autotuner compiled every config
    for kind in ("bfloat16 ieee", "float16 ieee", "float32 tf32"):  # tensor cores, cp.async, within 227 KB
        assert gemm[kind][1] == gemm[kind][2] == gemm[kind][3] == gemm[kind][0], stdout
