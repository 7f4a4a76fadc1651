"""``fused_loss=True``: an HF model's training loss through ``fastops.linear_cross_entropy``, never the logits.

The output embedding (``model.get_output_embeddings()``, a plain ``nn.Linear``) returns, while the model runs in
training with ``labels``, a stand-in for its logits (``_Logits``) that holds the hidden states, weight and bias.
The stand-in answers shape, dtype and device questions, follows ``.float()``, ``.view``/``.reshape`` that keep
the vocabulary last and ``.contiguous()``, and turns ``F.cross_entropy`` (so also ``nn.CrossEntropyLoss``, HF's
``ForCausalLMLoss`` and ``ForMaskedLMLoss``) into the fused op on the same rows. Anything else done to it
(soft-capping, scaling, slicing the vocabulary, class weights) gets the real logits, computed there by the layer's
own ``F.linear``: slower, never different. The model's ``out.logits`` is then None (the point is not to build
them); without labels, in eval mode, or with grad disabled the model runs as before.

Models whose head does more than the linear map before the loss are left unfused, with a warning: the configs
that say so (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``) are recognised; other unforeseen
operations still land in the real-logits path above. A head whose weight is a DTensor (TP-sharded vocabulary)
takes the real-logits path too."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

_ACTIVE = threading.local()  # set while a prepared model's forward runs with labels in training
_META = {"size", "dim", "numel", "__len__", "is_floating_point", "get_device", "is_contiguous", "stride"}
_PROPERTIES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "is_sparse"}
# HF config fields that put an operation between the linear map and the loss.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


class _Logits(torch.Tensor):
    """Stands for ``F.linear(x, weight, bias).to(dtype)``; its storage is one element, expanded."""

    @staticmethod
    def __new__(cls, x, weight, bias, dtype):
        shape = (*x.shape[:-1], weight.shape[0])
        stand = torch.Tensor._make_subclass(cls, torch.zeros((), dtype=dtype, device=x.device).expand(shape))
        stand._parts = (x, weight, bias)
        return stand

    def materialize(self) -> torch.Tensor:
        x, weight, bias = self._parts
        return F.linear(x, weight, bias).to(self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stand = args[0] if args and isinstance(args[0], _Logits) else None
        if stand is not None:
            if name == "__get__" and getattr(func, "__self__", None) is not None:
                prop = func.__self__.__name__
                if prop in _PROPERTIES:
                    with torch._C.DisableTorchFunctionSubclass():
                        return func(*args, **kwargs)
                if prop == "requires_grad":
                    return any(t is not None and t.requires_grad for t in stand._parts)
            if name in _META:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if name == "float" or (name == "to" and _only_dtype(args[1:], kwargs)):
                dtype = torch.float32 if name == "float" else _only_dtype(args[1:], kwargs)
                return _Logits(*stand._parts, dtype)
            if name == "contiguous":
                return stand
            if name in ("view", "reshape"):
                shaped = _reshape(stand, args[1:])
                if shaped is not None:
                    return shaped
        if func in (F.cross_entropy, torch.nn.functional.cross_entropy) and stand is not None:
            fused = _cross_entropy(stand, *args[1:], **kwargs)
            if fused is not None:
                return fused
        args, kwargs = torch.utils._pytree.tree_map_only(_Logits, _Logits.materialize, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _only_dtype(args, kwargs):
    if len(args) == 1 and isinstance(args[0], torch.dtype) and not kwargs:
        return args[0]
    if not args and set(kwargs) == {"dtype"}:
        return kwargs["dtype"]
    return None


def _reshape(stand: _Logits, shape_args):
    shape = shape_args[0] if len(shape_args) == 1 and isinstance(shape_args[0], (tuple, list, torch.Size)) else shape_args
    if not shape or not all(isinstance(s, int) for s in shape) or shape[-1] != stand.shape[-1]:
        return None
    x, weight, bias = stand._parts
    return _Logits(x.reshape(*shape[:-1], x.shape[-1]), weight, bias, stand.dtype)


def _cross_entropy(stand: _Logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    from .._lce import linear_cross_entropy

    x, w, b = stand._parts
    if (weight is not None or size_average is not None or reduce is not None or stand.dim() != 2
            or target.dtype != torch.long or target.dim() != 1 or isinstance(w, torch.distributed.tensor.DTensor)):
        return None
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)  # what F.linear would have computed in
    else:
        dtype = torch.promote_types(x.dtype, w.dtype)
    cast = (lambda t: t if t is None or t.dtype == dtype else t.to(dtype))
    # The loss is what cross_entropy gives on logits rounded to stand.dtype: the op's row pass runs in fp32 on
    # logits rounded to the matmul dtype, which is stand.dtype or finer (HF upcasts to fp32 before the loss).
    # cross_entropy runs in fp32 under autocast, and otherwise returns its logits' dtype (fp32 where HF upcasts).
    out_dtype = torch.float32 if torch.is_autocast_enabled(x.device.type) else stand.dtype
    return linear_cross_entropy(cast(x), cast(w), target, bias=cast(b), ignore_index=ignore_index,
                                reduction=reduction, label_smoothing=label_smoothing, out_dtype=out_dtype)


def install(model: nn.Module) -> bool:
    """Make ``model``'s training loss fused; False (with a warning giving the reason) where it cannot be."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    reason = None
    if type(head) is not nn.Linear:
        reason = f"its output embedding is {type(head).__name__ if head is not None else 'missing'}, not nn.Linear"
    else:
        extras = [f for f in _HEAD_EXTRAS if getattr(config, f, None) not in (None, 1, 1.0)]
        if extras:
            reason = f"its head does more than a linear map before the loss ({', '.join(extras)})"
    if reason:
        warnings.warn(f"fastops.accelerate(fused_loss=True): {type(model).__name__} is left unfused: {reason}",
                      stacklevel=3)
        return False
    head_forward = head.forward

    def forward(self, x):
        if getattr(_ACTIVE, "on", False) and torch.is_grad_enabled():
            return _Logits(x, self.weight, self.bias, x.dtype if not torch.is_autocast_enabled(x.device.type)
                           else torch.get_autocast_dtype(x.device.type))
        return head_forward(x)

    head.forward = types.MethodType(forward, head)
    model_forward = model.forward

    @functools.wraps(model_forward)
    def model_fused_forward(*args, **kwargs):
        if not (model.training and kwargs.get("labels") is not None):
            return model_forward(*args, **kwargs)
        with _active():
            out = model_forward(*args, **kwargs)
        return _drop_logits(out)

    model.forward = model_fused_forward
    return True


def _drop_logits(out):
    # HF's ModelOutput keeps a key set to None (setattr changes only the attribute), so build it again.
    if isinstance(out, dict) and any(isinstance(v, _Logits) for v in out.values()):
        return type(out)(**{k: v for k, v in out.items() if not isinstance(v, _Logits)})
    if isinstance(out, tuple) and any(isinstance(v, _Logits) for v in out):
        return type(out)(None if isinstance(v, _Logits) else v for v in out)
    return out


@contextlib.contextmanager
def _active():
    before = getattr(_ACTIVE, "on", False)
    _ACTIVE.on = True
    try:
        yield
    finally:
        _ACTIVE.on = before
