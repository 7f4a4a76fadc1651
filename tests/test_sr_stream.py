"""The random bits of bf16 states' stochastic rounding (fastops/_quant.py's sr_bits, which every backend reproduces bit
for bit: tests/test_lowp_ops.py, test_cpu_isa.py, test_cuda_math.py) have the statistics stochastic rounding needs:
each rounding unbiased, the roundings of any two elements of a block uncorrelated, and none tied to a place in the
block, to the block, to the tensor or to the step.

Each check is a z-score against the spread the statistic would have with independent uniform bits, held under 5 (with
the few hundred statistics below, a false alarm under independence is about 1 in 3000, and the seeds are fixed, so a
pass is a pass for good). The per-element hash the stream replaced fails the lag check (see
test_the_lag_check_flags_the_old_per_element_hash), so the check can fail.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fastops import _ops as ops
from fastops import _quant

Z = 5.0
BLOCK = _quant.BLOCK


def _bits(keys, numel):
    """sr_bits of ``numel`` elements for each key: (m, v) 16-bit values as float64, shape (len(keys), numel)."""
    b = torch.stack([_quant.sr_bits(k, numel) for k in keys])
    return (b & 0xFFFF).double(), (b >> 16).double()


def _keys(n, index=0):
    return [_quant.sr_key(step * 0x61C88647 + 12345, index) for step in range(n)]


def _lag_z(x, y):
    """z-scores of the correlation of x[..., j] with y[..., j + d] inside a block, pooled over blocks and over j, for
    d = 0..255: x and y hold uniform values on [0, 2^16) (or 0/1 indicators), shape (rows, numel)."""
    x = x.reshape(-1, BLOCK)
    y = y.reshape(-1, BLOCK)
    x = ((x - x.mean()) / x.std()).float()
    y = ((y - y.mean()) / y.std()).float()
    c = (x.T @ y).double()  # c[j, j'] = sum over blocks of x_j y_j' (fp32: its rounding is far below the spread)
    return torch.stack([torch.diagonal(c, d).sum() / math.sqrt(x.shape[0] * (BLOCK - d)) for d in range(BLOCK)])


M, V = _bits(_keys(64), 64 * BLOCK)  # 64 steps x 64 blocks x 256 elements


def _fraction_and_ulp(x):
    """Where |x| (fp32, finite, normal) sits between its two bf16 neighbours: the fraction f of the gap, and the gap."""
    bits = x.abs().view(torch.int32)
    lo = (bits & ~0xFFFF).view(torch.float32).double()
    hi = ((bits & ~0xFFFF) + 0x10000).view(torch.float32).double()
    return (bits & 0xFFFF).double() / 2**16, hi - lo


def test_each_rounding_is_unbiased():
    # Over 300 steps, the rounded states average to the fp32 values they round, for values a fraction 1/2, 1/4, 1/16
    # and 0.999 of a bf16 gap above one, negative ones and tiny ones. Through the op itself (the backend serving the
    # CPU): beta1 = beta2 = 0 makes the new exp_avg the grad and the new exp_avg_sq its square, each rounded once.
    n, steps = 4 * BLOCK + 77, 300
    base = torch.tensor([1.0, -3.0, 1.5e-5, -(2.0**-120)]).repeat_interleave(n // 4 + 1)[:n]
    f = torch.tensor([0.5, 0.25, 1 / 16, 0.999]).repeat(n // 4 + 1)[:n]
    g = base + base * f * 2.0**-7  # exact in fp32: f of a gap above base, away from zero
    p, m, v = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    err_m, err_v = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        ops.adam_step_lowp_([p], [g], [m], [v], [], [], [torch.tensor(0.0)], [], torch.tensor(0.0), 0.0, 0.0, 1e-8,
                            0.0, False, True, step * 7919 + 3, None, None)  # fmt: skip
        err_m += m.double() - g.double()
        err_v += v.double() - (g * g).double()  # beta2 = 0: exp_avg_sq = fp32(g * g), rounded once
    for err, x in ((err_m, g), (err_v, g * g)):
        frac, gap = _fraction_and_ulp(x)
        for k in range(4):  # each fraction on its own
            sel = torch.arange(n) % 4 == k
            # A rounding is off by (1 - f) gap with probability f, else by -f gap: variance f (1 - f) gap^2 a step.
            se = (steps * (frac[sel] * (1 - frac[sel]) * gap[sel].square()).sum()).sqrt() / (steps * sel.sum())
            mean = err[sel].sum() / (steps * sel.sum())
            assert abs(mean) < Z * se, (k, float(mean), float(se))


def test_no_correlation_between_the_elements_of_a_block():
    # The 16 random bits of element j against those of element j + d of the same block, d = 1..255, for exp_avg's and
    # exp_avg_sq's streams and between them (d = 0 included: the two states of one element), pooled over 4096 blocks
    # (64 steps of one 16384-element tensor); and the same for the top bit alone (the rounding of a value halfway
    # between two bf16 values).
    for x, y, d0 in ((M, M, 1), (V, V, 1), (M, V, 0), (V, M, 1)):
        for a, b in ((x, y), ((x >= 2**15).double(), (y >= 2**15).double())):
            z = _lag_z(a, b)[d0:]
            assert z.abs().max() < Z, (int(z.abs().argmax()) + d0, float(z.abs().max()))


def _per_block_lag_sd(x, lags=(1, 2, 3, 17, 128)):
    """For each lag d, the spread over blocks of a block's own lag-d correlation, over what independent bits give
    (1 / sqrt(256 - d)): 1 for independent bits, whatever the pooled correlation."""
    x = x.reshape(-1, BLOCK)
    x = (x - x.mean()) / x.std()
    return torch.tensor([float((x[:, :-d] * x[:, d:]).mean(1).std() * math.sqrt(BLOCK - d)) for d in lags])


def test_each_block_alone_looks_independent():
    # Pooled over blocks, a stream can be uncorrelated while each block on its own is not: a multiply-add an element,
    # (a * j + b) >> 16 with random a and b per block, is pairwise independent (Dietzfelbinger's multiply-add-shift),
    # yet within a block it is a linear sequence whose neighbours correlate by as much as the block's a decides (a
    # spread 7x that of independent bits, the stream this test refuses). Over 4096 blocks the spread's estimate is
    # within 1.1% of its value; the bound allows 5 times that.
    for x in (M, V, (M >= 2**15).double()):
        ratio = _per_block_lag_sd(x)
        assert (ratio - 1).abs().max() < 0.055, ratio
    k = torch.arange(4096 * BLOCK, dtype=torch.int64)
    a, b = (_quant.mix32(k[::BLOCK] * 2 + t) for t in (1, 2))  # a, b per block from a hash
    linear = ((a[:, None] * torch.arange(BLOCK) + b[:, None]) & 0xFFFFFFFF) >> 16
    assert (_per_block_lag_sd(linear.double()) - 1).abs().max() > 1


def test_each_place_in_a_block_is_uniform():
    # Per element j of a block, over 4096 blocks: the mean of the 16 bits and the share of each top-2-bit quarter.
    for x in (M, V):
        col = x.reshape(-1, BLOCK)
        rows = col.shape[0]
        z_mean = (col.mean(0) - (2**16 - 1) / 2) / ((2**32 - 1) / 12 / rows) ** 0.5
        assert z_mean.abs().max() < Z, float(z_mean.abs().max())
        quarter = (col // 2**14).long()
        for q in range(4):
            share = (quarter == q).double().mean(0)
            z = (share - 0.25) / (0.25 * 0.75 / rows) ** 0.5
            assert z.abs().max() < Z, (q, float(z.abs().max()))


def test_no_correlation_across_blocks_tensors_and_steps():
    # Element j of a block against element j of the next block, of the same block at the next step, and of the
    # tensor at the next position in the op's lists (another key).
    rows_m = M.reshape(64, -1, BLOCK)
    other = _bits(_keys(64, index=1), 64 * BLOCK)[0].reshape(64, -1, BLOCK)

    def z(a, b):
        a, b = (a - a.mean()) / a.std(), (b - b.mean()) / b.std()
        return float((a * b).sum() / math.sqrt(a.numel()))

    for a, b in ((rows_m[:, :-1], rows_m[:, 1:]), (rows_m[:-1], rows_m[1:]), (rows_m, other)):
        assert abs(z(a, b)) < Z
        assert abs(z((a >= 2**15).double(), (b >= 2**15).double())) < Z


def test_the_lag_check_flags_the_old_per_element_hash():
    # The hash each element drew its 32 bits from before (mix32 of the key xor the element index): the low 16 bits of
    # elements 96 apart correlate at -0.0034 (z = -39 over 1.3e8 pairs), 80 apart at about the same, which the lag
    # check sees in 2^23 elements (z about 7).
    x = np.arange(256 * BLOCK, dtype=np.uint32)[None, :] ^ np.array(_keys(128), dtype=np.uint32)[:, None]
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):  # _quant.mix32 in uint32 (wrapping) arithmetic
        x ^= x >> np.uint32(shift)
        if mul is not None:
            x *= np.uint32(mul)
    low = torch.from_numpy((x & 0xFFFF).astype(np.float64))
    z = _lag_z(low, low)[1:]
    assert z.abs().max() >= Z, float(z.abs().max())
