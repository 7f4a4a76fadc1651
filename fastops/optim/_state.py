"""The optimizer state's formats and the state_dict hooks that keep them.

fastops keeps every state tensor in fp32 on the param's device, except Adam's exp_avg and exp_avg_sq, which follow
the group's ``state_dtype``: ``"fp32"`` (torch's format), ``"bf16"``, or ``"8bit"`` (uint8 codes shaped like the
param plus ``exp_avg_absmax``/``exp_avg_sq_absmax``, fp32, one per 256 elements in memory order; fastops/_quant.py).
``load_state_dict`` checks the saved states (``check_saved``), then converts them, whatever their format, to the
loading optimizer's; ``state_dict`` saves 8-bit states of DTensor params decoded to fp32 DTensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import _quant
from . import _master
from ._fallback import _local, _why_not

# Group keys that torch's optimizers do not have; a torch state_dict loaded into fastops keeps the current value.
_FASTOPS_KEYS = ("master_weights", "max_grad_norm")
# Adam's group keys of the state format. Present in a group only when not fp32 (state_seed: when state_dtype is
# not fp32 or the seed is not 0), so an fp32 state_dict is the one fastops wrote before these existed. They
# describe this optimizer, not a checkpoint: load_state_dict keeps the current values and converts the states.
_LOWP_KEYS = ("state_dtype", "state_seed")
# Saved in bf16 groups of a state_dict only: the count of steps that drew stochastic-rounding bits (see adam.py).
_SR_STEP_KEY = "state_sr_step"
STATE_DTYPES = ("fp32", "bf16", "8bit")
# State tensors that fastops keeps in fp32 on the param's device (exp_avg and exp_avg_sq: unless the group's
# state_dtype says otherwise, see _convert_moments).
_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "master_param")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_ABSMAX = ("exp_avg_absmax", "exp_avg_sq_absmax")


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


def check_saved(saved: dict[str, Any], p: Tensor, where: str) -> None:
    """Raises ValueError, naming the problem, for a saved state that would load as something other than what was
    saved, or poison ``p`` at its next step: a negative or nan step (the bias correction 1 - beta**step goes
    negative or nan: nan params), 8-bit codes that are not uint8 or not shaped like the param, an absmax that is
    missing (a bare KeyError otherwise), not one fp32 per 256 codes, negative (sign-flipped moments that train
    silently) or not finite (nan params), and float moments next to absmax keys (two formats mixed: they would load
    as fp32 moments and the absmax be dropped)."""
    step = saved.get("step")
    if step is not None:
        value = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
        if isinstance(value, (int, float)) and not value >= 0:
            raise ValueError(f"{where}: step is {value}; a step count is a number >= 0")
    absmax_keys = [k for k in _ABSMAX if k in saved]
    moments = {k: saved[k] for k in _MOMENTS if saved.get(k) is not None}
    codes = [k for k, t in moments.items() if t.dtype == torch.uint8]
    if not absmax_keys and not codes:
        return  # fp32 or bf16 moments (or none): any float dtype converts
    for key in _MOMENTS:
        if key not in moments:
            raise ValueError(f"{where}: 8-bit states need both exp_avg and exp_avg_sq; {key} is missing")
    local_shape = tuple(_local(p).shape)
    for key, absmax in zip(_MOMENTS, _ABSMAX):
        t = moments[key]
        if t.dtype != torch.uint8:
            raise ValueError(
                f"{where}: {key} is {t.dtype} next to {', '.join(absmax_keys) or 'uint8 codes'}: 8-bit states are "
                f"uint8 codes with their absmax, so this mixes two formats; save and load one format (or drop the "
                f"absmax keys of float moments)"
            )
        if tuple(_local(t).shape) != local_shape:
            raise ValueError(f"{where}: 8-bit {key} has shape {tuple(_local(t).shape)}; its param's is {local_shape}")
        if absmax not in saved:
            raise ValueError(f"{where}: 8-bit {key} (uint8 codes) needs its {absmax} in the same state; it is missing")
        a = _local(saved[absmax])
        blocks = _quant.n_blocks(math.prod(local_shape))
        if not isinstance(a, Tensor) or a.dtype != torch.float32 or a.dim() != 1 or a.numel() != blocks:
            what = f"{a.dtype} of shape {tuple(a.shape)}" if isinstance(a, Tensor) else type(a).__name__
            raise ValueError(f"{where}: {absmax} must be float32 of shape ({blocks},) (one per 256 codes), got {what}")
        # A host read of the absmax (one per 256 elements): a load is a one-off.
        if not bool(torch.isfinite(a).all()) or not bool((a >= 0).all()):
            bad = a[~(torch.isfinite(a) & (a >= 0))][0].item()
            raise ValueError(
                f"{where}: {absmax} holds {bad}; a block's absmax is a finite number >= 0 (a negative one flips the "
                f"sign of its moments, a nan or inf one makes nan params at the next step)"
            )


def load_pre_hook(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Checks the saved states (nothing has changed yet when it raises) and keeps them aside: torch's
    load_state_dict casts every state tensor to the param's dtype, and fastops keeps fp32 states and fp32 masters
    for bf16/fp16 params, so the post hook restores the originals in fastops' layout."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    who = f"fastops.optim.{type(opt).__name__}.load_state_dict"
    for i, p in zip(saved_ids, params):
        saved = state_dict["state"].get(i)
        if saved:
            check_saved(saved, p, f"{who}: state[{i!r}]")
    opt._fastops_loading = [(p, state_dict["state"].get(i)) for i, p in zip(saved_ids, params)]
    groups = []
    sr_steps = [0]
    for saved, current in zip(state_dict["param_groups"], opt.param_groups):
        extra = {k: current[k] for k in _FASTOPS_KEYS if k not in saved}
        sr_steps.append(int(saved.get(_SR_STEP_KEY, 0)))
        saved = {k: v for k, v in saved.items() if k not in _LOWP_KEYS and k != _SR_STEP_KEY}
        # The state format is this optimizer's (the post hook converts the saved states to it).
        extra.update({k: current[k] for k in _LOWP_KEYS if k in current})
        groups.append({**saved, **extra})
    # Applied by the post hook: torch's load_state_dict calls __setstate__, which makes a new _sr_step.
    opt._fastops_sr_loading = max(sr_steps)
    return {**state_dict, "param_groups": groups}


def state_dict_post_hook(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    # 8-bit states of DTensor params (FSDP2 shards, TP) are saved decoded to fp32 DTensors with the param's
    # placements: codes are only meaningful with their block's absmax, and the 256-element blocks are cut
    # inside each local shard, so a resharded load would pair codes with another block's absmax. The load
    # re-encodes them in the loading optimizer's format on its own shards (README, "8-bit and bf16 Adam states").
    # torch's state_dict shares the per-param dicts with opt.state: replaced, not edited.
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        st = state_dict["state"].get(i)
        if st is not None and _is_dtensor(p) and "exp_avg" in st and _moment_format(st) == "8bit":
            st = {k: v for k, v in st.items() if k not in _ABSMAX}
            m, v = moments_fp32(opt.state[p])
            st["exp_avg"], st["exp_avg_sq"] = _like_param(m, p), _like_param(v, p)
            state_dict["state"][i] = st
    # The stochastic-rounding step count goes with the bf16 groups, so a resumed run draws the bits the
    # uninterrupted one would have (a host read of a CPU tensor: no device sync).
    if any(g.get("state_dtype") == "bf16" for g in state_dict["param_groups"]):
        n = int(opt._sr_step)
        for g in state_dict["param_groups"]:
            if g.get("state_dtype") == "bf16":
                g[_SR_STEP_KEY] = n
    return state_dict


def to_fp32_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (a fastops ``state_dict()``) with every exp_avg/exp_avg_sq decoded to fp32 (their absmax dropped)
    and without the state-format keys."""
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


def load_post_hook(opt) -> None:
    """Puts each (param, saved state) of ``opt._fastops_loading`` into fastops' layout: fp32 states and master, a
    float32 step on the param's device, the moments in the group's state format. Params the kernels do not take
    keep torch's layout (their group runs torch's step). ``fuse_`` calls it to convert torch's own state."""
    loading = opt.__dict__.pop("_fastops_loading", [])
    opt._sr_step.fill_(opt.__dict__.pop("_fastops_sr_loading", 0))
    if opt.defaults.get("differentiable", False):  # every group runs torch's step
        return
    owner = {p: group for group in opt.param_groups for p in group["params"]}
    for p, saved in loading:
        if not saved or _why_not(p) is not None:
            continue
        state = opt.state[p]
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
        _master.keep_or_rebuild(state, p)
        if "step" in saved:
            step = saved["step"]
            step = step if isinstance(step, Tensor) else torch.tensor(float(step))
            state["step"] = step.to(device=_local(p).device, dtype=torch.float32)
