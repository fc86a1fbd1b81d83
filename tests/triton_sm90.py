"""Compiles the Triton kernels for sm_90 (Hopper) through their real launchers, on a machine without a GPU:
a stand-in driver reports an sm_90 device, CPU tensors go through the launchers' normal specialisation, and each
launch stops after compiling (warmup). The interpreter the other tests use runs none of Triton's type checks or
its lowering, so this is what catches a kernel that would not build on a GPU. Run as a script (no
TRITON_INTERPRET); prints one line per compiled kernel and FAIL lines."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
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


driver.set_active(Sm90Driver())
_run = JITFunction.run
FAILURES = []
PTX = {}


def compile_only(self, *args, grid, warmup, **kwargs):
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure is reported
        FAILURES.append(f"{self.fn.__name__}: {e!r}"[:2000])
        return None
    PTX.setdefault(self.fn.__name__, set()).add(kernel.asm["ptx"])
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
    import fused.distance.triton_kernels as tk
    for dt, d in ((torch.float32, 3), (torch.float32, 64), (torch.bfloat16, 64), (torch.float64, 5)):
        a, b = torch.randn(2, 40, d, dtype=dt), torch.randn(1, 70, d, dtype=dt)
        for p in (2.0, 1.0, 0.5):
            dist = tk.pairwise_distances(a, b, p)
            tk.pairwise_topk(a, b, 5, p)
            tk.pairwise_distances_backward(torch.ones_like(dist), a, b, dist, p, False)


if __name__ == "__main__":
    for family in sys.argv[1:] or ["elementwise", "distance"]:
        try:
            globals()[family]()
        except Exception as e:  # noqa: BLE001 - a launcher that fails after a skipped launch still counts
            if not FAILURES:
                FAILURES.append(f"{family}: {e!r}"[:2000])
    for name, ptxs in sorted(PTX.items()):
        approx = sum(p.count("sqrt.approx") for p in ptxs)
        fma = sum(p.count("fma.rn.f32") for p in ptxs)
        print(f"compiled {name}: {len(ptxs)} variants, sqrt.approx {approx}, fma.rn.f32 {fma}")
    for f in FAILURES:
        print("FAIL", f)
    sys.exit(1 if FAILURES else 0)
