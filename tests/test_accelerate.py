"""fastops.accelerate: the one line, with the training loop unchanged, against plain torch."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fastops import _util, optim
from fastops.accelerate import Accelerator, _checkpoint, _cpu_cache, _distributed, _loader, _model, accelerate
from tests import dist_worker
from tests.rounding import assert_as_accurate, assert_orders_agree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def make(dropout: float = 0.0, opt: str = "adamw", **kw):
    torch.manual_seed(0)
    model = Net(dropout)
    if opt == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(n: int, b: int = 8, seed: int = 1):
    """Labels from a fixed linear rule, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(99))
    xs = [torch.randn(b, 6, generator=g) for _ in range(n)]
    return [(x, (x @ w).argmax(1)) for x in xs]


def loop(model, opt, loader, sched=None, zero_first: bool = False):
    """The user's loop, as written for plain PyTorch."""
    losses = []
    for x, y in loader:
        if zero_first:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if not zero_first:
            opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def params(model):
    return [p.detach().clone() for p in model.parameters()]


# ---- the one line --------------------------------------------------------------------------------------


def test_fp32_parity_with_plain_torch():
    data = batches(12)
    model, opt = make()
    ref_losses = loop(model, opt, data)
    ref = params(model)

    model, opt = make()
    model2, opt2, loader = accelerate(model, opt, data, precision="fp32")
    assert model2 is model and isinstance(opt2, optim.AdamW) and isinstance(opt2, torch.optim.AdamW)
    losses = loop(model2, opt2, loader)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    for p, r in zip(model2.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_optimizer_converted_in_place_keeps_groups_state_and_hooks():
    torch.manual_seed(0)
    model = Net()

    def adam(m):
        groups = [{"params": m.fc1.parameters(), "lr": 3e-3, "weight_decay": 0.01}, {"params": m.fc2.parameters()}]
        return torch.optim.Adam(groups, lr=1e-3, betas=(0.8, 0.9), amsgrad=True)

    opt = adam(model)
    data = batches(5)
    loop(model, opt, data[:2])  # state exists before the one line
    ref_model = copy.deepcopy(model)
    ref_opt = adam(ref_model)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: load_state_dict keeps same-dtype tensors
    group_ids = [id(g) for g in opt.param_groups]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    saved = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    steps = []
    opt.register_step_post_hook(lambda *args: steps.append(1))

    _, new, _ = accelerate(model, opt, precision="fp32")
    assert new is opt and type(opt) is optim.Adam  # the user's object, now fused
    assert [id(g) for g in opt.param_groups] == group_ids
    for g, h in zip(opt.param_groups, hyper):
        assert {k: v for k, v in g.items() if k in h} == h
    for p, state in saved.items():
        assert set(opt.state[p]) == set(state)
        for k, v in state.items():
            assert opt.state[p][k].dtype == torch.float32 and torch.equal(opt.state[p][k], v.float())

    loop(model, opt, data[2:])
    loop(ref_model, ref_opt, data[2:])
    assert len(steps) == 3  # the step hook registered on torch's optimizer still runs
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_schedulers_built_before_the_one_line_keep_driving_the_optimizer():
    data = batches(8)

    def run(prepared: bool):
        model, opt = make()
        free = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # never prepared
        lr_scheduler = torch.optim.lr_scheduler
        warmup, decay = lr_scheduler.LinearLR(opt, 0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, 0.9)
        seq = lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
        loader = data
        if prepared:
            model, opt, seq, loader = Accelerator(precision="fp32").prepare(model, opt, seq, data)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                free.step()
                seq.step()
                lrs.append(opt.param_groups[0]["lr"])
        return lrs, params(model)

    ref_lrs, ref = run(prepared=False)
    lrs, got = run(prepared=True)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12) and len(set(lrs)) > 4
    for p, r in zip(got, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_optimizers_fastops_cannot_fuse_stay_as_they_are():
    class MyAdamW(torch.optim.AdamW):
        pass

    torch.manual_seed(0)
    cases = [
        (Net().double(), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),  # fastops has no float64 kernel
        (Net(), lambda ps: MyAdamW(ps, lr=1e-2)),  # a subclass may override what fastops would replace
        (Net(), lambda ps: torch.optim.AdamW(ps, lr=1e-2, differentiable=True)),
    ]
    for model, build in cases:
        opt = build(model.parameters())
        cls = type(opt)
        _, new, loader = accelerate(model, opt, batches(2), precision="fp32")
        assert new is opt and type(opt) is cls
        losses = [F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y) for x, y in loader]
        assert all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loop_unchanged_low_precision(precision):
    data = batches(40)
    model, opt = make()
    model, opt, loader = accelerate(model, opt, data, precision=precision)
    x = data[0][0]
    assert model(x).dtype == torch.float32  # outputs come back in fp32
    if precision == "bf16":
        with torch.no_grad():  # autocast is on inside forward
            seen = []
            h = model.fc1.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
            model(x)
            h.remove()
        assert seen == [torch.bfloat16]
    losses = loop(model, opt, loader)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "extra": (y.argmax(1), [y * 2]), "note": "kept"}


def test_nested_outputs_come_back_fp32():
    model, _, _ = accelerate(_Nested(), torch.optim.SGD(_Nested().parameters(), lr=0.1), precision="bf16")
    out = model(torch.randn(4, 6))
    assert out["logits"].dtype == out["extra"][1][0].dtype == torch.float32
    assert out["extra"][0].dtype == torch.int64 and out["note"] == "kept"


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(config)


def test_hf_model_output_trains_with_the_loop_unchanged():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 100, (4, 16), generator=g) for _ in range(10)]
    # The labels are the inputs: a rule the model learns within these steps, so the losses move.
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]

    def run(model, opt, loader):
        losses = []
        for batch in loader:
            out = model(**batch)
            loss = out.loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, out

    ref_model = _tiny_bert()
    ref_losses, _ = run(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), data)
    model = _tiny_bert()
    model, opt, loader = accelerate(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, precision="fp32")
    losses, out = run(model, opt, loader)
    assert type(out).__name__ == "MaskedLMOutput" and out["logits"] is out.logits
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=0)
    assert losses[-1] < 0.9 * losses[0], losses
    # Rounding-level differences of the two AdamW steps grow over 10 steps where Adam divides a near-zero
    # grad by its near-zero second moment: at most 1.6e-5 here, 0.2% of one step's update (lr = 1e-2).
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-3, atol=1e-4)


def test_hf_cache_in_the_outputs_is_neither_copied_nor_changed():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    seen = []

    def snapshot(_module, _args, out):  # registered first: runs before fastops' output hook
        cache = out.past_key_values
        seen.append((cache, [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]))

    model.register_forward_hook(snapshot)
    model, opt, _ = accelerate(model, torch.optim.AdamW(model.parameters()), precision="bf16")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids, use_cache=True)
    cache, before = seen[0]
    assert out.past_key_values is cache
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(after) == len(before) == 4
    for a, b in zip(after, before):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)  # not cast to fp32 as the logits are
    assert out.logits.dtype == torch.float32
    out.loss.backward()
    opt.step()


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
    big = [(torch.cat([x for x, _ in data[i : i + k]]), torch.cat([y for _, y in data[i : i + k]])) for i in range(0, len(data), k)]
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


class _Epochs:
    """An iterable that records set_epoch calls."""

    def __init__(self, data):
        self.data, self.epochs = data, []

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_loader_kinds_and_set_epoch():
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(5)
    src = _Epochs(data)
    acc = Accelerator(precision="fp32")
    acc.prepare(*make())
    loader = acc.prepare(src)
    for _ in range(3):
        got = list(loader)
    assert src.epochs == [0, 1, 2] and len(loader) == 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, data))
    gen = acc.prepare(b for b in data)
    assert len(list(gen)) == 5
    ds = TensorDataset(torch.arange(10.0))
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    assert [b[0].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _refilling(n: int, produced: list | None = None):
    """A loader that refills one buffer for every batch."""
    buf = torch.zeros(8, 6)
    for i in range(n):
        buf.fill_(i)
        if produced is not None:
            produced[i].set()
        yield buf, torch.zeros(8, dtype=torch.long)


def test_a_loader_that_refills_one_buffer_gives_the_plain_loops_batches():
    n = 6
    produced = [threading.Event() for _ in range(n)]
    model, opt = make()
    _, _, loader = accelerate(model, opt, _refilling(n, produced), precision="fp32")
    seen = []
    for i, (x, _) in enumerate(loader):
        if i + 1 < n:
            assert produced[i + 1].wait(timeout=30)  # the loader has refilled its buffer meanwhile
        seen.append(x[0, 0].item())
    assert seen == [float(i) for i in range(n)]
    # With several ranks, each reads a whole round before it yields its own batch of it.
    for rank in (0, 1):
        got = [x[0, 0].item() for x, _ in _loader.RoundRobin(_refilling(7), rank, 2)]
        assert got == [float(i) for i in range(rank, 6, 2)]


class _Noisy(Dataset):
    """A random augmentation: draws from torch's global generator in __getitem__. Records the loading threads."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x @ torch.randn(6, 3, generator=g)).argmax(1)
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.threads.add(threading.current_thread().name)
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


def test_dataloader_without_workers_is_read_on_the_loops_thread():
    ds = _Noisy()
    acc = Accelerator(precision="fp32")
    model, opt = acc.prepare(*make(dropout=0.3))
    loop(model, opt, acc.prepare(DataLoader(ds, batch_size=4, shuffle=True)))
    # In the Prefetcher's thread, its draws would interleave with dropout's in a different order every run.
    assert ds.threads == {threading.current_thread().name}
    with_workers = acc.prepare(DataLoader(ds, batch_size=4, num_workers=1))
    assert with_workers.prefetcher.background  # worker processes draw from their own generators


def test_prepared_loader_exposes_the_dataloaders_attributes():
    ds = TensorDataset(torch.arange(10.0))
    dl = DataLoader(ds, batch_size=4)
    acc = Accelerator(precision="fp32")
    acc.prepare(*make())
    loader = acc.prepare(dl)
    assert loader.dataset is ds and loader.batch_size == 4 and loader.sampler is dl.sampler
    assert loader.prefetcher.dataset is ds and loader.epoch == 0
    with pytest.raises(AttributeError, match="no_such_thing"):
        loader.no_such_thing
    clone = copy.copy(loader)  # copy probes a bare instance for __setstate__: no recursion into __getattr__
    assert clone.dataset is ds


def test_compile_smoke():
    # CI and the dev machines have gcc, so inductor must compile here: any failure is a real one.
    model, opt = make()
    model, opt, loader = accelerate(model, opt, batches(3), precision="fp32", compile=True)
    losses = loop(model, opt, loader)
    assert all(torch.isfinite(torch.tensor(losses)))


# ---- checkpoints ---------------------------------------------------------------------------------------


def _fresh(dropout=0.3):
    model, opt = make(dropout)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    acc = Accelerator(precision="fp32")
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def test_checkpoint_resume_is_bitwise(tmp_path):
    data = batches(6)
    acc, model, opt, sched = _fresh()
    loop(model, opt, data, sched)  # dropout draws from the torch RNG every step
    uninterrupted = params(model)

    acc, model, opt, sched = _fresh()
    loop(model, opt, data[:3], sched)
    acc.save(tmp_path / "ckpt.pt")
    torch.manual_seed(1234)  # the process state moves on; load must restore it
    acc, model, opt, sched = _fresh()
    acc.load(tmp_path / "ckpt.pt")
    assert acc.step == 3 and sched.last_epoch == 3
    loop(model, opt, data[3:], sched)
    assert all(torch.equal(p, u) for p, u in zip(model.parameters(), uninterrupted))


def test_resume_through_a_shuffled_dataloader_is_bitwise(tmp_path):
    def fresh():
        acc = Accelerator(precision="fp32")
        model, opt = make(dropout=0.3)
        model, opt, loader = acc.prepare(model, opt, DataLoader(_Noisy(), batch_size=4, shuffle=True))
        torch.manual_seed(5)
        return acc, model, opt, loader

    acc, model, opt, loader = fresh()
    for _ in range(3):  # shuffling, augmentation and dropout all draw from the global generator
        loop(model, opt, loader)
    uninterrupted = params(model)

    acc, model, opt, loader = fresh()
    loop(model, opt, loader)
    acc.save(tmp_path / "ckpt.pt")
    acc, model, opt, loader = fresh()
    torch.manual_seed(1234)
    acc.load(tmp_path / "ckpt.pt")
    assert loader.epoch == 1 and acc.step == 6
    for _ in range(2):
        loop(model, opt, loader)
    assert all(torch.equal(p, u) for p, u in zip(model.parameters(), uninterrupted))


def test_checkpoint_file_mode_and_fsyncs(tmp_path, monkeypatch):
    acc, model, opt, sched = _fresh()
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), fsync(fd)))
    umask = os.umask(0o027)
    try:
        acc.save(tmp_path / "ckpt.pt")
    finally:
        os.umask(umask)
    # What open(path, "wb") creates under that umask (mkstemp would give 0o600).
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt.pt").st_mode) == 0o640
    assert synced == [False, True]  # the file, then its directory after the rename


_KILLED_SAVE = """
import os, signal, sys, torch
from fastops.accelerate import Accelerator
from tests.test_accelerate import make
acc = Accelerator(precision="fp32")
acc.prepare(*make())
def dies(obj, f, *a, **k):  # killed halfway through writing the checkpoint
    f.write(b"x" * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dies
acc.save(sys.argv[1])
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_checkpoint_save_removes_temp_files_of_killed_saves(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (tmp_path / "other.pt.0123456789ab.tmp").write_bytes(b"another target's")
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.pt.")]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp") and not path.exists()
    acc, model, opt, sched = _fresh()
    acc.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "other.pt.0123456789ab.tmp"]
    acc.load(path)


def test_checkpoint_saved_through_a_symlink_keeps_the_link(tmp_path):
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "runs" / "step100.pt")  # dangling until the first save, as torch.save allows
    acc, model, opt, sched = _fresh()
    for _ in range(2):
        acc.save(link)
        assert link.is_symlink() and (tmp_path / "runs" / "step100.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "runs"]
    assert os.listdir(tmp_path / "runs") == ["step100.pt"]
    acc.load(link)


def test_checkpoint_rng_of_another_world_size_or_version(tmp_path):
    path = tmp_path / "ckpt.pt"
    acc, model, opt, sched = _fresh()
    acc.save(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["fastops_checkpoint"] == 2 and len(ckpt["rng"]) == 1
    mine = ckpt["rng"][0]["torch"]
    torch.manual_seed(42)
    ckpt["rng"].append(_checkpoint._rng_state())  # as if saved by 2 ranks
    torch.save(ckpt, path)
    torch.manual_seed(7)
    with pytest.warns(UserWarning, match=r"RNG states of 2 rank\(s\), this run has 1; rank r restores saved rank"):
        acc.load(path)
    assert torch.equal(torch.get_rng_state(), mine)

    ckpt.update(fastops_checkpoint=1, rng=ckpt["rng"][0])  # version 1: rank 0's state, not a list
    torch.save(ckpt, path)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.load(path)
    assert torch.equal(torch.get_rng_state(), mine)


def test_checkpoint_truncated_or_mismatched_keeps_last_good(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    acc, model, opt, sched = _fresh()
    loop(model, opt, batches(2), sched)
    acc.save(path)
    good = path.read_bytes()

    def crash(obj, f, *a, **k):  # a save that dies halfway through writing
        f.write(good[: len(good) // 2])
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", crash)
        with pytest.raises(OSError, match="disk full"):
            acc.save(path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left

    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good[: len(good) // 2])
    before = params(model)
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        acc.load(bad)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    other = Accelerator(precision="fp32")
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3))
    other.prepare(wide, torch.optim.AdamW(wide.parameters()))
    before = params(wide)
    with pytest.raises(ValueError, match="does not match.*missing keys"):
        other.load(path)
    assert all(torch.equal(p, b) for p, b in zip(wide.parameters(), before))

    fp16 = Accelerator(precision="fp16")
    fp16.prepare(*make())
    with pytest.raises(ValueError, match="precision='fp32'.*'fp16'"):
        fp16.load(path)
    acc.load(path)  # the last good one still loads


def test_checkpoint_with_numpy_hyperparameters_loads(tmp_path):
    import fractions

    import numpy as np

    model, opt = make()
    opt.param_groups[0]["lr"] = np.float64(3e-3)  # from a config file or a sweep
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=np.float32(0.5))  # base_lrs get np.float64
    acc = Accelerator(precision="fp32")
    model, opt, sched = acc.prepare(model, opt, sched)
    loop(model, opt, batches(3), sched)
    acc.save(tmp_path / "np.pt")
    lr = opt.param_groups[0]["lr"]
    acc.load(tmp_path / "np.pt")
    assert opt.param_groups[0]["lr"] == lr and type(opt.param_groups[0]["lr"]) is float
    assert sched.scheduler.base_lrs == [3e-3] and sched.scheduler.gamma == 0.5

    opt.param_groups[0]["note"] = fractions.Fraction(1, 3)  # a type weights_only unpickling refuses
    acc.save(tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match=r"refuses to unpickle, not damaged data.*add_safe_globals") as e:
        acc.load(tmp_path / "other.pt")
    assert "truncated" not in str(e.value)


# ---- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="fp8"), "unknown precision 'fp8'"),
        (dict(strategy="deepspeed"), "unknown strategy 'deepspeed'"),
        (dict(accumulate=0), "accumulate must be an int >= 1"),
        (dict(accumulate=2.5), "accumulate must be an int >= 1"),
        (dict(grad_clip=-1.0), "grad_clip must be > 0"),
        (dict(strategy="ddp"), "strategy='ddp' needs a process group"),
        (dict(strategy="fsdp"), "strategy='fsdp' needs a process group"),
        (dict(device="meta"), "device 'meta' is not supported; use 'cpu' or 'cuda'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accelerate(*make(), **kwargs)


def test_where_it_runs_is_one_frozen_state():
    import ast
    import dataclasses
    import inspect
    import textwrap

    from fastops.accelerate._state import ProcessState

    acc = Accelerator(precision="fp32")
    assert isinstance(acc.state, ProcessState) and acc.state.strategy == "none" and acc.dp_size == 1
    assert (acc.device, acc.rank, acc.world_size, acc.is_main, acc.mesh) == (torch.device("cpu"), 0, 1, True, None)
    with pytest.raises(AttributeError):
        acc.rank = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        acc.state.rank = 1
    # accelerate's keywords are Accelerator's: one list, shown by help(), a misspelling refused by name.
    keywords = list(inspect.signature(Accelerator).parameters)
    assert list(inspect.signature(accelerate).parameters) == ["model", "optimizer", "loader", *keywords]
    with pytest.raises(TypeError, match="precison"):
        accelerate(*make(), precison="fp32")
    # __init__ reads no attribute of its own before assigning it (the state's fields come as properties).
    init = ast.parse(textwrap.dedent(inspect.getsource(Accelerator.__init__))).body[0]
    assigned = {name for name in dir(Accelerator) if isinstance(getattr(Accelerator, name), property)}
    for stmt in init.body:
        nodes = [n for n in ast.walk(stmt) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)]
        mine = [n for n in nodes if n.value.id == "self"]
        read = {n.attr for n in mine if isinstance(n.ctx, ast.Load)}
        assert read <= assigned, f"Accelerator.__init__ line {stmt.lineno} reads {read - assigned} before it is set"
        assigned |= {n.attr for n in mine if isinstance(n.ctx, ast.Store)}


def test_cpu_cache_settings(monkeypatch):
    for off in ("0", "false", "OFF", "No"):
        monkeypatch.setenv("FASTOPS_KEEP_FREED_MEMORY", off)
        assert not _cpu_cache.keep_freed_memory() and not Accelerator(precision="fp32").keeps_freed_memory
    for on in ("1", "True", "on", "YES"):
        monkeypatch.setenv("FASTOPS_KEEP_FREED_MEMORY", on)
        assert _cpu_cache.keep_freed_memory()
    monkeypatch.setenv("FASTOPS_KEEP_FREED_MEMORY", "maybe")
    with pytest.raises(ValueError, match="FASTOPS_KEEP_FREED_MEMORY must be 1, true, on, yes or 0, false, off, no"):
        _cpu_cache.keep_freed_memory()
    monkeypatch.setenv("FASTOPS_KEEP_FREED_MEMORY", "1")
    for bad in ("1" + "0" * 20, "1.5", "-1", "lots"):
        monkeypatch.setenv("FASTOPS_CPU_CACHE_MB", bad)
        with pytest.raises(ValueError, match=f"FASTOPS_CPU_CACHE_MB must be a whole number of MiB .* got '{bad}'"):
            _cpu_cache.keep_freed_memory()


def test_fp16_without_autocast_support(monkeypatch):
    monkeypatch.setattr(_model, "_autocast_supported", lambda device_type, dtype: dtype != torch.float16)
    with pytest.raises(ValueError, match="precision='fp16' is not supported by autocast on device cpu"):
        accelerate(*make(), precision="fp16")


def test_model_without_parameters():
    with pytest.raises(ValueError, match="has no parameters"):
        accelerate(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    resolve = _util.resolve_device
    # Under torchrun (LOCAL_RANK=2): "cuda" and no device both mean this rank's GPU, not every rank on one.
    assert resolve("cuda", local_rank=2) == resolve(None, local_rank=2) == torch.device("cuda", 2)
    assert resolve("cuda:1", local_rank=2) == torch.device("cuda", 1)
    assert resolve("cuda", local_rank=None) == resolve(None, local_rank=None) == torch.device("cuda", 3)
    assert resolve("cpu", local_rank=2) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK=5 but this process sees 4 CUDA device"):
        resolve("cuda", local_rank=5)
    with pytest.raises(ValueError, match="'cuda:4' does not exist"):
        resolve("cuda:4", local_rank=None)
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve("gpu0", local_rank=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(None, local_rank=2) == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve("cuda", local_rank=2)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--batch", "two"], "--batch: expected an integer, got 'two'"),
        (["--dim", "30"], "--dim: must be a multiple of 4"),
        (["--device", "cuda"], "--device: 'cuda' needs CUDA, which this torch .* does not have"),
        (["--device", "meta"], "--device: 'meta' is not supported; use 'cpu' or 'cuda'"),
    ],
)
def test_demo_rejects_bad_arguments(argv, match, monkeypatch, capsys):
    from fastops.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2  # argparse's usage error, before anything runs
    assert re.search(match, capsys.readouterr().err)


# ---- one rank in this process (gloo) -------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulation_skips_gradient_sync_on_micro_steps(strategy, one_rank_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    syncs = []  # per forward: whether its backward all-reduces (DDP) / reduce-scatters (FSDP2)
    if strategy == "ddp":
        no_sync = DistributedDataParallel.no_sync
        monkeypatch.setattr(DistributedDataParallel, "no_sync", lambda self: (syncs.append(False), no_sync(self))[1])
    else:
        set_sync = FSDPModule.set_requires_gradient_sync
        monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync",
                            lambda self, sync, **kw: (syncs.append(sync), set_sync(self, sync, **kw))[1])  # fmt: skip
    k, data = 2, batches(8, 2)
    model, opt = make()
    model, opt, loader = accelerate(model, opt, data, precision="fp32", strategy=strategy, accumulate=k)
    for x, y in loader:
        before = len(syncs)
        F.cross_entropy(model(x), y).backward()
        if strategy == "ddp" and len(syncs) == before:
            syncs.append(True)  # this forward ran outside no_sync()
        opt.step()
        opt.zero_grad()
    assert syncs == [False, True] * 4


# ---- two ranks (gloo) ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(cmds: list[list[str]], envs: list[dict[str, str]], log_dir) -> list[subprocess.Popen]:
    """Starts the commands in one new process group (the first one's), so that one killpg ends them all
    along with anything they spawned. A group, not a session per process (start_new_session): a process can
    only join a group of its own session. Output goes to files: a rank blocked on a full pipe would stall the
    others."""
    procs: list[subprocess.Popen] = []
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        join = functools.partial(os.setpgid, 0, procs[0].pid if procs else 0)  # 0: a new group, led by rank 0
        with open(os.path.join(log_dir, f"rank{i}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=join))  # fmt: skip
    return procs


def _wait_group(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits for every process; past ``timeout`` (a hang) kills the whole group and raises TimeoutExpired."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        raise


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie has exited; only its entry is left
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rank_launcher_kills_the_whole_group_on_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    spawn = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")  # fmt: skip
    cmds = [[sys.executable, "-c", spawn], [sys.executable, "-c", "import time; time.sleep(600)"]]
    procs = _start_group(cmds, [{}, {}], tmp_path)
    for _ in range(3000):  # until the grandchild exists (at most 30 s)
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.01)
    grandchild = int(pid_file.read_text())
    with pytest.raises(subprocess.TimeoutExpired):
        _wait_group(procs, timeout=0.1)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    for _ in range(1000):  # SIGKILL is delivered at once; the exit itself can take a moment
        if _gone(grandchild):
            break
        time.sleep(0.01)
    assert _gone(grandchild), "the rank's child survived the launcher's timeout"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(strategy, tmp_path):
    out = tmp_path / "result.pt"
    # The ranks are started here rather than by torchrun, which gives each worker its own session: a killpg
    # on torchrun after a hang would leave them running.
    port = str(_free_port())
    world = dist_worker.WORLD
    envs = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world)) for r in range(world)]  # fmt: skip
    cmd = [sys.executable, os.path.join(ROOT, "tests", "dist_worker.py"), strategy, str(out)]
    procs = _start_group([cmd] * world, envs, tmp_path)
    logs = lambda: "".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world))  # noqa: E731
    try:
        _wait_group(procs, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks hung; killed:\n" + logs())
    assert [p.returncode for p in procs] == [0] * world, logs()
    result = torch.load(out)
    for name in dist_worker.SCENARIOS:
        # Two ranks sum the grads in another order than one process: as accurate as it, against float64.
        ref_losses, ref_params = dist_worker.reference(name)
        exact_losses, exact_params = dist_worker.reference(name, torch.float64)
        got = result[name]
        if dist_worker.SCENARIOS[name]["accumulate"] == 1:
            assert_as_accurate(got["losses"], ref_losses, exact_losses, what=f"{strategy} {name} losses")
        for n, p in ref_params.items():
            assert_as_accurate(got["params"][n], p, exact_params[n], what=f"{strategy} {name} {n}")
    assert result["checkpoint_ok"]
    assert result["sharded_sampler"]  # a map-style DataLoader got a DistributedSampler, visible as loader.sampler
    assert result["resume_bitwise"]  # each rank got its own RNG state back
    assert result["save_error_on_every_rank"]
    if strategy == "ddp":
        assert result["rank0_only_load"]  # returned without waiting for the other rank
    for name in ("fp16_adamw_clip", "fp16_sgd_clip"):
        scales = result[name]["scales"]
        assert scales[0] == scales[1], (name, scales)  # the same steps were skipped on both ranks
        assert all(map(math.isfinite, result[name]["losses"][-2:]))
    assert result["fp16_adamw_clip"]["scales"][0] < 65536.0  # some steps were skipped
    if strategy == "fsdp":
        _check_sharded_fsdp_checkpoints(result)


def _check_sharded_fsdp_checkpoints(result):
    """Saved by 2 FSDP ranks after one epoch: the directory of shards holds no gathered file; it resumes at 2 ranks
    and in one process with the losses of the uninterrupted run, scheduler and fp16 scaler included."""
    per_epoch = dist_worker.N // (dist_worker.PER_RANK_BATCH * dist_worker.WORLD)
    for precision in ("fp32", "fp16"):
        got = result[f"sharded_{precision}"]
        assert got["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "fastops.pt"]
        after = got["straight"][per_epoch:]
        assert got["first"] == got["straight"][:per_epoch]
        assert got["resumed"]["losses"] == after  # the same ranks in the same order: bitwise
        assert got["resumed"]["state"] == got["saved"] and got["resumed"]["step"] == 2 * per_epoch
        if precision == "fp16":  # steps were skipped before the save: the scale and the scheduler show it
            assert got["saved"]["scaler"]["scale"] < 65536.0
            assert got["saved"]["sched"]["last_epoch"] < per_epoch
        else:  # the one file FSDP saved before, gathered
            assert got["legacy"]["losses"] == after
            assert got["legacy"]["state"] == got["saved"]

        # One process, the same global batches (both ranks' halves side by side).
        acc, model, opt, sched, _ = dist_worker.sharded_setup("none", precision)
        with pytest.warns(UserWarning, match=r"RNG states of 2 rank\(s\), this run has 1"):
            acc.load(got["path"])
        assert acc.step == per_epoch and sched.state_dict() == got["saved"]["sched"]
        if precision == "fp16":
            assert acc.scaler.state_dict() == got["saved"]["scaler"]
        x, y = dist_worker.data()
        sc = dict(epochs=dist_worker.SHARDED_EPOCHS, shuffle=False)
        batches = [(x[i], y[i]) for i in dist_worker.global_batches(sc)[per_epoch:]]
        losses = dist_worker.sharded_epoch(model, opt, sched, batches)
        # The loaded weights, exactly (the first loss's forward sums the batch in another order: a few ulps).
        assert abs(losses[0] - after[0]) <= 8 * 2.0**-24 * abs(after[0])
        if precision == "fp32":  # one process sums the grads in another order than 2 ranks (tests/rounding.py)
            full32, full64 = dist_worker.sharded_reference(torch.float32), dist_worker.sharded_reference(torch.float64)
            assert_orders_agree(losses, after, full32, full64, what="fsdp checkpoint continued in one process")
        else:
            # An fp16 rounding that flips with the order moves the third loss by 1.6e-4 relative: within 4 units
            # of fp16's roundoff (2**-11 = 4.9e-4), the bound being fp16's, not the checkpoint's.
            torch.testing.assert_close(losses, after, rtol=4 * 2.0**-11, atol=0)
