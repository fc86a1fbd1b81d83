"""The CUDA C++ kernels, run on the CPU by the host emulation of CUDA's execution model (csrc/common/cuda_host.h,
built by tests/cuda_emulation.py): every launcher of every *_kernels.cu on CPU tensors, held against the CPU
kernels (torch.ops.fused.*) and the float64 references with the harness's tolerances, bit for bit where the CPU
and CUDA formulas are meant to match (dropout). Every buffer sits between NaN guards: a kernel that reads past a
buffer gets NaN, one that writes past it fails the launch check. Reductions give the same bits under other block
and thread orders and SM counts. Odd sizes, tails, unaligned pointers (the scalar paths), several blocks, grid-
stride loops (one SM: 8 blocks a wave), grids sliced past 65535 blocks, empty inputs. The emulation's own
semantics and planted bugs (a missing barrier, an off-by-one tail, a wrong shuffle offset) are checked first.
Select with `pytest -k emulation`. What it cannot show: see the README's "GPU status"."""
import math

import numpy as np
import pytest
import torch

import cuda_emulation as ce
from fused._codes import ACT_CODES, UNARY_CODES, parse_op
from fused.distance import reference as dref
from fused.elementwise import encode_ops, reference as eref
from harness import ALL_DTYPES, assert_accuracy, assert_close, make

pytestmark = pytest.mark.skipif(ce.unavailable() is not None, reason=str(ce.unavailable()))

F = torch.ops.fused
ACTS = list(ACT_CODES)
NAN = float("nan")
GUARD = 32  # NaN elements before and after every buffer


@pytest.fixture(scope="module")
def emu():
    m = ce.module()
    m.set_sm_count(1)
    m.set_schedule_seed(1)
    yield m
    m.set_sm_count(2)


@pytest.fixture
def reschedule(emu):
    """Runs f() under other schedule seeds and SM counts; restores the defaults."""
    def run(f):
        results = []
        for seed, sms in [(0, 1), (12345, 3), (99, 132)]:
            emu.set_schedule_seed(seed)
            emu.set_sm_count(sms)
            results.append(f())
        emu.set_schedule_seed(1)
        emu.set_sm_count(1)
        return results
    return run


def poison(dtype):
    """What surrounds every buffer (and fills outputs): NaN, or a marker for integers."""
    return NAN if dtype.is_floating_point else -0x5A5A5A5A


def buf(values, misalign=False):
    """A copy of values in the middle of a poison-filled allocation; misalign: one element off 16 bytes."""
    start = GUARD + int(misalign)
    flat = torch.full((start + values.numel() + GUARD,), poison(values.dtype), dtype=values.dtype)
    flat.data_region = (start, start + values.numel())
    view = flat[start:start + values.numel()].view(values.shape)
    view.copy_(values)
    return view


def out(shape, dtype, misalign=False):
    """An output buffer: poison inside too, so an element the kernel does not write shows."""
    return buf(torch.full(shape, poison(dtype), dtype=dtype), misalign)


def launch(fn, *args):
    """fn(*args) with tensors passed as data pointers and None as a null pointer; then every guard must be intact."""
    fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else 0 if a is None else a for a in args])
    for a in args:
        if isinstance(a, torch.Tensor) and hasattr(a._base, "data_region"):
            start, end = a._base.data_region
            guards = torch.cat([a._base[:start], a._base[end:]])
            assert torch.equal(bits(guards), bits(torch.full_like(guards, poison(a.dtype)))), \
                f"{fn.__name__} wrote outside a buffer"


def code(dtype):
    return ce.code(dtype)


def bits(t):
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_equal_bits(a, b):
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), f"max |diff| {(a.double() - b.double()).abs().max()}"


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
            src = [seg + arg % width, lane - arg if pos >= arg else lane, lane + arg if pos + arg < width else lane,
                   lane ^ arg if (lane ^ arg) < seg + width else lane, 0, 0, 0, lane ^ 1][kind]
            res.append(x[w0 + src] if part[src] else -1)
        else:
            ballot = sum(1 << m for m in range(32) if part[m] and x[w0 + m])
            everyone = sum(1 << m for m in range(32) if part[m])
            res.append([ballot - (1 << 32) if ballot >= 1 << 31 else ballot, int(ballot != 0),
                        int(ballot == everyone)][kind - 4])
    return res


# kind: 0-3 __shfl_sync / _up / _down / _xor, 4-6 __ballot_sync / __any_sync / __all_sync, 7 each lane reads its
# neighbour's shared-memory write after __syncwarp. 48 threads: the second warp has 16 lanes.
@pytest.mark.parametrize("kind,arg,width", [(0, 5, 32), (0, 37, 8), (1, 3, 32), (1, 2, 8), (2, 1, 32), (2, 3, 16),
                                            (3, 16, 32), (3, 5, 8), (4, 0, 32), (5, 0, 32), (6, 0, 32), (7, 0, 32)])
@pytest.mark.parametrize("mask,exited,threads", [(0xFFFFFFFF, 0, 64), (0x0000FFFF, 0, 64), (0x5555AAAA, 0, 64),
                                                 (0xFFFFFFFF, 0x00300021, 64), (0xFFFFFFFF, 0, 48)])
def test_warp_collectives(emu, kind, arg, width, mask, exited, threads):
    x = torch.tensor([(t * 7) % 5 if kind >= 4 else 1000 + t for t in range(threads)], dtype=torch.int32)
    y = out((threads,), torch.int32)
    launch(emu.selftest.collective, x, y, threads, kind, mask, exited, arg, width)
    assert y.tolist() == collective_model(x.tolist(), kind, mask, exited, arg, width)


def test_atomics(emu):
    c = torch.zeros(4, dtype=torch.int32)
    launch(emu.selftest.atomics, c, 3, 64, 100)
    assert c.tolist() == [192, -1, 192 % 101, 191]  # atomicInc wraps to 0 after the limit


def test_planted_missing_barrier_is_caught(emu):
    x = make((2 * 256,), seed=0)
    y = out((2,), torch.float32)
    launch(emu.selftest.block_sum, x, y, 2, 256, True)
    assert_close(y, x.view(2, 256).sum(1), scale=10)
    launch(emu.selftest.block_sum, x, y, 2, 256, False)
    assert not torch.allclose(y, x.view(2, 256).sum(1), equal_nan=False)  # reads before the writes: NaN or wrong


def test_planted_off_by_one_tail_is_caught(emu):
    x = make((100,), seed=0)
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


@pytest.mark.parametrize("mode,message", [
    (0, r"waits at __syncthreads \(.*\) while .* waits at another"),
    (1, "__shfl_xor_sync and lane 16's __shfl_down_sync of one mask differ"),
    (2, r"deadlock in block \(0,0,0\): no thread can run; threads 0-15: __shfl_xor_sync; threads 16-63: __syncthreads"),
    (3, r"__shfl_sync with mask 1 and width 32 \(the calling lane must be in the mask"),
    (4, r"invalid configuration argument: launch of grid \(1,1,1\), block \(2048,1,1\)"),
    (5, r"invalid configuration argument: launch of grid \(1,65536,1\)"),
])
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
        launch(emu.bias_act_backward, code(dtype), ACT_CODES[act], buf(g, misalign), buf(x, misalign), buf(b), gx,
               gb, ew_workspace(emu, rows, C, dtype), rows * C, C)
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
        launch(emu.glu_backward, code(dtype), ACT_CODES[act], buf(grad), gate_b, 2 * cols, up_b, 2 * cols, gg, gu, rows,
               cols)
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
            launch(emu.bias_dropout_add, code(dtype), buf(x, misalign), buf(b), buf(r, misalign), y, x.numel(), C,
                   *dropout_args(p, seed))
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
        launch(emu.dropout_backward, code(dtype), buf(g, misalign), gx, gb, ew_workspace(emu, rows, C, dtype),
               g.numel(), C, *dropout_args(p, seed))
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
    ["abs", ("clamp_min", 0.25), ("clamp_max", 2.0), "relu", "gelu", "gelu_tanh", "silu", "sin", "cos",
     ("pow", 0.0)],
    [("mul", 0.999)] * 64,  # a whole launch's worth of ops
]


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
        launch(emu.unary_chain_backward, code(dtype), op_codes, scalars, buf(g, misalign), buf(x, misalign), gx,
               x.numel())
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
    launch(emu.bias_act_backward, 0, 2, buf(torch.zeros(0)), buf(torch.zeros(0)), buf(torch.zeros(5)), y, gb, None,
           0, 5)
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
        launch(emu.act_grad_bias, code(dtype), ACT_CODES[act], buf(grad), buf(saved), gp, gb,
               linear_workspace(emu, dtype, M, N), M, N)
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
    launch(emu.act_grad_bias, code(torch.float32), ACT_CODES["silu"], buf(grad), buf(saved), gp, gb,
           linear_workspace(emu, torch.float32, M, N), M, N)
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


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("p,squared", [(2.0, False), (2.0, True), (1.0, False), (0.0, False), (math.inf, False),
                                       (3.5, False), (0.5, False)])
def test_pairwise_distances_direct_and_grad(emu, p, squared, dtype):
    """B=2 batches of 70 x 130 points: 2 x 2 output tiles with tails, D=17: a staged chunk of 16 coordinates and
    a tail of 1. Duplicated points (zero distance: zero subgradient). The gradient of both inputs, as the binding
    launches it: grad_b is the same kernel with a and b swapped and (grad, dist) read transposed."""
    B, N, M, D = 2, 70, 130, 17
    a, b = make((B, N, D), dtype, seed=0), make((B, M, D), dtype, seed=1)
    b[:, 3] = a[:, 5]
    dist = out((B, N, M), dtype)
    launch(emu.pairwise_distances_direct, code(dtype), metric(p), p, squared, buf(a), buf(b), dist, B, N, M, D)
    expected = F.pairwise_distances(a, b, p, squared)
    assert_close(dist, expected, scale=4)
    assert_close(dist, dref.pairwise_distances(a.double(), b.double(), p, squared), dtype, scale=4)
    assert (dist[:, 5, 3] == 0).all()

    # 16-bit max-norm backwards run in float32 on float32 distances (fused/distance/ops.py): so here too.
    gdtype = torch.float32 if p == math.inf and dtype in (torch.float16, torch.bfloat16) else dtype
    a, b, dist = a.to(gdtype), b.to(gdtype), F.pairwise_distances(a.to(gdtype), b.to(gdtype), p, squared)
    grad = make((B, N, M), gdtype, seed=2)
    math_t = torch.float64 if gdtype == torch.float64 else torch.float32
    ga, gb = out((B, N, D), math_t), out((B, M, D), math_t)
    launch(emu.pairwise_distances_grad, code(gdtype), metric(p), p, squared, buf(a), buf(b), buf(grad), buf(dist), ga,
           B, N, M, D, M, 1)
    launch(emu.pairwise_distances_grad, code(gdtype), metric(p), p, squared, buf(b), buf(a), buf(grad), buf(dist), gb,
           B, M, N, D, 1, M)
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
    dist = out((B, 1, 1), torch.float32)
    launch(emu.pairwise_distances_direct, 0, 2, 2.0, False, buf(a), buf(b), dist, B, 1, 1, 2)
    assert_close(dist, torch.cdist(a.double(), b.double()), torch.float32)
    grad = make((B, 1, 1), seed=2)
    ga = out((B, 1, 2), torch.float32)
    launch(emu.pairwise_distances_grad, 0, 2, 2.0, False, buf(a), buf(b), buf(grad), dist, ga, B, 1, 1, 2, 1, 1)
    assert_close(ga, F.pairwise_distances_backward(grad, a, b, dist, 2.0, False)[0])


def test_distance_zero_dimensions(emu):
    """D = 0: every distance is 0, for every metric."""
    for p in (0.0, 1.0, 2.0, math.inf, 3.5):
        dist = out((2, 3, 4), torch.float32)
        launch(emu.pairwise_distances_direct, 0, metric(p), p, False, buf(torch.zeros(2, 3, 0)),
               buf(torch.zeros(2, 4, 0)), dist, 2, 3, 4, 0)
        assert torch.equal(dist, F.pairwise_distances(torch.zeros(2, 3, 0), torch.zeros(2, 4, 0), p, False))


def test_distance_empty_inputs_launch_nothing(emu):
    dist = out((2, 0, 3), torch.float32)
    launch(emu.pairwise_distances_direct, 0, 2, 2.0, False, buf(torch.zeros(2, 0, 4)), buf(torch.zeros(2, 3, 4)),
           dist, 2, 0, 3, 4)
    ga = out((2, 3, 0), torch.float32)
    launch(emu.pairwise_distances_grad, 0, 2, 2.0, False, buf(torch.zeros(2, 3, 0)), buf(torch.zeros(2, 4, 0)),
           buf(torch.zeros(2, 3, 4)), buf(torch.zeros(2, 3, 4)), ga, 2, 3, 4, 0, 4, 1)
