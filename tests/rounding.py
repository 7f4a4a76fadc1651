"""Tolerances for comparing two fp32 runs of one computation that differ only in the order of their sums.

Another rank count, a sharded matmul, an all-reduce or a chunked reduction sums the same terms in another order.
Neither result is the exact one: each carries rounding of the same kind and size, which training steps then
carry forward. A fixed rtol measured on one machine holds only as long as that machine rounds the same way (an
AVX-512 machine sums in 16 lanes where an AVX2 one sums in 8). So the bound is measured in the test itself: the
same run in float64 stands for the exact answer, and a run in another order must be as accurate as the plain fp32
run, within FACTOR of its worst error over the series. The two are independent rounding walks of the same size:
over the 30 comparisons of tests/test_model_parallel.py (TP, FSDP2 x TP, pipelines at 2 and 4 ranks) on an
AVX-512 machine the run in another order had 0.18x to 1.9x the one-process run's error.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # fp32's unit roundoff
FACTOR = 4.0
FLOOR = 16 * U32  # where the plain fp32 run happens to round exactly, a few ulps still separate the orders


def rel_err(got, exact) -> float:
    """The worst relative error of a series of floats (element by element), or of a tensor (normwise: elements
    near zero carry no relative meaning of their own)."""
    if isinstance(exact, torch.Tensor):
        exact = exact.double()
        return float((got.double() - exact).norm() / exact.norm().clamp_min(1e-300))
    return max(abs(float(g) - float(e)) / max(abs(float(e)), 1e-300) for g, e in zip(got, exact, strict=True))


def rtol_of(fp32, exact, factor: float = FACTOR) -> float:
    """The tolerance a run in another summation order gets: ``factor`` times the plain fp32 run's own error."""
    return max(factor * rel_err(fp32, exact), FLOOR)


def assert_as_accurate(got, fp32, exact, factor: float = FACTOR, what: str = "") -> None:
    """``got`` (the run in another order) is within ``factor`` times the plain fp32 run's error of the exact one."""
    rtol = rtol_of(fp32, exact, factor)
    err = rel_err(got, exact)
    assert err <= rtol, (
        f"{what}: relative error {err:.2e} against float64, more than {factor:g}x the one-process fp32 run's "
        f"{rel_err(fp32, exact):.2e} (floor {FLOOR:.1e})"
    )


def assert_orders_agree(a, b, fp32, exact, factor: float = FACTOR, what: str = "") -> None:
    """Two runs in other orders than ``fp32``'s (neither exact): each within ``factor`` times its error of the exact
    run, so within twice that of each other. For runs that continue from one checkpoint, the error of the whole
    uninterrupted fp32 run bounds what the continued steps add."""
    rtol = 2 * rtol_of(fp32, exact, factor)
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: relative difference {err:.2e}, more than {rtol:.2e} (2 x {factor:g} x fp32's own error)"


# ---- one reduction ------------------------------------------------------------------------------------------
# An fp32 sum of n terms in any order (lanes, threads, chunks, ranks) is within (n - 1) u of the exact sum in the
# worst case, a bound real sums never approach. Modelling the rounding errors as independent and of mean zero,
# Higham and Mary (SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4) bound it by exp(lambda sqrt(n) u + n u^2/(1-u)) - 1
# with probability at least 1 - 2n exp(-lambda^2 (1-u)^2 / 2): for lambda = 8 and n = 10^6 terms, a failure in
# 4e7 comparisons. That is the bound used here, for any machine's summation order.
LAMBDA = 8.0


def sum_rtol(n: int) -> float:
    """Relative error of an fp32 sum of ``n`` nonnegative terms against the exact sum, plus the one rounding of
    each term (a square, the unscale multiply)."""
    m = max(n - 1, 1)
    return math.expm1(LAMBDA * math.sqrt(m) * U32 + m * U32 * U32 / (1 - U32)) + U32


def norm_rtol(n: int) -> float:
    """The same for the 2-norm of ``n`` elements: the square root halves the sum's relative error and rounds once."""
    return sum_rtol(n) / 2 + U32
