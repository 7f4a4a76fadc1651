"""``fastops.patch()`` inside the frameworks people train with: PyTorch Lightning's Trainer, HF Accelerate's
Accelerator and HF's Trainer, the real ones, each run twice from the same weights and batches, without and with
``patch()``. What each framework reads of torch's optimizer and scaler must read the same:

- Lightning refuses to clip for an optimizer with ``_step_supports_amp_scaling`` (torch sets it on ``fused=True``
  instances only) and unscales before clipping for the others.
- Accelerate flags an fp16 step as skipped when ``optimizer.step`` was not called, and HF's Trainer (through
  Accelerate's scheduler and its own loop) holds the LR schedule on that flag.

fp16 on the CPU: Accelerate runs fp32 there without a word (no autocast, no scaler) and Lightning turns
"16-mixed" into bf16, so their GPU fp16 paths are driven as they run on a GPU: Accelerate's ``native_amp`` set
and a CPU GradScaler given to it, Lightning's MixedPrecision plugin with a CPU scaler. The scale starts at 2**24,
so the first steps overflow in fp16 and are skipped while the scale halves, as on a GPU.

Steps: after every iteration each run records its optimizer's step count (``state[p]["step"]``, which a step
skipped for inf/nan grads leaves as it was, in torch's AdamW as in fastops'), and the two runs' counts must be
equal iteration by iteration: a step missed or taken twice, or a skipped fp16 step taken, fails there. The
planted-fault cases show it: they make fastops' AdamW drop or repeat one of its steps (one that is not skipped
for inf/nan grads, where dropping it would change nothing) and expect the check to fail.

Losses: fastops' fp32 AdamW step differs from torch's at rounding level (tests/test_adam.py), which autocast's
bf16/fp16 rounding of the next forward can turn into one unit of its last place in a few activations; the
losses then agree to a few units of fp16's/bf16's rounding over these steps: LOWP_RTOL.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn

import fastops
from tests.test_real_models import bert, mlm_batch

STEPS = 12
INIT_SCALE = 2.0**24
LOWP_RTOL = 2e-2  # bf16 keeps 8 bits: 2**-8 = 3.9e-3 per rounding, a few roundings compounded over the steps
LEARNS = 5e-2


def _patched(on: bool):
    return fastops.patched() if on else _Nothing()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_close_and_learning(plain, fast, rtol):
    assert len(plain) == len(fast)
    rel = max(abs(a - b) / abs(a) for a, b in zip(plain, fast))
    assert rel <= rtol, f"losses differ by {rel:.2e} (tolerance {rtol:g}):\n{plain}\n{fast}"
    assert abs(plain[-1] - plain[0]) / abs(plain[0]) > LEARNS, plain  # the runs train


def _step_count(opt) -> int:
    """Steps ``opt`` (or the optimizer a framework wraps in it) has taken: its first param's ``step``."""
    opt = getattr(opt, "optimizer", opt)
    state = opt.state.get(opt.param_groups[0]["params"][0], {})
    return int(state["step"]) if "step" in state else 0


def _assert_same_steps(plain_counts, fast_counts):
    """The step counts after each iteration agree: the same steps taken, and the same ones skipped."""
    assert len(plain_counts) == len(fast_counts) == STEPS
    assert fast_counts == plain_counts, f"optimizer steps after each iteration:\n{plain_counts}\n{fast_counts}"


def _skipped(counts):
    """The iterations whose optimizer step did not count (skipped for inf/nan grads)."""
    return [i for i, (a, b) in enumerate(zip([0, *counts], counts)) if b == a]


FAULTS = [None, "missed", "extra"]


@contextlib.contextmanager
def _planted(fault, monkeypatch, at=5):
    """fastops' AdamW drops (``missed``: the closure runs, the update does not) or repeats (``extra``) its
    ``at``-th step; the step-count check must then fail."""
    if fault is None:
        yield
        return
    original = fastops.optim.AdamW.step
    calls = [0]

    def step(self, closure=None):
        calls[0] += 1
        if calls[0] != at:
            return original(self, closure)
        if fault == "missed":
            if closure is not None:
                with torch.enable_grad():
                    return closure()
            return None
        out = original(self, closure)
        original(self)
        return out

    monkeypatch.setattr(fastops.optim.AdamW, "step", step)
    yield
    monkeypatch.undo()
    assert calls[0] >= at, "the fault was never reached"


def _check_with_fault(fault, check):
    """``check()`` passes without a fault and fails with one."""
    if fault is None:
        check()
    else:
        with pytest.raises(AssertionError, match="optimizer steps after each iteration"):
            check()


# ---- PyTorch Lightning -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _plain_lightning_run(precision: str, clip: float):
    return _lightning_run(False, precision, clip)


def _lightning_run(patched: bool, precision: str, clip: float):
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision

    class Counter(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            pl_module.step_counts.append(_step_count(trainer.optimizers[0]))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
            self.losses, self.optimizer_types, self.step_counts = [], [], []

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            self.optimizer_types.append(type(opt))
            return opt

    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1].sin() * 3)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    with _patched(patched):
        kw = dict(precision=precision)
        if precision == "16-mixed":  # Lightning's GPU fp16 path, on the CPU (see the module docstring)
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            kw = dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, gradient_clip_val=clip, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[Counter()], **kw)  # fmt: skip
        module = Module()
        trainer.fit(module, loader)
    scaler = trainer.precision_plugin.scaler
    return module, None if scaler is None else scaler.get_scale()


@pytest.mark.parametrize("precision, fault", [("bf16-mixed", None), ("16-mixed", None), ("16-mixed", "missed"),
                                              ("bf16-mixed", "extra")])  # fmt: skip
def test_lightning_mixed_precision_with_clipping(precision, fault, monkeypatch):
    """Lightning's Trainer with mixed precision and gradient_clip_val: before, the first step raised "does not
    allow for gradient clipping because it performs unscaling of gradients internally" under patch()."""
    plain, plain_scale = _plain_lightning_run(precision, clip=0.5)
    with _planted(fault, monkeypatch, at=11 if precision == "16-mixed" else 5):  # a step that is not skipped
        fast, fast_scale = _lightning_run(True, precision, clip=0.5)
    assert plain.optimizer_types == [torch.optim.AdamW] and fast.optimizer_types == [fastops.optim.AdamW]

    def check():
        _assert_same_steps(plain.step_counts, fast.step_counts)
        skipped = _skipped(plain.step_counts)
        if precision == "16-mixed":  # the first steps overflow at a 2**24 scale and are skipped (9 of 12 here)
            assert 0 < len(skipped) < STEPS and skipped == list(range(len(skipped))), skipped
            assert plain_scale == fast_scale == INIT_SCALE / 2 ** len(skipped)
        else:
            assert skipped == []
        _assert_close_and_learning(plain.losses, fast.losses, LOWP_RTOL)

    _check_with_fault(fault, check)


# ---- HF Accelerate ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _plain_accelerate_run():
    return _accelerate_run(False)


def _accelerate_run(patched: bool):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    with _patched(patched):
        acc = Accelerator(mixed_precision="fp16", cpu=True)
        # Accelerate's GPU fp16 path, on the CPU (see the module docstring).
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        torch.manual_seed(0)
        model = bert()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 8))
        model, opt, sched = acc.prepare(model, opt, sched)
        batch = mlm_batch(torch.Generator().manual_seed(3))  # one batch, seen at every step: its loss falls
        losses, skipped, lrs, counts = [], [], [], []
        for _ in range(STEPS):
            with acc.autocast():
                loss = model(**batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            skipped.append(acc.optimizer_step_was_skipped)
            lrs.append(sched.get_last_lr()[0])
            counts.append(_step_count(opt))
    AcceleratorState._reset_state(True)
    return losses, skipped, lrs, type(opt.optimizer), counts


@pytest.mark.parametrize("fault", [None, "extra"])
def test_hf_accelerate_sees_skipped_fp16_steps(fault, monkeypatch):
    """Before, Accelerate flagged no step as skipped under patch() (fastops' scaler always called step()), so its
    scheduler advanced on every skipped step and the LR reached 0 early."""
    plain = _plain_accelerate_run()
    with _planted(fault, monkeypatch):
        fast = _accelerate_run(True)
    assert plain[3] is torch.optim.AdamW and fast[3] is fastops.optim.AdamW

    def check():
        _assert_same_steps(plain[4], fast[4])
        assert [i for i, s in enumerate(plain[1]) if s] == _skipped(plain[4])  # Accelerate's flag is the count's
        assert any(plain[1]) and not all(plain[1])
        assert fast[1] == plain[1]
        assert fast[2] == plain[2]  # the schedule held on the same steps
        _assert_close_and_learning(plain[0], fast[0], LOWP_RTOL)

    _check_with_fault(fault, check)


# ---- HF Trainer -------------------------------------------------------------------------------------------


def _trainer_run(tmp_path, patched: bool, optim: str):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    counts = []

    class Counter(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            counts.append(_step_count(optimizer))

    g = torch.Generator().manual_seed(3)
    samples = [{k: v[0] for k, v in mlm_batch(g, batch=1).items()} for _ in range(4)] * STEPS  # losses fall
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_grad_norm=1.0, learning_rate=1e-2, max_steps=STEPS,
        lr_scheduler_type="linear", per_device_train_batch_size=4, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0, optim=optim,
    )  # fmt: skip
    with _patched(patched):
        torch.manual_seed(0)
        trainer = Trainer(model=bert(), args=args, train_dataset=samples, callbacks=[Counter()])
        acc = trainer.accelerator
        # fp16=True on the CPU: Accelerate's GPU fp16 path driven as in _accelerate_run.
        acc.state._mixed_precision = "fp16"
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    return trainer, [h["loss"] for h in logs], [h["learning_rate"] for h in logs], counts


@pytest.mark.parametrize("optim, fault", [("adamw_torch", None), ("adamw_torch_fused", None),
                                          ("adamw_torch", "missed")])  # fmt: skip
def test_hf_trainer_schedule_on_skipped_fp16_steps_is_torchs(tmp_path, optim, fault, monkeypatch):
    """HF's Trainer steps its LR scheduler only when Accelerate says the optimizer step ran, which Accelerate reads
    from whether ``optimizer.step`` was called. torch's scaler calls it on skipped steps too for ``fused=True``
    (the Trainer's default here), so there the schedule advances on them with torch as with fastops; with
    ``adamw_torch`` it holds. Before, under patch() every skipped step advanced the schedule in both cases."""
    plain, plain_losses, plain_lrs, plain_counts = _trainer_run(tmp_path / "plain", False, optim)
    with _planted(fault, monkeypatch):
        fast, fast_losses, fast_lrs, fast_counts = _trainer_run(tmp_path / "fast", True, optim)
    assert type(fast.optimizer.optimizer) is fastops.optim.AdamW
    assert bool(fast.optimizer.optimizer.defaults["fused"]) == (optim == "adamw_torch_fused")

    def check():
        _assert_same_steps(plain_counts, fast_counts)
        skipped = _skipped(plain_counts)
        assert skipped and fast.accelerator.scaler.get_scale() == plain.accelerator.scaler.get_scale() < INIT_SCALE
        held = len(set(plain_lrs)) < len(plain_lrs)
        assert held == (optim == "adamw_torch"), plain_lrs
        assert fast_lrs == pytest.approx(plain_lrs, rel=1e-12)
        _assert_close_and_learning(plain_losses, fast_losses, LOWP_RTOL)

    _check_with_fault(fault, check)
