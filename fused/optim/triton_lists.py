"""Multi-tensor launches of the Triton optimizer kernels, as csrc/optim/optim_cuda.cpp packs its lists: the tensors
of one call are grouped by their dtypes, and each group is described once in device memory, so one launch covers
the whole group whatever its number of tensors (no kernel-argument limit, no launch per tensor).

A group's table is an int64 [K + 3, n] tensor: rows 0..K-1 the addresses of its tensors in each of the K lists,
then each tensor's element count, its first program and its index in the call (its row of per-tensor tables, its
stochastic-rounding key). Program j of the launch works on tile j - first of tensor `tensor_of[j]` (an int32 map
of every program). Tables and per-tensor hyperparameters are cached by their content (addresses, sizes, dtypes,
values), so a training loop copies them to the device once.

What follows a pass in the CUDA C++ kernels' last block (the norm's finish, advancing the step counters) runs in the
last program of a launch here too (last_program: an integer ticket per device, no float atomics), so a step is its
passes' launches and nothing else."""

import collections
import functools
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
}
CACHE_SIZE = 32
_cache = collections.OrderedDict()  # content key -> (table, tensor_of), most recent last


class Group(NamedTuple):
    dtypes: tuple  # the torch dtype of each list's tensors (None: a list absent from the call)
    indices: list  # the tensors' indices in the call
    table: torch.Tensor  # int64 [K + 3, n] on the device
    tensor_of: torch.Tensor  # int32 [programs] on the device
    programs: int


@triton.jit
def program_tensor(table, tensor_of, n, K: tl.constexpr):
    """tile_tensor of this program's tile (one tile a program)."""
    return tile_tensor(table, tensor_of, n, K, tl.program_id(0))


@triton.jit
def tile_tensor(table, tensor_of, n, K: tl.constexpr, j):
    """(i, tile, numel, t) of the group's tile j: its tensor's column i in the group's table, the tile of that
    tensor, the tensor's element count and its index t in the call (all int64)."""
    i = tl.load(tensor_of + j).to(tl.int64)
    numel = tl.load(table + K * n + i)
    first = tl.load(table + (K + 1) * n + i)
    t = tl.load(table + (K + 2) * n + i)
    return i, j - first, numel, t


@triton.jit
def list_ptr(table, n, i, k: tl.constexpr, DTYPE: tl.constexpr):
    """The address of tensor i in list k of the group, as a pointer to DTYPE."""
    return tl.load(table + k * n + i).to(tl.pointer_type(DTYPE))


@triton.jit
def last_program(ticket_ptr, programs):
    """Whether this program is the last of `programs` (of one or more launches in stream order) to get here, after
    every earlier one's reads and writes; the last one leaves the ticket at 0 for the next launch or graph replay."""
    tl.debug_barrier()  # every thread of this program is done with its loads and stores
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == programs - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def advance_steps(ticket_ptr, table, n, k: tl.constexpr, found_ptr):
    """In the last program of the launch (every program has read its step counter by then): adds 1 to the step
    counter (float32) of every tensor of the group (list k), unless found_inf is set (a skipped step does not
    count). ticket_ptr: step_ticket's."""
    if last_program(ticket_ptr, tl.num_programs(0)) & (tl.load(found_ptr) == 0.0):
        for start in range(0, n, 128):  # a counter a thread: few registers in the kernels that end with it
            j = start + tl.arange(0, 128)
            ptrs = tl.load(table + k * n + j, mask=j < n, other=0).to(tl.pointer_type(tl.float32))
            tl.store(ptrs, tl.load(ptrs, mask=j < n, other=0.0) + 1.0, mask=j < n)


_tickets = {}  # device -> int32 [2]: the norm's ticket and the step counters' (one a kind of launch), zeroed once


def _ticket(device, which):
    """A one-element view of the device's tickets, as the CUDA C++ kernels' workspace: the kernels leave it at 0.
    One optimizer step at a time per device."""
    if device not in _tickets:
        _tickets[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _tickets[device][which : which + 1]


def norm_ticket(device):
    """The ticket of the norm launches (last_program in triton_norm's kernel)."""
    return _ticket(device, 0)


def step_ticket(device):
    """The ticket of the launches that advance step counters (advance_steps)."""
    return _ticket(device, 1)


STRIDE_PROGRAMS_PER_SM = 8  # a grid-stride launch on a GPU: as the CUDA C++ kernels' grid
STRIDE_PROGRAMS_INTERPRETED = 2  # under the interpreter: few, so that the tests take the stride loop


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def stride_programs(tiles, device):
    """The programs of a grid-stride launch over `tiles` tiles (each program takes tiles pid, pid + programs, ...)."""
    cap = STRIDE_PROGRAMS_INTERPRETED if device.type == "cpu" else STRIDE_PROGRAMS_PER_SM * _sm_count(device.index)
    return min(tiles, cap)


def _to_device(host, device):
    if device.type == "cpu":
        return host
    # from pinned memory: an asynchronous copy on the current stream, no host sync
    return host.pin_memory().to(device, non_blocking=True)


def _describe(lists, indices, block, device):
    """The table and program map of the tensors `indices` of `lists` (K lists, None entries: list 0's tensor, a
    stand-in never read)."""
    n = len(indices)
    numel = [lists[0][t].numel() for t in indices]
    tiles = [triton.cdiv(x, block) for x in numel]
    first = [0, *itertools.accumulate(tiles)][:n]
    rows = [[(lst[t] if lst is not None else lists[0][t]).data_ptr() for t in indices] for lst in lists] + [
        numel,
        first,
        list(indices),
    ]
    table = torch.tensor(rows, dtype=torch.int64)
    tensor_of = torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(tiles))
    return _to_device(table, device), _to_device(tensor_of, device), sum(tiles)


def groups(lists, block, keep_empty=False):
    """The launches of K parallel lists of tensors (a list may be None: absent), `block` elements a program: one
    Group per combination of dtypes, in the order of first appearance. Tensors with no elements take no program
    (keep_empty: they stay in their group's table, for what its last program does for every tensor)."""
    device = lists[0][0].device
    by_key = {}
    for t, p in enumerate(lists[0]):
        if p.numel() == 0 and not keep_empty:
            continue
        by_key.setdefault(tuple(lst[t].dtype if lst is not None else None for lst in lists), []).append(t)
    out = []
    for key, indices in by_key.items():
        content = (device, block, key, tuple(indices)) + tuple(
            (lst[t].data_ptr(), lst[t].numel()) for lst in lists if lst is not None for t in indices
        )
        table, tensor_of, programs = _cached(content, lambda: _describe(lists, indices, block, device))
        out.append(Group(key, indices, table, tensor_of, programs))
    return out


def _cached(content, make):
    """make()'s result, kept under its content key (most recently used last, CACHE_SIZE at most)."""
    if content in _cache:
        _cache.move_to_end(content)
    else:
        _cache[content] = make()
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return _cache[content]


def tl_dtype(dtype, default):
    """Triton's dtype of a list's tensors (default: the stand-in's, for an absent list)."""
    return TL_DTYPES[dtype if dtype is not None else default]


def per_tensor(rows, device):
    """Per-tensor float64 rows (hyperparameters of several param groups) as a [n, width] device tensor, cached by
    content as the tables are: a training loop copies them once, and a step captured in a CUDA graph copies nothing
    from the host (a pinned copy cannot be captured)."""
    host = torch.tensor(rows, dtype=torch.float64)
    content = ("rows", device, tuple(host.shape), host.numpy().tobytes())  # the bits: -0.0 is not 0.0, NaN is NaN
    return _cached(content, lambda: _to_device(host, device))
