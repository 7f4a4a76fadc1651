"""fastops.amp: a drop-in GradScaler on fused kernels, and a one-pass clip_grad_norm_.

torch's AMP optimizer phase (``unscale_`` -> ``clip_grad_norm_`` -> ``step`` -> ``update``) reads and
writes every gradient several times. With a fastops optimizer the whole phase is two passes over the
grads and no host sync: ``grad_stats`` reads them once for the norm and the inf/nan check, then the
fused step divides by ``scale / clip_coef`` and skips itself on device when ``found_inf`` is set.

Grads that fastops' kernels do not take (float64, complex, sparse, strided with gaps, tensor subclasses
such as DTensor, devices other than cpu/cuda) go to torch's own implementation, so every script torch
runs keeps running after ``fastops.patch()``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Iterable

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.optim import optimizer as _torch_optimizer
from typing_extensions import deprecated

from . import _ops
# grad_stats, clip_coef and unscale_grads_ are public here as before; they live in _grads, which optim reads too.
from ._grads import by_device as _by_device
from ._grads import clip_coef, grad_stats, unscale_grads_  # noqa: F401
from ._grads import kernels_take as _kernels_take


def _torch_original(module: str, name: str):
    # Read once, when this module is first imported (before fastops.patch() can run). If it is re-imported
    # while patched, the attribute is fastops' own: take the original that patch() recorded instead.
    saved = getattr(sys.modules.get("fastops._patch"), "_originals", {}).get((module, name))
    return saved if saved is not None else getattr(importlib.import_module(module), name)


_TorchGradScaler = _torch_original("torch.amp.grad_scaler", "GradScaler")
_TorchCudaGradScaler = _torch_original("torch.cuda.amp.grad_scaler", "GradScaler")
_TorchCpuGradScaler = _torch_original("torch.cpu.amp.grad_scaler", "GradScaler")
_torch_clip_grad_norm_ = _torch_original("torch.nn.utils.clip_grad", "clip_grad_norm_")

_NO_INF_CHECKS = "No inf checks were recorded for this optimizer."  # torch's GradScaler.step message


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ with one read pass for the norm and one in-place scale.

    Norm types 2 and inf over float32/bfloat16/float16 dense grads on cpu/cuda use fastops' kernels; any
    other call (other norm types, float64, complex or sparse grads, grads strided with gaps, DTensor grads,
    other devices) is torch's implementation, whole.

    Differences from torch on the fastops path: the returned norm is float32 for bfloat16/float16 grads
    (torch returns it in the grads' dtype; fastops accumulates in fp32 and does not round it back), and an
    empty grad's inf-norm is 0 (torch raises)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type not in (2.0, float("inf")) or not all(_kernels_take(g) for g in grads):
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
    """A fastops optimizer says so by its class attribute ``takes_grad_scale`` (see fastops/optim/optimizer.py):
    its step takes ``grad_scale``/``found_inf`` and writes ``step_was_skipped`` and ``last_grad_norm``."""
    return getattr(optimizer, "takes_grad_scale", False) is True


def _step_is_watched(optimizer) -> bool:
    """Whether code outside fastops may count the calls of ``optimizer.step``: a ``step`` replaced on the instance
    (HF Accelerate's AcceleratedOptimizer does, to flag a skipped fp16 step by the call not happening, and HF's
    Trainer holds its LR schedule on that flag), or step hooks (they run on every call). torch's LR scheduler
    wrapper, fastops.accelerate's step and SkipAwareScheduler's hook are not counted: they know fastops' rule."""
    step = optimizer.__dict__.get("step")
    if step is not None and not getattr(step, "_wrapped_by_lr_sched", False):
        return True
    tables = (getattr(optimizer, "_optimizer_step_pre_hooks", {}), getattr(optimizer, "_optimizer_step_post_hooks", {}),
              _torch_optimizer._global_optimizer_pre_hooks, _torch_optimizer._global_optimizer_post_hooks)
    return any(not getattr(hook, "_fastops_hook", False) for table in tables for hook in table.values())


def _hands_over(optimizer) -> bool:
    """Whether fastops' GradScaler hands ``optimizer`` the scale and calls its step on every iteration, the step
    skipping itself on the device (no host sync). torch's scaler does that for optimizers with
    ``_step_supports_amp_scaling`` (fused=True) and calls any other's step only when no inf/nan was found, after a
    host read. fastops keeps the sync-free hand-over for its optimizers unless something watches the step calls,
    which then see torch's rule."""
    if not _is_fastops_optimizer(optimizer):
        return False
    return getattr(optimizer, "_step_supports_amp_scaling", False) or not _step_is_watched(optimizer)


class GradScaler(_TorchGradScaler):
    """torch.amp.GradScaler, same constructor, methods and state_dict, on fastops' fused kernels.

    - ``unscale_`` uses ``torch.ops.fastops.unscale_check_``: one pass per device for all dtypes. Grads the
      kernel does not take (float64, complex, sparse, strided with gaps, DTensor, other devices) go to
      ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype), sharing the same found_inf.
    - ``step`` with a fastops optimizer never syncs with the host: it hands the scale to the optimizer,
      which checks for inf/nan in the same read that gives the grad norm and skips itself on device. When
      something counts the step calls (HF Accelerate and Trainer do, see ``_step_is_watched``) and the optimizer
      is not ``fused=True``, it keeps torch's rule instead: unscale, read ``found_inf`` on the host, and call
      ``step()`` only when nothing was found. With any other optimizer it behaves exactly like torch's.
    - ``update`` is torch's, already on device, so the scale trajectory is torch's to the bit.
    """

    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool):
        params = (p for group in optimizer.param_groups for p in group["params"])
        return unscale_grads_(params, inv_scale, found_inf, allow_fp16)

    def step(self, optimizer, *args, **kwargs):
        if not (self._enabled and _hands_over(optimizer)):
            retval = super().step(optimizer, *args, **kwargs)
            if self._enabled:
                found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
                skipped = sum(t.to(self._scale.device) for t in found) != 0
                if _is_fastops_optimizer(optimizer):
                    # torch's step read found_inf on the host already; a step it did not call wrote no flags.
                    optimizer.step_was_skipped.copy_(skipped)
                    if skipped:
                        optimizer.last_grad_norm.fill_(float("nan"))
                else:
                    optimizer.step_was_skipped = skipped
            return retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        # torch's scaler records no inf check for an optimizer without grads and raises (here, or in update()
        # for fused optimizers); recording a clean step instead would grow the scale where torch's does not.
        # A grad_scale the user set on the optimizer is torch's too: multiplied into the scale before unscale_,
        # passed alone after it, and deleted with the scaler's attributes after the step.
        user_scale = getattr(optimizer, "grad_scale", None)
        if state["stage"] is OptState.READY:
            if not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
                raise AssertionError(_NO_INF_CHECKS)
            # The optimizer divides by the scale inside its step and finds inf/nan in its grad_stats read.
            scale = self._get_scale_async()
            optimizer.grad_scale = scale if user_scale is None else scale * user_scale
            optimizer.found_inf = None
        else:
            if not state["found_inf_per_device"]:
                raise AssertionError(_NO_INF_CHECKS)
            # unscale_ already ran (and found inf/nan): the grads are unscaled, the flag is known.
            found = [t.to(self._scale.device, non_blocking=True) for t in state["found_inf_per_device"].values()]
            optimizer.grad_scale, optimizer.found_inf = user_scale, sum(found)
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        if state["stage"] is OptState.READY:
            state["found_inf_per_device"] = {self._scale.device: optimizer.step_was_skipped.float()}
        state["stage"] = OptState.STEPPED
        return retval


# torch.cuda.amp.GradScaler / torch.cpu.amp.GradScaler: deprecated in torch, still in many scripts, so
# fastops.patch() replaces them too. Each is fastops' GradScaler with the old device-fixed signature, the
# same FutureWarning at the caller's line, and torch's deprecated class as a base, so isinstance checks
# against either class hold.


def _device_scaler(device: str, torch_base: type) -> type:
    class DeviceGradScaler(GradScaler, torch_base):
        @deprecated(
            f"`torch.{device}.amp.GradScaler(args...)` is deprecated. "
            f"Please use `torch.amp.GradScaler('{device}', args...)` instead.",
            category=FutureWarning,
        )
        def __init__(
            self,
            init_scale: float = 2.0**16,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 2000,
            enabled: bool = True,
        ) -> None:
            # Past torch's deprecated __init__ (it would warn a second time, at this line) to torch.amp.GradScaler's.
            super(torch_base, self).__init__(
                device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval, enabled=enabled,
            )  # fmt: skip

    name = f"{device.capitalize()}GradScaler"
    DeviceGradScaler.__name__ = DeviceGradScaler.__qualname__ = name  # pickle finds it as fastops.amp.<name>
    DeviceGradScaler.__doc__ = (
        f"What ``fastops.patch()`` puts at ``torch.{device}.amp.GradScaler``: fastops.amp.GradScaler(\"{device}\", ...)."
    )
    return DeviceGradScaler


CudaGradScaler = _device_scaler("cuda", _TorchCudaGradScaler)
CpuGradScaler = _device_scaler("cpu", _TorchCpuGradScaler)


class SkipAwareScheduler:
    """Wraps an LR scheduler so that ``step()`` advances it only after a real optimizer step: not after a
    step that a GradScaler skipped for inf/nan grads, as if that iteration never happened. Call ``step()``
    once per optimizer step, as with the scheduler itself; to move the schedule without an optimizer step
    (fast-forwarding), step ``.scheduler``.

    Works with either GradScaler and any optimizer. An optimizer step post-hook records the latest step's
    skip flag: ``step_was_skipped`` for fastops optimizers, otherwise the ``found_inf`` a GradScaler sets
    on fused torch optimizers during their step (absent without a scaler: a real step). torch's
    GradScaler skips other optimizers by not calling ``step()``, and no ``step()`` since the previous
    call counts as skipped.

    Host sync: ``step()`` reads that flag on the host, once per call when it is a device tensor (always
    for fastops optimizers, under a scaler for torch's fused ones); on CUDA that is one sync per iteration,
    after the optimizer phase. The optimizer phase itself stays free of syncs.

    ``state_dict``/``load_state_dict`` are the wrapped scheduler's, so a checkpoint moves between a plain
    torch scheduler and this wrapper; other public attributes (``get_last_lr``, ``last_epoch``, ...) are
    read from it. It is not an LRScheduler instance: LRScheduler.__init__ stores ``initial_lr`` in the
    optimizer, wraps its ``step`` and takes a first step, all of which the wrapped scheduler already did."""

    def __init__(self, scheduler, optimizer=None) -> None:
        optimizer = optimizer if optimizer is not None else scheduler.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.scheduler = scheduler
        self.optimizer = optimizer
        self._last_skip: Tensor | bool | None = None  # None: no optimizer step since the last step()
        self._watch()

    def _watch(self) -> None:
        self._hook = self.optimizer.register_step_post_hook(self._record_step)

    def _record_step(self, optimizer, args, kwargs) -> None:
        # Runs inside optimizer.step(), before a GradScaler deletes the found_inf it set for that step.
        if _is_fastops_optimizer(optimizer):
            self._last_skip = optimizer.step_was_skipped
        else:
            found = getattr(optimizer, "found_inf", None)
            self._last_skip = False if found is None else found

    _record_step._fastops_hook = True  # see _step_is_watched

    def step(self, *args, **kwargs):
        skip, self._last_skip = self._last_skip, None
        if skip is None or bool(skip):
            return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getstate__(self) -> dict:
        # The hook handle points into the optimizer's hook table, which torch does not pickle with the optimizer.
        state = self.__dict__.copy()
        del state["_hook"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._watch()

    def __getattr__(self, name: str):
        # Reached only for names the wrapper lacks. While pickle or copy rebuilds it, __dict__ is empty, so
        # forwarding "scheduler" would recurse without end, and protocol lookups (__setstate__, __deepcopy__)
        # must fail as on a plain object rather than find the wrapped scheduler's.
        if name == "scheduler" or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.scheduler, name)
