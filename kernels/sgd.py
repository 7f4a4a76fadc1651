"""Triton SGD step (torch.optim.SGD's update): every param of one dtype on a device in one launch, over the
chunk table of ``_common`` as the Adam kernel.

As there, nothing reads a device value on the host: lr, grad_scale and found_inf on the params' device are
read in the kernel, so the step has no sync and can be captured in a CUDA graph. bf16/fp16 params are
loaded as fp32, updated in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from fastops._specs.sgd import SPEC as SGD

from ._common import (
    TL_DTYPE, block_sizes, chunk_of, device_scope, group_by_dtype, ld, round_to, scalar_value, st, step_scalars,
    table_ptr,
    tensor_table,
)

# Columns of the SGD tensor table (pointers, 0 when absent, then numel), as the kernel reads them, and their count.
_P, _G, _BUF, _MASTER, _NUMEL, _SGD_COLS = (tl.constexpr(i) for i in range(6))


@triton.jit
def _sgd_block(
    p_ptr, g_ptr, b_ptr, w_ptr, offs, numel, scale, neg_lr, weight_decay, momentum, one_minus_dampening,
    P_DTYPE: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
    MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MASTER: tl.constexpr,
):  # fmt: skip
    mask = offs < numel
    if MASTER:
        p = ld(w_ptr, offs, mask, EVEN)
    else:
        p = ld(p_ptr, offs, mask, EVEN).to(tl.float32)
    g = ld(g_ptr, offs, mask, EVEN).to(tl.float32)
    # reference.py's order (torch.optim.SGD's for-loop path); tl.fma where torch's CPU kernels fuse (every
    # add with alpha), fp fusion off at launch so nothing else is fused.
    if SCALE:
        g = tl.div_rn(g, scale)
    if MAXIMIZE:
        g = -g
    if WD:
        g = tl.fma(p, weight_decay, g)
    if MOMENTUM != 0:
        if MOMENTUM == 1:
            buf = g
        else:
            buf = tl.fma(g, one_minus_dampening, ld(b_ptr, offs, mask, EVEN) * momentum)
        st(b_ptr, offs, buf, mask, EVEN)
        if NESTEROV:
            g = tl.fma(buf, momentum, g)
        else:
            g = buf
    p = tl.fma(g, neg_lr, p)
    if MASTER:
        st(w_ptr, offs, p, mask, EVEN)
    st(p_ptr, offs, round_to(p, P_DTYPE), mask, EVEN)


@triton.jit
def _sgd_kernel(
    rows, chunks, lr_ptr, lr_value, scale_ptr, scale_value, found_inf_ptr,
    weight_decay, momentum, one_minus_dampening,
    P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    LR_PTR: tl.constexpr, SCALE: tl.constexpr, FOUND_INF: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
    MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MASTER: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    # SCALE: 0 no grad_scale, 1 value, 2 pointer. MOMENTUM: 0 none, 1 first step (buf = grad), 2 later steps.
    if FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    _, t, start = chunk_of(chunks, CHUNK)
    row = rows + t * _SGD_COLS
    numel = tl.load(row + _NUMEL)
    p_ptr = table_ptr(row, _P, P_DTYPE, ALIGNED)
    g_ptr = table_ptr(row, _G, P_DTYPE, ALIGNED)
    b_ptr = table_ptr(row, _BUF, tl.float32, ALIGNED)
    w_ptr = table_ptr(row, _MASTER, tl.float32, ALIGNED)
    neg_lr = -scalar_value(lr_ptr, lr_value, LR_PTR)
    scale = scalar_value(scale_ptr, scale_value, SCALE == 2)

    if start + CHUNK <= numel:
        # Full chunk: no mask, so the accesses can be 16-byte vectors.
        for off in range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            _sgd_block(
                p_ptr, g_ptr, b_ptr, w_ptr, offs, numel, scale, neg_lr, weight_decay, momentum, one_minus_dampening,
                P_DTYPE, True, SCALE, MAXIMIZE, WD, MOMENTUM, NESTEROV, MASTER,
            )  # fmt: skip
    else:
        # (Other loop names than above: Triton merges same-named values of both branches; see adam.py.)
        for tail_off in range(0, numel - start, BLOCK):
            tail_offs = start + tail_off + tl.arange(0, BLOCK)
            _sgd_block(
                p_ptr, g_ptr, b_ptr, w_ptr, tail_offs, numel, scale, neg_lr, weight_decay, momentum,
                one_minus_dampening, P_DTYPE, False, SCALE, MAXIMIZE, WD, MOMENTUM, NESTEROV, MASTER,
            )  # fmt: skip


@torch.no_grad()
def sgd_step_(*args, host_scalars=()):
    """sgd_step_ on the op's arguments (fastops/_specs/sgd.py); ``host_scalars``: see ``_common.StepScalars``."""
    a = SGD.Args(*args)
    sc = step_scalars(a, host_scalars)
    if sc is None:
        return
    params, device = a.params, a.params[0].device
    chunk, block, num_warps = block_sizes("sgd")
    has_momentum = a.momentum != 0
    mode = 0 if not has_momentum else (1 if a.is_first_step else 2)
    with device_scope(device):
        for dtype, idx in group_by_dtype(params).items():
            table = tensor_table("sgd", device, chunk, idx, lambda i: (
                params[i].data_ptr(),
                a.grads[i].data_ptr(),
                a.momentum_buffers[i].data_ptr() if has_momentum else 0,
                a.master_params[i].data_ptr() if a.master_params else 0,
                params[i].numel(),
            ), _SGD_COLS.value)  # fmt: skip
            if table.n_chunks == 0:
                continue
            lr_ptr, scale_ptr, inf_ptr = sc.pointers(table.rows)
            _sgd_kernel[(table.n_chunks,)](
                table.rows, table.chunks, lr_ptr, sc.lr, scale_ptr, sc.scale, inf_ptr,
                float(a.weight_decay), float(a.momentum), 1 - float(a.dampening),
                P_DTYPE=TL_DTYPE[dtype], CHUNK=chunk, BLOCK=block, LR_PTR=sc.lr_t is not None, SCALE=sc.scale_mode,
                FOUND_INF=sc.inf_t is not None, MAXIMIZE=bool(a.maximize), WD=a.weight_decay != 0, MOMENTUM=mode,
                NESTEROV=bool(a.nesterov) and has_momentum, MASTER=bool(a.master_params), ALIGNED=table.aligned,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
