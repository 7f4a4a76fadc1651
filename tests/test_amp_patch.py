"""The GradScalers and clip_grad_norm_ fastops.patch() swaps in, the deprecated device scalers, and torch's
contracts that frameworks read (_step_supports_amp_scaling, who counts step calls)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import fastops
import fastops.amp as famp
from tests.amp_helpers import INIT_SCALE, MAX_NORM, POISON, _model, _loss, SCALERS, no_host_reads


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
