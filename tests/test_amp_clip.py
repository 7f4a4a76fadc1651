"""fastops.amp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_, every CPU backend, and the grads it hands to
torch's implementation."""

from __future__ import annotations

import pytest
import torch

import fastops
import fastops.amp as famp
from fastops import _backend
from tests.amp_helpers import _grads_the_kernels_do_not_take, _params_with_grads
from tests.rounding import norm_rtol


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_clip_grad_norm_parity(cpu_backend, norm_type, max_norm):
    # torch's inf-norm refuses an empty grad ("no identity"); fastops takes it as 0, so leave it out here.
    empty = norm_type != float("inf")
    mine, theirs = _params_with_grads(empty=empty), _params_with_grads(empty=empty)
    got = fastops.clip_grad_norm_(mine, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    # Two 2-norms in other summation orders (tests/rounding.py); the inf-norm is a max, exact.
    rtol = 2 * norm_rtol(sum(p.numel() for p in mine)) if norm_type == 2.0 else 0
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    for a, b in zip(mine, theirs):  # times coef, which carries the norm's error, and one rounding more
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol + 2**-23, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_clip_grad_norm_nonfinite(cpu_backend, norm_type, poison):
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        fastops.clip_grad_norm_(_params_with_grads(poison=poison), 1.0, norm_type, error_if_nonfinite=True)
    mine, theirs = _params_with_grads(poison=poison, empty=False), _params_with_grads(poison=poison, empty=False)
    got = fastops.clip_grad_norm_(mine, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(got, want, equal_nan=True)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)


def test_clip_grad_norm_low_precision_grads(cpu_backend):
    for dtype in (torch.bfloat16, torch.float16):
        mine = _params_with_grads(dtype)
        exact = torch.cat([p.grad.double().flatten() for p in mine]).norm()
        got = fastops.clip_grad_norm_(mine, 0.1)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=norm_rtol(sum(p.numel() for p in mine)), atol=0)


@pytest.mark.parametrize("case", ["float64", "strided", "mixed", "complex"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_takes_what_torch_takes(case, norm_type):
    """The whole call goes to torch's clip_grad_norm_, so the result is torch's to the bit."""
    mine, theirs = _grads_the_kernels_do_not_take(case), _grads_the_kernels_do_not_take(case)
    got = fastops.clip_grad_norm_(mine, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
    assert want > 0.5, "the grads were clipped"


def _fastops_ops_unreachable(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a fastops kernel was called")

    monkeypatch.setattr(famp._ops, "grad_stats", boom)
    monkeypatch.setattr(famp._ops, "unscale_check_", boom)


def test_grads_on_devices_fastops_does_not_serve_go_to_torch(monkeypatch):
    """No device type other than cpu/cuda exists on a CPU-only machine, so CPU is declared unserved here."""
    monkeypatch.setattr(_backend, "DEVICE_TYPES", ("cuda",))
    _fastops_ops_unreachable(monkeypatch)
    mine, theirs = _params_with_grads(empty=False), _params_with_grads(empty=False)
    assert torch.equal(fastops.clip_grad_norm_(mine, 0.1), torch.nn.utils.clip_grad_norm_(theirs, 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
    opt = torch.optim.SGD(mine, lr=0.1)
    scaler = famp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    assert all(torch.equal(a.grad, b.grad / 4) for a, b in zip(mine, theirs))


def test_clip_grad_norm_calls_torch_original_even_when_patched():
    params = _grads_the_kernels_do_not_take("float64")
    with fastops.patched():
        assert torch.nn.utils.clip_grad_norm_ is fastops.clip_grad_norm_
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)  # would recurse if the fallback read the attribute
    assert norm.dtype == torch.float64
