"""Real clients: models from HF transformers, timm and torchvision, built from tiny configs (nothing is
downloaded), trained a few steps with the user's loop unchanged through ``fastops.accelerate`` and, for HF's
Trainer, through ``fastops.patch()``.

Parity: ``accelerate(precision="fp32")`` must follow the plain loop's losses to PARITY_RTOL over STEPS steps,
from the same initial weights and batches, dropout off. The optimizer is then fastops' fused one, whose fp32
step agrees with torch's at rounding level (tests/test_adam.py), and the forward and backward are the same
kernels, so the losses agree to about 1e-6; a step that is skipped or uses another learning rate moves them by
far more than PARITY_RTOL, which each test checks its batches can show (``assert_parity``).

bf16 and fp16: ``accelerate(precision=...)`` must follow the same recipe written in plain PyTorch (autocast
around the loss computation, torch's optimizer, and for fp16 torch's GradScaler) within its noise floor: the
recipe run twice, the second time with every weight scaled by (1 + 2**-22) before the first step, a change at
the rounding level of the fp32 weights, which is all that fastops' fused optimizer step changes (its updates
differ from torch's in the last bits). Autocast's rounding carries such a change into the losses by an amount
that depends on the model and the steps; fastops' losses may differ from the recipe's by at most NOISE_FACTOR
times that (``assert_within_noise``).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import timm
import torch
import torchvision
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, Trainer,  # fmt: skip
                          TrainingArguments)

import fastops

STEPS = 8
PARITY_RTOL = 1e-4
LEARNS = 1e-2  # the second pass's losses differ from the first's by at least this (relative)
PERTURB = 1 + 2**-22  # two units in the last place of an fp32 weight
# Measured on the Xeon: fastops' bf16 losses equal the recipe's bit for bit on every model here (its fp32 step is
# torch's to a few elements' last bit, which bf16 autocast rounds away), fp16 GPT-2's were within
# floor at the same step (1.2 times its envelope); 8 leaves room for other machines' rounding. NOISE_MIN: a few fp32 roundings of the loss.
NOISE_FACTOR = 8
NOISE_MIN = 1e-6
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def train(make, batches, loss_fn, precision=None, recipe=None, perturb=False, channels_last=False):
    """Losses of one step per batch, from ``make()``'s (model, optimizer) built after seeding; the plain loop,
    or the same loop after ``fastops.accelerate(..., precision=precision)``, or (``recipe`` "bf16"/"fp16") the
    plain loop under autocast (and torch's GradScaler for fp16), with the weights scaled by PERTURB first when
    ``perturb``, in the channels_last layout when ``channels_last``. Returns (losses, optimizer)."""
    torch.manual_seed(0)
    model, opt = make()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(PERTURB)
    loader = batches
    if precision is not None:
        model, opt, loader = fastops.accelerate(model, opt, batches, precision=precision, device="cpu")
    scaler = torch.amp.GradScaler("cpu") if recipe == "fp16" else None
    autocast = torch.autocast("cpu", dtype=_DTYPES[recipe]) if recipe else contextlib.nullcontext()
    model.train()
    torch.manual_seed(1)  # Mask R-CNN samples proposals from the global generator
    losses = []
    for batch in loader:
        with autocast:
            loss = loss_fn(model, batch)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def _rel(got, ref):
    return [abs(a - b) / abs(b) for a, b in zip(got, ref)]


def assert_within_noise(make, batches, loss_fn, precision, got):
    """``got`` (fastops' losses at ``precision``) against the plain recipe's, step by step: within NOISE_FACTOR
    times the recipe's own spread up to that step under a rounding-level change of the weights, and for a bf16 conv
    net (which fastops.accelerate puts in channels_last on a CPU with native bf16) of the convolutions' layout
    (and never under NOISE_MIN, a few fp32 roundings of the loss). Mask R-CNN's step-0 loss moved 9.2% with the
    layout alone on an AMD Zen 5, 7.7x its spread under nudged weights: its proposals are a top-k of its convolutions'
    outputs, which a layout's other rounding reorders."""
    ref = train(make, batches, loss_fn, recipe=precision)[0]
    nudged = train(make, batches, loss_fn, recipe=precision, perturb=True)[0]
    spread = _rel(nudged, ref)
    if precision == "bf16" and any(isinstance(m, torch.nn.Conv2d) for m in make()[0].modules()):
        layout = train(make, batches, loss_fn, recipe=precision, channels_last=True)[0]
        spread = [max(a, b) for a, b in zip(spread, _rel(layout, ref))]
    assert all(math.isfinite(x) for x in got + ref), (got, ref)
    noise = list(itertools.accumulate(spread, max))
    diff = _rel(got, ref)
    print(f"{precision}: fastops vs recipe {[f'{d:.1e}' for d in diff]}, noise {[f'{n:.1e}' for n in noise]}")
    over = [i for i, (d, n) in enumerate(zip(diff, noise)) if d > max(NOISE_FACTOR * n, NOISE_MIN)]
    assert not over, (
        f"losses differ from the {precision} recipe's by more than {NOISE_FACTOR} x its noise floor at steps "
        f"{over}:\nrecipe  {ref}\nnudged  {nudged}\nfastops {got}")


def assert_parity(ref, got, rtol=PARITY_RTOL):
    assert len(got) == len(ref) >= STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert rel <= rtol, f"losses differ by {rel:.2e} relative (tolerance {rtol:g}):\n{ref}\n{got}"
    # The batches cycle twice: the weights the second pass sees have moved, so its losses differ from the
    # first pass's by far more than the tolerance (by 4% to 98% here); an optimizer that did not step would give
    # the same losses again, and pass the comparison above without showing anything.
    half = len(ref) // 2
    moved = max(abs(b - a) / abs(a) for a, b in zip(ref[:half], ref[half:]))
    assert moved > LEARNS, ref


def assert_finite(losses, steps):
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses


def cycled(make_batch, distinct=STEPS // 2):
    """STEPS batches: ``distinct`` different ones, seeded, seen twice in the same order."""
    g = torch.Generator().manual_seed(2)
    first = [make_batch(g) for _ in range(distinct)]
    return first + first[: STEPS - distinct]


def check(make, batches, loss_fn, precision, fastops_cls, lowp_steps=STEPS):
    """The fp32 run follows the plain loop; bf16/fp16 runs (of the first ``lowp_steps`` batches: each is three
    runs) follow the plain recipe within its noise floor. Either way the optimizer the user holds became
    ``fastops_cls`` in place."""
    if precision != "fp32":
        batches = batches[:lowp_steps]
    losses, opt = train(make, batches, loss_fn, precision)
    assert type(opt) is fastops_cls
    assert_finite(losses, len(batches))
    if precision == "fp32":
        assert_parity(train(make, batches, loss_fn)[0], losses)
    else:
        assert_within_noise(make, batches, loss_fn, precision, losses)


# ---- HF transformers --------------------------------------------------------------------------------------

VOCAB, SEQ = 512, 32


def bert():
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForMaskedLM(cfg)


def gpt2():
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def mlm_batch(g, batch=4):
    ids = torch.randint(5, VOCAB, (batch, SEQ), generator=g)
    mask = torch.rand(batch, SEQ, generator=g) < 0.15
    mask[:, 0] = True  # every row predicts something
    return {"input_ids": ids.masked_fill(mask, 4), "attention_mask": torch.ones_like(ids),
            "labels": ids.masked_fill(~mask, -100)}  # fmt: skip


def lm_batch(g, batch=4):
    ids = torch.randint(VOCAB, (batch, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def hf_loss(model, batch):
    out = model(**batch)
    assert out["loss"] is out.loss  # the ModelOutput came back as one: attribute and key access both work
    return out.loss


HF = {"bert": (bert, mlm_batch), "gpt2": (gpt2, lm_batch)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(HF))
def test_hf_model_through_accelerate(name, precision):
    build, make_batch = HF[name]

    def make():
        model = build()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    check(make, cycled(make_batch), hf_loss, precision, fastops.optim.AdamW)


def test_the_noise_check_catches_a_lost_step(monkeypatch):
    """fastops' AdamW dropping its 3rd step (BERT, bf16) moves the losses far past the recipe's noise floor."""
    build, make_batch = HF["bert"]

    def make():
        model = build()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    original, calls = fastops.optim.AdamW.step, [0]

    def step(self, closure=None):
        calls[0] += 1
        return None if calls[0] == 3 else original(self, closure)

    batches = cycled(make_batch)
    monkeypatch.setattr(fastops.optim.AdamW, "step", step)
    losses = train(make, batches, hf_loss, "bf16")[0]
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="more than 8 x its noise floor at steps"):
        assert_within_noise(make, batches, hf_loss, "bf16", losses)


class _RecordingTrainer(Trainer):
    """HF's Trainer, recording each training step's loss (what it logs, unrounded)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def _trainer_run(tmp_path, patched: bool):
    g = torch.Generator().manual_seed(3)
    samples = [{k: v[0] for k, v in mlm_batch(g, batch=1).items()} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, max_grad_norm=0.5, learning_rate=1e-3, max_steps=STEPS,
        per_device_train_batch_size=4, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = _RecordingTrainer(model=bert(), args=args, train_dataset=samples)
    if patched:
        fastops.patch()
    try:
        trainer.train()
    finally:
        fastops.unpatch()
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return trainer, grad_norms


def test_hf_trainer_after_patch(tmp_path):
    """``fastops.patch()``, then HF's Trainer (bf16, max_grad_norm): it builds fastops' AdamW from torch's
    names and clips with fastops' clip_grad_norm_, and the losses follow the unpatched run's. Tolerance: the
    two fp32 optimizers differ at rounding level, which the bf16 autocast forward can round differently
    in a few weights: 1e-3 relative."""
    plain, plain_norms = _trainer_run(tmp_path / "plain", patched=False)
    fast, fast_norms = _trainer_run(tmp_path / "fast", patched=True)
    assert type(plain.optimizer.optimizer) is torch.optim.AdamW
    assert type(fast.optimizer.optimizer) is fastops.optim.AdamW  # the Trainer wraps it in HF's AcceleratedOptimizer
    assert max(plain_norms) > 0.5  # the clip was active, on both sides
    assert_parity(plain.losses, fast.losses, rtol=1e-3)
    assert fast_norms == pytest.approx(plain_norms, rel=1e-2)


# ---- timm and torchvision ----------------------------------------------------------------------------------


def image_batch(g, batch=8, size=16, classes=10):
    # ResNet-50 on batches of 2 (BatchNorm over 2 values in its last stage) turns rounding-level differences
    # between the optimizers into 3e-2 in the loss within 8 steps, even at lr 1e-4; on 8 images of 16 x 16
    # (the same compute as 2 of 32 x 32) they stay at 4e-7.
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(classes, (batch,), generator=g)


def classify_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


VISION = {
    "timm_resnet50": lambda: timm.create_model("resnet50", pretrained=False, num_classes=10),
    "timm_vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16,
                                               patch_size=4),
}


# ResNet-50 in bf16 runs in the torchvision test below: the same network, and the file's most expensive run.
@pytest.mark.parametrize("name, precision", [("timm_resnet50", "fp32"), ("timm_vit_tiny", "fp32"),
                                             ("timm_vit_tiny", "bf16")])  # fmt: skip
def test_timm_model_through_accelerate(name, precision):
    def make():
        model = VISION[name]()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    check(make, cycled(image_batch), classify_loss, precision, fastops.optim.AdamW, lowp_steps=4)


def _sgd(model, lr):
    # torchvision's reference recipes: SGD with momentum 0.9 and weight decay 1e-4, the learning rate scaled
    # linearly to the batch (ResNet-50 0.1 per 256 images, Mask R-CNN 0.02 per 16); 0.02 at these batches
    # diverges within 8 steps
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torchvision_resnet50_sgd_through_accelerate(precision):
    def make():
        model = torchvision.models.resnet50(weights=None, num_classes=10)
        return model, _sgd(model, lr=0.1 * 8 / 256)

    # bf16: 3 steps. BatchNorm over few values makes this net chaotic in bf16: the recipe's own losses move by
    # 19% from the first step under the 2**-22 nudge (measured on the Xeon), so this case shows little beyond
    # a run that completes with the fused SGD; fastops' losses equalled the recipe's bit for bit there.
    check(make, cycled(image_batch), classify_loss, precision, fastops.optim.SGD, lowp_steps=3)


def detection_batch(g, batch=2, size=64, classes=3):
    """Images of varying sizes with one or two boxes each, their masks filling the boxes."""
    images, targets = [], []
    for i in range(batch):
        h, w = size, size - 8 * i
        images.append(torch.rand(3, h, w, generator=g))
        n = 1 + i % 2
        xy = torch.rand(n, 2, generator=g) * (w / 2)
        boxes = torch.cat([xy, xy + w / 4 + torch.rand(n, 2, generator=g) * (w / 4)], dim=1)
        masks = torch.zeros(n, h, w, dtype=torch.uint8)
        for j, (x0, y0, x1, y1) in enumerate(boxes.long().tolist()):
            masks[j, y0:y1, x0:x1] = 1
        labels = torch.randint(1, classes, (n,), generator=g)
        targets.append({"boxes": boxes, "labels": labels, "masks": masks})
    return images, targets


def detection_loss(model, batch):
    images, targets = batch
    losses = model(images, targets)  # train mode: a dict of losses, which the user sums
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    return sum(losses.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torchvision_maskrcnn_sgd_through_accelerate(precision):
    """Mask R-CNN samples its proposals with torch.randperm from the global generator, seeded alike in both
    runs, and the rest of its training forward is deterministic on the CPU, so the fp32 run is held to
    parity too."""

    def make():
        # 64 sampled RoIs an image instead of 512: the mask head's convolutions over up to 128 positive RoIs
        # were half of a CPU step (1.5 s -> 0.75 s a step at 64 px).
        model = torchvision.models.detection.maskrcnn_resnet50_fpn(
            weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64, box_batch_size_per_image=64
        )
        return model, _sgd(model, lr=0.02 * 2 / 16)

    # bf16 convolutions on a CPU without native bf16 (AVX2) took 14 s a step: the bf16 case runs 2 steps, three
    # times (fastops, the recipe, the nudged recipe); its noise floor is wide (5e-2 at the first step, 0.48 at the
    # second on the Xeon), fastops' losses equalled the recipe's there. fp32, with parity, runs all 8.
    check(make, cycled(detection_batch), detection_loss, precision, fastops.optim.SGD, lowp_steps=2)
