"""Large CPU buffers that Python code allocates for the kernels to write, advised onto transparent huge pages
(csrc/common/huge_pages.h: a fresh 32 MiB buffer otherwise faults in 8192 pages of 4 KB, each zeroed by the kernel,
which can cost more than the computation that fills it). FUSED_HUGE_PAGES=0 turns it off."""

import torch

from fused._ext import _C


def advised(t):
    """t, its storage advised MADV_HUGEPAGE where it is a CPU tensor with real memory (not fake) of 32 MiB or more
    (the C++ side's threshold); t itself."""
    if type(t) is torch.Tensor and t.device.type == "cpu":
        storage = t.untyped_storage()
        _C.advise_huge_pages(storage.data_ptr(), storage.nbytes())
    return t
