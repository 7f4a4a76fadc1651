"""fastops.optim.Adam/AdamW against torch.optim.Adam/AdamW, many steps, every CPU backend: fp32 parity (the
measured tolerances are in tests/adam_helpers.py), tensor lr and betas, groups added mid-run, and bf16/fp16 params
against an fp64 model. Master weights and state dicts: test_adam_master.py; the step's flags, GradScaler,
torch.compile and patch: test_adam_step.py."""

from __future__ import annotations

import pytest
import torch

import fastops
from fastops import _backend
from tests.adam_helpers import (
    BIG, FP32_TOL, LR_MAX, STEPS, _assert_fp32_close, _assert_states_close, _Fp64Adam, _grads, _groups,
    _model_params, _run, _schedule, _sizes, _spacings
)


@pytest.mark.parametrize("algo", ["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_parity_fp32(cpu_backend, algo, amsgrad, maximize, weight_decay):
    sizes = _sizes(cpu_backend)
    mine, theirs = _model_params(0, sizes), _model_params(0, sizes)
    kw = dict(amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    opt = getattr(fastops.optim, algo)(_groups(mine, False), **kw)
    ref = getattr(torch.optim, algo)(_groups(theirs, False), foreach=False, **kw)
    _run(opt, mine, STEPS)
    _run(ref, theirs, STEPS)
    _assert_fp32_close(mine, theirs, cpu_backend)
    _assert_states_close(opt, ref, mine, theirs, cpu_backend)


# The Triton interpreter would take minutes for 10^6+7 elements x 50 steps; test_ops runs it at 5000 elements.
@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("algo,amsgrad", [("AdamW", True), ("Adam", False)])
def test_parity_fp32_large(backend, algo, amsgrad):
    """10^6+7 elements: many parallel chunks and an odd tail in the C++ kernel, next to tensors of 1 and 0."""
    sizes = (BIG, 1, 0)
    mine, theirs = _model_params(7, sizes), _model_params(7, sizes)
    kw = dict(amsgrad=amsgrad, weight_decay=0.1)
    with _backend.use("cpu", backend):
        opt = getattr(fastops.optim, algo)(mine, lr=1e-2, **kw)
        ref = getattr(torch.optim, algo)(theirs, lr=1e-2, foreach=False, **kw)
        _run(opt, mine, STEPS)
        _run(ref, theirs, STEPS)
    _assert_fp32_close(mine, theirs, backend)
    _assert_states_close(opt, ref, mine, theirs, backend)


def test_parity_tensor_lr(cpu_backend):
    sizes = _sizes(cpu_backend)
    mine, theirs = _model_params(1, sizes), _model_params(1, sizes)
    opt = fastops.optim.AdamW(_groups(mine, True))
    ref = torch.optim.AdamW(_groups(theirs, True), foreach=False)
    _run(opt, mine, STEPS, tensor_lr=True)
    _run(ref, theirs, STEPS, tensor_lr=True)
    # torch computes lr / bias_correction1 as fp32 tensor arithmetic when lr is a Tensor; every fastops backend
    # reads a CPU lr on the host as a Python float, so the reference is not bit-exact here (measured max d 1.1e-7).
    _assert_fp32_close(mine, theirs, cpu_backend, tol=FP32_TOL["cpp"])


def test_tensor_betas_are_read_every_step(cpu_backend):
    """CPU Tensor betas (torch accepts them with foreach=False), changed in place mid-run, give exactly the run
    with float betas replaced at the same step: fastops reads them as doubles each step, nothing is cached.
    (torch itself computes 1 - beta and beta**step as fp32 tensors here, so it is not the yardstick.)"""
    sizes = _sizes(cpu_backend)
    with_tensors, with_floats = _model_params(8, sizes), _model_params(8, sizes)
    betas = (torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.999, dtype=torch.float64))  # exactly 0.9, 0.999
    opt = fastops.optim.AdamW(_groups(with_tensors, False), betas=betas)
    ref = fastops.optim.AdamW(_groups(with_floats, False), betas=(0.9, 0.999))
    for o, ps in ((opt, with_tensors), (ref, with_floats)):
        for step in range(STEPS):
            if step == 25:
                if o is opt:
                    betas[0].fill_(0.8)
                    betas[1].fill_(0.99)
                else:
                    o.param_groups[0]["betas"] = (0.8, 0.99)
            for p, g in zip(ps, _grads(step, ps)):
                p.grad = g
            o.step()
    for a, b in zip(with_tensors, with_floats):
        assert torch.equal(a, b)


def test_add_param_group_mid_training(cpu_backend):
    """A layer unfrozen at step 20 joins as a new group with its own hyperparameters, as in fine-tuning."""
    sizes = _sizes(cpu_backend)
    mine, theirs = _model_params(9, sizes), _model_params(9, sizes)
    opt = fastops.optim.AdamW(mine[:3], lr=1e-2)
    ref = torch.optim.AdamW(theirs[:3], lr=1e-2, foreach=False)
    for o, ps in ((opt, mine), (ref, theirs)):
        for step in range(STEPS):
            if step == 20:
                o.add_param_group({"params": ps[3:], "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.3})
            grads = _grads(step, ps)
            live = _schedule(step, len(ps))
            for i, p in enumerate(ps):
                p.grad = grads[i] if i in live and (i < 3 or step >= 20) else None
            o.step()
    _assert_fp32_close(mine, theirs, cpu_backend)
    _assert_states_close(opt, ref, mine, theirs, cpu_backend)
    assert opt.state[mine[3]]["step"].item() == STEPS - 20 - 1  # step 35 had no grads


# Every pair of values of any two of the five switches appears in some row (a pairwise cover: 6 runs, not 32).
PAIRWISE = [
    # algo, amsgrad, maximize, weight_decay, tensor_lr
    ("AdamW", False, False, 0.0, False),
    ("AdamW", False, False, 0.0, True),
    ("AdamW", True, True, 0.1, False),
    ("Adam", False, True, 0.1, False),
    ("Adam", True, False, 0.1, True),
    ("Adam", True, True, 0.0, True),
]
BF16, FP16 = torch.bfloat16, torch.float16
# The C++ and reference backends (~0.1 s a run) get every row for both dtypes, with and without a master; the
# Triton interpreter (~1.3 s a run) gets a pairwise cover of all seven switches (the five, dtype, master).
LOW_CASES = [(b, *row, dtype, master) for b in ("cpp", "reference") for row in PAIRWISE
             for dtype in (BF16, FP16) for master in (False, True)] + [
    ("triton", "AdamW", False, False, 0.0, False, BF16, False),
    ("triton", "AdamW", False, False, 0.0, True, FP16, True),
    ("triton", "AdamW", True, True, 0.1, False, BF16, False),
    ("triton", "Adam", False, True, 0.1, False, FP16, True),
    ("triton", "Adam", True, False, 0.1, True, BF16, True),
    ("triton", "Adam", True, True, 0.0, True, FP16, False),
]  # fmt: skip


def _low_id(case):
    backend, algo, amsgrad, maximize, wd, tensor_lr, dtype, master = case
    flags = [n for n, on in (("amsgrad", amsgrad), ("maximize", maximize), (f"wd{wd}", True),
                             ("tensor_lr", tensor_lr), ("master", master)) if on]  # fmt: skip
    return "-".join([backend, str(dtype).removeprefix("torch."), algo, *flags])


# Without a master each step rounds its fp32 result once; when that fp32 value lies within an fp32 ulp of a
# rounding midpoint the rounding can go either way, and an element near such a midpoint for several steps can
# collect more than one ulp. Measured over all 32 combinations of the five switches: fp16 451 of 484k elements
# end off (bf16 24), at most one element of a run beyond 1 ulp, none beyond 3 (bf16 2). With a master there
# is one rounding, at the end: at most 1 ulp everywhere. Mutations of the update (lr x 1.3, weight decay or
# bias correction 2 dropped) move most elements by many ulps.
NO_MASTER_OUTLIERS, NO_MASTER_MAX = 3, 4.0


@pytest.mark.parametrize("case", LOW_CASES, ids=_low_id)
def test_low_precision_parity(case):
    """bf16/fp16 params over 50 steps of the _run schedule (lr change, frozen param, a step with no grads): every
    backend against an fp64 emulation of the documented semantics, cpp and triton also against the reference."""
    backend, algo, amsgrad, maximize, weight_decay, tensor_lr, dtype, master = case
    sizes = _sizes(backend)
    kw = dict(amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    runs = {}
    for name in {backend, "reference"}:
        params = _model_params(2, sizes, dtype)
        with _backend.use("cpu", name):
            opt = getattr(fastops.optim, algo)(_groups(params, tensor_lr), master_weights=master, **kw)
            _run(opt, params, STEPS, tensor_lr=tensor_lr)
        runs[name] = (params, opt)
    mine, opt = runs[backend]
    emulated = _model_params(2, sizes, dtype)
    emulation = _Fp64Adam(_groups(emulated, tensor_lr), decoupled=algo == "AdamW", master=master, **kw)
    _run(emulation, emulated, STEPS, tensor_lr=tensor_lr)

    off = torch.cat([_spacings(a, b, LR_MAX) for a, b in zip(mine, emulated)])
    outliers = int((off > 1.0).sum())
    if master:
        assert outliers == 0, f"{outliers} elements more than 1 ulp from the fp64 emulation, worst {off.max():.3g}"
    else:
        assert outliers <= NO_MASTER_OUTLIERS and off.max() <= NO_MASTER_MAX, (
            f"{outliers} elements more than 1 ulp from the fp64 emulation, worst {off.max():.3g} ulps"
        )
    for p in mine:
        st = opt.state.get(p, {})
        assert all(t.dtype == torch.float32 for t in st.values()), "states are fp32 for every param dtype"
        if master and st:
            assert torch.equal(p, st["master_param"].to(dtype)), "the param is the rounded master"
    if backend != "reference":
        # The same fp32 arithmetic up to the kernels' measured fp32 differences: params within 1 ulp of the
        # reference (measured: C++ bit-identical; Triton one fp16 element 1 ulp off).
        theirs, ref = runs["reference"]
        off = torch.cat([_spacings(a, b, LR_MAX) for a, b in zip(mine, theirs)])
        assert off.max() <= 1.0, f"{off.max():.3g} ulps from the reference backend"
        _assert_states_close(opt, ref, mine, theirs, backend)
        if master:
            _assert_fp32_close([opt.state[p]["master_param"] for p in mine if p in opt.state],
                               [ref.state[p]["master_param"] for p in theirs if p in ref.state], backend)
