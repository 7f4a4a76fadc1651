"""Triton Adam/AdamW step on fp32 states (``adam_step_``): every param of one dtype on a device in one launch, the
update, step scalars and launcher of ``_adam.py`` over 1-D blocks of BLOCK elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from fastops._specs.adam import SPEC as ADAM

from . import _adam
from ._adam import FIRST_OWN
from ._common import block_sizes, ld, st, table_ptr

# This op's own column of the tensor table: max_exp_avg_sq (0 without amsgrad).
_VMAX = FIRST_OWN


@triton.jit
def _adam_block(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel, hyper, step_scalars,
    P_DTYPE: tl.constexpr, EVEN: tl.constexpr, SCALE: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr, LERP_SMALL: tl.constexpr,
    EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    p, g, mask = _adam.load_param_grad(p_ptr, g_ptr, w_ptr, offs, numel, MASTER, EVEN)
    m = ld(m_ptr, offs, mask, EVEN)
    v = ld(v_ptr, offs, mask, EVEN)
    p, m, v = _adam.update(p, g, m, v, vmax_ptr, offs, mask, hyper, step_scalars, SCALE, AMSGRAD, MAXIMIZE, WD,
                           LERP_SMALL, EMULATE_FMA, EVEN)  # fmt: skip
    st(m_ptr, offs, m, mask, EVEN)
    st(v_ptr, offs, v, mask, EVEN)
    _adam.store_param(p, p_ptr, w_ptr, offs, mask, P_DTYPE, MASTER, EVEN)


@triton.jit
def _adam_kernel(
    common, BLOCK: tl.constexpr, AMSGRAD: tl.constexpr,
    P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, COLS: tl.constexpr, LR_PTR: tl.constexpr, SCALE: tl.constexpr,
    FOUND_INF: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr, MASTER: tl.constexpr,
    LERP_SMALL: tl.constexpr, ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr,
):  # fmt: skip
    # common: _adam.launch's arguments, read by program_scalars.
    row, start, numel, step_scalars, hyper = _adam.program_scalars(common, COLS, CHUNK, LR_PTR, SCALE, FOUND_INF)
    p_ptr, g_ptr, m_ptr, v_ptr, w_ptr = _adam.table_ptrs(row, P_DTYPE, tl.float32, ALIGNED)
    vmax_ptr = table_ptr(row, _VMAX, tl.float32, ALIGNED)
    if start + CHUNK <= numel:
        # Full chunk: no mask, so the accesses can be 16-byte vectors.
        for off in range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, numel, hyper, step_scalars,
                P_DTYPE, True, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL, EMULATE_FMA,
            )  # fmt: skip
    else:
        # (Loop names differ from the branch above: Triton merges same-named values of both branches, and
        # this trip count is int64.)
        for tail_off in range(0, numel - start, BLOCK):
            tail_offs = start + tail_off + tl.arange(0, BLOCK)
            _adam_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, tail_offs, numel, hyper, step_scalars,
                P_DTYPE, False, SCALE, AMSGRAD, MAXIMIZE, WD, MASTER, LERP_SMALL, EMULATE_FMA,
            )  # fmt: skip


@torch.no_grad()
def adam_step_(*args, host_scalars=()):
    """adam_step_ on the op's arguments (fastops/_specs/adam.py); ``host_scalars``: see ``_common.StepScalars``."""
    a = ADAM.Args(*args)
    _adam.launch("adam_step_", _adam_kernel, a, host_scalars,
                 lambda i: (a.max_exp_avg_sqs[i].data_ptr() if a.amsgrad else 0,),
                 BLOCK=block_sizes("adam")[1], AMSGRAD=bool(a.amsgrad))
