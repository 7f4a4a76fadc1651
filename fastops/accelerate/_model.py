"""The prepared model: wrapping, autocast and precision, and the output hooks that scale the gradient.

The model's ``forward`` (an instance attribute, so the model object, its ``state_dict`` keys and ``isinstance``
checks stay the same; under DDP the DDP wrapper's) runs under autocast and returns floating outputs in fp32.
When the gradient must be scaled (fp16 loss scaling, ``accumulate=k``) each output gets a backward hook that
multiplies the gradient coming into it by ``scale / k``: ``loss.backward()`` then produces exactly what
``scaler.scale(loss / k).backward()`` would, for any loss computed from the outputs. This holds for ``model(x)``
and ``model.forward(x)`` alike, and for outputs that are tensors, possibly nested in lists, tuples, dicts (HF
``ModelOutput``), namedtuples and dataclasses.

An AMP script that keeps its own GradScaler (``scaler.scale(loss).backward(); scaler.step(optimizer);
scaler.update()``, torch's or fastops') runs unchanged under fp16: that scaler's ``scale()`` of a loss computed
from the model's outputs makes it drive that step (its scale, its skip decision, its update), and fastops neither
scales the gradient again nor steps its own scaler (``give_way_to``). This needs accumulate=1 (otherwise that
``scale()`` raises) and a scaler that inherits torch's ``scale`` (FSDP's ShardedGradScaler does not: its step
raises). A step the user's scaler skips for an optimizer fastops does not fuse never reaches
``optimizer.step()``, so ``Accelerator.step`` does not count it."""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import amp
from .._util import map_tensors
from . import _auto, _distributed, _fused_loss

if TYPE_CHECKING:
    from . import Accelerator

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
_OUTPUT_MARK = "fastops.accelerate"  # key in the grad_fn metadata of each hooked output: its Accelerator
_WATCHING: weakref.WeakSet = weakref.WeakSet()  # fp16 Accelerators, told of every other GradScaler's scale()


def _autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    if not torch.amp.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    # torch.autocast warns and disables itself for a dtype the device does not support.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(device_type, dtype=dtype)
    return not caught


def _native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # Without AVX512-BF16/AMX, CPU bf16 matmuls are emulated and slower than fp32.
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(precision: str, device: torch.device) -> tuple[str, torch.dtype | None]:
    """(precision, autocast dtype or None for fp32); "auto" is bf16 where the device computes it natively."""
    if precision == "auto":
        native = _native_bf16(device) and _autocast_supported(device.type, torch.bfloat16)
        precision = "bf16" if native else "fp32"
    dtype = _DTYPES[precision]
    if dtype is not None and not _autocast_supported(device.type, dtype):
        raise ValueError(
            f"fastops.accelerate: precision={precision!r} is not supported by autocast on device "
            f"{device}; use 'bf16', 'fp32' or 'auto'"
        )
    return precision, dtype


class _GradFactor:
    """Backward hook: the gradient arriving at a model output times ``factor`` (scale / k). It records that it
    ran, for the check in the optimizer step, and stands aside inside ``Accelerator.backward``, which has
    scaled the whole loss already."""

    def __init__(self, factor: torch.Tensor, acc: "Accelerator") -> None:
        self.factor = factor
        self.acc = acc

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        state = self.acc._step_state
        state.grads_scaled = True
        if state.exact_backward or state.user_scaler is not None:
            return None
        return grad * self.factor.to(grad.device, grad.dtype)


def prepare_model(acc: "Accelerator", model: nn.Module) -> nn.Module:
    if acc.model is not None:
        raise ValueError("fastops.Accelerator: one model per Accelerator; this one already has a model")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"fastops.accelerate: the model ({type(model).__name__}) has no parameters to train")
    model.to(acc.device)
    acc._names = {id(p): n for n, p in model.named_parameters()}
    acc._inner = model
    if acc.strategy == "pp":
        return _prepare_pipeline(acc, model)
    decision = acc.decision
    acc.fused_head = _auto.decide_fused(acc, model, acc.fused_loss)
    decision.compile, decision.compile_why = _auto.decide_compile(acc, model, acc.compile)
    if decision.compile:
        from . import _compile

        acc._step_state.regions = _compile.compile_regions(model, eager=_auto.region_stays_eager(acc.device))
    _auto.decide_channels_last(acc, model)
    _auto.decide_dropout(acc, model)
    if acc.strategy in ("tp", "fsdp+tp"):
        from . import _parallel

        wrapped = _parallel.parallelize(model, acc.mesh, acc.strategy, acc.tp_plan)
    else:
        wrapped = _distributed.wrap(model, acc.strategy, acc.device)
    _wrap_forward(acc, wrapped)
    acc.model = wrapped
    return wrapped


PLAIN_LOOP_UNDER_PP = (
    "fastops.accelerate: under strategy='pp' the pipeline schedule runs forward and backward itself, so the "
    "model cannot be called in the loop; replace `loss = loss_fn(model(x), y); loss.backward()` with "
    "`loss = acc.train_step((x, y), loss_fn)` (acc = optimizer.accelerator), and keep optimizer.step()")


class PipelineModel(nn.Module):
    """What ``prepare`` returns under strategy="pp": this rank's stage (its parameters, state_dict, train/eval),
    which refuses to be called: the loop runs the schedule through ``Accelerator.train_step``."""

    def __init__(self, pipeline) -> None:
        super().__init__()
        for name, child in pipeline.module.named_children():
            self.add_module(name, child)  # the model's own FQNs: its checkpoint loads into the whole model

    def forward(self, *args, **kwargs):
        raise RuntimeError(PLAIN_LOOP_UNDER_PP)


def _prepare_pipeline(acc: "Accelerator", model: nn.Module) -> nn.Module:
    from . import _parallel

    if acc.scaler is not None or acc.accumulate > 1 or acc.compile is True or acc.fused_loss is True:
        raise ValueError("fastops.accelerate: strategy='pp' supports neither fp16, accumulate > 1, compile nor "
                         "fused_loss yet "
                         "(the schedule's microbatches already accumulate: raise n_microbatches)")
    pipe = _parallel.Pipeline(model, acc.mesh, n_microbatches=acc.n_microbatches, schedule=acc.pp_schedule)
    if acc.amp_dtype is not None:
        inner_forward = pipe.module.forward

        def forward(*args, **kwargs):
            with torch.autocast(acc.device.type, dtype=acc.amp_dtype):
                return inner_forward(*args, **kwargs)

        pipe.module.forward = forward
    acc.pipeline = pipe
    acc.model = PipelineModel(pipe)
    return acc.model


def _wrap_forward(acc: "Accelerator", module: nn.Module) -> None:
    inner_forward = module.forward
    state = acc._step_state

    def forward(mod, *args, **kwargs):
        via_call, state.via_call = state.via_call, False
        ctx = contextlib.nullcontext()
        if acc.accumulate > 1:
            sync = acc.micro_step % acc.accumulate == acc.accumulate - 1
            ctx = _distributed.grad_sync_context(mod, acc.strategy, sync)
        # No autocast(enabled=False) for fp32: it would switch off an autocast region the caller opened.
        amp_ctx = contextlib.nullcontext()
        if acc.amp_dtype is not None:
            amp_ctx = torch.autocast(acc.device.type, dtype=acc.amp_dtype)
        with ctx, amp_ctx:
            out = inner_forward(*args, **kwargs)
        if not acc.decision.logged and mod.training and torch.is_grad_enabled():
            acc.decision.log()
        # model.forward(x) runs no module hooks: its outputs are cast and hooked here instead.
        return out if via_call else _outputs(acc, out)

    module.forward = types.MethodType(forward, module)
    module.register_forward_pre_hook(lambda _mod, _args: setattr(state, "via_call", True))
    # A forward hook registered last runs after DDP's and FSDP2's own output handling (FSDP2 warns when
    # its module returns a view, which the grad hooks below may create).
    module.register_forward_hook(lambda _mod, _args, out: _outputs(acc, out))


def grad_factor(acc: "Accelerator") -> torch.Tensor | None:
    """``scale / k``, what the gradient of the loss is multiplied by; None when that is 1."""
    if acc.scaler is None and acc.accumulate == 1:
        return None
    # The scaler's own tensor when k == 1: GradScaler.update changes it in place, so a backward run after
    # an update (in the next step) uses the scale that step unscales by.
    factor = acc.scaler._scale if acc.scaler is not None else torch.ones((), device=acc.device)
    return factor / acc.accumulate if acc.accumulate > 1 else factor


def _outputs(acc: "Accelerator", out):
    low = acc.amp_dtype is not None
    factor = grad_factor(acc)
    state = acc._step_state
    floating = False

    def fix(t: torch.Tensor) -> torch.Tensor:
        nonlocal floating
        if not t.is_floating_point():
            return t
        floating = True
        if _fused_loss.is_lazy(t):
            # Logits not built (the fused loss): cast as the others, and hooked once something builds them.
            t = t.float() if low and t.dtype in (torch.bfloat16, torch.float16) else t
            return t.then(fix) if factor is not None else t
        if low and t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        elif factor is not None and t.requires_grad:
            # A new node: a hook on the model's own tensor would also scale gradient that reached it
            # through another, already hooked, output.
            t = t.view_as(t)
        if factor is not None and t.requires_grad:
            t.register_hook(_GradFactor(factor, acc))
            t.grad_fn.metadata[_OUTPUT_MARK] = acc
            state.hooked = True
        return t

    out = map_tensors(fix, out)
    if not floating and (low or factor is not None) and not state.warned_outputs:
        state.warned_outputs = True
        scaled = ""
        if factor is not None:
            scaled = (
                ", and gradient through them is not scaled (fp16 loss scale, 1/k of accumulate=k): call "
                "Accelerator.backward(loss) (optimizer.accelerator.backward(loss)) instead of loss.backward(), "
                "or optimizer.step() will raise"
            )
        warnings.warn(
            f"fastops.accelerate: the model returned a {type(out).__name__} with no floating-point tensor that "
            "fastops can see (it looks inside lists, tuples, dicts, namedtuples, dataclasses and what torch's "
            f"pytree knows, such as HF ModelOutput), so its outputs stay as autocast ({acc.precision}) made "
            f"them{scaled}",
            stacklevel=3,
        )
    return out


def check_scaled(acc: "Accelerator", opt: torch.optim.Optimizer) -> None:
    """Before a real step: gradients that all bypassed the scaling would be divided by the loss scale (or
    summed over k micro-batches) without having been multiplied by it, which must not train silently."""
    if acc._step_state.grads_scaled or grad_factor(acc) is None:
        return
    if not any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return
    missing = []
    if acc.scaler is not None:
        missing.append(f"the fp16 loss scale ({acc.scaler.get_scale():g}) the step divides by")
    if acc.accumulate > 1:
        missing.append(f"the 1/{acc.accumulate} of accumulate={acc.accumulate}")
    what = " and ".join(missing)
    raise RuntimeError(
        "fastops.accelerate: optimizer.step() found gradients, but none came through the prepared model's "
        f"outputs since the last step, so they lack {what}. The loss was not computed from what model(...) "
        "returned as fastops sees it (an output container it does not look into, such as a SimpleNamespace, "
        "or a forward run outside the prepared model). Call optimizer.accelerator.backward(loss) "
        "(Accelerator.backward) instead of loss.backward(): it scales the whole loss."
    )


def give_way_to(acc: "Accelerator", scaler: amp._TorchGradScaler, outputs: Any) -> None:
    """``scaler``, a GradScaler that is not ``acc``'s, is scaling ``outputs``. When they were computed from this
    model's hooked outputs, that scaler drives loss scaling until the next real step: the output hooks leave the
    gradient alone (the user's scale is its only one), and ``optimizer.step()``, which that scaler calls with its
    scale and inf flag set on the optimizer (or after unscaling the grads itself), runs the optimizer's own step
    without the Accelerator's scaler. It is decided here, before the backward: seen only at the step, the doubly
    scaled fp16 backward would have overflowed and that step been lost."""
    if not acc._step_state.hooked:
        return
    tensors: list[torch.Tensor] = []
    if isinstance(outputs, (torch.Tensor, list, tuple)):  # not a one-pass iterable, which scale() consumes
        map_tensors(tensors.append, outputs)
    if not any(_from_outputs(acc, t) for t in tensors):
        return
    if acc.accumulate > 1:
        raise RuntimeError(
            f"fastops.accelerate: your {type(scaler).__name__} scales a loss from the prepared model, with "
            f"accumulate={acc.accumulate}: its step() and update() at every optimizer.step() call would change "
            "the scale (and unscale the gradients of optimizers fastops does not fuse) in the middle of an "
            "accumulation cycle. Use accumulate=1 with your GradScaler, or drop it: precision='fp16' scales the "
            "loss itself (loss.backward(); optimizer.step())"
        )
    acc._step_state.user_scaler = scaler


def _from_outputs(acc: "Accelerator", t: torch.Tensor) -> bool:
    """Whether ``t``'s autograd graph reaches an output hooked since the last step. The walk stops there: a
    loss computed from the outputs gets there within a few nodes (at once for an HF ``out.loss``)."""
    stack, seen = [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node.metadata.get(_OUTPUT_MARK) is acc:
            return True
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def watch_user_scalers(acc: "Accelerator") -> None:
    """Has every ``GradScaler.scale`` call (torch's, its deprecated device classes' and fastops', which all
    inherit it) first tell the live fp16 Accelerators, so that a user's own scaler can drive loss scaling
    (``give_way_to``). Installed once per process; a scale call costs a look at each live fp16 Accelerator's
    ``hooked`` flag, and a walk up the scaled loss's graph while one has hooked outputs."""
    _WATCHING.add(acc)
    base = amp._TorchGradScaler
    if hasattr(base.scale, "_fastops_original"):
        return
    original = base.scale

    @functools.wraps(original)
    def scale(self, outputs):
        if self._enabled:
            for watcher in list(_WATCHING):
                if self is not watcher.scaler:
                    give_way_to(watcher, self, outputs)
        return original(self, outputs)

    scale._fastops_original = original
    base.scale = scale
