"""Triton kernel of fused::accumulate_grads_: accs += grads (accs = grads when overwrite), float32 accumulators
(float64 for float64 gradients), one launch per combination of dtypes (fused/optim/triton_lists.py); the CPU
kernel's one rounded add, so its bits."""

import torch
import triton
import triton.language as tl

from fused.optim.triton_lists import TL_DTYPES, groups, list_ptr, program_tensor
from fused.triton_utils import BLOCK, KEEP_SUBNORMALS


@triton.jit
def _accumulate_kernel(table, tensor_of, n, A: tl.constexpr, G: tl.constexpr, OVERWRITE: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    i, tile, numel, _ = program_tensor(table, tensor_of, n, 2)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a_ptr = list_ptr(table, n, i, 0, A)
    g = tl.load(list_ptr(table, n, i, 1, G) + offs, mask=mask, other=0.0).to(A)
    if not OVERWRITE:
        g = tl.load(a_ptr + offs, mask=mask, other=0.0) + g
    tl.store(a_ptr + offs, g, mask=mask)


def accumulate_grads_(accs, grads, overwrite):
    """fused::accumulate_grads_ on Triton; the CPU kernel's checks of the lists are not repeated here (the
    optimizers build them)."""
    if not accs:
        return
    with torch.cuda.device_of(accs[0]):
        for grp in groups([accs, grads], BLOCK):
            a_t, g_t = grp.dtypes
            _accumulate_kernel[(grp.programs,)](
                grp.table, grp.tensor_of, len(grp.indices), A=TL_DTYPES[a_t], G=TL_DTYPES[g_t],
                OVERWRITE=bool(overwrite), BLOCK=BLOCK, **KEEP_SUBNORMALS
            )  # fmt: skip
