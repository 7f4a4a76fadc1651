"""``fastops.dropout``: ``F.dropout`` on ``torch.ops.fastops.dropout`` (fastops/_specs/dropout.py), and the pieces
``fastops.accelerate`` swaps into a model on the CPU: ``Dropout`` for ``nn.Dropout`` and an HF attention function
whose attention-probability dropout is the same op.

Why: torch's CPU dropout draws every element from mt19937 through ``bernoulli_``, serially. On an AMD Zen 5 (1
thread, 1M bf16 elements, thread CPU time) ``F.dropout`` took 5.5 ms where the op takes 0.18 ms, a plain multiply
0.14 ms; in BertForMaskedLM 4x256 (B16 x L128, bf16, ``fastops.accelerate`` defaults) ``bernoulli_`` was 68 ms of a
389 ms step (``benchmarks/bench_train.py --profile``).

What differs from torch: which elements are dropped (a hash of the seed and the element's position, not torch's
generator), so runs differ from torch's by a different mask; with the same ``torch.manual_seed`` a run repeats
itself. The kept elements are torch's values bit for bit (x times 1/(1-p) rounded to x's dtype, rounded from fp32).
The backward regenerates the mask from the seed instead of saving it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, is_dense
from ._specs.dropout import check_p

_op = torch.ops.fastops.dropout.default


def _seed() -> int:
    # From torch's default generator, so torch.manual_seed makes a run's masks repeat.
    return int(torch.empty((), dtype=torch.int64).random_())


class _DropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed
        ctx.strides = x.stride()
        return _op(x, p, seed)

    @staticmethod
    def backward(ctx, grad):
        # The mask is a function of the position in memory: the gradient is read in the input's layout.
        if grad.stride() != ctx.strides:  # x's strides are dense, so equal strides make grad dense in x's order
            grad = torch.empty_strided(grad.shape, ctx.strides, dtype=grad.dtype, device=grad.device).copy_(grad)
        return _op(grad, ctx.p, ctx.seed), None, None


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout``'s signature and results, the mask from fastops' stream (module docstring). Falls back to
    ``F.dropout`` for what the op does not take: other dtypes, gapped layouts, an in-place call that autograd
    records, a call being compiled."""
    check_p(p)
    if not training or p == 0.0 or input.numel() == 0:
        return input
    # Under torch.compile inductor generates its own dropout (a seed drawn on the host would break the graph).
    if (torch.compiler.is_compiling() or input.dtype not in FLOAT_DTYPES or not is_dense(input)
            or (inplace and torch.is_grad_enabled() and input.requires_grad)):  # fmt: skip
        return F.dropout(input, p, training, inplace)
    if inplace:
        with torch.no_grad():
            return input.copy_(_op(input, p, _seed()))
    return _DropoutFn.apply(input, p, _seed())


class Dropout(nn.Dropout):
    """``nn.Dropout`` on ``fastops.dropout``: what ``fastops.accelerate`` turns a model's ``nn.Dropout`` modules into
    on the CPU (by class, so ``isinstance(m, nn.Dropout)``, ``p``, ``inplace`` and the state dict stay)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)


def swap_dropouts(model: nn.Module) -> int:
    """Turns every plain ``nn.Dropout`` of ``model`` that drops anything into ``Dropout``; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Dropout and m.p > 0:
            m.__class__ = Dropout
            n += 1
    return n
