"""The fused loss: an HF model's training loss through ``fastops.linear_cross_entropy``, the logits built only when
something reads them.

The output embedding (``model.get_output_embeddings()``, a plain ``nn.Linear``) returns, while the model runs in
training with ``labels``, a stand-in for its logits (``_Logits``) that holds the hidden states, weight and bias.
The stand-in answers shape, dtype and device questions, follows ``.float()``, ``.view``/``.reshape`` that keep
the vocabulary last and ``.contiguous()``, and turns ``F.cross_entropy`` (so also ``nn.CrossEntropyLoss``, HF's
``ForCausalLMLoss`` and ``ForMaskedLMLoss``) into the fused op on the same rows. Anything else done to it
(soft-capping, scaling, slicing the vocabulary, class weights, ``argmax``, printing) builds the real logits there,
with the head's own casts and ``F.linear``, once: slower, never different. So the model's ``out.logits`` is the
stand-in: a loop that reads it (accuracy, ``argmax``, logging) gets the real logits and pays for them then, and
one that does not never builds them. Without labels, in eval mode, or with grad disabled the model runs as before.

Models whose head does more than the linear map before the loss are left unfused: the configs that say so (Gemma
2's ``final_logit_softcapping``, Cohere's ``logit_scale``) are recognised; other unforeseen operations still land
in the real-logits path above. A head whose weight is a DTensor (TP-sharded vocabulary) takes the real-logits path
too. With a rule (fused_loss="auto", ``fastops.accelerate._auto``) the first loss call decides, from its shapes
and label count, whether the fused op or the head's own loss runs from then on."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._specs.linear_ce import master_weight

_ACTIVE = threading.local()  # set while a prepared model's forward runs with labels in training
_META = {"size", "dim", "numel", "__len__", "is_floating_point", "get_device", "is_contiguous", "stride"}
_PROPERTIES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "is_sparse"}
# HF config fields that put an operation between the linear map and the loss.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


class _Logits(torch.Tensor):
    """Stands for ``F.linear(x, weight, bias).to(dtype)``, the linear map computed in ``compute`` (the dtype autocast
    gave the head's matmul), or for a cast, reshape or ``then(fn)`` of another stand-in (``_parent``); its storage
    is one element, expanded. The real tensor is built by the first operation that needs its values, then kept
    (``materialize``)."""

    @staticmethod
    def __new__(cls, x, weight, bias, dtype, compute=None, owner=None):
        shape = (*x.shape[:-1], weight.shape[0])
        stand = torch.Tensor._make_subclass(cls, torch.zeros((), dtype=dtype, device=x.device).expand(shape))
        stand._parts = (x, weight, bias)
        stand._compute = compute or x.dtype
        stand._post = ()  # set on a stand-in made by then(): no fused loss, lazy cast or view on it
        stand._real = None
        stand._owner = owner  # the FusedHead that made it, or None
        stand._parent = None  # (stand-in, fn) when this one is fn(that one's logits)
        if any(t is not None and t.is_leaf and t.requires_grad for t in (weight, bias)):
            _UNCAST.add(stand)  # the head's own params: an optimizer step would change them (_before_step)
        return stand

    def materialize(self) -> torch.Tensor:
        if self._real is None and self._parent is not None:  # a cast or reshape of another stand-in: built from it
            parent, fn = self._parent
            with torch._C.DisableTorchFunctionSubclass():
                self._real = fn(parent.materialize())
        if self._real is None:
            x, weight, bias = self._parts
            c = self._compute
            with torch._C.DisableTorchFunctionSubclass():
                # Outside autocast too: the same casts and bf16 matmul autocast gave the model's own head.
                with torch.autocast(x.device.type, enabled=False):
                    real = F.linear(x.to(c), weight.to(c), None if bias is None else bias.to(c)).to(self.dtype)
            self._real = real
        return self._real

    def then(self, fn) -> "_Logits":
        """A stand-in for ``fn(real)``, built when this one is."""
        if self._real is not None:
            return fn(self._real)
        like = self._like(fn)
        like._post = (fn,)
        return like

    def _like(self, fn, x=None, dtype=None) -> "_Logits":
        """A stand-in for ``fn(real)``, a cast or reshape: built from this one's logits, so both cost one matmul."""
        x0, weight, bias = self._parts
        like = _Logits(x0 if x is None else x, weight, bias, dtype or self.dtype, self._compute, owner=self._owner)
        like._parent = (self, fn)
        return like

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
                if prop == "requires_grad" and stand._real is None:
                    return any(t is not None and t.requires_grad for t in stand._parts)
            if name in _META:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if stand._real is None and not stand._post:
                if name == "float" or (name == "to" and _only_dtype(args[1:], kwargs)):
                    dtype = torch.float32 if name == "float" else _only_dtype(args[1:], kwargs)
                    return stand._like(lambda real: real.to(dtype), dtype=dtype)
                if name == "contiguous":
                    return stand
                if name in ("view", "reshape"):
                    shaped = _reshape(stand, args[1:])
                    if shaped is not None:
                        return shaped
        if func in (F.cross_entropy, torch.nn.functional.cross_entropy) and stand is not None and stand._real is None \
                and not stand._post:
            fused = _cross_entropy(stand, *args[1:], **kwargs)
            if fused is not None:
                return fused
        args, kwargs = torch.utils._pytree.tree_map_only(_Logits, _Logits.materialize, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# Stand-ins hold the head's params themselves, uncast (the fused op casts fp32 master weights itself, a block at a
# time): before any optimizer step changes those in place, they take a copy in the dtype their logits are computed
# in, so logits read after optimizer.step() are still the ones of their forward.
_UNCAST: weakref.WeakSet = weakref.WeakSet()
_hooked = []


def _before_step(optimizer, args, kwargs) -> None:
    copies: dict = {}  # one copy per param and dtype, shared by the stand-ins over it

    def copy(t, dtype):
        if t is not None and (id(t), dtype) not in copies:
            copies[id(t), dtype] = t.detach().to(dtype, copy=True)
        return None if t is None else copies[id(t), dtype]

    for stand in list(_UNCAST):
        if stand._real is None:
            x, weight, bias = stand._parts
            stand._parts = (x, copy(weight, stand._compute), copy(bias, stand._compute))
    _UNCAST.clear()


# Not a watcher of the step calls (fastops.amp._step_is_watched): it runs on skipped steps too, harmlessly, so
# fastops' scaler keeps handing the skip to the step instead of reading the grads' finiteness on the host.
_before_step._fastops_hook = True


def is_lazy(t) -> bool:
    """Whether ``t`` is logits not built yet (a fused-loss model's ``out.logits`` in training)."""
    return isinstance(t, _Logits) and t._real is None


def _only_dtype(args, kwargs):
    if len(args) == 1 and isinstance(args[0], torch.dtype) and not kwargs:
        return args[0]
    if not args and set(kwargs) == {"dtype"}:
        return kwargs["dtype"]
    return None


def _reshape(stand: _Logits, shape_args):
    one = len(shape_args) == 1 and isinstance(shape_args[0], (tuple, list, torch.Size))
    shape = shape_args[0] if one else shape_args
    if not shape or not all(isinstance(s, int) for s in shape) or shape[-1] != stand.shape[-1]:
        return None
    shape = tuple(shape)
    x = stand._parts[0]
    return stand._like(lambda real: real.reshape(shape), x=x.reshape(*shape[:-1], x.shape[-1]))


def _cross_entropy(stand: _Logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    from .._lce import linear_cross_entropy

    x, w, b = stand._parts
    if (weight is not None or size_average is not None or reduce is not None or stand.dim() != 2
            or target.dtype != torch.long or target.dim() != 1 or isinstance(w, torch.distributed.tensor.DTensor)):
        return None
    owner = stand._owner
    if owner is not None and owner.mode is None:
        owner.decide(rows=target.numel(), labeled=int((target != ignore_index).sum()), vocab=w.shape[0],
                     hidden=w.shape[1], device=x.device, dtype=stand._compute)
    mode = "fused" if owner is None else owner.mode
    if mode == "eager":
        return None
    dtype = stand._compute  # what F.linear would have computed in
    cast = (lambda t: t if t is None or t.dtype == dtype else t.to(dtype))
    if mode == "compiled":
        return _compiled_cross_entropy(owner, cast(x), cast(w), cast(b), target, ignore_index, reduction,
                                       label_smoothing)
    x = cast(x)
    if not (master_weight(x, w) and (b is None or b.dtype == w.dtype)):
        w, b = cast(w), cast(b)
    # fp32 master weights go in uncast: the op casts them a block at a time, and its grad_weight (fp32) becomes the
    # param's .grad as it is. autocast's cast would hold a bf16 copy of the weight, the op a bf16 grad_weight until
    # the backward, and the backward a cast of that back to fp32: on the Llama benchmark (train_cases.py, 1 thread,
    # AMD Zen 5) they held 31 MiB of the step's peak.
    # The loss is what cross_entropy gives on logits rounded to stand.dtype: the op's row pass runs in fp32 on
    # logits rounded to the matmul dtype, which is stand.dtype or finer (HF upcasts to fp32 before the loss).
    # cross_entropy runs in fp32 under autocast, and otherwise returns its logits' dtype (fp32 where HF upcasts).
    out_dtype = torch.float32 if torch.is_autocast_enabled(x.device.type) else stand.dtype
    return linear_cross_entropy(x, w, target, bias=b, ignore_index=ignore_index,
                                reduction=reduction, label_smoothing=label_smoothing, out_dtype=out_dtype)


def unfusable(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be fused (None when it can): its head must be a plain ``nn.Linear`` output
    embedding with nothing between it and the loss."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None and not hasattr(model, "get_output_embeddings"):
        return "not an HF transformers model with an output embedding"
    if type(head) is not nn.Linear:
        return f"its output embedding is {type(head).__name__ if head is not None else 'missing'}, not nn.Linear"
    config = getattr(model, "config", None)
    extras = [f for f in _HEAD_EXTRAS if getattr(config, f, None) not in (None, 1, 1.0)]
    if extras:
        return f"its head does more than a linear map before the loss ({', '.join(extras)})"
    return None


def _linear_cross_entropy(x, weight, bias, target, ignore_index, reduction, label_smoothing):
    with torch.autocast(x.device.type, enabled=False):  # x and weight come cast: the head's matmul dtype
        logits = F.linear(x, weight, bias).float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)


_compiled: dict = {}  # backend -> the compiled loss


def _compiled_cross_entropy(owner, x, weight, bias, target, ignore_index, reduction, label_smoothing):
    """The head's own loss (its matmul, the fp32 upcast, cross_entropy) compiled by inductor, which fuses the upcast,
    log-softmax and loss of the forward and their backward into a few passes over the logits; where it fails to
    compile, eager from then on, with one warning."""
    from ._compile import BACKEND

    args = (x, weight, bias, target, ignore_index, reduction, label_smoothing)
    if BACKEND not in _compiled:
        _compiled[BACKEND] = torch.compile(_linear_cross_entropy, backend=BACKEND)
    try:
        return _compiled[BACKEND](*args)
    except torch._dynamo.exc.TorchDynamoException as e:
        owner.mode = "eager"
        warnings.warn(f"fastops.accelerate: compiling the loss failed, so it runs eagerly ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", RuntimeWarning, stacklevel=3)
        return _linear_cross_entropy(*args)


class FusedHead:
    """The fused loss of one model. ``mode``: "fused" (the fused op), "compiled" (the head's own loss, compiled),
    "eager" (the head's own logits and loss, as without fastops), None while ``rule`` has yet to decide at the
    first fusable loss call: ``rule(rows, labeled, vocab, hidden, device)`` returns (mode, reason). Except under
    "eager", out.logits is built only when read."""

    def __init__(self, model: nn.Module, rule=None) -> None:
        self.mode = None if rule is not None else "fused"
        self.rule = rule
        self.reason = "" if rule is not None else "fused_loss=True"
        self.listeners: list = []  # called once the rule has decided
        head = model.get_output_embeddings()
        head_forward = head.forward
        owner = self

        def forward(self, x):
            if getattr(_ACTIVE, "on", False) and torch.is_grad_enabled() and owner.mode != "eager":
                if torch.is_autocast_enabled(x.device.type):
                    dtype = torch.get_autocast_dtype(x.device.type)
                else:
                    dtype = torch.promote_types(x.dtype, self.weight.dtype)
                # The params uncast: the fused op takes fp32 ones as they are, the rest casts where it is used.
                return _Logits(x, self.weight, self.bias, dtype, dtype, owner=owner)
            return head_forward(x)

        head.forward = types.MethodType(forward, head)
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hooked.append(register_optimizer_step_pre_hook(_before_step))
        model_forward = model.forward

        @functools.wraps(model_forward)
        def model_fused_forward(*args, **kwargs):
            if not (model.training and kwargs.get("labels") is not None and owner.mode != "eager"):
                return model_forward(*args, **kwargs)
            with _active():
                out = model_forward(*args, **kwargs)
            return _built(out) if owner.mode == "eager" else out

        model.forward = model_fused_forward

    def decide(self, **shapes) -> None:
        self.mode, self.reason = self.rule(**shapes)
        for fn in self.listeners:
            fn(self)


def _built(out):
    """The outputs of the call in which the rule chose the head's own loss: the logits it built, as plain tensors."""
    real = (lambda v: v.materialize() if isinstance(v, _Logits) else v)
    if isinstance(out, dict):
        for k, v in list(out.items()):
            if isinstance(v, _Logits):
                out[k] = real(v)  # ModelOutput's __setitem__ sets the attribute too
        return out
    if isinstance(out, tuple) and any(isinstance(v, _Logits) for v in out):
        return type(out)(real(v) for v in out) if type(out) is tuple else type(out)(*map(real, out))
    return out


def install(model: nn.Module, rule=None) -> FusedHead | None:
    """Make ``model``'s training loss fused (with ``rule``: where the rule says so at the first loss); None (with
    a warning giving the reason, unless a rule asked) where it cannot be."""
    reason = unfusable(model)
    if reason:
        if rule is None:
            warnings.warn(f"fastops.accelerate(fused_loss=True): {type(model).__name__} is left unfused: {reason}",
                          stacklevel=3)
        return None
    return FusedHead(model, rule)


@contextlib.contextmanager
def _active():
    before = getattr(_ACTIVE, "on", False)
    _ACTIVE.on = True
    try:
        yield
    finally:
        _ACTIVE.on = before
