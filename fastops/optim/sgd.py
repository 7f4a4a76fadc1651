"""SGD: the fastops step of torch.optim.SGD (``torch.ops.fastops.sgd_step_``), momentum buffers in fp32."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _ops
from ._fallback import _local
from ._state import _fp32_zeros
from .optimizer import _EXTRAS_DOC, Call, _check_scalars, _Fused, _where


@dataclass(slots=True)
class SGDCall(Call):
    """One call of ``sgd_step_``."""

    momentum_buffers: list[Tensor] = field(default_factory=list)  # empty without momentum or at a first step
    first: bool = False  # the buffers start at this step (made in _launch)


class SGD(_Fused, torch.optim.SGD):
    """torch.optim.SGD with a fused fastops step (``torch.ops.fastops.sgd_step_``). Same arguments, plus
    ``master_weights`` and ``max_grad_norm`` as in Adam. ``momentum_buffer`` is fp32 for every param dtype.

    A param's first step with momentum sets ``buf = grad`` (torch's rule). When a GradScaler skips that step,
    the buffer stays unstarted, so the next real step is a first step again (torch's fused SGD leaves an
    uninitialized buffer there instead). With ``dampening == 0`` this costs nothing: the buffer starts at zero,
    and ``momentum * 0 + grad`` is ``grad``. With ``dampening != 0`` it takes one host read of the GradScaler's
    found_inf, once, at the first step of params that have no buffer yet (a sync on CUDA)."""

    _nonnegative = (
        ("lr", "learning rate"),
        ("momentum", "momentum value"),
        ("weight_decay", "weight_decay value"),
        ("max_grad_norm", "max_grad_norm value"),
    )

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float | Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastops_init(master_weights, max_grad_norm)

    def _check_group(self, group: dict[str, Any], k: int | None, read_device: bool) -> None:
        """torch.optim.SGD's constructor checks and messages."""
        _check_scalars(group, k, read_device, self._nonnegative)
        if group.get("state_dtype", "fp32") != "fp32":
            raise ValueError(
                f"fastops.optim.SGD keeps its momentum in fp32; state_dtype applies to Adam and AdamW{_where(k)}"
            )
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening{_where(k)}")

    def _group_calls(self, group: dict[str, Any], k: int):
        """The op's calls, split by whether a param has an fp32 master and whether its buffer starts at this step
        (those buffers are made in ``_launch``)."""
        calls: dict[tuple[bool, bool], SGDCall] = {}
        with_momentum = group["momentum"] != 0
        master_weights = group["master_weights"]
        states = self.state
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            lg = self._grad(p, i, k)
            # (.get, not self.state[p]: torch keeps no state for SGD without momentum)
            state = states.get(p) if with_momentum else None
            buf = None if state is None else state.get("momentum_buffer")
            use_master = master_weights and p.dtype != torch.float32
            first = with_momentum and buf is None
            call = calls.get((use_master, first))
            if call is None:
                call = calls[(use_master, first)] = SGDCall(first=first)
            call.params.append(_local(p))
            call.grads.append(lg)
            if buf is not None:
                call.momentum_buffers.append(_local(buf))
            if use_master:
                call.masters.append(self._master(p, self.state[p]))
            call.owners.append(p)
        return list(calls.values())

    def _launch(self, group, _, call, lr_t, divisor, found_inf, sr=None) -> None:
        c: SGDCall = call
        bufs = c.momentum_buffers
        dampening = float(group["dampening"])
        if c.first:
            if dampening != 0 and found_inf is not None and bool(found_inf):  # host read, see the class docstring
                return  # skipped: no buffer, so the next real step is these params' first
            for p in c.owners:
                self.state[p]["momentum_buffer"] = buf = _fp32_zeros(p)
                bufs.append(_local(buf))
        _ops.sgd_step_(
            c.params, c.grads, bufs, c.masters, lr_t, float(group["weight_decay"]), float(group["momentum"]),
            dampening, bool(group["nesterov"]), bool(group["maximize"]), c.first, divisor, found_inf,
        )  # fmt: skip
        if c.masters:
            self._wrote(c.owners)


SGD.__doc__ += _EXTRAS_DOC
