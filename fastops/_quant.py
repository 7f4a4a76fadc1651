"""Low-precision optimizer states: the 8-bit blockwise format and bf16 stochastic rounding, in plain torch.

This module is the definition every backend reproduces bit for bit (the reference op, the C++ and CUDA
kernels and the Triton kernels), and what the optimizer uses to convert states on load and export.

8-bit ("8bit")
    A state tensor is stored as uint8 codes shaped like its param, plus one fp32 absmax per block of 256
    elements along the param's memory (``absmax`` has ``ceil(numel / 256)`` elements). An element's value
    is ``qmap[code] * absmax[block]``. The value sets are bitsandbytes' dynamic tree quantization maps
    (``create_dynamic_map``: 7 decades 1e-6..1, linearly spaced fractions inside each decade, the number of
    fractions doubling with the decade), signed for ``exp_avg`` and unsigned for ``exp_avg_sq``. The codes
    are laid out as that tree (sign bit, a unary decade marker, the fraction bits), not as indices into a
    sorted table, so encoding is arithmetic (no table search):

    - signed, ``c = s << 7 | r``: r = 0 is 0.0 (s = 0) or +1.0 (s = 1); otherwise decade ``i = floor(log2 r)``
      (0..6) and fraction ``j = r - 2**i``, value ``(-1)**s * 10**(i - 6) * (0.1 + 0.9 * (j + 0.5) / 2**i)``;
    - unsigned, ``c = r``: 0 is 0.0, 1 is 1.0; otherwise ``i = floor(log2 r) - 1`` and ``j = r - 2**(i + 1)``,
      value ``10**(i - 6) * (0.1 + 0.9 * (j + 0.5) / 2**(i + 1))``.

    Values are computed in fp64 and rounded to fp32 (``QMAP_SIGNED``/``QMAP_UNSIGNED``). Encoding ``x``
    (the state divided by its block's absmax, IEEE fp32 division) picks the decade by comparing ``a = |x|``
    with the fp32 midpoints between decades (``T[0]``: between 0 and the smallest value, ``T[7]``: between
    the largest fraction and 1.0), then the fraction as
    ``j = clamp(round_half_even(((a * P[i]) - 0.1) * F[i] - 0.5), 0, n_i - 1)`` with every operation an fp32
    IEEE operation in that order, no fused multiply-add (``P[i] = 10**(6 - i)``, ``F[i] = n_i / 0.9`` rounded
    to fp32, ``n_i`` the decade's number of fractions). ``!(a >= T[0])`` (nan included) encodes 0; a block
    whose absmax is 0 divides 0 by 0 and so stores code 0 everywhere. A negative ``a >= T[7]`` encodes the
    largest negative fraction (the signed map has +1.0 but not -1.0, as bitsandbytes').

bf16 ("bf16")
    States stored as bf16, written with stochastic rounding: 16 random bits are added to the fp32 value's
    bits below the bf16 mantissa before truncation (nan stays nan, inf stays inf). The bits depend only on
    (seed, the tensor's position in the op's lists, the element's flat memory index), so a run is deterministic
    for a given seed whatever the backend and thread count. ``sr_bits`` gives each element 32 of them:
    ``exp_avg`` takes the low 16, ``exp_avg_sq`` the high 16.

    The stream: each block of 256 elements along memory (the 8-bit block) has a key ``kb = mix32(key ^ lo32(block))
    ^ hi32(block)`` (``sr_block_keys``), and element ``j`` of the block (0..255) draws ``mix32(kb + j * GOLDEN)``
    (mod 2**32): one ``mix32`` an element and one a block. Its statistics are tests/test_sr_stream.py's: every
    rounding unbiased, no correlation between the elements of a block (nor inside each block alone), across
    blocks, tensors or steps. It replaced a hash of the element index itself, ``mix32(key ^ lo32(k) ^ hi32(k) *
    0x85EBCA6B)``, whose bits correlated between elements 96 apart (-0.0034 over 1.3e8 pairs, 39 standard
    errors). Cheaper streams were measured and not taken: a multiply-add an element (``(a * j + b) >> 16`` with
    ``a``, ``b`` from the block key, pairwise independent) is a linear sequence inside each block, whose
    neighbours correlate by as much as ``a`` decides (a block's lag-1 correlation spreads 7x as far as with
    independent bits); one multiply an element (``mix32`` with one round) correlates elements of a block at 0.05.
"""

from __future__ import annotations

import enum
import math

import torch

BLOCK = 256
# Params with fewer elements keep fp32 states under state_dtype="8bit" (bitsandbytes' and torchao's rule: the
# absmax overhead and the quantization error buy nothing on biases and norms).
MIN_8BIT_NUMEL = 4096

_M32 = 0xFFFFFFFF


class StateFormat(str, enum.Enum):
    """How Adam's two moments are stored: the values of fastops.optim's ``state_dtype``, and what an op tells from
    the dtype of its ``exp_avgs`` (``of``). The one name of the concept in Python (csrc/state_format.h in C++)."""

    FP32 = "fp32"
    BF16 = "bf16"
    EIGHT_BIT = "8bit"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the moments are stored in (8-bit: the codes)."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[self.value]

    @classmethod
    def of(cls, exp_avgs) -> StateFormat | None:
        """The format of an op's states, from the dtype of ``exp_avgs``; None for a dtype no format stores. A call
        without tensors counts as 8-bit (its absmax lists are then as empty as bf16's)."""
        dtype = exp_avgs[0].dtype if len(exp_avgs) else torch.uint8
        return next((f for f in cls if f.dtype == dtype), None)


def _decade_values(i: int, n: int) -> list[float]:
    return [10.0 ** (i - 6) * (0.1 + 0.9 * (j + 0.5) / n) for j in range(n)]


def _build(signed: bool):
    """(qmap as fp64 list, thresholds T[0..7], P[0..6], F[0..6], n[0..6]) of one map."""
    q = [0.0] * 256
    ns = [2**i if signed else 2 ** (i + 1) for i in range(7)]
    for i, n in enumerate(ns):
        for j, v in enumerate(_decade_values(i, n)):
            r = n + j  # signed: 2**i + j; unsigned: 2**(i+1) + j
            q[r] = v
            if signed:
                q[128 | r] = -v
    if signed:
        q[0], q[128] = 0.0, 1.0
    else:
        q[0], q[1] = 0.0, 1.0
    lo = [_decade_values(i, n)[0] for i, n in enumerate(ns)]
    hi = [_decade_values(i, n)[-1] for i, n in enumerate(ns)]
    t = [lo[0] / 2] + [(hi[i - 1] + lo[i]) / 2 for i in range(1, 7)] + [(hi[6] + 1.0) / 2]
    p = [10.0 ** (6 - i) for i in range(7)]
    f = [n / 0.9 for n in ns]
    return q, t, p, f, ns


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


_SIGNED = _build(True)
_UNSIGNED = _build(False)
QMAP_SIGNED = _f32(_SIGNED[0])
QMAP_UNSIGNED = _f32(_UNSIGNED[0])


def constants(signed: bool) -> dict[str, list[float]]:
    """The fp32 constants of one map as Python floats (exactly representable in fp32): ``qmap`` (256),
    ``T`` (8 thresholds), ``P`` and ``F`` (7 each), ``n`` (7 fraction counts). The kernels bake these in."""
    q, t, p, f, ns = _SIGNED if signed else _UNSIGNED
    return {"qmap": _f32(q).tolist(), "T": _f32(t).tolist(), "P": _f32(p).tolist(), "F": _f32(f).tolist(), "n": ns}


_CONST = {s: {k: (torch.tensor(v, dtype=torch.float32) if k != "n" else torch.tensor(v)) for k, v in constants(s).items()}
          for s in (True, False)}  # fmt: skip


def encode(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 ``x`` (a state divided by its absmax) -> uint8 codes, as the module docstring defines."""
    c = _CONST[signed]
    x = x.float()
    a = x.abs() if signed else x
    t = c["T"]
    i = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for k in range(1, 7):
        i += (a >= t[k]).long()
    pi, fi, ni = c["P"].to(x.device)[i], c["F"].to(x.device)[i], c["n"].to(x.device)[i]
    tt = ((a * pi) - torch.tensor(0.1, dtype=torch.float32)) * fi - torch.tensor(0.5, dtype=torch.float32)
    j = torch.round(tt).clamp_(min=0).long()
    j = torch.minimum(j, ni - 1)
    r = ni + j
    if signed:
        neg = x < 0
        top = torch.where(neg, torch.full_like(r, 0xFF), torch.full_like(r, 0x80))
        code = torch.where(neg, r | 0x80, r)
    else:
        top = torch.ones_like(r)
        code = r
    code = torch.where(a >= t[7], top, code)
    code = torch.where(a >= t[0], code, torch.zeros_like(code))  # nan and tiny values: code 0
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    qmap = (QMAP_SIGNED if signed else QMAP_UNSIGNED).to(codes.device)
    return qmap[codes.long()]


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in memory order (what the kernels walk), for any dimension order."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    flat = t.permute(order)
    if not flat.is_contiguous():
        raise RuntimeError(f"fastops: a tensor of shape {tuple(t.shape)} and strides {t.stride()} is not dense")
    return flat.reshape(-1)


def n_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def _per_element(absmax: torch.Tensor, numel: int) -> torch.Tensor:
    return absmax.repeat_interleave(BLOCK)[:numel]


def quantize(state: torch.Tensor, signed: bool, codes: torch.Tensor | None = None, absmax: torch.Tensor | None = None):
    """fp32 ``state`` -> (uint8 codes laid out like ``state``, fp32 absmax of ``n_blocks`` elements); into
    ``codes``/``absmax`` when given. The block max propagates nan (as torch.amax), so a nan makes its whole
    block decode to nan instead of hiding it."""
    flat = memory_flat(state).float()
    n = flat.numel()
    if codes is None:
        codes = torch.empty_like(state, dtype=torch.uint8, memory_format=torch.preserve_format)
    if absmax is None:
        absmax = torch.empty(n_blocks(n), dtype=torch.float32, device=state.device)
    if n == 0:
        return codes, absmax
    padded = torch.zeros(n_blocks(n) * BLOCK, dtype=torch.float32, device=state.device)
    padded[:n] = flat.abs() if signed else flat
    absmax.copy_(padded.view(-1, BLOCK).amax(dim=1))
    memory_flat(codes).copy_(encode(flat / _per_element(absmax, n), signed))
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 ``codes`` and their absmax -> fp32 laid out like ``codes``."""
    out = torch.empty_like(codes, dtype=torch.float32, memory_format=torch.preserve_format)
    flat = memory_flat(codes)
    if flat.numel():
        memory_flat(out).copy_(decode(flat, signed) * _per_element(absmax, flat.numel()))
    return out


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 x < 2**32 without overflowing int64: c split in 16-bit halves.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32 constants), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sr_key(seed: int, index: int) -> int:
    """The 32-bit key of the tensor at ``index`` in an op's lists: ``mix32(seed_lo32 ^ mix32(index + golden))``."""
    return mix32_int((seed & _M32) ^ mix32_int(index + 0x9E3779B9))


GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: the step of a block's Weyl counter


def sr_block_keys(key: int, blocks: torch.Tensor) -> torch.Tensor:
    """The key of each block index in ``blocks`` (int64 tensor): ``mix32(key ^ lo32(block)) ^ hi32(block)``."""
    return mix32((blocks & _M32) ^ key) ^ (blocks >> 32)


def sr_bits(key: int, numel: int, device=None) -> torch.Tensor:
    """32 random bits (int64 tensor) for flat elements 0..numel-1: element j = k % 256 of block k // 256 draws
    ``mix32(kb + j * GOLDEN)``, kb the block's ``sr_block_keys``."""
    k = torch.arange(numel, dtype=torch.int64, device=device)
    kb = sr_block_keys(key, torch.arange(n_blocks(numel), dtype=torch.int64, device=device))
    return mix32((kb[k >> 8] + (k & (BLOCK - 1)) * GOLDEN) & _M32)  # j * GOLDEN < 2**40: exact in int64


def round_bf16_stochastic(x: torch.Tensor, rand16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (1-D) -> bf16, adding ``rand16`` (int64, 0..65535 per element) below the bf16 mantissa."""
    bits = x.float().view(torch.int32).to(torch.int64) & _M32
    finite = torch.isfinite(x)
    out = torch.where(finite, (bits + rand16) >> 16, bits >> 16)
    out = torch.where(torch.isnan(x), torch.full_like(out, 0x7FC0), out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.bfloat16)



def _hex_literal(v: float) -> str:
    """``v`` as a C float literal that holds its fp32 bits exactly (hex float; 0 written plainly)."""
    return f"{float(v).hex()}f" if v != 0 else "0.0f"


def qmaps_header() -> str:
    """The text of csrc/cuda/qmaps.cuh: the 8-bit maps' values and the encoder's fp32 constants of this module as
    hex float literals, so the CUDA kernels hold them bit for bit (fastops/_specs/codegen.py writes it,
    tests/test_generated.py compares the file)."""
    out = ["// Generated by `python -m fastops._specs.codegen` from fastops._quant.qmaps_header()",
           "// (tests/test_generated.py fails when this file and fastops/_quant.py drift apart): the 8-bit",
           "// maps' values and the encoder's fp32 constants, bit for bit (hex float literals). A host build",
           "// (csrc/cuda/host_device.h) has them as plain arrays.",
           "#pragma once", "", "namespace fastops {", "namespace cuda {", ""]  # fmt: skip
    for signed, tag in ((True, "kSigned"), (False, "kUnsigned")):
        c = constants(signed)
        q = c["qmap"]
        body = ",\n    ".join(", ".join(_hex_literal(v) for v in q[i:i + 6]) for i in range(0, len(q), 6))
        out.append(f"__device__ __constant__ float {tag}Qmap[256] = {{\n    {body}}};\n")
        for name, n in (("T", 8), ("P", 7), ("F", 7)):
            out.append(f"__device__ __constant__ float {tag}{name}[{n}] = {{{', '.join(_hex_literal(v) for v in c[name])}}};")
        out.append("")
    out += ["}  // namespace cuda", "}  // namespace fastops", ""]
    return "\n".join(out)
