"""Triton ``dropout`` (the op: fastops/_specs/dropout.py): a [ROWS, 256] tile a program, one row one block of the
bf16 states' random stream (``_codec``), so each row's key is hashed once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastops import _quant
from fastops._specs.dropout import constants

from ._codec import _GOLDEN, QBLOCK, _sr_block_keys, mix32
from ._common import TL_DTYPE, device_scope, ld, round_to, st

_ROWS = 8


@triton.jit
def _dropout_kernel(x_ptr, out_ptr, numel, key, threshold, scale, DTYPE: tl.constexpr, ROWS: tl.constexpr,
                    EVEN: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, QBLOCK)[None, :]
    offs = row * QBLOCK + col
    mask = offs < numel
    kb = _sr_block_keys(key.to(tl.uint32), row)
    bits = mix32(kb + col.to(tl.uint32) * tl.full(col.shape, _GOLDEN, tl.uint32))
    x = ld(x_ptr, offs, mask, EVEN).to(tl.float32)
    y = x * tl.where(bits >= threshold.to(tl.uint32), scale, 0.0)
    st(out_ptr, offs, round_to(y, DTYPE), mask, EVEN)


def dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    key, threshold, scale = constants(p, seed, x.dtype)
    tile = _ROWS * _quant.BLOCK
    with device_scope(x.device):
        _dropout_kernel[(triton.cdiv(n, tile),)](x, out, n, key, threshold, scale, DTYPE=TL_DTYPE[x.dtype],
                                                 ROWS=_ROWS, EVEN=n % tile == 0)  # fmt: skip
    return out

