"""fastops::dropout: ``F.dropout(x, p, training=True)`` with the mask drawn from a counter-based hash of (``seed``,
the element's position in memory) instead of torch's generator (semantics: fastops/_ops.py). The backward is the
same op on the output's gradient with the same seed: it draws the same mask (fastops/_dropout.py)."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .. import _checks as C
from .. import _quant
from .spec import BadCall, OpSpec, Sample

SCHEMA = "dropout(Tensor x, float p, int seed) -> Tensor"


def constants(p: float, seed: int, dtype: torch.dtype) -> tuple[int, int, float]:
    """What every backend computes from (p, seed): the stream's key, the threshold and the scale.

    - key: _quant.sr_key of the seed's low and high 32 bits; element k of x's memory draws 32 bits from the bf16
      states' stream under that key (``_quant.sr_bits``).
    - threshold: an element is kept when its bits are >= round(p * 2^32), so it is dropped with probability p
      within 2^-33. p = 1 keeps every element and scales by 0, which is torch's ``x * 0`` (nan for inf and nan).
    - scale: 1 / (1 - p) rounded to x's dtype, as torch's ``noise.div_(1 - p)`` computes it on a mask of x's dtype;
      the output is x times it, rounded from fp32 (torch's ``input * noise``)."""
    key = _quant.sr_key(seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    if p == 1.0:
        return key, 0, 0.0
    threshold = min(int(round(p * 2.0**32)), 2**32 - 1)
    return key, threshold, float(torch.ones((), dtype=dtype).div_(1 - p))


def check_p(p: float) -> None:
    # F.dropout's rule and wording.
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def check_values(a) -> None:
    check_p(a.p)


def inputs(shape, dtype=torch.float32, p=0.1, seed=5, gen_seed=0, transposed=False, device="cpu"):
    """dropout's arguments (``SPEC.Args``): x ~ N(0, 1) of ``shape`` (a 2-D one transposed: dense, not contiguous)."""
    g = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(shape, generator=g).to(dtype)
    if transposed:
        x = x.t().contiguous().t()
    return SPEC.Args(x.to(device), p, seed)


def sample_inputs(device="cpu") -> Iterator[Sample]:
    """Sizes around the 256-element stream block, every dtype, p at 0, 1 and between, seeds above 32 bits and
    negative, signed zeros, subnormals and the largest floats among the kept and the dropped elements."""
    yield Sample("fp32", inputs((3, 257), device=device))
    yield Sample("bf16-half", inputs((1000,), torch.bfloat16, p=0.5, seed=2**40 + 3, device=device))
    yield Sample("fp16-transposed", inputs((37, 9), torch.float16, p=0.3, seed=-7, transposed=True, device=device))
    yield Sample("p0", inputs((300,), p=0.0, device=device))
    specials = inputs((513,), p=0.5, seed=11, device=device)
    # No inf or nan here: opcheck compares outputs without equal_nan (tests/test_dropout.py takes them).
    specials.x[:8] = torch.tensor([-0.0, 0.0, 1e38, -1e-45, 3.4e38, -3.4e38, 1e-38, 3.0])
    yield Sample("fp32-specials", specials)
    yield Sample("p1-bf16", inputs((65,), torch.bfloat16, p=1.0, device=device))
    yield Sample("empty", inputs((0, 3), device=device))


def bad_inputs(device="cpu") -> Iterator[BadCall]:
    op = "fastops.dropout"
    x = torch.ones(4, 3, device=device)
    yield BadCall("p above 1", SPEC.Args(x, 1.5, 0), ValueError,
                  "dropout probability has to be between 0 and 1, but got 1.5")
    yield BadCall("p nan", SPEC.Args(x, math.nan, 0), ValueError,
                  "dropout probability has to be between 0 and 1, but got nan")
    yield BadCall("int x", SPEC.Args(torch.ones(4, dtype=torch.int64, device=device), 0.1, 0), RuntimeError,
                  f"{op}: x has dtype torch.int64; expected float32, bfloat16 or float16")
    yield BadCall("gapped x", SPEC.Args(torch.ones(8, device=device)[::2], 0.1, 0), RuntimeError,
                  "fastops: x is not contiguous (its memory is strided with gaps or overlaps); fused kernels walk the "
                  "tensor's memory as one block")


def _result(a):
    return torch.empty_like(a.x)


SPEC = OpSpec(SCHEMA, C.dropout, check_values, _result, sample_inputs, bad_inputs)
