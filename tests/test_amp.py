"""fastops.amp against torch.amp.GradScaler and torch.nn.utils.clip_grad_norm_, every CPU backend."""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import pickle
import warnings

import pytest
import torch

import fastops
import fastops.amp as famp
from fastops import _backend
from tests.rounding import norm_rtol

INIT_SCALE = 2.0**12
MAX_NORM = 0.5
# Between the smallest and largest grad norms of _model on _batch over 32 steps (0.87 to 2.69 unclipped),
# so that some steps clip and some do not; the tests that use it assert both happen.
MID_NORM = 1.6
# Steps with a poisoned grad: inf early, nan later, two in a row to exercise repeated backoff.
POISON = {3: float("inf"), 11: float("nan"), 12: float("inf")}


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).to(dtype)


def _batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g) * (1 + step % 3), torch.randn(8, 3, generator=g)
    return x.to(dtype), y.to(dtype)


def _loss(model, step, dtype=torch.float32):
    x, y = _batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x), y)


SCALERS = {"torch": lambda init=INIT_SCALE: torch.amp.GradScaler("cpu", init_scale=init, growth_interval=4),
           "fastops": lambda init=INIT_SCALE: famp.GradScaler("cpu", init_scale=init, growth_interval=4)}
OPTIMIZERS = {
    "torch": lambda ps, max_norm: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "torch_fused": lambda ps, max_norm: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fastops": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2),
    "fastops_folded": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2, max_grad_norm=max_norm),
    # fused=True: torch's scaler hands the scale over to it, as to torch's fused AdamW (see test_torch_scaler_*).
    "fastops_folded_fused": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2, max_grad_norm=max_norm, fused=True),
}


def _train(scaler_name, opt_name, recipe, steps=20, max_norm=MAX_NORM, init_scale=INIT_SCALE, check=None,
           poison=POISON):
    """recipe: 'plain' (scale/step/update), 'unscale_clip' (torch's clipping recipe), 'folded' (no unscale_ call;
    the optimizer clips), 'unscale_folded' (unscale_ first, then the folding optimizer: must not double-unscale).
    scaler_name None trains without a scaler (and without poisoned steps); poison maps step -> value written into
    one grad under a scaler. check(step, model) runs after backward.
    Returns the model, optimizer, scale after each update, whether each step backed off, and each step's norm."""
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters(), max_norm)
    scaler = None if scaler_name is None else SCALERS[scaler_name](init_scale)
    scales, skipped, norms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        loss = _loss(model, step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if check is not None:
            check(step, model)
        if scaler is not None and step in poison:
            model[0].weight.grad[1, 2] = poison[step]
        if scaler is not None and recipe in ("unscale_clip", "unscale_folded"):
            scaler.unscale_(opt)
        if recipe == "unscale_clip":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if scaler is None:
            opt.step()
        else:
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(scaler.get_scale() < scale_before)
        if recipe in ("folded", "unscale_folded"):
            norms.append(opt.last_grad_norm.clone())
    return model, opt, scales, skipped, norms


def _baseline(recipe, **kwargs):
    return _train("torch", "torch", "unscale_clip" if recipe != "plain" else "plain", **kwargs)


def _assert_params_close(model, want_model):
    # fp32; the folded clip divides by scale/coef in one step where torch multiplies twice: a few ulps/step.
    for a, b in zip(model.parameters(), want_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


PAIRINGS = [
    (s, o, r)
    for s, o, r in itertools.product(SCALERS, OPTIMIZERS, ["plain", "unscale_clip", "folded", "unscale_folded"])
    if (r in ("folded", "unscale_folded")) == o.startswith("fastops_folded")
]


@pytest.mark.parametrize("scaler_name,opt_name,recipe", PAIRINGS)
def test_scaler_parity_every_pairing(cpu_backend, scaler_name, opt_name, recipe):
    want_model, want_opt, want_scales, want_skipped, _ = _baseline(recipe)
    model, opt, scales, skipped, _ = _train(scaler_name, opt_name, recipe)
    assert scales == want_scales, "the scale trajectory is torch's"
    assert skipped == want_skipped and sum(skipped) == len(POISON)
    _assert_params_close(model, want_model)
    want_steps = 20 - len(POISON)
    assert all(opt.state[p]["step"].item() == want_steps for p in model.parameters())


@pytest.mark.parametrize("scaler_name", [None, "torch", "fastops"])
def test_folded_clip_matches_torch_recipe_when_clipping_and_not(cpu_backend, scaler_name):
    """AdamW(max_grad_norm) vs clip_grad_norm_ + AdamW over 32 steps, max_norm between the grad norms so both the
    clipped and the clamped-at-1 branch of the coefficient run; with no scaler, either scaler; grads not written."""
    grads_before = {}

    def keep_grads(step, model):
        grads_before[step] = [p.grad.clone() for p in model.parameters()]

    want_model, _, want_scales, _, want_norms = _train(scaler_name and "torch", "torch", "unscale_clip", steps=32,
                                                       max_norm=MID_NORM)  # fmt: skip
    # torch's scaler hands the scale to fused=True optimizers only; to others it unscales the grads in place first.
    folded = "fastops_folded_fused" if scaler_name == "torch" else "fastops_folded"
    model, opt, scales, _, norms = _train(scaler_name, folded, "folded", steps=32, max_norm=MID_NORM,
                                          check=keep_grads)  # fmt: skip
    assert scales == want_scales
    finite = [i for i, n in enumerate(want_norms) if torch.isfinite(n)]
    assert len(finite) == 32 - (len(POISON) if scaler_name else 0)
    clipped = sum(want_norms[i] > MID_NORM for i in finite)
    assert clipped >= 5 and len(finite) - clipped >= 5, [round(want_norms[i].item(), 2) for i in finite]
    for i in finite:
        torch.testing.assert_close(norms[i], want_norms[i], rtol=1e-5, atol=0)
    _assert_params_close(model, want_model)
    # The last step's grads, still as backward left them (scaled when a scaler is used): the step never writes them.
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_before[31]))


@pytest.mark.parametrize("scaler_name", ["torch", "fastops"])
def test_folded_clip_at_a_huge_loss_scale(cpu_backend, scaler_name):
    """init_scale=2**70: the scaled fp32 grads reach ~1e20 and their squares overflow fp32. The folded clip unscales
    inside the norm read, so with either scaler it matches torch's recipe (fused AdamW + unscale_ + clip_grad_norm_),
    never skips and reports a finite norm. The scale grows to 2**72 on the way (growth_interval=4)."""
    scale = 2.0**70

    def squares_overflow(step, model):
        if step == 0:
            grads = [p.grad for p in model.parameters()]
            assert max(g.abs().max().item() for g in grads) > 1e19
            assert torch.stack([g.pow(2).sum() for g in grads]).sum().isinf(), "the hazard this test is about"

    kwargs = dict(steps=9, max_norm=MID_NORM, init_scale=scale, poison={})
    torch_run = _train("torch", "torch_fused", "unscale_clip", **kwargs)
    model, opt, scales, skipped, norms = _train(scaler_name, "fastops_folded", "folded", check=squares_overflow,
                                                **kwargs)  # fmt: skip
    assert scales == torch_run[2] and scales[-1] == 2.0**72 and not any(skipped)
    assert all(opt.state[p]["step"].item() == 9 for p in model.parameters())
    for got, want in zip(norms, torch_run[4]):
        assert torch.isfinite(got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert any(n > MID_NORM for n in norms), "some steps clip"
    _assert_params_close(model, torch_run[0])


def _params_with_grads(dtype=torch.float32, poison=None, empty=True):
    g = torch.Generator().manual_seed(0)
    sizes = (1023, 1, 0, 5000) if empty else (1023, 1, 5000)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).mul_(3).to(dtype)
    if poison is not None:
        params[-1].grad[-1] = poison
    return params


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_clip_grad_norm_parity(cpu_backend, norm_type, max_norm):
    # torch's inf-norm refuses an empty grad ("no identity"); fastops takes it as 0, so leave it out here.
    empty = norm_type != float("inf")
    mine, theirs = _params_with_grads(empty=empty), _params_with_grads(empty=empty)
    got = fastops.clip_grad_norm_(mine, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    # Two 2-norms in other summation orders (tests/rounding.py); the inf-norm is a max, exact.
    rtol = 2 * norm_rtol(sum(p.numel() for p in mine)) if norm_type == 2.0 else 0
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    for a, b in zip(mine, theirs):  # times coef, which carries the norm's error, and one rounding more
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol + 2**-23, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_clip_grad_norm_nonfinite(cpu_backend, norm_type, poison):
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        fastops.clip_grad_norm_(_params_with_grads(poison=poison), 1.0, norm_type, error_if_nonfinite=True)
    mine, theirs = _params_with_grads(poison=poison, empty=False), _params_with_grads(poison=poison, empty=False)
    got = fastops.clip_grad_norm_(mine, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(got, want, equal_nan=True)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)


def test_clip_grad_norm_low_precision_grads(cpu_backend):
    for dtype in (torch.bfloat16, torch.float16):
        mine = _params_with_grads(dtype)
        exact = torch.cat([p.grad.double().flatten() for p in mine]).norm()
        got = fastops.clip_grad_norm_(mine, 0.1)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=norm_rtol(sum(p.numel() for p in mine)), atol=0)


def _grads_the_kernels_do_not_take(case):
    """Params (with grads) of a kind torch's clip_grad_norm_ and GradScaler take and fastops' kernels do not."""
    g = torch.Generator().manual_seed(1)

    def param(shape, dtype=torch.float32, grad=None):
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.grad = torch.randn(shape, generator=g).mul_(3).to(dtype) if grad is None else grad
        return p

    if case == "float64":
        return [param((7, 5), torch.float64), param((300,), torch.float64)]
    if case == "strided":  # x[:, ::2]: a view with gaps
        return [param((4, 3), grad=torch.randn(4, 6, generator=g)[:, ::2]), param((9,))]
    if case == "mixed":  # fp32 grads the kernels take, next to float64 ones they do not
        return [param((300,)), param((7, 5), torch.float64), param((11,), torch.bfloat16)]
    if case == "complex":
        return [param((6, 2), torch.complex64), param((5,))]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["float64", "strided", "mixed", "complex"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_takes_what_torch_takes(case, norm_type):
    """The whole call goes to torch's clip_grad_norm_, so the result is torch's to the bit."""
    mine, theirs = _grads_the_kernels_do_not_take(case), _grads_the_kernels_do_not_take(case)
    got = fastops.clip_grad_norm_(mine, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
    assert want > 0.5, "the grads were clipped"


def _fastops_ops_unreachable(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a fastops kernel was called")

    monkeypatch.setattr(famp._ops, "grad_stats", boom)
    monkeypatch.setattr(famp._ops, "unscale_check_", boom)


def test_grads_on_devices_fastops_does_not_serve_go_to_torch(monkeypatch):
    """No device type other than cpu/cuda exists on a CPU-only machine, so CPU is declared unserved here."""
    monkeypatch.setattr(_backend, "DEVICE_TYPES", ("cuda",))
    _fastops_ops_unreachable(monkeypatch)
    mine, theirs = _params_with_grads(empty=False), _params_with_grads(empty=False)
    assert torch.equal(fastops.clip_grad_norm_(mine, 0.1), torch.nn.utils.clip_grad_norm_(theirs, 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
    opt = torch.optim.SGD(mine, lr=0.1)
    scaler = famp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    assert all(torch.equal(a.grad, b.grad / 4) for a, b in zip(mine, theirs))


def test_clip_grad_norm_calls_torch_original_even_when_patched():
    params = _grads_the_kernels_do_not_take("float64")
    with fastops.patched():
        assert torch.nn.utils.clip_grad_norm_ is fastops.clip_grad_norm_
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)  # would recurse if the fallback read the attribute
    assert norm.dtype == torch.float64


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


@pytest.mark.parametrize("second", ["fastops", "torch"])
def test_multiple_optimizers_only_the_overflowing_one_skips(cpu_backend, second):
    """One scaler, two optimizers (the fastops scaler with a fastops one and a second of either kind); an inf in the
    first optimizer's grads skips only its step, and the scale backs off once, all as torch's scaler does."""

    def run(scaler_name, opt_names):
        model = _model()
        opts = [OPTIMIZERS[n](m.parameters(), None) for n, m in zip(opt_names, (model[0], model[2]))]
        scaler = SCALERS[scaler_name]()
        scales, flags = [], []
        for step in range(8):
            for o in opts:
                o.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if step == 5:
                model[0].weight.grad[0, 0] = float("inf")
            for o in opts:
                scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
            flags.append([bool(getattr(o, "step_was_skipped", False)) for o in opts])
        return model, opts, scales, flags

    want_model, want_opts, want_scales, _ = run("torch", ["torch", "torch"])
    model, opts, scales, flags = run("fastops", ["fastops", second])
    assert scales == want_scales and scales[5] == scales[4] / 2
    assert flags[5] == [True, False] and all(f == [False, False] for i, f in enumerate(flags) if i != 5)
    assert [o.state[o.param_groups[0]["params"][0]]["step"].item() for o in opts] == [7, 8]
    _assert_params_close(model, want_model)


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, famp.GradScaler])
@pytest.mark.parametrize("opt_name", ["torch", "fastops_folded"])
def test_disabled_scaler_is_a_passthrough(scaler_cls, opt_name):
    want = _model()
    want_opt = OPTIMIZERS[opt_name](want.parameters(), MID_NORM)
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters(), MID_NORM)
    scaler = scaler_cls("cpu", enabled=False)
    for step in range(6):
        for m, o in ((want, want_opt), (model, opt)):
            o.zero_grad()
        _loss(want, step).backward()
        want_opt.step()
        loss = _loss(model, step)
        assert scaler.scale(loss) is loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaler_name", ["torch", "fastops"])
def test_low_precision_params_with_master_weights(cpu_backend, dtype, scaler_name):
    """bf16/fp16 params, fastops AdamW(master_weights=True) under a scaler, against torch's scaler + torch AdamW on
    fp32 copies fed the same (upcast) grads each step. The fp32 master and torch's fp32 params see identical
    inputs and differ only in the fused kernel's operation order: the fp32 parity tolerance. The param must be its
    master rounded, bit for bit. init_scale=2**16 makes fp16 grads overflow for real in the first steps."""
    model = _model(dtype=dtype)
    # torch's scaler unscales fp16 grads only for optimizers it hands the scale to (fused=True), as for torch's.
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True, fused=scaler_name == "torch")
    ref = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    scaler, ref_scaler = SCALERS[scaler_name](2.0**16), SCALERS["torch"](2.0**16)
    ref_scaler.scale(torch.ones(()))
    skipped = []
    for step in range(16):
        opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        scaler.scale(_loss(model, step, dtype)).backward()
        if step == 9:
            model[2].weight.grad[0, 0] = float("nan")
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()
        before = scaler.get_scale()
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
        skipped.append(scaler.get_scale() < before)
        for p, r in zip(model.parameters(), ref):
            master = opt.state[p]["master_param"]
            torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=2e-6)
            assert torch.equal(p, master.to(dtype))
    assert skipped[9] and (dtype != torch.float16 or sum(skipped) > 1), skipped
    assert not all(skipped)


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


@contextlib.contextmanager
def no_host_reads():
    """Make every way of reading a tensor value on the host raise: on CUDA each of them is a sync."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for n in names:
        setattr(torch.Tensor, n, boom)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("scaler_name", ["torch", "fastops"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_scalers_with_a_fastops_optimizer_never_read_values_on_the_host(scaler_name, unscale_first):
    # Catches reads made in Python (the default cpp backend reads nothing in Python); kernels are checked on CUDA.
    model = _model()
    # fused=True: torch's scaler hands the scale over instead of reading found_inf (its rule for fused optimizers).
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM, fused=scaler_name == "torch")
    scaler = SCALERS[scaler_name]()
    loss = _loss(model, 0)
    with no_host_reads():
        scaled = scaler.scale(loss)
    scaled.backward()
    model[0].weight.grad[0, 0] = float("inf")
    with no_host_reads():
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert opt.step_was_skipped.item() and scaler.get_scale() == INIT_SCALE / 2


@pytest.mark.parametrize("unscale_first", [False, True])
def test_user_grad_scale_on_the_optimizer_is_torchs(cpu_backend, unscale_first):
    """A grad_scale set on the optimizer before scaler.step (e.g. summed micro-batches) is multiplied into the
    scale before unscale_ and used alone after it, then deleted, as torch's scaler does with torch's fused AdamW."""
    # eps=0.1, near sqrt(v) of these grads: Adam's update then depends on the grads' magnitude, so a grad_scale
    # that is ignored (or applied twice) shows in the params instead of cancelling in m / sqrt(v).
    optimizers = {"torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=0.1, fused=True),
                  "fastops": lambda ps: fastops.optim.AdamW(ps, lr=1e-2, eps=0.1, fused=True)}  # fmt: skip

    def run(scaler_name, opt_name, user_scale):
        model = _model()
        opt = optimizers[opt_name](model.parameters())
        scaler = SCALERS[scaler_name]()
        for step in range(5):
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if unscale_first:
                scaler.unscale_(opt)
            if user_scale is not None:
                opt.grad_scale = torch.tensor(user_scale)
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale")
        return model

    want = run("torch", "torch_fused", 8.0)
    for scaler_name in ("fastops", "torch"):
        _assert_params_close(run(scaler_name, "fastops", 8.0), want)
    unscaled = run("torch", "torch_fused", None)
    assert max((a - b).abs().max().item() for a, b in zip(unscaled.parameters(), want.parameters())) > 1e-3


# (package, defining module, attribute, fastops replacement) for every GradScaler and clip_grad_norm_ patch() swaps.
PATCHED_NAMES = [
    ("torch", "torch.amp.grad_scaler", "GradScaler", famp.GradScaler),
    ("torch.amp", "torch.amp.grad_scaler", "GradScaler", famp.GradScaler),
    ("torch.cuda.amp", "torch.cuda.amp.grad_scaler", "GradScaler", famp.CudaGradScaler),
    ("torch.cpu.amp", "torch.cpu.amp.grad_scaler", "GradScaler", famp.CpuGradScaler),
    ("torch.nn.utils", "torch.nn.utils.clip_grad", "clip_grad_norm_", famp.clip_grad_norm_),
]


def test_patch_swaps_and_unpatch_restores_every_name():
    import importlib

    def current():
        return [(getattr(importlib.import_module(pkg), a), getattr(importlib.import_module(mod), a))
                for pkg, mod, a, _ in PATCHED_NAMES]  # fmt: skip

    originals = current()
    assert all(o is not r for (o, _), (_, _, _, r) in zip(originals, PATCHED_NAMES))
    with fastops.patched():
        for (pkg_value, mod_value), (_, _, _, replacement) in zip(current(), PATCHED_NAMES):
            assert pkg_value is replacement and mod_value is replacement
        from torch.cuda.amp import GradScaler as cuda_scaler
        from torch.nn.utils import clip_grad_norm_

        assert clip_grad_norm_ is fastops.clip_grad_norm_ and cuda_scaler is famp.CudaGradScaler
    after = current()
    assert all(a is o for pair_a, pair_o in zip(after, originals) for a, o in zip(pair_a, pair_o))
    assert issubclass(famp.GradScaler, originals[1][0])
    assert issubclass(famp.CudaGradScaler, originals[2][0]) and issubclass(famp.CpuGradScaler, originals[3][0])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_deprecated_device_scalers_match_torchs(device):
    torch_cls = famp._TorchCudaGradScaler if device == "cuda" else famp._TorchCpuGradScaler
    ours = famp.CudaGradScaler if device == "cuda" else famp.CpuGradScaler
    assert inspect.signature(ours.__init__, eval_str=True) == inspect.signature(torch_cls.__init__, eval_str=True)

    def made(cls, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = cls(**kwargs)
        return scaler, [(w.category, str(w.message)) for w in caught], caught[0].filename

    for kwargs in ({}, {"init_scale": 8.0, "growth_interval": 3}, {"enabled": False}):
        theirs, their_warnings, _ = made(torch_cls, **kwargs)
        mine, my_warnings, where = made(ours, **kwargs)
        # The FutureWarning first, at the caller's line; on a machine without CUDA also torch's "Disabling." warning.
        assert my_warnings == their_warnings and my_warnings[0][0] is FutureWarning and where == __file__
        assert mine._device == device and mine.is_enabled() == theirs.is_enabled()
        assert mine.state_dict() == theirs.state_dict()
        assert isinstance(mine, famp.GradScaler) and isinstance(mine, torch_cls)


@pytest.mark.filterwarnings("ignore:`torch.c.*amp.GradScaler\\(args...\\)` is deprecated")
def test_patched_deprecated_scalers_train_as_torchs():
    torch_cpu, torch_cuda = torch.cpu.amp.GradScaler, torch.cuda.amp.GradScaler

    def run(cpu_cls, cuda_cls):
        results = []
        for make in (lambda: cpu_cls(init_scale=INIT_SCALE, growth_interval=4), lambda: cuda_cls(enabled=False)):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            scaler = make()
            scales = []
            for step in range(8):
                opt.zero_grad()
                scaler.scale(_loss(model, step)).backward()
                if step in POISON and scaler.is_enabled():
                    model[0].weight.grad[1, 2] = POISON[step]
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            results.append((type(scaler), type(opt), scales, [p.detach().clone() for p in model.parameters()]))
        return results

    want = run(torch_cpu, torch_cuda)
    with fastops.patched():
        got = run(torch.cpu.amp.GradScaler, torch.cuda.amp.GradScaler)
    assert [r[:2] for r in got] == [(famp.CpuGradScaler, fastops.optim.AdamW),
                                    (famp.CudaGradScaler, fastops.optim.AdamW)]
    for (_, _, want_scales, want_params), (_, _, scales, params) in zip(want, got):
        assert scales == want_scales
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert want[0][2][3] == INIT_SCALE / 2 and want[1][2] == [1.0] * 8


# ---- torch's contracts that frameworks read ------------------------------------------------------------------


@pytest.mark.parametrize("fused", [None, False, True])
@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_step_supports_amp_scaling_is_torchs(name, fused):
    """torch sets _step_supports_amp_scaling on fused=True instances only; Lightning refuses to clip for optimizers
    that have it, and torch's scaler then calls their step on skipped steps too. fastops' optimizers, and torch's
    converted by fuse_, have it exactly when torch's would."""
    params = [torch.nn.Parameter(torch.ones(3))]
    want = getattr(torch.optim, name)(params, lr=0.1, fused=fused)
    got = getattr(fastops.optim, name)(params, lr=0.1, fused=fused)
    converted = getattr(torch.optim, name)(params, lr=0.1, fused=fused)
    assert fastops.optim.fuse_(converted)
    flag = getattr(want, "_step_supports_amp_scaling", False)
    assert flag == bool(fused)
    assert getattr(got, "_step_supports_amp_scaling", False) == flag
    assert getattr(converted, "_step_supports_amp_scaling", False) == flag


def _watch_by_replacing_step(opt, calls):
    """What HF Accelerate's AcceleratedOptimizer does around scaler.step: the instance's step replaced by one that
    records the call."""
    original = opt.step

    def step(*args, **kwargs):
        calls.append(True)
        return original(*args, **kwargs)

    opt.step = step


def _watch_by_hook(opt, calls):
    opt.register_step_post_hook(lambda *args: calls.append(True))


@pytest.mark.parametrize("watch", [_watch_by_replacing_step, _watch_by_hook])
@pytest.mark.parametrize("fused", [False, True])
def test_watched_steps_follow_torchs_call_rule(watch, fused):
    """When something counts optimizer.step calls, fastops' scaler keeps torch's rule: a non-fused optimizer's step
    is called only on steps without inf/nan (one host read, as torch's scaler makes), a fused one's on every step.
    The skip flag, norm and params are what the hand-over path gives."""
    results = {}
    for watched in (False, True):
        model = _model()
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM, fused=fused)
        calls = []
        if watched:
            watch(opt, calls)
        scaler = SCALERS["fastops"]()
        flags, finite = [], []
        for step in range(8):
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if step in POISON:
                model[0].weight.grad[1, 2] = POISON[step]
            scaler.step(opt)
            scaler.update()
            flags.append((bool(opt.step_was_skipped), scaler.get_scale()))
            finite.append(bool(opt.last_grad_norm.isfinite()))
        results[watched] = (flags, [p.detach().clone() for p in model.parameters()], len(calls), finite)
    flags, params, n_calls, finite = results[True]
    assert flags == results[False][0]
    skipped = sum(f[0] for f in flags)
    assert skipped == sum(1 for s in POISON if s < 8) > 0
    # A real step's norm is finite either way. A skipped one: the hand-over's step read the inf grads (inf); a
    # watched non-fused step was not called and computed no norm (nan, never an earlier step's value).
    assert finite == results[False][3] == [not f[0] for f in flags]
    assert n_calls == (8 if fused else 8 - skipped)
    for a, b in zip(params, results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # unscale then step vs divide in the step


def test_lr_scheduler_and_fastops_wrappers_do_not_count_as_watching():
    """torch's LR scheduler wraps the instance's step too, and SkipAwareScheduler adds a hook: neither counts the
    calls the way Accelerate does, so the hand-over stays free of host reads."""
    model = _model()
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-2)
    sched = famp.SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert "step" in opt.__dict__ and not famp._step_is_watched(opt)
    scaler = SCALERS["fastops"]()
    scaler.scale(_loss(model, 0)).backward()
    with no_host_reads():
        scaler.step(opt)
        scaler.update()
    sched.step()
    opt.register_step_pre_hook(lambda *args: None)
    assert famp._step_is_watched(opt)
