"""Triton row pass of ``linear_cross_entropy`` (the op: fastops/_specs/linear_ce.py). The chunk loop and its three
matmuls are fastops/_lce.py's (cuBLAS on a GPU, ATen under the interpreter); one program per row of a chunk
computes the row's log-sum-exp and loss in fp32 and, with a gradient wanted, overwrites the row with the logits'
gradient.

Under TRITON_INTERPRET=1 the chunk is handed over in fp32: the interpreter runs numpy, which has no
bf16 arithmetic, so bf16/fp16 logits are cast up before and the gradient cast down after; compiled on a GPU the
kernel loads the matmul's dtype (fp16 too) and converts in registers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE

BLOCK = 1024
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ce_rows_kernel(z_ptr, t_ptr, g_ptr, loss_ptr, v, stride, scale, eps, eps_over_v, inv_v,
                    HAS_G: tl.constexpr, WITH_GRAD: tl.constexpr, Z_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    t = tl.load(t_ptr + row)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    zs = tl.zeros([BLOCK], tl.float32)
    for off in range(0, v, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < v
        z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, z)
        zs += tl.where(mask, z, 0.0)
    m = tl.max(mx, axis=0)
    zsum = tl.sum(zs, axis=0)
    s = tl.zeros([BLOCK], tl.float32)
    for off in range(0, v, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < v
        z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        s += tl.where(mask, tl.exp(z - m), 0.0)
    lse = m + tl.log(tl.sum(s, axis=0))
    zt = tl.load(base + t).to(tl.float32)
    # In log-probabilities, as torch: exactly 0 at V = 1. The smoothing term only where eps != 0: a -inf logit (a
    # banned class's bias) makes zsum -inf, and 0 * inf would be nan.
    loss = (1.0 - eps) * (lse - zt) + tl.where(eps != 0.0, eps * (lse - zsum * inv_v), 0.0)
    tl.store(loss_ptr + row, loss)
    if WITH_GRAD:
        c = scale
        if HAS_G:
            c = c * tl.load(g_ptr + row)
        for off in range(0, v, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < v
            z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.exp(z - lse) - eps_over_v - tl.where(offs == t, 1.0 - eps, 0.0)
            tl.store(base + offs, (c * d).to(Z_DTYPE), mask=mask)


def _rows(buf, target, grad_rows, loss, scale, eps, with_grad):
    r, v = buf.shape
    _ce_rows_kernel[(r,)](
        buf, target, grad_rows if grad_rows is not None else loss, loss, v, buf.stride(0), float(scale), float(eps),
        float(eps) / v, 1.0 / v, HAS_G=grad_rows is not None, WITH_GRAD=with_grad, Z_DTYPE=TL_DTYPE[buf.dtype],
        BLOCK=min(BLOCK, triton.next_power_of_2(v)),
    )


def rows(buf, target, row_grad, scale, eps, with_grad, loss):
    """The row pass in fastops/_lce.py's signature. fp64 chunks take the reference's (no kernel takes fp64)."""
    if buf.dtype == torch.float64:
        from fastops import _lce  # here, not at import: this folder may also be imported as a top-level package

        _lce.reference_rows(buf, target, row_grad, scale, eps, with_grad, loss)
        return
    row_grad = None if row_grad is None else row_grad.float().contiguous()
    if _INTERPRETED and buf.dtype != torch.float32:  # the interpreter has no bf16/fp16 arithmetic
        wide = buf.float()
        _rows(wide, target.contiguous(), row_grad, loss, scale, eps, with_grad)
        if with_grad:
            buf.copy_(wide)
        return
    _rows(buf, target.contiguous(), row_grad, loss, scale, eps, with_grad)


def linear_cross_entropy(*args):
    """fastops/_specs/linear_ce.py's op: fastops/_lce.py's chunk loop (torch's matmuls) around this row pass."""
    from fastops import _lce

    return _lce.forward(*args, rows=rows, rows_take_half=True)


def linear_cross_entropy_backward(*args):
    from fastops import _lce

    return _lce.backward(*args, rows=rows, rows_take_half=True)
