"""fastops.amp.GradScaler with fastops and torch optimizers against torch's recipe, every CPU backend: every
scaler/optimizer pairing fastops takes part in, the clip folded into the step, several optimizers, master weights, no host reads.
clip_grad_norm_: test_amp_clip.py; the scaler alone: test_amp_scaler.py; patch() and torch's contracts that
frameworks read: test_amp_patch.py."""

from __future__ import annotations

import itertools

import pytest
import torch

import fastops
import fastops.amp as famp
from tests.amp_helpers import (
    INIT_SCALE,
    MAX_NORM,
    MID_NORM,
    POISON,
    _model,
    _loss,
    SCALERS,
    OPTIMIZERS,
    _train,
    _baseline,
    _assert_params_close,
    no_host_reads,
)


# Every pairing in which fastops runs (its scaler, its optimizer or both) against torch's scaler and optimizer:
# torch's scaler with a torch optimizer would compare torch with itself.
PAIRINGS = [
    (s, o, r)
    for s, o, r in itertools.product(SCALERS, OPTIMIZERS, ["plain", "unscale_clip", "folded", "unscale_folded"])
    if (r in ("folded", "unscale_folded")) == o.startswith("fastops_folded") and "fastops" in (s + o)
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


@pytest.mark.parametrize("scaler_cls, opt_name", [(famp.GradScaler, "torch"), (famp.GradScaler, "fastops_folded"),
                                                   (torch.amp.GradScaler, "fastops_folded")])  # fmt: skip
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
