"""Triton AMP helpers: ``unscale_check_`` (unscale grads in place and flag non-finite ones) and
``grad_stats`` (sum of squares, max |g| and a non-finite flag in one read of the grads).

Both walk the same (pointer, numel) table and chunk table as the Adam kernel, one launch per grad dtype.
``grad_stats`` is deterministic: the first pass writes one [sumsq, amax, nonfinite] partial per chunk, the
second pass is a single program that folds the partials in a fixed order; there are no float atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from ._common import (
    FLOAT32_MAX, TL_DTYPE, block_sizes, chunk_of, device_scope, group_by_dtype, ld, round_to, scalar_source,
    scalar_value,
    st, table_ptr, tensor_table,
)

_GRAD_COLS = 2  # data_ptr, numel


def _grad_table(grads, idx, device, chunk):
    return tensor_table("grads", device, chunk, idx, lambda i: (grads[i].data_ptr(), grads[i].numel()), _GRAD_COLS)


@triton.jit
def _chunk_start(rows, chunks, CHUNK: tl.constexpr, G_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    pid, t, start = chunk_of(chunks, CHUNK)
    g_ptr = table_ptr(rows + 2 * t, 0, G_DTYPE, ALIGNED)
    numel = tl.load(rows + 2 * t + 1)
    return pid, g_ptr, start, numel


@triton.jit
def _unscale_block(g_ptr, offs, numel, inv, bad, G_DTYPE: tl.constexpr, EVEN: tl.constexpr):
    mask = offs < numel
    x = ld(g_ptr, offs, mask, EVEN).to(tl.float32)
    # The check is on the grad as it came in, as torch's AMP kernel does; masked lanes load 0.
    bad = tl.where(tl.abs(x) <= FLOAT32_MAX, bad, 1)
    # fp32 multiply, one rounding to the grad's dtype.
    st(g_ptr, offs, round_to(x * inv, G_DTYPE), mask, EVEN)
    return bad


@triton.jit
def _unscale_check_kernel(
    rows, chunks, found_inf_ptr, inv_ptr, inv_value,
    G_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, INV_PTR: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    pid, g_ptr, start, numel = _chunk_start(rows, chunks, CHUNK, G_DTYPE, ALIGNED)
    inv = scalar_value(inv_ptr, inv_value, INV_PTR)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    if start + CHUNK <= numel:
        for off in range(0, CHUNK, BLOCK):
            bad = _unscale_block(g_ptr, start + off + tl.arange(0, BLOCK), numel, inv, bad, G_DTYPE, True)
    else:
        for tail_off in range(0, numel - start, BLOCK):
            bad = _unscale_block(g_ptr, start + tail_off + tl.arange(0, BLOCK), numel, inv, bad, G_DTYPE, False)
    if tl.max(bad, axis=0) > 0:
        # Only ever 1.0, so concurrent stores from several programs agree and nothing clears the flag.
        tl.store(found_inf_ptr, 1.0)


@triton.jit
def _stats_block(g_ptr, offs, numel, inv, sq, amax, nan, bad, EVEN: tl.constexpr):
    mask = offs < numel
    x = ld(g_ptr, offs, mask, EVEN).to(tl.float32)
    # The inf/nan check is on the grad as it is; the norm is of the unscaled grad, unscaled before
    # squaring (a scaled fp32 grad above 1.8e19 would square to inf).
    bad = tl.where(tl.abs(x) <= FLOAT32_MAX, bad, 1)
    u = x * inv
    a = tl.abs(u)
    is_nan = u != u
    sq += u * u
    # nan is tracked apart and put back at the end: how max treats nan differs between backends.
    amax = tl.maximum(amax, tl.where(is_nan, 0.0, a))
    nan = tl.where(is_nan, 1, nan)
    return sq, amax, nan, bad


@triton.jit
def _grad_stats_kernel(
    rows, chunks, partials, first_partial, inv_ptr, inv_value,
    G_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, INV_PTR: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    pid, g_ptr, start, numel = _chunk_start(rows, chunks, CHUNK, G_DTYPE, ALIGNED)
    inv = scalar_value(inv_ptr, inv_value, INV_PTR)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    if start + CHUNK <= numel:
        for off in range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            sq, amax, nan, bad = _stats_block(g_ptr, offs, numel, inv, sq, amax, nan, bad, True)
    else:
        for tail_off in range(0, numel - start, BLOCK):
            tail_offs = start + tail_off + tl.arange(0, BLOCK)
            sq, amax, nan, bad = _stats_block(g_ptr, tail_offs, numel, inv, sq, amax, nan, bad, False)
    mx = tl.max(amax, axis=0)
    mx = tl.where(tl.max(nan, axis=0) > 0, float("nan"), mx)
    out = partials + (first_partial + pid) * 3
    tl.store(out, tl.sum(sq, axis=0))
    tl.store(out + 1, mx)
    tl.store(out + 2, tl.max(bad, axis=0).to(tl.float32))


@triton.jit
def _grad_stats_reduce_kernel(partials, out, n, BLOCK: tl.constexpr):
    # One program, a fixed order of loads and a fixed reduction tree: the same bits on every run.
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        s = tl.load(partials + offs * 3, mask=mask, other=0.0)
        m = tl.load(partials + offs * 3 + 1, mask=mask, other=0.0)
        b = tl.load(partials + offs * 3 + 2, mask=mask, other=0.0)
        sq += s
        is_nan = m != m
        amax = tl.maximum(amax, tl.where(is_nan, 0.0, m))
        nan = tl.where(is_nan, 1, nan)
        bad = tl.maximum(bad, b)
    mx = tl.max(amax, axis=0)
    mx = tl.where(tl.max(nan, axis=0) > 0, float("nan"), mx)
    tl.store(out, tl.sum(sq, axis=0))
    tl.store(out + 1, mx)
    tl.store(out + 2, tl.max(bad, axis=0))


@torch.no_grad()
def unscale_check_(grads, found_inf, inv_scale, *, host_scalars=()):
    """``host_scalars``: see ``_common.StepScalars`` (here "inv_scale")."""
    if len(grads) == 0:
        return
    device = grads[0].device
    inv_t, inv_value = scalar_source(inv_scale, device, "inv_scale" in host_scalars)
    chunk, block, num_warps = block_sizes("unscale")
    with device_scope(device):
        for dtype, idx in group_by_dtype(grads).items():
            table = _grad_table(grads, idx, device, chunk)
            if table.n_chunks == 0:
                continue
            _unscale_check_kernel[(table.n_chunks,)](
                table.rows, table.chunks, found_inf, table.rows if inv_t is None else inv_t, inv_value,
                G_DTYPE=TL_DTYPE[dtype], CHUNK=chunk, BLOCK=block, INV_PTR=inv_t is not None,
                ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip


@torch.no_grad()
def grad_stats(grads, inv_scale=None, *, host_scalars=()):
    """``host_scalars``: see ``_common.StepScalars`` (here "inv_scale")."""
    device = grads[0].device
    inv_t, inv_value = None, 1.0
    if inv_scale is not None:
        inv_t, inv_value = scalar_source(inv_scale, device, "inv_scale" in host_scalars)
    chunk, block, num_warps = block_sizes("stats")
    _, reduce_block, reduce_warps = block_sizes("stats_reduce")
    with device_scope(device):
        groups = [(dtype, _grad_table(grads, idx, device, chunk)) for dtype, idx in group_by_dtype(grads).items()]
        total = sum(table.n_chunks for _, table in groups)
        out = torch.empty(3, dtype=torch.float32, device=device)
        if total == 0:
            return out.zero_()
        partials = torch.empty(total * 3, dtype=torch.float32, device=device)
        first = 0
        for dtype, table in groups:
            if table.n_chunks == 0:
                continue
            _grad_stats_kernel[(table.n_chunks,)](
                table.rows, table.chunks, partials, first, table.rows if inv_t is None else inv_t, inv_value,
                G_DTYPE=TL_DTYPE[dtype], CHUNK=chunk, BLOCK=block, INV_PTR=inv_t is not None,
                ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
            first += table.n_chunks
        _grad_stats_reduce_kernel[(1,)](
            partials, out, total, BLOCK=reduce_block, num_warps=reduce_warps, enable_fp_fusion=False
        )
    return out
