"""fused.info, set_backend, and a smoke run of every benchmark case (each implementation once, small shapes),
so that the benchmark suite cannot rot unnoticed."""

import importlib.util
import os
import pkgutil
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import benchmarks
import fused
from benchmarks.common import built
from fused.info import report
from tests.harness import raises
from tests.test_op_coverage import registered


def test_info_lists_every_op_with_its_kernels():
    text = report()
    assert f"fused {fused.__version__}" in text and f"torch {torch.__version__}" in text
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:2] == ["op", "cpu"]) + 1
    rows = {line.split()[0]: line.split()[1:] for line in lines[first:] if line.strip()}
    assert sorted(rows) == registered()  # every fused:: op but the CUDA twins (tests/test_op_coverage.py)
    for op in rows:
        assert rows[op][0] in ("C++", "composite"), op


def test_info_reports_the_cpu_knn_gemm(monkeypatch):
    """The k-NN filter's GEMM that this CPU runs, and FUSED_KNN_FILTER forcing either."""
    monkeypatch.delenv("FUSED_KNN_FILTER", raising=False)
    levels = fused._C.int8_gemm_levels()
    assert levels in (0, 63, 127)
    line = "CPU k-NN GEMM (pairwise_topk, radius_neighbors at p=2, D >= 32): "
    if fused._C.knn_filter(10**6, 768) == "int8":  # x86 with torch's oneDNN: int8 from 128 rows of a
        assert line + {127: "int8, 8-bit codes, from 128 rows", 63: "int8, 7-bit codes"}[levels] in report()
        assert fused._C.knn_filter(127, 768) == "float32" and fused._C.knn_filter(128, 768) == "int8"
    else:
        assert line + "float32 (torch's int8 GEMM is not" in report()
    monkeypatch.setenv("FUSED_KNN_FILTER", "float32")
    assert line + "float32 (FUSED_KNN_FILTER=float32)" in report()
    assert fused._C.knn_filter(10**6, 768) == "float32"
    monkeypatch.setenv("FUSED_KNN_FILTER", "int8")
    assert fused._C.knn_filter(1, 768) == ("int8" if levels else "float32")
    assert (line + "int8") in report() or not levels


def test_set_backend_validates_and_env_default(monkeypatch):
    with raises(r"fused.set_backend: unknown backend 'cudnn'"):
        fused.set_backend("cudnn")
    monkeypatch.setattr(fused._backend, "_backend", None)
    monkeypatch.setenv("FUSED_BACKEND", "triton")
    assert fused.get_backend() == "triton"
    fused.set_backend("auto")
    assert fused.get_backend() == "auto"


def test_choose_is_cached_per_backend():
    """choose() caches its answer per (op, backend): set_backend between calls still changes it, and a backend
    that cannot run the op raises every time, not once."""
    from fused import _backend

    try:
        for backend in ("cuda", "triton", "cuda"):
            fused.set_backend(backend)
            cuda_op = _backend.GPU_KERNELS["norm_fwd"]["cuda"]
            runs = _backend.triton_available() if backend == "triton" else _backend.cuda_kernel_compiled(cuda_op)
            for _ in range(2):
                if runs:
                    assert _backend.choose("norm_fwd") == backend
                else:
                    with raises(rf"fused\.norm_fwd: backend '{backend}' was asked for"):
                        _backend.choose("norm_fwd")
        fused.set_backend("auto")
        assert _backend.choose("norm_fwd") == _backend._choice.__wrapped__("norm_fwd", "auto")
    finally:
        fused.set_backend("auto")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_router_takes_the_backend_except_on_triton_only_paths(monkeypatch, backend):
    """pairwise_distances on a CUDA tensor: the tensor-core path (p = 2, D >= 32, not float64) is Triton's whatever
    the backend (while triton is installed); every other call runs the backend that choose() picks."""
    from fused import _backend
    from fused.distance.ops import _tensor_core_path

    ran = []
    monkeypatch.setattr(_backend, "choose", lambda op: backend)
    monkeypatch.setattr(_backend, "triton_launcher", lambda path: lambda *args: ran.append(path))
    route = _backend.gpu_router(
        "pairwise_distances",
        "cuda_pairwise_distances",
        "module:launcher",
        cuda_call=lambda *args: ran.append("cuda"),
        triton_when=_tensor_core_path,
    )
    tensor_core = [(torch.empty(2, 32), None, 2.0, False)]
    direct = [
        (torch.empty(2, 31), None, 2.0, False),
        (torch.empty(2, 64), None, 1.0, False),
        (torch.empty(2, 64, dtype=torch.float64), None, 2.0, False),
    ]
    for args in tensor_core + direct:
        route(*args)
    assert ran == ["module:launcher"] + ["cuda" if backend == "cuda" else "module:launcher"] * 3
    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    ran.clear()
    route(*tensor_core[0])
    assert ran == ["cuda" if backend == "cuda" else "module:launcher"]


def test_meta_tensors_get_shapes_from_the_fake_kernels():
    x = torch.empty(2, 3, 8, device="meta")
    assert fused.bias_act(x, torch.empty(8, device="meta")).shape == (2, 3, 8)
    assert fused.glu(x, x).shape == (2, 3, 8)
    assert fused.unary_chain(x, ["exp", ("mul", 2.0)]).device.type == "meta"
    with raises(r"fused\.bias_act: bias must be 1-D"):
        fused.bias_act(x, torch.empty(3, device="meta"))


BENCH_MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_benchmark_cases_run(name):
    module = importlib.import_module(f"benchmarks.{name}")
    cases = module.cases("cpu", quick=True)
    assert cases
    for case in map(built, cases):
        assert case["name"] and case["impls"] and "eager" in case["impls"]
        for label, fn in case["impls"].items():
            if label != "torch.compile":  # compiling every case here would take minutes; run.py times it
                fn()


def test_import_works_without_triton():
    """`import fused` and the CPU kernels need no triton (it is imported lazily, for CUDA tensors only)."""
    import subprocess
    import sys

    code = """
import sys
class BlockTriton:  # triton as if not installed (torch 2.14 itself asks find_spec, and takes this error)
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, BlockTriton())
import torch, fused
assert fused.bias_act(torch.ones(2, 3), None, "relu").sum().item() == 6.0
print(fused.info.report() if hasattr(fused, "info") else __import__("fused.info").info.report())
"""
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "triton not installed" in out.stdout


def test_benchmark_summary_table():
    from benchmarks.summary import summary

    rows = [
        {"impl": "eager", "ms": 2.0, "peak_mb": 8.0},
        {"impl": "torch.compile", "ms": 1.0, "peak_mb": 4.0},
        {"impl": "fused[cuda]", "ms": 0.5, "vs_eager": 4.0, "vs_best_alt": 2.0, "peak_mb": 2.0},
        {"impl": "fused[triton]", "ms": None, "error": "OutOfMemoryError"},
    ]
    lines = summary([{"name": "case", "rows": rows}]).splitlines()
    assert lines[2:] == ["| case [fused[cuda]] | 0.500 | 2.000 | torch.compile (1.000) | 4.00x | 2.00x | 2.0 / 4.0 |"]


def test_master_weights_memory_held():
    """The bf16 master-weight benchmark's memory figure: after a step, fused holds 16 B per parameter (bf16 param
    and grad, fp32 master, m and v) where torch's fp32-master recipe holds 20 B (its masters need fp32 .grad)."""
    from benchmarks.bench_optim import master_impls, model_shapes

    shapes = model_shapes(32, 2)
    n = sum(torch.Size(s).numel() for s in shapes)
    impls, resident = master_impls(shapes, "cpu")
    for label, step in impls.items():
        step()
        per_param = resident[label]() * 2**20 / n
        expected = 16 if label == "fused" else 20
        assert expected <= per_param < expected + 0.1, (label, per_param)


def test_cpu_peak_memory():
    """The benchmarks' CPU peak memory: the most that was live at once during the call, beyond what was before."""
    from benchmarks.timing import peak_memory_mb

    live_before = torch.ones(1 << 20)

    def one_at_a_time():
        for _ in range(3):
            torch.ones(1 << 20).sum()  # 4 MB, freed before the next

    def two_at_once():
        return torch.ones(1 << 20) + torch.ones(1 << 20)  # 3 x 4 MB live at the peak

    assert peak_memory_mb(one_at_a_time, "cpu") == pytest.approx(4.0, abs=0.01)
    assert peak_memory_mb(two_at_once, "cpu") == pytest.approx(12.0, abs=0.01)
    del live_before


def test_benchmark_run_writes_table_and_json_without_matplotlib(monkeypatch, tmp_path, capsys):
    """Without matplotlib, a run still writes its table and JSON (and prints the table), and says in one line how
    to get the chart."""
    import sys
    import types

    from benchmarks import run

    tiny = types.SimpleNamespace(cases=lambda device, quick: [{"name": "tiny", "impls": {"eager": lambda: None}}])
    monkeypatch.setattr(run, "discover", lambda only: [tiny])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ModuleNotFoundError
    run.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md"], written
    out = capsys.readouterr().out
    assert "| tiny | eager |" in out
    skipped = [line for line in out.splitlines() if "chart" in line]
    assert len(skipped) == 1 and "pip install matplotlib" in skipped[0], out


def test_bench_default_is_a_case_per_op_and_dtype():
    """make bench's default: the cases a family marks "default"; else its first case of each op and dtype (shapes,
    sizes and the direction do not make another op; a dtype does)."""
    from benchmarks.run import default_cases

    names = [
        "linear_cross_entropy 4096x1024x32768 float32 fwd",
        "linear_cross_entropy 4096x1024x32768 float32 fwd+bwd",
        "linear_cross_entropy 4096x1024x131072 float32 fwd",
        "linear_cross_entropy 4096x1024x32768 bfloat16 fwd",
        "pairwise_topk k=16 (100,2)x(200,2) float32 fwd",
        "pairwise_topk k=10 (4096,128)x(65536,128) float32 fwd",
    ]
    picked = [c["name"] for c in default_cases([{"name": n} for n in names])]
    assert picked == [names[0], names[3], names[4]]
    marked = [{"name": n, "default": i == 2} for i, n in enumerate(names)]
    assert [c["name"] for c in default_cases(marked)] == [names[2]]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="--keep-heap sets glibc's malloc options")
def test_benchmark_keep_heap_reuses_freed_memory(tmp_path):
    """--keep-heap: malloc keeps what it frees, so 32 MB tensors made and freed in turn reuse pages once glibc has
    settled (by default each comes from mmap and faults in 8192 fresh pages), and the files say which run it was."""
    code = textwrap.dedent(
        f"""
        import resource, sys, types, torch
        from benchmarks import run
        case = {{"name": "tiny", "impls": {{"eager": lambda: None}}}}
        tiny = types.SimpleNamespace(cases=lambda device, quick: [case])
        run.discover = lambda only: [tiny]
        sys.modules["matplotlib"] = None
        run.main(["--device", "cpu", "--quick", "--keep-heap", "--out", {str(tmp_path)!r}])
        for _ in range(10):  # glibc settles in a few calls
            torch.empty(2**23).fill_(1.0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            torch.empty(2**23).fill_(1.0)
        print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    faults = int(done.stdout.split("faults")[-1])
    assert faults <= 2 * 8192, faults  # 4 x 8192 when each tensor is fresh memory
    assert ["-keep-heap" in p.name for p in tmp_path.iterdir() if p.suffix == ".md"] == [True]
    assert "freed heap kept" in done.stdout


def test_gpu_candidate_patches_apply_to_the_tree():
    """tools/gpu_candidates/*.patch wait for a GPU timing (tools/gpu_ab.sh): each still applies to this tree."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(root, "tools", "gpu_candidates")
    patches = sorted(f for f in os.listdir(folder) if f.endswith(".patch")) if os.path.isdir(folder) else []
    for name in patches:
        check = subprocess.run(["git", "apply", "--check", os.path.join(folder, name)], cwd=root, capture_output=True)
        assert check.returncode == 0, (name, check.stderr.decode())


def test_gpu_adam_times_runs(capsys):
    """tools/gpu_adam_times.py (gpu_ab.sh's timing command) on small CPU tensors: a line per backend and state."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gpu_adam_times", os.path.join(root, "tools", "gpu_adam_times.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.run(layers=1, width=64, device="cpu")
    lines = [line for line in capsys.readouterr().out.splitlines() if "median" in line]
    assert [line.split(":")[0] for line in lines] == [
        f"fused[{b}] state {s}" for b in ("cuda", "triton") for s in ("fp32", "bf16", "int8")
    ]
    assert fused._backend._backend in (None, "auto")  # set back


def test_every_triton_launch_keeps_subnormals():
    """Every Triton kernel launch (kernel[grid](...)) passes KEEP_SUBNORMALS: without it libdevice's exp, pow,
    division and sqrt flush subnormal results to zero on a GPU, where eager keeps them (the interpreter cannot show
    the difference, so this reads the launch sites)."""
    import ast
    import pathlib

    launches, missing = 0, []
    for path in pathlib.Path(fused.__file__).parent.rglob("triton*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launches += 1
                if not any(k.arg is None and getattr(k.value, "id", "") == "KEEP_SUBNORMALS" for k in node.keywords):
                    missing.append(f"{path.name}:{node.lineno}")
    assert launches >= 24 and not missing, missing


def _float32_nearest(exact):
    """The float32 nearest a Fraction, ties to even."""
    from fractions import Fraction

    import numpy as np

    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))


def test_fma_for_the_interpreter_rounds_once():
    """tests/triton_interpreter.py's fma (given to Triton interpreters that round tl.fma twice) against exact
    rational arithmetic, on products whose float32 rounding a following add cancels (where rounding twice shows),
    and the fma the interpreter runs now."""
    np = pytest.importorskip("numpy")
    from fractions import Fraction

    from tests.triton_interpreter import PROBE, _probe, fma_rounded_once

    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(2000).astype(np.float32) for _ in range(2))
    cancel = (-(x.astype(np.float64) * y.astype(np.float64))).astype(np.float32)
    tiny = (rng.standard_normal(2000) * 1e-9).astype(np.float32)
    for z in (cancel, tiny, (cancel + tiny).astype(np.float32)):
        got = fma_rounded_once(x, y, z)
        want = [
            _float32_nearest(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))) for a, b, c in zip(x, y, z)
        ]
        assert np.array_equal(got, np.array(want, dtype=np.float32))
    x64, y64 = x.astype(np.float64) * (1 + 2.0**-40), y.astype(np.float64)
    z64 = -(x64 * y64)
    assert np.array_equal(
        fma_rounded_once(x64, y64, z64),
        [float(Fraction(a) * Fraction(b) + Fraction(c)) for a, b, c in zip(x64, y64, z64)],
    )
    assert fma_rounded_once(*np.array(PROBE, dtype=np.float32)) == 2.0**-24
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        pytest.skip("the interpreter's own fma: runs where Triton kernels run under the interpreter")
    assert _probe() == 2.0**-24
