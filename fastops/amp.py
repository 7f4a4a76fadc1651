"""fastops.amp: a drop-in GradScaler on fused kernels, and a one-pass clip_grad_norm_.

torch's AMP optimizer phase (``unscale_`` -> ``clip_grad_norm_`` -> ``step`` -> ``update``) reads and
writes every gradient several times. With a fastops optimizer the whole phase is two passes over the
grads and no host sync: ``grad_stats`` reads them once for the norm and the inf/nan check, then the
fused step divides by ``scale / clip_coef`` and skips itself on device when ``found_inf`` is set.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from . import _ops

_TorchGradScaler = torch.amp.GradScaler
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


def _by_device(tensors: Iterable[Tensor]) -> dict[torch.device, list[Tensor]]:
    out: dict[torch.device, list[Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device].append(t)
    return out


def grad_stats(grads: list[Tensor], inv_scale: Tensor | None = None) -> Tensor:
    """``[sum of (g * inv_scale)^2, max |g| * inv_scale, found_inf]`` over grads on any number of devices,
    on the first one's device, with no host sync. Empty input gives zeros on the CPU."""
    parts = []
    for device, ts in _by_device(grads).items():
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


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ with one read pass for the norm and one in-place scale.

    Norm types 2 and inf use fastops' kernels; other norm types call torch's implementation. The
    returned norm is fp32 whatever the grads' dtype (torch returns it in the grads' dtype)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type not in (2.0, float("inf")) or any(g.is_sparse for g in grads):
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return torch.tensor(0.0)
    stats = grad_stats(grads)
    total = stats[0].sqrt() if norm_type == 2.0 else stats[1]
    if error_if_nonfinite and (torch.isnan(total) or torch.isinf(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = clip_coef(total, max_norm)
    for device, ts in _by_device(grads).items():
        # unscale_check_ is the fused in-place multi-tensor multiply; its inf flag is not needed here.
        _ops.unscale_check_(ts, torch.zeros(1, device=device), coef.to(device, non_blocking=True))
    return total


def _is_fastops_optimizer(optimizer) -> bool:
    return getattr(optimizer, "_fastops_amp", False)


class GradScaler(_TorchGradScaler):
    """torch.amp.GradScaler, same constructor, methods and state_dict, on fastops' fused kernels.

    - ``unscale_`` uses ``torch.ops.fastops.unscale_check_``: one pass per device for all dtypes.
    - ``step`` with a fastops optimizer never syncs with the host: it hands the scale to the optimizer,
      which checks for inf/nan in the same read that gives the grad norm and skips itself on device.
      With any other optimizer it behaves exactly like torch's (which reads ``found_inf`` on the host).
    - ``update`` is torch's, already on device, so the scale trajectory is torch's to the bit.
    """

    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool):
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if (not allow_fp16) and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse:
                    return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
                grads.append(param.grad)
        per_device_found_inf = {}
        with torch.no_grad():
            for device, ts in _by_device(grads).items():
                if device not in per_device_found_inf:
                    per_device_found_inf[device] = found_inf.to(device, non_blocking=True)
                _ops.unscale_check_(ts, per_device_found_inf[device], inv_scale.to(device, non_blocking=True))
        return per_device_found_inf

    def step(self, optimizer, *args, **kwargs):
        if not (self._enabled and _is_fastops_optimizer(optimizer)):
            retval = super().step(optimizer, *args, **kwargs)
            if self._enabled:
                found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
                optimizer.step_was_skipped = sum(t.to(self._scale.device) for t in found) != 0
            return retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            # The optimizer divides by the scale inside its step and finds inf/nan in its grad_stats read.
            optimizer.grad_scale, optimizer.found_inf = self._get_scale_async(), None
        else:
            # unscale_ already ran (and found inf/nan): the grads are unscaled, the flag is known.
            found = [t.to(self._scale.device, non_blocking=True) for t in state["found_inf_per_device"].values()]
            optimizer.grad_scale, optimizer.found_inf = None, sum(found)
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        if state["stage"] is OptState.READY:
            state["found_inf_per_device"] = {self._scale.device: optimizer.step_was_skipped.float()}
        state["stage"] = OptState.STEPPED
        return retval


class SkipAwareScheduler:
    """Wraps an LR scheduler so that ``step()`` does nothing after an optimizer step that was skipped
    (inf/nan grads under a GradScaler), as if that iteration never happened.

    It reads ``optimizer.step_was_skipped``, which fastops optimizers and fastops.amp.GradScaler set as a
    device tensor: one host read per scheduler step, nowhere else. Everything else is the wrapped
    scheduler's (``get_last_lr``, ``state_dict``, ...)."""

    def __init__(self, scheduler, optimizer=None) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer if optimizer is not None else scheduler.optimizer

    def step(self, *args, **kwargs):
        skipped = getattr(self.optimizer, "step_was_skipped", None)
        if skipped is not None and bool(skipped):
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)
