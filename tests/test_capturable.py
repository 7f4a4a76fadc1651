"""The optimizer phase reads no tensor value on the host, which is what CUDA-graph capture (``capturable=True``)
and a sync-free training loop need. torch's CUDA sync debug mode needs a GPU, so here CPU tensors stand in for
device ones and every Python-level way of reading a value on the host raises during the phase.

The phase runs on the Triton launchers (the CUDA default; their kernels run in the interpreter here). Reads are
allowed inside ``build_table`` only: it computes the pointer tables on host tensors it makes from Python ints and
uploads them with a non-blocking copy, so on a GPU it reads nothing back (grads set to None by ``zero_grad`` come
back at new addresses, so the checked step builds new tables). lr is a Python float, which the launchers take as a
CPU tensor (read on the host by design, no device sync on a GPU; a device lr is read in the kernel).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fastops
from fastops import _backend, _grads, amp, optim
from fastops.kernels import _common as kcommon

# Tensor methods that hand a value to Python, and torch functions whose result depends on values on the host.
_TENSOR_READS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__float__", "__int__", "__index__",
                 "__complex__", "__array__", "__format__", "__repr__")  # fmt: skip
_TORCH_READS = ("equal", "allclose", "is_nonzero", "nonzero")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    host_only = [0]  # > 0 inside build_table

    def forbid(owner, name):
        original = getattr(owner, name)

        def read(*args, **kwargs):
            if host_only[0]:
                return original(*args, **kwargs)
            raise HostRead(f"{owner.__name__}.{name} read a tensor on the host inside the optimizer phase")

        return read

    def on_host(build_table):
        def wrapped(*args, **kwargs):
            host_only[0] += 1
            try:
                return build_table(*args, **kwargs)
            finally:
                host_only[0] -= 1

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        for name in _TENSOR_READS:
            mp.setattr(torch.Tensor, name, forbid(torch.Tensor, name))
        for name in _TORCH_READS:
            mp.setattr(torch, name, forbid(torch, name))
        mp.setattr(kcommon, "build_table", on_host(kcommon.build_table))
        yield


@pytest.fixture(autouse=True)
def triton_backend():
    with _backend.use("cpu", "triton"):
        yield


def _model():
    # No fp16 param: GradScaler refuses to unscale fp16 grads (torch's rule).
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7, 5).to(torch.bfloat16))]


def _loss(params, bad: bool = False):
    loss = sum((p.float() ** 2).sum() for p in params)
    return loss * float("inf") if bad else loss


def _train(make_opt, phase, bad: bool = False):
    """One warm-up iteration, then one whose optimizer phase runs under no_host_reads. Returns the params."""
    params = _model()
    opt, scaler = make_opt(params)
    for i in range(2):
        opt.zero_grad()
        loss = _loss(params, bad and i == 1)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        before = [p.detach().clone() for p in params]
        with no_host_reads() if i == 1 else contextlib.nullcontext():
            phase(opt, scaler, params)
    if bad:  # the skipped step ran (sync-free) and changed nothing
        assert all(torch.equal(b, p) for b, p in zip(before, params))
    return params


def _adamw(params):
    return optim.AdamW(params, lr=1e-2, weight_decay=0.1, capturable=True, master_weights=True), None


def _adam_amsgrad_clip(params):
    return optim.Adam(params, lr=1e-2, amsgrad=True, maximize=True, capturable=True, max_grad_norm=0.5), None


def _scaled(params):
    opt = optim.AdamW(params, lr=1e-2, capturable=True, max_grad_norm=1.0, master_weights=True)
    return opt, amp.GradScaler("cpu", init_scale=2.0**10)


def _step(opt, scaler, params):
    opt.step()


def _scaler_step(opt, scaler, params):
    scaler.step(opt)
    scaler.update()


def _unscale_clip_step(opt, scaler, params):
    # torch's documented order: unscale_, clip_grad_norm_, step, update.
    scaler.unscale_(opt)
    fastops.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()


# (make_opt, phase, inf grads in the checked iteration). Without a scaler inf grads are not skipped.
CASES = {
    "adamw-master": (_adamw, _step, False),
    "adam-amsgrad-maximize-folded-clip": (_adam_amsgrad_clip, _step, False),
    "scaler-folded-clip": (_scaled, _scaler_step, False),
    "scaler-folded-clip-skipped": (_scaled, _scaler_step, True),
    "scaler-unscale-clip": (_scaled, _unscale_clip_step, False),
    "scaler-unscale-clip-skipped": (_scaled, _unscale_clip_step, True),
}


@pytest.mark.parametrize("case", CASES)
def test_optimizer_phase_reads_nothing_on_the_host(case):
    make_opt, phase, bad = CASES[case]
    _train(make_opt, phase, bad)


def test_a_host_read_in_the_phase_fails(monkeypatch):
    # The guard itself: the same phase with one .item() added where the folded clip computes its coefficient.
    clip_coef = _grads.clip_coef

    def reading_clip_coef(norm, max_norm):
        norm.item()
        return clip_coef(norm, max_norm)

    monkeypatch.setattr(_grads, "clip_coef", reading_clip_coef)
    with pytest.raises(HostRead, match=r"Tensor\.item read"):
        _train(_scaled, _scaler_step)
