"""Drop-in fused Adam and AdamW.

``fastops.optim.Adam``/``AdamW`` subclass torch's classes, so ``isinstance`` checks, LR schedulers and
``torch.amp.GradScaler`` treat them as torch's own. They keep torch's constructor signature, defaults,
param_groups and state_dict format, and add one keyword, ``master_weights``. Each step is one call of
``torch.ops.fastops.adam_step_`` per param group (two when some params need an fp32 master copy).

Where they differ from torch on purpose (the README lists these too):
- optimizer states are fp32 for every param dtype (torch keeps bf16/fp16 states for bf16/fp16 params);
- grads are never written (torch's fused kernels leave the unscaled grad behind when a GradScaler is
  used; reading the grad after ``scaler.step`` gives the scaled grad here);
- ``foreach`` and ``fused`` are accepted and stored but ignored: the fastops kernel always runs;
- hyperparameters are checked with torch's constructor checks and wording in ``add_param_group`` and again
  at every ``step`` (torch checks only the constructor's values, so a group added or edited later with
  betas=(1.0, 0.999) gives nan params there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _ops, amp
from ._checks import check_like, is_dense

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Group keys that torch's Adam does not have; a torch state_dict loaded into fastops keeps the current value.
_FASTOPS_KEYS = ("master_weights", "max_grad_norm")
_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _local(t: Tensor) -> Tensor:
    # FSDP2 shards are DTensors; the kernel updates their local shard, as torch's fused path does.
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _check_param(p: Tensor, i: int, cls: str) -> None:
    # Before anything that asks for strides: a sparse CSR tensor raises on is_contiguous() itself.
    if p.layout != torch.strided:
        raise ValueError(f"{cls} does not support sparse params (param {i} has layout {p.layout})")
    if p.is_complex():
        raise ValueError(f"{cls} does not support complex params (param {i} has dtype {p.dtype})")
    if p.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{cls} supports float32, bfloat16 and float16 params; param {i} has dtype {p.dtype}")
    local = _local(p)
    if not is_dense(local):
        raise ValueError(
            f"{cls}: param {i} (shape {tuple(p.shape)}, strides {local.stride()}) is not contiguous; "
            "its memory has gaps or overlaps, which the fused kernel cannot update in place"
        )


def _check_group_params(params: list[Tensor], cls: str) -> None:
    """Every param of one group as the fused kernel takes it: dense, float, all on one device."""
    for i, p in enumerate(params):
        _check_param(p, i, cls)
        if p.device != params[0].device:
            raise ValueError(
                f"{cls}: all params of a group must be on one device; param {i} is on {p.device} "
                f"but param 0 is on {params[0].device}"
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


def _to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. A copy to an accelerator is queued (non_blocking, no host sync); a copy to the CPU
    waits, since the CPU kernels read the value on the host as soon as they start."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


# (group key, what torch's constructor calls it). The messages are torch.optim.Adam's constructor's, so a bad
# value fails the same way whether it came through the constructor, add_param_group or an edit between steps.
_NONNEGATIVE = (
    ("lr", "learning rate"),
    ("eps", "epsilon value"),
    ("weight_decay", "weight_decay value"),
    ("max_grad_norm", "max_grad_norm value"),
)


def _where(k: int | None) -> str:
    return "" if k is None else f" (param_groups[{k}])"


def _check_scalars(group: dict[str, Any], k: int | None, read_device: bool) -> None:
    """lr, eps, weight_decay and max_grad_norm must be >= 0 (nan fails). ``k``: the group's index, named in the
    message when the check runs at a step. ``read_device``: also read tensors on an accelerator, a host sync
    (add_param_group does; step() does not, and leaves a GPU lr to the checks made when its group was added)."""
    for key, what in _NONNEGATIVE:
        v = group.get(key)
        if v is None and key == "max_grad_norm":  # no clipping (or the constructor has not set the key yet)
            continue
        value = v
        if isinstance(v, Tensor):
            if v.numel() != 1:
                raise ValueError(f"Tensor {key} must be 1-element{_where(k)}")
            if (v.device.type != "cpu" and not read_device) or torch.compiler.is_compiling():
                continue
            value = v.item()
        if not 0.0 <= value:
            raise ValueError(f"Invalid {what}: {v}{_where(k)}")


def _checked_betas(group: dict[str, Any], k: int | None) -> tuple[float, float]:
    """The group's betas as Python floats, checked to lie in [0, 1) as torch's constructor does. The op takes
    float betas (as torch's fused kernels do), so a Tensor beta on a GPU costs a host sync per step."""
    out = []
    for i, b in enumerate(group["betas"]):
        if isinstance(b, Tensor):
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element{_where(k)}")
            b = b.item()
        # beta = 1 makes the bias correction 1 - 1**t = 0: nan params. torch 2.13's constructor has the same
        # rule; it takes Tensor betas unless foreach=True and capturable=False, and its fused kernels read
        # them as floats too, with .item() at every step.
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}{_where(k)}")
        out.append(float(b))
    return out[0], out[1]


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
        try:
            # torch's add_param_group checks no hyperparameter (its constructor checks only the defaults).
            _check_scalars(group, None, read_device=True)
            _checked_betas(group, None)
            cls = f"fastops.optim.{type(self).__name__}"
            _check_group_params(group["params"], cls)
            _check_no_overlap([p for g in self.param_groups for p in g["params"]], cls)
        except ValueError:
            self.param_groups.pop()  # a group that raised is not half-added
            raise

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
        """Puts each (param, saved state) of ``self._fastops_loading`` into fastops' layout: fp32 moments and
        master, a float32 step on the param's device. fastops.accelerate calls it to convert torch's own state."""
        for p, saved in self.__dict__.pop("_fastops_loading", []):
            if not saved:
                continue
            state = self.state[p]
            for key in _STATE_TENSORS:
                if key in saved:
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32)
            master = state.get("master_param")
            if master is not None and not _same_bits(_local(master).to(p.dtype), _local(p)):
                # torch.optim keeps the unknown key but never updates it: a master that no longer rounds to the
                # param is from before steps taken elsewhere, and stepping it would undo them.
                state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
            if "step" in saved:
                step = saved["step"]
                step = step if isinstance(step, Tensor) else torch.tensor(float(step))
                state["step"] = step.to(device=_local(p).device, dtype=torch.float32)

    def _fastops_group(self, group: dict[str, Any], k: int):
        """Per param group: the op's tensor lists, split by whether a param has an fp32 master."""
        plain = ([], [], [], [], [], [], [])
        mastered = ([], [], [], [], [], [], [])
        amsgrad = group["amsgrad"]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            grad = p.grad
            if grad.is_sparse:  # (a grad of another sparse layout cannot be assigned to a strided param)
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            lp, lg = _local(p), _local(grad)
            if lg.stride() != lp.stride() and lg.numel() > 1:
                # The kernel walks grad and param memory in lockstep; a grad laid out differently is copied. The copy
                # would broadcast or cast a grad that no longer matches its param (kept from before p.data was
                # reassigned), so that is checked first; grads that are not copied are checked by the op itself.
                where = f"fastops.optim.{type(self).__name__}: in param_groups[{k}], "
                check_like(lg, lp, f"grads[{i}]", f"params[{i}]", None, prefix=where, strides=False)
                lg = torch.empty_like(lp).copy_(lg)
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=lp.device)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            use_master = group["master_weights"] and p.dtype != torch.float32
            if use_master and "master_param" not in state:
                state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
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

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return _local(p).device
        return torch.device("cpu")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by a GradScaler (torch's or fastops') for optimizers with _step_supports_amp_scaling.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # Every group is checked before anything changes: a bad value raises with nothing half-updated.
        betas = []
        for k, group in enumerate(self.param_groups):
            _check_scalars(group, k, read_device=False)
            betas.append(_checked_betas(group, k))
        work = []
        for k, group in enumerate(self.param_groups):
            calls = self._fastops_group(group, k)
            if calls:
                work.append((group, betas[k], calls))
        device0 = self._first_device()  # where step_was_skipped lives
        clipping = any(group["max_grad_norm"] is not None for group, _, _ in work)
        norm = None
        if work and (clipping or (grad_scale is not None and found_inf is None)):
            # One read of every grad gives the norm and the inf/nan flag; no host sync.
            # Unscaled inside the read, before squaring: scaled fp32 grads above 1.8e19 would square to inf.
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            stats = amp.grad_stats([g for _, _, calls in work for lists in calls for g in lists[1]], inv_scale)
            if self.reduce_grad_stats is not None:
                stats = self.reduce_grad_stats(stats)
            if found_inf is None:
                found_inf = stats[2] if grad_scale is not None else None
            norm = stats[0].sqrt()
        self.last_grad_norm = norm
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # torch's GradScaler hands over sum([]) == 0 when no param has a grad.
            found_inf = torch.full((), float(found_inf), device=device0)
        if found_inf is None:
            self.step_was_skipped = torch.zeros((), dtype=torch.bool, device=device0)
        else:
            self.step_was_skipped = _to(found_inf, device0) != 0
        for group, (beta1, beta2), calls in work:
            # Every scalar is brought to this group's device: with model parallelism the scaler's scale, the
            # grad norm (first grads' device) and this group's params can sit on three different GPUs.
            device = calls[0][0][0].device
            lr = group["lr"]
            if isinstance(lr, Tensor):
                # A CPU lr is read on the host by every backend, so it stays there.
                lr_t = lr if lr.device.type == "cpu" else _to(lr, device)
            else:
                lr_t = torch.tensor(lr, dtype=torch.float64)
            divisor = None if grad_scale is None else _to(grad_scale, device)
            max_norm = group["max_grad_norm"]
            if max_norm is not None:
                # grads / (scale / coef): unscale and clip folded into the step, grads never written.
                max_norm = _to(max_norm, device) if isinstance(max_norm, Tensor) else max_norm
                coef = amp.clip_coef(_to(norm, device), max_norm)
                divisor = 1.0 / coef if divisor is None else divisor / coef
            fi = None if found_inf is None else _to(found_inf, device)
            for params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters in calls:
                _ops.adam_step_(
                    params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters, lr_t,
                    beta1, beta2, float(group["eps"]), float(group["weight_decay"]),
                    bool(group["amsgrad"]), bool(group["maximize"]), bool(group["decoupled_weight_decay"]),
                    divisor, fi,
                )  # fmt: skip
        return loss


class Adam(_FusedAdamMixin, torch.optim.Adam):
    """torch.optim.Adam with a fused fastops step. Same arguments, plus ``master_weights``: keep an fp32
    copy of bf16/fp16 params in the optimizer state, update it, and write the rounded param in the same pass;
    and ``max_grad_norm``: clip the grads' total 2-norm to it inside the step, with no pass of its own.

    After each ``step()``:

    - ``step_was_skipped``: a bool tensor on the device of the optimizer's first param, True when a GradScaler
      found inf/nan and the step changed nothing; always a tensor, so only reading it syncs.
    - ``last_grad_norm``: the total 2-norm of the unscaled grads (fp32, on the grads' device) when this step
      computed it (``max_grad_norm`` set, or a GradScaler handed over its scale without an ``unscale_``
      first), else None: never an earlier step's value.

    Hyperparameters are checked with torch's constructor checks and wording when a group is added and at
    every step (Python numbers and CPU tensors; a GPU lr only when its group is added, since reading it each
    step would sync). A Tensor beta is read on the host at every step, so in-place changes take effect at the
    next step; on a GPU that read is a sync (the kernels take float betas, as torch's fused kernels do).
    """

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
    """torch.optim.AdamW with a fused fastops step. Same arguments, plus ``master_weights`` and
    ``max_grad_norm``; ``step_was_skipped``, ``last_grad_norm`` and the hyperparameter checks as in Adam."""

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
