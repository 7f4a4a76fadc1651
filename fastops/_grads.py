"""The grad math shared by ``fastops.optim`` and ``fastops.amp``: the grads fastops' kernels take, the one-read
grad statistics (norm, max, inf/nan flag), torch's clip coefficient, and the in-place unscale.

It sits below both (optim's step and amp's GradScaler and clip_grad_norm_ read it; neither imports the other),
on top of the ops: see tests/test_layers.py for the order of the layers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import Tensor

from . import _backend, _ops
from ._checks import FLOAT_DTYPES, is_dense


def kernels_take(t: Tensor) -> bool:
    """Whether fastops' unscale_check_/grad_stats take this grad. Subclasses with their own dispatch
    (DTensor) have no fastops rule, so only plain tensors qualify."""
    # Called per grad on every unscale_: is_cpu/is_cuda cost 0.1 us against 0.5 us for t.device.type.
    device_type = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    return (
        type(t) in (Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.dtype in FLOAT_DTYPES
        and device_type in _backend.DEVICE_TYPES
        and is_dense(t)
    )


def by_device(tensors: Iterable[Tensor]) -> dict[torch.device, list[Tensor]]:
    out: dict[torch.device, list[Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device].append(t)
    return out


def grad_stats(grads: list[Tensor], inv_scale: Tensor | None = None) -> Tensor:
    """``[sum of (g * inv_scale)^2, max |g| * inv_scale, found_inf]`` over grads on any number of devices,
    on the first one's device, with no host sync. Empty input gives zeros on the CPU."""
    parts = []
    for device, ts in by_device(grads).items():
        inv = inv_scale
        if inv is not None and inv.device != device and inv.device.type != "cpu":
            inv = inv.to(device, non_blocking=True)
        parts.append(_ops.grad_stats(ts, inv))
    if not parts:
        return torch.zeros(3)
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack([p.to(parts[0].device, non_blocking=True) for p in parts])
    return torch.stack([stacked[:, 0].sum(), stacked[:, 1].max(), stacked[:, 2].max()])


def clip_coef(norm: Tensor, max_norm: float | Tensor) -> Tensor:
    # torch.nn.utils.clip_grad_norm_'s formula, so clipped grads agree to rounding.
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def unscale_grads_(params: Iterable[Tensor], inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool):
    """The grads of ``params`` times ``inv_scale``, in place, with inf/nan recorded: torch's
    ``GradScaler._unscale_grads_`` (returns found_inf per device), on ``unscale_check_`` for the grads the kernel
    takes, one pass per device for all dtypes; the others go to ``torch._amp_foreach_non_finite_check_and_unscale_``
    per (device, dtype), sharing the same found_inf."""
    fused: dict[torch.device, list[Tensor]] = defaultdict(list)
    other: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    with torch.no_grad():
        for param in params:
            if param.grad is None:
                continue
            if (not allow_fp16) and param.grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            grad = param.grad
            if grad.is_sparse:
                # torch's rule: duplicate indices of scaled fp16 values can overflow when summed, so
                # fp16 grads are coalesced first and the coalesced values checked.
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
                other[(grad.device, grad.dtype)].append(grad)
            elif kernels_take(grad):
                fused[grad.device].append(grad)
            else:
                other[(grad.device, grad.dtype)].append(grad)
        per_device_found_inf: dict[torch.device, Tensor] = {}
        per_device_inv_scale: dict[torch.device, Tensor] = {}

        def on(device):
            if device not in per_device_found_inf:
                per_device_found_inf[device] = found_inf.to(device, non_blocking=True)
                per_device_inv_scale[device] = inv_scale.to(device, non_blocking=True)
            return per_device_found_inf[device], per_device_inv_scale[device]

        for device, grads in fused.items():
            _ops.unscale_check_(grads, *on(device))
        for (device, _), grads in other.items():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, *on(device))
    return per_device_found_inf
