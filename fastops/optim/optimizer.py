"""The step that Adam, AdamW and SGD share: hyperparameter checks, the grad norm, the GradScaler hand-over, the
clip, the skip flag, and the hand-off of groups the kernels do not take to torch's step.

Two hooks connect it to the layers above, both set per instance and read at every step:

- ``grad_scale`` / ``found_inf``: set by a GradScaler around ``step()`` (torch's for ``fused=True`` instances,
  fastops' for every instance, see fastops/amp.py); the step divides by the scale inside the op and skips itself
  on the device when inf/nan is found. amp recognizes an optimizer that takes them by ``takes_grad_scale``.
- ``grad_stats_fn``: the one way to hand the step a global grad norm. None (the default) is
  ``fastops._grads.grad_stats``: the statistics of the grads this process holds. Set it where grads are sharded
  over processes, so that the clip and the skip decision agree on every rank: fastops.accelerate sets it under
  FSDP2 (``fastops.accelerate._distributed.fsdp_grad_stats``, an all-reduce), ``fastops.accelerate._parallel.
  global_grad_stats`` under TP/PP (a replicated grad counts once), a user with their own sharding sets their own.
  Called once per step that needs the norm (``max_grad_norm`` set, or a GradScaler handed over its scale without
  an ``unscale_`` first) as ``grad_stats_fn(grads, inv_scale)``: ``grads`` the local grads of the params the
  kernels step (plain tensors, the local shards of DTensor grads, on any devices), ``inv_scale`` None or a
  1-element float32 tensor (1 / the GradScaler's scale) to multiply them by before squaring. It returns a
  3-element float32 tensor ``[sum of squares, max |g|, found_inf (0 or 1)]`` of the unscaled grads over all
  ranks, on any device, without a host sync (the step stays sync-free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _grads
from .._checks import check_like
from . import _fallback, _master, _state
from ._fallback import _check_no_overlap, _kernels_take, _local, _to


@dataclass(slots=True)
class Call:
    """One call of a step op: the tensor lists it takes, in the params' order. Subclasses add their state lists."""

    params: list[Tensor] = field(default_factory=list)  # local tensors (the shard of a DTensor param)
    grads: list[Tensor] = field(default_factory=list)  # local grads, laid out like their params
    masters: list[Tensor] = field(default_factory=list)  # fp32 masters (empty: the call has none)
    owners: list[Tensor] = field(default_factory=list)  # the params themselves: the keys of self.state


def _where(k: int | None) -> str:
    return "" if k is None else f" (param_groups[{k}])"


def _check_scalars(group: dict[str, Any], k: int | None, read_device: bool, keys) -> None:
    """Each of ``keys`` ((group key, torch's name for it)) must be >= 0 (nan fails). ``k``: the group's index,
    named in the message when the check runs at a step. ``read_device``: also read tensors on an accelerator, a
    host sync (add_param_group does; step() does not, and leaves a GPU lr to the checks made when its group was
    added)."""
    for key, what in keys:
        v = group.get(key)
        if v is None and key == "max_grad_norm":  # no clipping (or the constructor has not set the key yet)
            continue
        value = v
        if isinstance(v, Tensor):
            if v.numel() != 1:
                raise ValueError(f"Tensor {key} must be 1-element{_where(k)}")
            if not v.is_floating_point():
                # torch has no rule here; its fused kernels and fastops' read lr as a float, and an integer lr
                # would fail only at the first step, deep inside the op.
                raise ValueError(f"Tensor {key} must be a floating-point tensor, got {v.dtype}{_where(k)}")
            if (v.device.type != "cpu" and not read_device) or torch.compiler.is_compiling():
                continue
            value = v.item()
        if not 0.0 <= value:
            raise ValueError(f"Invalid {what}: {v}{_where(k)}")


class _Fused:
    """What Adam, AdamW and SGD share: the fastops group keys, hyperparameter checks, the state layout (fp32 on
    the param's device) and its conversion on load, master weights, and the step (grad norm, clip, GradScaler
    hand-off, skip flag, torch fallback). A subclass names its torch class (its last base) and defines
    ``_check_group`` (per-step hyperparameters), ``_group_calls`` (its ``Call`` records) and ``_launch``."""

    # Read by fastops.amp.GradScaler: this optimizer takes the scale (grad_scale/found_inf) instead of having its
    # grads unscaled first. _step_supports_amp_scaling, which torch's GradScaler and Lightning read, is torch's
    # own: set by torch's constructor on fused=True instances only (Lightning refuses to clip for optimizers that
    # have it, and torch's scaler then calls step() on skipped steps too), so a fastops optimizer looks to both
    # exactly like torch's with the same arguments.
    takes_grad_scale = True
    _nonnegative: tuple[tuple[str, str], ...] = ()  # (group key, torch's constructor's name for it)
    # Set per instance by the layers above; see the module docstring.
    grad_stats_fn = None

    def _fastops_init(
        self, master_weights: bool, max_grad_norm: float | None, state_dtype: str = "fp32", state_seed: int = 0
    ) -> None:
        if max_grad_norm is not None and not 0.0 <= max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        extra = {"master_weights": bool(master_weights), "max_grad_norm": max_grad_norm}
        # Only what differs from fp32 / seed 0 is stored, so fp32 groups and state_dicts keep their keys.
        if state_dtype != "fp32":
            extra["state_dtype"] = state_dtype
        if state_dtype != "fp32" or state_seed != 0:
            extra["state_seed"] = state_seed
        self.defaults.update(extra)
        for k, group in enumerate(self.param_groups):
            for key, v in extra.items():
                group.setdefault(key, v)
            if any(key in group for key in _state._LOWP_KEYS):
                # The constructor's groups were added before the keys were known; the per-group keys are checked
                # here (amsgrad with 8-bit states, an unknown state_dtype).
                self._check_group(group, k, read_device=True)
        self.register_load_state_dict_pre_hook(_state.load_pre_hook)
        self.register_load_state_dict_post_hook(_state.load_post_hook)
        self.register_state_dict_post_hook(_state.state_dict_post_hook)
        self._init_flags()

    def _init_flags(self) -> None:
        # Created here, eagerly, and only ever written in place: attributes assigned inside a torch.compile'd step
        # do not survive it, tensor mutations do.
        device = self._first_device()
        self.step_was_skipped = torch.zeros((), dtype=torch.bool, device=device)
        self.last_grad_norm = torch.full((), math.nan, dtype=torch.float32, device=device)
        # param -> its _version right after the step last wrote it from its master (see _master.py).
        self._written_versions: dict[Tensor, int] = {}
        # Steps that drew stochastic-rounding bits for bf16 states (see adam.py's _sr_seed). On the CPU whatever
        # the params' device, so reading it is no device sync; an int64 tensor so that a compiled step reads it
        # as a graph input instead of baking it in.
        self._sr_step = torch.zeros((), dtype=torch.int64)

    @property
    def _torch_class(self) -> type:
        """torch's class this one drops in for (also under a user's subclass of a fastops class)."""
        return next(c for c in type(self).__mro__ if issubclass(c, torch.optim.Optimizer) and not issubclass(c, _Fused))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        group = self.param_groups[-1]
        try:
            # torch's add_param_group checks no hyperparameter (its constructor checks only the defaults).
            self._check_group(group, None, read_device=True)
            cls = f"fastops.optim.{type(self).__name__}"
            _check_no_overlap([p for g in self.param_groups for p in g["params"]], cls)
        except ValueError:
            self.param_groups.pop()  # a group that raised is not half-added
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        for group in self.param_groups:
            group.setdefault("master_weights", False)
            group.setdefault("max_grad_norm", None)
        self._init_flags()

    def to_fp32_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with every exp_avg/exp_avg_sq decoded to fp32 (their absmax dropped) and without the
        state-format keys: the state_dict an fp32 fastops optimizer would have saved, which torch.optim.Adam/AdamW
        load as their own. The optimizer's own states are not changed."""
        return _state.to_fp32_state_dict(self.state_dict())

    def _master(self, p: Tensor, state: dict[str, Any]) -> Tensor:
        return _master.master(self._written_versions, p, state)

    def _wrote(self, params: list[Tensor]) -> None:
        _master.wrote(self._written_versions, params)

    def _grad(self, p: Tensor, i: int, k: int) -> Tensor:
        """The local grad of ``p``, in its param's memory layout, which the kernel walks in lockstep."""
        lp, lg = _local(p), _local(p.grad)
        if lg.stride() != lp.stride() and lg.numel() > 1:
            # A grad laid out differently is copied. The copy would broadcast or cast a grad that no longer matches
            # its param (kept from before p.data was reassigned), so that is checked first; grads that are not
            # copied are checked by the op itself.
            where = f"fastops.optim.{type(self).__name__}: in param_groups[{k}], "
            check_like(lg, lp, f"grads[{i}]", f"params[{i}]", None, prefix=where, strides=False)
            lg = torch.empty_like(lp).copy_(lg)
        return lg

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return _local(p).device
        return torch.device("cpu")

    def _sr_base(self, work) -> Any:
        return None  # only Adam's bf16 states round stochastically (see adam.py)

    def _norm_and_found_inf(self, work, by_torch, grad_scale: Tensor | None, found_inf):
        """This step's total grad norm (None when nothing needs it) and skip flag (None: no GradScaler). Grads of
        groups torch's step serves are unscaled in place here (see fastops/optim/_fallback.py)."""
        device0 = self.step_was_skipped.device
        handed = found_inf  # by torch's GradScaler (every grad checked), or after an unscale_ (either scaler)
        if handed is not None and not isinstance(handed, Tensor):
            # torch's GradScaler hands over sum([]) == 0 when no param has a grad.
            handed = found_inf = torch.full((), float(handed), device=device0)
        torch_grads = [p.grad for g in by_torch for p in g["params"] if p.grad is not None]
        clipping = any(group["max_grad_norm"] is not None for group in [w[0] for w in work] + by_torch)
        squares = None
        if work and (clipping or (grad_scale is not None and handed is None)):
            # One read of every grad gives the norm and the inf/nan flag; no host sync.
            # Unscaled inside the read, before squaring: scaled fp32 grads above 1.8e19 would square to inf.
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            grads = [g for _, _, calls in work for call in calls for g in call.grads]
            sharded = any(_state._is_dtensor(p) for group, _, _ in work for p in group["params"])
            if self.grad_stats_fn is None and sharded:
                # The kernels see local shards: the norm and inf flag would be this rank's, a clip differing per
                # rank (measured under fully_shard at 2 ranks: 0.338 against the true 0.474).
                raise RuntimeError(
                    f"fastops.optim.{type(self).__name__}: max_grad_norm or a GradScaler with DTensor params (FSDP2 "
                    "shards, TP) needs the global grad norm, but grad_stats_fn is not set, so each rank would clip by "
                    "its own shard's norm. Use fastops.accelerate, which sets it, or set opt.grad_stats_fn to a "
                    "function of (grads, inv_scale) that returns the all-reduced [sum of squares, max |g|, found_inf] "
                    "(fastops.accelerate._distributed.fsdp_grad_stats for FSDP2 alone; see fastops/optim/optimizer.py)"
                )
            stats = (self.grad_stats_fn or _grads.grad_stats)(grads, inv_scale)
            if grad_scale is not None and handed is None:
                found_inf = stats[2]
            squares = stats[0]
        if torch_grads and grad_scale is not None:
            torch_found = _fallback.unscale_for_torch(by_torch, grad_scale, device0)
            if handed is None:
                found_inf = torch_found if found_inf is None else torch.maximum(_to(found_inf, device0), torch_found)
        if torch_grads and (clipping or squares is not None):
            # torch's own norm of the grads it serves (float64, complex, sparse), unscaled above.
            torch_squares = torch.nn.utils.get_total_norm(torch_grads, 2.0).float().square()
            squares = torch_squares if squares is None else squares + _to(torch_squares, squares.device)
        return (None if squares is None else squares.sqrt()), found_inf

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by fastops' GradScaler (see amp.GradScaler.step), or torch's for fused=True instances.
        grad_scale = getattr(self, "grad_scale", None)
        # Every group is checked before anything changes: a bad value raises with nothing half-updated.
        hypers = [self._check_group(group, k, read_device=False) for k, group in enumerate(self.param_groups)]
        work, by_torch = [], []
        for k, group in enumerate(self.param_groups):
            if not any(p.grad is not None for p in group["params"]):
                continue
            if not _kernels_take(group):
                by_torch.append(group)
                continue
            calls = self._group_calls(group, k)
            if calls:
                work.append((group, hypers[k], calls))
        norm, found_inf = self._norm_and_found_inf(work, by_torch, grad_scale, getattr(self, "found_inf", None))
        if norm is None:
            self.last_grad_norm.fill_(math.nan)
        else:
            self.last_grad_norm.copy_(norm)
        if found_inf is None:
            self.step_was_skipped.fill_(False)
        else:
            self.step_was_skipped.copy_(_to(found_inf, self.step_was_skipped.device) != 0)
        sr_base = self._sr_base(work)
        index = {id(group): k for k, group in enumerate(self.param_groups)}
        for group, hyper, calls in work:
            # Every scalar is brought to this group's device: with model parallelism the scaler's scale, the
            # grad norm (first grads' device) and this group's params can sit on three different GPUs.
            device = calls[0].params[0].device
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
                coef = _grads.clip_coef(_to(norm, device), max_norm)
                divisor = 1.0 / coef if divisor is None else divisor / coef
            fi = None if found_inf is None else _to(found_inf, device)
            for call in calls:
                self._launch(group, hyper, call, lr_t, divisor, fi, sr=(sr_base, index[id(group)]))
        if by_torch and not (found_inf is not None and bool(found_inf)):  # a host read, see _fallback.py
            for group in by_torch:
                if group["max_grad_norm"] is not None:
                    torch.nn.utils.clip_grads_with_norm_(group["params"], group["max_grad_norm"], norm)
            for group in by_torch:
                # torch's step would find uint8 codes or bf16 moments and compute with them as if they were fp32
                # (or fail on the dtype): the group's states go to fp32 first; the next fused step converts them
                # back to the group's state_dtype.
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and "exp_avg" in state and _state._moment_format(state) != "fp32":
                        _state._convert_moments(state, "fp32", p)
            _fallback.torch_step(self, self._torch_class, by_torch)
        return loss


_EXTRAS_DOC = """

    After each ``step()``, both tensors on the device of the optimizer's first param, created with the optimizer
    and updated in place (so they stay right when the step is ``torch.compile``d; ``.clone()`` one to keep it):

    - ``step_was_skipped``: bool, True when a GradScaler found inf/nan and the step changed nothing; only
      reading it syncs.
    - ``last_grad_norm``: float32, the total 2-norm of the unscaled grads when this step computed it
      (``max_grad_norm`` set, or a GradScaler handed over its scale without an ``unscale_`` first), else nan:
      never an earlier step's value.

    Both describe the last ``step()`` call: torch's GradScaler skips a non-fused optimizer by not calling it, so
    there they keep the last real step's values (fastops' GradScaler sets them for a step it does not call).

    Hyperparameters are checked with torch's constructor checks and wording when a group is added and at
    every step (Python numbers and CPU tensors; a GPU lr only when its group is added, since reading it each
    step would sync); a Tensor lr must be floating point. Groups the kernels do not take (float64 or complex
    params, ``differentiable=True``, sparse grads, ...) run torch's own step: see ``fastops.optim``'s docstring.
    ``grad_stats_fn`` hands the step a global grad norm: see fastops/optim/optimizer.py."""
