"""Dropout on the CPU through ``fastops.dropout`` (fastops/_dropout.py says why): ``accelerate`` turns a model's
``nn.Dropout`` modules into ``fastops._dropout.Dropout``. HF's attention dropout goes through it too, in
``_attention``. FASTOPS_DROPOUT=0 leaves dropout to torch."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _dropout
from .._util import switched_off


def install(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """Swaps the model's dropout on ``device`` where it pays; returns (on, why) for the decision line."""
    if switched_off("FASTOPS_DROPOUT"):
        return False, "FASTOPS_DROPOUT=0"
    if device.type != "cpu":
        return False, "torch's own dropout off the CPU"
    n = _dropout.swap_dropouts(model)
    if not n:
        return False, "no nn.Dropout in the model"
    return True, f"{n} nn.Dropout on the fused op: torch's CPU dropout draws each element serially (bernoulli_)"
