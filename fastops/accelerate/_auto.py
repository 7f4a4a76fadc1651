"""``compile="auto"``, ``fused_loss="auto"`` (the defaults) and the conv-net layout: what ``fastops.accelerate``
turns on for a model, decided by rules on its structure and shapes, never by timing it at start-up.

- compile: regional compilation (``_compile``) where it pays: repeated blocks that compute more than their
  launches cost, in a run long enough to repay the compile time. See ``decide_compile`` for the rules and the
  measurements behind them.
- fused_loss: HF transformers models with a plain linear head get the stand-in logits (``_fused_loss``); the
  first training call with labels decides from its shapes whether the fused op runs (``fused_rule``).
- channels_last: conv nets in bf16 on the CPU, where oneDNN's convolutions run faster in that layout.
- dropout: on the CPU, the model's dropout through the fused op (``_dropout``).
- attention: HF models' SDPA attention as fastops' own where that runs faster on the CPU (``_attention``).

The decisions and their reasons are one line, logged (logger ``fastops.accelerate``, INFO) at the first training
call and kept as ``Accelerator.decision``."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._util import switched_off

if TYPE_CHECKING:
    from . import Accelerator

log = logging.getLogger("fastops.accelerate")
AUTO = "auto"

# compile: a block must hold at least this many parameters for its compiled code to repay the compile time in a
# run of ordinary length; a run of fewer than MIN_STEPS steps per loader pass never repays it.
MIN_BLOCK_PARAMS = 1 << 17
MIN_STEPS = 100
# fused_loss: the fused op is used when at most MAX_LABELED_SHARE of the rows carry a label, or at any share up to
# a vocabulary of ALL_ROWS_MAX_VOCAB. Measured with the op's chunks of at most 512 labeled rows, bf16, Xeon with AMX,
# every row labeled (results/loss_grid.md, 18 points: V 8000 to 151936, H 256 to 2048, N 1024 and 4096, the providers
# timed in one process): at 1 thread the op took 0.29-1.03x the time of the best of torch.compile and its
# auto-chunker, 1.03x only at N=1024 H=2048 V=32000 (where all three are matmul-bound); at 2 threads (6 points)
# 0.46-0.92x. LlamaForCausalLM 4x256 trained in 276 ms a step with it against 305 with the head's own loss compiled
# (results/train_cpu_llama_1t.json). The largest vocabulary measured is Qwen2's 151936 (N=1024, H=256, 1 thread:
# 1.57x the best peer); past it, with every row labeled, the head's own loss runs. (Before the 512-row chunks the
# op added its fp32 grad_weight once per 2^22 logits and lost from V=32000 on: 1.10-1.19x.) Since the C++ CPU
# backend's vocabulary blocks, every row labeled, trained head, N=1024 H=256 (bench_loss's speed-up, so above 1 is
# faster): 1.07x-1.72x the best peer on the Xeon (results/loss_blocks.md); on an AMD Zen 5, whose exact fp32 sums
# of partial products go through fastops' own AVX-512 BF16 GEMM (MKL's runs slow kernels there), 1.10x-1.14x from
# V=32000 up and 0.92x at V=8000 (results/loss_zen5_bf16.md; 0.90x-0.94x and 0.77x with oneDNN's fp32 sums,
# results/loss_zen5.md).
MAX_LABELED_SHARE = 0.5
ALL_ROWS_MAX_VOCAB = 151936


@dataclasses.dataclass
class Decision:
    compile: bool = False
    compile_why: str = ""
    fused_loss: bool | None = False  # None: decided at the first training call with labels
    fused_why: str = ""
    channels_last: bool = False
    channels_last_why: str = ""
    dropout: bool = False
    dropout_why: str = ""
    attention: bool = False
    attention_why: str = ""
    logged: bool = False
    prefix: str = "fastops.accelerate"

    def line(self) -> str:
        fused = {True: "on", False: "off", None: "decided at the first training call with labels"}[self.fused_loss]
        text = (f"{self.prefix}: compile={'on' if self.compile else 'off'} ({self.compile_why}); "
                f"fused_loss={fused} ({self.fused_why})")
        if self.channels_last or self.channels_last_why:
            text += f"; channels_last={'on' if self.channels_last else 'off'} ({self.channels_last_why})"
        if self.dropout:
            text += f"; dropout=fastops ({self.dropout_why})"
        if self.attention:
            text += f"; attention=fastops ({self.attention_why})"
        return text

    def log(self) -> None:
        if not self.logged:
            self.logged = True
            log.info(self.line())

    def __str__(self) -> str:
        return self.line()


def _has(model: nn.Module, kinds) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


# ResNet-50, bf16, channels_last, batch 8 x 128 px, 1 thread, CPU time (Xeon with AMX): its 16 bottlenecks
# compiled (one graph per signature) 830 ms a step, eager 429 ms; the whole model under torch.compile 555 ms.
_CONV_EAGER = ("convolution blocks on the CPU: compiled, ResNet-50's measured 1.9x slower than eager (oneDNN "
               "runs the convolutions either way)")


# BertForMaskedLM 4x256 (dropout 0.1), same settings: its layers compiled 863 ms a step, eager 590 ms; one
# BertLayer 143 ms compiled, 70 ms eager (inductor's generated dropout). Without dropout (Llama) compiling pays.
_DROPOUT_EAGER = ("blocks with dropout on the CPU: compiled, BERT-4x256's (dropout 0.1) measured 1.46x slower than "
                  "eager")


def _dropout(module: nn.Module) -> bool:
    """Whether ``module`` drops anything in training: a dropout layer, or an attention dropout rate (HF's
    ``attention_dropout``/``dropout`` floats handed to scaled_dot_product_attention)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name in ("attention_dropout", "dropout", "attn_dropout"):
            rate = m.__dict__.get(name)
            if isinstance(rate, float) and rate > 0:
                return True
    return False


def region_stays_eager(device: torch.device):
    """The test ``_compile`` applies to each region, also under compile=True: why it stays eager, or None."""

    def why(module: nn.Module) -> str | None:
        if device.type == "cpu" and _has(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return _CONV_EAGER
        if device.type == "cpu" and _dropout(module):
            return _DROPOUT_EAGER
        return None

    return why


def decide_compile(acc: "Accelerator", model: nn.Module, asked) -> tuple[bool, str]:
    from ._compile import find_regions

    regions = find_regions(model)
    stays = region_stays_eager(acc.device)
    eager = {why for why in map(stays, regions or [model]) if why is not None}
    if asked is True:
        if eager and all(stays(r) for r in regions or [model]):
            return False, f"compile=True, but every region stays eager: {eager.pop()}"
        return True, "compile=True" + (f"; some regions stay eager: {eager.pop()}" if eager else "")
    if asked is False:
        return False, "compile=False"
    if acc.strategy == "pp":
        return False, "not under strategy='pp'"
    if not regions:
        return False, ("no repeated block: only a whole-model compile would be left, whose first step takes tens of "
                       "seconds")
    if eager:
        return False, eager.pop()
    largest = max(sum(p.numel() for p in r.parameters()) for r in regions)
    if largest < MIN_BLOCK_PARAMS:
        return False, (f"blocks of at most {largest} parameters: too little work per block for the compiled code "
                       f"to repay its compile time")
    counts = collections.Counter(type(r).__name__ for r in regions)
    names = ", ".join(f"{n} x {name}" if n > 1 else name for name, n in counts.items())
    return True, f"regions {names}, compiled once per signature"


def short_run(acc: "Accelerator", batches: int) -> None:
    """A prepared loader of ``batches`` per pass: under compile="auto", too few steps to repay the compile turn
    it off (before anything was compiled)."""
    d = acc.decision
    if acc.compile != AUTO or not d.compile or batches >= MIN_STEPS:
        return
    regions = acc._step_state.regions
    if regions is not None:
        regions.remove()
        acc._step_state.regions = None
    d.compile = False
    d.compile_why = f"the loader has {batches} batches a pass: too few steps to repay the compile time"


def fused_rule(rows: int, labeled: int, vocab: int, hidden: int, device: torch.device, dtype=None,
               compiled: bool = False) -> tuple[str, str]:
    """Which loss is the faster at the first loss call's shapes: "fused" (the fused op), else the head's own loss,
    "compiled" where the model's blocks are compiled anyway, "eager" otherwise. ``dtype``: what the head's matmul
    computes in."""
    if dtype == torch.float16:
        # Under fp16 a loss scaler skips the steps whose gradients overflow; the fused loss's gradients overflow
        # at other scales than the head's (HF Trainer and Accelerate fp16 runs skipped other steps and ended at
        # a 4x lower scale), so "auto" keeps the head's loss there and skipped steps follow the run without it.
        return "eager", "fp16: the head's own loss runs, so a loss scaler skips the steps it skips without fastops"
    share = labeled / max(rows, 1)
    what = f"{labeled} of {rows} rows labeled, vocabulary {vocab}"
    if share <= MAX_LABELED_SHARE:
        return "fused", f"{what}: the fused loss skips the unlabeled rows' logits"
    if vocab <= ALL_ROWS_MAX_VOCAB:
        return "fused", f"{what}: the fused loss is not slower there and never builds the logits"
    slower = f"{what}: with nearly every row labeled at this vocabulary the fused loss measured slower"
    if compiled:
        return "compiled", f"{slower}; the head's own loss runs compiled, out.logits built when read"
    return "eager", f"{slower}, so the head's own loss runs"


def decide_fused(acc: "Accelerator", model: nn.Module, asked):
    """Installs the fused loss where asked or where the rules allow it; returns its FusedHead or None."""
    from . import _fused_loss

    d = acc.decision
    if asked is False:
        d.fused_loss, d.fused_why = False, "fused_loss=False"
        return None
    if acc.strategy == "pp":
        d.fused_loss, d.fused_why = False, "not under strategy='pp'"
        return None
    if asked is True:
        head = _fused_loss.install(model)
        d.fused_loss, d.fused_why = (True, "fused_loss=True") if head else (False, _fused_loss.unfusable(model))
        return head
    reason = _fused_loss.unfusable(model)
    if reason:
        d.fused_loss, d.fused_why = False, reason
        return None
    head = _fused_loss.install(model, rule=lambda **shapes: fused_rule(**shapes, compiled=d.compile))

    def decided(h) -> None:
        was_logged = d.logged
        d.fused_loss, d.fused_why = h.mode == "fused", h.reason
        if was_logged:  # the first line went out before any call had labels: this one completes it
            log.info(d.line())

    head.listeners.append(decided)
    d.fused_loss, d.fused_why = None, "HF model with a linear head"
    return head


def decide_channels_last(acc: "Accelerator", model: nn.Module) -> None:
    """bf16 conv nets on a CPU with native bf16 take the channels_last layout, oneDNN's own for bf16 convolutions.
    FASTOPS_CHANNELS_LAST=0 leaves the layout alone."""
    from ._model import _native_bf16

    d = acc.decision
    if not _has(model, nn.Conv2d):
        return
    if switched_off("FASTOPS_CHANNELS_LAST"):
        d.channels_last_why = "FASTOPS_CHANNELS_LAST=0"
        return
    if acc.device.type != "cpu" or acc.amp_dtype != torch.bfloat16 or not _native_bf16(acc.device):
        d.channels_last_why = "only for bf16 on a CPU that computes it natively"
        return
    model.to(memory_format=torch.channels_last)
    d.channels_last, d.channels_last_why = True, "2-D convolutions in bf16 on the CPU: oneDNN's preferred layout"


def decide_dropout(acc: "Accelerator", model: nn.Module) -> None:
    """The model's dropout and HF's attention, on the CPU (``_dropout``, ``_attention``)."""
    from . import _attention, _dropout

    d = acc.decision
    d.dropout, d.dropout_why = _dropout.install(model, acc.device)
    d.attention, d.attention_why = _attention.install(model, acc.device)


def check_option(name: str, value) -> None:
    if value is not True and value is not False and value != AUTO:
        raise ValueError(f"fastops.accelerate: {name} must be True, False or 'auto', got {value!r}")


def describe(device: torch.device) -> list[str]:
    """The rules as they apply on ``device`` (``python -m fastops info``)."""
    from ._model import resolve_precision

    precision = resolve_precision("auto", device)[0]
    lines = [f"precision='auto' -> {precision} on {device.type}",
             f"compile='auto': regional compilation of repeated blocks of at least {MIN_BLOCK_PARAMS} parameters"
             + (", not blocks with convolutions or dropout (they stay eager under compile=True too)"
                if device.type == "cpu" else "")
             + f", not when the loader has fewer than {MIN_STEPS} batches a pass",
             f"fused_loss='auto': HF models with a linear head, decided at the first labeled call: on when at most "
             f"{MAX_LABELED_SHARE:.0%} of the rows are labeled, or the vocabulary is at most {ALL_ROWS_MAX_VOCAB}; "
             "off under fp16 autocast (a loss scaler's skipped steps follow the run without fastops)"]
    if device.type == "cpu":
        from ._attention import SHORT_KEYS

        here = "" if precision == "bf16" else " (not here: no native bf16)"
        lines.append("channels_last: conv nets in bf16" + here)
        lines.append("dropout: nn.Dropout and HF's SDPA attention dropout through fastops.dropout")
        lines.append(f"attention: HF's SDPA as fastops' own in compiled training calls with at most {SHORT_KEYS} keys, "
                     "and eagerly where attention probabilities drop")
    return lines
