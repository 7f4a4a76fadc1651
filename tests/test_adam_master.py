"""fastops.optim.Adam/AdamW master weights (fp32 copies of bf16/fp16 params) and state_dicts: against torch's fp32
run, cross-loads with torch both ways, edits of the param between steps, EMA swaps, torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
from fastops import _backend
from tests.adam_helpers import (
    LR_MAX, STEPS, _assert_fp32_close, _assert_states_close, _Fp64Adam, _fresh_dynamo, _grads, _groups,
    _model_params, _run, _schedule, _sizes, _spacings, _torch_keys
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_master_weights_follow_torch_fp32(cpu_backend, dtype):
    """The fp32 master is updated as torch's fp32 AdamW updates an fp32 copy of the params with the (upcast)
    low-precision grads, so the fp32 parity tolerance applies to it; the param is its rounding."""
    sizes = _sizes(cpu_backend)
    mine = _model_params(3, sizes, dtype)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in mine]
    opt = fastops.optim.AdamW(_groups(mine, False), master_weights=True, amsgrad=True)
    ref = torch.optim.AdamW(_groups(theirs, False), foreach=False, amsgrad=True)
    _run(opt, mine, STEPS)
    for step in range(STEPS):  # _run's schedule with the grads rounded to dtype, then upcast
        if step == 10:
            for k, group in enumerate(ref.param_groups):
                group["lr"] = group["lr"] * (0.5 + 0.25 * k)
        grads, live = _grads(step, mine), _schedule(step, len(theirs))
        for i, p in enumerate(theirs):
            p.grad = grads[i].float() if i in live else None
        ref.step()
    masters = [opt.state[p]["master_param"] if p in opt.state else p.float() for p in mine]
    _assert_fp32_close(masters, theirs, cpu_backend)
    _assert_states_close(opt, ref, mine, theirs, cpu_backend)
    for p, m in zip(mine, masters):
        assert torch.equal(p, m.to(dtype))


def test_state_dict_cross_load_both_ways(cpu_backend):
    sizes = _sizes(cpu_backend)
    baseline = _model_params(3, sizes)
    base_opt = torch.optim.AdamW(baseline, lr=1e-2, amsgrad=True)
    _run(base_opt, baseline, 30, lr_change_at=-1)

    switched = _model_params(3, sizes)
    torch_opt = torch.optim.AdamW(switched, lr=1e-2, amsgrad=True)
    for step in range(30):
        if step == 10:  # torch -> fastops
            fast_opt = fastops.optim.AdamW(switched, lr=1e-2, amsgrad=True)
            fast_opt.load_state_dict(torch_opt.state_dict())
            opt = fast_opt
        elif step == 20:  # fastops -> torch
            torch_opt = torch.optim.AdamW(switched, lr=5.0, amsgrad=False)
            torch_opt.load_state_dict(copy.deepcopy(fast_opt.state_dict()))
            opt = torch_opt
        elif step == 0:
            opt = torch_opt
        grads = _grads(step, switched)
        live = _schedule(step, len(switched))
        for i, p in enumerate(switched):
            p.grad = grads[i] if i in live else None
        opt.step()
    assert torch_opt.param_groups[0]["lr"] == 1e-2 and torch_opt.param_groups[0]["amsgrad"]
    _assert_fp32_close(switched, baseline, cpu_backend)
    sd = fast_opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32


def test_master_weights_continue_from_torch_after_a_detour(cpu_backend):
    """bf16 with master weights: fastops 10 steps, torch.optim.AdamW 10 steps, fastops again. torch keeps the
    master_param key it does not know but never updates it; the master must be rebuilt from the param torch
    left, or the param jumps back to where fastops left it."""
    sizes = _sizes(cpu_backend)
    params = _model_params(10, sizes, torch.bfloat16)

    def feed(step):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g

    fast = fastops.optim.AdamW(params, lr=1e-2, master_weights=True)
    for step in range(10):
        feed(step)
        fast.step()
    detour = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    detour.load_state_dict(copy.deepcopy(fast.state_dict()))
    for step in range(10, 20):
        feed(step)
        detour.step()
    torch_sd = copy.deepcopy(detour.state_dict())
    back = fastops.optim.AdamW(params, lr=1e-2, master_weights=True)
    back.load_state_dict(torch_sd)
    for p in params:
        assert torch.equal(back.state[p]["master_param"], p.float()), "a stale master is rebuilt from the param"

    # One fp64 step from the state torch left (its bf16 moments, exactly as fastops upcasts them).
    emulated = [torch.nn.Parameter(p.detach().clone()) for p in params]
    emulation = _Fp64Adam([{"params": emulated}], decoupled=True, master=True, lr=1e-2, weight_decay=1e-2)
    for i, (p, e) in enumerate(zip(params, emulated)):
        st = torch_sd["state"][i]
        emulation.state[e] = {"step": int(st["step"]), "exp_avg": st["exp_avg"].double(),
                              "exp_avg_sq": st["exp_avg_sq"].double(), "master_param": p.double()}  # fmt: skip
    feed(20)
    back.step()
    for e, g in zip(emulated, _grads(20, emulated)):
        e.grad = g
    emulation.step()
    off = torch.cat([_spacings(p, e, LR_MAX) for p, e in zip(params, emulated)])
    assert off.max() <= 1.0, f"{off.max():.3g} ulps from one fp64 step after torch's"


def test_state_dict_keeps_fp32_states_for_bf16_params():
    params = _model_params(4, (5, 7), torch.bfloat16)
    opt = fastops.optim.AdamW(params, master_weights=True)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    other = fastops.optim.AdamW(params, master_weights=True)
    other.load_state_dict(sd)
    for p in params:  # the master still rounds to its param, so it is kept as saved (not p.float())
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert other.state[p][key].dtype == torch.float32
            torch.testing.assert_close(other.state[p][key], opt.state[p][key], rtol=0, atol=0)
    # A torch state_dict has no master_weights key: the optimizer keeps its own setting.
    torch_sd = torch.optim.AdamW(params).state_dict()
    other.load_state_dict(torch_sd)
    assert other.param_groups[0]["master_weights"] is True


def test_add_param_group_and_hyperparameters_roundtrip():
    params = _model_params(5, (4, 6, 8))
    opt = fastops.optim.AdamW(params[:1], lr=1e-3)
    opt.add_param_group({"params": params[1:], "lr": 5e-4, "weight_decay": 0.0})
    ref = torch.optim.AdamW(params[:1], lr=1e-3)
    ref.add_param_group({"params": params[1:], "lr": 5e-4, "weight_decay": 0.0})
    assert _torch_keys(opt.state_dict()["param_groups"]) == ref.state_dict()["param_groups"]
    assert isinstance(opt, torch.optim.AdamW) and isinstance(fastops.optim.Adam(params), torch.optim.Adam)


def _edits():
    """In-place edits of a model's params between steps that torch keeps (each under no_grad, as users write them)."""
    def fill(model, other):
        model.weight.fill_(5.0)

    def load_state_dict(model, other):
        model.load_state_dict(other.state_dict())

    def clamp(model, other):  # WGAN's weight clipping
        for p in model.parameters():
            p.clamp_(-0.01, 0.01)

    def ema_swap(model, other):  # the EMA weights swapped in, and training goes on from them
        for p, e in zip(model.parameters(), other.parameters()):
            tmp = p.detach().clone()
            p.copy_(e)
            e.copy_(tmp)

    return [fill, load_state_dict, clamp, ema_swap]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("algo", ["AdamW", "SGD"])
def test_master_weights_keep_edits_of_the_param(edit, algo):
    """torch keeps an edit made between steps; with master_weights=True fastops rebuilds the master from the edited
    param (seen through its version counter), so the next step starts from the edit as torch's does: exactly the
    step of an optimizer whose master was set to the edited param by hand."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).bfloat16()
    other = torch.nn.Linear(4, 3).bfloat16()
    make = lambda m: (fastops.optim.AdamW(m.parameters(), lr=1e-3, master_weights=True) if algo == "AdamW"  # noqa: E731
                      else fastops.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, master_weights=True))
    opt = make(model)
    with _backend.use("cpu", "reference"):
        for step in range(3):
            model.weight.grad = _grads(step, [model.weight])[0]
            model.bias.grad = _grads(step + 50, [model.bias])[0]
            opt.step()
        twin_model = copy.deepcopy(model)
        twin = make(twin_model)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        with torch.no_grad():
            edit(model, copy.deepcopy(other))
            edit(twin_model, copy.deepcopy(other))
        edited = [p.detach().clone() for p in model.parameters()]
        for p in twin_model.parameters():
            if not torch.equal(twin.state[p]["master_param"].to(p.dtype), p):  # edited: the rebuild, by hand
                twin.state[p]["master_param"] = p.detach().float()
        for m, o in ((model, opt), (twin_model, twin)):
            m.weight.grad = torch.ones_like(m.weight)
            m.bias.grad = torch.ones_like(m.bias)
            o.step()
    for a, b, e in zip(model.parameters(), twin_model.parameters(), edited):
        assert torch.equal(a, b)
        assert (a.float() - e.float()).abs().max() <= 0.05  # a step of lr 1e-3 from the edit, not back to before it


def test_master_survives_an_ema_swap_and_back():
    """Swapping EMA weights in (to evaluate) and back leaves the param's bits as the master rounds: the master is
    kept, with the bits below bf16 that a rebuild would lose."""
    torch.manual_seed(0)
    model, ema = torch.nn.Linear(4, 3).bfloat16(), torch.nn.Linear(4, 3).bfloat16()
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-3, master_weights=True)
    with _backend.use("cpu", "reference"):
        for step in range(2):
            for p in model.parameters():
                p.grad = _grads(step, [p])[0]
            opt.step()
        masters = [opt.state[p]["master_param"].clone() for p in model.parameters()]
        swap = _edits()[3]
        with torch.no_grad():
            swap(model, ema)
            swap(model, ema)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.param_groups[0]["lr"] = 0.0
        opt.step()
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(opt.state[p]["master_param"], m)


def test_master_without_edits_costs_no_compare(monkeypatch):
    """The version counter the step leaves is what tells an edit: steps with no edit in between read neither the
    param nor its master an extra time (the bits are compared once, for a master the optimizer did not write)."""
    calls = []
    real = fastops.optim._master._same_bits
    monkeypatch.setattr(fastops.optim._master, "_same_bits", lambda a, b: calls.append(1) or real(a, b))
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = fastops.optim.AdamW([p], lr=1e-3, master_weights=True)
    with _backend.use("cpu", "reference"):
        for _ in range(4):
            p.grad = torch.ones(4, dtype=torch.bfloat16)
            opt.step()
        assert calls == []
        with torch.no_grad():
            p.add_(1.0)
        opt.step()
    assert calls == [1] and (p.float() - 2.0).abs().max() < 0.01  # the edit (1 -> 2) kept


def test_compiled_step_with_master_weights_keeps_an_edit():
    """The edit check also holds when the step is torch.compile'd (the version record is left to eager steps)."""
    _fresh_dynamo()
    with _backend.use("cpu", "reference"):
        ps = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(2)]
        opts = [fastops.optim.AdamW([p], lr=1e-3, master_weights=True) for p in ps]
        steps = [torch.compile(opts[0].step, backend="aot_eager"), opts[1].step]
        for s in range(4):
            for p, step in zip(ps, steps):
                p.grad = torch.full((4,), 0.1 * (s + 1), dtype=torch.bfloat16)
                step()
                if s == 2:
                    with torch.no_grad():
                        p.fill_(3.0)
    masters = [o.state[p]["master_param"] for o, p in zip(opts, ps)]
    assert torch.equal(masters[0], masters[1]) and (masters[0] - 3.0).abs().max() < 0.01
