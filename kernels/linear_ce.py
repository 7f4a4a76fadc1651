"""Triton row pass of ``linear_cross_entropy`` (the contract: fastops/_lce.py). The chunk loop and its three
matmuls are torch's (cuBLAS on a GPU, ATen under the interpreter); one program per row of a chunk computes the
row's log-sum-exp and loss in fp32 and, with a gradient wanted, overwrites the row with the logits' gradient.

Under TRITON_INTERPRET=1 (CPU tensors) the chunk is handed over in fp32: the interpreter runs numpy, which has no
bf16 arithmetic, so bf16/fp16 logits are cast up before and the gradient cast down after; compiled on a GPU the
kernel loads the matmul's dtype and converts in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE

BLOCK = 1024


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
    # In log-probabilities, as torch: exactly 0 at V = 1.
    loss = (1.0 - eps) * (lse - zt) + eps * (lse - zsum * inv_v)
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


def linear_ce_pass(x, weight, bias, target, label_smoothing, scale, grad_rows, with_grad, chunk_rows):
    m, h = x.shape
    v = weight.shape[0]
    interp = x.device.type == "cpu"
    loss = torch.empty(m, dtype=torch.float32, device=x.device)
    gx = torch.empty((m, h) if with_grad else (0,), dtype=x.dtype, device=x.device)
    gw = torch.zeros((v, h) if with_grad else (0,), dtype=torch.float32, device=x.device)
    gb = torch.zeros((v,) if with_grad and bias is not None else (0,), dtype=torch.float32, device=x.device)
    target = target.contiguous()
    grad_rows = None if grad_rows is None else grad_rows.float().contiguous()
    step = max(1, chunk_rows)  # fastops/_lce.py sizes the chunks for every backend
    for s in range(0, m, step):
        xc = x[s:s + step]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else xc @ weight.t()
        buf = logits.float() if interp or logits.dtype == torch.float16 else logits
        _rows(buf, target[s:s + step], None if grad_rows is None else grad_rows[s:s + step], loss[s:s + step],
              scale, label_smoothing, with_grad)
        if not with_grad:
            continue
        dl = buf.to(x.dtype)
        torch.mm(dl, weight, out=gx[s:s + step])
        if x.dtype == torch.float32:
            gw.addmm_(dl.t(), xc)
        else:  # no mixed-dtype matmul on the CPU: the chunk's product is added to the fp32 accumulator
            gw += (dl.t() @ xc).float()
        if bias is not None:
            gb += buf.sum(0, dtype=torch.float32)
    return loss, gx, gw.to(weight.dtype), gb.to(weight.dtype)
