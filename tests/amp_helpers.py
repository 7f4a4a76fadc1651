"""What the fastops.amp test files share: a small model trained under each GradScaler and optimizer pairing
(the parity runs against torch), grads to clip, and a guard against host reads (each one a sync on CUDA)."""

from __future__ import annotations

import contextlib

import torch

import fastops
import fastops.amp as famp

INIT_SCALE = 2.0**12
MAX_NORM = 0.5
# Between the smallest and largest grad norms of _model on _batch over 32 steps (0.87 to 2.69 unclipped),
# so that some steps clip and some do not; the tests that use it assert both happen.
MID_NORM = 1.6
# Steps with a poisoned grad: inf early, nan later, two in a row to exercise repeated backoff.
POISON = {3: float("inf"), 11: float("nan"), 12: float("inf")}


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).to(dtype)


def _batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g) * (1 + step % 3), torch.randn(8, 3, generator=g)
    return x.to(dtype), y.to(dtype)


def _loss(model, step, dtype=torch.float32):
    x, y = _batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x), y)


SCALERS = {"torch": lambda init=INIT_SCALE: torch.amp.GradScaler("cpu", init_scale=init, growth_interval=4),
           "fastops": lambda init=INIT_SCALE: famp.GradScaler("cpu", init_scale=init, growth_interval=4)}
OPTIMIZERS = {
    "torch": lambda ps, max_norm: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "torch_fused": lambda ps, max_norm: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fastops": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2),
    "fastops_folded": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2, max_grad_norm=max_norm),
    # fused=True: torch's scaler hands the scale over to it, as to torch's fused AdamW (see test_torch_scaler_*).
    "fastops_folded_fused": lambda ps, max_norm: fastops.optim.AdamW(ps, lr=1e-2, max_grad_norm=max_norm, fused=True),
}


def _train(scaler_name, opt_name, recipe, steps=20, max_norm=MAX_NORM, init_scale=INIT_SCALE, check=None,
           poison=POISON):
    """recipe: 'plain' (scale/step/update), 'unscale_clip' (torch's clipping recipe), 'folded' (no unscale_ call;
    the optimizer clips), 'unscale_folded' (unscale_ first, then the folding optimizer: must not double-unscale).
    scaler_name None trains without a scaler (and without poisoned steps); poison maps step -> value written into
    one grad under a scaler. check(step, model) runs after backward.
    Returns the model, optimizer, scale after each update, whether each step backed off, and each step's norm."""
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters(), max_norm)
    scaler = None if scaler_name is None else SCALERS[scaler_name](init_scale)
    scales, skipped, norms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        loss = _loss(model, step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if check is not None:
            check(step, model)
        if scaler is not None and step in poison:
            model[0].weight.grad[1, 2] = poison[step]
        if scaler is not None and recipe in ("unscale_clip", "unscale_folded"):
            scaler.unscale_(opt)
        if recipe == "unscale_clip":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if scaler is None:
            opt.step()
        else:
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(scaler.get_scale() < scale_before)
        if recipe in ("folded", "unscale_folded"):
            norms.append(opt.last_grad_norm.clone())
    return model, opt, scales, skipped, norms


def _baseline(recipe, **kwargs):
    return _train("torch", "torch", "unscale_clip" if recipe != "plain" else "plain", **kwargs)


def _assert_params_close(model, want_model):
    # fp32; the folded clip divides by scale/coef in one step where torch multiplies twice: a few ulps/step.
    for a, b in zip(model.parameters(), want_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def _params_with_grads(dtype=torch.float32, poison=None, empty=True):
    g = torch.Generator().manual_seed(0)
    sizes = (1023, 1, 0, 5000) if empty else (1023, 1, 5000)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).mul_(3).to(dtype)
    if poison is not None:
        params[-1].grad[-1] = poison
    return params


@contextlib.contextmanager
def no_host_reads():
    """Make every way of reading a tensor value on the host raise: on CUDA each of them is a sync."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for n in names:
        setattr(torch.Tensor, n, boom)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _grads_the_kernels_do_not_take(case):
    """Params (with grads) of a kind torch's clip_grad_norm_ and GradScaler take and fastops' kernels do not."""
    g = torch.Generator().manual_seed(1)

    def param(shape, dtype=torch.float32, grad=None):
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.grad = torch.randn(shape, generator=g).mul_(3).to(dtype) if grad is None else grad
        return p

    if case == "float64":
        return [param((7, 5), torch.float64), param((300,), torch.float64)]
    if case == "strided":  # x[:, ::2]: a view with gaps
        return [param((4, 3), grad=torch.randn(4, 6, generator=g)[:, ::2]), param((9,))]
    if case == "mixed":  # fp32 grads the kernels take, next to float64 ones they do not
        return [param((300,)), param((7, 5), torch.float64), param((11,), torch.bfloat16)]
    if case == "complex":
        return [param((6, 2), torch.complex64), param((5,))]
    raise AssertionError(case)
