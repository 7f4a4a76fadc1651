"""Drop-in fused Adam, AdamW and SGD.

``fastops.optim.Adam``/``AdamW``/``SGD`` subclass torch's classes, so ``isinstance`` checks, LR schedulers and
``torch.amp.GradScaler`` treat them as torch's own. They keep torch's constructor signature, defaults,
param_groups and state_dict format, and add two keywords, ``master_weights`` and ``max_grad_norm``. Each step is
one call of ``torch.ops.fastops.adam_step_`` / ``sgd_step_`` per param group (a few when some params need an fp32
master copy, or, for SGD, start their momentum buffer at this step).

Where they differ from torch on purpose (the README lists these too):
- optimizer states are fp32 for every param dtype (torch keeps bf16/fp16 states for bf16/fp16 params);
- grads are never written (torch's fused kernels leave the unscaled grad behind when a GradScaler is
  used; reading the grad after ``scaler.step`` gives the scaled grad here);
- ``foreach`` and ``fused`` are accepted and stored but ignored: the fastops kernel always runs;
- hyperparameters are checked with torch's constructor checks and wording in ``add_param_group`` and again
  at every ``step`` (torch checks only the constructor's values, so a group added or edited later with
  betas=(1.0, 0.999) gives nan params there).

Param groups the kernels do not take run torch's own step, so every script torch runs keeps running after
``fastops.patch()``. The choice is per param group and per step: a group goes to torch when it has
``differentiable=True``, or any of its params is not float32/bfloat16/float16, is complex, sparse, strided with
gaps, on a device fastops does not serve, or on another device than the group's first param, or has a sparse
grad at this step (torch's SGD takes it; torch's Adam raises its own error). Such a group gets torch's results
exactly (torch's code, torch's state layout); ``master_weights`` does not apply to it, ``max_grad_norm`` does (its
grads count in the norm and are clipped in place first, as ``clip_grad_norm_`` would). Under a GradScaler its
grads are unscaled in place first, as torch's GradScaler does for torch's optimizers, and the skip decision is
read on the host (one sync per step, which torch's GradScaler also takes for those optimizers).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Any

import torch
from torch import Tensor

from . import _backend, _ops, _quant, amp
from ._checks import FLOAT_DTYPES, check_like, is_dense

# Group keys that torch's optimizers do not have; a torch state_dict loaded into fastops keeps the current value.
_FASTOPS_KEYS = ("master_weights", "max_grad_norm")
# Adam's group keys of the state format. Present in a group only when not fp32 (state_seed: when state_dtype is
# not fp32 or the seed is not 0), so an fp32 state_dict is the one fastops wrote before these existed. They
# describe this optimizer, not a checkpoint: load_state_dict keeps the current values and converts the states.
_LOWP_KEYS = ("state_dtype", "state_seed")
# Saved in bf16 groups of a state_dict only: the count of steps that drew stochastic-rounding bits (see _sr_seed).
_SR_STEP_KEY = "state_sr_step"
STATE_DTYPES = ("fp32", "bf16", "8bit")
# State tensors that fastops keeps in fp32 on the param's device (exp_avg and exp_avg_sq: unless the group's
# state_dtype says otherwise, see _convert_moments).
_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "master_param")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_ABSMAX = ("exp_avg_absmax", "exp_avg_sq_absmax")
# Odd 31-bit constants spreading the step count and the call's salt over the 32 seed bits the op uses; < 2**31 so
# that (count mod 2**32) * constant stays inside int64 under torch.compile, where the count is a SymInt.
_SEED_STEP_MUL = 0x61C88647
_SEED_SALT_MUL = 0x2545F491


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
    """Whether the fused step serves this group now (else torch's step does; see the module docstring): every
    param passes ``_why_not``, all on one device, and dense grads. Asked at every step (grads can turn sparse), so it
    makes no torch.device objects and no messages, and complex dtypes fail the dtype test: 0.7 ms for 300 params
    on the 2-core development machine, against 1.7 ms for building the op's lists of the same group."""
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


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def _fp32_zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "_local_tensor")


def _like_param(t: Tensor, p: Tensor) -> Tensor:
    """A local state ``t`` of a DTensor param ``p`` as a DTensor with ``p``'s mesh and placements (``t`` itself for
    a plain param), so DCP saves it by its global offsets and reshards it to any other layout."""
    if not _is_dtensor(p) or _is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _state_format(group: dict[str, Any], p: Tensor) -> str:
    """The format of ``p``'s exp_avg and exp_avg_sq in ``group``: its state_dtype, except that 8-bit keeps fp32
    states for params under MIN_8BIT_NUMEL elements (counted over the whole param, so every rank of a sharded
    param agrees)."""
    fmt = group.get("state_dtype", "fp32")
    if fmt == "8bit" and p.numel() < _quant.MIN_8BIT_NUMEL:
        return "fp32"
    return fmt


def _moment_format(state: dict[str, Any]) -> str:
    """The format the moments in ``state`` are stored in, read from their dtype (uint8: 8-bit, bf16, else fp32)."""
    dtype = state["exp_avg"].dtype
    return "8bit" if dtype == torch.uint8 else "bf16" if dtype == torch.bfloat16 else "fp32"


def moments_fp32(state: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """``state``'s exp_avg and exp_avg_sq as fp32 tensors (decoded from 8-bit codes and their absmax, or widened
    from bf16), laid out like the stored ones; the stored fp32 tensors themselves when they are fp32."""
    fmt = _moment_format(state)
    out = []
    for key, absmax, signed in zip(_MOMENTS, _ABSMAX, (True, False)):
        t = state[key]
        if fmt == "8bit":
            if absmax not in state:
                raise RuntimeError(f"fastops: an 8-bit {key} (uint8 codes) needs its {absmax} in the same state")
            t = _quant.dequantize(_local(t), _local(state[absmax]), signed)
        elif t.dtype != torch.float32:
            t = _local(t).float()
        out.append(t)
    return out[0], out[1]


def _convert_moments(state: dict[str, Any], fmt: str, p: Tensor) -> None:
    """Stores ``state``'s moments in ``fmt`` on ``p``'s device, whatever format they are in. Converting to bf16
    rounds to nearest (a load is a one-off, not a step: no stochastic rounding needed to stay unbiased)."""
    if "exp_avg" not in state:
        return
    current = _moment_format(state)
    device = _local(p).device
    if current == fmt and state["exp_avg"].device == device:
        return
    # Local shards from here on: a DTensor param's 8-bit codes are plain per-shard tensors (blocks of 256 inside
    # the local shard), its fp32/bf16 states DTensors like the param.
    m, v = (_local(t).to(device) for t in moments_fp32(state))
    for key in _ABSMAX:
        state.pop(key, None)
    if fmt == "fp32":
        state["exp_avg"], state["exp_avg_sq"] = _like_param(m, p), _like_param(v, p)
    elif fmt == "bf16":
        state["exp_avg"], state["exp_avg_sq"] = (_like_param(t.to(torch.bfloat16), p) for t in (m, v))
    else:
        for key, absmax, t, signed in zip(_MOMENTS, _ABSMAX, (m, v), (True, False)):
            state[key], state[absmax] = _quant.quantize(t, signed)


def _new_moments(state: dict[str, Any], fmt: str, p: Tensor) -> None:
    """Zero moments for ``p`` in ``fmt``: 8-bit zeros are code 0 with absmax 0 (0 * 0 decodes to 0)."""
    local = _local(p)
    if fmt == "8bit":
        for key, absmax in zip(_MOMENTS, _ABSMAX):
            state[key] = torch.zeros_like(local, dtype=torch.uint8, memory_format=torch.preserve_format)
            state[absmax] = torch.zeros(_quant.n_blocks(local.numel()), dtype=torch.float32, device=local.device)
    else:
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        for key in _MOMENTS:
            state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


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


def _check_betas_len(betas, k: int | None = None) -> None:
    # torch's constructor keeps betas[:2] of a longer tuple and its step fails to unpack one in a group.
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {len(betas)} elements: {tuple(betas)}{_where(k)}")


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


class _Fused:
    """What Adam, AdamW and SGD share: the fastops group keys, hyperparameter checks, the state layout (fp32 on
    the param's device) and its conversion on load, master weights, and the step (grad norm, clip, GradScaler
    hand-off, skip flag, torch fallback). A subclass names its torch class (its last base) and defines
    ``_check_group`` (per-step hyperparameters), ``_group_calls`` (the op's tensor lists) and ``_launch``."""

    # fastops.amp.GradScaler hands this optimizer the scale instead of unscaling first. _step_supports_amp_scaling,
    # which torch's GradScaler and Lightning read, is torch's own: set by torch's constructor on fused=True
    # instances only (Lightning refuses to clip for optimizers that have it, and torch's scaler then calls step()
    # on skipped steps too), so a fastops optimizer looks to both exactly like torch's with the same arguments.
    _fastops_amp = True
    _nonnegative: tuple[tuple[str, str], ...] = ()  # (group key, torch's constructor's name for it)
    # Set per instance by fastops.accelerate when grads are sharded across ranks (FSDP2): maps this rank's
    # grad_stats to the global ones (an all-reduce), so the clip norm and the skip decision agree on all ranks.
    reduce_grad_stats = None
    # Set per instance by fastops._parallel under TP/PP: replaces amp.grad_stats with the mesh's global stats, in
    # which a grad replicated over ranks counts once.
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
            if any(key in group for key in _LOWP_KEYS):
                # The constructor's groups were added before the keys were known; the per-group keys are checked
                # here (amsgrad with 8-bit states, an unknown state_dtype).
                self._check_group(group, k, read_device=True)
        self.register_load_state_dict_pre_hook(_Fused._load_pre_hook)
        self.register_load_state_dict_post_hook(_Fused._load_post_hook)
        self.register_state_dict_post_hook(_Fused._state_dict_post_hook)
        self._init_flags()

    def _init_flags(self) -> None:
        # Created here, eagerly, and only ever written in place: attributes assigned inside a torch.compile'd step
        # do not survive it, tensor mutations do.
        device = self._first_device()
        self.step_was_skipped = torch.zeros((), dtype=torch.bool, device=device)
        self.last_grad_norm = torch.full((), math.nan, dtype=torch.float32, device=device)
        # param -> its _version right after the step last wrote it from its master (see _master).
        self._written_versions: dict[Tensor, int] = {}
        # Steps that drew stochastic-rounding bits for bf16 states (see _sr_seed). On the CPU whatever the params'
        # device, so reading it is no device sync; an int64 tensor so that a compiled step reads it as a graph
        # input instead of baking it in.
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

    # torch's load_state_dict casts every state tensor to the param's dtype; fastops keeps fp32 states and
    # fp32 masters for bf16/fp16 params, so the originals are kept aside here and restored afterwards.
    @staticmethod
    def _load_pre_hook(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self._fastops_loading = [(p, state_dict["state"].get(i)) for i, p in zip(saved_ids, params)]
        groups = []
        sr_steps = [0]
        for saved, current in zip(state_dict["param_groups"], self.param_groups):
            extra = {k: current[k] for k in _FASTOPS_KEYS if k not in saved}
            saved = {k: v for k, v in saved.items() if k not in _LOWP_KEYS and k != _SR_STEP_KEY}
            sr_steps.append(int(state_dict["param_groups"][len(groups)].get(_SR_STEP_KEY, 0)))
            # The state format is this optimizer's (the post hook converts the saved states to it).
            extra.update({k: current[k] for k in _LOWP_KEYS if k in current})
            groups.append({**saved, **extra})
        # Applied by the post hook: torch's load_state_dict calls __setstate__, which makes a new _sr_step.
        self._fastops_sr_loading = max(sr_steps)
        return {**state_dict, "param_groups": groups}

    @staticmethod
    def _state_dict_post_hook(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # 8-bit states of DTensor params (FSDP2 shards, TP) are saved decoded to fp32 DTensors with the param's
        # placements: codes are only meaningful with their block's absmax, and the 256-element blocks are cut
        # inside each local shard, so a resharded load would pair codes with another block's absmax. The load
        # re-encodes them in the loading optimizer's format on its own shards (README, "8-bit and bf16 Adam states").
        # torch's state_dict shares the per-param dicts with self.state: replaced, not edited.
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, params):
            st = state_dict["state"].get(i)
            if st is not None and _is_dtensor(p) and "exp_avg" in st and _moment_format(st) == "8bit":
                st = {k: v for k, v in st.items() if k not in _ABSMAX}
                m, v = moments_fp32(self.state[p])
                st["exp_avg"], st["exp_avg_sq"] = _like_param(m, p), _like_param(v, p)
                state_dict["state"][i] = st
        # The stochastic-rounding step count goes with the bf16 groups, so a resumed run draws the bits the
        # uninterrupted one would have (a host read of a CPU tensor: no device sync).
        if any(g.get("state_dtype") == "bf16" for g in state_dict["param_groups"]):
            n = int(self._sr_step)
            for g in state_dict["param_groups"]:
                if g.get("state_dtype") == "bf16":
                    g[_SR_STEP_KEY] = n
        return state_dict

    def to_fp32_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with every exp_avg/exp_avg_sq decoded to fp32 (their absmax dropped) and without the
        state-format keys: the state_dict an fp32 fastops optimizer would have saved, which torch.optim.Adam/AdamW
        load as their own. The optimizer's own states are not changed."""
        sd = self.state_dict()
        state = {}
        for i, st in sd["state"].items():
            st = dict(st)
            if "exp_avg" in st:
                st["exp_avg"], st["exp_avg_sq"] = moments_fp32(st)  # fp32 ones as they are, as torch's state_dict
                for key in _ABSMAX:
                    st.pop(key, None)
            state[i] = st
        groups = [{k: v for k, v in g.items() if k not in _LOWP_KEYS and k != _SR_STEP_KEY} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _load_post_hook(self) -> None:
        """Puts each (param, saved state) of ``self._fastops_loading`` into fastops' layout: fp32 states and
        master, a float32 step on the param's device. Params the kernels do not take keep torch's layout (their
        group runs torch's step). fastops.accelerate and ``fuse_`` call it to convert torch's own state."""
        loading = self.__dict__.pop("_fastops_loading", [])
        self._sr_step.fill_(self.__dict__.pop("_fastops_sr_loading", 0))
        if self.defaults.get("differentiable", False):  # every group runs torch's step
            return
        owner = {p: group for group in self.param_groups for p in group["params"]}
        for p, saved in loading:
            if not saved or _why_not(p) is not None:
                continue
            state = self.state[p]
            for key in _STATE_TENSORS:
                if saved.get(key) is not None and key not in _MOMENTS:
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32)
            if saved.get("exp_avg") is not None:
                # The moments as saved (8-bit codes, bf16 or fp32), then in this optimizer's format for p.
                for key in (*_MOMENTS, *_ABSMAX):
                    if saved.get(key) is not None:
                        state[key] = saved[key]
                    else:
                        state.pop(key, None)
                _convert_moments(state, _state_format(owner[p], p), p)
            master = state.get("master_param")
            if master is not None and not _same_bits(_local(master).to(p.dtype), _local(p)):
                # torch.optim keeps the unknown key but never updates it: a master that no longer rounds to the
                # param is from before steps taken elsewhere, and stepping it would undo them.
                state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
            if "step" in saved:
                step = saved["step"]
                step = step if isinstance(step, Tensor) else torch.tensor(float(step))
                state["step"] = step.to(device=_local(p).device, dtype=torch.float32)

    def _master(self, p: Tensor, state: dict[str, Any]) -> Tensor:
        """The fp32 master of a bf16/fp16 param, rebuilt from the param when the param was changed outside the
        optimizer since the step last wrote it (``p.fill_``, ``model.load_state_dict``, ``clamp_``, an EMA swap):
        torch keeps such edits, and stepping the old master would undo them. Seen through autograd's version
        counter, which every in-place op bumps, so a step without edits costs no extra pass; when it moved, the
        master is kept if it still rounds to the param (an EMA swapped back), else rebuilt (losing the bits below
        the param's precision, as a fresh master would). Edits through ``p.data`` bypass the version counter
        (``p.data.clamp_()`` is invisible to autograd too) and are not seen: edit under ``torch.no_grad()``."""
        lp = _local(p)
        master = state.get("master_param")
        if master is not None and self._written_versions.get(p) != lp._version:
            if not _same_bits(_local(master).to(p.dtype), lp):
                master = None
        if master is None:
            master = state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
        return _local(master)

    def _wrote(self, params: list[Tensor]) -> None:
        """Records the version counters the op left on params it wrote from their masters."""
        if torch.compiler.is_compiling():
            # Not traced; the stale entries make the next eager step compare bits once, which finds no edit.
            return
        for p in params:
            self._written_versions[p] = _local(p)._version

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
        return None  # only Adam's bf16 states round stochastically (see _AdamBase._sr_base)

    def _torch_step(self, groups: list[dict[str, Any]]) -> None:
        """torch's own step over ``groups`` only, without the step hooks (the fastops step that calls it runs
        them) and with grad_scale/found_inf hidden: the caller has unscaled the grads and decided the skip."""
        step = self._torch_class.step
        if getattr(step, "hooked", False):  # torch wrapped the class's step when its first instance was made
            step = step.__wrapped__
        everything = self.param_groups
        self.param_groups = groups
        try:
            with _hidden(self, ("grad_scale", "found_inf")):
                step(self)
        finally:
            self.param_groups = everything

    def _unscale_for_torch(self, groups, grad_scale: Tensor, device: torch.device) -> Tensor:
        """Unscales the grads of groups that torch's step serves, in place, as torch's GradScaler.unscale_
        would; returns their found_inf (float32, on ``device``)."""
        found = torch.zeros(1, device=device)
        inv_scale = grad_scale.double().reciprocal().float()
        params = [p for g in groups for p in g["params"]]
        per_device = amp.unscale_grads_(params, inv_scale, found, allow_fp16=True)
        for t in per_device.values():
            found = torch.maximum(found, _to(t, device))
        return found.reshape(())

    def _norm_and_found_inf(self, work, by_torch, grad_scale: Tensor | None, found_inf):
        """This step's total grad norm (None when nothing needs it) and skip flag (None: no GradScaler). Grads of
        groups torch's step serves are unscaled in place here (see the module docstring)."""
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
            grads = [g for _, _, calls in work for call in calls for g in call[1]]
            if (self.reduce_grad_stats is None and self.grad_stats_fn is None
                    and any(_is_dtensor(p) for group, _, _ in work for p in group["params"])):
                # The kernels see local shards: the norm and inf flag would be this rank's, a clip differing per
                # rank (measured under fully_shard at 2 ranks: 0.338 against the true 0.474).
                raise RuntimeError(
                    f"fastops.optim.{type(self).__name__}: max_grad_norm or a GradScaler with DTensor params (FSDP2 "
                    "shards, TP) needs the global grad norm, but neither reduce_grad_stats nor grad_stats_fn is set, "
                    "so each rank would clip by its own shard's norm. Use fastops.accelerate, which sets one, or set "
                    "opt.reduce_grad_stats to a function that all-reduces [sum of squares, max |g|, found_inf] "
                    "(fastops.accelerate._distributed.all_reduce_stats for FSDP2 alone)"
                )
            stats = (self.grad_stats_fn or amp.grad_stats)(grads, inv_scale)
            if self.reduce_grad_stats is not None:
                stats = self.reduce_grad_stats(stats)
            if grad_scale is not None and handed is None:
                found_inf = stats[2]
            squares = stats[0]
        if torch_grads and grad_scale is not None:
            torch_found = self._unscale_for_torch(by_torch, grad_scale, device0)
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
            for call in calls:
                self._launch(group, hyper, call, lr_t, divisor, fi, sr=(sr_base, index[id(group)]))
        if by_torch and not (found_inf is not None and bool(found_inf)):  # a host read, see the module docstring
            for group in by_torch:
                if group["max_grad_norm"] is not None:
                    torch.nn.utils.clip_grads_with_norm_(group["params"], group["max_grad_norm"], norm)
            for group in by_torch:
                # torch's step would find uint8 codes or bf16 moments and compute with them as if they were fp32
                # (or fail on the dtype): the group's states go to fp32 first; the next fused step converts them
                # back to the group's state_dtype.
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and "exp_avg" in state and _moment_format(state) != "fp32":
                        _convert_moments(state, "fp32", p)
            self._torch_step(by_torch)
        return loss


class _AdamBase(_Fused):
    _nonnegative = (
        ("lr", "learning rate"),
        ("eps", "epsilon value"),
        ("weight_decay", "weight_decay value"),
        ("max_grad_norm", "max_grad_norm value"),
    )

    def _check_group(self, group: dict[str, Any], k: int | None, read_device: bool) -> tuple[float, float]:
        """The messages are torch.optim.Adam's constructor's, so a bad value fails the same way whether it came
        through the constructor, add_param_group or an edit between steps. Returns the betas as Python floats,
        checked to lie in [0, 1) as torch's constructor does. The op takes float betas (as torch's fused kernels
        do), so a Tensor beta on a GPU costs a host sync per step."""
        _check_scalars(group, k, read_device, self._nonnegative)
        _check_betas_len(group["betas"], k)
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
        fmt = group.get("state_dtype", "fp32")
        if fmt not in STATE_DTYPES:
            raise ValueError(f"Invalid state_dtype: {fmt!r}; expected one of {STATE_DTYPES}{_where(k)}")
        if fmt != "fp32" and group["amsgrad"]:
            raise ValueError(
                f"amsgrad=True needs fp32 states: its max_exp_avg_sq has no {fmt} format; use state_dtype='fp32' "
                f"for this group{_where(k)}"
            )
        seed = group.get("state_seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"state_seed must be an int, got {type(seed).__name__}{_where(k)}")
        return out[0], out[1]

    def _group_calls(self, group: dict[str, Any], k: int):
        """The op's tensor lists, split by the format of the states (one call of adam_step_ for fp32 states, one of
        adam_step_lowp_ for each low-precision format) and by whether a param has an fp32 master. Each call is
        (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or exp_avg_absmax, [] or exp_avg_sq_absmax, steps,
        masters, owners, (format, mastered))."""
        calls: dict[tuple[str, bool], tuple] = {}
        amsgrad = group["amsgrad"]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            lg = self._grad(p, i, k)
            state = self.state[p]
            fmt = _state_format(group, p)
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                _new_moments(state, fmt, p)
            elif _moment_format(state) != fmt:
                # The group's state_dtype was changed between steps: the states follow it.
                _convert_moments(state, fmt, p)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = _fp32_zeros(p)
            use_master = group["master_weights"] and p.dtype != torch.float32
            key = (fmt, use_master)
            lists = calls.get(key)
            if lists is None:
                lists = calls[key] = ([], [], [], [], [], [], [], [], [], key)
            lists[0].append(_local(p))
            lists[1].append(lg)
            lists[2].append(_local(state["exp_avg"]))
            lists[3].append(_local(state["exp_avg_sq"]))
            if fmt == "8bit":
                lists[4].append(state["exp_avg_absmax"])
                lists[5].append(state["exp_avg_sq_absmax"])
            elif amsgrad:
                lists[4].append(_local(state["max_exp_avg_sq"]))
            lists[6].append(state["step"])
            if use_master:
                lists[7].append(self._master(p, state))
            lists[8].append(p)
        return [calls[key] for key in sorted(calls)]

    def _sr_base(self, work) -> Any:
        """This step's count of steps that drew stochastic-rounding bits (an int, or under torch.compile a SymInt
        read from ``_sr_step`` in the graph), advanced once per step; None when no call of this step has bf16
        states. Read at every step, skipped ones included (whether a GradScaler skips is known only on the
        device): a skipped step writes nothing, so it only moves the next step to other bits."""
        if not any(call[-1][0] == "bf16" for _, _, calls in work for call in calls):
            return None
        if torch.compiler.is_compiling():
            if not torch._dynamo.config.capture_scalar_outputs:
                # Dynamo would bake the count in as a constant and recompile at every step (measured: one frame
                # per step with the count on the optimizer as an int); frozen, every step would draw the same
                # bits, and stochastic rounding with the same bits each step is biased.
                raise RuntimeError(
                    "fastops.optim: bf16 states (state_dtype='bf16') draw new stochastic-rounding bits at every step "
                    "from a step count kept in a CPU tensor. Inside torch.compile that count must be read as a graph "
                    "input: set torch._dynamo.config.capture_scalar_outputs = True before compiling the step (without "
                    "fullgraph=True the step runs eagerly instead). 8-bit and fp32 states compile without it."
                )
            base = self._sr_step.remainder(2**32).item()
        else:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # A CUDA graph replays the seed it was captured with: every replay would draw the same bits.
                raise RuntimeError(
                    "fastops.optim: bf16 states (state_dtype='bf16') cannot be stepped inside CUDA-graph capture: the "
                    "stochastic-rounding seed changes every step and a graph would replay the captured one. Use "
                    "state_dtype='8bit' or 'fp32' for captured steps."
                )
            base = int(self._sr_step) % 2**32
        self._sr_step.add_(1)
        return base

    @staticmethod
    def _sr_seed(group: dict[str, Any], base: Any, k: int, mastered: bool) -> Any:
        """The op's seed for one call: the user's state_seed, this step's count and the call (group ``k``, with
        or without masters), so no two steps and no two calls of a step draw the same bits. Only the low 32 bits
        reach the op's hash; kept under 2**32 here with arithmetic a SymInt supports."""
        salt = (2 * k + int(mastered)) * _SEED_SALT_MUL + int(group.get("state_seed", 0))
        return (base * _SEED_STEP_MUL + salt) % 2**32

    def _launch(self, group, betas, call, lr_t, divisor, found_inf, sr=(None, 0)) -> None:
        params, grads, exp_avgs, exp_avg_sqs, extra1, extra2, steps, masters, owners, (fmt, mastered) = call
        eps, wd = float(group["eps"]), float(group["weight_decay"])
        maximize, decoupled = bool(group["maximize"]), bool(group["decoupled_weight_decay"])
        if fmt == "fp32":
            _ops.adam_step_(
                params, grads, exp_avgs, exp_avg_sqs, extra1, steps, masters, lr_t, betas[0], betas[1], eps, wd,
                bool(group["amsgrad"]), maximize, decoupled, divisor, found_inf,
            )  # fmt: skip
        else:
            seed = self._sr_seed(group, sr[0], sr[1], mastered) if fmt == "bf16" else 0  # 8-bit rounds to nearest
            _ops.adam_step_lowp_(
                params, grads, exp_avgs, exp_avg_sqs, extra1, extra2, steps, masters, lr_t, betas[0], betas[1], eps,
                wd, maximize, decoupled, seed, divisor, found_inf,
            )  # fmt: skip
        if masters:
            self._wrote(owners)


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
    params, ``differentiable=True``, sparse grads, ...) run torch's own step: see the module docstring."""


class Adam(_AdamBase, torch.optim.Adam):
    """torch.optim.Adam with a fused fastops step. Same arguments, plus ``master_weights``: keep an fp32
    copy of bf16/fp16 params in the optimizer state, update it, and write the rounded param in the same pass
    (edits of the param between steps are kept, see ``_master``); and ``max_grad_norm``: clip the grads' total
    2-norm to it inside the step, with no pass of its own. A Tensor beta is read on the host at every step, so
    in-place changes take effect at the next step; on a GPU that read is a sync.

    ``state_dtype``: how exp_avg and exp_avg_sq are stored, also a param-group key (a group
    ``{"params": embeddings, "state_dtype": "fp32"}`` excludes those params, as bitsandbytes' override_config):

    - ``"fp32"`` (default): torch's format; the state_dict has no fastops state keys.
    - ``"8bit"``: uint8 codes shaped like the param plus ``exp_avg_absmax``/``exp_avg_sq_absmax``, fp32, one per
      256 elements in memory order (bitsandbytes' dynamic maps, signed for exp_avg, unsigned for exp_avg_sq;
      fastops/_quant.py). Params under 4096 elements keep fp32 states. About 2.03 bytes a param instead of 8.
    - ``"bf16"``: bf16 states written with stochastic rounding; the bits come from ``state_seed``, the count of
      bf16 steps taken (saved in the state_dict) and the param's place in the step's call, so a run is
      deterministic for a seed on any backend and thread count. Under torch.compile the step count is read as a
      graph input, which needs ``torch._dynamo.config.capture_scalar_outputs = True`` (a clear error otherwise).

    amsgrad needs fp32 states. ``load_state_dict`` converts the saved states (any of the three formats, torch's
    included) to this optimizer's state_dtype, whose group keys it keeps; ``to_fp32_state_dict()`` exports the
    states in fp32 for torch.optim."""

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
        state_dtype: str = "fp32",
        state_seed: int = 0,
    ) -> None:
        _check_betas_len(betas)
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastops_init(master_weights, max_grad_norm, state_dtype, state_seed)


class AdamW(_AdamBase, torch.optim.AdamW):
    """torch.optim.AdamW with a fused fastops step. Same arguments, plus ``master_weights``, ``max_grad_norm``,
    ``state_dtype`` and ``state_seed`` as in Adam."""

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
        state_dtype: str = "fp32",
        state_seed: int = 0,
    ) -> None:
        _check_betas_len(betas)
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastops_init(master_weights, max_grad_norm, state_dtype, state_seed)


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
        """Calls of (params, grads, momentum_buffers, masters, owners, is_first_step), split by whether a param has
        an fp32 master and whether its buffer starts at this step (those buffers are made in ``_launch``)."""
        calls: dict[tuple[bool, bool], tuple] = {}
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
                call = calls[(use_master, first)] = ([], [], [], [], [], first)
            call[0].append(_local(p))
            call[1].append(lg)
            if buf is not None:
                call[2].append(_local(buf))
            if use_master:
                call[3].append(self._master(p, self.state[p]))
            call[4].append(p)
        return list(calls.values())

    def _launch(self, group, _, call, lr_t, divisor, found_inf, sr=None) -> None:
        params, grads, bufs, masters, owners, first = call
        dampening = float(group["dampening"])
        if first:
            if dampening != 0 and found_inf is not None and bool(found_inf):  # host read, see the class docstring
                return  # skipped: no buffer, so the next real step is these params' first
            for p in owners:
                self.state[p]["momentum_buffer"] = buf = _fp32_zeros(p)
                bufs.append(_local(buf))
        _ops.sgd_step_(
            params, grads, bufs, masters, lr_t, float(group["weight_decay"]), float(group["momentum"]), dampening,
            bool(group["nesterov"]), bool(group["maximize"]), first, divisor, found_inf,
        )  # fmt: skip
        if masters:
            self._wrote(owners)


for _cls in (Adam, AdamW, SGD):
    _cls.__doc__ += _EXTRAS_DOC

# torch's classes (exactly) -> fastops'. fastops.patch() rebinds the torch.optim names, not these bases.
_FUSABLE = {cls.__bases__[-1]: cls for cls in (AdamW, Adam, SGD)}


def _tracked_step(opt: torch.optim.Optimizer):
    """The instance step torch's LRScheduler installs (it sets ``_opt_called``, which its order check reads),
    around the optimizer's current class's step."""
    opt_ref = weakref.ref(opt)

    @functools.wraps(type(opt).step)
    def wrapper(*args, **kwargs):
        o = opt_ref()
        o._opt_called = True
        return type(o).step(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    return wrapper


def fuse_(opt: torch.optim.Optimizer) -> bool:
    """Turns a torch ``Adam``, ``AdamW`` or ``SGD`` (exactly those classes, not subclasses) into fastops' class in
    place and returns True: the same object with the same param_group dicts, state, hooks and step counts, so LR
    schedulers built on it keep driving it. Its states move to fastops' layout (fp32, on the param's device), as
    when a torch state_dict is loaded into a fastops optimizer; ``master_weights`` is off and ``max_grad_norm``
    None. Returns True, changing nothing, for an optimizer that already is fastops'. Returns False and leaves it
    as it was when fastops cannot take every group (another class, ``differentiable=True``, params that are not
    float32/bfloat16/float16, complex, sparse, strided with gaps, on several devices in a group, or overlapping)."""
    if isinstance(opt, _Fused):
        return True
    cls = _FUSABLE.get(type(opt))
    if cls is None or opt.defaults.get("differentiable", False):
        return False
    if not all(_kernels_take(group) for group in opt.param_groups):
        return False
    try:
        _check_no_overlap([p for g in opt.param_groups for p in g["params"]], "")
    except ValueError:
        return False
    torch_step = type(opt).step
    opt.__class__ = cls
    opt._fastops_init(master_weights=False, max_grad_norm=None)
    # torch wraps a class's step (step hooks, profiler) when the first instance is constructed; a class
    # assigned without a constructor call gets the same here.
    opt._patch_step_function()
    sched_step = opt.__dict__.get("step")
    if getattr(sched_step, "_wrapped_by_lr_sched", False) and getattr(sched_step, "__wrapped__", None) is torch_step:
        # An LR scheduler made before the conversion wrapped the instance's step around torch's class's function.
        opt.step = _tracked_step(opt)
    opt._fastops_loading = [(p, dict(s)) for p, s in opt.state.items()]
    _Fused._load_post_hook(opt)
    return True
