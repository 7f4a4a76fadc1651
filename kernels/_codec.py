"""The low-precision state formats of fastops/_quant.py in Triton, bit for bit: 8-bit blockwise codes (decode by
table, encode by arithmetic on the map's decades) and bf16 with stochastic rounding.

States move as [ROWS, 256] tiles: one row is one quantization block along memory, so a block's absmax is a row
reduction and its scale broadcasts back along the row without leaving the tile's layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastops import _quant

from ._common import ld, st

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
def _decade(a, t1, t2, t3, t4, t5, t6):
    # How many of the thresholds T[1..6] a reaches: the decade index 0..6.
    return ((a >= t1).to(tl.int32) + (a >= t2).to(tl.int32) + (a >= t3).to(tl.int32)
            + (a >= t4).to(tl.int32) + (a >= t5).to(tl.int32) + (a >= t6).to(tl.int32))  # fmt: skip


@triton.jit
def _encode(x, SIGNED: tl.constexpr):
    """fp32 ``x`` (state / absmax) -> uint8 code, _quant.encode's operations in its order."""
    if SIGNED:
        a = tl.abs(x)
        i = _decade(a, _ST1, _ST2, _ST3, _ST4, _ST5, _ST6)
        p = _pick(i, _SP0, _SP1, _SP2, _SP3, _SP4, _SP5, _SP6)
        f = _pick(i, _SF0, _SF1, _SF2, _SF3, _SF4, _SF5, _SF6)
        n = 1 << i
        t7 = _ST7
        t0 = _ST0
    else:
        a = x
        i = _decade(a, _UT1, _UT2, _UT3, _UT4, _UT5, _UT6)
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
def mix32(x):
    # _quant.mix32 on uint32 (products wrap mod 2**32).
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _round_bf16_sr(x, r16):
    """_quant.round_bf16_stochastic: ``r16`` (uint32 below 2**16) added under the bf16 mantissa. An infinity needs no
    case of its own (0x7F800000 + 0xFFFF truncates to 0x7F80 again); a nan's payload could carry into the sign."""
    out = (x.to(tl.uint32, bitcast=True) + r16) >> 16
    out = tl.where(x != x, 0x7FC0, out)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


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


_GOLDEN = tl.constexpr(_quant.GOLDEN)


@triton.jit
def _sr_block_keys(key, blk):
    """_quant.sr_block_keys of the block indices ``blk`` (int64), as uint32."""
    return mix32((blk & 0xFFFFFFFF).to(tl.uint32) ^ key) ^ (blk >> 32).to(tl.uint32)


@triton.jit
def sr_key(seed, index):
    """_quant.sr_key(seed, index): the tensor's position in the op's lists, not in its dtype group."""
    return mix32(seed.to(tl.uint32) ^ mix32((index + 0x9E3779B9).to(tl.uint32)))


@triton.jit
def decode(m_ptr, v_ptr, ma_ptr, va_ptr, qs_ptr, qu_ptr, offs, mask, blk0, r, nblocks,
           EIGHT_BIT: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """The tile's exp_avg and exp_avg_sq as fp32. offs: [ROWS, 256] element indices, row k of them block blk0 + k;
    r: [ROWS, 1] row numbers. Masked lanes decode to 0 (code 0, or a bf16 0)."""
    if EIGHT_BIT:
        m = tl.load(qs_ptr + ld(m_ptr, offs, mask, EVEN).to(tl.int32)) * _row_scalars(ma_ptr, blk0, r, nblocks, EVEN)
        v = tl.load(qu_ptr + ld(v_ptr, offs, mask, EVEN).to(tl.int32)) * _row_scalars(va_ptr, blk0, r, nblocks, EVEN)
    else:
        m = ld(m_ptr, offs, mask, EVEN).to(tl.float32)
        v = ld(v_ptr, offs, mask, EVEN).to(tl.float32)
    return m, v


@triton.jit
def encode(m, v, m_ptr, v_ptr, ma_ptr, va_ptr, key, offs, mask, blk0, r, c, nblocks,
           EIGHT_BIT: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """Writes the fp32 tile states back in their format; ``key``: the tensor's sr_key (bf16)."""
    if EIGHT_BIT:
        # Masked lanes hold m = v = 0 (codes 0 decode to 0, grads 0), so they never raise a block's max.
        # nan propagates into the max as torch.amax does: its block then decodes to nan.
        ma = _max_nan_rows(tl.abs(m))
        va = _max_nan_rows(v)
        st(m_ptr, offs, _encode(tl.div_rn(m, ma), True), mask, EVEN)
        st(v_ptr, offs, _encode(tl.div_rn(v, va), False), mask, EVEN)
        _store_rows(ma_ptr, blk0, ma, r, c, nblocks, EVEN)
        _store_rows(va_ptr, blk0, va, r, c, nblocks, EVEN)
    else:
        # _quant.sr_bits: each row's block key, then mix32 of the Weyl counter kb + j * GOLDEN an element.
        kb = _sr_block_keys(key, (blk0 + r).to(tl.int64))
        bits = mix32(kb + c.to(tl.uint32) * tl.full(c.shape, _GOLDEN, tl.uint32))
        st(m_ptr, offs, _round_bf16_sr(m, bits & 0xFFFF), mask, EVEN)
        st(v_ptr, offs, _round_bf16_sr(v, bits >> 16), mask, EVEN)


_QMAPS: dict = {}


def qmaps(device: torch.device):
    """(signed, unsigned) decode tables on ``device``, one upload per device."""
    if device not in _QMAPS:
        _QMAPS[device] = (_quant.QMAP_SIGNED.to(device), _quant.QMAP_UNSIGNED.to(device))
    return _QMAPS[device]


def seed_i32(seed: int) -> int:
    # The seed's low 32 bits as a signed int32, so every seed launches the same (i32) signature.
    lo = int(seed) & 0xFFFFFFFF
    return lo - (1 << 32) if lo >= 1 << 31 else lo
