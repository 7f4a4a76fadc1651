"""Triton Adam/AdamW step on low-precision states (``adam_step_lowp_``): 8-bit blockwise or bf16 with stochastic
rounding, the formats fastops/_quant.py defines bit for bit. Each tile's states are decoded to fp32 (``_codec``),
stepped by ``_adam.update`` and encoded again; step scalars and launcher are ``_adam``'s.

Each loop trip is a [ROWS, 256] tile, one quantization block a row (``_codec``). ROWS * 256 = 4 * 32 * num_warps
puts 4 elements in each thread for every stream (uint8 codes, bf16 and fp32 alike): the streams share one layout,
so none needs a layout conversion (the 1-D bf16 Adam kernel, where fp32 streams take 4 a thread and bf16 ones 8,
needed 4-8 of them and 139-184 registers on sm_90 at 4 warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastops import _quant
from fastops._quant import StateFormat
from fastops._specs.adam_lowp import SPEC as LOWP

from . import _adam, _codec
from ._adam import FIRST_OWN
from ._codec import QBLOCK
from ._common import block_sizes, table_ptr

# This op's own columns of the tensor table: the absmax pointers (0 with bf16 states) and the tensor's position
# in the op's lists (the stochastic-rounding key's input).
_M_ABSMAX = FIRST_OWN
_V_ABSMAX = tl.constexpr(FIRST_OWN.value + 1)
_INDEX = tl.constexpr(FIRST_OWN.value + 2)


@triton.jit
def _lowp_tile(
    p_ptr, g_ptr, m_ptr, v_ptr, ma_ptr, va_ptr, w_ptr, qs_ptr, qu_ptr, key, offs, blk0, r, c, numel, nblocks,
    hyper, step_scalars,
    P_DTYPE: tl.constexpr, EIGHT_BIT: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    # offs: [ROWS, 256] element indices, row k of them block blk0 + k; r: [ROWS, 1] row numbers.
    p, g, mask = _adam.load_param_grad(p_ptr, g_ptr, w_ptr, offs, numel, MASTER, EVEN)
    m, v = _codec.decode(m_ptr, v_ptr, ma_ptr, va_ptr, qs_ptr, qu_ptr, offs, mask, blk0, r, nblocks, EIGHT_BIT, EVEN)
    p, m, v = _adam.update(p, g, m, v, w_ptr, offs, mask, hyper, step_scalars, SCALE, False, MAXIMIZE, WD, LERP_SMALL,
                           EMULATE_FMA, EVEN, not EIGHT_BIT)  # fmt: skip
    _codec.encode(m, v, m_ptr, v_ptr, ma_ptr, va_ptr, key, offs, mask, blk0, r, c, nblocks, EIGHT_BIT, EVEN)
    _adam.store_param(p, p_ptr, w_ptr, offs, mask, P_DTYPE, MASTER, EVEN)


# The seed changes every step: specialised, each value divisible by 16 would compile another variant.
@triton.jit(do_not_specialize=["seed"])
def _adam_lowp_kernel(
    common, seed, qmap_signed, qmap_unsigned, EIGHT_BIT: tl.constexpr, ROWS: tl.constexpr,
    P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, COLS: tl.constexpr, LR_PTR: tl.constexpr, SCALE: tl.constexpr,
    FOUND_INF: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr,
    LERP_SMALL: tl.constexpr, ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    # common: _adam.launch's arguments, read by program_scalars; the seed, qmaps and EIGHT_BIT/ROWS are this op's.
    row, start, numel, step_scalars, hyper = _adam.program_scalars(common, COLS, CHUNK, LR_PTR, SCALE, FOUND_INF)
    if EIGHT_BIT:
        p_ptr, g_ptr, m_ptr, v_ptr, w_ptr = _adam.table_ptrs(row, P_DTYPE, tl.uint8, ALIGNED)
    else:
        p_ptr, g_ptr, m_ptr, v_ptr, w_ptr = _adam.table_ptrs(row, P_DTYPE, tl.bfloat16, ALIGNED)
    ma_ptr = table_ptr(row, _M_ABSMAX, tl.float32, ALIGNED)
    va_ptr = table_ptr(row, _V_ABSMAX, tl.float32, ALIGNED)
    key = _codec.sr_key(seed, tl.load(row + _INDEX))
    nblocks = (numel + (QBLOCK - 1)) // QBLOCK

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
                numel, nblocks, hyper, step_scalars, P_DTYPE, EIGHT_BIT, True, SCALE, MAXIMIZE, WD, MASTER,
                LERP_SMALL, EMULATE_FMA,
            )  # fmt: skip
    else:
        # (Loop names differ from the branch above: Triton merges same-named values of both branches.)
        for tail_off in range(0, numel - start, ROWS * QBLOCK):
            tail_offs = start + tail_off + tile
            tail_blk = (start + tail_off) // QBLOCK
            _lowp_tile(
                p_ptr, g_ptr, m_ptr, v_ptr, ma_ptr, va_ptr, w_ptr, qmap_signed, qmap_unsigned, key, tail_offs,
                tail_blk, r, c, numel, nblocks, hyper, step_scalars, P_DTYPE, EIGHT_BIT, False, SCALE, MAXIMIZE,
                WD, MASTER, LERP_SMALL, EMULATE_FMA,
            )  # fmt: skip


@torch.no_grad()
def adam_step_lowp_(*args, host_scalars=()):
    """adam_step_lowp_ on the op's arguments (fastops/_specs/adam_lowp.py); ``host_scalars``: see
    ``_common.StepScalars``."""
    a = LOWP.Args(*args)
    if len(a.params) == 0:
        return
    eight_bit = StateFormat.of(a.exp_avgs) is StateFormat.EIGHT_BIT
    _adam.launch(
        "adam_step_lowp_", _adam_lowp_kernel, a, host_scalars,
        lambda i: (a.exp_avg_absmax[i].data_ptr() if eight_bit else 0,
                   a.exp_avg_sq_absmax[i].data_ptr() if eight_bit else 0, i),
        (_codec.seed_i32(a.seed), *_codec.qmaps(a.params[0].device)),
        EIGHT_BIT=eight_bit, ROWS=block_sizes("adam_lowp")[1] // _quant.BLOCK,
    )  # fmt: skip
