"""The Triton adam_step_lowp_ (fastops.kernels.adam_lowp) against fastops.reference: 8-bit codes, absmax and bf16
states bit for bit; params within an ulp of the update plus one of the result (see _assert_match).
Under the Triton interpreter on CPU without a GPU (conftest), compiled on CUDA with one: the cuda mark puts it in
the GPU run (benchmarks/gpu_check.sh selects -m cuda); without a GPU it still runs, interpreted."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastops import _quant, reference  # noqa: E402
from fastops.kernels import adam_lowp as klowp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.cuda


def _make(mode, sizes, dtypes, master, seed=0):
    gen = torch.Generator().manual_seed(seed)
    P, G, M, V, MA, VA, S, W = ([] for _ in range(8))
    for k, (n, dt) in enumerate(zip(sizes, dtypes)):
        w = torch.randn(n, generator=gen)
        P.append(w.to(dt))
        G.append((torch.randn(n, generator=gen) * 0.5).to(dt))
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
        if n > 300:
            m[7], v[300] = 0.0, 0.0  # exact zeros and a whole-block structure
            m[256:512] = 0.0
        if mode == "8bit":
            mc, ma = _quant.quantize(m, True)
            vc, va = _quant.quantize(v, False)
            M.append(mc), V.append(vc), MA.append(ma), VA.append(va)
        else:
            M.append(m.bfloat16()), V.append(v.bfloat16())
        S.append(torch.tensor(float(3 * k)))
        if master:
            W.append(w.clone())
    return [[t.to(DEVICE) for t in lst] for lst in (P, G, M, V, MA, VA, S, W)]


def _call(fn, st, *, lr=1e-3, wd=0.01, decoupled=True, maximize=False, beta1=0.9, seed=1234, grad_scale=None,
          found_inf=None, lr_on_device=False):
    lr_t = torch.tensor(lr, device=DEVICE if lr_on_device else "cpu")
    fn(*st, lr_t, beta1, 0.999, 1e-8, wd, maximize, decoupled, seed, grad_scale, found_inf)


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _assert_match(mine, ref, before):
    """``before``: the state both stepped from. Params (and masters) may differ by one ulp of the update plus one of
    the result: the reference's sqrt is torch's, not correctly rounded (measured here: 0.7% of fp32 inputs differ
    from numpy's, which the interpreter runs), which puts an ulp into the update. When the update is larger than
    the param it lands on, that ulp is several of the result's (found: an fp32 param stepped from 1.48e-3 to
    3.92e-4 came out 2.5 of the result's ulps off, 1 of the update's)."""
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "exp_avg_absmax", "exp_avg_sq_absmax", "state_steps",
             "master_params")
    for name, la, lb, l0 in zip(names, mine, ref, before):
        for i, (a, b, b0) in enumerate(zip(la, lb, l0)):
            what = f"{name}[{i}]"
            if name in ("params", "master_params"):
                b, b0 = b.float(), b0.float()
                tol = torch.finfo(a.dtype).eps * (b.abs() + (b - b0).abs()).clamp_min(torch.finfo(a.dtype).tiny)
                assert ((a.float() - b).abs() <= tol).all(), what
            else:
                assert torch.equal(_bits(a), _bits(b)), what


def _clone(st):
    return [[t.clone() for t in lst] for lst in st]


# Sizes: one element, one partial block, exactly one tile (1024), a partial tile, a full 16384-element chunk plus
# a tail chunk.
@pytest.mark.parametrize("mode", ["8bit", "bf16"])
def test_lowp_matches_reference_over_sizes_and_dtypes(mode):
    sizes = (1, 300, 1024, 3000, 16384 + 700)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16)
    ref = _make(mode, sizes, dtypes, master=False)
    mine, before = _clone(ref), _clone(ref)
    _call(reference.adam_step_lowp_, ref)
    _call(klowp.adam_step_lowp_, mine)
    _assert_match(mine, ref, before)
    assert [float(s) for s in mine[6]] == [3.0 * k + 1 for k in range(len(sizes))]


@pytest.mark.parametrize("mode", ["8bit", "bf16"])
@pytest.mark.parametrize("case", ["master_l2_scale", "maximize_beta1_small", "lr_on_device_scale_ptr"])
def test_lowp_options(mode, case):
    sizes, dtypes = (700, 2000), (torch.bfloat16, torch.float16)
    kw = {}
    master = case == "master_l2_scale"
    if master:
        kw = dict(decoupled=False, grad_scale=torch.tensor(1024.0))
    elif case == "maximize_beta1_small":
        kw = dict(maximize=True, beta1=0.3, wd=0.0)
    else:
        sizes, dtypes = (5000,), (torch.float32,)
        kw = dict(lr_on_device=True, grad_scale=torch.tensor(0.5, device=DEVICE))
    ref = _make(mode, sizes, dtypes, master=master, seed=1)
    mine = _clone(ref)
    if "grad_scale" in kw:
        s = kw["grad_scale"]
        for g in ref[1] + mine[1]:
            g.mul_(s.to(g.device).to(g.dtype))
    before = _clone(ref)
    _call(reference.adam_step_lowp_, ref, **kw)
    _call(klowp.adam_step_lowp_, mine, **kw)
    _assert_match(mine, ref, before)


@pytest.mark.parametrize("mode", ["8bit", "bf16"])
def test_lowp_found_inf_skips_everything(mode):
    st = _make(mode, (600, 40), (torch.float32, torch.bfloat16), master=True)
    before = _clone(st)
    for found_inf in (torch.ones((), device=DEVICE), torch.ones(())):
        _call(klowp.adam_step_lowp_, st, found_inf=found_inf)
        for la, lb in zip(st, before):
            for a, b in zip(la, lb):
                assert torch.equal(_bits(a), _bits(b))


def test_bf16_seed_and_position_change_the_rounding():
    # Two identical tensors in one call round differently (the key holds the tensor's index), and so does another seed.
    st = _make("bf16", (4096, 4096), (torch.float32, torch.float32), master=False)
    for lst in st:
        if len(lst) == 2:
            lst[1].copy_(lst[0])
    st[6][1].copy_(st[6][0])
    other = _clone(st)
    _call(klowp.adam_step_lowp_, st, seed=5)
    _call(klowp.adam_step_lowp_, other, seed=6)
    assert not torch.equal(_bits(st[2][0]), _bits(st[2][1]))
    assert not torch.equal(_bits(st[2][0]), _bits(other[2][0]))
    ref, before = _clone(other), _clone(other)
    # The seed's high bits beyond 32 are ignored, as _quant.sr_key does.
    _call(klowp.adam_step_lowp_, other, seed=6 + (1 << 40))
    _call(reference.adam_step_lowp_, ref, seed=6)
    _assert_match(other, ref, before)


def test_8bit_nan_block_decodes_to_nan():
    st = _make("8bit", (600,), (torch.float32,), master=False)
    st[1][0][300] = float("nan")
    ref = _clone(st)
    _call(klowp.adam_step_lowp_, st)
    _call(reference.adam_step_lowp_, ref)
    assert torch.isnan(st[4][0][1]) and torch.isnan(st[5][0][1]) and not torch.isnan(st[4][0][0])
    assert torch.equal(st[2][0], ref[2][0]) and torch.equal(st[3][0], ref[3][0])
