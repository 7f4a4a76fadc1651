"""Triton Adam/AdamW step: every param of one dtype on a device in one launch.

The launch walks a chunk table, as apex's multi_tensor_apply does: each program owns one CHUNK-element
slice of one tensor and finds that tensor's pointers in a per-tensor table. Both tables are int64 tensors
on the params' device, built once per set of (data_ptr, numel) and cached (``_common.TableCache``), so a steady
training loop only hashes pointers on the host.

Nothing here reads a device value on the host: lr, grad_scale and found_inf are read in the kernel when
they are on the params' device, the step counters are bumped by a device op before the launch, and bias
corrections are computed in the kernel from each tensor's own step. That keeps the step free of syncs and
capturable in a CUDA graph.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from fastops._checks import check_adam_args

from ._common import (
    StepScalars, TL_DTYPE, block_sizes, chunk_of, device_scope, group_by_dtype, ld, round_to, scalar_value, st, table_ptr,
    tensor_table,
)

# Columns of the Adam tensor table, as the kernel reads them.
_P = tl.constexpr(0)
_G = tl.constexpr(1)
_M = tl.constexpr(2)
_V = tl.constexpr(3)
_VMAX = tl.constexpr(4)
_MASTER = tl.constexpr(5)
_STEP = tl.constexpr(6)
_NUMEL = tl.constexpr(7)
_ADAM_COLS = tl.constexpr(8)


@triton.jit
def _one_minus_pow(log_beta, step):
    # 1 - beta**step, as -expm1(step * log(beta)) with log(beta) computed on the host in fp64. The direct
    # fp32 form is off twice: fp32(0.999) = 0.99900001287, so 1 - beta alone is 1.3e-5 too small relative
    # at step 1, and 1 - pow() cancels the leading digits. For |y| <= 0.5 a Taylor series to y**9
    # truncates below 1e-8 relative; beyond, 1 - exp(y) >= 0.39 has no cancellation. Measured for beta in
    # 0.9..0.9999 and steps 1..1e7: at most 2.2e-7 relative off fp64, where fp32 1 - pow() is 2e-5 (0.999)
    # and 2e-4 (0.9999).
    y = step * log_beta
    # Clamped so the unused series stays finite when beta = 0 (log_beta = -inf).
    ys = tl.maximum(y, -0.5)
    t = 1.0 + ys * (1.0 / 9.0)
    t = 1.0 + ys * (1.0 / 8.0) * t
    t = 1.0 + ys * (1.0 / 7.0) * t
    t = 1.0 + ys * (1.0 / 6.0) * t
    t = 1.0 + ys * (1.0 / 5.0) * t
    t = 1.0 + ys * (1.0 / 4.0) * t
    t = 1.0 + ys * (1.0 / 3.0) * t
    t = 1.0 + ys * 0.5 * t
    return tl.where(y > -0.5, -ys * t, 1.0 - tl.exp(y))


@triton.jit
def _max_nan(a, b):
    # torch.maximum: nan if either is nan.
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _adam_block(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel,
    scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
    P_DTYPE: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
):  # fmt: skip
    mask = offs < numel
    if MASTER:
        p = ld(w_ptr, offs, mask, EVEN)
    else:
        p = ld(p_ptr, offs, mask, EVEN).to(tl.float32)
    g = ld(g_ptr, offs, mask, EVEN).to(tl.float32)
    m = ld(m_ptr, offs, mask, EVEN)
    v = ld(v_ptr, offs, mask, EVEN)
    # The order of operations below is reference.py's (torch.optim.Adam's for-loop path); tl.fma stands
    # where torch's CPU kernels fuse (add with alpha, lerp, addcmul). fp fusion is off at launch so no
    # other product is fused.
    if SCALE:
        g = tl.div_rn(g, scale)
    if MAXIMIZE:
        g = -g
    if WD == 1:
        g = tl.fma(p, weight_decay, g)
    if WD == 2:
        p = p * decay
    if LERP_SMALL:
        m = tl.fma(lerp_weight, g - m, m)
    else:
        m = tl.fma(lerp_weight - 1.0, g - m, g)
    # torch's addcmul compiles to fma((1 - beta2) * g, g, v * beta2); measured: 0 of 5000 differ this way,
    # 376 with a separate add.
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    if AMSGRAD:
        vmax = _max_nan(ld(vmax_ptr, offs, mask, EVEN), v)
        st(vmax_ptr, offs, vmax, mask, EVEN)
        denom = tl.div_rn(tl.sqrt_rn(vmax), bc2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    st(m_ptr, offs, m, mask, EVEN)
    st(v_ptr, offs, v, mask, EVEN)
    if MASTER:
        st(w_ptr, offs, p, mask, EVEN)
    st(p_ptr, offs, round_to(p, P_DTYPE), mask, EVEN)


@triton.jit
def _adam_kernel(
    rows, chunks, lr_ptr, lr_value, decay_value, scale_ptr, scale_value, found_inf_ptr,
    beta2, one_minus_beta2, lerp_weight, log_beta1, log_beta2, eps, weight_decay,
    P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    LR_PTR: tl.constexpr, SCALE: tl.constexpr, FOUND_INF: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    # SCALE: 0 no grad_scale, 1 value, 2 pointer. WD: 0 none, 1 L2 (Adam), 2 decoupled (AdamW).
    if FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    _, t, start = chunk_of(chunks, CHUNK)
    row = rows + t * _ADAM_COLS
    numel = tl.load(row + _NUMEL)
    p_ptr = table_ptr(row, _P, P_DTYPE, ALIGNED)
    g_ptr = table_ptr(row, _G, P_DTYPE, ALIGNED)
    m_ptr = table_ptr(row, _M, tl.float32, ALIGNED)
    v_ptr = table_ptr(row, _V, tl.float32, ALIGNED)
    vmax_ptr = table_ptr(row, _VMAX, tl.float32, ALIGNED)
    w_ptr = table_ptr(row, _MASTER, tl.float32, ALIGNED)
    step = tl.load(tl.load(row + _STEP).to(tl.pointer_type(tl.float32)))

    lr = scalar_value(lr_ptr, lr_value, LR_PTR)
    if LR_PTR:
        decay = tl.fma(-lr, weight_decay, 1.0)
    else:
        decay = decay_value
    scale = scalar_value(scale_ptr, scale_value, SCALE == 2)
    bc1 = _one_minus_pow(log_beta1, step)
    bc2 = _one_minus_pow(log_beta2, step)
    neg_step_size = -tl.div_rn(lr, bc1)
    bc2_sqrt = tl.sqrt_rn(bc2)

    if start + CHUNK <= numel:
        # Full chunk: no mask, so the accesses can be 16-byte vectors.
        for off in range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel,
                scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
                P_DTYPE, True, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL,
            )  # fmt: skip
    else:
        # (Loop names differ from the branch above: Triton merges same-named values of both branches, and
        # this trip count is int64.)
        for tail_off in range(0, numel - start, BLOCK):
            tail_offs = start + tail_off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, tail_offs, numel,
                scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
                P_DTYPE, False, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL,
            )  # fmt: skip


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


@torch.no_grad()
def adam_step_(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
):  # fmt: skip
    _adam_step(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
        lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
    )  # fmt: skip


def _adam_step(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, grad_scale, found_inf,
    scalars_on_host: bool = False,
):  # fmt: skip
    """``scalars_on_host``: see ``_common.StepScalars``."""
    check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, amsgrad)
    if len(params) == 0:
        return
    device = params[0].device
    for i, s in enumerate(state_steps):
        if s.device != device:
            raise RuntimeError(
                f"fastops.adam_step_: state_steps[{i}] is on {s.device} but params[0] is on {device}; "
                "the kernel reads each step through a pointer"
            )
    sc = StepScalars("adam_step_", device, lr, grad_scale, found_inf, scalars_on_host)
    if sc.skip:
        return
    steps = list(state_steps)
    chunk, block, num_warps = block_sizes("adam")
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    lerp_weight = 1 - beta1
    # torch.lerp picks its formula by |weight| < 0.5 on the fp32 weight.
    lerp_small = abs(struct.unpack("f", struct.pack("f", lerp_weight))[0]) < 0.5
    wd_mode = 0 if weight_decay == 0 else (2 if decoupled else 1)
    with device_scope(device):
        if sc.inf_t is None:
            torch._foreach_add_(steps, 1)
        else:
            # A device op: a skipped step leaves the counters as they were, with no host read.
            torch._foreach_add_(steps, (sc.inf_t.reshape(()) == 0).to(torch.float32))
        for dtype, idx in group_by_dtype(params).items():
            table = tensor_table("adam", device, chunk, idx, lambda i: (
                params[i].data_ptr(),
                grads[i].data_ptr(),
                exp_avgs[i].data_ptr(),
                exp_avg_sqs[i].data_ptr(),
                max_exp_avg_sqs[i].data_ptr() if amsgrad else 0,
                master_params[i].data_ptr() if master_params else 0,
                steps[i].data_ptr(),
                params[i].numel(),
            ), _ADAM_COLS.value)  # fmt: skip
            if table.n_chunks == 0:
                continue
            lr_ptr, scale_ptr, inf_ptr = sc.pointers(table.rows)
            _adam_kernel[(table.n_chunks,)](
                table.rows, table.chunks, lr_ptr, sc.lr, 1 - sc.lr * weight_decay, scale_ptr, sc.scale, inf_ptr,
                beta2, 1 - beta2, lerp_weight, _log(beta1), _log(beta2), eps, weight_decay,
                P_DTYPE=TL_DTYPE[dtype], CHUNK=chunk, BLOCK=block, LR_PTR=sc.lr_t is not None, SCALE=sc.scale_mode,
                FOUND_INF=sc.inf_t is not None, AMSGRAD=bool(amsgrad), MAXIMIZE=bool(maximize), WD=wd_mode,
                MASTER=bool(master_params), LERP_SMALL=lerp_small, ALIGNED=table.aligned,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
