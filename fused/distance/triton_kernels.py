"""Triton kernels of the distance family and their launchers (the op's own arguments; CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1).

- direct tiles for every p: BN x BM distances accumulated over D, math in float32 (float64 for float64);
- p = 2 with D >= 32 (not float64): a tensor-core tile (tl.dot, tf32x3 for float32) with the squared norms added
  in the epilogue, clamped at 0, and any tile holding a small (cancellation-prone), inf or NaN entry recomputed
  directly;
- pairwise_topk and radius_neighbors: one program per BN rows sweeps all of b keeping a running k-best per row
  in registers (ties to the lower index, NaN ranked as torch.topk ranks it; radius_neighbors takes only
  candidates within the radius): memory O(N k), never the N x M matrix;
- padded batches: each batch's valid row counts bound the loops and masks; padded pairs give 0 (distances) or no
  candidate (selection);
- backward: a direct [BR, BC, BD] tile kernel, called once for grad_a and once (with grad and dist read
  transposed through their strides) for grad_b; pairwise_topk's backward sums grad_b over the selected pairs
  sorted by index (a segment sum); fixed-order sums, no atomics.
"""

import math

import torch
import triton
import triton.language as tl

from fused import triton_math as tm
from fused._codes import METRIC_CODES, metric_of
from fused.distance.ops import (
    MATMUL_MIN_D,
    batch_shape,
    check_k,
    check_length_values,
    check_lengths,
    check_p,
    check_radius,
)
from fused.distance.reference import select_sorted
from fused.triton_utils import KEEP_SUBNORMALS, on_device_of, program_2d, to_out

# The metric codes of csrc/common/op_codes.h (host code gets them from fused._codes.metric_of).
P0, P1, P2, PINF, PGEN = (tl.constexpr(METRIC_CODES[name]) for name in ("P0", "P1", "P2", "PInf", "PGen"))
RECOMPUTE = tl.constexpr(1.0 / 16)  # d^2 below this fraction of |a|^2 + |b|^2 is recomputed directly
MAX_TOPK_REGISTERS = 256  # k above this: row chunks of the all-pairs kernel + a stable sort


def use_matmul(metric, d, dtype):
    return bool(metric == P2) and d >= MATMUL_MIN_D and dtype != torch.float64


def _p_const(metric, p):
    """p as a compile-time constant (exact in float64 math; Triton passes float arguments as float32), used by
    the general-p kernels only: the others get 1.0 and share one compiled kernel."""
    return float(p) if metric == PGEN else 1.0


def _acc_type(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check(op, a, b, p, squared):
    check_p(op, p, squared)
    return batch_shape(op, a, b)


def _flatten(a, b, batch):
    n, m, d = a.shape[-2], b.shape[-2], a.shape[-1]
    bsz = math.prod(batch)
    a3 = a.expand(*batch, n, d).reshape(bsz, n, d).contiguous()
    b3 = b.expand(*batch, m, d).reshape(bsz, m, d).contiguous()
    return a3, b3, bsz, n, m, d


def _lengths(op, name, lengths, t_name, t, batch, rows, placeholder):
    """(lengths broadcast to the batch and flattened [B], True) for the kernels, checked; (placeholder, False)
    when not given."""
    if lengths is None:
        return placeholder, False
    check_lengths(op, name, lengths, t_name, t)
    check_length_values(op, name, lengths, rows)
    return lengths.expand(batch).reshape(-1).contiguous(), True


def _both_lengths(op, a, b, batch, lengths_a, lengths_b, placeholder):
    return (
        *_lengths(op, "lengths_a", lengths_a, "a", a, batch, a.shape[-2], placeholder),
        *_lengths(op, "lengths_b", lengths_b, "b", b, batch, b.shape[-2], placeholder),
    )


def _center(b3, dtype, lb=None):
    """The mean of b's valid rows per batch (float32) for float32 inputs: distances are translation invariant,
    and centered points keep |a|^2 + |b|^2 - 2 a.b small. 16-bit inputs stay uncentered (centering would round
    them)."""
    if dtype != torch.float32 or b3.shape[1] == 0:
        return torch.zeros(b3.shape[0], b3.shape[2], device=b3.device, dtype=torch.float32), False
    if lb is None:
        c = b3.float().mean(1)
    else:
        valid = torch.arange(b3.shape[1], device=b3.device) < lb[:, None]
        c = torch.where(valid[..., None], b3.float(), 0.0).sum(1) / lb.clamp(min=1)[:, None]
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c)), True


@triton.jit
def _valid_rows(lengths_ptr, bi, rows, GIVEN: tl.constexpr):
    """The valid row count of batch bi: lengths[bi], or every row."""
    if GIVEN:
        rows = tl.load(lengths_ptr + bi).to(tl.int32)
    return rows


# ---- shared tile code ----
@triton.jit
def _pow_p(x, p: tl.constexpr):
    """x ** p for the general metric's constant p: the elementwise kernels' pow (libdevice's on a GPU, as
    torch.cdist's; tl.exp2 / tl.log2 are the approximate instructions), with p in x's type."""
    return tm.pow(x, tl.zeros_like(x) + p)


@triton.jit
def _accumulate(acc, diff, p: tl.constexpr, METRIC: tl.constexpr):
    if METRIC == P0:
        acc += tl.minimum(tl.ceil(tl.abs(diff)), 1.0, propagate_nan=tl.PropagateNan.ALL)
    elif METRIC == P1:
        acc += tl.abs(diff)
    elif METRIC == P2:
        acc = tl.fma(diff, diff, acc)  # explicit, as the C++ kernels' (Triton may not contract a * b + c)
    elif METRIC == PINF:
        acc = tl.maximum(acc, tl.abs(diff), propagate_nan=tl.PropagateNan.ALL)
    else:
        acc += _pow_p(tl.abs(diff), p)
    return acc


@triton.jit
def _finish(acc, inv_p: tl.constexpr, METRIC: tl.constexpr, SQUARED: tl.constexpr):
    if METRIC == P2:
        if not SQUARED:
            acc = tm.sqrt(acc)  # correctly rounded, as the C++ kernels (tl.sqrt is sqrt.approx.ftz on a GPU)
    elif METRIC == PGEN:
        acc = _pow_p(acc, inv_p)
    return acc


@triton.jit
def _direct_tile(
    a_rows,
    b_rows,
    mask_n,
    mask_m,
    D,
    p: tl.constexpr,
    METRIC: tl.constexpr,
    ACC: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
):
    """sum_d |a - b|^p (or the max) for BN rows of a (pointers a_rows) against BM rows of b."""
    acc = tl.zeros((BN, BM), dtype=ACC)
    for d in range(0, D):
        av = tl.load(a_rows + d, mask=mask_n, other=0.0).to(ACC)
        bv = tl.load(b_rows + d, mask=mask_m, other=0.0).to(ACC)
        acc = _accumulate(acc, av[:, None] - bv[None, :], p, METRIC)
    return acc


@triton.jit
def _matmul_tile(
    a_rows,
    b_rows,
    center,
    mask_n,
    mask_m,
    D,
    CENTER: tl.constexpr,
    PREC: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Squared distances |a|^2 + |b|^2 - 2 a.b on tensor cores, clamped at 0; a tile with a small, inf or NaN
    entry is recomputed directly (exact zeros at duplicates, no cancellation)."""
    dot = tl.zeros((BN, BM), dtype=tl.float32)
    na = tl.zeros((BN,), dtype=tl.float32)
    nb = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, D, BK):
        rk = k0 + tl.arange(0, BK)
        mask_k = rk < D
        at = tl.load(a_rows[:, None] + rk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        bt = tl.load(b_rows[:, None] + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if CENTER:
            c = tl.load(center + rk, mask=mask_k, other=0.0)
            at = tl.where(mask_n[:, None] & mask_k[None, :], at - c[None, :], 0.0)
            bt = tl.where(mask_m[:, None] & mask_k[None, :], bt - c[None, :], 0.0)
        af = at.to(tl.float32)
        bf = bt.to(tl.float32)
        na += tl.sum(af * af, 1)
        nb += tl.sum(bf * bf, 1)
        dot = tl.dot(at, tl.trans(bt), dot, input_precision=PREC)
    s = na[:, None] + nb[None, :]
    d2 = s - 2.0 * dot
    redo = (d2 <= s * RECOMPUTE) | (d2 != d2) | (tl.abs(d2) == float("inf"))
    redo = redo & mask_n[:, None] & mask_m[None, :]
    if tl.max(redo.to(tl.int32)) > 0:
        exact = _direct_tile(a_rows, b_rows, mask_n, mask_m, D, 2.0, P2, tl.float32, BN, BM)
        d2 = tl.where(redo, exact, d2)
    return tl.where(d2 < 0.0, 0.0, d2)


# ---- pairwise_distances ----
@triton.jit
def _distances_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    la_ptr,
    lb_ptr,
    out_ptr,
    N,
    M,
    D,
    P: tl.constexpr,
    METRIC: tl.constexpr,
    SQUARED: tl.constexpr,
    MATMUL: tl.constexpr,
    CENTER: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
    HAS_LA: tl.constexpr,
    HAS_LB: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    n_tiles, m_tiles = tl.cdiv(N, BN), tl.cdiv(M, BM)
    bi, tile = program_2d(n_tiles * m_tiles)
    bi = bi.to(tl.int64)
    rn = (tile // m_tiles) * BN + tl.arange(0, BN)
    rm = (tile % m_tiles) * BM + tl.arange(0, BM)
    mask_n = rn < _valid_rows(la_ptr, bi, N, HAS_LA)
    mask_m = rm < _valid_rows(lb_ptr, bi, M, HAS_LB)
    a_rows = a_ptr + bi * N * D + rn.to(tl.int64) * D
    b_rows = b_ptr + bi * M * D + rm.to(tl.int64) * D
    if MATMUL:
        acc = _matmul_tile(a_rows, b_rows, c_ptr + bi * D, mask_n, mask_m, D, CENTER, PREC, BN, BM, BK)
    else:
        acc = _direct_tile(a_rows, b_rows, mask_n, mask_m, D, P, METRIC, ACC, BN, BM)
    out = tl.where(mask_n[:, None] & mask_m[None, :], _finish(acc, 1.0 / P, METRIC, SQUARED), 0.0)  # padded: 0
    offs = bi * N * M + rn.to(tl.int64)[:, None] * M + rm[None, :]
    tl.store(out_ptr + offs, to_out(out, out_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rm < M)[None, :])


DIRECT_TILE = (32, 64, 16)  # BN, BM, BK of the distances kernel on the direct path
MATMUL_TILE = (64, 64, 32)  # and on the tensor-core path


@on_device_of
def pairwise_distances(a, b, p=2.0, squared=False, lengths_a=None, lengths_b=None):
    op = "pairwise_distances"
    batch = _check(op, a, b, p, squared)
    a3, b3, bsz, n, m, d = _flatten(a, b, batch)
    la, has_la, lb, has_lb = _both_lengths(op, a, b, batch, lengths_a, lengths_b, a3)
    out = torch.empty(*batch, n, m, device=a.device, dtype=a.dtype)
    if out.numel() == 0:
        return out
    metric = metric_of(p)
    matmul = use_matmul(metric, d, a.dtype)
    center, centered = _center(b3, a.dtype, lb if has_lb else None)
    bn, bm, bk = MATMUL_TILE if matmul else DIRECT_TILE
    grid = (bsz * triton.cdiv(n, bn) * triton.cdiv(m, bm),)
    _distances_kernel[grid](
        a3,
        b3,
        center,
        la,
        lb,
        out,
        n,
        m,
        d,
        _p_const(metric, p),
        metric,
        squared,
        matmul,
        centered,
        "tf32x3" if a.dtype == torch.float32 else "tf32",
        _acc_type(a.dtype),
        has_la,
        has_lb,
        bn,
        bm,
        bk,
        **KEEP_SUBNORMALS,
    )
    return out


# ---- pairwise_topk ----
@triton.jit
def _lex_min(n, k, i, BIG_I: tl.constexpr):
    """Row-wise lexicographic minimum of (n, k, i)."""
    nm = tl.min(n, 1)
    km = tl.min(tl.where(n == nm[:, None], k, float("inf")), 1)
    im = tl.min(tl.where((n == nm[:, None]) & (k == km[:, None]), i, BIG_I), 1)
    return nm, km, im


@triton.jit
def _lex_max(n, k, i):
    nm = tl.max(n, 1)
    km = tl.max(tl.where(n == nm[:, None], k, -float("inf")), 1)
    im = tl.max(tl.where((n == nm[:, None]) & (k == km[:, None]), i, -1), 1)
    return nm, km, im


@triton.jit
def _topk_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    la_ptr,
    lb_ptr,
    bound_ptr,
    val_ptr,
    idx_ptr,
    N,
    M,
    D,
    K,
    WIDTH,
    P: tl.constexpr,
    METRIC: tl.constexpr,
    SQUARED: tl.constexpr,
    LARGEST: tl.constexpr,
    MATMUL: tl.constexpr,
    CENTER: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
    HAS_LA: tl.constexpr,
    HAS_LB: tl.constexpr,
    WITHIN: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    KP: tl.constexpr,
):
    """The K best valid rows of b for each row of a, written sorted into WIDTH >= K slots per row; slots without
    a candidate (and padded rows of a) get index -1 and value inf (-inf when largest). WITHIN: only candidates
    with a value <= bound_ptr[0] (in the math type), NaN never."""
    # Selection keys, smaller is better: (flag, +-value, index), flag 0 or 1 for numbers and NaN. Slots at or
    # past K hold flag -1 (never the worst, never taken out); empty slots hold flag 2 (worse than any candidate);
    # flag 3 marks a candidate that is out (masked, taken, or outside the radius).
    BIG_I: tl.constexpr = 2**31 - 1
    NAN_FLAG: tl.constexpr = 0 if LARGEST else 1  # torch.topk: NaN is the largest value
    bi, tile = program_2d(tl.cdiv(N, BN))
    bi = bi.to(tl.int64)
    rn = tile * BN + tl.arange(0, BN)
    mask_n = rn < _valid_rows(la_ptr, bi, N, HAS_LA)
    m_valid = _valid_rows(lb_ptr, bi, M, HAS_LB)
    a_rows = a_ptr + bi * N * D + rn.to(tl.int64) * D
    slot = tl.arange(0, KP)
    zero = tl.zeros((BN, KP), dtype=tl.int32)
    best_n = tl.where(slot[None, :] < K, 2, -1) + zero
    best_k = tl.zeros((BN, KP), dtype=ACC)
    best_i = zero + BIG_I
    for m0 in range(0, m_valid, BM):
        rm = m0 + tl.arange(0, BM)
        mask_m = rm < m_valid
        b_rows = b_ptr + bi * M * D + rm.to(tl.int64) * D
        if MATMUL:
            acc = _matmul_tile(a_rows, b_rows, c_ptr + bi * D, mask_n, mask_m, D, CENTER, PREC, BN, BM, BK)
        else:
            acc = _direct_tile(a_rows, b_rows, mask_n, mask_m, D, P, METRIC, ACC, BN, BM)
        v = to_out(_finish(acc, 1.0 / P, METRIC, SQUARED), val_ptr.dtype.element_ty).to(ACC)  # output's ties
        cand_n = tl.where(v != v, NAN_FLAG, 1 - NAN_FLAG)
        live = mask_n[:, None] & mask_m[None, :]
        if WITHIN:
            live = live & (v <= tl.load(bound_ptr))
        cand_n = tl.where(live, cand_n, 3)
        if LARGEST:
            cand_k = tl.where(v != v, 0.0, -v)
        else:
            cand_k = tl.where(v != v, 0.0, v)
        cand_i = rm[None, :] + tl.zeros((BN, BM), dtype=tl.int32)
        more = tl.program_id(0) * 0 + 1  # an int32 tensor, like the tl.sum that replaces it in the loop
        while more > 0:
            cn, ck, ci = _lex_min(cand_n, cand_k, cand_i, BIG_I)
            wn, wk, wi = _lex_max(best_n, best_k, best_i)
            better = (cn < 3) & ((cn < wn) | ((cn == wn) & ((ck < wk) | ((ck == wk) & (ci < wi)))))
            pos = tl.min(
                tl.where(
                    (best_n == wn[:, None]) & (best_k == wk[:, None]) & (best_i == wi[:, None]), slot[None, :], KP
                ),
                1,
            )
            put = better[:, None] & (slot[None, :] == pos[:, None])
            best_n = tl.where(put, cn[:, None], best_n)
            best_k = tl.where(put, ck[:, None], best_k)
            best_i = tl.where(put, ci[:, None], best_i)
            # The taken candidate leaves; a row with no better candidate is done with this tile.
            gone = (better[:, None] & (cand_i == ci[:, None])) | (~better[:, None])
            cand_n = tl.where(gone, 3, cand_n)
            more = tl.sum(better.to(tl.int32))
    # Sorted output: take the best remaining slot WIDTH times; an empty (2) or used-up (4) slot is missing.
    best_n = tl.where(slot[None, :] < K, best_n, 4)
    out_rows = bi * N * WIDTH + rn.to(tl.int64) * WIDTH
    for t in range(0, WIDTH):
        n, k, i = _lex_min(best_n, best_k, best_i, BIG_I)
        if LARGEST:
            val = tl.where(n == NAN_FLAG, float("nan"), tl.where(n >= 2, -float("inf"), -k))
        else:
            val = tl.where(n == NAN_FLAG, float("nan"), tl.where(n >= 2, float("inf"), k))
        idx = tl.where(n >= 2, -1, i.to(tl.int64))
        tl.store(val_ptr + out_rows + t, to_out(val, val_ptr.dtype.element_ty), mask=rn < N)
        tl.store(idx_ptr + out_rows + t, idx, mask=rn < N)
        best_n = tl.where((best_n == n[:, None]) & (best_k == k[:, None]) & (best_i == i[:, None]), 4, best_n)


def _select(op, a, b, width, p, squared, largest, radius, lengths_a, lengths_b):
    """pairwise_topk and radius_neighbors (radius: not None): the running k-best kernel, or for more than
    MAX_TOPK_REGISTERS candidates per row, _select_by_chunks."""
    batch = batch_shape(op, a, b)
    a3, b3, bsz, n, m, d = _flatten(a, b, batch)
    la, has_la, lb, has_lb = _both_lengths(op, a, b, batch, lengths_a, lengths_b, a3)
    values = torch.empty(*batch, n, width, device=a.device, dtype=a.dtype)
    indices = torch.empty(*batch, n, width, device=a.device, dtype=torch.int64)
    if values.numel() == 0:
        return values, indices
    keep = max(1, min(width, m))  # candidates per row
    bound = None if radius is None else _radius_bound(radius, a.dtype, a.device)
    if triton.next_power_of_2(keep) > MAX_TOPK_REGISTERS:
        return _select_by_chunks(
            a3, b3, width, p, squared, largest, bound, la if has_la else None, lb if has_lb else None, values, indices
        )
    metric = metric_of(p)
    matmul = use_matmul(metric, d, a.dtype)
    center, centered = _center(b3, a.dtype, lb if has_lb else None)
    bn, bm, bk = (32, 64, 32) if matmul else (32, 64, 16)
    grid = (bsz * triton.cdiv(n, bn),)
    _topk_kernel[grid](
        a3,
        b3,
        center,
        la,
        lb,
        a3 if bound is None else bound,
        values,
        indices,
        n,
        m,
        d,
        keep,
        width,
        _p_const(metric, p),
        metric,
        squared,
        largest,
        matmul,
        centered,
        "tf32x3" if a.dtype == torch.float32 else "tf32",
        _acc_type(a.dtype),
        has_la,
        has_lb,
        bound is not None,
        bn,
        bm,
        bk,
        triton.next_power_of_2(keep),
        **KEEP_SUBNORMALS,
    )
    return values, indices


def _radius_bound(radius, dtype, device):
    """The radius in the math type, rounded down (values are compared in it: v <= radius exactly)."""
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    r = torch.tensor(radius, dtype=math_dtype)
    if r.double() > radius:
        r = torch.nextafter(r, torch.tensor(-math.inf, dtype=math_dtype))
    return r.reshape(1).to(device)


@on_device_of
def pairwise_topk(a, b, k, p=2.0, squared=False, largest=False, lengths_a=None, lengths_b=None):
    check_p("pairwise_topk", p, squared)
    batch_shape("pairwise_topk", a, b)
    check_k("pairwise_topk", k, b.shape[-2])
    return _select("pairwise_topk", a, b, k, p, squared, largest, None, lengths_a, lengths_b)


@on_device_of
def radius_neighbors(a, b, radius, max_neighbors, lengths_a=None, lengths_b=None, p=2.0):
    check_p("radius_neighbors", p, False)
    check_radius("radius_neighbors", radius, max_neighbors)
    return _select("radius_neighbors", a, b, max_neighbors, p, False, False, radius, lengths_a, lengths_b)


SELECT_CHUNK = 2**24  # distances per chunk of _select_by_chunks (with their int64 sort indices: ~200 MB)


def _select_by_chunks(a3, b3, width, p, squared, largest, bound, la, lb, values, indices):
    """Many candidates per row: distances for a few rows at a time (O(rows x M) memory), then a stable sort
    (select_sorted: torch.topk's order, ties to the lower index)."""
    bsz, n, m = a3.shape[0], a3.shape[1], b3.shape[1]
    rows = max(1, SELECT_CHUNK // max(bsz * m, 1))  # rows of a per chunk, over the whole batch
    v3, i3 = values.view(bsz, n, width), indices.view(bsz, n, width)
    cols = torch.arange(m, device=a3.device)
    for r0 in range(0, n, rows):
        d = pairwise_distances(a3[:, r0 : r0 + rows], b3, p, squared)
        valid = torch.ones_like(d, dtype=torch.bool)
        if la is not None:
            valid &= (torch.arange(r0, r0 + d.shape[1], device=a3.device) < la[:, None])[..., None]
        if lb is not None:
            valid &= (cols < lb[:, None])[:, None, :]
        if bound is not None:
            valid &= d.to(bound.dtype) <= bound
        v3[:, r0 : r0 + rows], i3[:, r0 : r0 + rows] = select_sorted(d, valid, width, largest)
    return values, indices


# ---- backward ----
@triton.jit
def _weight(g, dist, p: tl.constexpr, METRIC: tl.constexpr, SQUARED: tl.constexpr):
    if METRIC == P2:
        if SQUARED:
            w = 2.0 * g
        else:
            w = tl.where(dist == 0.0, 0.0, tm.div(g, dist))
    elif METRIC == PGEN:
        w = tl.where(dist == 0.0, 0.0, tm.div(g, _pow_p(dist, p - 1.0)))
    else:
        w = g
    return w


@triton.jit
def _grad_term(diff, w, dist, p: tl.constexpr, METRIC: tl.constexpr):
    sign = tl.where(diff > 0.0, 1.0, 0.0) - tl.where(diff < 0.0, 1.0, 0.0)
    if METRIC == P2:
        t = diff * w
    elif METRIC == P1:
        t = w * sign
    elif METRIC == PINF:
        t = tl.where(tl.abs(diff) == dist, w * sign, 0.0)
    else:
        t = tl.where(diff == 0.0, 0.0, w * sign * _pow_p(tl.abs(diff), p - 1.0))
    return t


@triton.jit
def _grad_kernel(
    x_ptr,
    y_ptr,
    g_ptr,
    dist_ptr,
    lr_ptr,
    lc_ptr,
    out_ptr,
    R,
    C,
    D,
    s_r,
    s_c,
    P: tl.constexpr,
    METRIC: tl.constexpr,
    SQUARED: tl.constexpr,
    ACC: tl.constexpr,
    HAS_LR: tl.constexpr,
    HAS_LC: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    """out[r] = sum_c w[r, c] phi(x[r] - y[c]) over the valid pairs (0 for a padded row r); grad and dist of pair
    (r, c) at r * s_r + c * s_c."""
    r_tiles, d_tiles = tl.cdiv(R, BR), tl.cdiv(D, BD)
    bi, tile = program_2d(r_tiles * d_tiles)
    bi = bi.to(tl.int64)
    rr = (tile // d_tiles) * BR + tl.arange(0, BR)
    rd = (tile % d_tiles) * BD + tl.arange(0, BD)
    mask_r, mask_d = rr < _valid_rows(lr_ptr, bi, R, HAS_LR), rd < D
    c_valid = _valid_rows(lc_ptr, bi, C, HAS_LC)
    x = tl.load(
        x_ptr + bi * R * D + rr.to(tl.int64)[:, None] * D + rd[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    ).to(ACC)
    acc = tl.zeros((BR, BD), dtype=ACC)
    for c0 in range(0, c_valid, BC):
        rc = c0 + tl.arange(0, BC)
        mask_c = rc < c_valid
        pair = mask_r[:, None] & mask_c[None, :]
        offs = bi * R * C + rr.to(tl.int64)[:, None] * s_r + rc.to(tl.int64)[None, :] * s_c
        g = tl.load(g_ptr + offs, mask=pair, other=0.0).to(ACC)
        dist = tl.load(dist_ptr + offs, mask=pair, other=0.0).to(ACC)
        w = _weight(g, dist, P, METRIC, SQUARED)
        y = tl.load(
            y_ptr + bi * C * D + rc.to(tl.int64)[:, None] * D + rd[None, :],
            mask=mask_c[:, None] & mask_d[None, :],
            other=0.0,
        ).to(ACC)
        diff = x[:, None, :] - y[None, :, :]
        t = _grad_term(diff, w[:, :, None], dist[:, :, None], P, METRIC)
        acc += tl.sum(tl.where(pair[:, :, None], t, 0.0), 1)
    tl.store(
        out_ptr + bi * R * D + rr.to(tl.int64)[:, None] * D + rd[None, :], acc, mask=(rr < R)[:, None] & mask_d[None, :]
    )


def _reduce_to(g, batch, rows, like):
    return g.view(*batch, rows, like.shape[-1]).sum_to_size(like.shape).to(like.dtype)


@on_device_of
def pairwise_distances_backward(grad, a, b, dist, p, squared, lengths_a=None, lengths_b=None):
    op = "pairwise_distances_backward"
    batch = _check(op, a, b, p, squared)
    a3, b3, bsz, n, m, d = _flatten(a, b, batch)
    la, has_la, lb, has_lb = _both_lengths(op, a, b, batch, lengths_a, lengths_b, a3)
    metric = metric_of(p)
    if metric == P0 or bsz * n * m * d == 0:
        return torch.zeros_like(a, memory_format=torch.contiguous_format), torch.zeros_like(
            b, memory_format=torch.contiguous_format
        )
    g3 = grad.reshape(bsz, n, m).contiguous()
    dist3 = dist.reshape(bsz, n, m).contiguous()
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    ga = torch.empty(bsz, n, d, device=a.device, dtype=acc)
    gb = torch.empty(bsz, m, d, device=a.device, dtype=acc)
    br, bc, bd = 16, 32, min(16, triton.next_power_of_2(d))
    args = (_p_const(metric, p), metric, squared, _acc_type(a.dtype))
    _grad_kernel[(bsz * triton.cdiv(n, br) * triton.cdiv(d, bd),)](
        a3, b3, g3, dist3, la, lb, ga, n, m, d, m, 1, *args, has_la, has_lb, br, bc, bd, **KEEP_SUBNORMALS
    )
    # grad_b = sum_i w phi(b_j - a_i): phi is odd, so the same kernel with grad and dist read transposed.
    _grad_kernel[(bsz * triton.cdiv(m, br) * triton.cdiv(d, bd),)](
        b3, a3, g3, dist3, lb, la, gb, m, n, d, 1, m, *args, has_lb, has_la, br, bc, bd, **KEEP_SUBNORMALS
    )
    return _reduce_to(ga, batch, n, a), _reduce_to(gb, batch, m, b)


@on_device_of
def pairwise_topk_backward(grad, a, b, values, indices, p, squared):
    """Gradient through the k selected pairs only (O(N k D) memory; index -1: no pair): gather the selected rows
    of b, form each pair's term (torch ops), sum it over k into grad_a, and into grad_b with _segment_sum_kernel
    over the pairs stably sorted by their point of b: a fixed order, no atomics, so the result is
    deterministic."""
    batch = _check("pairwise_topk_backward", a, b, p, squared)
    a3, b3, bsz, n, m, d = _flatten(a, b, batch)
    metric = metric_of(p)
    k = values.shape[-1]
    if metric == P0 or bsz * n * m * k * d == 0:  # (m = 0: every index is -1, no pair)
        return torch.zeros_like(a, memory_format=torch.contiguous_format), torch.zeros_like(
            b, memory_format=torch.contiguous_format
        )
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    a3, b3 = a3.to(acc), b3.to(acc)
    idx = indices.reshape(bsz, n, k)
    missing = idx < 0
    idx = torch.where(missing, 0, idx)
    g = torch.where(missing, 0.0, grad.reshape(bsz, n, k).to(acc))
    v = values.reshape(bsz, n, k).to(acc)
    chosen = torch.gather(b3, 1, idx.reshape(bsz, n * k, 1).expand(-1, -1, d)).view(bsz, n, k, d)
    diff = a3[:, :, None, :] - chosen
    zero = torch.zeros((), dtype=acc, device=a.device)
    if metric == P2:
        w = 2 * g if squared else torch.where(v == 0, zero, g / v)
        term = diff * w[..., None]
    elif metric == P1:
        term = g[..., None] * diff.sign()
    elif metric == PINF:
        term = torch.where(diff.abs() == v[..., None], g[..., None] * diff.sign(), zero)
    else:
        w = torch.where(v == 0, zero, g / v.pow(p - 1))
        term = torch.where(diff == 0, zero, w[..., None] * diff.sign() * diff.abs().pow(p - 1))
    term = torch.where(missing[..., None], zero, term)
    ga = term.sum(2)
    gb = torch.zeros(bsz * m, d, device=a.device, dtype=acc)
    flat = torch.where(missing, bsz * m, idx + torch.arange(bsz, device=a.device).view(bsz, 1, 1) * m).reshape(-1)
    keys, order = torch.sort(flat, stable=True)
    keys = torch.cat([keys, keys.new_full((1,), -1)])  # a sentinel ends the last run
    pairs, bd = flat.numel(), min(64, triton.next_power_of_2(d))
    _segment_sum_kernel[(pairs, triton.cdiv(d, bd))](
        term.reshape(pairs, d).contiguous(), order, keys, gb, bsz * m, d, _acc_type(a.dtype), bd, **KEEP_SUBNORMALS
    )
    return _reduce_to(ga, batch, n, a), _reduce_to(gb, batch, m, b)


@triton.jit
def _segment_sum_kernel(term_ptr, order_ptr, key_ptr, out_ptr, points, D, ACC: tl.constexpr, BD: tl.constexpr):
    """out[key] = -sum of term[order[e]] over the run of sorted pairs e with that key (a flat point of b), added
    in sorted order by the program at the run's first pair; the other programs have nothing to do, nor has the
    run of missing pairs (key = points, last: it may hold most pairs, which one program would walk serially)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = cols < D
    key = tl.load(key_ptr + e)
    prev = tl.load(key_ptr + e - 1, mask=e > 0, other=-1)
    if (key != prev) & (key < points):
        acc = tl.zeros([BD], dtype=ACC)
        while tl.load(key_ptr + e) == key:
            src = tl.load(order_ptr + e).to(tl.int64)
            acc -= tl.load(term_ptr + src * D + cols, mask=mask, other=0.0)
            e += 1
        tl.store(out_ptr + key * D + cols, acc, mask=mask)
