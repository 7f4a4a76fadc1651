"""Adam and AdamW: the fastops step of torch.optim.Adam/AdamW, in any of the state formats of _state.py, with the
stochastic-rounding seed of bf16 states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _ops
from ._fallback import _local
from ._state import STATE_DTYPES, _fp32_zeros, _moment_format, _new_moments, _state_format, _convert_moments
from .optimizer import _EXTRAS_DOC, Call, _check_scalars, _Fused, _where

# Odd 31-bit constants spreading the step count and the call's salt over the 32 seed bits the op uses; < 2**31 so
# that (count mod 2**32) * constant stays inside int64 under torch.compile, where the count is a SymInt.
_SEED_STEP_MUL = 0x61C88647
_SEED_SALT_MUL = 0x2545F491


@dataclass(slots=True)
class AdamCall(Call):
    """One call of ``adam_step_`` (``fmt`` "fp32") or ``adam_step_lowp_`` ("bf16", "8bit")."""

    exp_avgs: list[Tensor] = field(default_factory=list)  # fp32, bf16 or uint8 codes, by fmt
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[Tensor] = field(default_factory=list)  # fp32 with amsgrad, else empty
    exp_avg_absmax: list[Tensor] = field(default_factory=list)  # 8-bit only
    exp_avg_sq_absmax: list[Tensor] = field(default_factory=list)  # 8-bit only
    steps: list[Tensor] = field(default_factory=list)
    fmt: str = "fp32"  # the state format of every param of the call
    mastered: bool = False  # whether the call's params have fp32 masters


def _check_betas_len(betas, k: int | None = None) -> None:
    # torch's constructor keeps betas[:2] of a longer tuple and its step fails to unpack one in a group.
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {len(betas)} elements: {tuple(betas)}{_where(k)}")


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
        """The op's calls, split by the format of the states (one call of adam_step_ for fp32 states, one of
        adam_step_lowp_ for each low-precision format) and by whether a param has an fp32 master."""
        calls: dict[tuple[str, bool], AdamCall] = {}
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
            call = calls.get(key)
            if call is None:
                call = calls[key] = AdamCall(fmt=fmt, mastered=use_master)
            call.params.append(_local(p))
            call.grads.append(lg)
            call.exp_avgs.append(_local(state["exp_avg"]))
            call.exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            if fmt == "8bit":
                call.exp_avg_absmax.append(state["exp_avg_absmax"])
                call.exp_avg_sq_absmax.append(state["exp_avg_sq_absmax"])
            elif amsgrad:
                call.max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
            call.steps.append(state["step"])
            if use_master:
                call.masters.append(self._master(p, state))
            call.owners.append(p)
        return [calls[key] for key in sorted(calls)]

    def _sr_base(self, work) -> Any:
        """This step's count of steps that drew stochastic-rounding bits (an int, or under torch.compile a SymInt
        read from ``_sr_step`` in the graph), advanced once per step; None when no call of this step has bf16
        states. Read at every step, skipped ones included (whether a GradScaler skips is known only on the
        device): a skipped step writes nothing, so it only moves the next step to other bits."""
        if not any(call.fmt == "bf16" for _, _, calls in work for call in calls):
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
        c: AdamCall = call
        eps, wd = float(group["eps"]), float(group["weight_decay"])
        maximize, decoupled = bool(group["maximize"]), bool(group["decoupled_weight_decay"])
        if c.fmt == "fp32":
            _ops.adam_step_(
                c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.max_exp_avg_sqs, c.steps, c.masters, lr_t, betas[0],
                betas[1], eps, wd, bool(group["amsgrad"]), maximize, decoupled, divisor, found_inf,
            )  # fmt: skip
        else:
            # 8-bit rounds to nearest; bf16 rounds stochastically with this call's seed.
            seed = self._sr_seed(group, sr[0], sr[1], c.mastered) if c.fmt == "bf16" else 0
            _ops.adam_step_lowp_(
                c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.exp_avg_absmax, c.exp_avg_sq_absmax, c.steps,
                c.masters, lr_t, betas[0], betas[1], eps, wd, maximize, decoupled, seed, divisor, found_inf,
            )  # fmt: skip
        if c.masters:
            self._wrote(c.owners)


class Adam(_AdamBase, torch.optim.Adam):
    """torch.optim.Adam with a fused fastops step. Same arguments, plus ``master_weights``: keep an fp32
    copy of bf16/fp16 params in the optimizer state, update it, and write the rounded param in the same pass
    (edits of the param between steps are kept, see fastops/optim/_master.py); and ``max_grad_norm``: clip the
    grads' total 2-norm to it inside the step, with no pass of its own. A Tensor beta is read on the host at every
    step, so in-place changes take effect at the next step; on a GPU that read is a sync.

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



for _cls in (Adam, AdamW):
    _cls.__doc__ += _EXTRAS_DOC
