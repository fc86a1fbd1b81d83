"""Index arithmetic of the Triton tile kernels past 2**31 elements, under the interpreter (TRITON_INTERPRET=1 on a
machine without a GPU) where int32 arithmetic wraps as on a GPU. A real 2**31-column tensor (4 GiB of fp16, two
million programs) is out of the interpreter's reach, so a probe kernel starts its block indices near the limit,
computing the row start and the columns exactly as the elementwise tile kernels do."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fused.triton_utils import program_2d, tile_index  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _tile_probe(r_ptr, c_ptr, first_block, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, I64: tl.constexpr):
    row_block, col_block = program_2d(1, I64)
    row_block += first_block  # first_block < 2**31: an int32 argument, as a large grid's program id would be
    col_block += first_block
    r, c, mask = tile_index(row_block * BLOCK_R, col_block, rows, BLOCK_R, cols, BLOCK_C, I64)
    tl.store(r_ptr + tl.arange(0, BLOCK_R)[:, None] + 0 * c, r + 0 * c)
    tl.store(c_ptr + tl.arange(0, BLOCK_C)[None, :] + 0 * r, c + 0 * r)


@pytest.mark.parametrize("block_r, block_c", [(4, 1024), (1024, 4)])
def test_tile_rows_and_columns_do_not_wrap_past_2_31(block_r, block_c):
    first_block = 2**31 // min(block_r, block_c)  # block index x block size = 2**31 exactly
    r = torch.full((block_r,), -1, dtype=torch.int64, device=DEVICE)
    c = torch.full((block_c,), -1, dtype=torch.int64, device=DEVICE)
    huge = 2**33  # rows and cols as a > 2**31-element tensor has them: every probed index is in bounds
    _tile_probe[(1,)](r, c, first_block, huge, huge, BLOCK_R=block_r, BLOCK_C=block_c, I64=True)
    assert r.tolist() == [first_block * block_r + i for i in range(block_r)]
    assert c.tolist() == [first_block * block_c + i for i in range(block_c)]


class GridSpy:
    """Stands in for a @triton.jit kernel: records each launch grid and runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_linear_grad_pre_grid_fits_gpu_limits(monkeypatch):
    """More than 65535 column tiles (over 8M output features): grid axes 1 and 2 must stay within 65535."""
    from fused.linear import triton_kernels as linear_tk

    spy = GridSpy()
    monkeypatch.setattr(linear_tk, "_grad_pre_kernel", spy)
    n = 65536 * 128 + 1
    grad = torch.zeros(2, n, device=DEVICE)
    linear_tk.linear_act_grad_pre(grad, grad, "gelu", True)
    (grid,) = spy.grids
    assert all(axis <= 65535 for axis in grid[1:]) and grid[0] < 2**31, grid
    assert grid[0] * (grid[1] if len(grid) > 1 else 1) >= triton.cdiv(n, 128)  # every column tile launched
