"""Which params the fused kernels take, and the torch step that serves every group they do not.

The choice is per param group and per step (see fastops/optim/__init__.py): a group goes to torch when it has
``differentiable=True``, or any of its params is not float32/bfloat16/float16, is complex, sparse, strided with
gaps, on a device fastops does not serve, or on another device than the group's first param, or has a sparse grad
at this step. Such a group gets torch's code and torch's state layout; under a GradScaler its grads are unscaled
in place first, as torch's GradScaler does for torch's optimizers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from .. import _backend, _grads
from .._checks import FLOAT_DTYPES, is_dense


def _local(t: Tensor) -> Tensor:
    # FSDP2 shards are DTensors; the kernel updates their local shard, as torch's fused path does. (One getattr:
    # it runs about 5 times per param per step.)
    return getattr(t, "_local_tensor", t)


def _why_not(p: Tensor) -> str | None:
    """Why the fused kernels cannot update ``p`` in place, or None when they can."""
    # Before anything that asks for strides: a sparse CSR tensor raises on is_contiguous() itself.
    if p.layout != torch.strided:
        return f"is sparse (layout {p.layout})"
    if p.is_complex():
        return f"is complex (dtype {p.dtype})"
    if p.dtype not in FLOAT_DTYPES:
        return f"has dtype {p.dtype}; the kernels take float32, bfloat16 and float16"
    local = _local(p)
    # Checked per param at every step: is_cpu/is_cuda cost 0.1 us against 0.5 us for device.type.
    device_type = "cpu" if local.is_cpu else "cuda" if local.is_cuda else local.device.type
    if device_type not in _backend.DEVICE_TYPES:
        return f"is on {local.device}; fastops serves {_backend.DEVICE_TYPES}"
    if not is_dense(local):
        return (
            f"(shape {tuple(p.shape)}, strides {local.stride()}) is not contiguous; its memory has gaps or "
            "overlaps, which the fused kernel cannot update in place"
        )
    return None


def _kernels_take(group: dict[str, Any]) -> bool:
    """Whether the fused step serves this group now (else torch's step does): every param passes ``_why_not``,
    all on one device, and dense grads. Asked at every step (grads can turn sparse), so it makes no torch.device
    objects and no messages, and complex dtypes fail the dtype test: 0.7 ms for 300 params on the 2-core
    development machine, against 1.7 ms for building the op's lists of the same group."""
    if group.get("differentiable", False):
        return False
    params = group["params"]
    device0 = _local(params[0]).get_device() if params else None
    for p in params:
        if p.dtype not in FLOAT_DTYPES or p.layout != torch.strided:
            return False
        local = _local(p)
        if not (local.is_cpu or local.is_cuda) or local.get_device() != device0 or not is_dense(local):
            return False
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:
            return False
    return True


def _check_no_overlap(params: list[Tensor], cls: str) -> None:
    spans = []
    for i, p in enumerate(params):
        t = _local(p)
        if t.numel() and t.device.type != "meta" and _why_not(p) is None:
            start = t.data_ptr()
            spans.append((t.device, start, start + t.numel() * t.element_size(), i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"{cls}: params {a[3]} and {b[3]} overlap in memory; each param must own its storage")


def _to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. A copy to an accelerator is queued (non_blocking, no host sync); a copy to the CPU
    waits, since the CPU kernels read the value on the host as soon as they start."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


@contextlib.contextmanager
def _hidden(obj, names):
    """Inside the block, ``getattr(obj, name, None)`` is None for each name; afterwards each is as it was."""
    saved = {n: obj.__dict__[n] for n in names if n in obj.__dict__}
    for n in names:
        obj.__dict__[n] = None
    try:
        yield
    finally:
        for n in names:
            del obj.__dict__[n]
        obj.__dict__.update(saved)


def torch_step(opt, torch_class: type, groups: list[dict[str, Any]]) -> None:
    """torch's own step of ``torch_class`` over ``groups`` only, without the step hooks (the fastops step that
    calls it runs them) and with grad_scale/found_inf hidden: the caller has unscaled the grads and decided the
    skip."""
    step = torch_class.step
    if getattr(step, "hooked", False):  # torch wrapped the class's step when its first instance was made
        step = step.__wrapped__
    everything = opt.param_groups
    opt.param_groups = groups
    try:
        with _hidden(opt, ("grad_scale", "found_inf")):
            step(opt)
    finally:
        opt.param_groups = everything


def unscale_for_torch(groups, grad_scale: Tensor, device: torch.device) -> Tensor:
    """Unscales the grads of groups that torch's step serves, in place, as torch's GradScaler.unscale_
    would; returns their found_inf (float32, on ``device``)."""
    found = torch.zeros(1, device=device)
    inv_scale = grad_scale.double().reciprocal().float()
    params = [p for g in groups for p in g["params"]]
    per_device = _grads.unscale_grads_(params, inv_scale, found, allow_fp16=True)
    for t in per_device.values():
        found = torch.maximum(found, _to(t, device))
    return found.reshape(())
