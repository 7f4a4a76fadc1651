"""fastops.accelerate under fp16 (its own loss scaling, or the user's GradScaler driving it), accumulation and
the clip, with the loop unchanged, against plain torch's AMP recipe."""

from __future__ import annotations

import contextlib
import copy
import re
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastops.accelerate import Accelerator, accelerate
from tests.accelerate_helpers import make, batches, loop, params


def test_fp16_scales_grads_and_skips_steps():
    data = batches(3)
    model, opt = make()
    ref_model, _ = make()
    model, opt, _ = accelerate(model, opt, precision="fp16")
    scaler = opt.accelerator.scaler
    scale = scaler.get_scale()

    x, y = data[0]
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref_model(x), y).backward()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        # loss.backward() alone gives grads times the loss scale (fp16 autocast: 1e-2 relative).
        torch.testing.assert_close(p.grad / scale, r.grad, rtol=2e-2, atol=2e-4)
    opt.step()
    opt.zero_grad()
    assert not opt.step_was_skipped

    before = params(model)
    sched = opt.accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    lr = opt.param_groups[0]["lr"]
    x_inf = data[1][0].clone()
    x_inf[0, 0] = float("inf")
    F.cross_entropy(model(x_inf), data[1][1]).backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.step_was_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == scale / 2
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 0  # the scheduler did not advance
    assert opt.accelerator.step == 2


def _amp_loop(model, opt, data, scaler, clip: bool = False):
    """torch's AMP recipe, as an existing script has it (autocast and its own GradScaler)."""
    losses, scales, skipped = [], [], []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        before = params(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
    return losses, scales, skipped


@pytest.mark.parametrize("flavour", ["torch", "patched"])
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw+unscale_+clip", "sgd"])
def test_users_own_grad_scaler_drives_fp16(flavour, opt_kind):
    import fastops

    data = batches(6)
    x_inf = data[3][0].clone()
    x_inf[0, 0] = float("inf")  # the fp16 forward overflows: this step is skipped, the scale backs off
    data[3] = (x_inf, data[3][1])
    kind, clip = opt_kind.split("+")[0], "clip" in opt_kind
    with fastops.patched() if flavour == "patched" else contextlib.nullcontext():
        model, opt = make(opt=kind)
        ref = _amp_loop(model, opt, data, torch.amp.GradScaler("cpu"), clip)
        ref_params = params(model)

        model, opt = make(opt=kind)
        model, opt, _ = accelerate(model, opt, precision="fp16")
        scaler = torch.amp.GradScaler("cpu")
        assert isinstance(scaler, fastops.amp.GradScaler) == (flavour == "patched")
        got = _amp_loop(model, opt, data, scaler, clip)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0, equal_nan=True)
    assert got[1] == ref[1] == [65536.0] * 3 + [32768.0] * 3  # the user's scaler decides, once per step
    assert got[2] == ref[2] == [False] * 3 + [True] + [False] * 2  # the first step is not lost
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    own = opt.accelerator.scaler
    assert own.get_scale() == 65536.0 and not own._per_optimizer_states  # fastops' scaler stood aside


def test_users_grad_scaler_with_accumulate_raises_before_the_backward():
    model, opt, _ = accelerate(*make(), precision="fp16", accumulate=2)
    x, y = batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(RuntimeError, match="your GradScaler scales a loss .* accumulate=2"):
        torch.amp.GradScaler("cpu").scale(loss)
    # A loss not computed from the prepared model is none of fastops' business.
    other = nn.Linear(6, 3)
    torch.amp.GradScaler("cpu").scale(other(x).sum()).backward()


def test_a_grad_scaler_that_did_not_scale_the_loss_cannot_step():
    model, opt, _ = accelerate(*make(), precision="fp16")
    x, y = batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss.detach())  # not the loss that is backpropagated: fastops' hooks scale that one
    loss.backward()
    before = params(model)
    with pytest.raises(RuntimeError, match="called by a GradScaler that is not fastops'"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.accelerator.micro_step == 0


@pytest.mark.parametrize("grads", [True, False])
def test_fp16_step_with_a_closure_raises_torchs_message(grads):
    model, opt, _ = accelerate(*make(), precision="fp16")
    x, y = batches(1)[0]
    if grads:
        F.cross_entropy(model(x), y).backward()
    called = []

    def closure():
        called.append(1)
        return F.cross_entropy(model(x), y)

    before = params(model)
    torchs = "Closure use is not currently supported if GradScaler is enabled."
    with pytest.raises(RuntimeError, match=re.escape(torchs)):
        opt.step(closure)
    assert not called and opt.accelerator.micro_step == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_fp16_model_forward_called_directly_is_scaled():
    x, y = batches(1)[0]
    model, opt, _ = accelerate(*make(), precision="fp16")
    F.cross_entropy(model(x), y).backward()
    via_call = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    out = model.forward(x)  # skips module hooks, not the scaling
    assert out.dtype == torch.float32
    F.cross_entropy(out, y).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), via_call))
    opt.step()
    assert not opt.step_was_skipped


class _Namespaced(nn.Module):
    """Returns its logits in a container fastops does not look into."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return types.SimpleNamespace(logits=self.fc(x))


def test_fp16_gradient_that_bypasses_the_outputs_raises_at_step():
    x, y = batches(1)[0]
    model = _Namespaced()
    ref = copy.deepcopy(model)
    model, opt, _ = accelerate(model, torch.optim.AdamW(model.parameters()), precision="fp16")
    acc = opt.accelerator
    with pytest.warns(UserWarning, match="no floating-point tensor.*Accelerator.backward"):
        out = model(x)
    F.cross_entropy(out.logits.float(), y).backward()
    before = params(model)
    with pytest.raises(RuntimeError, match=r"none came through .*fp16 loss scale.*accelerator.backward\(loss\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and acc.micro_step == 0

    # The exact path: the whole loss scaled once.
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning was given once already
        out = model(x)
    acc.backward(F.cross_entropy(out.logits.float(), y))
    with torch.autocast("cpu", dtype=torch.float16):
        ref_logits = ref(x).logits
    F.cross_entropy(ref_logits.float(), y).backward()
    scale = acc.scaler.get_scale()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad / scale, r.grad, rtol=2e-2, atol=2e-4)
    opt.step()
    assert not opt.step_was_skipped and acc.step == 1


def test_accumulate_check_runs_at_the_boundary_only():
    x, y = batches(1)[0]
    model = _Namespaced()
    model, opt, _ = accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", accumulate=2)
    with pytest.warns(UserWarning, match="no floating-point tensor"):
        F.cross_entropy(model(x).logits, y).backward()
    opt.step()  # a micro-step: nothing to check yet
    F.cross_entropy(model(x).logits, y).backward()
    with pytest.raises(RuntimeError, match="1/2 of accumulate=2"):
        opt.step()


def test_backward_scales_loss_terms_outside_the_outputs():
    k, b = 2, 4
    data = batches(6 * k, b)

    def penalty(model):
        return 1e-2 * sum(p.square().sum() for p in model.parameters())

    model, opt = make()
    for i, (x, y) in enumerate(data):
        ((F.cross_entropy(model(x), y) + penalty(model)) / k).backward()
        if i % k == k - 1:
            opt.step()
            opt.zero_grad()
    ref = params(model)

    model, opt = make()
    model, opt, loader = accelerate(model, opt, data, precision="fp32", accumulate=k)
    for x, y in loader:
        opt.accelerator.backward(F.cross_entropy(model(x), y) + penalty(model))
        opt.step()
        opt.zero_grad()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_accumulation_matches_one_big_batch():
    k, b = 4, 2
    data = batches(8 * k, b)
    big = [(torch.cat([x for x, _ in data[i : i + k]]), torch.cat([y for _, y in data[i : i + k]]))
           for i in range(0, len(data), k)]
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loop(model, opt, big, sched)
    ref = params(model)

    for zero_first in (False, True):
        model, opt = make()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        acc = Accelerator(precision="fp32", accumulate=k)
        model, opt, sched, loader = acc.prepare(model, opt, sched, data)
        start = params(model)
        prefetched = list(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's scheduler sees the prepared step as the right order
            loop(model, opt, prefetched[: k - 1], sched, zero_first)
        # the first k-1 step()/zero_grad() calls did nothing; the grads accumulated
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert all(p.grad is not None for p in model.parameters()) and acc.step == 0
        assert opt.param_groups[0]["lr"] == 1e-2
        loop(model, opt, prefetched[k - 1 :], sched, zero_first)
        assert acc.step == 8 and sched.last_epoch == 8
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_grad_clip_folded_and_other_optimizers():
    data = batches(6)
    for kind in ("adamw", "sgd"):
        model, opt = make(opt=kind)
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        ref = params(model)

        model, opt = make(opt=kind)
        model, opt2, loader = accelerate(model, opt, data, precision="fp32", grad_clip=0.1)
        if kind == "sgd":
            assert opt2 is opt  # kept, and still clipped
        else:
            assert all(g["max_grad_norm"] == 0.1 for g in opt2.param_groups)  # folded into the fused step
        loop(model, opt2, loader)
        assert opt2.last_grad_norm > 0.1  # the clip was active
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_other_optimizer_fp16_unscales_clips_and_skips():
    data = batches(8)
    data[3] = (data[3][0].clone().fill_(float("inf")), data[3][1])  # this step must be skipped
    model, opt = make(opt="sgd")
    scaler = torch.amp.GradScaler("cpu")
    for x, y in data:  # torch's recipe for fp16 with clipping
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ref = params(model)

    model, opt = make(opt="sgd")
    model, opt2, loader = accelerate(model, opt, data, precision="fp16", grad_clip=0.5)
    assert opt2 is opt
    loop(model, opt2, loader)
    assert opt2.accelerator.scaler.get_scale() == scaler.get_scale() == 32768.0
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
