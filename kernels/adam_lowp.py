"""Triton Adam/AdamW step on low-precision states (``adam_step_lowp_``): 8-bit blockwise or bf16 with stochastic
rounding, the formats fastops/_quant.py defines bit for bit.

Same multi-tensor design as ``adam.py`` (chunk table, per-tensor pointer table, scalars read in the kernel).
Each loop trip is a [ROWS, 256] tile: one row is one quantization block of 256 elements along memory, so a
block's absmax is a row reduction and its scale broadcasts back along the row without leaving the tile's
layout. ROWS * 256 = 4 * 32 * num_warps puts 4 elements in each thread for every stream (uint8 codes, bf16
and fp32 alike): the streams share one layout, so none needs a layout conversion (the 1-D bf16 Adam kernel,
where fp32 streams take 4 a thread and bf16 ones 8, needs 4-8 of them and 139-184 registers on sm_90).
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from fastops import _quant

from ._common import (
    FLOAT32_MAX, StepScalars, TL_DTYPE, block_sizes, chunk_of, device_scope, group_by_dtype, round_to, scalar_value,
    table_ptr, tensor_table,
)

# Columns of the tensor table, as the kernel reads them.
_P = tl.constexpr(0)
_G = tl.constexpr(1)
_M = tl.constexpr(2)
_V = tl.constexpr(3)
_M_ABSMAX = tl.constexpr(4)
_V_ABSMAX = tl.constexpr(5)
_MASTER = tl.constexpr(6)
_STEP = tl.constexpr(7)
_INDEX = tl.constexpr(8)
_NUMEL = tl.constexpr(9)
_COLS = tl.constexpr(10)

QBLOCK = tl.constexpr(_quant.BLOCK)

_SIGNED = _quant.constants(True)
_UNSIGNED = _quant.constants(False)


def _c(name: str, signed: bool):
    return [tl.constexpr(v) for v in (_SIGNED if signed else _UNSIGNED)[name]]


# The encoder's fp32 constants (exact in fp32, so baking them in as literals keeps them bit for bit).
_ST0, _ST1, _ST2, _ST3, _ST4, _ST5, _ST6, _ST7 = _c("T", True)
_SP0, _SP1, _SP2, _SP3, _SP4, _SP5, _SP6 = _c("P", True)
_SF0, _SF1, _SF2, _SF3, _SF4, _SF5, _SF6 = _c("F", True)
_UT0, _UT1, _UT2, _UT3, _UT4, _UT5, _UT6, _UT7 = _c("T", False)
_UP0, _UP1, _UP2, _UP3, _UP4, _UP5, _UP6 = _c("P", False)
_UF0, _UF1, _UF2, _UF3, _UF4, _UF5, _UF6 = _c("F", False)
# fp32 round-half-even to an integer for |t| < 2**22: (t + 1.5 * 2**23) - 1.5 * 2**23, fp fusion off.
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _pick(i, c0, c1, c2, c3, c4, c5, c6):
    out = tl.where(i == 1, c1, c0)
    out = tl.where(i == 2, c2, out)
    out = tl.where(i == 3, c3, out)
    out = tl.where(i == 4, c4, out)
    out = tl.where(i == 5, c5, out)
    return tl.where(i == 6, c6, out)


@triton.jit
def _encode(x, SIGNED: tl.constexpr):
    """fp32 ``x`` (state / absmax) -> uint8 code, _quant.encode's operations in its order."""
    if SIGNED:
        a = tl.abs(x)
        i = ((a >= _ST1).to(tl.int32) + (a >= _ST2).to(tl.int32) + (a >= _ST3).to(tl.int32)
             + (a >= _ST4).to(tl.int32) + (a >= _ST5).to(tl.int32) + (a >= _ST6).to(tl.int32))  # fmt: skip
        p = _pick(i, _SP0, _SP1, _SP2, _SP3, _SP4, _SP5, _SP6)
        f = _pick(i, _SF0, _SF1, _SF2, _SF3, _SF4, _SF5, _SF6)
        n = 1 << i
        t7 = _ST7
        t0 = _ST0
    else:
        a = x
        i = ((a >= _UT1).to(tl.int32) + (a >= _UT2).to(tl.int32) + (a >= _UT3).to(tl.int32)
             + (a >= _UT4).to(tl.int32) + (a >= _UT5).to(tl.int32) + (a >= _UT6).to(tl.int32))  # fmt: skip
        p = _pick(i, _UP0, _UP1, _UP2, _UP3, _UP4, _UP5, _UP6)
        f = _pick(i, _UF0, _UF1, _UF2, _UF3, _UF4, _UF5, _UF6)
        n = 2 << i
        t7 = _UT7
        t0 = _UT0
    t = ((a * p) - 0.1) * f - 0.5
    r = (t + _RNE) - _RNE
    j = tl.minimum(tl.maximum(r, 0.0).to(tl.int32), n - 1)
    code = n + j
    if SIGNED:
        neg = x < 0
        code = tl.where(neg, code | 0x80, code)
        top = tl.where(neg, 0xFF, 0x80)
    else:
        top = tl.full(code.shape, 1, tl.int32)
    code = tl.where(a >= t7, top, code)
    code = tl.where(a >= t0, code, 0)
    return code.to(tl.uint8)


@triton.jit
def _pow_int(beta, step):
    """beta ** n in fp64 for the integral fp32 ``step`` n, by squaring."""
    n = step.to(tl.int64)
    r = tl.cast(1.0, tl.float64)
    b = beta
    while n > 0:
        r = tl.where((n & 1) != 0, r * b, r)
        b = b * b
        n = n >> 1
    return r


@triton.jit
def _mix32(x):
    # _quant.mix32 on uint32 (products wrap mod 2**32).
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _round_bf16_sr(x, r16):
    """_quant.round_bf16_stochastic: ``r16`` (uint32 below 2**16) added under the bf16 mantissa."""
    bits = x.to(tl.uint32, bitcast=True)
    out = tl.where(tl.abs(x) <= FLOAT32_MAX, (bits + r16) >> 16, bits >> 16)
    out = tl.where(x != x, 0x7FC0, out)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fma(a, b, c, EMULATE_FMA: tl.constexpr):
    # The interpreter computes tl.fma as a * b + c, two roundings. Under it, the product in fp64 is exact
    # (24 + 24 bits) and the sum rounds twice (fp64, then fp32), which differs from one rounding only when the
    # fp64 sum lands on an fp32 midpoint: what makes the states bit-exact with torch's fused CPU kernels.
    if EMULATE_FMA:
        return (tl.cast(a, tl.float64) * tl.cast(b, tl.float64) + tl.cast(c, tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _row_scalars(ptr, blk0, r, nblocks, EVEN: tl.constexpr):
    """[ROWS, 1]: row k holds ptr[blk0 + k]. Scalar loads: a [ROWS, 1] pointer tensor gets its own coalesced
    layout, and moving the scales into the tile's took 4 layout conversions a trip."""
    out = tl.zeros(r.shape, tl.float32)
    for k in tl.static_range(r.shape[0]):
        if EVEN:
            x = tl.load(ptr + blk0 + k)
        else:
            x = tl.load(ptr + blk0 + k, mask=blk0 + k < nblocks, other=0.0)
        out = tl.where(r == k, x, out)
    return out


@triton.jit
def _store_rows(ptr, blk0, x, r, c, nblocks, EVEN: tl.constexpr):
    """ptr[blk0 + k] = row k of ``x`` ([ROWS, 1]) as scalar stores, each value picked out of the whole tile by a sum
    with one nonzero term (exact: absmax is never -0.0, and nan or inf carry through). A [ROWS] store gets a
    layout of its own (the coalescer's), and moving the values into it took 4 layout conversions a trip; a row
    reduction followed by a pick in the reduction's layout took 16. Reducing the full tile takes none."""
    xs = x + tl.zeros((r.shape[0], QBLOCK), tl.float32)
    for k in tl.static_range(r.shape[0]):
        xk = tl.sum(tl.where((r == k) & (c == 0), xs, 0.0))
        if EVEN:
            tl.store(ptr + blk0 + k, xk)
        else:
            tl.store(ptr + blk0 + k, xk, mask=blk0 + k < nblocks)


@triton.jit
def _max_nan_rows(x):
    # Row max as [ROWS, 1], nan if any element of the row is nan (torch.amax; tl.max drops nans when compiled).
    mx = tl.max(x, axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1)
    return tl.where(has_nan != 0, float("nan"), mx)[:, None]


@triton.jit
def _lowp_tile(
    p_ptr, g_ptr, m_ptr, v_ptr, ma_ptr, va_ptr, w_ptr, qs_ptr, qu_ptr, key, offs, blk0, r, c, numel, nblocks,
    scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt, neg_step_size,
    P_DTYPE: tl.constexpr, EIGHT_BIT: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    # offs: [ROWS, 256] element indices, row k of them block blk0 + k; r: [ROWS, 1] row numbers.
    if EVEN:
        if MASTER:
            p = tl.load(w_ptr + offs)
        else:
            p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        if EIGHT_BIT:
            m = tl.load(qs_ptr + tl.load(m_ptr + offs).to(tl.int32)) * _row_scalars(ma_ptr, blk0, r, nblocks, True)
            v = tl.load(qu_ptr + tl.load(v_ptr + offs).to(tl.int32)) * _row_scalars(va_ptr, blk0, r, nblocks, True)
        else:
            m = tl.load(m_ptr + offs).to(tl.float32)
            v = tl.load(v_ptr + offs).to(tl.float32)
    else:
        mask = offs < numel
        if MASTER:
            p = tl.load(w_ptr + offs, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if EIGHT_BIT:
            mc = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
            vc = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
            m = tl.load(qs_ptr + mc) * _row_scalars(ma_ptr, blk0, r, nblocks, False)
            v = tl.load(qu_ptr + vc) * _row_scalars(va_ptr, blk0, r, nblocks, False)
        else:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # adam.py's _adam_block update (reference.py's order, tl.fma where torch's CPU kernels fuse).
    if SCALE:
        g = tl.div_rn(g, scale)
    if MAXIMIZE:
        g = -g
    if WD == 1:
        g = _fma(p, weight_decay, g, EMULATE_FMA)
    if WD == 2:
        p = p * decay
    if LERP_SMALL:
        m = _fma(lerp_weight, g - m, m, EMULATE_FMA)
    else:
        m = _fma(lerp_weight - 1.0, g - m, g, EMULATE_FMA)
    v = _fma(one_minus_beta2 * g, g, v * beta2, EMULATE_FMA)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)

    if EIGHT_BIT:
        # Masked lanes hold m = v = 0 (codes 0 decode to 0, grads 0), so they never raise a block's max.
        # nan propagates into the max as torch.amax does: its block then decodes to nan.
        am = tl.abs(m)
        ma = _max_nan_rows(am)
        va = _max_nan_rows(v)
        mq = _encode(tl.div_rn(m, ma), True)
        vq = _encode(tl.div_rn(v, va), False)
    else:
        bits = _mix32((offs & 0xFFFFFFFF).to(tl.uint32) ^ key
                      ^ ((offs >> 32).to(tl.uint32) * tl.full(offs.shape, 0x85EBCA6B, tl.uint32)))  # fmt: skip
        mq = _round_bf16_sr(m, bits & 0xFFFF)
        vq = _round_bf16_sr(v, bits >> 16)
    pq = round_to(p, P_DTYPE)
    if EVEN:
        tl.store(m_ptr + offs, mq)
        tl.store(v_ptr + offs, vq)
        if EIGHT_BIT:
            _store_rows(ma_ptr, blk0, ma, r, c, nblocks, True)
            _store_rows(va_ptr, blk0, va, r, c, nblocks, True)
        if MASTER:
            tl.store(w_ptr + offs, p)
        tl.store(p_ptr + offs, pq)
    else:
        tl.store(m_ptr + offs, mq, mask=mask)
        tl.store(v_ptr + offs, vq, mask=mask)
        if EIGHT_BIT:
            _store_rows(ma_ptr, blk0, ma, r, c, nblocks, False)
            _store_rows(va_ptr, blk0, va, r, c, nblocks, False)
        if MASTER:
            tl.store(w_ptr + offs, p, mask=mask)
        tl.store(p_ptr + offs, pq, mask=mask)


# The seed changes every step: specialised, each value divisible by 16 would compile another variant.
@triton.jit(do_not_specialize=["seed"])
def _adam_lowp_kernel(
    rows, chunks, seed, qmap_signed, qmap_unsigned, lr_ptr, lr_value, decay_value, scale_ptr, scale_value, found_inf_ptr,
    beta2, one_minus_beta2, lerp_weight, betas_ptr, eps, weight_decay,
    P_DTYPE: tl.constexpr, EIGHT_BIT: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
    LR_PTR: tl.constexpr, SCALE: tl.constexpr, FOUND_INF: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    # SCALE: 0 no grad_scale, 1 value, 2 pointer. WD: 0 none, 1 L2 (Adam), 2 decoupled (AdamW).
    if FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    _, t, start = chunk_of(chunks, CHUNK)
    row = rows + t * _COLS
    numel = tl.load(row + _NUMEL)
    p_ptr = table_ptr(row, _P, P_DTYPE, ALIGNED)
    g_ptr = table_ptr(row, _G, P_DTYPE, ALIGNED)
    if EIGHT_BIT:
        m_ptr = table_ptr(row, _M, tl.uint8, ALIGNED)
        v_ptr = table_ptr(row, _V, tl.uint8, ALIGNED)
    else:
        m_ptr = table_ptr(row, _M, tl.bfloat16, ALIGNED)
        v_ptr = table_ptr(row, _V, tl.bfloat16, ALIGNED)
    ma_ptr = table_ptr(row, _M_ABSMAX, tl.float32, ALIGNED)
    va_ptr = table_ptr(row, _V_ABSMAX, tl.float32, ALIGNED)
    w_ptr = table_ptr(row, _MASTER, tl.float32, ALIGNED)
    # _quant.sr_key(seed, index): the tensor's position in the op's lists, not in its dtype group.
    index = tl.load(row + _INDEX)
    key = _mix32(seed.to(tl.uint32) ^ _mix32((index + 0x9E3779B9).to(tl.uint32)))
    step = tl.load(tl.load(row + _STEP).to(tl.pointer_type(tl.float32)))
    nblocks = (numel + (QBLOCK - 1)) // QBLOCK

    lr = scalar_value(lr_ptr, lr_value, LR_PTR)
    if LR_PTR:
        decay = (1.0 - tl.cast(lr, tl.float64) * tl.cast(weight_decay, tl.float64)).to(tl.float32)
    else:
        decay = decay_value
    scale = scalar_value(scale_ptr, scale_value, SCALE == 2)
    # The bias corrections in fp64 and rounded once to fp32, as the reference's Python floats reach torch's fp32
    # kernels. beta**step by squaring over the integral step: fp64 exp() kept 8 bytes on the stack in 3 of the
    # 8-bit specs on sm_90 (compile-check's local memory), and the squarings stay about 1e-15 relative.
    bc1 = 1.0 - _pow_int(tl.load(betas_ptr), step)
    bc2 = 1.0 - _pow_int(tl.load(betas_ptr + 1), step)
    neg_step_size = (-(tl.cast(lr, tl.float64) / bc1)).to(tl.float32)
    bc2_sqrt = tl.sqrt(bc2).to(tl.float32)

    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, QBLOCK)[None, :]
    tile = r * QBLOCK + c
    if start + CHUNK <= numel:
        # Full chunk: no mask.
        for off in range(0, CHUNK, ROWS * QBLOCK):
            offs = start + off + tile
            blk = (start + off) // QBLOCK
            _lowp_tile(
                p_ptr, g_ptr, m_ptr, v_ptr, ma_ptr, va_ptr, w_ptr, qmap_signed, qmap_unsigned, key, offs, blk, r, c,
                numel, nblocks, scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay, bc2_sqrt,
                neg_step_size, P_DTYPE, EIGHT_BIT, True, SCALE, MAXIMIZE, WD, MASTER, LERP_SMALL,
                EMULATE_FMA,
            )  # fmt: skip
    else:
        # (Loop names differ from the branch above: Triton merges same-named values of both branches.)
        for tail_off in range(0, numel - start, ROWS * QBLOCK):
            tail_offs = start + tail_off + tile
            tail_blk = (start + tail_off) // QBLOCK
            _lowp_tile(
                p_ptr, g_ptr, m_ptr, v_ptr, ma_ptr, va_ptr, w_ptr, qmap_signed, qmap_unsigned, key, tail_offs,
                tail_blk, r, c, numel, nblocks, scale, beta2, one_minus_beta2, lerp_weight, eps, weight_decay, decay,
                bc2_sqrt, neg_step_size, P_DTYPE, EIGHT_BIT, False, SCALE, MAXIMIZE, WD, MASTER, LERP_SMALL,
                EMULATE_FMA,
            )  # fmt: skip


_QMAPS: dict = {}


def _qmaps(device: torch.device):
    if device not in _QMAPS:
        _QMAPS[device] = (_quant.QMAP_SIGNED.to(device), _quant.QMAP_UNSIGNED.to(device))
    return _QMAPS[device]


def _seed_i32(seed: int) -> int:
    # The seed's low 32 bits as a signed int32, so every seed launches the same (i32) signature.
    lo = int(seed) & 0xFFFFFFFF
    return lo - (1 << 32) if lo >= 1 << 31 else lo


def _f32(x: float) -> float:
    # Float arguments rounded to fp32 here: compiled they are fp32 anyway, but the interpreter keeps Python
    # floats and adds them in fp64 (x + eps rounded once from fp64 put 2 of 5000 params 1 ulp off).
    return struct.unpack("f", struct.pack("f", x))[0]


_BETAS: dict = {}


def _betas(beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
    """(beta1, beta2) as fp64 on ``device`` (float arguments reach a kernel as fp32), one upload per value."""
    key = (beta1, beta2, device)
    if key not in _BETAS:
        if len(_BETAS) > 64:
            _BETAS.clear()
        _BETAS[key] = torch.tensor([beta1, beta2], dtype=torch.float64, device=device)
    return _BETAS[key]


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@torch.no_grad()
def adam_step_lowp_(
    params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, maximize, decoupled, seed, grad_scale, found_inf,
):  # fmt: skip
    _adam_step_lowp(
        params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps, master_params,
        lr, beta1, beta2, eps, weight_decay, maximize, decoupled, seed, grad_scale, found_inf,
    )  # fmt: skip


def _adam_step_lowp(
    params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps, master_params,
    lr, beta1, beta2, eps, weight_decay, maximize, decoupled, seed, grad_scale, found_inf,
    scalars_on_host: bool = False,
):  # fmt: skip
    """``scalars_on_host``: see ``_common.StepScalars``."""
    from fastops._checks import check_adam_lowp_args

    mode = check_adam_lowp_args(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                                state_steps, master_params)  # fmt: skip
    if len(params) == 0:
        return
    device = params[0].device
    for i, s in enumerate(state_steps):
        if s.device != device:
            raise RuntimeError(
                f"fastops.adam_step_lowp_: state_steps[{i}] is on {s.device} but params[0] is on {device}; "
                "the kernel reads each step through a pointer"
            )
    sc = StepScalars("adam_step_lowp_", device, lr, grad_scale, found_inf, scalars_on_host)
    if sc.skip:
        return
    eight_bit = mode == "8bit"
    steps = list(state_steps)
    chunk, block, num_warps = block_sizes("adam_lowp")
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    lerp_weight = 1 - beta1
    lerp_small = abs(struct.unpack("f", struct.pack("f", lerp_weight))[0]) < 0.5
    wd_mode = 0 if weight_decay == 0 else (2 if decoupled else 1)
    qs, qu = _qmaps(device)
    with device_scope(device):
        if sc.inf_t is None:
            torch._foreach_add_(steps, 1)
        else:
            torch._foreach_add_(steps, (sc.inf_t.reshape(()) == 0).to(torch.float32))
        for dtype, idx in group_by_dtype(params).items():
            table = tensor_table("adam_lowp", device, chunk, idx, lambda i: (
                params[i].data_ptr(),
                grads[i].data_ptr(),
                exp_avgs[i].data_ptr(),
                exp_avg_sqs[i].data_ptr(),
                exp_avg_absmax[i].data_ptr() if eight_bit else 0,
                exp_avg_sq_absmax[i].data_ptr() if eight_bit else 0,
                master_params[i].data_ptr() if master_params else 0,
                steps[i].data_ptr(),
                i,
                params[i].numel(),
            ), _COLS.value)  # fmt: skip
            if table.n_chunks == 0:
                continue
            lr_ptr, scale_ptr, inf_ptr = sc.pointers(table.rows)
            _adam_lowp_kernel[(table.n_chunks,)](
                table.rows, table.chunks, _seed_i32(seed), qs, qu, lr_ptr, _f32(sc.lr), _f32(1 - sc.lr * weight_decay), scale_ptr,
                _f32(sc.scale),
                inf_ptr, _f32(beta2), _f32(1 - beta2), _f32(lerp_weight), _betas(beta1, beta2, device), _f32(eps),
                _f32(weight_decay),
                P_DTYPE=TL_DTYPE[dtype], EIGHT_BIT=eight_bit, CHUNK=chunk, ROWS=block // _quant.BLOCK,
                LR_PTR=sc.lr_t is not None, SCALE=sc.scale_mode, FOUND_INF=sc.inf_t is not None,
                MAXIMIZE=bool(maximize), WD=wd_mode, MASTER=bool(master_params), LERP_SMALL=lerp_small,
                ALIGNED=table.aligned, EMULATE_FMA=_INTERPRETED, num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
