"""fastops.accelerate: the one line, with the training loop unchanged, against plain torch; its state and bad input.
fp16 and accumulation: test_accelerate_fp16.py; loaders: test_accelerate_loader.py; checkpoints:
test_accelerate_checkpoint.py; process groups: test_accelerate_dist.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastops import _util, optim
from fastops.accelerate import Accelerator, _cpu_cache, _model, accelerate
from tests.accelerate_helpers import Net, make, batches, loop, params


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
    transformers = pytest.importorskip("transformers")  # the torch 2.13 CI leg has none
    BertConfig, BertForMaskedLM = transformers.BertConfig, transformers.BertForMaskedLM

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
    transformers = pytest.importorskip("transformers")  # the torch 2.13 CI leg has none
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel

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
