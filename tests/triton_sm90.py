"""Compiles the Triton kernels for sm_90 (Hopper) through their real launchers, on a machine without a GPU:
a stand-in driver reports an sm_90 device, CPU tensors go through the launchers' normal specialisation, and each
launch stops after compiling (warmup); the autotuned GEMM compiles every configuration (bf16), its "benchmark"
times none. The interpreter the other tests use runs none of Triton's type checks or its lowering, so this is what
catches a kernel that would not build on a GPU, and the PTX shows what the GPU would run. Run as a script (no
TRITON_INTERPRET); prints one line per compiled kernel and FAIL lines. `python tests/triton_sm90.py linear`
compiles one family (elementwise, distance, linear, norm, loss, rope, logprob, optim; distance_unfused, which
turns Triton's FP fusion off for the rest of its process, only by name)."""

import contextlib
import math
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class Sm90Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        # The autotuner's timer: each config is compiled (compile_only below), none runs; equal times keep the first.
        return lambda kernel_call, quantiles: (kernel_call(), [1.0] * len(quantiles))[1]


driver.set_active(Sm90Driver())
_run = JITFunction.run
FAILURES = []
PTX = {}  # kernel name -> set of PTX texts
PTX_F64 = {}  # kernel name -> set of PTX texts of its launches on float64 tensors
# (dtype, dot precision) of the linear GEMM -> {config: (shared bytes, wgmma count, cp.async count)}, from the
# launches with 16-byte aligned rows (a ragged K loads without cp.async)
GEMM = {}
SHARED_LIMIT = 227 * 1024  # what one block may use on sm_90; a config above it fails to launch (autotuner drops it)


def compile_only(self, *args, grid, warmup, **kwargs):
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure is reported
        FAILURES.append(f"{self.fn.__name__}: {e!r}"[:2000])
        return None
    ptx = kernel.asm["ptx"]
    PTX.setdefault(self.fn.__name__, set()).add(ptx)
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
        PTX_F64.setdefault(self.fn.__name__, set()).add(ptx)
    if self.fn.__name__ == "_linear_act_kernel" and x.stride(0) * x.element_size() % 16 == 0:  # aligned rows
        config = tuple(kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages", "num_warps"))
        GEMM.setdefault((str(args[0].dtype), kwargs["PRECISION"]), {})[config] = (
            kernel.metadata.shared,
            ptx.count("wgmma.mma_async"),
            ptx.count("cp.async"),
        )
    return kernel


JITFunction.run = compile_only


def elementwise():
    import fused.elementwise.triton_kernels as tk

    for dt in (torch.float32, torch.bfloat16):
        x, g = torch.randn(5, 131, dtype=dt), torch.randn(5, 131, dtype=dt)
        b = torch.randn(131, dtype=dt)
        for act in ("gelu", "silu", "gelu_tanh", "relu"):
            tk.bias_act(x, b, act)
            tk.bias_act_backward(g, x, b, act)
            tk.glu(x, x, act)
            tk.glu_backward(g, x, x, act)
        seed = torch.tensor(12345678901, dtype=torch.int64)
        tk.bias_dropout_add_seeded(x, b, g, 0.3, seed)
        tk.dropout_backward(g, 0.3, seed, True)
        ops = ["square", "sqrt", "rsqrt", "exp", "log", "sin", "tanh", "gelu", "reciprocal", "pow:1.5", "add:0.5"]
        tk.unary_chain(x, ops)
        tk.unary_chain_backward(g, x, ops)


def distance():
    """Every dtype x metric x path (D = 40: p = 2's tensor-core path, not float64), topk smallest and largest; for
    p = 1 and 2, padded batches (lengths) and radius_neighbors (the radius bound)."""
    import fused.distance.triton_kernels as tk

    la, lb = torch.tensor([40, 7]), torch.tensor([65])
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for p in (0.0, 1.0, 2.0, math.inf, 0.5):
            for d in (3, 40) if p == 2 and dt != torch.float64 else (3,):
                a, b = torch.randn(2, 40, d, dtype=dt), torch.randn(1, 70, d, dtype=dt)
                dist = tk.pairwise_distances(a, b, p)
                for largest in (False, True):
                    tk.pairwise_topk(a, b, 5, p, largest=largest)
                tk.pairwise_distances_backward(torch.ones_like(dist), a, b, dist, p, False)
                if p in (1.0, 2.0):
                    tk.pairwise_distances(a, b, p, False, la, lb)
                    tk.pairwise_topk(a, b, 5, p, False, False, la, lb)
                    tk.radius_neighbors(a, b, 1.0, 5, la, lb, p)
                    tk.pairwise_distances_backward(torch.ones_like(dist), a, b, dist, p, False, la, lb)


def distance_unfused():
    """p = 2 on the direct path with Triton's FP fusion off (Triton 3.10's default; 3.9's is on): the accumulation
    must stay one fma per coordinate, as the C++ kernels' explicit fma, so that every backend ranks the same
    values. float32 and float64, distances and topk."""
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
    import fused.distance.triton_kernels as tk

    for dt in (torch.float32, torch.float64):
        a, b = torch.randn(2, 40, 3, dtype=dt), torch.randn(1, 70, 3, dtype=dt)
        tk.pairwise_distances(a, b, 2.0)
        tk.pairwise_topk(a, b, 5, 2.0)


@contextlib.contextmanager
def one_config(tuned, config):
    """The autotuned kernel with only `config`: no tuning, one compile (each config costs seconds to build)."""
    configs, tuned.configs = tuned.configs, [config]
    try:
        yield
    finally:
        tuned.configs = configs


def linear():
    import fused.linear.triton_kernels as tk
    from fused._codes import ACT_CODES

    fits_fp32 = tk.HOPPER_CONFIGS[-2]  # BLOCK_K 32: fp32 tiles within shared memory
    x, w, b = (torch.randn(shape).bfloat16() for shape in ((128, 256), (512, 256), (512,)))
    for act in ACT_CODES:  # bf16: the first compiles every config (tuning), the others reuse the pick
        tk.linear_act_fwd(x, w, b, act, True)
    tk.linear_act_fwd(x, w, None, "gelu", False)
    with one_config(tk._linear_act_tuned, tk.HOPPER_CONFIGS[0]):
        tk.linear_act_fwd(x.half(), w.half(), b.half(), "silu", True)
        xr, wr = torch.randn(37, 100, dtype=torch.bfloat16), torch.randn(45, 100, dtype=torch.bfloat16)
        tk.linear_act_fwd(xr, wr, None, "silu", True)  # ragged: masked K loop, unaligned sizes
    with one_config(tk._linear_act_tuned, fits_fp32):
        tk.linear_act_fwd(x.float(), w.float(), b.float(), "gelu_tanh", True)  # fp32 products (FMA)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            tk.linear_act_fwd(x.float(), w.float(), b.float(), "gelu_tanh", True)  # tf32 tensor cores
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    g, saved = torch.randn(3, 41, 70), torch.randn(3, 41, 70)
    for act in ACT_CODES:
        tk.linear_act_grad_pre(g, saved, act, True)
    tk.linear_act_grad_pre(g, saved, "gelu", False)
    tk.linear_act_grad_pre(g.bfloat16(), saved.bfloat16(), "silu", True)
    tk.linear_act_grad_pre(g.half(), saved.half(), "gelu_tanh", True)


def norm():
    import fused.norm.triton_kernels as tk

    for dt, res_dt in (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ):
        x, g = torch.randn(6, 200, dtype=dt), torch.randn(6, 200, dtype=dt)
        r, w, b = torch.randn(6, 200, dtype=res_dt), torch.randn(200, dtype=dt), torch.randn(200, dtype=dt)
        for rms in (True, False):
            _, h, mean, rstd = tk.norm_fwd(x, r, [200], w, None if rms else b, 1e-5, rms)
            tk.norm_fwd(x, None, [200], None, None, 1e-5, rms)
            tk.norm_backward(g, h, h, mean, rstd, w, [200], rms, True, not rms)
            tk.norm_backward(g, None, x, mean, rstd, None, [200], rms, False, False)


def loss():
    import fused.loss.triton_kernels as tk

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        acc = torch.float64 if dt == torch.float64 else torch.float32
        logits, t = torch.randn(4, 300, dtype=dt), torch.tensor([1, -100, 299, 0])
        weight, scale = torch.rand(300, dtype=acc), torch.ones(4, 2, dtype=acc)
        tk.cross_entropy_rows(logits, t, weight, scale, torch.empty_like(logits), -100, 0.1, 1e-4, 30.0)
        tk.cross_entropy_rows(logits, t, None, scale[0], logits.new_empty(0), -100, 0.0, 0.0, 0.0)


def rope():
    from fused.rope import triton_kernels as tk  # fused.rope, the attribute, is the op

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        q = torch.randn(2, 3, 4, 20, dtype=dt).transpose(1, 2)  # a transposed projection
        k, cos, sin = (
            torch.randn(2, 1, 3, 20, dtype=dt),
            torch.randn(1, 3, 12, dtype=dt),
            torch.randn(1, 3, 12, dtype=dt),
        )
        for interleaved in (False, True):
            tk.rope(q, k, cos, sin, 1, interleaved=interleaved)
            tk.rope_backward(q, k, cos, sin, 1, interleaved)


def logprob():
    import fused.loss.triton_logprob as tk

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        acc = torch.float64 if dt == torch.float64 else torch.float32
        logits, t = torch.randn(4, 300, dtype=dt), torch.tensor([1, -100, 299, 0])
        scale = torch.ones(4, 2, dtype=acc)
        tk.log_prob_rows(logits, t, scale, torch.empty_like(logits), -100, 0.7)
        tk.distillation_rows(logits, logits, t, scale[:, 0], torch.empty_like(logits), "jsd", 0.5, 2.0, -100)
        tk.distillation_rows(logits, logits, None, scale[0, 0], logits.new_empty(0), "forward_kl", 0.5, 1.0, -100)


def optim():
    """adam_step_: 8-bit state (amsgrad, value clipping, loss scale; exp_avg_sq's codes rounded stochastically),
    bf16 params rounded stochastically, master weights, bf16 state rounded stochastically, float64 params with their
    own state. The bias corrections are taken in the kernel, as on a GPU (not from the host, as under the
    interpreter)."""
    from fused.optim import quantize
    from fused.optim import triton_kernels as tk

    tk.host_terms = lambda device: False

    def step(dt, codes, amsgrad=False, master=False, seed=None, state_seed=None):
        p = torch.randn(5000, dtype=torch.float32 if master else dt)
        g = torch.randn(5000, dtype=dt)
        plain = torch.bfloat16 if state_seed is not None else p.dtype
        state = [torch.zeros(5000, dtype=quantize.CODES[k] if codes else plain) for k in quantize.CODES]
        scales = {k + "_scales": [quantize.scales_like(s)] for k, s in zip(quantize.CODES, state)} if codes else {}
        one = torch.ones(())
        tk.adam_step_(
            [p], [g], [state[0]], [state[1]], [state[2]] if amsgrad else [], [torch.zeros(())], 1e-3, 0.9, 0.999,
            1e-8, 0.01, amsgrad, True, False, torch.ones((), dtype=torch.float64), one * 64, one * 0, 1.0,
            [torch.empty(5000, dtype=dt)] if master else [], seed, None, True, **scales, state_seed=state_seed,
        )  # fmt: skip

    step(torch.float32, True, amsgrad=True)
    step(torch.float32, True, state_seed=torch.tensor(11))  # exp_avg_sq's codes rounded stochastically
    step(torch.float32, False, amsgrad=True, state_seed=torch.tensor(9))
    step(torch.bfloat16, True, seed=torch.tensor(7))
    step(torch.bfloat16, True, master=True)
    step(torch.float64, False)
    optim_others()


def optim_others():
    """grad_norm (every norm type, a loss scale, value clipping, float64 and 16-bit gradients in one call, the
    finish=False mode), scale_grads_, accumulate_grads_, and sgd_step_: float32 without momentum, with momentum,
    with nesterov (value clipping, loss scale, maximize), bf16 master weights; float64; bf16 rounded stochastically."""
    from fused.optim import triton_accumulate, triton_norm, triton_sgd

    grads = [torch.randn(5000), torch.randn(300, dtype=torch.bfloat16), torch.randn(70, dtype=torch.float64)]
    one, coef = torch.ones(()), torch.ones((), dtype=torch.float64)
    for norm_type in (2.0, 1.0, math.inf, 3.0):
        triton_norm.grad_norm(grads, one * 0, one * 64, norm_type, 1.0, 0.5)
    triton_norm.grad_norm(grads[:2], None, None, 2.0, math.inf, math.inf, False)
    triton_norm.grad_norm([torch.zeros(0)], one * 0, None, 2.0, 1.0, math.inf)  # no element: the finish alone
    triton_norm.scale_grads_(grads, coef)
    triton_accumulate.accumulate_grads_([torch.zeros(300), torch.zeros(70, dtype=torch.float64)], grads[1:], False)

    def sgd(dt, momentum=0.0, nesterov=False, master=False, seed=None):
        p = torch.randn(5000, dtype=torch.float32 if master else dt)
        g = torch.randn(5000, dtype=dt)
        bufs, steps = ([torch.zeros_like(p)], [torch.zeros(())]) if momentum else ([], [])
        triton_sgd.sgd_step_(
            [p], [g], bufs, steps, 0.1, momentum, 0.0, 0.01, nesterov, nesterov, coef, one * 64, one * 0,
            0.5 if nesterov else math.inf, [torch.empty(5000, dtype=dt)] if master else [], seed, None, True,
        )  # fmt: skip

    sgd(torch.float32)
    sgd(torch.float32, momentum=0.9)
    sgd(torch.float32, momentum=0.9, nesterov=True)
    sgd(torch.bfloat16, momentum=0.9, master=True)
    sgd(torch.float64, momentum=0.9)
    sgd(torch.bfloat16, seed=torch.tensor(7))


def count(ptxs, *needles):
    return sum(p.count(n) for p in ptxs for n in needles)


def flushed(ptxs):
    """The .ftz instructions but the approximate ones: libdevice builds expf and correctly rounded division on
    ex2.approx.ftz and rcp.approx.ftz seeds, scaled so that no result is flushed (those stay in its non-ftz code)."""
    return count(ptxs, ".ftz") - count(ptxs, ".approx.ftz")


def entries(ptxs):
    """The kernels' own bodies: each PTX without the functions it calls (.func, e.g. libdevice's accurate pow,
    whose fmas are its own)."""
    out = []
    for p in ptxs:
        body = p[p.index(".entry") :]
        out.append(body[: body.index("\n.func")] if "\n.func" in body else body)
    return out


if __name__ == "__main__":
    for family in sys.argv[1:] or ["elementwise", "distance", "linear", "norm", "loss", "rope", "logprob", "optim"]:
        try:
            globals()[family]()
        except Exception as e:  # noqa: BLE001 - a launcher that fails after a skipped launch still counts
            if not FAILURES:
                FAILURES.append(f"{family}: {e!r}"[:2000])
    for name, ptxs in sorted(PTX.items()):
        print(
            f"compiled {name}: {len(ptxs)} variants, sqrt.approx {count(ptxs, 'sqrt.approx')}, "
            f"fma.rn.f32 {count(ptxs, 'fma.rn.f32')}, div.rn.f32 {count(ptxs, 'div.rn.f32')}, "
            f"div.full.f32 {count(ptxs, 'div.full.f32')}, div.approx {count(ptxs, 'div.approx')}, "
            f"float64 variants {len(PTX_F64.get(name, ()))}, fma.rn.f64 {count(ptxs, 'fma.rn.f64')}, "
            f"atom.global {count(ptxs, 'atom.global')}, own fma.rn.f64 {count(entries(ptxs), 'fma.rn.f64')}, "
            f"flushed {flushed(ptxs)}"
        )
        # Eager and the C++ kernels divide correctly rounded (div.rn); Triton's `/` on float32 is div.full.f32.
        if count(ptxs, "div.full.f32", "div.approx"):
            FAILURES.append(f"{name}: approximate float32 division (div.full / div.approx) in its PTX")
        # Launched without KEEP_SUBNORMALS, libdevice's functions compile to .ftz arithmetic (fma.rn.ftz, cvt.ftz,
        # abs.ftz) that flushes subnormal results to zero, where eager keeps them.
        if flushed(ptxs):
            FAILURES.append(f"{name}: {flushed(ptxs)} flush-to-zero (.ftz) instructions in its PTX")
        # A Python float reaches a kernel as an fp32 parameter unless annotated tl.float64: a float64 kernel
        # would compute with an fp32-rounded scalar (eps = 1e-5 as 9.99999974738e-06, 1e-50 as 0).
        if count(PTX_F64.get(name, ()), ".param .f32"):
            FAILURES.append(f"{name}: a float32 scalar parameter in its float64 PTX (annotate it tl.float64)")
    for (dtype, precision), configs in sorted(GEMM.items()):
        shared = [s for s, _, _ in configs.values()]
        fit = sum(s <= SHARED_LIMIT for s in shared)
        print(
            f"gemm {dtype} {precision}: {len(configs)} configs, {sum(w > 0 for _, w, _ in configs.values())} on "
            f"wgmma, {fit} within shared memory, {sum(c > 0 for _, _, c in configs.values())} with a cp.async "
            f"pipeline, shared {min(shared)}..{max(shared)}"
        )
        if not fit:
            FAILURES.append(f"gemm {dtype} {precision}: no config fits in shared memory")
    for f in FAILURES:
        print("FAIL", f)
    sys.exit(1 if FAILURES else 0)
