"""The low-precision state formats of fastops/_quant.py: the maps, the arithmetic encoder, blockwise
quantization and bf16 stochastic rounding."""

from __future__ import annotations

import pytest
import torch

from fastops import _quant as q


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_maps_hold_256_distinct_values_up_to_one(signed):
    qmap = q.QMAP_SIGNED if signed else q.QMAP_UNSIGNED
    s = torch.sort(qmap).values
    assert bool((s[1:] > s[:-1]).all())
    assert s[-1].item() == 1.0 and (s[0].item() == 0.0) != signed


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_every_code_round_trips(signed):
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(q.encode(q.decode(codes, signed), signed), codes)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_encoder_picks_the_nearest_value(signed):
    # The arithmetic encoder against a brute-force nearest search, over values spread across all 7 decades.
    g = torch.Generator().manual_seed(0)
    x = torch.rand(50000, generator=g) ** 6
    if signed:
        x = torch.where(torch.rand(50000, generator=g) < 0.5, -x, x)
    qmap = (q.QMAP_SIGNED if signed else q.QMAP_UNSIGNED).double()
    got = (q.decode(q.encode(x, signed), signed).double() - x.double()).abs()
    best = (qmap[None, :] - x.double()[:, None]).abs().min(dim=1).values
    assert torch.equal(got, best)


def test_nan_and_out_of_range_encode_as_documented():
    x = torch.tensor([float("nan"), -1.0, 1.0, 0.0, -0.0, 1e-9])
    assert q.encode(x, True).tolist() == [0, 0xFF, 0x80, 0, 0, 0]
    assert q.encode(torch.tensor([float("nan"), 1.0, 0.0, 1e-9]), False).tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 5000])
def test_blockwise_error_is_within_half_a_step(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 0, numel)
    codes, absmax = q.quantize(x, signed=True)
    assert codes.dtype == torch.uint8 and absmax.numel() == q.n_blocks(numel)
    back = q.dequantize(codes, absmax, signed=True)
    # The widest gap in the top decade is 0.9/64 of the block's absmax; nearest rounding is off by at most half.
    per_elem = absmax.repeat_interleave(q.BLOCK)[:numel]
    assert bool(((back - x).abs() <= per_elem * 0.9 / 128 * 1.0001).all())
    # Each block's largest magnitude is stored exactly where it is positive (+1.0 is in the map).
    pos = x.abs().argmax()
    if x[pos] > 0 and numel <= q.BLOCK:
        assert back[pos] == x[pos]


def test_memory_order_blocks_follow_the_layout():
    x = torch.randn(2, 300, 3).permute(0, 2, 1)  # dense, not contiguous
    codes, absmax = q.quantize(x, signed=True)
    assert codes.stride() == x.stride()
    flat = q.memory_flat(x)
    assert absmax[0] == flat[:256].abs().max()


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = torch.full((200000,), 1.0 + 2**-9)  # a quarter of the way between two bf16 values
    bits = q.sr_bits(q.sr_key(7, 0), x.numel())
    r = q.round_bf16_stochastic(x, bits & 0xFFFF).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5
    assert torch.equal(q.sr_bits(q.sr_key(7, 0), 1000), bits[:1000])
    assert not torch.equal(q.sr_bits(q.sr_key(8, 0), 1000), bits[:1000])
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    out = q.round_bf16_stochastic(special, torch.full((4,), 0xFFFF))
    assert torch.isnan(out[0]) and out[1] == float("inf") and out[2] == -float("inf") and out[3] == 0
