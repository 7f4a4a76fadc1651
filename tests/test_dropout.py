"""fastops.dropout (fastops/_dropout.py, the op: fastops/_specs/dropout.py): every backend bit for bit with the
reference, torch's kept values, the drop rate and the independence of the mask, the backward's mask, and what
accelerate swaps into a model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastops
from fastops import reference
from fastops._specs import SPECS
from tests.devices import on
from tests.test_lowp_ops import bits

SPEC = SPECS["dropout"]


@pytest.mark.parametrize("case", [s.id for s in SPEC.sample_inputs()])
def test_every_backend_is_the_reference_bit_for_bit(kernel_backend, case):
    device, _ = kernel_backend
    args = on(device, next(s.args for s in SPEC.sample_inputs() if s.id == case))
    got = torch.ops.fastops.dropout(*args)
    want = reference.dropout(*args)
    assert got.stride() == args.x.stride() and got.dtype == args.x.dtype
    assert torch.equal(bits(got.cpu()), bits(want.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inf_and_nan_give_torchs_results(kernel_backend, dtype):
    # Kept: inf times the scale, nan; dropped: x * 0, which is nan for both (torch's input * noise).
    device, _ = kernel_backend
    x = torch.tensor([math.inf, -math.inf, math.nan] * 200, dtype=dtype, device=device)
    got = torch.ops.fastops.dropout(x, 0.5, 9).cpu().float()
    want = reference.dropout(x, 0.5, 9).cpu().float()
    # nan's sign and payload are the conversion's (AVX-512 BF16 keeps the sign, c10's rounding does not): nan is nan.
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(want)) and torch.equal(got[~nan], want[~nan])
    finite_kept = torch.isinf(got)
    assert finite_kept.any() and torch.equal(got[finite_kept], x.cpu().float()[finite_kept])  # inf kept stays inf
    assert torch.isnan(got[torch.isinf(x.cpu().float()) & ~finite_kept]).all()  # inf dropped: inf * 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1 / 3])
def test_drops_p_of_the_elements_and_keeps_torchs_values(cpu_backend, dtype, p):
    n = 1 << 16
    x = torch.randn(n).to(dtype)
    x[x == 0] = 1.0
    y = fastops.dropout(x, p)
    dropped = (y == 0).double().mean().item()
    # A binomial count: 5 standard errors.
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)
    ref = F.dropout(x, p)  # torch's: x * (1 / (1 - p) rounded to x's dtype), rounded from fp32
    both = (y != 0) & (ref != 0)
    assert both.sum() > 0 and torch.equal(y[both], ref[both])


def test_masks_are_uncorrelated_across_neighbours_and_seeds():
    n = 1 << 18
    ones = torch.ones(n)
    a = (torch.ops.fastops.dropout(ones, 0.5, 1) != 0).double()
    b = (torch.ops.fastops.dropout(ones, 0.5, 2) != 0).double()
    c = (torch.ops.fastops.dropout(ones, 0.5, 1 + (1 << 32)) != 0).double()  # seeds that differ in the high half
    bound = 5 / math.sqrt(n)  # 5 standard errors of a correlation of independent bits
    for u, v in ((a, b), (a, c), (a[1:], a[:-1]), (a[256:], a[:-256])):
        assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < bound


def test_the_backward_draws_the_forward_mask(cpu_backend):
    x = torch.randn(6, 333, dtype=torch.bfloat16).t().requires_grad_()  # dense, not contiguous
    y = fastops.dropout(x, 0.3)
    g = torch.randn(333, 6, dtype=torch.bfloat16)  # contiguous: another layout than x's
    y.backward(g)
    scale = torch.ones((), dtype=torch.bfloat16).div_(0.7)
    assert torch.equal(x.grad, (g.float() * torch.where(y != 0, scale.float(), 0.0)).bfloat16())


def test_manual_seed_repeats_the_masks_and_eval_passes_through():
    x = torch.randn(1000)
    torch.manual_seed(3)
    a = fastops.dropout(x, 0.2)
    torch.manual_seed(3)
    assert torch.equal(a, fastops.dropout(x, 0.2))
    assert not torch.equal(a, fastops.dropout(x, 0.2))
    assert fastops.dropout(x, 0.2, training=False) is x and fastops.dropout(x, 0.0) is x


def test_what_the_op_does_not_take_goes_to_torch():
    x = torch.randn(100, dtype=torch.float64)
    torch.manual_seed(0)
    a = fastops.dropout(x, 0.5)
    torch.manual_seed(0)
    assert torch.equal(a, F.dropout(x, 0.5))
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got 1.5"):
        fastops.dropout(x, 1.5)


def test_accelerate_swaps_bert_dropout_and_trains():
    transformers = pytest.importorskip("transformers")  # the torch 2.13 CI leg has none
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=100)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = fastops.Accelerator()
    model, opt = acc.prepare(model, opt)
    assert all(type(m) is not nn.Dropout for m in model.modules())
    assert model.config._attn_implementation == "fastops_sdpa"
    ids = torch.randint(0, 100, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 10:] = 0
    losses = []
    for _ in range(3):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    line = acc.decision.line()
    assert acc.decision.dropout and "7 nn.Dropout on the fused op" in line
    assert acc.decision.attention and "where probabilities drop, on fastops.dropout" in line
