"""The C++ CPU kernels' low-precision states under every ISA level this machine runs (default, avx2, avx512 and
avx512_vbmi: each one has its own 8-bit encoder or decoder in csrc/cpu/codec_isa.h, and its own vector width for the
bf16 states' stochastic rounding), each in a subprocess with FASTOPS_CPU_CAPABILITY (and torch's ATEN_CPU_CAPABILITY,
so that the reference's own kernels place their FMAs as the fastops level does) set before import. Codes, absmax,
bf16 states and step counters must equal the reference's bit for bit, on inputs built to land on the codec's edges,
on partial blocks of the rounding stream and on nan, inf and overflowing values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastops
from fastops import _backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = ("default", "avx2", "avx512", "avx512_vbmi")
ATEN = {"default": "default", "avx2": "avx2", "avx512": "avx512", "avx512_vbmi": "avx512"}


def _supported():
    if _backend._C is None:
        return []
    best = fastops._C.cpu_capability()
    if best not in LEVELS:  # a -march=native build names its one table after its flags
        pytest.fail(f"unknown fastops CPU capability {best!r}")
    return list(LEVELS[: LEVELS.index(best) + 1])


# Run in the subprocess: the op against the reference on edge inputs, then the outputs saved for the parent.
WORKER = r"""
import sys, torch
import fastops
from fastops import _backend, _quant, reference
from fastops._specs.adam_lowp import inputs as lowp_inputs
from tests.devices import clone as _clone
from tests.test_lowp_ops import assert_step_matches as _assert_step_matches
from tests.test_lowp_ops import reference_step as _reference_step

level, out = sys.argv[1], sys.argv[2]
assert fastops._C.cpu_capability() == level, (fastops._C.cpu_capability(), level)
cpp = _backend.load("cpp", "cpu")


def edge_values(signed):
    # Normalized values on the codec's edges: each map value, its fp32 neighbours, the fp32 midpoints between
    # neighbouring map values and theirs, the decade boundaries T, zeros, -0.0, denormals, 1.0 (the absmax).
    q = (_quant.QMAP_SIGNED if signed else _quant.QMAP_UNSIGNED).double()
    s = torch.sort(q).values
    mids = ((s[1:] + s[:-1]) / 2).float()
    t = torch.tensor(_quant.constants(signed)["T"])
    base = torch.cat([q.float(), mids, t, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 5e-39, 1.0])])
    vals = torch.cat([base, torch.nextafter(base, torch.full_like(base, 2.0)),
                      torch.nextafter(base, torch.full_like(base, -2.0))]).clamp(-1.0, 1.0)
    return vals if signed else vals.abs()


def edge_case(scale):
    # beta1 = 0 makes the new exp_avg the grad itself (lerp with weight 1 is g - (g - m) * 0), so the encoder sees
    # exactly these values; beta2 = 0 makes exp_avg_sq = g * g. Blocks of 256 hold 1.0 * scale first (the block's
    # absmax), a block of zeros, and a tail of 77 elements.
    vals = edge_values(True)
    n = (vals.numel() + 255) // 256 * 256
    g = torch.zeros(n + 256 + 77)
    g[: vals.numel()] = vals
    for b in range(0, n, 256):
        g[b] = 1.0
    g[n + 256 :] = vals[:77]
    g = g * scale
    args = lowp_inputs([g.numel(), 300], gen_seed=3)
    return args._replace(grads=[g, torch.randn(300, generator=torch.Generator().manual_seed(1)) * 1e-2], beta1=0.0,
                         beta2=0.0)


def bf16_case(beta1, **kw):
    # bf16 states: partial blocks and a tensor under one block; nan, inf and huge grads (a nan state, an inf state,
    # a state that rounds up to inf) in the first tensor. beta1 picks torch's lerp formula (weight 1 - beta1 below or
    # from 0.5), which the bf16 loop takes as a template argument.
    args = lowp_inputs([4096, 1000, 257, 31], fmt="bf16", **kw)
    g = _quant.memory_flat(args.grads[0])  # a view, also of a transposed grad
    g[5], g[300], g[301], g[302] = float("nan"), float("inf"), -float("inf"), 3.4e38
    return args._replace(beta1=beta1)


cases = [edge_case(1.0), edge_case(3.7e-3), edge_case(2.0**-70), lowp_inputs([4096, 1000, 257, 31]),
         lowp_inputs([3000, 700], weight_decay=0.1, decoupled=False, maximize=True, scale=torch.tensor(1024.0)),
         bf16_case(0.9), bf16_case(0.3, seed=-(2**40) + 7),
         bf16_case(0.9, dtype=torch.float16, master=True, weight_decay=0.1, decoupled=False, maximize=True,
                   scale=torch.tensor(1024.0)),
         bf16_case(0.9, dtype=torch.bfloat16, weight_decay=0.1), bf16_case(0.9, maximize=True),
         bf16_case(0.5, shapes=[(70, 90), (33,), (300, 5), (2,)])]
outs = []
for want in cases:
    got = _clone(want)
    _reference_step(*want)
    cpp.adam_step_lowp_(*got)
    for k in ("params", "master_params"):  # a nan or inf grad leaves a nan param: in the same places, then out of
        for a, b in zip(getattr(got, k), getattr(want, k)):  # the ulp count
            assert torch.equal(a.isnan(), b.isnan()), k
            a[a.isnan()], b[b.isnan()] = 0, 0
    _assert_step_matches(got, want)  # codes, absmax, bf16 states, steps bit for bit; params as test_lowp_ops argues
    outs.append([getattr(got, k) for k in ("params", "exp_avgs", "exp_avg_sqs", "exp_avg_absmax", "exp_avg_sq_absmax")])
torch.save(outs, out)
"""


def _run(level, tmp_path):
    out = tmp_path / f"{level}.pt"
    env = {**os.environ, "FASTOPS_CPU_CAPABILITY": level, "ATEN_CPU_CAPABILITY": ATEN[level]}
    proc = subprocess.run([sys.executable, "-c", WORKER, level, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"level {level}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return torch.load(out)


def test_levels_cover_the_machine():
    # On an x86-64 machine with AVX2 the multi-ISA build must reach at least avx2 (else the test below checks
    # nothing but the scalar codec).
    levels = _supported()
    assert levels, "fastops._C did not load"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2 " in flags and " fma " in flags:
        assert "avx2" in levels


@pytest.mark.parametrize("level", LEVELS)
def test_codec_matches_reference_at_level(level, tmp_path):
    if level not in _supported():
        pytest.skip(f"this CPU does not run the {level} kernels")
    _run(level, tmp_path)


def test_fma_levels_agree_bit_for_bit(tmp_path):
    # avx2, avx512 and avx512_vbmi run the same fp32 operations with the same FMAs and differ only in how the
    # codec is vectorised, so params as well as states must be identical between them.
    levels = [lv for lv in _supported() if lv != "default"]
    if len(levels) < 2:
        pytest.skip("fewer than two FMA levels on this CPU")
    outs = {lv: _run(lv, tmp_path) for lv in levels}
    first = outs[levels[0]]
    for lv in levels[1:]:
        for c, (a_case, b_case) in enumerate(zip(first, outs[lv])):
            for a_list, b_list in zip(a_case, b_case):
                for a, b in zip(a_list, b_list):
                    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                    assert torch.equal(a, b), (levels[0], lv, c)
