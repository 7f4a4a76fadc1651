"""fastops.amp.GradScaler against torch.amp.GradScaler on its own: what it unscales, its errors, its state_dict;
and SkipAwareScheduler."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fastops
import fastops.amp as famp
from tests.amp_helpers import (
    INIT_SCALE,
    MAX_NORM,
    OPTIMIZERS,
    SCALERS,
    _grads_the_kernels_do_not_take,
    _loss,
    _model,
)


def _set_first(t, value):
    t = t._values() if t.is_sparse else t
    t[(0,) * t.dim()] = value


def _unscale_and_step(scaler_cls, params, poison_index):
    """One SGD iteration under a scaler, the grads scaled in place (so their layout stays) as backward would."""
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = scaler_cls("cpu", init_scale=INIT_SCALE)
    scaler.scale(torch.ones(()))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(INIT_SCALE)
        if poison_index is not None:
            _set_first(params[poison_index].grad, float("inf"))
    scaler.unscale_(opt)
    found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    grads = [p.grad.to_dense().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return found, grads, scaler.get_scale(), [p.detach().clone() for p in params]


@pytest.mark.parametrize("case", ["float64", "strided", "mixed", "sparse"])
@pytest.mark.parametrize("poison_index", [None, 0, 1])
def test_scaler_unscales_what_torch_unscales(cpu_backend, case, poison_index):
    """unscale_, the inf check, the skip and the scale as torch's, for grads the kernels do not take; an inf in
    either kind of grad sets the one shared found_inf."""

    def make():
        if case == "sparse":
            emb = torch.nn.Embedding(10, 4, sparse=True)
            with torch.no_grad():
                emb.weight.copy_(torch.arange(40.0).view(10, 4) / 40)
            emb(torch.tensor([1, 2, 2, 7])).pow(2).sum().backward()
            dense = torch.nn.Parameter(torch.ones(5))
            dense.grad = torch.linspace(-1, 1, 5)
            return [emb.weight, dense]
        return _grads_the_kernels_do_not_take(case)

    mine, theirs = _unscale_and_step(famp.GradScaler, make(), poison_index), _unscale_and_step(
        torch.amp.GradScaler, make(), poison_index)
    assert mine[0] == theirs[0] == (0.0 if poison_index is None else 1.0)
    assert mine[2] == theirs[2] == (INIT_SCALE if poison_index is None else INIT_SCALE / 2)
    for got, want in ((mine[1], theirs[1]), (mine[3], theirs[3])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_scaler_complex_grads_fail_as_torch():
    # torch's unscale kernel has no complex CPU implementation; fastops hands the grad to it and gets the same error.
    errors = []
    for cls in (torch.amp.GradScaler, famp.GradScaler):
        params = _grads_the_kernels_do_not_take("complex")
        scaler = cls("cpu")
        scaler.scale(torch.ones(()))
        with pytest.raises(Exception) as info:
            scaler.unscale_(torch.optim.SGD(params, lr=0.1))
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] and errors[0][0] is NotImplementedError


@pytest.mark.parametrize("unscale_first", [False, True])
def test_no_grads_raises_as_torch(unscale_first):
    messages = []
    for scaler_cls, opt_name in ((torch.amp.GradScaler, "torch"), (famp.GradScaler, "fastops_folded")):
        model = _model()
        opt = OPTIMIZERS[opt_name](model.parameters(), MAX_NORM)
        scaler = scaler_cls("cpu", init_scale=INIT_SCALE, growth_interval=1)
        scaler.scale(_loss(model, 0))  # no backward: no param has a grad
        with pytest.raises(AssertionError) as in_step:
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
        with pytest.raises(AssertionError) as in_update:
            scaler.update()
        messages.append((str(in_step.value), str(in_update.value), scaler.get_scale()))
    assert messages[0] == messages[1] == (
        "No inf checks were recorded for this optimizer.", "No inf checks were recorded prior to update.", INIT_SCALE
    )


def test_scaler_state_dict_round_trip_with_torch():
    mine = famp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    mine.scale(torch.ones(()))  # the scale tensor is created lazily, as in torch
    mine.update(new_scale=torch.tensor(77.0))
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(mine.state_dict())
    assert theirs.state_dict() == mine.state_dict()
    back = famp.GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == 77.0 and back.get_growth_factor() == 3.0 and back.get_backoff_factor() == 0.25
    assert back.get_growth_interval() == 7 and back.is_enabled()
    back.set_growth_interval(9)
    assert back.state_dict()["growth_interval"] == 9


def test_scaler_state_dict_round_trip_mid_training():
    """torch -> fastops -> torch between iterations, with a growth tracker of 2 of 3 at each hand-over: a tracker
    lost on the way would delay the next growth and change the scale trajectory."""

    def run(hand_over):
        model = _model()
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)
        scales, trackers = [], []
        for step in range(10):
            if step in hand_over:
                state = scaler.state_dict()
                trackers.append(state["_growth_tracker"])
                scaler = hand_over[step]("cpu")
                scaler.load_state_dict(state)
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if step == 5:
                model[0].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, trackers, model

    want_scales, _, want_model = run({})
    scales, trackers, model = run({2: famp.GradScaler, 8: torch.amp.GradScaler})
    assert trackers == [2, 2]
    assert scales == want_scales and want_scales[2] == INIT_SCALE * 2 and want_scales[5] == INIT_SCALE
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_model.parameters()))


def test_skip_aware_scheduler_does_not_advance_on_skipped_steps():
    lrs = {}
    pairings = [("fastops", "fastops"), ("fastops", "torch"), ("torch", "fastops"), ("torch", "torch"),
                ("torch", "torch_fused"), ("fastops", "torch_fused")]  # fmt: skip
    for scaler_name, opt_name in pairings:
        model = _model()
        opt = OPTIMIZERS[opt_name](model.parameters(), None)
        scaler = SCALERS[scaler_name]()
        sched = famp.SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        for step in range(6):
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if step in (2, 3):
                model[0].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            sched.step()
        lrs[(scaler_name, opt_name)] = sched.get_last_lr()[0]
    assert set(lrs.values()) == {1e-2 * 0.5**4}, lrs


def test_skip_aware_scheduler_without_a_scaler_advances_once_per_optimizer_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = famp.SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()
        sched.step()  # no optimizer step since the last call: held
    assert sched.last_epoch == 3 and sched.get_last_lr() == [0.125]


def test_skip_aware_scheduler_state_dict_pickle_and_copy():
    def fresh():
        model = _model()
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)

    model, opt, inner = fresh()
    sched = famp.SkipAwareScheduler(inner)
    scaler = famp.GradScaler("cpu", init_scale=INIT_SCALE)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    assert sched.state_dict() == inner.state_dict() and sched.state_dict()["last_epoch"] == 3
    # Into and out of a plain torch scheduler: the checkpoint format is torch's.
    *_, plain = fresh()
    plain.load_state_dict(sched.state_dict())
    assert plain.last_epoch == 3 and plain.get_last_lr() == sched.get_last_lr()
    *_, inner2 = fresh()
    sched2 = famp.SkipAwareScheduler(inner2)
    sched2.load_state_dict(plain.state_dict())
    assert inner2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()

    with pytest.raises(AttributeError):
        sched._last_lr  # private names are not forwarded (the wrapped scheduler has this one)
    for clone in (pickle.loads(pickle.dumps((sched, model, scaler))), copy.deepcopy((sched, model, scaler))):
        c_sched, c_model, c_scaler = clone
        assert c_sched.state_dict() == sched.state_dict() and c_sched.optimizer is c_sched.scheduler.optimizer
        c_opt = c_sched.optimizer
        for step, poison in ((3, True), (4, False)):  # the copy still tells a skipped step from a real one
            c_opt.zero_grad()
            c_scaler.scale(_loss(c_model, step)).backward()
            if poison:
                c_model[0].bias.grad[0] = float("nan")
            c_scaler.step(c_opt)
            c_scaler.update()
            c_sched.step()
            assert c_sched.last_epoch == (3 if poison else 4)
    assert sched.last_epoch == 3
