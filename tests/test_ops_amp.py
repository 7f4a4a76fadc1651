"""torch.ops.fastops.unscale_check_ and grad_stats on every (device, backend) pair: against fastops.reference (the CPU
reference itself is the oracle: tests/devices.py's KERNEL_PAIRS), against torch's AMP kernel and an fp64 oracle
(every pair), and the AMP optimizer phase without a host sync on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

import fastops
import fastops.amp as famp
from fastops import _backend, reference
from fastops._specs.amp import GRAD_STATS, UNSCALE_CHECK, grads
from tests.devices import COMPILED_CUDA_PAIRS, call, clone, cpu, on
from tests.rounding import sum_rtol
from tests.test_ops_adam import DTYPES, sizes

POISONS = (None, math.inf, -math.inf, math.nan)


def grad_case(case, device, backend, poison, where):
    """Case ``case``: one dtype in every tensor (the sizes of test_ops_adam.sizes), or mixed dtypes with two full
    16384-element Triton chunks and a 70_000-element tensor."""
    if case < len(DTYPES):
        return grads(sizes(device, backend), DTYPES[case], poison, where)
    parts = [grads([n], dt, seed=k) for k, (n, dt) in enumerate(
        zip([70_000, 3, 0, 16384], [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]))]  # fmt: skip
    out = [t for p in parts for t in p]
    if poison is not None:
        out[0 if where == "first" else -1][0 if where == "first" else -1] = poison
    return out


def same_bits(a, b):
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(((a.view(view) == b.view(view)) | (a.isnan() & b.isnan())).all())


# (inv_scale, read on the host: devices.call, found_inf's value before the call): it is only ever set, never cleared.
UNSCALE_SETS = [(0.5, False, 0.0), (1 / 65536, True, 0.0), (3.0, False, 1.0)]


@pytest.mark.parametrize("case", range(len(DTYPES) + 1), ids=["fp32", "bf16", "fp16", "mixed"])
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("inv,host,found0", UNSCALE_SETS, ids=["x0.5", "host", "found_set"])
def test_unscale_check_matches_reference(kernel_backend, case, poison, inv, host, found0):
    device, backend = kernel_backend
    where = ("first", "last")[POISONS.index(poison) % 2]
    gs = grad_case(case, device, backend, poison, where)
    want = UNSCALE_CHECK.Args(gs, torch.tensor([found0]), torch.tensor(inv))
    got = on(device, clone(want))
    call("unscale_check_", got, host)
    reference.unscale_check_(*want)
    assert got.found_inf.item() == want.found_inf.item() == (0.0 if poison is None and not found0 else 1.0)
    for a, b in zip(cpu(got).grads, want.grads):
        assert same_bits(a, b)  # one fp32 multiply, one rounding: bit-identical


def test_unscale_check_matches_torch_amp_kernel(device_backend):
    # The semantics fastops promises: torch._amp_foreach_non_finite_check_and_unscale_'s, bit for bit on finite values
    # (nan payloads may differ). Both scale directions, so values really change.
    device, _ = device_backend
    for dtype in DTYPES:
        for inv_value in (2.0**-16, 3.0):
            got = grads([1023, 1, 77], dtype, float("nan"), "last", device=device)
            want = [t.clone() for t in got]
            found, found_torch = torch.zeros(1, device=device), torch.zeros(1, device=device)
            torch.ops.fastops.unscale_check_(got, found, torch.tensor(inv_value))
            inv = torch.tensor([inv_value], device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(want, found_torch, inv)
            assert found.item() == found_torch.item() == 1.0
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def exact_stats(gs, inv):
    """fp64 oracle: [sum of (g*inv)^2, max |g|*inv, any non-finite]."""
    flat = torch.cat([t.double().cpu().flatten() for t in gs]) * (1.0 if inv is None else inv)
    if flat.numel() == 0:
        return [0.0, 0.0, 0.0]
    return [flat.square().sum().item(), flat.abs().max().item(), float(not flat.isfinite().all())]


# (inv_scale, read on the host: devices.call)
STATS_SETS = [(None, False), (2.0**-16, False), (3.0, True)]


@pytest.mark.parametrize("case", range(len(DTYPES) + 1), ids=["fp32", "bf16", "fp16", "mixed"])
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("inv,host", STATS_SETS, ids=["no_scale", "scaled", "host"])
def test_grad_stats_matches_reference_and_is_deterministic(kernel_backend, case, poison, inv, host):
    device, backend = kernel_backend
    where = ("first", "last")[POISONS.index(poison) % 2]
    want = GRAD_STATS.Args(grad_case(case, device, backend, poison, where), None if inv is None else torch.tensor(inv))
    args = on(device, want)
    got, again = call("grad_stats", args, host), call("grad_stats", args, host)
    ref, exact = reference.grad_stats(*want), exact_stats(want.grads, inv)
    assert got.shape == (3,) and got.dtype == torch.float32 and got.device == args.grads[0].device
    got = got.cpu()
    assert same_bits(got, again.cpu())
    assert same_bits(got[1:], ref[1:])  # max |g| and the flag are exact
    assert got[2].item() == exact[2] == (0.0 if poison is None else 1.0)
    if poison is None:
        # fp32 sums of n squares, each in its own order (tests/rounding.py): each within sum_rtol(n) of exact.
        n = sum(g.numel() for g in want.grads)
        torch.testing.assert_close(got[:1], ref[:1], rtol=2 * sum_rtol(n), atol=0)
        assert got[0].item() == pytest.approx(exact[0], rel=sum_rtol(n))
        assert got[1].item() == pytest.approx(exact[1], rel=1e-7)  # exact up to the fp32 multiply
    else:
        # inf/nan reach the sum and the max as torch's norm would: inf^2 = inf, nan anywhere gives nan.
        torch.testing.assert_close(got[:2], torch.tensor(exact[:2], dtype=torch.float32), equal_nan=True)


def test_grad_stats_edges(device_backend):
    device, _ = device_backend
    stats = lambda gs, inv=None: torch.ops.fastops.grad_stats(gs, inv).cpu()  # noqa: E731
    empty = [torch.empty(0, device=device), torch.empty(0, dtype=torch.bfloat16, device=device)]
    assert stats(empty).tolist() == [0.0, 0.0, 0.0]
    # Large finite fp16: summed in fp32, no overflow.
    out = stats([torch.full((4096,), 60000.0, dtype=torch.float16, device=device)])
    assert out[2].item() == 0 and out[0].item() == pytest.approx(4096 * 60000.0**2, rel=1e-6)
    # The sum overflows but every element is finite: the flag comes from the elements, not the sum.
    big = [torch.full((1000,), 3.9e20, device=device), torch.full((5,), -1e21, device=device)]
    out = stats(big)
    assert out[0].item() == math.inf and out[2].item() == 0
    # The same grads behind a 2^70 loss scale (a GradScaler reaches it after enough clean steps): unscaled before
    # squaring, the norm is finite.
    out, exact = stats(big, torch.tensor(2.0**-70)), exact_stats(big, 2.0**-70)
    assert out[2].item() == 0.0
    assert out[0].item() == pytest.approx(exact[0], rel=1e-6)
    assert out[1].item() == pytest.approx(exact[1], rel=1e-7)


@pytest.mark.parametrize("device,backend", COMPILED_CUDA_PAIRS)
@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, famp.GradScaler], ids=["torch_scaler", "fastops_scaler"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_amp_phase_never_syncs(device, backend, scaler_cls, unscale_first):
    """unscale_ (optional), step and update with a folded clip: no host sync with either scaler. torch's scaler
    hands the optimizer its scale and a found_inf tensor; fastops' hands the scale alone before unscale_ and
    the flag alone after it."""
    with _backend.use(device, backend):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 128).cuda()
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
        scaler = scaler_cls("cuda")
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(3):  # warm: tables built and cached, kernels compiled
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 128, device="cuda")).square().mean()).backward()
            torch.cuda.set_sync_debug_mode("error")
            try:
                if unscale_first:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        skipped = opt.step_was_skipped
        assert skipped.dtype == torch.bool and skipped.device == model.weight.device and not skipped.item()
        assert opt.last_grad_norm is not None and opt.last_grad_norm.device == model.weight.device
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
