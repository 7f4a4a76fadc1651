"""The prepared optimizer and LR schedulers.

The optimizer keeps its identity: torch's AdamW/Adam/SGD becomes fastops' fused one in place
(``fastops.optim.fuse_``: same object, param_groups, state and step hooks, so every LR scheduler built on it
keeps driving it), with ``step``/``zero_grad`` replaced on the instance: they do nothing on the first k-1
micro-steps, and the real ``step`` runs GradScaler step + update (fp16) and clipping (folded into the fused
step, or fastops.clip_grad_norm_ after unscaling otherwise). A scheduler that is not prepared still advances on
every ``step()`` call; ``Accelerator.prepare(scheduler)`` makes it advance once per real step (not on
micro-steps, not after a skipped fp16 step)."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from .. import amp, optim
from ..optim.optimizer import _Fused
from . import _distributed, _model

if TYPE_CHECKING:
    from . import Accelerator

_CLOSURE_UNSUPPORTED = "Closure use is not currently supported if GradScaler is enabled."  # torch's message


def prepare_optimizer(acc: "Accelerator", opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    if acc.optimizer is not None:
        raise ValueError("fastops.Accelerator: one optimizer per Accelerator; this one already has an optimizer")
    if acc.model is None:
        raise ValueError("fastops.Accelerator.prepare: prepare the model before (or together with) the optimizer")
    if acc.strategy == "pp":
        # The optimizer was built on the whole model: this rank steps its stage's parameters only.
        mine = {id(p) for p in acc.model.parameters()}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]
    elif acc.strategy in ("fsdp", "tp", "fsdp+tp"):
        _repoint(acc, opt)
    # torch's Adam/AdamW/SGD become fastops' in place (same object, so schedulers keep driving it); others
    # (and torch optimizers fastops cannot take) stay as they are.
    optim.fuse_(opt)
    if isinstance(opt, _Fused):
        if acc.grad_clip is not None:
            opt.defaults["max_grad_norm"] = acc.grad_clip
            for group in opt.param_groups:
                group["max_grad_norm"] = acc.grad_clip
        # The global grad norm for the clip and the fp16 skip, through the optimizer's one hook for it
        # (fastops/optim/optimizer.py): all-reduced over the FSDP2 shards, or over the TP/PP mesh.
        if acc.strategy == "fsdp":
            opt.grad_stats_fn = _distributed.fsdp_grad_stats
        elif acc.mesh is not None:
            from . import _parallel

            _parallel.global_grad_stats(opt, acc.mesh)
    elif acc.mesh is not None and (acc.grad_clip is not None or acc.scaler is not None):
        raise ValueError(f"fastops.accelerate: under strategy={acc.strategy!r}, grad_clip and fp16 need an "
                         f"optimizer fastops fuses (torch Adam, AdamW, SGD), not {type(opt).__name__}")
    if acc.scaler is not None and isinstance(opt, _Fused):
        # Under fp16 the prepared step unscales by itself (fastops' scaler, or a user's that drives it): a torch
        # GradScaler must hand it the scale rather than unscale the grads first, which this flag tells it (torch
        # sets it on fused=True optimizers). _step then sees a scaler that did not scale the loss by its grad_scale.
        opt._step_supports_amp_scaling = True
    opt.step = types.MethodType(_step, opt)
    opt.zero_grad = types.MethodType(_zero_grad, opt)
    opt.accelerator = acc
    acc.optimizer = opt
    return opt


def _repoint(acc: "Accelerator", opt: torch.optim.Optimizer) -> None:
    """FSDP2 replaced the model's parameters with sharded ones: the optimizer's param lists are pointed at
    them in place, so the optimizer (and every scheduler built on it) stays the same object. An optimizer
    that keeps references to its parameters outside ``param_groups`` is not supported."""
    if opt.state:
        raise ValueError(
            "fastops.accelerate: the optimizer already has state, which cannot be carried over to FSDP2's "
            "sharded parameters; prepare it before training, and resume with Accelerator.load"
        )
    params = dict(acc._inner.named_parameters())
    current = {id(p) for p in params.values()}
    for group in opt.param_groups:
        plist = group["params"]
        for i, p in enumerate(plist):
            if id(p) in current:
                continue
            name = acc._names.get(id(p))
            if name not in params:
                raise ValueError(
                    "fastops.accelerate: the optimizer holds a parameter that is not in the model, which "
                    "FSDP cannot shard; create the optimizer from model.parameters()"
                )
            plist[i] = params[name]


class Scheduler(amp.SkipAwareScheduler):
    """An LR scheduler that advances once per real optimizer step: not on accumulation micro-steps, not
    after a step skipped for inf/nan grads."""

    def __init__(self, scheduler, optimizer, acc: "Accelerator") -> None:
        super().__init__(scheduler, optimizer)
        self.accelerator = acc

    def step(self, *args, **kwargs):
        if not self.accelerator._step_state.last_step_real:
            return None
        return super().step(*args, **kwargs)


def prepare_scheduler(acc: "Accelerator", scheduler) -> Scheduler:
    if acc.optimizer is None:
        raise ValueError("fastops.Accelerator.prepare: prepare the optimizer before (or with) the scheduler")
    if scheduler.optimizer is not acc.optimizer:
        raise ValueError("fastops.Accelerator.prepare: the scheduler drives an optimizer that was not prepared here")
    wrapped = Scheduler(scheduler, acc.optimizer, acc)
    acc.schedulers.append(wrapped)
    return wrapped


def _clip(acc: "Accelerator", opt: torch.optim.Optimizer) -> torch.Tensor:
    """Clip for an optimizer that is not fastops' (grads already unscaled)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if acc.strategy != "fsdp":
        return amp.clip_grad_norm_(params, acc.grad_clip)
    grads = [_distributed.local(p.grad) for p in params]
    norm = _distributed.fsdp_grad_stats(grads)[0].sqrt()
    if grads:
        torch._foreach_mul_(grads, amp.clip_coef(norm, acc.grad_clip).to(grads[0].device))
    return norm


def _step(opt: torch.optim.Optimizer, closure=None):
    """``optimizer.step()`` of a prepared optimizer (bound to the instance)."""
    acc: Accelerator = opt.accelerator
    state = acc._step_state
    cls = type(opt)
    if state.raw:
        return cls.step(opt, closure)
    driven = state.user_scaler is not None  # by the user's GradScaler (see _model.give_way_to)
    fused = isinstance(opt, _Fused)
    if driven and acc.grad_clip is not None and not fused and getattr(opt, "grad_scale", None) is not None:
        raise RuntimeError(
            f"fastops.accelerate: grad_clip with your {type(state.user_scaler).__name__} and a "
            f"{type(opt).__name__}, which unscales inside its step: the gradients are still scaled when fastops "
            "clips them. Call scaler.unscale_(optimizer) before scaler.step(optimizer)"
        )
    if acc.scaler is not None and not driven:
        if closure is not None:
            # As torch's GradScaler.step: the closure's backward would run unscaled, after the inf check.
            raise RuntimeError(_CLOSURE_UNSUPPORTED)
        if "grad_scale" in opt.__dict__ or "found_inf" in opt.__dict__:
            raise RuntimeError(
                "fastops.accelerate: optimizer.step() was called by a GradScaler that is not fastops' (it set "
                "optimizer.grad_scale), but no scale() of that scaler was seen on a loss computed from the prepared "
                "model's outputs, so the gradients carry fastops' own loss scale. Scale the loss with that scaler "
                "(scaler.scale(loss).backward()), or drop it: precision='fp16' scales the loss itself"
            )
    if closure is None and not driven and (acc.micro_step + 1) % acc.accumulate == 0:
        _model.check_scaled(acc, opt)  # before anything changes, so a raise leaves the run as it was
    opt._opt_called = True  # for torch's LRScheduler order check
    acc.micro_step += 1
    state.last_step_real = acc.micro_step % acc.accumulate == 0
    if not state.last_step_real:
        return None
    with state.raw_calls():
        if acc.scaler is not None and not driven:
            if acc.grad_clip is not None and not fused:
                acc.scaler.unscale_(opt)
                opt.last_grad_norm = _clip(acc, opt)
            # With a fastops optimizer the scaler hands it the scale: unscale, inf check, clip and step are
            # one pass over the grads after the grad_stats read.
            result = acc.scaler.step(opt)
            acc.scaler.update()
        else:
            if acc.grad_clip is not None and not fused:
                opt.last_grad_norm = _clip(acc, opt)
            result = cls.step(opt, closure)
    acc.step += 1
    state.end_step()
    return result


# torch's LRScheduler warns unless optimizer.step looks wrapped by it (it then reads opt._opt_called, which
# _step sets); with this it also leaves the prepared step as it is.
_step._wrapped_by_lr_sched = True


def _zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad()``: only at an accumulation boundary, so it works before backward or after step."""
    acc: Accelerator = opt.accelerator
    if acc._step_state.raw or acc.micro_step % acc.accumulate == 0:
        type(opt).zero_grad(opt, set_to_none)
