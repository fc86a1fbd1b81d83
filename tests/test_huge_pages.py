"""Outputs of 32 MiB and more are advised onto transparent huge pages before the kernels write them
(csrc/common/huge_pages.h, fused/_memory.py): the VMA holding such an output carries the kernel's `hg` flag
(MADV_HUGEPAGE) in /proc/self/smaps, smaller outputs and FUSED_HUGE_PAGES=0 leave memory as it was."""

import ctypes
import mmap
import os
import subprocess
import sys

import pytest
import torch

import fused

MIB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds address."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def madvise_shows():
    """Whether this process's kernel takes MADV_HUGEPAGE and shows it (the `hg` flag) on an anonymous mapping of its
    own: not on non-Linux systems, kernels without THP, or processes with THP disabled (PR_SET_THP_DISABLE)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"):
        return False
    region = mmap.mmap(-1, 8 * MIB)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        return "hg" in vm_flags(address + 4 * MIB)
    except OSError:
        return False
    finally:
        region.close()


pytestmark = pytest.mark.skipif(not madvise_shows(), reason="MADV_HUGEPAGE not taken or not shown here")


def advised(t):
    """Whether the middle of t's memory (inside its whole 2 MB pages) is advised MADV_HUGEPAGE."""
    return "hg" in vm_flags(t.data_ptr() + t.numel() * t.element_size() // 2)


def outputs(rows):
    """Each family's output of rows x 1024 float32 (32 MiB at 8192 rows): elementwise, norm, rope, linear, the
    loss's weight gradient (a Python-allocated buffer), and two backward kernels' input gradients."""
    x = torch.randn(rows, 1024)
    q = torch.randn(rows // 512, 16, 128, 256)  # [b, h, s, d]: rows x 1024 floats
    cos = torch.randn(1, 128, 256)
    w = torch.randn(rows, 1024, requires_grad=True)  # a vocabulary of `rows` classes
    fused.linear_cross_entropy(torch.randn(64, 1024), w, torch.randint(rows, (64,))).backward()
    xs = [torch.randn(rows, 1024, requires_grad=True) for _ in range(2)]
    fused.bias_act(xs[0], torch.randn(1024)).backward(x)
    fused.rms_norm(xs[1], (1024,)).backward(x)
    return {
        "unary_chain": fused.unary_chain(x, ["square", "sin"]),
        "rms_norm": fused.rms_norm(x, (1024,)),
        "add_layer_norm sum": fused.add_layer_norm(x, x, (1024,))[1],
        "rope": fused.rope(q, q, cos, cos)[0],
        "linear_act": fused.linear_act(x[:, :64], torch.randn(1024, 64), act="gelu"),
        "linear_cross_entropy grad": w.grad,
        "bias_act grad": xs[0].grad,
        "rms_norm grad": xs[1].grad,
    }


def test_outputs_of_32_mib_are_advised_and_smaller_ones_not():
    """In a fresh process: whether a 16 MiB block lands in memory that an earlier test's allocations left advised
    depends on the heap's history, not on these kernels."""
    code = (
        "import torch, fused; from tests.test_huge_pages import advised, outputs, MIB\n"
        "for name, out in outputs(8192).items():\n"
        "    assert out.numel() * out.element_size() == 32 * MIB, name\n"
        "    assert advised(out), name\n"
        "for name, out in outputs(4096).items():  # 16 MiB: glibc's heap memory, shared with other blocks\n"
        "    assert not advised(out), name\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_fused_huge_pages_0_turns_it_off():
    code = (
        "import torch, fused; from tests.test_huge_pages import advised, outputs; "
        "print(sorted(n for n, o in outputs(8192).items() if advised(o)))"
    )
    for env, expected in (("0", "[]"), ("1", str(sorted(outputs(8192))))):
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, "FUSED_HUGE_PAGES": env}, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expected, (env, run.stdout)
