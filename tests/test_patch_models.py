"""``fastops.patch()`` (models=True, the default) inside the frameworks: an HF transformers model trained by HF's
Trainer, by Lightning or in an HF Accelerate loop gets fastops.accelerate's rules at its first labeled training
call (the fused loss with lazy logits here: the models are tiny, so regional compilation stays off), and trains
as the unpatched run does: the same LR schedule, losses and grad norms to bf16's rounding (LOWP_RTOL, as
tests/test_frameworks.py, which runs the fp16 paths and their skipped steps under the same patch()).
``patch(models=False)`` leaves models alone."""

from __future__ import annotations

import math

import pytest
import torch

import fastops
from fastops.accelerate import _fused_loss
from tests.test_frameworks import LOWP_RTOL, STEPS, _assert_close_and_learning, _patched
from tests.test_real_models import bert, mlm_batch


def _samples():
    g = torch.Generator().manual_seed(3)
    return [{k: v[0] for k, v in mlm_batch(g, batch=1).items()} for _ in range(4)] * STEPS  # losses fall


def _trainer_run(tmp_path, patched: bool):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, max_grad_norm=1.0, learning_rate=1e-2, max_steps=STEPS,
        lr_scheduler_type="linear", per_device_train_batch_size=4, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    with _patched(patched):
        torch.manual_seed(0)
        model = bert()
        trainer = Trainer(model=model, args=args, train_dataset=_samples())
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    return model, {k: [h[k] for h in logs] for k in ("loss", "grad_norm", "learning_rate")}


def test_hf_trainer_gets_the_fused_loss_and_trains_as_without(tmp_path):
    plain_model, plain = _trainer_run(tmp_path / "plain", False)
    model, fast = _trainer_run(tmp_path / "fast", True)
    assert "_fastops_decision" not in plain_model.__dict__
    decision = model._fastops_decision
    assert decision.fused_loss is True and decision.line().startswith("fastops.patch: BertForMaskedLM: compile=off")
    assert fast["learning_rate"] == pytest.approx(plain["learning_rate"], rel=1e-12)
    _assert_close_and_learning(plain["loss"], fast["loss"], LOWP_RTOL)
    rel = max(abs(a - b) / a for a, b in zip(plain["grad_norm"], fast["grad_norm"]))
    assert rel <= LOWP_RTOL, (plain["grad_norm"], fast["grad_norm"])


def test_hf_trainer_gets_the_fused_dropout(tmp_path):
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    from fastops import _dropout

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, learning_rate=1e-2, max_steps=STEPS, logging_steps=1,
        per_device_train_batch_size=4, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    with _patched(True):
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=bert().config.vocab_size, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=128,
                                           max_position_embeddings=bert().config.max_position_embeddings))
        trainer = Trainer(model=model, args=args, train_dataset=_samples())
        trainer.train()
    decision = model._fastops_decision
    assert decision.dropout and decision.attention and "probabilities drop, on fastops.dropout" in decision.line()
    assert sum(type(m) is _dropout.Dropout for m in model.modules()) == 7
    assert model.config._attn_implementation == "fastops_sdpa"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_patch_models_false_leaves_models_alone():
    torch.manual_seed(0)
    model = bert()
    with fastops.patched(models=False):
        out = model(**mlm_batch(torch.Generator().manual_seed(0)))
        assert type(torch.optim.AdamW(model.parameters())) is fastops.optim.AdamW  # the optimizers are patched
    assert type(out.logits) is torch.Tensor and "_fastops_decision" not in model.__dict__


def test_models_made_before_patch_and_unpatch():
    """The rules reach a model made before patch() at its first labeled training call after it; unpatch() stops
    reaching new ones (those already given the fused loss keep it)."""
    torch.manual_seed(0)
    early, late = bert(), bert()
    batch = mlm_batch(torch.Generator().manual_seed(0))
    with fastops.patched():
        early.eval()
        assert type(early(**batch).logits) is torch.Tensor  # eval: nothing decided
        early.train()
        out = early(**batch)
        assert _fused_loss.is_lazy(out.logits) and early._fastops_decision.fused_loss is True
    assert _fused_loss.is_lazy(early(**batch).logits)
    assert type(late(**batch).logits) is torch.Tensor and "_fastops_decision" not in late.__dict__


def _losses_lightning(patched: bool):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model, self.losses = bert(), []

        def training_step(self, batch, _):
            out = self.model(**batch)
            self.losses.append(out.loss.item())
            self.seen_lazy = _fused_loss.is_lazy(out.logits)
            return out.loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    loader = torch.utils.data.DataLoader(_samples(), batch_size=4)
    with _patched(patched):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, precision="bf16-mixed", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        module = Module()
        trainer.fit(module, loader)
    return module


def _losses_accelerate(patched: bool):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    with _patched(patched):
        acc = Accelerator(mixed_precision="bf16", cpu=True)
        torch.manual_seed(0)
        model = bert()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        losses, lazy = [], []
        for batch in torch.utils.data.DataLoader(_samples(), batch_size=4):
            out = model(**batch)
            acc.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            lazy.append(_fused_loss.is_lazy(out.logits))
            if len(losses) == STEPS:
                break
    AcceleratorState._reset_state(True)
    return losses, lazy


def test_lightning_and_hf_accelerate_loops_get_the_fused_loss():
    plain, fast = _losses_lightning(False), _losses_lightning(True)
    assert not plain.seen_lazy and fast.seen_lazy
    _assert_close_and_learning(plain.losses, fast.losses, LOWP_RTOL)
    (plain, plain_lazy), (fast, fast_lazy) = _losses_accelerate(False), _losses_accelerate(True)
    assert not any(plain_lazy) and all(fast_lazy)
    _assert_close_and_learning(plain, fast, LOWP_RTOL)
