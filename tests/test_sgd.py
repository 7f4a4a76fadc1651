"""fastops.optim.SGD against torch.optim.SGD: many steps, state_dict both ways, GradScaler, folded clip."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend, optim
from tests.adam_helpers import _fresh_dynamo, _grads, _model_params, _run, _schedule, _torch_keys
from tests.rounding import norm_rtol
from tests.amp_helpers import no_host_reads

STEPS = 40  # past adam_helpers._schedule's frozen param (steps 20-29) and its step without grads (35)
SIZES = (3, 1023, 1, 77, 0)
# fp32 against torch's for-loop SGD (foreach=False): the reference uses torch's operations in torch's order, so
# it is bit-exact. The compiled backends were not measured by this file's author (their kernels land in
# parallel); SGD has no sqrt or division, so only an FMA contraction can move a result, by 1 ulp per step
# (6e-8 relative) fed through momentum: 1e-6 relative leaves a factor ~15 over 30 steps, ~11 over 40.
FP32_TOL = {"reference": 0.0, "cpp": 1e-6, "triton": 1e-6}
CONFIGS = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, weight_decay=0.1, nesterov=True),
    dict(momentum=0.8, dampening=0.3, maximize=True),
    dict(momentum=0.9, weight_decay=0.05, maximize=True),
]


def _groups(params, tensor_lr=False):
    lr1, lr2 = (torch.tensor(0.05), torch.tensor(0.02)) if tensor_lr else (0.05, 0.02)
    return [{"params": params[:2], "lr": lr1}, {"params": params[2:], "lr": lr2, "weight_decay": 0.2}]


def _close(mine, theirs, backend):
    tol = FP32_TOL[backend]
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _assert_buffers(opt, ref, mine, theirs, backend):
    tol = FP32_TOL[backend]
    for a, b in zip(mine, theirs):
        want = ref.state.get(b, {}).get("momentum_buffer")
        got = opt.state.get(a, {}).get("momentum_buffer")
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kw", CONFIGS, ids=str)
def test_parity_fp32(cpu_backend, kw):
    """Two groups, lr changed at step 10, a frozen param for steps 20-29 (its buffer waits, then resumes), no grads
    at step 35."""
    assert not _schedule(35, len(SIZES)) and 1 not in _schedule(25, len(SIZES)) and STEPS > 35
    mine, theirs = _model_params(0, SIZES), _model_params(0, SIZES)
    opt = fastops.optim.SGD(_groups(mine), **kw)
    ref = torch.optim.SGD(_groups(theirs), foreach=False, **kw)
    _run(opt, mine, STEPS)
    _run(ref, theirs, STEPS)
    _close(mine, theirs, cpu_backend)
    _assert_buffers(opt, ref, mine, theirs, cpu_backend)
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_parity_tensor_lr(cpu_backend):
    mine, theirs = _model_params(1, SIZES), _model_params(1, SIZES)
    opt = fastops.optim.SGD(_groups(mine, True), momentum=0.9)
    ref = torch.optim.SGD(_groups(theirs, True), momentum=0.9, foreach=False)
    _run(opt, mine, STEPS, tensor_lr=True)
    _run(ref, theirs, STEPS, tensor_lr=True)
    _close(mine, theirs, cpu_backend)


def test_defaults_groups_and_class_are_torchs():
    params = _model_params(2, (4, 5))
    opt, ref = fastops.optim.SGD(params), torch.optim.SGD(params)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.3, "momentum": 0.5})
    ref.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.3, "momentum": 0.5})
    assert _torch_keys(opt.state_dict()["param_groups"]) == ref.state_dict()["param_groups"]
    assert _torch_keys(opt.defaults) == ref.defaults
    assert isinstance(opt, torch.optim.SGD)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -0.1}, "Invalid learning rate: -0.1"),
        ({"momentum": -0.5}, "Invalid momentum value: -0.5"),
        ({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
        ({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "Nesterov momentum requires a momentum and zero"),
        ({"lr": torch.tensor([0.1, 0.1])}, "Tensor lr must be 1-element"),
        ({"max_grad_norm": -1.0}, "Invalid max_grad_norm value: -1.0"),
    ],
)
def test_constructor_checks_are_torchs(kwargs, match):
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=match):
        fastops.optim.SGD(params, **kwargs)
    if "max_grad_norm" not in kwargs:
        with pytest.raises(ValueError, match=match):
            torch.optim.SGD(params, **kwargs)


def test_hyperparameters_checked_at_every_step(cpu_backend):
    p = torch.nn.Parameter(torch.ones(3))
    opt = fastops.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.param_groups[0]["momentum"] = -0.1
    with pytest.raises(ValueError, match=r"Invalid momentum value: -0.1 \(param_groups\[0\]\)"):
        opt.step()
    assert torch.equal(p, torch.ones(3)) and p not in opt.state


@pytest.mark.parametrize("direction", ["torch->fastops", "fastops->torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_both_ways_mid_training(direction, dtype):
    """Switching class at step 10 continues exactly the run that never switched (fp32: bit for bit, on the
    reference). bf16: torch casts the fastops fp32 buffer down on load and fastops casts torch's up, and their bf16
    updates differ by design (fastops computes a step in fp32 and rounds once, torch rounds after each op), so the
    switch is at step 1 and the runs are compared to bf16 rounding."""
    steps, switch = (20, 10) if dtype == torch.float32 else (6, 1)
    first_cls, second_cls = (
        (torch.optim.SGD, fastops.optim.SGD) if direction == "torch->fastops" else (fastops.optim.SGD, torch.optim.SGD)
    )
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    with _backend.use("cpu", "reference"):
        mine, theirs = _model_params(3, SIZES, dtype), _model_params(3, SIZES, dtype)
        ref = torch.optim.SGD(theirs, foreach=False, **kw)
        opt = first_cls(mine, foreach=False, **kw)
        for step in range(steps):
            if step == switch:
                saved = copy.deepcopy(opt.state_dict())
                opt = second_cls(mine, foreach=False, **kw)
                opt.load_state_dict(saved)
                want = torch.float32 if second_cls is fastops.optim.SGD else dtype
                assert all(s["momentum_buffer"].dtype == want for s in opt.state.values())
            for ps, o in ((mine, opt), (theirs, ref)):
                for p, g in zip(ps, _grads(step, ps)):
                    p.grad = g
                o.step()
    # bf16: 2 ulps at 1 (2^-7 each); measured max |diff| / (1 + |torch|): 7.6e-3 torch->fastops, 3.7e-3 back.
    tol = 0.0 if dtype == torch.float32 else 2 * 2**-7
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("master", [True, False])
def test_low_precision_follows_the_documented_fp32_update(cpu_backend, dtype, master):
    """bf16/fp16 params: fastops computes in fp32 with an fp32 buffer. With master weights the master is torch's
    fp32 SGD on the same grads and the param its rounding; without, it is torch's fp32 SGD from the rounded param,
    rounded after every step. Emulated here with torch's fp32 SGD (reference: exact)."""
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True)
    mine = _model_params(4, SIZES, dtype)
    emul = [torch.nn.Parameter(p.detach().float()) for p in mine]
    opt = fastops.optim.SGD(mine, master_weights=master, **kw)
    ref = torch.optim.SGD(emul, foreach=False, **kw)
    peak = [e.detach().abs().amax() if e.numel() else torch.tensor(0.0) for e in emul]
    for step in range(STEPS):
        for p, e, g in zip(mine, emul, _grads(step, mine)):
            p.grad, e.grad = g, g.float()
        opt.step()
        ref.step()
        if not master:
            with torch.no_grad():
                for e in emul:
                    e.copy_(e.to(dtype).float())
        peak = [torch.maximum(m, e.detach().abs().amax()) if e.numel() else m for m, e in zip(peak, emul)]
    tol = FP32_TOL[cpu_backend]
    ulp = torch.finfo(dtype).eps
    for p, e, m in zip(mine, emul, peak):
        if master and p.numel():
            torch.testing.assert_close(opt.state[p]["master_param"], e.detach(), rtol=tol, atol=tol)
        # Exact on the reference. Elsewhere fp32 values that agree to `tol` can round to neighbouring values of
        # the param's dtype at some step: one ulp at the magnitude the param had then, which stays as an absolute
        # difference when the value later moves towards zero (the Triton interpreter's unfused fma did that to
        # one fp16 element of 1023 without master weights: 2.2e-4 at a value of 6.6e-3).
        atol = float(ulp * m) if tol else 0.0
        torch.testing.assert_close(p.float(), e.detach().to(dtype).float(), rtol=ulp if tol else 0, atol=atol)


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_skipped_first_step_leaves_the_buffer_unstarted(cpu_backend, dampening):
    """A GradScaler's skip at the first step changes nothing, and the next real step is a first step (buf = grad),
    as in torch's for-loop SGD, which a torch GradScaler never calls on that step."""
    kw = dict(lr=0.1, momentum=0.9, dampening=dampening)
    mine, theirs = _model_params(5, SIZES), _model_params(5, SIZES)
    opt = fastops.optim.SGD(mine, **kw)
    ref = torch.optim.SGD(theirs, foreach=False, **kw)
    before = [p.detach().clone() for p in mine]
    for p, g in zip(mine, _grads(0, mine)):
        p.grad = g
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(1.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert opt.step_was_skipped.item()
    assert all(torch.equal(p, b) for p, b in zip(mine, before))
    for step in range(1, 8):
        for ps, o in ((mine, opt), (theirs, ref)):
            for p, g in zip(ps, _grads(step, ps)):
                p.grad = g
            o.step()
    _close(mine, theirs, cpu_backend)
    _assert_buffers(opt, ref, mine, theirs, cpu_backend)


def test_first_step_under_a_scaler_reads_nothing_on_the_host_without_dampening(monkeypatch):
    """With dampening == 0 the skip decision stays on the device (checked on the Python side; the op is a stub)."""
    calls = []
    monkeypatch.setattr(optim._ops, "sgd_step_", lambda *args: calls.append(args[10]))
    p = torch.nn.Parameter(torch.ones(3))
    opt = fastops.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(1.0)
    with no_host_reads():
        opt.step()
        opt.step()
    assert calls == [True, False]  # the second step reads the (zero) buffer that the first one left


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, fastops.amp.GradScaler])
def test_grad_scaler_parity_with_torch(cpu_backend, scaler_cls):
    """Both scalers drive fastops' SGD as torch's GradScaler drives torch's SGD (which it unscales and skips
    itself), with inf/nan at steps 4 and 9; the scale trajectory and every param agree."""
    results = []
    for cls in (fastops.optim.SGD, torch.optim.SGD):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = cls(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
        scaler = (scaler_cls if cls is fastops.optim.SGD else torch.amp.GradScaler)("cpu", init_scale=2.0**10,
                                                                                   growth_interval=3)  # fmt: skip
        for step in range(12):
            opt.zero_grad()
            x = torch.linspace(-1, 1, 24).view(4, 6) * (step + 1)
            scaler.scale(model(x).square().mean()).backward()
            if step in (4, 9):
                model[0].weight.grad[0, 0] = float("inf") if step == 4 else float("nan")
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (pa, sa), (pb, sb) = results
    assert sa == sb
    # torch unscales by multiplying with 1/scale, fastops divides by the scale inside the step; the scale is a
    # power of two, so both are exact and the reference is bit-exact (measured).
    _close(pa, pb, cpu_backend)


def test_folded_clip_matches_clip_grad_norm(cpu_backend):
    mine, theirs = _model_params(6, SIZES), _model_params(6, SIZES)
    opt = fastops.optim.SGD(mine, lr=0.05, momentum=0.9, max_grad_norm=5.0)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    for step in range(10):
        grads = _grads(step, mine, scale=1.0 + step)
        for a, b, g in zip(mine, theirs, grads):
            a.grad, b.grad = g, g.clone()
        opt.step()
        want = torch.nn.utils.clip_grad_norm_(theirs, 5.0)
        ref.step()
        torch.testing.assert_close(opt.last_grad_norm, want, rtol=2 * norm_rtol(sum(p.numel() for p in mine)), atol=0)
    # The kernel divides by 1/coef where torch multiplies by coef: measured max |diff| / (1 + |torch|) 1.1e-7 on the
    # reference after 10 steps of momentum.
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_step_keeps_the_flags_and_matches_torch():
    _fresh_dynamo()
    with _backend.use("cpu", "reference"):
        mine, theirs = _model_params(7, (3, 5)), _model_params(7, (3, 5))
        opt = fastops.optim.SGD(mine, lr=0.1, momentum=0.9, max_grad_norm=1e6)
        ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
        step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
        for s in range(3):
            grads = _grads(s, mine, scale=10.0**s)
            for a, b, g in zip(mine, theirs, grads):
                a.grad, b.grad = g, g.clone()
            step()
            ref.step()
            torch.testing.assert_close(opt.last_grad_norm, torch.linalg.vector_norm(torch.cat(grads)))
            assert not opt.step_was_skipped
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)


def test_frozen_and_gradless_params_keep_no_state(cpu_backend):
    params = _model_params(8, (3, 4))
    opt = fastops.optim.SGD(params, lr=0.1)  # momentum 0: torch keeps no state at all
    params[0].grad = torch.ones(3)
    opt.step()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
