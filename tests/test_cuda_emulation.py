"""The CUDA C++ kernels, run on the CPU by the host emulation of CUDA's execution model (csrc/common/cuda_host.h,
built by tests/cuda_emulation.py): every launcher of every *_kernels.cu on CPU tensors, held against the CPU
kernels (torch.ops.fused.*) and the float64 references with the harness's tolerances, bit for bit where the CPU
and CUDA formulas are meant to match (dropout). Every buffer sits between NaN guards: a kernel that reads past a
buffer gets NaN, one that writes past it fails the test. Reductions give the same bits under other block
and thread orders and SM counts. Odd sizes, tails, unaligned pointers (the scalar paths), several blocks, grid-
stride loops (one SM: 8 blocks a wave), grids sliced past 65535 blocks, empty inputs. The emulation's own
semantics and planted bugs (a missing barrier, an off-by-one tail, a wrong shuffle offset) are checked first.
Select with `pytest -k emulation`. What it cannot show: see the README's "GPU status"."""

import functools
import glob
import math
import os

import pytest
import torch

from fused._codes import ACT_CODES, parse_op
from fused.distance import reference as dref
from fused.elementwise import encode_ops
from fused.elementwise import reference as eref
from tests import cuda_emulation as ce
from tests.harness import ALL_DTYPES, assert_accuracy, assert_close, int8_moments, make

pytestmark = pytest.mark.skipif(ce.unavailable() is not None, reason=str(ce.unavailable()))

F = torch.ops.fused
F64 = torch.float64
ACTS = list(ACT_CODES)
NAN = float("nan")
GUARD = 32  # NaN elements before and after every buffer


@pytest.fixture
def reschedule(emu):
    """Runs f() under other schedule seeds and SM counts; restores the defaults."""

    def run(f):
        results = []
        try:
            for seed, sms in [(0, 1), (12345, 3), (99, 132)]:
                emu.set_schedule_seed(seed)
                emu.set_sm_count(sms)
                results.append(f())
        finally:
            emu.set_schedule_seed(1)
            emu.set_sm_count(1)
        return results

    return run


def poison(dtype):
    """What surrounds every buffer (and fills outputs): NaN, or a marker for integers."""
    return NAN if dtype.is_floating_point else 0x5A if dtype.itemsize == 1 else -0x5A5A5A5A


def buf(values, misalign=False):
    """A copy of values in the middle of a poison-filled allocation; misalign: one element off 16 bytes."""
    start = GUARD + int(misalign)
    flat = torch.full((start + values.numel() + GUARD,), poison(values.dtype), dtype=values.dtype)
    flat.data_region = (start, start + values.numel())
    view = flat[start : start + values.numel()].view(values.shape)
    view.copy_(values)
    return view


def out(shape, dtype, misalign=False):
    """An output buffer: poison inside too, so an element the kernel does not write shows."""
    return buf(torch.full(shape, poison(dtype), dtype=dtype), misalign)


def pointers(a):
    """A launcher's argument: tensors as data pointers (in lists too), None as a null pointer."""
    if isinstance(a, (list, tuple)):
        return [pointers(x) for x in a]
    return a.data_ptr() if isinstance(a, torch.Tensor) else 0 if a is None else a


def tensors(a):
    return (
        [t for x in a for t in tensors(x)]
        if isinstance(a, (list, tuple))
        else [a]
        if isinstance(a, torch.Tensor)
        else []
    )


def launch(fn, *args):
    """fn(*args) with pointers for tensors; then the guards of every buffer (in lists too) must be intact."""
    fn(*[pointers(a) for a in args])
    for a in tensors(args):
        if hasattr(a._base, "data_region"):
            start, end = a._base.data_region
            guards = torch.cat([a._base[:start], a._base[end:]])
            assert torch.equal(bits(guards), bits(torch.full_like(guards, poison(a.dtype)))), (
                f"{fn.__name__} wrote outside a buffer"
            )


def code(dtype):
    return ce.code(dtype)


def bits(t):
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_equal_bits(a, b):
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), (
        f"max |diff| {(a.double() - b.double()).abs().max()}"
    )


# ---------------------------------------------------------------- the emulation itself
def test_threads_interleave_at_barriers(emu):
    x = torch.arange(100, dtype=torch.int32)
    y = out((100,), torch.int32)
    launch(emu.selftest.rotate, x, y, 100)
    assert torch.equal(y, x.roll(-1))  # each thread reads what the next one wrote before the barrier


def collective_model(x, kind, mask, exited, arg, width):
    """What each thread of a CUDA block gets from the collective: lanes that exited (or that the block lacks) take no
    part, and a shuffle reading from one gets -1 (0xff bytes); -3 and -2 for the lanes that return first."""
    res = []
    for t in range(len(x)):
        w0, lane = t - t % 32, t % 32
        seg, pos = lane - lane % width, lane % width
        part = [mask >> m & 1 and not exited >> m & 1 and w0 + m < len(x) for m in range(32)]
        if exited >> lane & 1 or not mask >> lane & 1:
            res.append(-3 if exited >> lane & 1 else -2)
        elif kind <= 3 or kind == 7:
            src = [
                seg + arg % width,
                lane - arg if pos >= arg else lane,
                lane + arg if pos + arg < width else lane,
                lane ^ arg if (lane ^ arg) < seg + width else lane,
                0,
                0,
                0,
                lane ^ 1,
            ][kind]
            res.append(x[w0 + src] if part[src] else -1)
        else:
            ballot = sum(1 << m for m in range(32) if part[m] and x[w0 + m])
            everyone = sum(1 << m for m in range(32) if part[m])
            res.append(
                [ballot - (1 << 32) if ballot >= 1 << 31 else ballot, int(ballot != 0), int(ballot == everyone)][
                    kind - 4
                ]
            )
    return res


# kind: 0-3 __shfl_sync / _up / _down / _xor, 4-6 __ballot_sync / __any_sync / __all_sync, 7 each lane reads its
# neighbour's shared-memory write after __syncwarp. 48 threads: the second warp has 16 lanes.
@pytest.mark.parametrize(
    "kind,arg,width",
    [
        (0, 5, 32),
        (0, 37, 8),
        (1, 3, 32),
        (1, 2, 8),
        (2, 1, 32),
        (2, 3, 16),
        (3, 16, 32),
        (3, 5, 8),
        (4, 0, 32),
        (5, 0, 32),
        (6, 0, 32),
        (7, 0, 32),
    ],
)
@pytest.mark.parametrize(
    "mask,exited,threads",
    [(0xFFFFFFFF, 0, 64), (0x0000FFFF, 0, 64), (0x5555AAAA, 0, 64), (0xFFFFFFFF, 0x00300021, 64), (0xFFFFFFFF, 0, 48)],
)
def test_warp_collectives(emu, kind, arg, width, mask, exited, threads):
    x = torch.tensor([(t * 7) % 5 if kind >= 4 else 1000 + t for t in range(threads)], dtype=torch.int32)
    y = out((threads,), torch.int32)
    launch(emu.selftest.collective, x, y, threads, kind, mask, exited, arg, width)
    assert y.tolist() == collective_model(x.tolist(), kind, mask, exited, arg, width)


def test_planted_missing_syncwarp_is_caught(emu, reschedule):
    """Warp-synchronous code without __syncwarp: lanes run one after another, so some read their neighbour's slot
    before it was written, in every thread order."""
    x = torch.arange(64, dtype=torch.int32)

    def exchange(kind):
        y = out((64,), torch.int32)
        launch(emu.selftest.collective, x, y, 64, kind, 0xFFFFFFFF, 0, 0, 32)
        return y

    for y in [exchange(7)] + reschedule(lambda: exchange(7)):
        assert torch.equal(y, x ^ 1)
    for y in [exchange(8)] + reschedule(lambda: exchange(8)):
        assert not torch.equal(y, x ^ 1)


def test_atomics(emu):
    c = torch.zeros(4, dtype=torch.int32)
    launch(emu.selftest.atomics, c, 3, 64, 100)
    assert c.tolist() == [192, -1, 192 % 101, 191]  # atomicInc wraps to 0 after the limit


def test_planted_missing_barrier_is_caught(emu, reschedule):
    """Without the barriers a thread reads shared memory before the thread that writes it ran: NaN or a wrong sum,
    in every order the emulation runs threads (index order too)."""
    x = make((2 * 256,), seed=0)

    def block_sum(barrier):
        y = out((2,), torch.float32)
        launch(emu.selftest.block_sum, x, y, 2, 256, barrier)
        return y

    for y in [block_sum(True)] + reschedule(lambda: block_sum(True)):
        assert_close(y, x.view(2, 256).sum(1), scale=10)
    for y in [block_sum(False)] + reschedule(lambda: block_sum(False)):
        assert not torch.allclose(y, x.view(2, 256).sum(1))


def test_planted_off_by_one_tail_is_caught(emu):
    x = torch.cat([make((100,), seed=0), torch.ones(1)])[:100]  # the read past the end gets 1, not a guard's NaN
    y = out((100,), torch.float32)
    launch(emu.selftest.scale, x, y, 100, 0, 32)
    assert torch.equal(y, 2 * x)
    with pytest.raises(AssertionError, match="wrote outside a buffer"):
        launch(emu.selftest.scale, x, y, 100, 1, 32)


def test_planted_wrong_shuffle_offset_is_caught(emu):
    x = make((64,), seed=0)
    y = out((2,), torch.float32)
    launch(emu.selftest.warp_sum, x, y, 2, 16)
    assert_close(y, x.view(2, 32).sum(1), scale=10)
    launch(emu.selftest.warp_sum, x, y, 2, 8)
    assert not torch.allclose(y, x.view(2, 32).sum(1))


@pytest.mark.parametrize(
    "mode,message",
    [
        (0, r"waits at __syncthreads \(.*\) while .* waits at another"),
        (1, "__shfl_xor_sync and lane 16's __shfl_down_sync of one mask differ"),
        (
            2,
            r"deadlock in block \(0,0,0\): no thread can run; "
            r"threads 0-15: __shfl_xor_sync; threads 16-63: __syncthreads",
        ),
        (3, r"__shfl_sync with mask 1 and width 32 \(the calling lane must be in the mask"),
        (4, r"invalid configuration argument: launch of grid \(1,1,1\), block \(2048,1,1\)"),
        (5, r"invalid configuration argument: launch of grid \(1,65536,1\)"),
        (6, "dynamic shared memory is not emulated"),
    ],
)
def test_faults_fail_the_launch(emu, mode, message):
    with pytest.raises(RuntimeError, match=message):
        emu.selftest.fault(mode)


# ---------------------------------------------------------------- elementwise
def ew_workspace(emu, rows, C, dtype):
    return out((emu.column_sum_workspace(rows, C),), torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_bias_act(emu, act, dtype):
    """67 x 257 elements: several waves of the grid-stride loop, the bias column wrapping mid-group, a tail."""
    x, b = make((67, 257), dtype, seed=0), make((257,), dtype, seed=1)
    expected = F.bias_act(x, b, act)
    for misalign in (False, True):
        y = out(x.shape, dtype, misalign)
        launch(emu.bias_act, code(dtype), ACT_CODES[act], buf(x, misalign), buf(b), y, x.numel(), 257)
        assert_close(y, expected)
        assert_close(y, eref.bias_act(x.double(), b.double(), act), dtype)
    y = out(x.shape, dtype)
    launch(emu.bias_act, code(dtype), ACT_CODES[act], buf(x), None, y, x.numel(), 1)
    assert_close(y, F.bias_act(x, None, act))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_bias_act_backward(emu, act, dtype, reschedule):
    """100 rows of 131: 7 row chunks and 2 column blocks of partial sums; the bias gradient's bits do not depend
    on the block and thread order or the SM count."""
    rows, C = 100, 131
    x, g, b = make((rows, C), dtype, seed=0), make((rows, C), dtype, seed=2), make((C,), dtype, seed=1)
    cpu_gx, cpu_gb = F.bias_act_backward(g, x, b, act)
    x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
    ref_gx, ref_gb = torch.autograd.grad(eref.bias_act(x64, b64, act), (x64, b64), g.double())

    def run(misalign=False):
        gx, gb = out(x.shape, dtype, misalign), out((C,), dtype)
        launch(
            emu.bias_act_backward,
            code(dtype),
            ACT_CODES[act],
            buf(g, misalign),
            buf(x, misalign),
            buf(b),
            gx,
            gb,
            ew_workspace(emu, rows, C, dtype),
            rows * C,
            C,
        )
        return gx, gb

    for misalign in (False, True):
        gx, gb = run(misalign)
        assert_close(gx, cpu_gx, scale=4)
        assert_close(gx, ref_gx, dtype, scale=2)
        assert_close(gb, cpu_gb, scale=8)
        assert_close(gb, ref_gb, dtype, scale=8)
    for other in reschedule(lambda: run()[1]):
        assert_equal_bits(other, gb)
    gx = out(x.shape, dtype)
    launch(emu.bias_act_backward, code(dtype), ACT_CODES[act], buf(g), buf(x), None, gx, None, None, rows * C, 1)
    assert_close(gx, F.bias_act_backward(g, x, None, act)[0], scale=4)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "sigmoid"])
def test_glu(emu, act, dtype):
    """gate and up as the two strided halves of one tensor (rows of 2 x cols), odd and vector-sized widths; more
    rows (150) and columns (9001) than one wave of blocks covers (both grid-stride loops)."""
    for rows, cols in [(37, 77), (9, 256), (150, 40), (3, 9001)]:
        h = make((rows, 2 * cols), dtype, seed=0)
        grad = make((rows, cols), dtype, seed=3)
        gate, up = h.chunk(2, -1)
        hb = buf(h)
        gate_b, up_b = hb[:, :cols], hb[:, cols:]
        y = out((rows, cols), dtype)
        launch(emu.glu, code(dtype), ACT_CODES[act], gate_b, 2 * cols, up_b, 2 * cols, y, rows, cols)
        assert_close(y, F.glu(gate, up, act))
        assert_close(y, eref.glu(gate.double(), up.double(), act), dtype)
        gg, gu = out((rows, cols), dtype), out((rows, cols), dtype)
        launch(
            emu.glu_backward,
            code(dtype),
            ACT_CODES[act],
            buf(grad),
            gate_b,
            2 * cols,
            up_b,
            2 * cols,
            gg,
            gu,
            rows,
            cols,
        )
        cpu_gg, cpu_gu = F.glu_backward(grad, gate, up, act)
        assert_close(gg, cpu_gg, scale=4)
        assert_close(gu, cpu_gu, scale=4)
        g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
        ref_gg, ref_gu = torch.autograd.grad(eref.glu(g64, u64, act), (g64, u64), grad.double())
        assert_close(gg, ref_gg, dtype, scale=2)
        assert_close(gu, ref_gu, dtype, scale=2)


def dropout_args(p, seed):
    threshold = 0 if p <= 0 else (1 << 32) if p >= 1 else int(p * 4294967296.0 + 0.5)
    return seed % (1 << 64), threshold, 1.0 / (1.0 - p) if p < 1 else 0.0


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_bias_dropout_add_is_the_cpu_kernels_bits(emu, p, dtype):
    """The Philox mask and the rounding of residual + keep * (x + bias) are the CPU kernel's, bit for bit: element
    counts that are no multiple of 4 (a Philox call cut short), unaligned pointers, a seed above 2^63."""
    rows, C = 51, 259
    x, b, r = make((rows, C), dtype, seed=0), make((C,), dtype, seed=1), make((rows, C), dtype, seed=2)
    for seed in (1234, -5):
        seed_t = torch.tensor(seed)
        expected = F.bias_dropout_add_seeded(x, b, r, p, seed_t)
        for misalign in (False, True):
            y = out(x.shape, dtype, misalign)
            launch(
                emu.bias_dropout_add,
                code(dtype),
                buf(x, misalign),
                buf(b),
                buf(r, misalign),
                y,
                x.numel(),
                C,
                *dropout_args(p, seed),
            )
            assert_equal_bits(y, expected)
        keep = eref.dropout_keep_mask(seed, x.shape, p)
        assert_close(y, eref.bias_dropout_add(x.double(), b.double(), r.double(), p, seed=seed), dtype)
        assert torch.equal(y[~keep], r[~keep])  # dropped: the residual alone
        y = out(x.shape, dtype)
        launch(emu.bias_dropout_add, code(dtype), buf(x), None, buf(r), y, x.numel(), 1, *dropout_args(p, seed))
        assert_equal_bits(y, F.bias_dropout_add_seeded(x, None, r, p, seed_t))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dropout_backward(emu, dtype, reschedule):
    """grad_x: the CPU kernel's bits; the bias gradient deterministic, against the CPU kernel and float64."""
    rows, C, p, seed = 77, 133, 0.3, 99
    g = make((rows, C), dtype, seed=0)
    cpu_gx, cpu_gb = F.dropout_backward(g, p, torch.tensor(seed), True)

    def run(misalign=False):
        gx, gb = out(g.shape, dtype, misalign), out((C,), dtype)
        launch(
            emu.dropout_backward,
            code(dtype),
            buf(g, misalign),
            gx,
            gb,
            ew_workspace(emu, rows, C, dtype),
            g.numel(),
            C,
            *dropout_args(p, seed),
        )
        return gx, gb

    for misalign in (False, True):
        gx, gb = run(misalign)
        assert_equal_bits(gx, cpu_gx)
        assert_close(gb, cpu_gb, scale=8)
        keep = eref.dropout_keep_mask(seed, g.shape, p)
        assert_close(gb, torch.where(keep, g.double() / (1 - p), 0).sum(0), dtype, scale=8)
    for other in reschedule(lambda: run()[1]):
        assert_equal_bits(other, gb)
    gx = out(g.shape, dtype)
    launch(emu.dropout_backward, code(dtype), buf(g), gx, None, None, g.numel(), 1, *dropout_args(p, seed))
    assert_equal_bits(gx, cpu_gx)


CHAINS = [
    ["square"] * 10,
    [("mul", 0.5), "tanh", ("add", 1.0)],
    ["sigmoid", "log", "neg", "exp", ("pow", 3.0), "sqrt", "rsqrt", "reciprocal"],
    ["abs", ("clamp_min", 0.25), ("clamp_max", 2.0), "relu", "gelu", "gelu_tanh", "silu", "sin", "cos", ("pow", 0.0)],
    [("mul", 0.999)] * 64,  # a whole launch's worth of ops
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unary_chain_special_values_are_the_cpu_kernels(emu, dtype):
    """Signed zeros, infinities and NaN through pow(+-0.5) (eager's sqrt / rsqrt), rsqrt's derivative and clamp to a
    NaN bound: the CPU kernel's NaNs, zeros and infinities (signs included), and its finite values within 1e-6 (the
    CPU's vector pow and the device's scalar pow may round apart)."""
    x = torch.tensor([-0.0, 0.0, -math.inf, math.inf, -1.0, 4.0, math.nan, 1e-30, -2.0], dtype=dtype)
    g = torch.ones_like(x)
    for chain in ([("pow", 0.5)], [("pow", -0.5)], ["rsqrt"], [("clamp_min", math.nan)], [("clamp_max", math.nan)]):
        ops = encode_ops(chain)
        op_codes, scalars = zip(*[parse_op("unary_chain", s)[1:] for s in ops])
        y, gx = out(x.shape, dtype), out(x.shape, dtype)
        launch(emu.unary_chain, code(dtype), list(op_codes), list(scalars), buf(x), y, x.numel())
        launch(emu.unary_chain_backward, code(dtype), list(op_codes), list(scalars), buf(g), buf(x), gx, x.numel())
        for got, want in ((y, F.unary_chain(x, ops)), (gx, F.unary_chain_backward(g, x, ops))):
            nan, edge = want.isnan(), (want == 0) | want.isinf()
            assert torch.equal(got.isnan(), nan), chain
            assert torch.equal(got[edge], want[edge]) and torch.equal(got[edge].signbit(), want[edge].signbit())
            torch.testing.assert_close(got[~nan & ~edge], want[~nan & ~edge], rtol=1e-6, atol=0)  # vector vs scalar pow


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("chain", CHAINS, ids=range(len(CHAINS)))
def test_unary_chain(emu, chain, dtype):
    x, g = make((33, 301), dtype, seed=0, low=0.1, high=2.0), make((33, 301), dtype, seed=1)
    ops = encode_ops(chain)
    codes = [parse_op("unary_chain", s)[1:] for s in ops]
    op_codes, scalars = [c for c, _ in codes], [v for _, v in codes]
    for misalign in (False, True):
        y, gx = out(x.shape, dtype, misalign), out(x.shape, dtype, misalign)
        launch(emu.unary_chain, code(dtype), op_codes, scalars, buf(x, misalign), y, x.numel())
        assert_close(y, F.unary_chain(x, ops), scale=4)
        assert_close(y, eref.unary_chain(x.double(), chain), dtype, scale=4)
        launch(
            emu.unary_chain_backward, code(dtype), op_codes, scalars, buf(g, misalign), buf(x, misalign), gx, x.numel()
        )
        assert_close(gx, F.unary_chain_backward(g, x, ops), scale=8)
        x64 = x.double().requires_grad_()
        (ref_gx,) = torch.autograd.grad(eref.unary_chain(x64, chain), x64, g.double())
        assert_close(gx, ref_gx, dtype, scale=8)


def test_elementwise_empty_inputs_launch_nothing(emu):
    y = out((0,), torch.float32)
    launch(emu.bias_act, 0, 2, buf(torch.zeros(0)), None, y, 0, 1)
    launch(emu.unary_chain, 0, [0], [0.0], buf(torch.zeros(0)), y, 0)
    launch(emu.bias_dropout_add, 0, buf(torch.zeros(0)), None, buf(torch.zeros(0)), y, 0, 1, *dropout_args(0.5, 1))
    gb = out((5,), torch.float32)
    launch(
        emu.bias_act_backward, 0, 2, buf(torch.zeros(0)), buf(torch.zeros(0)), buf(torch.zeros(5)), y, gb, None, 0, 5
    )
    launch(emu.glu, 0, 4, buf(torch.zeros(0)), 0, buf(torch.zeros(0)), 0, y, 0, 7)
    assert torch.isnan(gb).all()  # nothing written


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_linear_bias_act_epilogue(emu, act, dtype):
    """In place on the GEMM's output: pre = y + bias (that add's own bits), y = act(pre); rows wider and narrower
    than a block (a partial warp)."""
    for M, N in [(37, 300), (5, 45)]:
        y0, b = make((M, N), dtype, seed=0), make((N,), dtype, seed=1)
        y, pre = buf(y0), out((M, N), dtype)
        launch(emu.bias_act_epilogue, code(dtype), ACT_CODES[act], y, pre, buf(b), M, N)
        assert_equal_bits(pre, y0 + b)
        assert_close(y, F.bias_act(y0, b, act))
        assert_close(y, eref.bias_act(y0.double(), b.double(), act), dtype)
        y = buf(y0)
        launch(emu.bias_act_epilogue, code(dtype), ACT_CODES[act], y, None, None, M, N)
        assert_close(y, F.bias_act(y0, None, act))


def test_linear_bias_act_epilogue_rows_past_the_grid(emu):
    """A block per row up to 262144 blocks; rows beyond in the blocks' row-stride loop."""
    M, N = 262145 + 3, 1
    y0, b = make((M, N), seed=0), make((N,), seed=1)
    y = buf(y0)
    launch(emu.bias_act_epilogue, code(torch.float32), ACT_CODES["relu"], y, None, buf(b), M, N)
    assert_equal_bits(y, torch.relu(y0 + b))


def linear_workspace(emu, dtype, M, N):
    math_t = torch.float64 if dtype == torch.float64 else torch.float32
    return out((emu.act_grad_bias_workspace_bytes(code(dtype), M, N) // math_t.itemsize,), math_t)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_linear_act_grad_bias(emu, act, dtype, reschedule):
    """grad_pre = grad * act'(saved) and the bias gradient: 300 rows (3 chunks of 128, the last cut short) x 70
    columns (3 tiles of 32, the last partial); the bias gradient's bits do not depend on the schedule."""
    M, N = 300, 70
    grad, pre0 = make((M, N), dtype, seed=0), make((M, N), dtype, seed=1)
    saved = pre0 if act in ("gelu", "gelu_tanh", "silu") else F.bias_act(pre0, None, act)
    cpu_gp, cpu_gb = F.linear_act_grad_pre(grad, saved, act, True)
    p64 = pre0.double().requires_grad_()
    (ref_gp,) = torch.autograd.grad(eref.bias_act(p64, None, act), p64, grad.double())

    def run():
        gp, gb = out((M, N), dtype), out((N,), dtype)
        launch(
            emu.act_grad_bias,
            code(dtype),
            ACT_CODES[act],
            buf(grad),
            buf(saved),
            gp,
            gb,
            linear_workspace(emu, dtype, M, N),
            M,
            N,
        )
        return gp, gb

    gp, gb = run()
    assert_close(gp, cpu_gp, scale=4)
    assert_close(gp, ref_gp, dtype, scale=4)
    assert_close(gb, cpu_gb, scale=8)
    assert_close(gb, ref_gp.sum(0), dtype, scale=8)
    for other in reschedule(lambda: run()[1]):
        assert_equal_bits(other, gb)
    gp = out((M, N), dtype)
    launch(emu.act_grad_bias, code(dtype), ACT_CODES[act], buf(grad), buf(saved), gp, None, None, M, N)
    assert_close(gp, cpu_gp, scale=4)


def test_linear_act_grad_bias_column_tiles_past_65535(emu):
    """65537 column tiles of 32: two launches on grid y (65535 + 2 tiles), then the bias-gradient sum."""
    M, N = 2, 65536 * 32 + 5
    grad, saved = make((M, N), seed=0), make((M, N), seed=1)
    gp, gb = out((M, N), torch.float32), out((N,), torch.float32)
    launch(
        emu.act_grad_bias,
        code(torch.float32),
        ACT_CODES["silu"],
        buf(grad),
        buf(saved),
        gp,
        gb,
        linear_workspace(emu, torch.float32, M, N),
        M,
        N,
    )
    cpu_gp, cpu_gb = F.linear_act_grad_pre(grad, saved, "silu", True)
    assert_close(gp, cpu_gp, scale=4)
    assert_close(gb, cpu_gb, scale=4)


def test_linear_empty_inputs_launch_nothing(emu):
    y = out((0, 5), torch.float32)
    launch(emu.bias_act_epilogue, 0, 2, y, None, buf(torch.zeros(5)), 0, 5)
    gb = out((5,), torch.float32)
    launch(emu.act_grad_bias, 0, 2, buf(torch.zeros(0, 5)), buf(torch.zeros(0, 5)), y, gb, None, 0, 5)
    assert torch.isnan(gb).all()  # nothing written: the binding zeroes it


# ---------------------------------------------------------------- distance
METRICS = {0.0: 0, 1.0: 1, 2.0: 2, math.inf: 3}


def metric(p):
    return METRICS.get(p, 4)


def emu_distances(emu, a, b, p=2.0, squared=False, la=None, lb=None):
    """pairwise_distances_direct as the binding launches it: dist [B, N, M] in a's dtype."""
    (B, N, D), M = a.shape, b.shape[1]
    dist = out((B, N, M), a.dtype)
    launch(
        emu.pairwise_distances_direct, code(a.dtype), metric(p), p, squared, buf(a), buf(b), la, lb, dist, B, N, M, D
    )
    return dist


def emu_distance_grad(emu, grad, x, y, dist, p=2.0, squared=False, lx=None, ly=None, transposed=False):
    """pairwise_distances_grad as the binding launches it: the gradient of x [B, R, D] in the math type.
    transposed: x is b and y is a, so (grad, dist) [B, C, R] are read transposed."""
    (B, R, D), C = x.shape, y.shape[1]
    gx = out((B, R, D), torch.float64 if x.dtype == torch.float64 else torch.float32)
    strides = (1, R) if transposed else (C, 1)
    args = (code(x.dtype), metric(p), p, squared, buf(x), buf(y), buf(grad), buf(dist), lx, ly, gx, B, R, C, D)
    launch(emu.pairwise_distances_grad, *args, *strides)
    return gx


def emu_distance_grads(emu, grad, a, b, dist, p=2.0, squared=False, la=None, lb=None):
    """The gradients of a and b: grad_b is the same kernel with a and b swapped."""
    ga = emu_distance_grad(emu, grad, a, b, dist, p, squared, la, lb)
    return ga, emu_distance_grad(emu, grad, b, a, dist, p, squared, lb, la, transposed=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    "p,squared", [(2.0, False), (2.0, True), (1.0, False), (0.0, False), (math.inf, False), (3.5, False), (0.5, False)]
)
def test_pairwise_distances_direct_and_grad(emu, p, squared, dtype):
    """B=2 batches of 70 x 130 points: 2 x 2 output tiles with tails, D=17: a staged chunk of 16 coordinates and
    a tail of 1. Duplicated points (zero distance: zero subgradient). The gradient of both inputs, as the binding
    launches it: grad_b is the same kernel with a and b swapped and (grad, dist) read transposed."""
    B, N, M, D = 2, 70, 130, 17
    a, b = make((B, N, D), dtype, seed=0), make((B, M, D), dtype, seed=1)
    b[:, 3] = a[:, 5]
    dist = emu_distances(emu, a, b, p, squared)
    expected = F.pairwise_distances(a, b, p, squared)
    assert_close(dist, expected, scale=4)
    assert_close(dist, dref.pairwise_distances(a.double(), b.double(), p, squared), dtype, scale=4)
    assert (dist[:, 5, 3] == 0).all()

    # 16-bit max-norm backwards run in float32 on float32 distances (fused/distance/ops.py): so here too.
    gdtype = torch.float32 if p == math.inf and dtype in (torch.float16, torch.bfloat16) else dtype
    a, b, dist = a.to(gdtype), b.to(gdtype), F.pairwise_distances(a.to(gdtype), b.to(gdtype), p, squared)
    grad = make((B, N, M), gdtype, seed=2)
    ga, gb = emu_distance_grads(emu, grad, a, b, dist, p, squared)
    cpu_ga, cpu_gb = F.pairwise_distances_backward(grad, a, b, dist, p, squared)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ref_ga, ref_gb = torch.autograd.grad(dref.pairwise_distances(a64, b64, p, squared), (a64, b64), grad.double())
    for ours, cpu, ref in [(ga, cpu_ga, ref_ga), (gb, cpu_gb, ref_gb)]:
        ours = ours.to(gdtype)
        assert_close(ours, cpu, scale=8 if p >= 1 else 32)  # p < 1: |diff|^(p-1) amplifies pow's last bits
        assert_accuracy(ours, cpu, ref)


def test_pairwise_distances_batches_past_65535(emu):
    """65537 batches: the direct kernel's and the gradient's grids are sliced (65535 + 2 batches)."""
    B = 65537
    a, b = make((B, 1, 2), seed=0), make((B, 1, 2), seed=1)
    dist = emu_distances(emu, a, b)
    assert_close(dist, torch.cdist(a.double(), b.double()), torch.float32)
    grad = make((B, 1, 1), seed=2)
    ga = emu_distance_grad(emu, grad, a, b, dist)
    assert_close(ga, F.pairwise_distances_backward(grad, a, b, dist, 2.0, False)[0])


def test_distance_zero_dimensions(emu):
    """D = 0: every distance is 0, for every metric."""
    for p in (0.0, 1.0, 2.0, math.inf, 3.5):
        dist = emu_distances(emu, torch.zeros(2, 3, 0), torch.zeros(2, 4, 0), p)
        assert torch.equal(dist, F.pairwise_distances(torch.zeros(2, 3, 0), torch.zeros(2, 4, 0), p, False))


def test_distance_empty_inputs_launch_nothing(emu):
    emu_distances(emu, torch.zeros(2, 0, 4), torch.zeros(2, 3, 4))
    emu_distance_grad(emu, torch.zeros(2, 3, 4), torch.zeros(2, 3, 0), torch.zeros(2, 4, 0), torch.zeros(2, 3, 4))


def test_pairwise_distances_padded_batches(emu):
    """lengths_a / lengths_b (a full cloud, a short one, an empty one): padded pairs are 0 and their rows, NaN here,
    are never read; the gradients of padded rows are 0. Against the CPU kernels with the same lengths."""
    B, N, M, D = 3, 70, 130, 5
    a, b = make((B, N, D), seed=3), make((B, M, D), seed=4)
    la, lb = torch.tensor([70, 13, 0]), torch.tensor([1, 130, 64])
    for t, lengths in ((a, la), (b, lb)):
        for i, n in enumerate(lengths.tolist()):
            t[i, n:] = NAN
    dist = emu_distances(emu, a, b, la=buf(la), lb=buf(lb))
    expected = F.pairwise_distances(a, b, 2.0, False, la, lb)
    assert_close(dist, expected, scale=4)
    assert not dist.isnan().any() and (dist[1, 13:] == 0).all() and (dist[0, :, 1:] == 0).all()
    grad = make((B, N, M), seed=5)
    ga, gb = emu_distance_grads(emu, grad, a, b, dist, la=buf(la), lb=buf(lb))
    cpu_ga, cpu_gb = F.pairwise_distances_backward(grad, a, b, expected, 2.0, False, la, lb)
    assert_close(ga, cpu_ga, scale=8)
    assert_close(gb, cpu_gb, scale=8)
    assert (ga[1, 13:] == 0).all() and (gb[0, 1:] == 0).all()


def select(emu, a, b, width, p=2.0, squared=False, largest=False, radius=None, la=None, lb=None):
    """select_direct as the binding launches it: (values, indices) [B, N, width]."""
    B, N, D = a.shape
    M = b.shape[1]
    values, indices = out((B, N, width), a.dtype), out((B, N, width), torch.int64)
    launch(
        emu.select_direct,
        code(a.dtype),
        metric(p),
        p,
        squared,
        largest,
        radius is not None,
        0.0 if radius is None else radius,
        buf(a),
        buf(b),
        la,
        lb,
        values,
        indices,
        B,
        N,
        M,
        D,
        max(1, min(width, M)),
        width,
    )
    return values, indices


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("k", [1, 5, 40])  # the kernel's three list sizes: 1 (registers), 16, 256
@pytest.mark.parametrize("p,largest", [(2.0, False), (1.0, True), (math.inf, False), (3.5, False)])
def test_select_direct_topk(emu, dtype, k, p, largest):
    """pairwise_topk: B=2 batches of 200 rows (two blocks, a tail) against 3000 points of b in D=3 (tiles of 2730
    float / 1365 double rows, with tails): the CPU kernel's answer, indices and values, bit for bit where both sum
    the same terms in the same order (p = 1, 2, inf); p = 3.5 within rounding of pow (scalar vs vector)."""
    a, b = make((2, 200, 3), dtype, seed=6), make((2, 3000, 3), dtype, seed=7)
    values, indices = select(emu, a, b, k, p, largest=largest)
    cpu_v, cpu_i = F.pairwise_topk(a, b, k, p, False, largest)
    if p == 3.5:
        assert_close(values, cpu_v, scale=4)  # the best values, and our indices point at them
        assert_close(values, dref.pairwise_distances(a, b, p).gather(-1, indices), scale=4)
    else:
        assert torch.equal(indices, cpu_i)
        assert_equal_bits(values, cpu_v)


def test_select_direct_ties_nan_lengths_and_radius(emu):
    """Points on a small integer grid (many exact ties: the lower index wins), a NaN row in b (last when nearest,
    first when farthest, as torch.topk ranks it), padded batches with NaN in their padded rows (never read), and
    the radius bound (0, 1.5, inf; width past M: missing slots -1 and inf): the CPU kernels' answers, exactly."""
    g = torch.Generator().manual_seed(8)
    a = torch.randint(-2, 3, (3, 150, 2), generator=g).float()
    b = torch.randint(-2, 3, (3, 40, 2), generator=g).float()
    b[:, 7] = NAN
    la, lb = torch.tensor([150, 9, 0]), torch.tensor([40, 3, 17])
    a_pad, b_pad = a.clone(), b.clone()
    a_pad[1, 9:] = NAN
    b_pad[1, 3:] = NAN
    for largest in (False, True):
        for k in (1, 6, 40):
            values, indices = select(emu, a_pad, b_pad, k, largest=largest, la=buf(la), lb=buf(lb))
            cpu_v, cpu_i = F.pairwise_topk(a, b, k, 2.0, False, largest, la, lb)
            assert torch.equal(indices, cpu_i), (largest, k)
            torch.testing.assert_close(values, cpu_v, rtol=0, atol=0, equal_nan=True)
    for radius, width in ((0.0, 3), (1.5, 8), (math.inf, 45)):
        values, indices = select(emu, a_pad, b_pad, width, radius=radius, la=buf(la), lb=buf(lb))
        cpu_v, cpu_i = F.radius_neighbors(a, b, radius, width, la, lb)
        assert torch.equal(indices, cpu_i), radius
        assert torch.equal(values, cpu_v)
        assert (indices == -1).any()


def select_grad(emu, grad, a, b, values, indices, p=2.0, squared=False):
    """select_grad as the binding launches it: keys and order from a stable sort of the pairs by point of b."""
    B, N, D = a.shape
    M, k = b.shape[1], indices.shape[-1]
    keys = torch.where(indices < 0, B * M, indices + torch.arange(B).view(B, 1, 1) * M).reshape(-1)
    keys, order = torch.sort(keys, stable=True)
    math_t = torch.float64 if a.dtype == torch.float64 else torch.float32
    ga, gb = out((B, N, D), math_t), buf(torch.zeros(B, M, D, dtype=math_t))
    launch(
        emu.select_grad,
        code(a.dtype),
        metric(p),
        p,
        squared,
        buf(a),
        buf(b),
        buf(grad),
        buf(values),
        buf(indices),
        buf(keys),
        buf(order),
        ga,
        gb,
        B,
        N,
        M,
        D,
        k,
    )
    return ga, gb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p,squared", [(2.0, False), (2.0, True), (1.0, False), (3.5, False)])
def test_select_grad(emu, reschedule, dtype, p, squared):
    """pairwise_topk_backward through the selected pairs, missing ones (index -1) included: the CPU kernel's
    gradients (the same sums in the same order: grad_b over the pairs in (batch, row, rank) order), and the same
    bits under other block orders and SM counts."""
    a, b = make((2, 150, 3), dtype, seed=9), make((2, 20, 3), dtype, seed=10)
    lb = torch.tensor([20, 3])
    values, indices = F.pairwise_topk(a, b, 5, p, squared, False, None, lb)
    assert (indices == -1).any()
    grad = make(values.shape, dtype, seed=11)
    runs = reschedule(lambda: select_grad(emu, grad, a, b, values, indices, p, squared))
    cpu_ga, cpu_gb = F.pairwise_topk_backward(grad, a, b, values, indices, p, squared)
    for ga, gb in runs:
        assert_close(ga, cpu_ga)
        assert_close(gb, cpu_gb)
        assert_equal_bits(ga, runs[0][0])
        assert_equal_bits(gb, runs[0][1])


# ---------------------------------------------------------------- optim
# The launchers are called as the CUDA binding (csrc/optim/optim_cuda.cpp) calls them, from the CPU ops' arguments,
# so that each test makes one call through both. Tensors: two chunks of 65536 and a tail, odd sizes, a scalar, an
# empty one; num_sms = 1 gives 4 blocks for 6 chunks (blocks stride over chunks).
SHAPES = [(70001,), (37, 5), (3,), (2, 3, 131), (), (0,)]
NUM_SMS = 1


@pytest.fixture
def ws(emu):
    """The optimizer workspace (per-block partials, the non-finite flag, two tickets), zeroed once as the binding
    does: every launch must leave the flag and the tickets at zero (checked after each)."""
    return buf(torch.zeros(emu.WORKSPACE_BYTES // 4, dtype=torch.int32))


def optim_launch(ws, fn, *args):
    launch(fn, *args)
    assert not ws[-4:].any(), f"{fn.__name__} left the workspace's non-finite flag or a ticket set"


def norm_kind(norm_type):
    return 0 if norm_type == 2 else 1 if norm_type == 1 else 2 if math.isinf(norm_type) else 3


def emu_grad_norm(emu, ws, grads, found_inf, grad_scale, norm_type, max_norm, clip_value, finish=True):
    """As grad_norm_cuda calls it: the norm in the gradients' promoted dtype (float64 accumulator when not
    finished), the clip coefficient in float64, float64 accumulation where a gradient is float64."""
    norm_dtype = (
        torch.float64
        if not finish
        else functools.reduce(torch.promote_types, [g.dtype for g in grads], grads[0].dtype if grads else torch.float32)
    )
    norm, found = out((), norm_dtype), out((), torch.float32)
    coef = out((), torch.float64) if finish else None
    optim_launch(
        ws,
        emu.grad_norm,
        [[buf(g) for g in grads]],
        [g.numel() for g in grads],
        [code(g.dtype) for g in grads],
        ws,
        found_inf,
        grad_scale,
        norm_kind(norm_type),
        norm_type,
        max_norm,
        clip_value,
        finish,
        norm,
        coef,
        found,
        NUM_SMS,
        any(g.dtype == torch.float64 for g in grads),
        code(norm_dtype),
    )
    return norm, coef, found


def is16(t):
    return t.dtype in (torch.float16, torch.bfloat16)


def update_code(emu, param, grad, state, model):
    """The kernels' dtype code of one tensor of an update, as optim_cuda.cpp's update_code makes it."""
    low = model if model is not None else param
    c = code(low.dtype)
    if state is not None and state.dtype == torch.int8:
        c |= emu.INT8_STATE
    if state is not None and state.dtype == torch.bfloat16 and param.dtype != torch.bfloat16:
        c |= emu.BF16_STATE
    if model is not None:
        c |= emu.MASTER
    elif state is not None and is16(param) and state.dtype == torch.float32:
        c |= emu.F32_STATE
    if is16(low) and grad.dtype == torch.float32:
        c |= emu.F32_GRAD
    return c


def seed_of(sr_seed):
    return (0, False) if sr_seed is None else (int(sr_seed) % (1 << 64), True)


def hyper_rows(hyper):
    return [] if hyper is None else hyper.double().flatten().tolist()


def emu_update(
    emu,
    ws,
    kernel,
    lists,
    states,
    steps,
    hparams,
    flags,
    clip_coef,
    grad_scale,
    found_inf,
    clip_value,
    model_params,
    sr_seed=None,
    hyper=None,
    write_grads=False,
    extra=(),
):
    """An update launch as optim_cuda.cpp makes it: lists [params, grads, state lists...] (and the model params of
    master weights), dtype codes from each param's first state (states None: no state), then the op's
    hyperparameters, clip_value, the op's flags, the arguments every update takes and the op's own last ones
    (extra)."""
    params, grads = lists[0], lists[1]
    codes = [
        update_code(emu, p, g, states[i] if states else None, model_params[i] if model_params else None)
        for i, (p, g) in enumerate(zip(params, grads))
    ]
    seed, stochastic = seed_of(sr_seed)
    lists = lists + ([model_params] if model_params else [])
    numels = [p.numel() for p in params]
    common = (stochastic, seed, clip_coef, grad_scale, found_inf, NUM_SMS, write_grads, *extra)
    optim_launch(ws, kernel, lists, numels, codes, steps, hyper_rows(hyper), ws, *hparams, clip_value, *flags, *common)


def emu_sgd_step_(
    emu, ws, params, grads, bufs, steps, lr, momentum, dampening, weight_decay, nesterov, maximize, *rest, **kw
):
    """F.sgd_step_'s arguments; rest and kw: emu_update's from clip_coef on."""
    use_momentum = momentum != 0
    lists = [params, grads] + ([bufs] if use_momentum else [])
    states, steps = (bufs, steps) if use_momentum else (None, [])
    hparams = (lr, momentum, dampening, weight_decay)
    emu_update(emu, ws, emu.sgd_step, lists, states, steps, hparams, (nesterov, maximize), *rest, **kw)


def emu_adam_step_(
    emu,
    ws,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    steps,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    amsgrad,
    decoupled,
    maximize,
    *rest,
    **kw,
):
    """F.adam_step_'s arguments; rest and kw: emu_update's from clip_coef on, the scales of 8-bit state (lists
    after the state lists, as the binding passes them where some state is 8-bit) and state_seed (the launch's last
    arguments)."""
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    keys = ("exp_avg_scales", "exp_avg_sq_scales") + (("max_exp_avg_sq_scales",) if amsgrad else ())
    scales = [kw.pop(k, None) for k in keys]
    if any(s is not None for s in scales):
        lists += scales
    hparams, flags = (lr, beta1, beta2, eps, weight_decay), (amsgrad, decoupled, maximize)
    state_seed, state_stochastic = seed_of(kw.pop("state_seed", None))
    extra = (state_stochastic, state_seed)
    emu_update(emu, ws, emu.adam_step, lists, exp_avgs, steps, hparams, flags, *rest, **kw, extra=extra)


def step_both(opt, emu, ws, cpu_lists, emu_lists, args, clip_coef, grad_scale, found, clip_value, models, **kw):
    """One step of F.<opt>_step_ on the CPU lists and of the emulated kernel on the buffers, with the same arguments:
    clip_coef (float64), grad_scale (None: unscaled) and found_inf as CPU tensors there and as buffers here;
    models: the (CPU, emulated) model params of master weights."""

    def scalars(make):
        return make(clip_coef, F64), None if grad_scale is None else make(grad_scale), make(found)

    def cpu_scalar(v, dtype=torch.float32):
        return torch.tensor(float(v), dtype=dtype)

    getattr(F, f"{opt}_step_")(*cpu_lists, *args, *scalars(cpu_scalar), clip_value, models[0], **kw)
    emu_step = emu_sgd_step_ if opt == "sgd" else emu_adam_step_
    emu_step(emu, ws, *emu_lists, *args, *scalars(scalar), clip_value, models[1], **kw)


def tensors_of(dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype) for s in SHAPES]


def scalar(v, dtype=torch.float32):
    return buf(torch.tensor(float(v), dtype=dtype))


@pytest.mark.parametrize("dtype", ALL_DTYPES + ["mixed"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_grad_norm(emu, ws, reschedule, norm_type, dtype):
    """The norm (the last block adds the per-block partials in slot order; in the gradients' promoted dtype), the
    float64 clip coefficient and the finite check, against the CPU kernel and float64, unscaled and value-clipped;
    the same bits in any block order. float64 gradients are summed in float64: float64's tolerance."""
    grads = (
        tensors_of(dtype, 0, 100.0)
        if dtype != "mixed"
        else [t.to(d) for t, d in zip(tensors_of(torch.float64, 0, 100.0), ALL_DTYPES * 2)]
    )
    tol = torch.float64 if dtype == torch.float64 else torch.float32
    scale, found_in = torch.tensor(64.0), torch.tensor(0.0)
    for clip_value in (math.inf, 50.0):
        cpu = F.grad_norm(grads, found_in, scale, norm_type, 1.0, clip_value, True)
        norm, coef, found = emu_grad_norm(emu, ws, grads, scalar(0), scalar(64), norm_type, 1.0, clip_value)
        assert norm.dtype == cpu[0].dtype == (torch.float64 if dtype == "mixed" else dtype)
        assert coef.dtype == cpu[1].dtype == torch.float64
        norm_tol = norm.dtype if is16(norm) else tol
        assert_close(norm, cpu[0], norm_tol, scale=4)
        assert_close(coef, cpu[1], tol, scale=4)
        assert found.item() == 0 == cpu[2].item()
        g64 = torch.cat([g.double().flatten() / 64 for g in grads]).clamp(-clip_value, clip_value)
        norm64 = torch.linalg.vector_norm(g64, norm_type)
        assert_close(norm, norm64, norm_tol, scale=4)
        assert_close(coef, (1.0 / (norm64 + 1e-6)).clamp(max=1.0), tol, scale=4)
        for other in reschedule(
            lambda: emu_grad_norm(emu, ws, grads, scalar(0), scalar(64), norm_type, 1.0, clip_value)[:2]
        ):
            assert_equal_bits(other[0], norm)
            assert_equal_bits(other[1], coef)
    acc, coef, found = emu_grad_norm(emu, ws, grads, None, None, norm_type, 1.0, math.inf, finish=False)
    assert coef is None and acc.dtype == torch.float64
    assert_close(acc, F.grad_norm(grads, None, None, norm_type, 1.0, math.inf, False)[0], tol, scale=4)


@pytest.mark.parametrize("bad", [math.inf, math.nan, "found_in"])
def test_grad_norm_nonfinite(emu, ws, bad):
    """inf or NaN in a gradient (or found_inf set) gives found_inf = 1 and torch's norm and coefficient."""
    grads = tensors_of(torch.float32, 1)
    if bad != "found_in":
        grads[0][65536 + 7] = bad
    found_in = 1.0 if bad == "found_in" else 0.0
    for max_norm in (1.0, math.inf):
        cpu = F.grad_norm(grads, torch.tensor(found_in), None, 2.0, max_norm, math.inf, True)
        norm, coef, found = emu_grad_norm(emu, ws, grads, scalar(found_in), None, 2.0, max_norm, math.inf)
        assert_close(norm, cpu[0], scale=4)
        assert_close(coef, cpu[1], torch.float32, scale=4)  # from float32 sums
        assert found.item() == cpu[2].item() == 1.0


def test_grad_norm_of_no_gradients(emu, ws):
    norm, coef, found = emu_grad_norm(emu, ws, [], scalar(1.0), None, 2.0, 1.0, math.inf)
    assert (norm.item(), coef.item(), found.item()) == (0.0, 1.0, 1.0)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_scale_grads_and_accumulate_grads(emu, dtype):
    """grads *= coef; fp32 (fp64) sums += grads or = grads: the CPU kernels' bits."""
    grads = tensors_of(dtype, 2)
    gs = [buf(g) for g in grads]
    launch(emu.scale_grads, [gs], [g.numel() for g in grads], [code(dtype)] * len(grads), scalar(0.37, F64), NUM_SMS)
    expected = [g.clone() for g in grads]
    F.scale_grads_(expected, torch.tensor(0.37, dtype=F64))
    for g, e in zip(gs, expected):
        assert_equal_bits(g, e)
    acc_t = torch.float64 if dtype == torch.float64 else torch.float32
    for overwrite in (True, False):
        accs0 = tensors_of(acc_t, 3)
        accs = [buf(a) for a in accs0]
        launch(
            emu.accumulate_grads,
            [accs, [buf(g) for g in grads]],
            [g.numel() for g in grads],
            [code(dtype)] * len(grads),
            overwrite,
            NUM_SMS,
        )
        F.accumulate_grads_(accs0, grads, overwrite)
        for a, e in zip(accs, accs0):
            assert_equal_bits(a, e)


def state_like(ps, dtype=None, seed=10):
    """Non-zero state (a run in progress), in the params' dtype or `dtype`."""
    return [t.abs() for t in tensors_of(dtype or ps[0].dtype, seed, 0.1)]


def assert_update(emu_ts, cpu_ts):
    """Updated tensors against the CPU kernel's: every element within the tolerance of its dtype (compared in
    float32 or float64, where 16-bit values are exact and the comparison is fast)."""
    for e, c in zip(emu_ts, cpu_ts):
        wide = torch.float64 if e.dtype == torch.float64 else torch.float32
        assert_close(e.to(wide), c.to(wide), e.dtype, scale=4)


UPDATE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def assert_grads_written(emu_g, cpu_g, grads, step):
    """The gradients after a step: on step 0 (write_grads) the CPU kernel's write-back (clamp(g / 64, +-30) * 0.5:
    exact, so the same bits) and not the input; on step 1 (no write_grads) and step 2 (write_grads, skipped by
    found_inf) the input as it was."""
    for e, c, g in zip(emu_g, cpu_g, grads):
        assert_equal_bits(e, c)
        if step == 0:
            assert_equal_bits(e, (g.double() / 64).clamp(-30, 30).mul(0.5).to(g.dtype))
        else:
            assert_equal_bits(e, g)


SGD_CASES = [
    dict(momentum=0.9, dampening=0.2, weight_decay=0.01, nesterov=False, maximize=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=True),
    dict(momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False, maximize=False),
]


@pytest.mark.parametrize("dtype", UPDATE_DTYPES)
@pytest.mark.parametrize("case", range(len(SGD_CASES)))
def test_sgd_step(emu, ws, case, dtype):
    """Three steps (the first sets the momentum buffers), unscaled, value- and norm-clipped; the third is skipped
    (found_inf): params, buffers and step counters as they were. The last block advances every step counter.
    write_grads on the first two steps: the gradients written back are the CPU kernel's bits."""
    h = SGD_CASES[case]
    params0 = tensors_of(dtype, 4)
    cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
    cpu_b, emu_b = [torch.zeros_like(p) for p in params0], [out(p.shape, dtype) for p in params0]
    cpu_s, emu_s = [torch.zeros(()) for _ in params0], [buf(torch.zeros(())) for _ in params0]
    bufs = lambda b: b if h["momentum"] else []  # noqa: E731
    for step in range(3):
        grads = tensors_of(dtype, 20 + step, 100.0)
        found = float(step == 2)
        args = (0.1, h["momentum"], h["dampening"], h["weight_decay"], h["nesterov"], h["maximize"])
        cpu_g, emu_g = [g.clone() for g in grads], [buf(g) for g in grads]
        cpu_lists = (cpu_p, cpu_g, bufs(cpu_b), bufs(cpu_s))
        emu_lists = (emu_p, emu_g, bufs(emu_b), bufs(emu_s))
        step_both("sgd", emu, ws, cpu_lists, emu_lists, args, 0.5, 64.0, found, 30.0, ([], []), write_grads=step != 1)
        assert_update(emu_p, cpu_p)
        assert_grads_written(emu_g, cpu_g, grads, step)
        if h["momentum"]:
            assert_update(emu_b, cpu_b)
            assert [s.item() for s in emu_s] == [s.item() for s in cpu_s] == [min(step + 1, 2)] * len(SHAPES)


ADAM_CASES = [
    dict(amsgrad=False, decoupled=True, maximize=False, weight_decay=0.1),
    dict(amsgrad=True, decoupled=False, maximize=True, weight_decay=0.01),
    dict(amsgrad=False, decoupled=False, maximize=False, weight_decay=0.0),
]


@pytest.mark.parametrize("dtype", UPDATE_DTYPES)
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_step(emu, ws, case, dtype):
    """Three steps of Adam / AdamW / AMSGrad, the third skipped; bias corrections from the step counters.
    write_grads on all but the second step (as test_sgd_step)."""
    h = ADAM_CASES[case]
    params0 = tensors_of(dtype, 5)
    cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
    states = [state_like(params0, seed=s) for s in (11, 12, 13)]
    cpu_st = [[t.clone() for t in st] for st in states]
    emu_st = [[buf(t) for t in st] for st in states]
    cpu_s, emu_s = [torch.full((), 5.0) for _ in params0], [buf(torch.full((), 5.0)) for _ in params0]
    for step in range(3):
        grads = tensors_of(dtype, 30 + step, 100.0)
        found = float(step == 2)
        args = (1e-2, 0.9, 0.99, 1e-8, h["weight_decay"], h["amsgrad"], h["decoupled"], h["maximize"])
        cpu_g, emu_g = [g.clone() for g in grads], [buf(g) for g in grads]
        cpu_lists, emu_lists = (cpu_p, cpu_g, *cpu_st, cpu_s), (emu_p, emu_g, *emu_st, emu_s)
        step_both("adam", emu, ws, cpu_lists, emu_lists, args, 0.5, 64.0, found, 30.0, ([], []), write_grads=step != 1)
        assert_update(emu_p, cpu_p)
        assert_grads_written(emu_g, cpu_g, grads, step)
        for e, c in zip(emu_st, cpu_st):
            assert_update(e, c)
        assert [s.item() for s in emu_s] == [s.item() for s in cpu_s] == [6.0 + min(step, 1)] * len(SHAPES)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_master_weights_and_fp32_state(emu, ws, opt, low):
    """Master weights: fp32 params and state, 16-bit grads; the kernel writes the rounded 16-bit model params
    without reading them. Then 16-bit params with fp32 state and fp32 (accumulated) gradients, no master."""
    masters0 = tensors_of(torch.float32, 6)
    model0 = [m.to(low) for m in masters0]
    grads = tensors_of(low, 40, 100.0)
    hyper = torch.tensor([[1e-2, 0.9, 0.0, 0.01]] * len(SHAPES), dtype=torch.float64)
    for mode in ("master", "fp32 state"):
        params0 = masters0 if mode == "master" else model0
        cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
        cpu_m, emu_m = (
            ([m.clone() for m in model0], [out(m.shape, low) for m in model0]) if mode == "master" else ([], [])
        )
        g = grads if mode == "master" else [x.float() for x in grads]
        st = state_like(params0, torch.float32, seed=14)
        cpu_st, emu_st = [t.clone() for t in st], [buf(t) for t in st]
        cpu_s, emu_s = [torch.ones(()) for _ in SHAPES], [buf(torch.ones(())) for _ in SHAPES]
        emu_g = [buf(x) for x in g]
        if opt == "sgd":
            args = (0.0, 0.9, 0.0, 0.0, False, False)  # lr, momentum, dampening, weight decay: the rows'
            cpu_lists, emu_lists = (cpu_p, g, cpu_st, cpu_s), (emu_p, emu_g, emu_st, emu_s)
            step_both("sgd", emu, ws, cpu_lists, emu_lists, args, 1.0, None, 0.0, math.inf, (cpu_m, emu_m), hyper=hyper)
        else:
            st2 = state_like(params0, torch.float32, seed=15)
            cpu_st2, emu_st2 = [t.clone() for t in st2], [buf(t) for t in st2]
            args = (1e-2, 0.9, 0.99, 1e-8, 0.1, False, True, False)
            cpu_lists, emu_lists = (cpu_p, g, cpu_st, cpu_st2, [], cpu_s), (emu_p, emu_g, emu_st, emu_st2, [], emu_s)
            step_both("adam", emu, ws, cpu_lists, emu_lists, args, 1.0, None, 0.0, math.inf, (cpu_m, emu_m))
            assert_update(emu_st2, cpu_st2)
        assert_update(emu_p, cpu_p)
        assert_update(emu_st, cpu_st)
        for e, c, p in zip(emu_m, cpu_m, emu_p):
            assert_equal_bits(e, p.to(low))  # the model param is its master, rounded
            assert_update([e], [c])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_stochastic_rounding(emu, ws, opt):
    """bf16 params rounded stochastically: the Philox words of the CPU kernel (element i of tensor t: word i % 4 of
    counter i / 4 under seed + t * golden) and its fp32 update, so its bits."""
    params0 = tensors_of(torch.bfloat16, 7)
    grads = tensors_of(torch.bfloat16, 50)
    seed = torch.tensor(-123456789)
    cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
    emu_g = [buf(g) for g in grads]
    if opt == "sgd":  # lr a power of two: p - lr * g is exact in fp32, so only the rounding is compared
        args = (2.0**-6, 0.0, 0.0, 0.0, False, False)
        cpu_lists, emu_lists = (cpu_p, grads, [], []), (emu_p, emu_g, [], [])
    else:
        st = [state_like(params0, torch.float32, seed=s) for s in (16, 17)]
        steps = [torch.ones(()) for _ in SHAPES]
        args = (1e-2, 0.9, 0.99, 1e-8, 0.0, False, True, False)
        cpu_lists = (cpu_p, grads, *[[t.clone() for t in s] for s in st], [], [t.clone() for t in steps])
        emu_lists = (emu_p, emu_g, *[[buf(t) for t in s] for s in st], [], [buf(t) for t in steps])
    step_both(opt, emu, ws, cpu_lists, emu_lists, args, 1.0, None, 0.0, math.inf, ([], []), sr_seed=seed)
    for e, c in zip(emu_p, cpu_p):
        assert_equal_bits(e, c)


INT8_SHAPES = [(70001,), (37, 5), (5000,), (2, 3, 131), (4096,)]  # chunks, tails, partial blocks; fp32 (37, 5)


def assert_same(a, b):
    """The same bits, NaN anywhere (its payload is the CPU's vector max's or the GPU's own) counting as one."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    assert_equal_bits(a, b)


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "float16 fp32 grads", "master", "stochastic"])
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_step_int8_state(emu, ws, case, mode):
    """8-bit state (int8 exp_avg, uint8 exp_avg_sq and max_exp_avg_sq, float32 scales per 256), mixed in one launch
    with float32 state of small tensors: decoded, updated and re-encoded by two warps per block of 256, with the
    CPU kernel's formulas, so its bits for codes, scales, params, gradients written back and the fp32 state, over
    three steps (scaled, value- and norm-clipped) with an inf gradient in step 1 (a non-finite block: codes 0,
    scale inf or NaN) and a skipped step 2 (found_inf: everything as it was); exp_avg_sq's codes rounded
    stochastically (the same dither words) but in float32 mode."""
    h = ADAM_CASES[case]
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if h["amsgrad"] else ())
    low = {"bfloat16": torch.bfloat16, "stochastic": torch.bfloat16, "float16 fp32 grads": torch.float16}
    pdtype = low.get(mode, torch.float32)
    gen = torch.Generator().manual_seed(8)
    params0 = [torch.randn(s, generator=gen).to(pdtype) for s in INT8_SHAPES]
    masters = [p.float() for p in params0] if mode == "master" else None
    model0 = params0 if mode == "master" else None
    params0 = masters or params0
    state = int8_moments(params0, keys, 9 + case)
    cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
    cpu_m, emu_m = ([m.clone() for m in model0], [out(m.shape, m.dtype) for m in model0]) if model0 else ([], [])
    cpu_st = {k: ([t.clone() for t in st], [s.clone() for s in sc]) for k, (st, sc) in state.items()}
    emu_st = {k: ([buf(t) for t in st], [buf(s) for s in sc]) for k, (st, sc) in state.items()}
    cpu_s, emu_s = [torch.full((), 2.0) for _ in params0], [buf(torch.full((), 2.0)) for _ in params0]
    seed = torch.tensor(987654321) if mode == "stochastic" else None
    for step in range(3):
        gdtype = torch.float32 if mode == "float16 fp32 grads" else (model0 or params0)[0].dtype
        grads = [(torch.randn(p.shape, generator=gen) * 100).to(gdtype) for p in params0]
        if step == 1:
            grads[0][70000 - 3] = math.inf  # the last partial block of tensor 0
        # exp_avg_sq's codes rounded stochastically (a seed above 2^63), but in float32 mode: to nearest
        state_seed = None if mode == "float32" else torch.tensor(-(2**62) + 777 * step)
        found = float(step == 2)
        args = (1e-2, 0.9, 0.99, 1e-8, h["weight_decay"], h["amsgrad"], h["decoupled"], h["maximize"])
        clip_value = math.inf if step == 1 else 30.0  # step 1: the inf reaches the moments
        cpu_g, emu_g = [g.clone() for g in grads], [buf(g) for g in grads]

        def lists(st, p, g, steps):
            sts = [st[k][0] for k in keys] + ([] if h["amsgrad"] else [[]])
            return (p, g, *sts, steps)

        def scales(st):
            return {k + "_scales": st[k][1] for k in keys}

        cpu_lists, emu_lists = lists(cpu_st, cpu_p, cpu_g, cpu_s), lists(emu_st, emu_p, emu_g, emu_s)
        F.adam_step_(
            *cpu_lists,
            *args,
            torch.tensor(0.5, dtype=F64),
            torch.tensor(64.0),
            torch.tensor(found),
            clip_value,
            cpu_m,
            sr_seed=seed,
            write_grads=True,
            state_seed=state_seed,
            **scales(cpu_st),
        )
        emu_adam_step_(
            emu,
            ws,
            *emu_lists,
            *args,
            scalar(0.5, F64),
            scalar(64.0),
            scalar(found),
            clip_value,
            emu_m,
            sr_seed=seed,
            write_grads=True,
            state_seed=state_seed,
            **scales(emu_st),
        )
        for a, b in zip(emu_p + emu_g + emu_m, cpu_p + cpu_g + cpu_m):
            assert_same(a, b)
        for k in keys:
            for a, b in zip(emu_st[k][0] + emu_st[k][1], cpu_st[k][0] + cpu_st[k][1]):
                assert_same(a, b)
        assert state["exp_avg"][0][0].dtype == torch.int8
        assert [s.item() for s in emu_s] == [s.item() for s in cpu_s] == [3.0 + min(step, 1)] * len(INT8_SHAPES)
    blocks = cpu_st["exp_avg"][1][0]
    assert not blocks[-1].isfinite() and blocks[:-1].isfinite().all()  # the inf gradient's block only
    assert (cpu_st["exp_avg"][0][0][-113:] == 0).all()


@pytest.mark.parametrize("mode", ["float32", "bfloat16 stochastic", "float16 fp32 grads", "master"])
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_step_bf16_state(emu, ws, case, mode):
    """bf16 moments rounded stochastically (state_dtype=torch.bfloat16) beside params of each dtype: the CPU kernel's
    half words (element i: half i % 2 of dither_word(key, i / 2), under the key of its tensor and moment), so its
    bits for the moments, params and gradients written back, over three steps (scaled, value-
    and norm-clipped) with an inf gradient in step 1 and a skipped step 2 (found_inf: everything as it was)."""
    h = ADAM_CASES[case]
    keys = 3 if h["amsgrad"] else 2
    low = {"bfloat16 stochastic": torch.bfloat16, "float16 fp32 grads": torch.float16}
    gen = torch.Generator().manual_seed(18)
    params0 = [torch.randn(s, generator=gen).to(low.get(mode, torch.float32)) for s in INT8_SHAPES]
    model0 = params0 if mode == "master" else None
    params0 = [p.float() for p in params0] if model0 else params0
    moments = [[torch.randn(p.shape, generator=gen) * 1e-2 for p in params0] for _ in range(keys)]
    moments = [[(m if k == 0 else m.abs()).to(torch.bfloat16) for m in ms] for k, ms in enumerate(moments)]
    cpu_p, emu_p = [p.clone() for p in params0], [buf(p) for p in params0]
    cpu_m, emu_m = ([m.clone() for m in model0], [out(m.shape, m.dtype) for m in model0]) if model0 else ([], [])
    cpu_st, emu_st = [[t.clone() for t in ms] for ms in moments], [[buf(t) for t in ms] for ms in moments]
    cpu_st += [[]] * (3 - keys)
    emu_st += [[]] * (3 - keys)
    cpu_s, emu_s = [torch.full((), 2.0) for _ in params0], [buf(torch.full((), 2.0)) for _ in params0]
    seed = torch.tensor(-55555) if mode == "bfloat16 stochastic" else None
    for step in range(3):
        gdtype = torch.float32 if mode == "float16 fp32 grads" else (model0 or params0)[0].dtype
        grads = [(torch.randn(p.shape, generator=gen) * 100).to(gdtype) for p in params0]
        if step == 1:
            grads[0][70000 - 3] = math.inf
        found = float(step == 2)
        args = (1e-2, 0.9, 0.99, 1e-8, h["weight_decay"], h["amsgrad"], h["decoupled"], h["maximize"])
        clip_value = math.inf if step == 1 else 30.0  # step 1: the inf reaches the moments
        cpu_g, emu_g = [g.clone() for g in grads], [buf(g) for g in grads]
        cpu_lists, emu_lists = (cpu_p, cpu_g, *cpu_st, cpu_s), (emu_p, emu_g, *emu_st, emu_s)
        kw = dict(sr_seed=seed, state_seed=torch.tensor(424242 + step), write_grads=True)
        step_both("adam", emu, ws, cpu_lists, emu_lists, args, 0.5, 64.0, found, clip_value, (cpu_m, emu_m), **kw)
        for a, b in zip(emu_p + emu_g + emu_m + sum(emu_st, []), cpu_p + cpu_g + cpu_m + sum(cpu_st, [])):
            assert_same(a, b)
        assert cpu_st[0][0].dtype == torch.bfloat16
        assert [s.item() for s in emu_s] == [s.item() for s in cpu_s] == [3.0 + min(step, 1)] * len(INT8_SHAPES)
    finite = cpu_st[0][0].isfinite()
    assert not finite[70000 - 3] and finite.sum() == finite.numel() - 1  # the inf gradient's element only


# ---------------------------------------------------------------- norm
# (x dtype, residual stream dtype)
NORM_DTYPES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
]


def emu_norm_fwd(emu, x, residual, weight, bias, eps, rms, misalign=False):
    """The launcher on guarded copies: (out, sum or None, mean or None, rstd)."""
    rows, C = x.shape
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    stream = residual.dtype if residual is not None else x.dtype
    outs = (
        out((rows, C), x.dtype),
        out((rows, C), stream) if residual is not None else None,
        None if rms else out((rows,), math_dtype),
        out((rows,), math_dtype),
    )
    launch(
        emu.norm_fwd,
        code(x.dtype),
        code(stream),
        buf(x, misalign),
        buf(residual) if residual is not None else None,
        buf(weight) if weight is not None else None,
        buf(bias) if bias is not None else None,
        *outs,
        rows,
        C,
        eps,
        rms,
    )
    return outs


def emu_norm_backward(emu, grad, grad_sum, h, mean, rstd, weight, rms, weight_grad, bias_grad):
    rows, C = h.shape
    math_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    ws = emu.norm_backward_workspace(rows, C)
    grads = (
        out((rows, C), h.dtype),
        out((C,), math_dtype) if weight_grad else None,
        out((C,), math_dtype) if bias_grad else None,
    )
    launch(
        emu.norm_backward,
        code(grad.dtype),
        code(h.dtype),
        buf(grad),
        buf(grad_sum) if grad_sum is not None else None,
        buf(h),
        mean,
        rstd,
        buf(weight) if weight is not None else None,
        *grads,
        out((ws,), math_dtype) if weight_grad else None,
        out((ws,), math_dtype) if bias_grad else None,
        rows,
        C,
        rms,
    )
    return grads


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("dtype,stream", NORM_DTYPES)
@pytest.mark.parametrize(
    "rows,C,misalign", [(5, 37, False), (3, 300, True), (4, 1, False), (2, 8192, False), (2, 8193, True)]
)
def test_norm_forward_and_backward(emu, rms, dtype, stream, rows, C, misalign):
    """A block per row (C = 300: threads stride over the row; up to C = 8192 a thread holds its elements in
    registers between the passes, C = 8193 re-reads them from memory), the sum rounded to the stream's dtype as the CPU
    kernel rounds it (bit for bit), statistics and gradients against the CPU op; with and without residual,
    weight, bias and grad_sum."""
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x, r = make((rows, C), dtype, seed=0), make((rows, C), stream, seed=1)
    w, b = make((C,), math_dtype, low=0.5, high=1.5, seed=2), None if rms else make((C,), math_dtype, seed=3)
    y, h, mean, rstd = emu_norm_fwd(emu, x, r, w, b, 1e-5, rms, misalign)
    cpu = F.norm_fwd(x, r, [C], w, b, 1e-5, rms)
    assert_close(y, cpu[0])
    assert_equal_bits(h, cpu[1])
    for e, c in zip((mean, rstd), cpu[2:]):
        if e is not None:
            assert_close(e, c, scale=4)
    g, gs = make((rows, C), dtype, seed=4), make((rows, C), stream, seed=5)
    grads = emu_norm_backward(emu, g, gs, h, mean, rstd, w, rms, True, not rms)
    cpu_grads = F.norm_backward(g, gs, cpu[1], *cpu[2:], w, [C], rms, True, not rms)
    for e, c in zip(grads, cpu_grads):
        if e is not None:
            assert_close(e, c, c.dtype, scale=8)
    if C == 1 and not rms:  # h - mean = 0: the gradient is grad_sum alone, with no fma's leftover of grad * weight
        assert_equal_bits(grads[0], gs)
        assert_equal_bits(cpu_grads[0], gs)
    # no residual, no weight, no grad_sum
    y, _, mean, rstd = emu_norm_fwd(emu, x, None, None, None, 1e-5, rms)
    cpu = F.norm_fwd(x, None, [C], None, None, 1e-5, rms)
    assert_close(y, cpu[0])
    grad_h, _, _ = emu_norm_backward(emu, g, None, x, mean, rstd, None, rms, False, False)
    assert_close(grad_h, F.norm_backward(g, None, x, *cpu[2:], None, [C], rms, False, False)[0], dtype, scale=8)


def test_norm_weight_gradients_same_bits_in_any_schedule(emu, reschedule):
    """700 rows: 350 chunks of 2 rows, partials summed in chunk order: the same bits under other block and thread
    orders and SM counts; against float64."""
    x, g = make((700, 40), seed=0), make((700, 40), seed=1)
    w, b = make((40,), low=0.5, high=1.5, seed=2), make((40,), seed=3)
    _, _, mean, rstd = emu_norm_fwd(emu, x, None, w, b, 1e-5, False)

    def grads():
        return emu_norm_backward(emu, g, None, x, mean, rstd, w, False, True, True)

    first = grads()
    for other in reschedule(grads):
        for a, c in zip(first, other):
            assert_equal_bits(a, c)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    expected = torch.autograd.grad(
        torch.nn.functional.layer_norm(x64, (40,), w64, b64, 1e-5), (x64, w64, b64), g.double()
    )
    for a, e in zip(first, expected):
        assert_close(a, e, torch.float32, scale=8)


def test_every_launch_is_emulated():
    """No .cu keeps a bare <<<...>>> launch (the emulation would not compile it), and every .cu is in the build."""
    sources = glob.glob(os.path.join(ce.ROOT, "csrc", "**", "*.cu"), recursive=True)
    assert sources
    for path in sources:
        assert "<<<" not in open(path).read(), f"{path} launches without FUSED_LAUNCH"
    assert len(ce.kernel_wrappers()) == len(sources)


def emu_rope(emu, q, k, cos, sin, unsqueeze_dim, interleaved, backward):
    """As rope_cuda calls it: [b, h, s, d] views of q, k and outputs laid out like them, by strides."""
    swap = (lambda t: t.transpose(1, 2)) if unsqueeze_dim == 2 else (lambda t: t)
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    heads = [
        (x.data_ptr(), o.data_ptr(), list(swap(x).stride()[:3]), list(swap(o).stride()[:3]), swap(x).shape[1])
        for x, o in ((q, out_q), (k, out_k))
    ]
    b, _, s, d = swap(q).shape
    r = cos.shape[-1]
    emu.rope(
        code(q.dtype), *heads, cos.data_ptr(), sin.data_ptr(), b, s, d, r, 0 if cos.shape[0] == 1 else s * r,
        interleaved, backward,
    )  # fmt: skip
    return out_q, out_k


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rope_forward_and_backward(emu, dtype, unsqueeze_dim, interleaved):
    """A block per position over q's heads then k's (GQA), partial rotary (features past r copied), strided q (a
    transposed projection), a per-batch table; forward and backward against the CPU op and float64."""
    from fused.rope import reference as rref

    q = make((2, 3, 5, 20), dtype, seed=0)
    q = q.transpose(1, 2) if unsqueeze_dim == 1 else q  # [b, h, s, d] read through [b, s, h, d] memory
    k = make((2, 2, 3, 20) if unsqueeze_dim == 1 else (2, 3, 2, 20), dtype, seed=1)
    cos, sin = make((2, 3, 12), dtype, seed=2), make((2, 3, 12), dtype, seed=3)
    for backward in (False, True):
        got = emu_rope(emu, q, k, cos, sin, unsqueeze_dim, interleaved, backward)
        args = (q, k, cos, sin, unsqueeze_dim)
        if backward:
            cpu = F.rope_backward(*args, interleaved)
            exact = rref.rope_backward(*(t.double() for t in args[:4]), unsqueeze_dim, interleaved)
        else:
            cpu = F.rope(*args, interleaved=interleaved)
            exact = rref.rope(*(t.double() for t in args[:4]), unsqueeze_dim, interleaved)
        for g, c, e, x in zip(got, cpu, exact, (q, k)):
            assert g.stride() == x.stride() or not x.is_contiguous()
            assert_close(g, c)
            assert_accuracy(g, c, e)
            assert torch.equal(g[..., 12:], x[..., 12:])
