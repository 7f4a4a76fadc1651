"""Drop-in fused Adam and AdamW.

``fastops.optim.Adam``/``AdamW`` subclass torch's classes, so ``isinstance`` checks, LR schedulers and
``torch.amp.GradScaler`` treat them as torch's own. They keep torch's constructor signature, defaults,
param_groups and state_dict format, and add one keyword, ``master_weights``. Each step is one call of
``torch.ops.fastops.adam_step_`` per param group (two when some params need an fp32 master copy).

Where they differ from torch on purpose (the README lists these too):
- optimizer states are fp32 for every param dtype (torch keeps bf16/fp16 states for bf16/fp16 params);
- grads are never written (torch's fused kernels leave the unscaled grad behind when a GradScaler is
  used; reading the grad after ``scaler.step`` gives the scaled grad here);
- ``foreach`` and ``fused`` are accepted and stored but ignored: the fastops kernel always runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _ops, amp
from ._checks import is_dense

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Group keys that torch's Adam does not have; a torch state_dict loaded into fastops keeps the current value.
_FASTOPS_KEYS = ("master_weights", "max_grad_norm")
_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _local(t: Tensor) -> Tensor:
    # FSDP2 shards are DTensors; the kernel updates their local shard, as torch's fused path does.
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _check_param(p: Tensor, i: int, cls: str) -> None:
    if p.is_complex():
        raise ValueError(f"{cls} does not support complex params (param {i} has dtype {p.dtype})")
    if p.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{cls} supports float32, bfloat16 and float16 params; param {i} has dtype {p.dtype}")
    if p.is_sparse:
        raise ValueError(f"{cls} does not support sparse params (param {i})")
    local = _local(p)
    if not is_dense(local):
        raise ValueError(
            f"{cls}: param {i} (shape {tuple(p.shape)}, strides {local.stride()}) is not contiguous; "
            "its memory has gaps or overlaps, which the fused kernel cannot update in place"
        )


def _check_no_overlap(params: list[Tensor], cls: str) -> None:
    spans = []
    for i, p in enumerate(params):
        t = _local(p)
        if t.numel() and t.device.type != "meta":
            start = t.data_ptr()
            spans.append((t.device, start, start + t.numel() * t.element_size(), i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"{cls}: params {a[3]} and {b[3]} overlap in memory; each param must own its storage")


class _FusedAdamMixin:
    _step_supports_amp_scaling = True
    _fastops_amp = True  # fastops.amp.GradScaler hands this optimizer the scale instead of unscaling first
    last_grad_norm: Tensor | None = None
    # Set per instance by fastops.accelerate when grads are sharded across ranks (FSDP2): maps this rank's
    # grad_stats to the global ones (an all-reduce), so the clip norm and the skip decision agree on all ranks.
    reduce_grad_stats = None

    def _fastops_init(self, master_weights: bool, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None and not 0.0 <= max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        extra = {"master_weights": bool(master_weights), "max_grad_norm": max_grad_norm}
        self.defaults.update(extra)
        for group in self.param_groups:
            for k, v in extra.items():
                group.setdefault(k, v)
        self.register_load_state_dict_pre_hook(_FusedAdamMixin._load_pre_hook)
        self.register_load_state_dict_post_hook(_FusedAdamMixin._load_post_hook)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        group = self.param_groups[-1]
        cls = f"fastops.optim.{type(self).__name__}"
        params = group["params"]
        for i, p in enumerate(params):
            _check_param(p, i, cls)
            if p.device != params[0].device:
                raise ValueError(
                    f"{cls}: all params of a group must be on one device; param {i} is on {p.device} "
                    f"but param 0 is on {params[0].device}"
                )
        _check_no_overlap([p for g in self.param_groups for p in g["params"]], cls)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        for group in self.param_groups:
            group.setdefault("master_weights", False)
            group.setdefault("max_grad_norm", None)

    # torch's load_state_dict casts every state tensor to the param's dtype; fastops keeps fp32 states and
    # fp32 masters for bf16/fp16 params, so the originals are kept aside here and restored afterwards.
    @staticmethod
    def _load_pre_hook(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self._fastops_loading = [(p, state_dict["state"].get(i)) for i, p in zip(saved_ids, params)]
        groups = []
        for saved, current in zip(state_dict["param_groups"], self.param_groups):
            extra = {k: current[k] for k in _FASTOPS_KEYS if k not in saved}
            groups.append({**saved, **extra})
        return {**state_dict, "param_groups": groups}

    @staticmethod
    def _load_post_hook(self) -> None:
        for p, saved in self.__dict__.pop("_fastops_loading", []):
            if not saved:
                continue
            state = self.state[p]
            for key in _STATE_TENSORS:
                if key in saved:
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32)
            if "step" in saved:
                step = saved["step"]
                step = step if isinstance(step, Tensor) else torch.tensor(float(step))
                state["step"] = step.to(device=_local(p).device, dtype=torch.float32)

    def _fastops_group(self, group: dict[str, Any]):
        """Per param group: the op's tensor lists, split by whether a param has an fp32 master."""
        plain = ([], [], [], [], [], [], [])
        mastered = ([], [], [], [], [], [], [])
        amsgrad = group["amsgrad"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            use_master = group["master_weights"] and p.dtype != torch.float32
            if use_master and "master_param" not in state:
                state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
            lp, lg = _local(p), _local(grad)
            if lg.stride() != lp.stride() and lg.numel() > 1:
                # The kernel walks grad and param memory in lockstep; a grad laid out differently is copied.
                lg = torch.empty_like(lp).copy_(lg)
            lists = mastered if use_master else plain
            lists[0].append(lp)
            lists[1].append(lg)
            lists[2].append(_local(state["exp_avg"]))
            lists[3].append(_local(state["exp_avg_sq"]))
            if amsgrad:
                lists[4].append(_local(state["max_exp_avg_sq"]))
            lists[5].append(state["step"])
            if use_master:
                lists[6].append(_local(state["master_param"]))
        return [lists for lists in (plain, mastered) if lists[0]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by a GradScaler (torch's or fastops') for optimizers with _step_supports_amp_scaling.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        work = []
        for group in self.param_groups:
            calls = self._fastops_group(group)
            if calls:
                work.append((group, calls))
        clipping = any(group["max_grad_norm"] is not None for group, _ in work)
        norm = None
        if work and (clipping or (grad_scale is not None and found_inf is None)):
            # One read of every grad gives the norm and the inf/nan flag; no host sync.
            # Unscaled inside the read, before squaring: scaled fp32 grads above 1.8e19 would square to inf.
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            stats = amp.grad_stats([g for _, calls in work for lists in calls for g in lists[1]], inv_scale)
            if self.reduce_grad_stats is not None:
                stats = self.reduce_grad_stats(stats)
            if found_inf is None:
                found_inf = stats[2] if grad_scale is not None else None
            norm = stats[0].sqrt()
            self.last_grad_norm = norm
        if found_inf is not None:
            self.step_was_skipped = found_inf != 0
        else:
            device = grad_scale.device if grad_scale is not None else (work[0][1][0][0][0].device if work else "cpu")
            self.step_was_skipped = torch.zeros((), dtype=torch.bool, device=device)
        for group, calls in work:
            device = calls[0][0][0].device
            lr = group["lr"]
            if isinstance(lr, Tensor):
                lr_t = lr if lr.device.type == "cpu" or lr.device == device else lr.to(device)
            else:
                lr_t = torch.tensor(lr, dtype=torch.float64)
            divisor = grad_scale
            if group["max_grad_norm"] is not None:
                # grads / (scale / coef): unscale and clip folded into the step, grads never written.
                coef = amp.clip_coef(norm, group["max_grad_norm"])
                divisor = 1.0 / coef if grad_scale is None else grad_scale / coef
            gs = divisor if divisor is None or divisor.device == device else divisor.to(device)
            fi = found_inf if found_inf is None or found_inf.device == device else found_inf.to(device)
            beta1, beta2 = group["betas"]
            for params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters in calls:
                _ops.adam_step_(
                    params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, lr_t,
                    float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                    bool(group["amsgrad"]), bool(group["maximize"]), bool(group["decoupled_weight_decay"]),
                    gs, fi,
                )  # fmt: skip
        return loss


class Adam(_FusedAdamMixin, torch.optim.Adam):
    """torch.optim.Adam with a fused fastops step. Same arguments, plus ``master_weights``: keep an fp32
    copy of bf16/fp16 params in the optimizer state, update it, and write the rounded param in the same pass."""

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if differentiable:
            raise NotImplementedError("fastops.optim.Adam does not support differentiable=True")
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=False, fused=fused, decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastops_init(master_weights, max_grad_norm)


class AdamW(_FusedAdamMixin, torch.optim.AdamW):
    """torch.optim.AdamW with a fused fastops step. Same arguments, plus ``master_weights`` (see Adam)."""

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if differentiable:
            raise NotImplementedError("fastops.optim.AdamW does not support differentiable=True")
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=False, fused=fused,
        )  # fmt: skip
        self._fastops_init(master_weights, max_grad_norm)
